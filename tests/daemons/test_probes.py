"""GET /livez and /readyz of real daemons: a stopped process (SIGSTOP) fails the probe, a server down makes
its workers not ready, naming it; both recover."""

from __future__ import annotations

import signal
import socket
import time
import urllib.error
import urllib.request
from typing import Callable

import pytest

import rank_programs as rp
from harness import run_ranks, start_cluster, write_config

PROBE_TIMEOUT_S = 1.0  # as a Kubernetes probe's timeoutSeconds: no answer within it is a failure


def _probe(address: tuple[str, int], path: str) -> tuple[int, str]:
    """(status, body); (0, why) when no answer came within PROBE_TIMEOUT_S."""
    try:
        with urllib.request.urlopen(f"http://{address[0]}:{address[1]}{path}", timeout=PROBE_TIMEOUT_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, socket.timeout, TimeoutError) as exc:
        return 0, str(exc)


def _until(what: Callable[[], tuple[int, str]], want: Callable[[tuple[int, str]], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not want(got := what()):
        assert time.monotonic() < deadline, f"still {got} after {timeout} s"
        time.sleep(0.1)


@pytest.fixture
def cluster(tmp_path):
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, metrics=True))
    try:
        yield cluster
    finally:
        for child in cluster.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGCONT)  # a stopped daemon cannot take its SIGTERM
        cluster.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("label", ["worker-0", "server-2"])
def test_a_stopped_daemon_fails_livez_and_passes_again_once_continued(cluster, label):
    kind, ident = label.split("-")
    spec = cluster.config.worker(int(ident)) if kind == "worker" else cluster.config.server(int(ident))
    assert spec.metrics is not None
    _until(lambda: _probe(spec.metrics, "/readyz"), lambda got: got == (200, "ready\n"), timeout=10)
    assert _probe(spec.metrics, "/livez") == (200, "ok\n")
    cluster.kill(label, signal.SIGSTOP)
    try:
        code, why = _probe(spec.metrics, "/livez")
        assert code == 0 and "timed out" in why, (code, why)  # the probe's timeout: a failure
        assert _probe(spec.metrics, "/readyz")[0] == 0
    finally:
        cluster.kill(label, signal.SIGCONT)
    _until(lambda: _probe(spec.metrics, "/livez"), lambda got: got == (200, "ok\n"), timeout=10)
    assert _probe(spec.metrics, "/readyz") == (200, "ready\n")


@pytest.mark.timeout(90)
def test_workers_readyz_names_a_server_that_is_down_until_it_is_back(cluster):
    workers = cluster.config.worker_specs
    victim = cluster.config.server(1)
    for w in workers:
        _until(lambda: _probe(w.metrics, "/readyz"), lambda got: got == (200, "ready\n"), timeout=10)
    cluster.kill("server-1")
    down = (503, f"not connected to server 1 at {victim.address}\n")
    for w in workers:
        _until(lambda: _probe(w.metrics, "/readyz"), lambda got: got == down, timeout=10)
        assert _probe(w.metrics, "/livez") == (200, "ok\n")  # alive: only not ready
    for sid in (0, 2):  # the other servers serve on
        assert _probe(cluster.config.server(sid).metrics, "/readyz") == (200, "ready\n")
    cluster.restart("server-1")
    for w in workers:
        _until(lambda: _probe(w.metrics, "/readyz"), lambda got: got == (200, "ready\n"), timeout=15)
    # and the cluster sums again through the restarted server
    cases = [("after", "float32", (300_000,), False, 3)]
    assert all(r[0]["exact"] for r in run_ranks(cluster, rp.sum_cases, cases))
