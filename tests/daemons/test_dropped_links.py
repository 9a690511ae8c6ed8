"""TCP connections between worker daemons and a Summation Service that break (the kernel resets them) while
the daemons and the training processes live on: what was in flight fails, on every machine, never a hang,
and later steps are exact."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import fault_programs as fp
from harness import run_ranks, server_stats, start_cluster, write_config

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ss") is None,
                                reason="destroying another process's sockets needs root and ss -K")


def _connections(cluster, server: int, workers: list[int]) -> list[int]:
    """The local ports of daemons ``worker-N``'s (N in ``workers``) established connections to ``server``."""
    pids = {cluster.supervisor.daemon(f"worker-{w}").proc.pid for w in workers}
    port = cluster.config.servers[server].port
    listing = subprocess.run(["ss", "-tnpH", "state", "established", "dport", "=", f":{port}"],
                             capture_output=True, text=True, check=True).stdout
    return [int(m.group(1)) for line in listing.splitlines() if any(f"pid={pid}," in line for pid in pids)
            if (m := re.search(r":(\d+)\s+\S+:\d+\s", line))]


def _drop(cluster, server: int, worker: int) -> int:
    """Reset daemon ``worker-N``'s connections to ``server`` (``ss -K``: the kernel resets them); how many
    there were."""
    port = cluster.config.servers[server].port
    ports = _connections(cluster, server, [worker])
    for local in ports:
        subprocess.run(["ss", "-K", "state", "established", "dport", "=", f":{port}", "sport", "=", f":{local}"],
                       capture_output=True, check=True)
    return len(ports)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("count", [100_000], ids=["unfused"])
def test_every_connection_to_a_server_dropped_fails_the_round_for_the_late_peer_too(tmp_path, count):
    """Worker 0 has pushed round 0 of a name, worker 1 not yet, when both lose their connection to the
    server, worker 1's first: the server fails the round, and worker 0 hears it. Worker 1 pushes round 0 only
    after both reconnected: it must fail too, at once, since worker 0 gave the round up. Before the fix the
    server took the two dropped connections for the job's end (every worker reset) and forgot the round's
    failure: worker 1's push opened round 0 afresh and waited for worker 0 for ever (fault_soak.py, seed
    208 with --kinds drop-all,kill-cpu: a hang)."""
    path = write_config(tmp_path, [1, 1], colocated=False, cpu_servers=1, cluster={"timeout": 4.0})
    cluster = start_cluster(path)
    go, done = str(tmp_path / "go"), str(tmp_path / "done")
    try:
        results: list = []
        job = threading.Thread(target=lambda: results.append(run_ranks(
            cluster, fp.late_peer_then_steps, "big", count, go, done, 3, 15.0, timeout=90)))
        job.start()
        deadline = time.monotonic() + 30
        while not server_stats(cluster, only=0)[0]["rounds_open"]:
            assert time.monotonic() < deadline, "worker 0's push never reached the server"
            time.sleep(0.01)
        # Worker 1's connection drops first (the server fails the round, and tells worker 0), then worker 0's,
        # before worker 1 reconnected (it is frozen meanwhile, so that the order is sure). Both must be connected
        # when it is frozen (on a loaded box, 4 s of a link's silence make it reconnect).
        while len(_connections(cluster, 0, [0, 1])) < 2:
            assert time.monotonic() < deadline, "the workers are not both connected to the server"
            time.sleep(0.01)
        cluster.kill("worker-1", signal.SIGSTOP)
        try:
            assert _drop(cluster, 0, 1) == 1
            time.sleep(0.3)
            assert _drop(cluster, 0, 0) == 1
            time.sleep(0.3)
        finally:
            cluster.kill("worker-1", signal.SIGCONT)
        while len(_connections(cluster, 0, [0, 1])) < 2:
            assert time.monotonic() < deadline, "the workers never reconnected"
            time.sleep(0.01)
        time.sleep(0.2)
        open(go, "w").close()
        job.join()
    finally:
        open(go, "a").close()
        cluster.stop()
    (first, second), = results
    if first[0] == second[0] == "exact":
        # Seen once in a loaded suite, not explained: round 0 summed by both pushes. Consistent (one machine
        # failing alone, or a hang, is not), and acceptable only where the server never failed round 0 on
        # worker 1's drop; its log says (the test fails with it otherwise, for whoever looks next).
        log = (tmp_path / "logs" / "server-0.log").read_text()
        assert not re.search(r"worker 1 \([^)]*\) disconnected; [1-9]", log), (results, log)
    else:
        assert first[0].startswith("BPS") and second[0].startswith("BPS"), results
        assert float(second[0].split()[-2]) < 10.0, results  # an error from the server, not our 15 s wait
    assert first[1:] == second[1:] == ["exact", "exact"], results


def _wait(what: str, deadline: float, ready) -> None:
    while not ready():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _late_peer_job(tmp_path, cluster_keys: dict, fault) -> list:
    """Steps of a name of 100,000 float32 on two workers of one process each and a CPU-only server (TCP, or
    shared memory where ``cluster_keys`` allows it): worker 1's process pushes step 0 only once file ``go``
    exists. Once worker 0's push of it is at the server and both workers are connected, ``fault(cluster, go)``
    runs (it makes ``go``); every rank's outcome of each step."""
    path = write_config(tmp_path, [1, 1], colocated=False, cpu_servers=1, cluster=cluster_keys)
    cluster = start_cluster(path)
    go = str(tmp_path / "go")
    try:
        results: list = []
        job = threading.Thread(target=lambda: results.append(run_ranks(
            cluster, fp.late_peer_said_then_meet, "big", 100_000, go, str(tmp_path / "met"), 3, 15.0, timeout=90)))
        job.start()
        deadline = time.monotonic() + 30
        _wait("worker 0's push never reached the server", deadline,
              lambda: server_stats(cluster, only=0)[0]["rounds_open"])
        _wait("the workers are not both connected", deadline, lambda: len(_connections(cluster, 0, [0, 1])) == 2)
        fault(cluster, go, deadline)
        job.join()
    finally:
        open(go, "a").close()
        cluster.stop()
    return results


@pytest.mark.timeout(120)
def test_a_connection_dropped_while_its_push_waits_for_a_peer_loses_nothing(tmp_path):
    """Worker 0 has pushed round 0 of a name and waits for worker 1 when its connection to the server breaks;
    the server is the same run when it reconnects. The push goes again, marked resumed: the server finds it in
    the round (its contribution added already) and answers it on the new connection once worker 1 pushed. Every
    step exact on both machines. Before, the reconnect failed the held push, and its abort failed worker 1's
    round too."""

    def drop(cluster, go: str, deadline: float) -> None:
        assert _drop(cluster, 0, 0) == 1
        _wait("worker 0 never reconnected", deadline, lambda: len(_connections(cluster, 0, [0])) == 1)
        time.sleep(0.2)
        open(go, "w").close()

    results = _late_peer_job(tmp_path, {"timeout": 4.0}, drop)
    assert results == [[["exact"] * 3, ["exact"] * 3]], results


@pytest.mark.timeout(120)
def test_a_sum_whose_answer_died_with_the_connection_fails_that_worker_alone_saying_so(tmp_path):
    """Worker 0's daemon is frozen with its push of round 0 at the server; worker 1 pushes, the server sums and
    answers both, and worker 0's connection is reset before it read its answer (over TCP: the part of it that
    its socket's receive buffer could not take is still in the server's, and dies with the connection; an answer
    in shared memory, or one the buffer took whole, would still be read). Thawed, it reconnects to the same
    run and pushes again (resumed): the server says the round was summed for the other workers and the answer
    lost, so worker 0's process gets a connection error saying just that, worker 1's the exact sum, and the later
    steps are exact on both (the workers' rounds stay in step: a fused round whose answer was lost so takes no
    unfused number, FusedOperation.failed_steps)."""

    def lose_the_answer(cluster, go: str, deadline: float) -> None:
        cluster.kill("worker-0", signal.SIGSTOP)
        try:
            open(go, "w").close()
            _wait("the server never summed round 0", deadline,
                  lambda: server_stats(cluster, only=0)[0]["rounds_completed"] >= 1)
            assert _drop(cluster, 0, 0) == 1
        finally:
            cluster.kill("worker-0", signal.SIGCONT)

    results = _late_peer_job(tmp_path, {"timeout": 8.0, "colocated_shm": False}, lose_the_answer)
    ((first, *later0), (second, *later1)), = results
    assert first.startswith("BPSConnectionError") and "was summed for the other workers" in first, results
    assert "answer was lost with its connection" in first, results
    assert second == "exact" and later0 == later1 == ["exact", "exact"], results


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("tc") is None or shutil.which("ip") is None,
                    reason="needs unshare, tc and ip")
def test_a_summed_lane_round_whose_held_push_the_link_gave_up_on_takes_no_unfused_number():
    """netns_link_gives_up.py's case, in a network namespace of its own (it blocks new connections on loopback)."""
    if subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a network namespace here (unshare -n)")
    here = os.path.dirname(os.path.abspath(__file__))
    inner = os.path.join(here, "netns_link_gives_up.py")
    run = subprocess.run(["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {sys.executable} -m pytest -q "
                          f"-p no:randomly -p no:cacheprovider {inner}"],
                         cwd=os.path.dirname(os.path.dirname(here)), env={**os.environ, "BPS_TEST_NETNS": "1"},
                         capture_output=True, text=True, timeout=170)
    assert run.returncode == 0 and re.search(r"^1 passed", run.stdout, re.M), run.stdout[-4000:] + run.stderr[-2000:]
