"""Asynchronous mode when things die (issue 17): a server killed and restarted mid-run loses no delta and
applies none twice; a worker machine killed holds the others back only as long as the bound and the timeout say."""

from __future__ import annotations

import multiprocessing as mp
import re
import threading
import time

import numpy as np
import pytest

import async_programs as ap
from harness import (_rank_main, daemon_logs, rank_context, reap, run_ranks, run_through_restart, server_stats,
                     start_cluster, write_config)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim,staleness", [("server-2", None), ("server-0", 1)],
                         ids=["cpu-only-tcp", "colocated-shm-bound-1"])
def test_a_server_killed_and_restarted_mid_run_keeps_every_delta_exactly_once(tmp_path, victim, staleness):
    """The exactness run (4 processes x 200 integer deltas at random intervals) while server ``victim`` is
    frozen (pushes in flight), killed -9 and restarted: no process sees an error, and the final value is the
    initial one plus every delta, exactly. With a bound of 1 and one machine 4x slower, answers are held
    when the server dies: their deltas are in the value, and pushed again."""
    path = write_config(tmp_path, [2, 2], cpu_servers=1, cluster={"partition_bytes": 16384, "timeout": 10.0})
    results, logs, stats = run_through_restart(start_cluster(path), victim, 150, "async_deltas", ap.exact_run,
                                               "restart", "float32", 200, 3, 10.0, 0.004, staleness,
                                               () if staleness is None else (1.0, 4.0), timeout=90)
    for r in results:
        assert np.array_equal(r["final"], r["want"]), (np.abs(r["final"] - r["want"]).max(), logs)
    sid = int(victim.split("-")[1])
    # (Whether a delta pushed again was in a restored copy already, stats' async_replays, depends on timing:
    # tests/pure/test_values.py drives that case on purpose.)
    assert stats[sid]["async_deltas"] > 0  # the new run took part
    replays = [int(n) for n in re.findall(r"restarted \(its state is lost\): replaying (\d+) finished sums", logs)]
    assert len(replays) >= 2 and all(n > 0 for n in replays[:2]), logs  # both machines restored their copies


TIMEOUT_S = 2.0


def _kill_when_running(cluster, victim: str, killed_at: list[float], restart: bool = False) -> threading.Thread:
    """Kill ``victim`` -9 once the servers took 10 deltas of every machine (each is past its init: without a
    bound the others push on their own, and 30 of theirs could come before the victim's process connected);
    ``restart``: start it again at once, as a supervisor would."""
    workers = [str(w.id) for w in cluster.config.worker_specs]

    def pushed() -> int:
        stats = server_stats(cluster).values()
        return min(sum(s.get("async_deltas_by_worker", {}).get(w, 0) for s in stats) for w in workers)

    def kill() -> None:
        deadline = time.monotonic() + 30
        while pushed() < 10:
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        killed_at.append(time.time())
        cluster.kill(victim)
        if restart:
            cluster.restart(victim)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def _worker_2_killed(tmp_path, staleness: int | None, restart: bool) -> tuple[list[dict], float, str]:
    """Three machines of one process push (``push_until_error``) while machine 2's worker daemon is killed -9
    (its process loses it) and, with ``restart``, started again at once: the ranks' results, when it was
    killed, and the daemons' logs. Machine 2's own process gets a BPSConnectionError (checked here)."""
    cluster = start_cluster(write_config(tmp_path, [1, 1, 1], cluster={"timeout": TIMEOUT_S}))
    killed_at: list[float] = []
    try:
        killer = _kill_when_running(cluster, "worker-2", killed_at, restart)
        results = run_ranks(cluster, ap.push_until_error, "dead", staleness, 2.5 * TIMEOUT_S + 1, timeout=60,
                            client_timeout=TIMEOUT_S)
        killer.join()
        logs = daemon_logs(cluster)
    finally:
        cluster.stop()
    assert killed_at, "the job never ran"
    assert results[2]["error"] == "BPSConnectionError", results[2]  # its own daemon died
    return results, killed_at[0], logs


@pytest.mark.parametrize("staleness", [1, None], ids=["bound-1", "unbounded"])
def test_a_worker_machine_killed(tmp_path, staleness):
    """With a bound, the others' pushes are held back by the dead machine until the timeout declares it dead:
    then they get a BPSConnectionError naming worker 2, within the timeout (plus the sweep's quarter) of the
    kill, and their next pushes return at once. Without one, they never notice and go on pushing."""
    results, killed_at, logs = _worker_2_killed(tmp_path, staleness, restart=False)
    for r in results[:2]:
        if staleness is None:
            assert r["error"] is None, (r, logs)
            assert sum(t > killed_at + TIMEOUT_S for t in r["times"]) > 10  # well after it died: still going
        else:
            assert r["error"] == "BPSConnectionError" and r["peer"] == "worker 2", (r, logs)
            assert TIMEOUT_S - 0.5 < r["at"] - killed_at < 1.25 * TIMEOUT_S + 2, r["at"] - killed_at
            assert r["after"] == 5, r  # declared dead, it holds nobody back: the next pushes return


def test_a_worker_machine_whose_daemon_is_restarted_without_its_process_holds_nobody_back(tmp_path):
    """As above with a bound, but machine 2's daemon is started again at once (a supervisor's restart) and no
    process comes back: the new daemon connects with another numbering, which the servers take as that
    machine's processes gone (a review's case: it counted as live again, and held the others back for ever).
    The others go on: unhindered where it connected within the timeout, else after the error that declared it
    dead."""
    results, killed_at, logs = _worker_2_killed(tmp_path, 1, restart=True)
    for r in results[:2]:
        if r["error"] is None:
            assert sum(t > killed_at + TIMEOUT_S for t in r["times"]) > 10, (r, logs)
        else:
            assert r["error"] == "BPSConnectionError" and r["after"] == 5, (r, logs)


@pytest.mark.timeout(120)
def test_a_machine_whose_processes_come_back_goes_on_from_its_step(tmp_path):
    """Machine 1's process pushes five deltas and leaves (its daemon resets: its rounds count from 0 again);
    a new process there initialises again and pushes five more, while machine 0 pushes all along. The new
    init learns machine 1's step from the servers, so its deltas are not taken for replays of the old ones:
    machine 0 ends with every delta of both in the value, exactly once."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cluster={"timeout": 4.0}))
    ctx = rank_context()
    queue = ctx.Queue()
    sockets = [w.socket for w in cluster.config.worker_specs]

    def rank(worker: int, role: str) -> mp.Process:
        p = ctx.Process(target=_rank_main, args=(queue, sockets[worker], 0, worker, ap.rejoin, (role,), 10.0),
                        daemon=True)
        p.start()
        return p

    procs = [rank(0, "steady"), rank(1, "first")]
    try:
        reports = []
        for _ in range(3):
            reports.append(queue.get(timeout=60))
            assert reports[-1][1] == "ok", (reports[-1], daemon_logs(cluster))
            if len(reports) == 1:
                assert reports[0][0] == 1  # "first" is done: machine 1's process comes back
                procs.append(rank(1, "again"))
        got = {r[0]: r[2] for r in reports[1:]}
    finally:
        reap(procs)
        cluster.stop()
    assert got[0] == [ap.REJOIN_TOTAL] * 4, got


@pytest.mark.timeout(120)
def test_a_machine_whose_processes_come_back_holds_nobody_back_for_the_steps_it_missed(tmp_path):
    """Under a bound of 1, machine 1's process pushes three deltas and leaves; machine 0 goes on alone (its
    steps run far ahead); a new process on machine 1 initialises again and pushes ten, 0.1 s apart. A review's
    reproducer: numbered from its own old step, machine 1 looked hundreds of steps behind, and machine 0 was
    held for the whole time machine 1 was back (one push in that window). Its steps now go on from the
    furthest machine's: machine 0 keeps pace with it, and every delta is in the value once."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cluster={"timeout": 4.0}))
    ctx = rank_context()
    queue = ctx.Queue()
    sockets = [w.socket for w in cluster.config.worker_specs]

    def rank(worker: int, role: str) -> mp.Process:
        p = ctx.Process(target=_rank_main, args=(queue, sockets[worker], 0, worker, ap.rejoin_bounded,
                                                 (role, str(tmp_path)), 10.0), daemon=True)
        p.start()
        return p

    procs = [rank(0, "steady"), rank(1, "first")]
    try:
        reports = [queue.get(timeout=60)]
        assert reports[0][:2] == (1, "ok"), (reports, daemon_logs(cluster))
        time.sleep(1.0)  # machine 0 alone: tens of steps ahead
        procs.append(rank(1, "again"))
        for _ in range(2):
            reports.append(queue.get(timeout=60))
            assert reports[-1][1] == "ok", (reports[-1], daemon_logs(cluster))
        steady = next(r[2] for r in reports[1:] if r[0] == 0)
    finally:
        reap(procs)
        cluster.stop()
    assert steady["value"] == [steady["total"]] * 4, steady
    assert steady["during"] >= 4, steady  # (10 or so; 1 before)


@pytest.mark.timeout(150)
def test_a_machine_whose_processes_ended_holds_nobody_back_after_a_server_restart(tmp_path):
    """Machine 1's processes ended (its daemon reset, and said so). The servers then restart: their new runs
    knew only that worker 1's daemon connected, and took it for one with processes whose step held machine 0
    back for ever under the bound. The daemon now tells a restarted server that it has none."""
    from bps_worker.supervise import Cluster  # noqa: F401 - (the harness's)
    from harness import start_cluster, write_config
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=0, cluster={"timeout": 2.0}))
    flags = tmp_path / "flags"
    flags.mkdir()

    def restart_servers() -> None:
        deadline = time.monotonic() + 90
        while not (flags / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        for victim in ("server-0", "server-1"):
            cluster.kill(victim)
        for victim in ("server-0", "server-1"):
            cluster.restart(victim)
        time.sleep(2.0)  # both worker daemons reconnect and restore
        (flags / "restarted").touch()

    thread = threading.Thread(target=restart_servers, daemon=True)
    thread.start()
    try:
        results = run_ranks(cluster, ap.finished_then_restart, "fin", str(flags), timeout=120)
    finally:
        thread.join(5)
        cluster.stop()
    machine0 = results[0]
    assert not machine0["still_waiting"], machine0
    assert len(machine0["after_restart"]) == 3 and all(isinstance(v, float) for v in machine0["after_restart"]), \
        machine0
