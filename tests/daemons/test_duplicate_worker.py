"""Two worker daemons with the same id (a stale service unit beside a manual start, issue 14 item 6): the
servers refuse the second one, naming the worker, where each daemon connects from and its epoch; the first
keeps working, and the second fails its operations at once with that message instead of a reconnect storm."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rank_programs as rp
from harness import daemon_logs, run_ranks, start_cluster, write_config

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 10.0

# One push_pull through the daemon at argv[1]; prints the error it gets (or "ok") and how long it took.
ONE_PUSH = """
import json, sys, time
import numpy as np
import bps_worker.client as bps
bps.init(socket=sys.argv[1], local_rank=0, timeout=60)
start = time.monotonic()
try:
    bps.push_pull(np.ones(4, np.float32), sys.argv[2])
    out = {"error": None}
except bps.BPSError as exc:
    out = {"error": type(exc).__name__, "message": str(exc), "peer": getattr(exc, "peer", "")}
out["seconds"] = time.monotonic() - start
print(json.dumps(out))
bps.shutdown()
"""


def _one_push(sock: str, name: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", ONE_PUSH, sock, name], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(REPO))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the second daemon exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "the second daemon did not start"
        time.sleep(0.1)


@pytest.mark.timeout(240)
def test_a_second_daemon_with_a_workers_id_is_refused_and_named(tmp_path):
    # Small partitions: the first job's tensor has partitions on every server, so that worker 0's daemon
    # is connected to all three before the second daemon appears.
    path = write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"timeout": TIMEOUT_S, "partition_bytes": 1024})
    cluster = start_cluster(path)
    second = None
    try:
        for reports in zip(*run_ranks(cluster, rp.sum_cases, [("first", "float32", (16384,), True, 1)])):
            assert all(r["exact"] for r in reports)
        sock, log = tmp_path / "second.sock", tmp_path / "second-worker-0.log"
        with open(log, "w") as err:
            started = time.monotonic()
            second = subprocess.Popen([sys.executable, "-m", "bps_worker", "--config", str(path), "--id", "0",
                                       "--socket", str(sock), "--log-level", "info"], stderr=err, cwd=str(REPO))
        _wait_for(sock, second, log)

        refused = _one_push(str(sock), "second.x")
        assert refused["error"] == "BPSConnectionError", refused
        message = refused["message"]
        holder = re.search(r"worker 0 is already served by another daemon, connected from 127\.0\.0\.1:(\d+) "
                           r"\(daemon ([0-9a-f]{16}), epoch ([0-9a-f]{16})\)", message)
        assert holder, message
        assert re.search(r"refusing this second daemon of worker 0 from 127\.0\.0\.1:\d+ \(daemon [0-9a-f]{16}, "
                         r"epoch [0-9a-f]{16}\)", message), message
        assert refused["seconds"] < TIMEOUT_S, refused  # at once, not after a reconnect window
        # Again: refused as fast, from the link's memory of the refusal (no new attempt within the timeout).
        again = _one_push(str(sock), "second.y")
        assert again["error"] == "BPSConnectionError" and holder.group(2) in again["message"], again

        # The first daemon was never disturbed, and still sums.
        for reports in zip(*run_ranks(cluster, rp.sum_cases, [("during", "float32", (16384,), True, 2)])):
            assert all(r["exact"] for r in reports)
        server_logs = daemon_logs(cluster)
        assert "worker 0 reconnected" not in server_logs, server_logs
        assert re.search(r"server \d: worker 0 is already served by another daemon, connected from 127\.0\.0\.1:"
                         + holder.group(1), server_logs), server_logs
        refusals = len(re.findall(r"refusing this second daemon of worker 0", server_logs))
        # One attempt per link (3 servers) at start, then at most one per link a timeout: no storm.
        assert 1 <= refusals <= 3 * (1 + int((time.monotonic() - started) / TIMEOUT_S)), server_logs
        second_log = log.read_text()
        assert re.search(r"ERROR .*server \d at 127\.0\.0\.1:\d+ refused the connection: worker 0 is already served "
                         r"by another daemon", second_log), second_log[-3000:]
    finally:
        if second is not None:
            second.terminate()
            second.wait(timeout=30)
        cluster.stop()
