"""A Summation Service killed (-9) and restarted mid-training: no error, no lost or doubled round."""

from __future__ import annotations

import re

import pytest

import rank_programs as rp
from harness import run_through_restart, start_cluster, write_config

ROUNDS = 100


ATTEMPTS = 3


def _run_once(tmp_path, victim: str, hosts: bool) -> list[int]:
    """One job through a kill and restart of ``victim``, every sum checked; the partitions each worker's link
    pushed again to the new server (from its log)."""
    path = write_config(tmp_path, [2, 2], cluster={"partition_bytes": 256 * 1024, "timeout": 15.0},
                        separate_hosts=hosts)
    cluster = start_cluster(path)
    results, logs, stats = run_through_restart(cluster, victim, 40, "rounds_completed", rp.steady_rounds, ROUNDS,
                                               0.0, timeout=180)
    for r in results:
        assert r["errors"] == [] and r["exact"] == r["expected"], (r, logs)
    # The restart happened mid-run: the new server took part, but did not see the whole run.
    sid = int(victim.split("-")[1])
    completed = stats[sid]["rounds_completed"]
    assert 0 < completed, stats[sid]
    assert results[0]["seconds"] > 2.0
    again = [int(n) for n in re.findall(r"restarted \(its state is lost\): replaying \d+ finished sums, pushing "
                                        r"(\d+) partitions again", logs)]
    assert len(again) == (4 if hosts else 2), logs  # per worker: one per stream
    return again


@pytest.mark.timeout(600)
@pytest.mark.parametrize("victim,hosts", [("server-2", False), ("server-0", False), ("server-2", True)],
                         ids=["cpu-only-tcp", "colocated-shm", "cpu-only-2-streams"])
def test_server_killed_and_restarted_mid_training(tmp_path, victim, hosts):
    """``hosts``: servers at 127.0.0.1/2/3, so each worker has two connections (streams) to the CPU-only one,
    and each must replay and push again on its own.

    Every run must be exact. The case this test is for, every worker meeting the new server with pushes in
    flight and pushing them again, is what a run usually gives: the victim is frozen once its statistics show a
    round open (``rounds_open``, harness.restart_mid_run). Before that wait, under a busy loop the freeze twice
    found nothing in flight at the victim ("pushing 0 partitions again" on every link, once in three runs in a
    row), so the job still runs again, up to ATTEMPTS times, until a run covers it."""
    for attempt in range(ATTEMPTS):
        again = _run_once(tmp_path / f"run{attempt}", victim, hosts)
        if sum(n > 0 for n in again) >= 2:
            return
    raise AssertionError(f"in {ATTEMPTS} runs no two links pushed partitions again after the restart: {again}")


@pytest.mark.timeout(120)
def test_a_round_given_up_on_a_server_that_then_dies_fails_on_its_restarted_run_too(tmp_path):
    """After a first step, worker 0 pushed round 1 of a name; worker 1's processes disagree about it, so
    worker 1 gives the round up (an Abort) while the server is frozen; the server is killed with the Abort
    unread, and restarted.
    Worker 0 pushes its round again to the new run, which must hear that worker 1 gave it up: worker 0's
    push fails within the timeout. Before, the new run opened the round afresh and waited for worker 1,
    which had moved on, for ever (fault_soak.py, seed 100 with --mismatch 0.1: a hang)."""
    import signal
    import threading
    import time

    import fault_programs as fp
    from harness import run_ranks, server_stats

    path = write_config(tmp_path, [1, 2], colocated=False, cpu_servers=1, cluster={"timeout": 4.0})
    cluster = start_cluster(path)
    go, gave_up, done = (str(tmp_path / f) for f in ("go", "gave_up", "done"))
    results: list = []
    job = threading.Thread(target=lambda: results.append(run_ranks(
        cluster, fp.given_up_while_frozen, "big", 100_000, go, gave_up, done, 4, 15.0, timeout=90)))
    job.start()
    try:
        deadline = time.monotonic() + 30
        while server_stats(cluster, only=0)[0]["rounds_completed"] < 2 or \
                not server_stats(cluster, only=0)[0]["rounds_open"]:
            assert time.monotonic() < deadline, "worker 0's push never reached the server"
            time.sleep(0.01)
        cluster.kill("server-0", signal.SIGSTOP)
        open(go, "w").close()
        fp.wait_for(gave_up, 30)
        time.sleep(0.3)  # worker 1's Abort is written (into the frozen server's socket)
        cluster.kill("server-0")
        time.sleep(0.3)
        cluster.restart("server-0")
        job.join()
    finally:
        for f in (go, gave_up, done):
            open(f, "a").close()
        job.join()
        cluster.stop()
    (first, second, third), = results
    assert [r[0] for r in results[0]] == ["exact"] * 3, results
    assert all(r[1].startswith("BPS") for r in (first, second, third)), results
    assert float(first[1].split()[-2]) < 10.0, results  # an error from the servers, not our 15 s wait
    assert first[2:] == second[2:] == third[2:] == ["exact", "exact"], results
