"""Run by test_dropped_links.py inside a network namespace of its own (``unshare -n``), never collected on its own
(the name does not start with ``test_``): it blocks new connections on that namespace's loopback with ``tc``,
which on the box's own loopback would cut every other test's daemons off."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time

import pytest

import fault_programs as fp
from harness import run_ranks, server_stats, start_cluster, write_config
from test_dropped_links import _connections, _drop, _wait

pytestmark = pytest.mark.skipif(not os.environ.get("BPS_TEST_NETNS"), reason="only inside its own network namespace")


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True)


def _block_new_connections(port: int) -> None:
    """SYNs to ``port`` on lo go to a class that lets nothing through; connections made stay up."""
    _tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "10")
    _tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit")
    _tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:20", "htb", "rate", "8bit", "ceil", "8bit",
        "burst", "1", "cburst", "1")
    _tc("qdisc", "add", "dev", "lo", "parent", "1:20", "handle", "20:", "pfifo", "limit", "1")
    _tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip", "dport",
        str(port), "0xffff", "match", "u8", "0x02", "0x02", "at", "33", "flowid", "1:20")
    try:  # (spends the class's one packet of burst)
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        pass


def _unblock() -> None:
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)


@pytest.mark.timeout(120)
def test_a_summed_lane_round_whose_held_push_the_link_gave_up_on_takes_no_unfused_number(tmp_path):
    """Worker 0's lane push of a fused step is at the anchor, waiting for worker 1's, when worker 0's connection
    breaks and it cannot connect again within the timeout (new connections to the server are blocked; worker 1's
    stays up). Worker 1 pushes, the round is summed for it, and worker 0's link gives up: its held push fails with
    its fate unknown. Once the link is back, worker 0 asks the server (RoundQuery.fate) and takes no unfused round
    number, as worker 1 took none: the later steps of the name, unfused, are exact on both. Before, worker 0 took
    one, and its unfused rounds of the name were one ahead of worker 1's for good: its step 1 was summed with
    worker 1's step 2 (wrong sums, no error). Found by a review."""
    path = write_config(tmp_path, [1, 1], colocated=False, cpu_servers=1, cluster={"timeout": 3.0})
    cluster = start_cluster(path)
    go, met, go2 = str(tmp_path / "go"), str(tmp_path / "met"), str(tmp_path / "go2")
    port = cluster.config.servers[0].port
    try:
        results: list = []
        job = threading.Thread(target=lambda: results.append(run_ranks(
            cluster, fp.fused_then_unfused, "x", go, met, go2, 12.0, timeout=90)))
        job.start()
        deadline = time.monotonic() + 30
        _wait("worker 1's report never reached the anchor", deadline,
              lambda: server_stats(cluster, only=0)[0]["fused_waiting"])
        _wait("the workers are not both connected", deadline, lambda: len(_connections(cluster, 0, [0, 1])) == 2)
        cluster.kill("worker-1", signal.SIGSTOP)  # it reported x; its plan waits in its socket
        try:
            open(go, "w").close()
            _wait("worker 0's lane push never reached the server", deadline,
                  lambda: server_stats(cluster, only=0)[0]["rounds_open"])
            _block_new_connections(port)
            assert _drop(cluster, 0, 0) == 1  # worker 0's answer will die with this connection
        finally:
            cluster.kill("worker-1", signal.SIGCONT)
        time.sleep(4.5)  # worker 1 pushes its lane round (summed); worker 0's link gives up (timeout 3 s)
        _unblock()  # (the server's statistics are asked over TCP too)
        summed = server_stats(cluster, only=0)[0]["rounds_completed"]
        _wait("worker 0 never reconnected", time.monotonic() + 20, lambda: len(_connections(cluster, 0, [0])) == 1)
        time.sleep(0.5)
        open(go2, "w").close()
        job.join()
    finally:
        _unblock()
        open(go, "a").close()
        open(go2, "a").close()
        cluster.stop()
    ((first0, *later0), (first1, *later1)), = results
    assert summed >= 1
    assert first0.startswith("BPSConnectionError") and first1 == "exact", results
    assert later0 == later1 == ["exact", "exact"], results
