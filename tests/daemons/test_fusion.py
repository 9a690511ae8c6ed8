"""Fused small sums on real daemons (issue 16): exact in any order, one bad name fails alone, mixed dtypes,
a dead process fails its peers instead of hanging. The sums are checked against the numpy reference."""

from __future__ import annotations

from typing import Any

import pytest

import fusion_programs as fp
from harness import (_rank_main, daemon_logs, rank_context, run_ranks, run_through_restart, server_stats,
                     start_cluster, write_config)

TIMEOUT_S = 4.0


@pytest.mark.timeout(240)
def test_5000_names_per_step_in_another_order_on_every_process_for_10_steps(cluster_2x2: Any) -> None:
    results = run_ranks(cluster_2x2, fp.shuffled_steps, 5000, 10, timeout=220, client_timeout=120)
    assert [r["wrong"] for r in results] == [0, 0, 0, 0]
    # The small sums went fused: far fewer rounds at the servers than tensors (5000 x 11 steps).
    rounds = sum(st["rounds_completed"] for st in server_stats(cluster_2x2).values())
    assert rounds < 5000 * 11 // 4, rounds


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad_rank", [1, 3], ids=["same-worker-as-rank-0", "other-worker"])
def test_a_mismatch_inside_a_fused_batch_fails_only_that_name_on_every_process(cluster_2x2: Any,
                                                                                 bad_rank: int) -> None:
    results = run_ranks(cluster_2x2, fp.mismatch_in_a_batch, bad_rank, 400, timeout=90)
    for rank, r in enumerate(results):
        assert list(r["errors"]) == ["fm.bad"], (rank, r["errors"])
        error = r["errors"]["fm.bad"]
        assert "'fm.bad'" in error["text"] and "[4]" in error["text"] and "[5]" in error["text"], (rank, error)
        assert r["wrong"] == 0
        assert r["again"] == [4.0] * 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad_ranks", [[1], [2], [3], [2, 3]], ids=["rank1", "rank2", "rank3", "worker1"])
@pytest.mark.parametrize("bad_large", [True, False], ids=["too-large-to-fuse", "small-enough"])
def test_a_size_on_both_sides_of_the_fusion_limit_is_a_mismatch_for_every_process(cluster_2x2: Any,
                                                                                    bad_ranks: list[int],
                                                                                    bad_large: bool) -> None:
    """Some processes' tensor goes fused, others' of the same name not (on one machine, or each machine's all
    one way): both paths must fail the name, on every machine, whichever path each process took (it hung:
    the fused side waited for ever), and the name works again in its next round."""
    for rank, r in enumerate(run_ranks(cluster_2x2, fp.paths_differ, bad_ranks, bad_large, timeout=90)):
        assert r["error"], (rank, r)
        assert "'pd'" in r["error"]["text"] and "[4]" in r["error"]["text"] and "[400]" in r["error"]["text"], \
            (rank, r["error"])
        assert r["wrong"] == 0 and r["again"] == [4.0] * 4, (rank, r)
        assert r["again_large"] == [4.0], (rank, r["again_large"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad_rank", [1, 3])
def test_a_fused_step_after_a_failed_unfused_step_of_the_name_is_summed(cluster_2x2: Any, bad_rank: int) -> None:
    """A machine whose unfused round of a fresh name fails tells the anchor once it learned the name's round
    base; its processes hear the failure only then, so their next step's fused report cannot overtake it."""
    for rank, r in enumerate(run_ranks(cluster_2x2, fp.unfused_mismatch_then_fused, bad_rank, 12, timeout=90)):
        assert r["errors"] == 12 and r["wrong"] == [], (rank, r)


@pytest.mark.timeout(120)
def test_an_unfused_failure_on_one_machine_reaches_a_machine_that_fused_the_name(cluster_2x2: Any) -> None:
    """Machine 0's processes disagree about a name too large to fuse; machine 1's pushed it small enough to fuse.
    Machine 1's processes must get an error too (its report waited at the planner for ever, and a barrier after
    the step hung every process), and the next step is summed."""
    for rank, r in enumerate(run_ranks(cluster_2x2, fp.unfused_failure_beside_fused, timeout=90)):
        assert r["step1"] == "BPSMismatchError", (rank, r)  # (machine 1: the facts came with the abort)
        assert r["barrier"] == [4.0, 4.0] and r["step2"] == [28.0], (rank, r)


@pytest.mark.timeout(120)
def test_a_name_whose_shape_or_dtype_changes_between_steps(cluster_2x2: Any) -> None:
    """The client keeps each slot's view from step to step: a name pushed with another shape or dtype gets
    the right result, and one process that changes alone is still a mismatch, named, on every process."""
    for rank, r in enumerate(run_ranks(cluster_2x2, fp.shape_and_dtype_change, 2, timeout=90)):
        assert r["wrong"] == [], (rank, r["wrong"])
        assert r["error"] and "'sc'" in r["error"] and "[4]" in r["error"] and "[2,2]" in r["error"], (rank, r)
        assert r["again"] == [4.0] * 4, (rank, r)


@pytest.mark.timeout(120)
def test_mixed_dtypes_shapes_and_averages_in_one_step(cluster_2x2: Any) -> None:
    for r in run_ranks(cluster_2x2, fp.mixed_dtypes, 3, timeout=90):
        assert r["wrong"] == [], r["wrong"][:5]


@pytest.mark.timeout(120)
def test_a_process_killed_mid_batch_fails_its_peers_within_the_timeout(make_cluster: Any) -> None:
    cluster = make_cluster([2, 2], cpu_servers=1, cluster={"timeout": TIMEOUT_S})
    results = run_ranks(cluster, fp.killed_mid_batch, 1, 200, may_die=frozenset({1}), timeout=90)
    for rank in (0, 2, 3):
        r = results[rank]
        # the half rank 1 issued before it died may have completed; the other half fails, none hangs
        assert r["errors"] >= 100 and r["errors"] + r["ok"] == 200, (rank, r)
        assert r["first_error"].startswith("BPS"), r
        assert r["seconds"] < TIMEOUT_S + 30, r


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", ["server-2", "server-0"], ids=["cpu-only", "colocated"])
def test_fused_batches_across_a_server_killed_and_restarted(tmp_path: Any, victim: str) -> None:
    """The anchor of a third of the names is killed (-9) mid-run and restarted: the plans it had sent, the
    names reported to it and the fused pushes in flight all survive; every step is exact, none doubled. The
    victim is frozen with a fused round open or fused names waiting for the other machine's reports. One process
    lags 50 ms a step, so that its machine's reports come that much later and the victim holds names for most
    of each step: a fused round is open only between the two machines' pushes, which the plan sends together
    (4% of the polls), and a busy CI machine's polls missed them all for 60 s."""
    path = write_config(tmp_path, [2, 2], cpu_servers=1, cluster={"timeout": 15.0})
    results, logs, stats = run_through_restart(start_cluster(path), victim, 30, "rounds_completed", fp.steady_fused,
                                               60, 300, 0.05, held=("rounds_open", "fused_waiting"),
                                               timeout=200, client_timeout=60)
    for r in results:
        assert r["errors"] == [] and r["exact"] == r["expected"], (r, logs[-6000:])
    sid = int(victim.split("-")[1])
    assert f"server {sid} restarted" in logs  # mid-run: the workers noticed, replayed and reported again
    assert stats[sid]["rounds_completed"] > 0  # and the new server summed the rest of the run


@pytest.mark.timeout(180)
def test_a_machines_process_killed_mid_fused_step_and_started_again_sums_exactly_from_its_first_step(
        make_cluster: Any) -> None:
    """One process per machine; machine 1's is killed (-9) with half a step of fused small sums issued, so its
    worker daemon resets (every process gone) while plans of that step are on their way or half run, then a new
    process starts there from step 0. The healthy process gets errors for the steps in between (if it issued them
    before the reset), never a hang; then every name is summed with the new process's steps 0, 1, 2, ... in
    order, exactly, and the new process with consecutive steps of the healthy one, without an error. (Lane
    generations, bps_server.fusion, keep the lanes in step when a plan reaches the machine only after its reset;
    this test passed before them too, as such a plan is rare here: tests/pure/test_fused_driver.py makes it
    happen.)"""
    n, steps, kill_after = 40, 6, 4
    cluster = make_cluster([1, 1], cluster={"timeout": TIMEOUT_S})
    ctx = rank_context()
    queue = ctx.Queue()
    sockets = [w.socket for w in cluster.config.worker_specs]
    procs = []

    def rank(worker: int, role: str) -> None:
        p = ctx.Process(target=_rank_main, args=(queue, sockets[worker], 0, worker, fp.reset_loop,
                                                 (role, n, steps, kill_after, 120.0), 10.0), daemon=True)
        p.start()
        procs.append(p)

    try:
        rank(0, "healthy")
        rank(1, "victim")
        procs[1].join(timeout=90)
        assert procs[1].exitcode == -9, "the victim did not reach its kill"
        rank(1, "new")
        results: dict[int, Any] = {}
        while len(results) < 2:
            r, status, value = queue.get(timeout=150)
            assert status == "ok", f"rank {r}: {value}\n{daemon_logs(cluster)[-6000:]}"
            results[r] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    healthy, new = results[0], results[1]
    for i in range(n):
        seen, at = healthy["seen"][i], healthy["restarted"][i]
        assert seen[:at] == [float(s) for s in range(at)] and at >= kill_after, (i, seen, at)  # the victim's
        assert seen[at:at + steps] == [float(s) for s in range(steps)], (i, seen, at, daemon_logs(cluster)[-6000:])
        mine = new["seen"][i]  # the healthy process's steps, summed with the new one's 0 .. steps - 1
        assert len(mine) == steps and mine == [mine[0] + s for s in range(steps)], (i, mine)
    assert new["error_count"] == 0, new["errors"]
    # The steps in between failed naming the machine whose processes left. Usually there are some: the healthy
    # process issues its step as the victim issues half of it. Where the healthy one came to issue it only after
    # machine 1's reset (a loaded box: 1 run in about 20 under a busy loop), that step waits for the new
    # process's step 0 instead, and none fails: the sums above are exact either way.
    assert all("worker 1" in e for e in healthy["errors"]), healthy["errors"]


def _run_on(cluster: Any, workers: list[int], target: Any, *args: Any, die: bool = False) -> dict[int, Any]:
    """``target(*args)`` in one process on each of ``workers`` (local rank 0, one process a machine): each
    one's result (None for one that ``die``s, killed -9 by itself)."""
    ctx = rank_context()
    queue = ctx.Queue()
    sockets = [w.socket for w in cluster.config.worker_specs]
    procs = [ctx.Process(target=_rank_main, args=(queue, sockets[w], 0, w, target, args, 10.0), daemon=True)
             for w in workers]
    for p in procs:
        p.start()
    try:
        if die:
            for p in procs:
                p.join(timeout=60)
                assert p.exitcode == -9, "the process did not reach its kill"
            return {w: None for w in workers}
        results = {}
        while len(results) < len(workers):
            r, status, value = queue.get(timeout=60)
            assert status == "ok", f"rank {r}: {value}\n{daemon_logs(cluster)[-6000:]}"
            results[r] = value
        return results
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


@pytest.mark.timeout(180)
def test_a_small_sum_whose_peer_machine_has_no_processes_fails_after_the_timeout_and_the_next_job_is_clean(
        make_cluster: Any) -> None:
    """Machine 1's processes ran a job and left (its daemon reset). Machine 0's next process alone pushes small
    (fused) sums: they waited for ever (a review's case; unfused rounds fail after the timeout), and a process
    killed while they waited left the next job's first step failing on every process with that job's errors.
    Now they fail after the timeout naming the machine without processes, and the next job sums exactly."""
    cluster = make_cluster([1, 1], cluster={"timeout": TIMEOUT_S})
    first = _run_on(cluster, [0, 1], fp.small_sums, ["x", "y"], 8)
    assert all(r["exact"] == {"x": True, "y": True} for r in first.values()), first
    (alone,) = _run_on(cluster, [0], fp.small_sums, ["x"], 8).values()
    assert list(alone["errors"]) == ["x"] and alone["errors"]["x"][0] == "BPSConnectionError", alone  # (no processes)
    assert "worker 1 had no training processes: none had started yet" in alone["errors"]["x"][1], alone
    assert TIMEOUT_S - 0.5 < alone["waited"] < 2.5 * TIMEOUT_S + 2, alone["waited"]
    _run_on(cluster, [0], fp.small_sums, ["y"], 8, 1.0, die=True)  # killed while "y" waits for machine 1
    for _ in range(2):  # the next jobs: clean
        after = _run_on(cluster, [0, 1], fp.small_sums, ["x", "y"], 8)
        assert all(r["exact"] == {"x": True, "y": True} and not r["errors"] for r in after.values()), after
    # A machine whose processes pushed (a large, unfused sum) has processes, also where it falls behind on a small
    # sum for longer than the timeout: a stall, not a timeout (the planner only took a report as its processes
    # back: "worker 1 has no training processes", a review's case).
    late = _run_on(cluster, [0, 1], fp.big_then_small, 1, 1.5 * TIMEOUT_S)
    assert all(r == {"error": None, "exact": True} for r in late.values()), late


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fusion", ["default", "0"])
def test_a_job_killed_beside_a_daemon_idle_since_it_started_leaves_the_next_job_exact(
        make_cluster: Any, monkeypatch: pytest.MonkeyPatch, fusion: str) -> None:
    """Fresh daemons: machine 0's process alone issues its sums (machine 1's never started) and is killed while
    they wait. Machine 1's daemon never had processes, so it never said Reset, and the failed rounds waited for
    it: the next job's first step failed on machine 1 and every later step was summed one apart on both (wrong
    sums without an error, a review's case). Fused (the planner) and unfused (the round table)."""
    if fusion != "default":
        monkeypatch.setenv("BPS_FUSION_BYTES", fusion)
    cluster = make_cluster([1, 1], cluster={"timeout": TIMEOUT_S})
    _run_on(cluster, [0], fp.small_sums, ["x", "y"], 8, 1.0, die=True)
    for _ in range(2):
        after = _run_on(cluster, [0, 1], fp.small_sums, ["x", "y"], 8)
        assert all(r["exact"] == {"x": True, "y": True} and not r["errors"] for r in after.values()), after
