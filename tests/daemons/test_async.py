"""Asynchronous mode with real daemons: exactness, the staleness bound, mismatches and misuse (issue 17).

Restarts and dead machines are in test_async_failures.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import async_programs as ap
from harness import run_ranks


def test_every_delta_is_in_the_value_exactly_float32(cluster_2x2):
    """4 processes, 200 integer-valued deltas each at random intervals (0-4 ms), split over 3 servers."""
    results = run_ranks(cluster_2x2, ap.exact_run, "exact32", "float32", 200, 1, 10.0, 0.004, timeout=90)
    for r in results:
        assert np.array_equal(r["final"], r["want"]), np.abs(r["final"] - r["want"]).max()


def test_float16_values_accumulate_in_float32_within_half_an_ulp(cluster_2x2):
    """The value starts at 3000-3006, where float16's spacing is 2, and takes +-2 integer deltas: added in
    float16, most would round away. The server adds in float32 (exact for these integers) and rounds once
    per answer, so the final value is the exact sum rounded to float16: within 1 (half the spacing) of it,
    and equal to numpy's rounding of it."""
    results = run_ranks(cluster_2x2, ap.exact_run, "exact16", "float16", 100, 2, 3000.0, 0.002, timeout=90)
    for r in results:
        assert np.abs(r["final"] - r["want"]).max() <= 1.0
        assert np.array_equal(r["final"], r["want"].astype(np.float16).astype(np.float64))


def test_a_bound_of_2_keeps_every_machine_within_2_steps_of_the_slowest(cluster_2x2):
    """Machine 1 sleeps 20 ms a step, machine 0 none: every answer's value shows that no machine was more than
    2 steps ahead of the slowest (each answer to step t holds every machine's steps up to at least t - 2),
    and the fast machine was held back to the slow one's pace."""
    results = run_ranks(cluster_2x2, ap.steps_trace, "bound2", 2, 40, {1: 0.02}, timeout=60)
    for r in results:
        for step, entries in r["trace"]:
            assert entries[r["worker"]] >= step  # its own delta is in
            assert min(entries) >= step - 2, (r["worker"], step, entries)
    fast, slow = results[0]["steps"], results[2]["steps"]
    assert slow == 40 and fast <= slow + 2, (fast, slow)
    assert results[0]["seconds"] >= 0.8 * results[2]["seconds"]  # held back: about the slow one's time


def test_unbounded_a_slow_machine_does_not_slow_the_others(cluster_2x2):
    """Machine 1 sleeps 5x as long a step as machine 0 (100 ms against 20 ms: long against a push on a loaded
    box): while it makes 20 steps, machine 0 completes at least 3x as many."""
    results = run_ranks(cluster_2x2, ap.steps_trace, "free", None, 20, {0: 0.02, 1: 0.1}, timeout=60)
    fast, slow = results[0]["steps"], results[2]["steps"]
    assert slow == 20 and fast >= 3 * slow, (fast, slow)
    assert results[1]["steps"] == fast and results[3]["steps"] == slow  # local processes go together


def test_a_shape_mismatch_names_the_tensor_and_both_shapes_on_both_sides(cluster_2x2):
    """Machine 1 initialises the name with another shape than the root's machine: it hears why, naming the
    tensor, its own shape and the root's (whichever init came first); the root's machine has its value, and
    hears the mismatch at its next delta, its own shape as ``ours`` (it went on with the first shape, never
    told: a review of the contract), then goes on."""
    results = run_ranks(cluster_2x2, ap.mismatch, "mm", timeout=60)
    for r in results[2:]:
        name, ours, theirs = r["init"].split("|")
        assert name == "mm" and ours.startswith("float32[5]") and theirs.startswith("float32[4]"), r
    for r in results[:2]:
        # the refused delta (1 from each process) added nothing; the next two (2, then 3 from each of machine 0's
        # two processes) once each, on the value's 1 (the second was lost as a replay: 3 then 9, a review)
        assert r["init"] == "ok" and r["pushes"][1:] == [[5.0] * 4, [11.0] * 4], r
        name, ours, theirs = r["pushes"][0].split("|")
        assert name == "mm" and ours.startswith("float32[4]") and theirs.startswith("float32[5]"), r


def test_sync_and_async_use_of_one_name_is_an_error(cluster_2x2):
    results = run_ranks(cluster_2x2, ap.misuse, "both", timeout=60)
    for rank, r in enumerate(results):
        if rank >= 2:  # pushed it synchronously: the servers hold it as asynchronous (or the other way)
            assert r["outcome"].startswith("BPSMismatchError") and "synchronous" in r["outcome"], r
        assert r["local"].startswith("BPSError") and "used synchronously in this process" in r["local"], r
        assert r["never"].startswith("BPSError") and "call async_init first" in r["never"], r
        assert len(r["bad"]) == 3 and all("staleness must be None or an integer >= 0" in t for t in r["bad"]), r
    assert results[0]["outcome"] == results[1]["outcome"] == "ok"


@pytest.mark.timeout(120)
def test_a_refused_delta_takes_no_step_of_the_staleness_bound(cluster_2x2):
    results = run_ranks(cluster_2x2, ap.refused_delta_takes_no_step, "skip", timeout=60)
    for rank, r in enumerate(results):
        assert r["final"] == [4 * 5] * 4, (rank, r)  # every good delta, once; the refused one added nothing
        if rank < 2:
            assert r["refused"] == "skip|int64[2]|int64[4]", r


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [4, 40000], ids=["fused", "unfused"])
def test_each_side_of_a_misuse_hears_its_own_use_as_ours(cluster_2x2, n):
    results = run_ranks(cluster_2x2, ap.sync_side_of_a_misuse, f"sides{n}", n, timeout=60)
    for rank, r in enumerate(results):
        ours, theirs = r.split("|")
        if rank < 2:
            assert ours == "used synchronously in this job" and theirs.endswith(", asynchronously"), (rank, r)
        else:
            assert ours.endswith(", asynchronously") and theirs == "used synchronously in this job", (rank, r)


@pytest.mark.parametrize("everywhere", [False, True], ids=["root-machine", "every-machine"])
def test_a_root_machine_that_disagrees_within_itself_fails_every_machines_init_at_once(tmp_path, everywhere):
    """Root rank 1's machine fails its async_init locally (its two processes disagree about the shape): the other
    machine's processes waited the whole timeout for the value, then heard a timeout that named neither shape (a
    review). Now every process hears the mismatch at once, and a retry alike everywhere gets the root's value, also
    where the other machine failed the attempt at home too and retried before the root's machine (the first
    version failed that retry, a review of it). Large enough to be cut into parts on several servers (each fails
    its own)."""
    from harness import start_cluster, write_config

    cluster = start_cluster(write_config(tmp_path, [2, 2], cpu_servers=1,
                                         cluster={"partition_bytes": 65536, "timeout": 20.0}))
    try:
        results = run_ranks(cluster, ap.split_root_machine, "split", 50_000, everywhere, timeout=120)
    finally:
        cluster.stop()
    for rank, r in enumerate(results):
        assert r["error"] is not None and r["error"]["class"] == "BPSMismatchError", (rank, r)
        assert r["error"]["name"] == "split" and "float32[50001]" in r["error"]["message"], (rank, r)
        first = rank % 2 == 0 and (everywhere or rank == 0)
        ours, theirs = ("float32[50001]", "float32[50000]") if first else ("float32[50000]", "float32[50001]")
        assert r["error"]["ours"].startswith(ours) and r["error"]["theirs"].startswith(theirs), (rank, r)
        assert r["waited"] < 5.0, (rank, r)  # not the timeout (20 s)
        assert r["value"] == [1.0], (rank, r)


@pytest.mark.timeout(120)
def test_the_next_jobs_init_beside_a_lingering_process_of_the_last_job_gets_its_own_value(tmp_path):
    """Daemons outlive jobs (bps-launch names each start a job, BPS_JOB): machine 0's process of job 'A' left,
    machine 1's lingers (connected after its last step), and machine 0's process of job 'B' inits the same name
    with its own value. It was taken for a rejoin and got job A's value (3s for 100s, a review's case); now it gets
    its own, the lingering process's late delta is refused naming both jobs (not added to B's value), and machine
    1's process of job B, once A's left, gets B's value."""
    from harness import collect_reports, reap

    cluster, ctx, queue, procs, start = _jobs_on_two_machines(tmp_path)
    said, b_began, b_may_leave = ctx.Queue(), ctx.Event(), ctx.Event()
    try:
        both = ctx.Barrier(2)
        start(0, 0, "A", ap.last_job, ("jobs.w",), both)
        start(1, 1, "A", ap.last_job, ("jobs.w", b_began), both)
        assert set(collect_reports(queue, {0}, 60, cluster)[0]["value"]) <= {2.0, 3.0}
        procs[0].join(10)
        start(10, 0, "B", ap.next_job, ("jobs.w", 100.0, b_may_leave, said))
        began = said.get(timeout=60)
        b_began.set()
        lingering = collect_reports(queue, {1}, 60, cluster)[1]
        procs[1].join(10)
        start(11, 1, "B", ap.next_job, ("jobs.w", 0.0))
        joined = collect_reports(queue, {11}, 60, cluster)[11]
        b_may_leave.set()
    finally:
        reap(procs, 5)
        cluster.stop()
    assert began == [100.0] * 8, began
    assert "late" not in lingering and "job 'A'" in lingering["error"] and "job 'B'" in lingering["error"], lingering
    assert joined == [100.0] * 8, joined


@pytest.mark.timeout(60)
def test_a_process_of_another_job_than_its_machines_connected_ones_is_refused_naming_both(tmp_path):
    from harness import collect_reports, _rank_main, rank_context, reap, start_cluster, write_config

    cluster = start_cluster(write_config(tmp_path, [2], cluster={"timeout": 10.0}))
    ctx = rank_context()
    queue, said, release, connected = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Barrier(2)
    sock = cluster.config.worker_specs[0].socket
    procs = [ctx.Process(target=_rank_main, args=(queue, sock, local, local, ap.next_job,
                                                  ("jobs.x", 1.0, hold, said), 20.0, {"BPS_JOB": job}, together),
                         daemon=True)
             for local, job, hold, together in ((0, "A", release, connected), (1, "B", None, None))]
    try:
        procs[0].start()
        connected.wait(60)  # (rank 0 connected; its init then waits for its machine's other process)
        procs[1].start()
        refused = collect_reports(queue, {1}, 30, cluster, allow_errors=True)[1]
        release.set()
    finally:
        reap(procs, 5)
        cluster.stop()
    assert "refused local rank 1" in refused and "this process is of job 'B'" in refused, refused
    assert "local rank 0 (pid" in refused and "are of job 'A'" in refused, refused


@pytest.mark.timeout(120)
def test_a_lingering_process_of_a_synchronous_job_is_older_than_the_next_job_at_its_first_asynchronous_push(
        tmp_path):
    """Job A summed synchronously only; machine 1's process of it lingers, and after job B began on machine 0 it
    makes its first asynchronous push. The servers' order of first pushes took A for the newest job: B's value
    was dropped and every later push of B refused (a review's reproducer). A job is as old as its processes (the
    worker's Joined says when they came): A's push is refused at once, naming both jobs, and B goes on."""
    from harness import collect_reports, reap

    cluster, ctx, queue, procs, start = _jobs_on_two_machines(tmp_path)
    said, b_began, b_goes_on = ctx.Queue(), ctx.Event(), ctx.Event()
    try:
        both = ctx.Barrier(2)
        start(0, 0, "A", ap.synchronous_job, (), both)
        start(1, 1, "A", ap.synchronous_job, (b_began,), both)
        assert collect_reports(queue, {0}, 60, cluster)[0] == {"sum": [1.0] * 8}  # (the mean)
        procs[0].join(10)
        start(10, 0, "B", ap.deltas_after, ("jobs.b", said, b_goes_on))
        began = said.get(timeout=60)
        b_began.set()
        lingering = collect_reports(queue, {1}, 60, cluster)[1]
        b_goes_on.set()
        after = collect_reports(queue, {10}, 60, cluster)[10]
    finally:
        reap(procs, 5)
        cluster.stop()
    assert began == [101.0] * 8 and after == [102.0] * 8, (began, after)
    assert "job 'A'" in lingering["error"] and "job 'B' began after it" in lingering["error"], lingering
    assert lingering["waited"] < 5.0, lingering  # at once, not after the timeout


def _jobs_on_two_machines(tmp_path):
    """A cluster of two machines (one process each) for jobs that overlap, and ``start(key, machine, job, target,
    args, together)``: a process of job ``job`` (BPS_JOB) on ``machine`` that runs ``target(*args)`` (once every
    process of the barrier ``together`` connected: a busy machine's start-up may outlast the cluster's timeout)
    and reports as ``key``."""
    from harness import _rank_main, rank_context, start_cluster, write_config

    cluster = start_cluster(write_config(tmp_path, [1, 1], cluster={"timeout": 10.0}))
    ctx = rank_context()
    queue = ctx.Queue()
    sockets = [w.socket for w in cluster.config.worker_specs]
    procs: list = []

    def start(key: int, machine: int, job: str, target, args, together=None) -> None:
        p = ctx.Process(target=_rank_main, args=(queue, sockets[machine], 0, key, target, args, 20.0,
                                                 {"BPS_JOB": job}, together), daemon=True)
        p.start()
        procs.append(p)

    return cluster, ctx, queue, procs, start
