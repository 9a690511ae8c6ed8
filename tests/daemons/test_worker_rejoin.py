"""A worker machine dies mid-training and comes back: the others get errors naming it, then training
goes on from the next round, with the restarted machine's new processes, without restarting anyone else."""

from __future__ import annotations

import signal
import time

import pytest

import rank_programs as rp
from harness import _rank_main, collect_reports, daemon_logs, rank_context, reap, server_stats, start_cluster, \
    write_config

STEPS = 12


@pytest.mark.timeout(180)
@pytest.mark.parametrize("servers_restart", ["none", "own", "every"],
                         ids=["servers-stay", "its-own-server-too", "every-server-restarts-too"])
@pytest.mark.parametrize("n", [200_003, 1000], ids=["partitioned", "fused"])
def test_a_killed_worker_machine_rejoins_the_running_job(tmp_path, servers_restart: str, n: int):
    """``its-own-server-too``: the common machine crash, its colocated server dies with its daemon and is back
    (as a reboot brings both) after more than the cluster's timeout, the other servers up all along.
    ``every-server-restarts-too``: while the machine is down every server restarts as well (a double
    fault), so no server knows the machine's earlier numbering; the healthy machine replays its last sums to
    the new runs. The restarted machine's new daemon says its numbering is fresh (Hello.fresh), and the
    servers place it at the healthy machine's round, as they do when they knew it (it used to be taken for a
    job starting: its first steps failed as stale rounds until its numbering caught up)."""
    path = write_config(tmp_path, [1, 1], cluster={"timeout": 4.0, "partition_bytes": 256 * 1024})
    cluster = start_cluster(path)
    ctx = rank_context()
    queue = ctx.Queue()
    sockets = [w.socket for w in cluster.config.worker_specs]
    procs = []

    def rank(worker: int, role: str, seconds: float) -> None:
        p = ctx.Process(target=_rank_main, args=(queue, sockets[worker], 0, worker, rp.rejoin_loop,
                                                 (role, STEPS, seconds, n), 10.0), daemon=True)
        p.start()
        procs.append(p)

    try:
        rank(0, "healthy", 120)
        rank(1, "victim", 60)
        # Mid-training: both ranks connected and the victim got the sum of its first step (a fixed 2 s alone
        # raced the ranks' start-up on a busy machine: the victim had not connected when its daemon died). A
        # round of the 1.6 MB tensor is 7 partitions of 256 KiB, each completed once on its server; the second
        # round's 7 mean the victim pushed its second step, so it had its first (the first round's 7 alone did
        # not: under a busy loop the kill once came before the first sum reached the victim).
        deadline = time.monotonic() + 60
        while (sum(s["rounds_completed"] for s in server_stats(cluster).values()) < 2 * 7
               and time.monotonic() < deadline):
            time.sleep(0.05)
        cluster.kill("worker-1")  # the machine's daemon dies; its process loses it and stops
        victim = collect_reports(queue, {1}, 30, cluster)[1]
        if servers_restart == "own":
            cluster.kill("server-1")  # (colocated with worker 1)
            time.sleep(5.0)  # down past cluster.timeout: the healthy process's rounds there fail
            cluster.restart("server-1")
        if servers_restart == "every":
            servers = [f"server-{s.id}" for s in cluster.config.servers]
            for label in servers:
                cluster.kill(label)
            for label in servers:
                cluster.restart(label)
        time.sleep(1.0)
        cluster.restart("worker-1")
        rank(1, "new", 60)  # the machine's training process, started again from scratch
        results = collect_reports(queue, {0, 1}, 120, cluster)
        logs = daemon_logs(cluster)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        cluster.stop()
    healthy, new = results[0], results[1]
    assert victim["error_count"] == 1 and victim["partner_steps"], victim
    # Before the crash the two trained in lock step.
    before = healthy["partner_steps"][:len(victim["partner_steps"])]
    assert before == [float(s) for s in range(len(before))]
    # The healthy process got errors naming the missing worker, within the timeout each; or none, where
    # its round waited at the servers for the machine to come back (within cluster.timeout) and the new
    # process's first step completed it (about one run in ten) ...
    assert healthy["error_count"] == 0 or any("worker 1" in e for e in healthy["errors"]), healthy["errors"]
    # ... and then summed with the new process's steps 0, 1, 2, ... in order: none lost, none doubled.
    after = healthy["partner_steps"][len(victim["partner_steps"]):]
    assert after[-STEPS:] == [float(s) for s in range(STEPS)], (repr(healthy), repr(victim), repr(new), logs)
    assert healthy["restarted_at"] == len(healthy["partner_steps"]) - STEPS
    # At most the round in flight at the kill completed without the victim seeing it.
    assert len(victim["partner_steps"]) <= healthy["restarted_at"] <= len(victim["partner_steps"]) + 1
    # The new process saw the healthy process's steps consecutively too.
    mine = new["partner_steps"]
    assert new["error_count"] == 0 and len(mine) == STEPS, new
    assert mine == [mine[0] + i for i in range(STEPS)] and mine[0] >= len(victim["partner_steps"]), new


@pytest.mark.timeout(120)
def test_a_process_that_outlives_its_daemon_sums_each_later_step_in_one_round(tmp_path):
    """Worker 1's daemon is killed at step 3 and restarted (systemd) while its process lives on: the process's
    step fails, and it calls init() again and goes on. The healthy process's rounds of that step that were
    still open (reported after the old daemon's connection dropped) used to be completed by the survivor's
    next step, and every later step of those names stayed a step apart from the others (a review's reproducer:
    37 names of 200, silently). The servers fail what was open when the new daemon connects: every later step
    is summed in one round, the same rounds on both processes."""
    path = write_config(tmp_path, [1, 1], cluster={"timeout": 5.0})
    cluster = start_cluster(path)
    ctx = rank_context()
    queue = ctx.Queue()
    sockets = [w.socket for w in cluster.config.worker_specs]
    flags = tmp_path / "flags"
    flags.mkdir()
    procs = [ctx.Process(target=_rank_main, args=(queue, sockets[w], 0, w, rp.survivor_steps,
                                                 (sockets[w], 8, 1000, str(flags)), 10.0), daemon=True)
             for w in (0, 1)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 60
        while not all((flags / f"{r}.half").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # (the first halves reported: summed, or in flight when the daemon dies)
        cluster.kill("worker-1")
        (flags / "killed").touch()  # rank 0 issues the rest of step 3 after the drop, before the new daemon
        time.sleep(0.3)
        cluster.restart("worker-1")
        results = collect_reports(queue, {0, 1}, 90, cluster)
        logs = daemon_logs(cluster)
    finally:
        reap(procs)
        cluster.stop()
    summed = {}
    for rank, steps in results.items():
        # The step the daemon died in fails on both (on the healthy side, names whose round the old daemon had
        # pushed before it died may have completed: their answers died with it, as ever).
        assert steps[3]["errors"] > 0 and steps[3]["sums"] in ([], [61.0]), (rank, steps)
        for s in steps[:3] + steps[4:]:
            assert s["errors"] in (0, 1000) and len(s["sums"]) == (0 if s["errors"] else 1), (rank, steps, logs)
        summed[rank] = [s["sums"][0] for s in steps[:3] + steps[4:] if not s["errors"]]
    assert summed[0][:3] == summed[1][:3] == [1.0, 21.0, 41.0], summed
    assert len(summed[0]) >= 5 and summed[0][3:] == summed[1][3:], summed  # the same rounds after it


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["ended", "crashed"])
def test_a_new_daemon_for_the_next_job_fails_none_of_its_first_rounds(tmp_path, how):
    """The servers outlive a job (a StatefulSet of CPU-only servers, job after job); machine 1's daemon goes with
    its job (``ended``: its processes had left; ``crashed``: killed with its process still connected, the job
    then ended by machine 0's leaving) and a new one comes 1.5 s after machine 0's trainer of the next job
    pushed. The first versions of the restarted-daemon reset took the new daemon for one that died under its
    processes and failed that first round (reviews of it); nothing of the old daemon was open: both sum every
    step."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cluster={"timeout": 10.0}))
    ctx = rank_context()
    queue = ctx.Queue()
    sockets = [w.socket for w in cluster.config.worker_specs]
    procs: list = []

    def rank(worker: int, linger: float = 0.0) -> None:
        p = ctx.Process(target=_rank_main, args=(queue, sockets[worker], 0, worker, rp.three_sums, ("x", linger),
                                                 20.0), daemon=True)
        p.start()
        procs.append(p)

    try:
        rank(0), rank(1, 30.0 if how == "crashed" else 0.0)
        first = collect_reports(queue, {0} if how == "crashed" else {0, 1}, 60, cluster)
        assert set(map(tuple, first.values())) == {(3.0, 3.0, 3.0)}, first
        procs[0].join(10)
        time.sleep(1.0)
        cluster.kill("worker-1", signal.SIGKILL if how == "crashed" else signal.SIGTERM)
        if how == "crashed":
            procs[1].kill()  # (the machine's trainer goes with it)
        reap(procs)
        time.sleep(0.5)
        rank(0)  # the next job: machine 0's trainer first
        time.sleep(1.5)
        cluster.restart("worker-1")
        time.sleep(0.5)
        rank(1)
        results = collect_reports(queue, {0, 1}, 60, cluster)
    finally:
        reap(procs, 5)
        cluster.stop()
    assert results == {0: [3.0, 3.0, 3.0], 1: [3.0, 3.0, 3.0]}, results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [4, 200_003], ids=["fused", "unfused"])
def test_the_next_job_begun_where_the_last_one_ended_first_outlives_its_end_elsewhere(tmp_path, n: int):
    """Daemons that outlive jobs: machine 0's trainer of the next job starts once its own trainer of the last
    job left, while machine 1's still lingers (connected, 3 s after its last step: a checkpoint, an evaluation),
    and machine 1's trainer of the next job comes 0.5 s after that one leaves. Its leaving (a Reset) failed the
    next job's first round, which machine 0's trainer had opened: every machine's next job failed (a review's
    case). Now that round waits for machine 1's next processes, as it would have for a machine that never ran the
    last job, and both sum every step."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cluster={"timeout": 10.0}))
    ctx = rank_context()
    queue = ctx.Queue()
    sockets = [w.socket for w in cluster.config.worker_specs]
    procs: list = []

    def rank(worker: int, name: str, linger: float = 0.0) -> None:
        p = ctx.Process(target=_rank_main, args=(queue, sockets[worker], 0, worker, rp.three_sums,
                                                 (name, linger, n), 20.0), daemon=True)
        p.start()
        procs.append(p)

    try:
        rank(0, "last"), rank(1, "last", 3.0)
        assert collect_reports(queue, {0}, 60, cluster) == {0: [3.0, 3.0, 3.0]}
        procs[0].join(10)
        time.sleep(0.3)
        rank(0, "next")  # machine 1's trainer of the last job is still connected
        assert collect_reports(queue, {1}, 60, cluster) == {1: [3.0, 3.0, 3.0]}
        procs[1].join(10)
        time.sleep(0.5)
        rank(1, "next")
        results = collect_reports(queue, {0, 1}, 60, cluster)
    finally:
        reap(procs, 5)
        cluster.stop()
    assert results == {0: [3.0, 3.0, 3.0], 1: [3.0, 3.0, 3.0]}, results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cross", [False, True], ids=["unfused", "its-first-step-fused"])
def test_a_machine_that_rejoins_after_a_failed_fused_step_lines_up_with_its_peer(tmp_path, cross):
    """A failed fused step takes an unfused round number on every machine (bps_worker.fusion), and the anchor
    counts it (an abort of that round), so a machine that rejoins mid-job is placed at the peers' round: its
    steps are summed with theirs, not with their next ones (it was, silently: 110 and 1100 for 20 and 200).
    Its first step may itself be a failed one (a fused push beside the peer's unfused one): it learns where it
    is at its next round."""
    path = write_config(tmp_path, [1, 1], cluster={"timeout": 10.0, "partition_bytes": 65536})
    cluster = start_cluster(path)
    ctx = rank_context()
    queue, go = ctx.Queue(), ctx.Event()
    sockets = [w.socket for w in cluster.config.worker_specs]
    procs = []

    def rank(worker: int, role: str) -> None:
        p = ctx.Process(target=_rank_main, args=(queue, sockets[worker], 0, worker, rp.phantom_rejoin,
                                                 (role, go, cross), 20.0), daemon=True)
        p.start()
        procs.append(p)

    try:
        rank(0, "steady")
        rank(1, "first")
        first = collect_reports(queue, {1}, 60, cluster)[1]
        procs[1].join(timeout=10)
        time.sleep(1.0)  # machine 1 has no processes (it resets) while machine 0's stays in the job
        rank(1, "again")
        time.sleep(1.0)
        go.set()
        results = collect_reports(queue, {0, 1}, 120, cluster)
    finally:
        reap(procs, timeout=5)
        cluster.stop()
    steady, again = results[0], results[1]
    assert first == {"step0": "BPSMismatchError"} and steady["step0"] == "BPSMismatchError", (first, steady)
    if cross:
        assert steady["step1"] == again["step1"] == "BPSMismatchError", (steady, again)
    else:
        assert steady["step1"] == again["step1"] == [20.0], (steady, again)
    for n in (2, 3):
        assert steady[f"step{n}"] == again[f"step{n}"] == [2 * 10.0 ** n], (n, steady, again)
