"""The anchor server's plans of fused small sums (``bps_server.fusion``), without sockets or a loop."""

from __future__ import annotations

import pickle

from bps_server.fusion import Planner
from protocol.messages import FUSED_NAMES_BUDGET, MAX_FUSED_ENTRIES, Spec, Why, fused_name

F32: Spec = ("float32", (4,), False, "")
F16: Spec = ("float16", (4,), False, "")


def test_names_are_planned_once_every_worker_reported_them_in_whatever_order_and_batches():
    p = Planner(3)
    assert p.report(0, ["a", "b", "c"], [F32] * 3) == []
    assert p.report(2, ["c", "b"], [F32] * 2) == []
    assert p.take_plans() == []
    assert p.report(1, ["b", "a", "c"], [F32] * 3) == []
    assert p.take_plans() == [(0, ["b", "c"])]  # a still waits for worker 2
    p.report(2, ["a"], [F32])
    assert p.take_plans() == [(1, ["a"])]
    assert p.take_plans() == [] and not p.waiting
    assert (p.plans, p.planned) == (2, 3)


def test_a_report_repeated_by_a_reconnecting_worker_changes_nothing():
    p = Planner(2)
    p.report(0, ["a"], [F32])
    p.report(0, ["a"], [F32])
    assert p.take_plans() == [] and p.waiting["a"].workers == {0}


def test_plans_stay_within_a_message():
    p = Planner(1)
    names = [f"t{i:05d}" for i in range(2 * MAX_FUSED_ENTRIES + 5)]
    p.report(0, names, [F32] * len(names))
    plans = p.take_plans()
    assert [seq for seq, _ in plans] == list(range(len(plans)))
    assert [n for _, chunk in plans for n in chunk] == names  # every name once, in order
    assert all(len(chunk) <= MAX_FUSED_ENTRIES and sum(len(n) + 16 for n in chunk) <= FUSED_NAMES_BUDGET
               for _, chunk in plans)


def test_workers_that_disagree_fail_that_name_everywhere_each_hearing_its_own_side():
    p = Planner(3)
    p.report(0, ["a", "b"], [F32, F32])
    failed = p.report(1, ["a", "b"], [F16, F32])
    sides = {f.worker: (f.why.code, f.why.ours, f.why.theirs) for f in failed}
    assert sides == {0: ("mismatch", "float32[4]", "float16[4]"), 1: ("mismatch", "float16[4]", "float32[4]")}
    assert all(f.name == "a" and "worker 0 has float32[4] but worker 1 has float16[4]" in f.why.text for f in failed)
    # worker 2 hears it when it reports a; b is planned normally
    late = p.report(2, ["a", "b"], [F32, F32])
    assert [(f.worker, f.name, f.why.code, f.why.ours) for f in late] == [(2, "a", "mismatch", "float32[4]")]
    assert p.take_plans() == [(0, ["b"])]
    assert not p.failed and not p.waiting
    assert p.report(0, ["a"], [F32]) == []  # a new round of a


def test_an_abort_fails_the_name_for_those_that_reported_it_and_those_that_will():
    p = Planner(3)
    p.report(0, ["a"], [F32])
    failed = p.abort(1, ["a", "z"], Why("worker 1 gave it up", "round_failed"))
    assert [(f.worker, f.name) for f in failed] == [(0, "a")]
    assert [(f.worker, f.name) for f in p.report(2, ["a", "z"], [F32, F32])] == [(2, "a"), (2, "z")]
    assert [(f.worker, f.name) for f in p.report(0, ["z"], [F32])] == [(0, "z")]
    assert not p.failed


def test_an_abort_of_a_name_ready_but_not_yet_planned_takes_it_out_of_the_plan():
    p = Planner(2)
    p.report(0, ["a", "b"], [F32, F32])
    p.report(1, ["a", "b"], [F32, F32])
    failed = p.abort(1, ["a"], Why("gave up", "round_failed"))
    assert [(f.worker, f.name) for f in failed] == [(0, "a")]
    assert p.take_plans() == [(0, ["b"])]


def test_a_reset_worker_fails_every_waiting_name_and_no_failure_waits_for_it():
    p = Planner(3)
    p.report(0, ["a"], [F32])
    p.report(1, ["b"], [F32])
    p.abort(0, ["c"], Why("worker 0 gave c up", "round_failed"))  # worker 1 and 2 still to hear it
    failed = p.worker_gone(1, Why("every process of worker 1 left", "round_failed"), reset=True)
    assert sorted((f.worker, f.name) for f in failed) == [(0, "a")]  # 1 is gone: nobody to tell
    assert set(p.failed) == {"a", "b", "c"}
    assert p.failed["a"][0][1] == {2} and p.failed["b"][0][1] == {0, 2} and p.failed["c"][0][1] == {2}
    p.worker_gone(2, Why("worker 2 reset", "round_failed"), reset=True)
    assert p.failed["b"][0][1] == {0} and "a" not in p.failed and "c" not in p.failed


def test_a_reset_spares_the_names_it_is_told_are_of_a_later_job_and_they_are_planned_with_its_next_processes():
    """As the round table's (bps_server.jobs): worker 0's trainer of the next job reported 'next' while worker 1's
    of the last job lingered (and reported 'last'); worker 1's Reset failed 'next' too."""
    p = Planner(2)
    p.report(1, ["last"], [F32])
    p.report(0, ["next"], [F32])
    failed = p.worker_gone(1, Why("every process of worker 1 left", "round_failed"), reset=True, epoch="b",
                           spared=lambda workers: 1 not in workers)
    assert failed == [] and "last" not in p.waiting and "next" in p.waiting  # ('last': 1 is gone, nobody to tell)
    p.report(1, ["next"], [F32])
    assert p.take_plans() and "next" not in p.waiting


def test_a_worker_whose_connection_dropped_still_hears_the_rounds_it_had_not_reported():
    """Its processes live on: once it is back it reports the rounds it had not reported, and each must meet
    its failure, not wait here as a new round that the peers' next step would join (steps summed together)."""
    p = Planner(3)
    p.report(0, ["a"], [F32])
    p.report(1, ["b"], [F32])
    p.abort(0, ["c"], Why("worker 0 gave c up", "round_failed"))
    failed = p.worker_gone(1, Why("worker 1 disconnected", "connection"), reset=False)
    assert sorted((f.worker, f.name) for f in failed) == [(0, "a")]  # b: worker 1 fails what it reported itself
    assert p.failed["a"][0][1] == {1, 2} and p.failed["b"][0][1] == {0, 2} and p.failed["c"][0][1] == {1, 2}
    late = p.report(1, ["a", "c"], [F32, F32])  # back, on a new connection
    assert sorted((f.worker, f.name, f.why.text) for f in late) == [
        (1, "a", "worker 1 disconnected"), (1, "c", "worker 0 gave c up")]
    assert not p.waiting and p.failed["a"][0][1] == {2}


def test_after_a_restart_a_worker_that_lost_a_plan_gets_it_again_whichever_message_comes_first():
    # worker 0 ran plan 7 (a, b: their 3rd plan); worker 1 lost it when the server died
    for running_first in (True, False):
        p = Planner(2)
        if running_first:
            p.running(0, 7, ["a", "b"], [3, 3])
        assert p.report(1, ["a", "b", "c"], [F32] * 3, [2, 2, 5]) == []
        if not running_first:
            p.running(0, 7, ["a", "b"], [3, 3])
        assert [(r.worker, r.seq, r.names) for r in p.take_resends()] == [(1, 7, ["a", "b"])]
        assert set(p.waiting) == {"c"}  # a and b wait for nobody: worker 1 runs plan 7 now
        # the next round of a (count 3 on both) is an ordinary one
        p.report(0, ["a"], [F32], [3])
        p.report(1, ["a"], [F32], [3])
        assert p.take_plans() == [(0, ["a"])] and "a" not in p.running_names


def test_plans_of_two_previous_runs_with_one_seq_are_each_sent_again_on_their_own_lanes():
    """We restarted twice; worker 0 still runs plan 0 of each previous run (every run numbers its plans from 0):
    ``a`` on generation r1.0, ``b`` on r2.0. Worker 1 lost both: it gets each again, with its names and lanes.
    Before, the plans running were keyed by seq alone: the second replaced the first, and worker 1 got plan 0
    of r2.0 alone, while worker 0's round of ``a`` waited for it for ever."""
    p = Planner(2, run="r3")
    p.running(0, 0, ["a"], [3], None, "r1.0")
    p.running(0, 0, ["b"], [5], None, "r2.0")
    assert p.report(1, ["a", "b"], [F32, F32], [2, 4]) == [] and not p.waiting
    resent = sorted((r.worker, r.seq, r.names, r.how, r.lanes) for r in p.take_resends())
    assert resent == [(1, 0, ["a"], "restart", "r1.0"), (1, 0, ["b"], "restart", "r2.0")]


def test_a_worker_that_ran_the_plan_too_reports_the_next_round_and_gets_no_resend():
    p = Planner(2)
    p.running(0, 7, ["a"], [3])
    p.running(1, 7, ["a"], [3])
    p.report(1, ["a"], [F32], [3])
    assert p.take_resends() == [] and p.waiting["a"].workers == {1}


def test_a_name_that_waits_for_a_worker_is_said_in_the_log_after_the_timeout_and_again():
    p = Planner(3, warn_after_s=5.0)
    p.report(0, ["late"], [F32], [1], now=100.0)
    p.report(2, ["late"], [F32], [1], now=101.0)
    assert p.stall_warnings(104.0) == []
    [stall] = p.stall_warnings(105.5)
    assert stall.told == (0, 1, 2)  # told to every worker: those that wait, and the one waited for
    assert stall.text == ("stall: round 1 of 'late' part 0 has waited 5.5 s for worker 1, whose processes have not pushed "
                    "it (pushed by worker 0, 2)")
    assert p.stall_warnings(107.0) == [] and len(p.stall_warnings(110.6)) == 1
    p.report(1, ["late"], [F32], [1], now=111.0)
    assert p.stall_warnings(200.0) == []  # planned: nothing waits


def _unfused_why(spec: Spec) -> Why:
    return Why.mismatch("a", "float32[4]", "float32[400]", "sizes on both sides of the fusion limit")


def test_a_worker_that_pushed_a_waiting_name_unfused_fails_it_for_the_reporters_and_is_not_waited_for():
    p = Planner(3)
    p.report(0, ["a"], [F32])
    failed = p.pushed_unfused(1, "a", _unfused_why, {1})
    assert [(f.worker, f.name, f.why.code, f.why.ours, f.why.theirs) for f in failed] == \
        [(0, "a", "mismatch", "float32[4]", "float32[400]")]
    assert p.failed["a"][0][1] == {2}  # worker 2 hears it when it reports a; worker 1 took the other path
    # worker 2 pushed it unfused too: nobody is left to tell, and its next fused report is a new round
    assert p.pushed_unfused(2, "a", _unfused_why, {1, 2}) == [] and not p.failed
    assert p.report(2, ["a"], [F32]) == [] and p.waiting["a"].workers == {2}


def test_an_unfused_push_of_a_name_nobody_reported_changes_nothing():
    p = Planner(2)
    assert p.pushed_unfused(1, "a", _unfused_why, {1}) == [] and not p.failed and not p.waiting
    p.report(1, ["a"], [F32])  # the pusher's own report (it reported, then pushed another round)
    assert p.pushed_unfused(1, "a", _unfused_why, {1}) == [] and p.waiting["a"].workers == {1}


def test_an_abort_does_not_wait_for_the_workers_that_pushed_the_name_unfused():
    """Their next fused report of the name is a round of its own: a failure left waiting for it would fail it."""
    p = Planner(3)
    p.abort(0, ["a"], Why("worker 0 gave it up", "round_failed"), lambda name: {1})
    assert p.failed["a"][0][1] == {2}
    p.abort(0, ["b"], Why("worker 0 gave it up", "round_failed"), lambda name: {1, 2})
    assert "b" not in p.failed


def test_a_second_abort_of_a_failed_name_stops_waiting_for_its_sender_and_adds_nobody():
    """A name failed already (its reporters told, worker 0 left to hear it): worker 0's own abort of it means
    worker 0 heard it; it must not fail worker 0's next, valid report of the name."""
    p = Planner(3)
    p.report(2, ["a"], [F32])
    p.pushed_unfused(1, "a", _unfused_why, {1})
    assert p.failed["a"][0][1] == {0}
    assert p.abort(0, ["a"], Why("worker 0 gave it up", "round_failed")) == []
    assert "a" not in p.failed
    assert p.report(0, ["a"], [F32]) == [] and p.waiting["a"].workers == {0}


def test_aborts_of_two_rounds_before_the_other_worker_reports_fail_both_of_its_rounds():
    """Worker 0's processes disagree on ``a`` two steps running; both aborts come before worker 1's first
    report (its processes are slower). Worker 1 hears a failure for each of its two rounds, in order: the
    second abort is a round of its own, not the first one again (the hang of test_silent_mismatch)."""
    p = Planner(2)
    assert p.abort(0, ["a"], Why("step 1", "round_failed")) == []
    assert p.abort(0, ["a"], Why("step 2", "round_failed")) == []
    first = p.report(1, ["a"], [F32])
    assert [(f.worker, f.name, f.why.text) for f in first] == [(1, "a", "step 1")]
    second = p.report(1, ["a"], [F32])
    assert [(f.worker, f.name, f.why.text) for f in second] == [(1, "a", "step 2")]
    assert not p.failed and not p.waiting
    # the third round is an ordinary one again
    assert p.report(1, ["a"], [F32]) == [] and p.report(0, ["a"], [F32]) == []
    assert p.take_plans() == [(0, ["a"])]


def test_an_abort_of_a_round_already_failed_comes_before_the_next_round_waiting():
    """Round 1 of ``a`` failed (worker 1 gave it up) before worker 0 reported it; worker 2 heard and reports
    round 2. Worker 0's abort is of round 1 (its own processes disagreed too): it ends worker 0's part of round
    1 and leaves round 2 waiting; worker 0's next report joins round 2."""
    p = Planner(3)
    p.report(2, ["a"], [F32])
    assert [(f.worker, f.why.text) for f in p.abort(1, ["a"], Why("round 1", "round_failed"))] == [(2, "round 1")]
    assert p.report(2, ["a"], [F32]) == []  # round 2
    assert p.abort(0, ["a"], Why("worker 0's round 1", "round_failed")) == []
    assert p.waiting["a"].workers == {2} and not p.failed
    assert p.report(0, ["a"], [F32]) == [] and p.report(1, ["a"], [F32]) == []
    assert p.take_plans() == [(0, ["a"])]


def test_a_name_every_worker_reported_is_not_planned_once_one_of_them_dropped():
    """The plan would not reach the worker that dropped (it fails what it reported on that connection): the
    others would run it without it."""
    p = Planner(2)
    p.report(0, ["a"], [F32])
    p.report(1, ["a"], [F32])
    told = p.worker_gone(1, Why("worker 1 disconnected", "connection"), reset=False)
    assert [(f.worker, f.name) for f in told] == [(0, "a")]
    assert p.take_plans() == [] and not p.failed


def test_an_abort_of_a_reported_round_fails_it_for_every_reporter_the_aborting_one_too():
    """Every report gets one answer: the worker that gave its reported round up hears the failure as well (it
    ends the round it keeps for that answer, see bps_worker.fusion)."""
    p = Planner(3)
    p.report(0, ["a"], [F32])
    p.report(1, ["a"], [F32])
    told = p.abort(1, ["a"], Why("a rank of worker 1 left", "connection"), reported=True)
    assert sorted((f.worker, f.why.text) for f in told) == [(0, "a rank of worker 1 left"),
                                                            (1, "a rank of worker 1 left")]
    assert p.failed["a"] == [(told[0].why, {2}, -1)]  # worker 2 hears it when it reports that round
    # ready, not yet planned: out of the plan, and every worker hears
    q = Planner(2)
    q.report(0, ["b"], [F32])
    q.report(1, ["b"], [F32])
    assert sorted(f.worker for f in q.abort(0, ["b"], Why("left", "connection"), reported=True)) == [0, 1]
    assert q.take_plans() == [] and not q.failed


def test_an_abort_of_a_reported_round_already_planned_or_failed_is_not_taken_for_the_next_round():
    """The plan went out (the worker fails its group when the plan names a round it gave up), or the round
    failed already: the abort changes nothing here. Taken for the worker's next round, it would fail the
    peers' next round of the name, which every worker runs in full."""
    p = Planner(2)
    p.report(0, ["a"], [F32])
    p.report(1, ["a"], [F32])
    assert p.take_plans() == [(0, ["a"])]
    assert p.abort(1, ["a"], Why("left", "connection"), reported=True) == []
    assert not p.failed
    p.report(0, ["a"], [F32])  # the next round
    assert p.abort(1, ["a"], Why("late", "connection"), reported=True) == []  # worker 1 did not report it
    assert p.report(1, ["a"], [F32]) == [] and p.take_plans() == [(1, ["a"])]
    # failed already: worker 0 disagreed; worker 1's abort of its own report of that round is an echo
    p.report(1, ["a"], [F32])
    assert sorted(f.worker for f in p.report(0, ["a"], [F16])) == [0, 1]
    assert p.abort(1, ["a"], Why("left", "connection"), reported=True) == [] and not p.failed
    assert p.report(0, ["a"], [F32]) == [] and p.waiting["a"].workers == {0}


def test_a_report_beside_an_unfused_round_fails_the_report_and_takes_no_failed_round_of_the_pushers():
    """Worker 1 pushed round 2 of ``a`` unfused after it heard round 1 failed (the failure waits for worker 2):
    worker 0's report of round 2 meets that push. Its failure must not also use up a failed round of worker
    1's: worker 1's part of round 1 ended when it pushed (its processes heard it)."""
    p = Planner(3)
    p.abort(2, ["a"], Why("round 1", "round_failed"))  # round 1 fails; workers 0 and 1 to hear it
    assert [f.why.text for f in p.report(0, ["a"], [F32])] == ["round 1"]
    p.pushed_unfused(1, "a", _unfused_why, {1})  # round 2 unfused: ends worker 1's round 1
    assert not p.failed
    p.report(0, ["a"], [F32])  # round 2, fused
    told = p.reported_beside_unfused(0, "a", _unfused_why(F32), {1})
    assert [(f.worker, f.why.code) for f in told] == [(0, "mismatch")]
    assert p.failed["a"][0][1] == {2}  # worker 2 still to hear round 2; worker 1 heard it through its push
    # worker 0's own report is not failed for a push it made itself
    assert p.reported_beside_unfused(0, "b", _unfused_why(F32), {0}) == []


def _explore(acts: list[list[str]]) -> int:
    """Every order in which the workers' reports ("R") and aborts ("A") of one name can reach the planner,
    round by round (``acts[w][k]``: worker w's round k). A worker's next round starts once it heard its
    report's outcome (a plan, or a failure) or right after its abort (its processes hear it from their
    worker). Each reporter must hear its own round's outcome: the sum when every worker reported the round,
    else a failure naming that round; nobody waits for ever and nothing stays in the planner. Returns the
    number of orders explored."""
    workers, rounds = len(acts), len(acts[0])

    def walk(p: Planner, at: tuple[int, ...], pending: frozenset[int]) -> int:
        enabled = [w for w in range(workers) if w not in pending and at[w] < rounds]
        if not enabled:
            assert not pending, f"{acts}: workers {sorted(pending)} wait for ever at rounds {at}"
            assert not p.waiting and not p.failed and not p.ready, (acts, p.waiting, p.failed)
            return 1
        explored = 0
        for w in enabled:
            q = pickle.loads(pickle.dumps(p, pickle.HIGHEST_PROTOCOL))
            now, waits = list(at), set(pending)
            k = now[w]
            if acts[w][k] == "A":
                told = q.abort(w, ["a"], Why(f"round {k}", "round_failed"))
                now[w] += 1
            else:
                told = q.report(w, ["a"], [F32])
                waits.add(w)
            for f in told:
                assert f.worker in waits, (acts, f)
                assert "A" in [acts[v][now[f.worker]] for v in range(workers)], (acts, f, now)
                assert f.why.text == f"round {now[f.worker]}", (acts, f, now)
                waits.discard(f.worker)
                now[f.worker] += 1
            for _, names in q.take_plans():
                assert names == ["a"] and waits == set(range(workers)), (acts, now, waits)
                assert len(set(now)) == 1, (acts, now)  # one round, the same on every worker
                assert all(acts[v][now[v]] == "R" for v in range(workers)), (acts, now)
                for v in range(workers):
                    now[v] += 1
                waits.clear()
            explored += walk(q, tuple(now), frozenset(waits))
        return explored

    return walk(Planner(workers), (0,) * workers, frozenset())


def test_every_order_of_reports_and_aborts_over_rounds_gives_each_round_its_outcome():
    """Exhaustive over small cases: 2 workers x 4 rounds and 3 workers x 2 rounds, every mix of reports and
    aborts per round, every order their messages can take."""
    import itertools

    orders = 0
    for workers, rounds in ((2, 4), (3, 2)):
        for mix in itertools.product("RA", repeat=workers * rounds):
            acts = [list(mix[w * rounds:(w + 1) * rounds]) for w in range(workers)]
            orders += _explore(acts)
    assert orders > 10_000, orders  # the walk did explore


def test_a_report_lost_with_a_broken_connection_is_failed_by_the_resync_not_by_the_next_report():
    """Worker 1's report of round 1 was written on a connection that broke before we read it: it failed the
    round itself. Told of one round by its resync, we fail round 1 for it; its next report is round 2's."""
    p = Planner(2)
    p.report(0, ["a"], [F32])  # round 1
    p.worker_gone(1, Why("worker 1 disconnected", "connection"), reset=False)  # worker 0 hears round 1 failed
    assert p.failed["a"][0][1] == {1}
    lost = Why("lost with the connection", "connection")
    assert p.resync(1, ["a"], [1], lost) == [] and not p.failed  # worker 1 knows: nobody to tell
    assert p.resync(1, ["a"], [1], lost) == []  # told again: nothing more was lost
    assert p.report(0, ["a"], [F32]) == [] and p.report(1, ["a"], [F32]) == []  # round 2 on both
    assert p.take_plans() == [(0, ["a"])]
    assert p.heard["a"] == [2, 2]


def test_an_abort_lost_with_a_broken_connection_fails_the_round_for_the_peers():
    """Worker 1 gave round 1 of ``b`` up before anyone reported it; the abort was lost. The resync fails the
    round for worker 0, which would otherwise wait for worker 1's report for good."""
    p = Planner(2)
    p.worker_gone(1, Why("worker 1 disconnected", "connection"), reset=False)
    assert p.resync(1, ["b", "c"], [1, 0], Why("lost", "connection")) == []
    assert [(f.worker, f.name) for f in p.report(0, ["b"], [F32])] == [(0, "b")]
    assert not p.failed and not p.waiting


def test_new_processes_on_a_worker_start_its_counts_again_and_are_not_waited_for_by_old_failures():
    p = Planner(2)
    p.worker_hello(1, "epoch-1")
    p.report(1, ["x"], [F32])
    p.report(0, ["a"], [F32])
    p.worker_gone(1, Why("worker 1 disconnected", "connection"), reset=False)
    assert p.failed["a"][0][1] == {1}
    p.worker_hello(1, "epoch-1")  # the same processes, reconnected: still owed the failure
    assert p.failed["a"][0][1] == {1}
    p.worker_hello(1, "epoch-2")  # new processes: they start at the peers' step
    assert "a" not in p.failed and p.failed["x"][0][1] == {0} and p.heard["x"] == [0, 0]


def test_the_plans_a_broken_connection_lost_can_be_sent_again_while_kept():
    p = Planner(1)
    for name in ("a", "b", "c"):
        p.report(0, [name], [F32])
        p.take_plans()
    assert p.sent_since(1, 0) == [(1, ["b"], ".0"), (2, ["c"], ".0")] and p.sent_since(3, 0) == []
    p.history.popleft()
    assert p.sent_since(0, 0) is None and p.sent_since(1, 0) == [(1, ["b"], ".0"), (2, ["c"], ".0")]
    p.worker_hello(0, "e", "another-daemon")  # a new daemon got none of the plans made before it
    assert p.sent_since(0, 0) == []


def test_the_plan_history_is_bounded_by_names_and_keeps_twice_every_name_heard_of():
    from bps_server.fusion import PLAN_HISTORY_NAMES

    p = Planner(1)
    names = [f"n{i}" for i in range(100)]
    for _ in range(1000):  # 100,000 names planned, of 100 distinct ones
        p.report(0, names, [F32] * 100)
        p.take_plans()
    kept = sum(len(n) for _, n, _ in p.history)
    assert PLAN_HISTORY_NAMES - 100 < kept <= PLAN_HISTORY_NAMES
    assert p.sent_since(0, 0) is None and p.sent_since(p.seq - 1, 0) == [(p.seq - 1, names, ".0")]


def test_a_reset_says_the_new_epoch_so_the_next_hello_does_not_excuse_the_new_processes_again():
    """Found by a simulation of resets: the hello that follows a Reset (a reconnect) carried the epoch the
    planner had not recorded, so it zeroed the counts of rounds the new processes had reported since; the
    next resync then failed them as lost, and the peer's steps shifted by one."""
    p = Planner(2)
    p.worker_hello(1, "e1")
    p.worker_gone(1, Why("every process of worker 1 left", "round_failed"), reset=True, epoch="e2")
    p.report(1, ["a"], [F32])  # the new processes' first round
    p.worker_gone(1, Why("worker 1 disconnected", "connection"), reset=False)
    p.worker_hello(1, "e2")  # it reconnects: the same processes
    assert p.heard["a"] == [0, 1]
    assert p.resync(1, ["a"], [1], Why("lost", "connection")) == []  # nothing was lost
    assert p.failed["a"][0][1] == {0}  # (the drop failed a, for worker 0 to hear; nothing for worker 1)


def test_a_plan_says_each_names_group_in_a_short_list_of_groups():
    p = Planner(2)
    f32_8: Spec = ("float32", (8,), False, "")
    avg: Spec = ("float32", (4,), True, "")
    names = ["a", "b", "c", "d"]
    specs = [F32, F16, f32_8, avg]
    p.report(0, names, specs)
    p.report(1, names, specs)
    ((seq, planned),) = p.take_plans()
    assert p.groups(planned) == ([["float32", False], ["float16", False], ["float32", True]], [0, 1, 0, 2])
    assert p.groups(["a", "unknown"]) == ([], [])  # not all known here: the worker groups by its own specs


def test_the_plans_before_a_workers_new_epoch_are_its_old_processes_and_never_sent_to_it_again():
    """The fused answers carry the epoch the server knows the worker by (from its hello, then its Reset); the
    plans made before the worker's epoch changed were its old processes': a resync asking for them again (a
    plan lost with a connection) gets only the later ones."""
    p = Planner(2)
    p.worker_hello(0, "e1", "d0")
    p.worker_hello(1, "f1", "d1")
    for name in ("a", "b"):
        p.report(0, [name], [F32])
        p.report(1, [name], [F32])
        p.take_plans()
    assert p.epoch(0) == "e1" and p.sent_since(0, 0) == [(0, ["a"], ".0"), (1, ["b"], ".0")]
    p.worker_gone(0, Why("every training process of worker 0 left", "round_failed"), reset=True, epoch="e2")
    assert p.epoch(0) == "e2" and p.sent_since(1, 0) == [] and p.sent_since(1, 1) == [(1, ["b"], ".0")]  # (its own lanes)
    p.report(0, ["c"], [F32])
    p.report(1, ["c"], [F32])
    p.take_plans()
    assert p.sent_since(0, 0) == [(2, ["c"], ".1")]  # (on the lanes the reset began)
    p.worker_hello(1, "f2", "d1")  # a new epoch said by a hello alone (its Reset lost with a connection)
    assert p.epoch(1) == "f2" and p.sent_since(0, 1) == []


def test_a_round_below_another_workers_is_stale_and_fails_for_its_worker_alone():
    """Rounds say their index (FuseReady.rounds): a worker's round that another worker is past never meets
    theirs (it failed on their side, and our previous run died before telling it): it fails at once,
    whichever came first; the later one waits for its peers."""
    p = Planner(2)
    assert p.report(1, ["a"], [F32], rounds=[7]) == []
    (f,) = p.report(0, ["a"], [F32], rounds=[5])
    assert (f.worker, f.name, f.why.code) == (0, "a", "round_failed") and "round 5" in f.why.text
    assert p.waiting["a"].workers == {1} and p.waiting["a"].index == 7
    assert [f.worker for f in p.report(0, ["a"], [F32], rounds=[6])] == [0]
    assert p.report(0, ["a"], [F32], rounds=[7]) == [] and p.take_plans() == [(0, ["a"])]
    q = Planner(2)
    assert q.report(0, ["b"], [F32], rounds=[2]) == []
    assert [f.worker for f in q.report(1, ["b"], [F32], rounds=[3])] == [0]  # worker 0's round 2: stale
    assert q.waiting["b"].workers == {1} and q.take_plans() == []


def test_a_round_without_an_index_is_matched_by_order():
    p = Planner(2)
    assert p.report(1, ["a"], [F32], rounds=[7]) == []
    assert p.report(0, ["a"], [F32]) == [] and p.take_plans() == [(0, ["a"])]


def test_a_failed_round_is_taken_by_the_round_of_its_index():
    """A failed round waits for the workers that did not report it: a worker past it (its own report or abort
    went to our previous run) is out of it; a worker's older round fails as stale and leaves it waiting."""
    p = Planner(3)
    p.report(0, ["a"], [F32], rounds=[4])
    p.abort(1, ["a"], Why("gave up", "round_failed"), rounds=[4])
    assert p.failed["a"][0][1:] == ({2}, 4)
    assert [f.why.text for f in p.report(2, ["a"], [F32], rounds=[3])][0].startswith("tensor 'a': worker 2 is at")
    assert p.failed["a"][0][1:] == ({2}, 4)  # still to hear round 4
    assert p.report(2, ["a"], [F32], rounds=[5]) == [] and "a" not in p.failed  # past it
    assert p.waiting["a"].workers == {2}


def test_an_abort_of_a_round_the_others_are_past_touches_nothing_and_one_past_theirs_fails_them():
    p = Planner(2)
    p.report(1, ["a"], [F32], rounds=[3])
    assert p.abort(0, ["a"], Why("gave up", "round_failed"), rounds=[2]) == [] and p.waiting["a"].workers == {1}
    assert [f.worker for f in p.abort(0, ["a"], Why("gave up", "round_failed"), rounds=[4])] == [1]
    assert p.failed["a"][0][1:] == ({1}, 4)  # worker 1's round 4 fails when it comes
    assert [f.worker for f in p.report(1, ["a"], [F32], rounds=[4])] == [1] and not p.failed


def test_a_reported_round_the_run_never_heard_of_is_given_up_as_a_round_not_reported():
    """A FuseAbort(reported) whose report went to our previous run: we heard nothing of the name from that
    worker. The peers' round of that index fails; the aborting worker expects no answer."""
    p = Planner(2)
    p.report(1, ["a"], [F32], rounds=[0])
    told = p.abort(0, ["a"], Why("gave up", "round_failed"), reported=True, rounds=[0])
    assert [f.worker for f in told] == [1] and not p.waiting and not p.failed
    q = Planner(2)  # in one run: the report was heard, the abort fails it for both (as before)
    q.report(0, ["a"], [F32], rounds=[0])
    q.report(1, ["b"], [F32], rounds=[0])
    told = q.abort(0, ["a"], Why("gave up", "round_failed"), reported=True, rounds=[0])
    assert [f.worker for f in told] == [0] and q.failed["a"][0][1:] == ({1}, 0)


def test_a_worker_past_a_round_fails_the_peers_round_below_it_and_no_failed_round_waits_for_it():
    """FusePast: after a restart, worker 1 says its processes are past round 4 of "a" (and round 2 of "b"):
    worker 0's round 3 waiting here, and its round 3 reported later, never meet a round of worker 1."""
    p = Planner(2)
    p.report(0, ["a"], [F32], rounds=[3])
    p.abort(0, ["b"], Why("gave up", "round_failed"), rounds=[1])
    assert p.failed["b"][0][1:] == ({1}, 1)
    told = p.past(1, ["a", "b"], [4, 2], [0, 0])
    assert [(f.worker, f.name) for f in told] == [(0, "a")] and not p.waiting and not p.failed
    assert [f.worker for f in p.report(0, ["a"], [F32], rounds=[3])] == [0]
    p.abort(0, ["b"], Why("gave up", "round_failed"), rounds=[1])  # (again: round 1 of b was worker 1's past)
    assert not p.failed
    assert p.report(0, ["a"], [F32], rounds=[4]) == [] and p.report(1, ["a"], [F32], rounds=[4]) == []
    assert p.take_plans() == [(0, ["a"])]


def test_a_worker_past_a_plan_of_the_previous_run_it_lost_gets_it_once_to_give_up():
    """Worker 0 still runs plan 5 of our previous run (round 2 of "a"); worker 1 never got it (one plan
    behind) and is past round 2: it gets the plan to give up (as FusePlan "restart_lost"), once a
    connection, whichever of its messages shows it first."""
    p = Planner(2)
    p.running(0, 5, ["a"], [3], [2])
    p.past(1, ["a"], [3], [2])
    p.report(1, ["a"], [F32], [2], rounds=[3])
    assert [(r.worker, r.seq, r.how) for r in p.take_resends()] == [(1, 5, "restart_lost")]
    q = Planner(2)  # the other order: worker 1's FusePast first
    q.past(1, ["a"], [3], [2])
    q.running(0, 5, ["a"], [3], [2])
    assert [(r.worker, r.seq, r.how) for r in q.take_resends()] == [(1, 5, "restart_lost")]
    q.past(1, ["a"], [3], [3])  # it ran it (its count says so): nothing more
    assert q.take_resends() == []


def test_a_resync_fails_the_last_lost_round_at_its_index():
    p = Planner(2)
    p.report(1, ["a"], [F32], rounds=[1])
    told = p.resync(0, ["a", "b"], [1, 1], Why("lost", "connection"), rounds=[1, 4])  # reports lost
    assert [(f.worker, f.name) for f in told] == [(1, "a")] and p.failed["b"][0][1:] == ({1}, 4)


def test_a_report_takes_the_failed_round_of_its_index_past_an_older_one_of_no_index():
    """A resync fails the rounds it lost: the last at its index, those before it at none (older). The peer's
    report of that index takes the round of that index; the older one no longer waits for it."""
    p = Planner(2)
    p.resync(0, ["a"], [2], Why("lost", "connection"), rounds=[5])
    assert [r[2] for r in p.failed["a"]] == [-1, 5]
    assert [f.worker for f in p.report(1, ["a"], [F32], rounds=[5])] == [1] and not p.failed
    q = Planner(2)  # in order where the index does not match: the older round of no index is the report's
    q.abort(0, ["a"], Why("gave up", "round_failed"))
    q.abort(0, ["a"], Why("gave up", "round_failed"), rounds=[1])
    assert [f.why.text for f in q.report(1, ["a"], [F32], rounds=[0])] == ["gave up"]
    assert [r[2] for r in q.failed["a"]] == [1]


def test_a_replaced_workers_indexes_are_not_compared_with_its_peers():
    """A worker daemon replaced mid-job (a new daemon, a new epoch at its hello) has processes that begin at the
    peers' step but count their rounds from 0: its indexes are ignored in this run (its rounds are matched by
    order, as a reset worker's), or every round of it would fail as one the peers are past, for ever."""
    p = Planner(2)
    p.worker_hello(0, "e0", "d0")
    p.worker_hello(1, "e1", "d1")
    for step in range(5):
        assert p.report(0, ["a"], [F32], rounds=[step]) == []
        assert p.report(1, ["a"], [F32], rounds=[step]) == []
        assert p.take_plans() == [(step, ["a"])]
    p.worker_hello(1, "e1b", "d1b")  # worker 1's machine came back with a new daemon and new processes
    assert p.report(0, ["a"], [F32], rounds=[5]) == []
    assert p.report(1, ["a"], [F32], rounds=[0]) == []  # its first round: the peers' step 5
    assert p.take_plans() == [(5, ["a"])]
    assert p.report(1, ["a"], [F32], rounds=[1]) == []  # and it may come first
    assert p.report(0, ["a"], [F32], rounds=[6]) == []
    assert p.take_plans() == [(6, ["a"])]
    assert p.abort(1, ["a"], Why("a process disagreed", "round_failed"), rounds=[2]) == []
    assert [f.worker for f in p.report(0, ["a"], [F32], rounds=[7])] == [0]  # the abort's round is step 7's


def test_a_reporter_that_says_no_index_does_not_turn_off_the_others_comparison():
    """Three workers after a restart of the anchor: worker 0 reports again a round the old run failed (its
    FuseFailed lost in the crash: index 5), worker 1 (reset earlier: no index) reports its current round, and
    worker 2 is past round 5. Worker 0's round is stale and fails; worker 1's waits on, for worker 2's round 6.
    Before, worker 1's report made the waiting round take any index, and worker 0's step 5 was summed with
    worker 2's step 6."""
    for past_first in (True, False):
        p = Planner(3)
        assert p.report(0, ["n"], [F32], rounds=[5]) == []
        assert p.report(1, ["n"], [F32]) == []
        if past_first:
            assert [f.worker for f in p.past(2, ["n"], [6], [0])] == [0]
        failures = p.report(2, ["n"], [F32], rounds=[6])
        assert [f.worker for f in failures] == ([] if past_first else [0])
        assert p.ready == [] and p.waiting["n"].workers == {1, 2} and p.waiting["n"].index == 6
        assert p.report(0, ["n"], [F32], rounds=[6]) == []  # worker 0's next round is step 6
        assert p.take_plans() == [(0, ["n"])]


def test_a_reset_begins_a_new_lane_generation_and_ends_the_old_ones_and_those_of_other_runs():
    """A worker reset (its Reset, or a hello with a new epoch when the Reset was lost) begins new lanes: the
    plans made from then on say them, and the fused tensors of the old ones are ended (their rounds fail at
    the anchor). A Reset whose epoch a hello already brought begins none (the hello did). The lanes of another
    run (plans of our previous run still running) live until the first reset, and end with it."""
    p = Planner(2, run="r1")
    p.worker_hello(0, "e1", "d0")
    p.worker_hello(1, "f1", "d1")
    first = fused_name(0, 3, "float32", False, "r1.0")
    others = (fused_name(0, 3, "float32", False, "r0.0"), fused_name(0, 3, "float32", False, "r10.1"))
    assert p.lanes == "r1.0" and not p.ended(first) and not p.ended("a@r1.0")
    assert not any(p.ended(name) for name in others) and p.endings == 0
    p.worker_gone(1, Why("every training process of worker 1 left", "round_failed"), reset=True, epoch="f2")
    assert p.lanes == "r1.1" and p.ended(first) and not p.ended(fused_name(0, 3, "float32", False, "r1.1"))
    assert all(p.ended(name) for name in others) and p.endings == 1
    p.worker_gone(0, Why("worker 0 disconnected", "connection"), reset=False)  # a drop: the processes live on
    p.worker_hello(0, "e1", "d0")
    assert p.lanes == "r1.1"
    p.worker_hello(0, "e2", "d0")  # its Reset lost with the connection: the hello says the new epoch
    assert p.lanes == "r1.2"
    p.worker_gone(0, Why("every training process of worker 0 left", "round_failed"), reset=True, epoch="e2")
    assert p.lanes == "r1.2" and p.endings == 2  # (the hello began them)
    p.report(0, ["a"], [F32])
    p.report(1, ["a"], [F32])
    ((seq, _),) = p.take_plans()
    assert p.sent_since(seq, 0) == [(seq, ["a"], "r1.2")]


def test_a_restarted_worker_daemon_ends_our_previous_runs_lanes_as_a_reset_does():
    """A worker daemon that died and started again sends no Reset: its first hello says a new daemon and a new
    epoch. It numbers every lane from 0 again, as a reset worker does, so the hello is handled as its reset: a
    new lane generation, and our previous run's lanes end with their plans still running, which are never sent
    again (sent to it, such a plan would be pushed as round 0 of a lane the peer is further on, and the peer's
    round would wait for ever). (A daemon's first hello to a run that never heard of the worker cannot be told
    from a surviving daemon's: both are new to the run, see ``worker_hello``.)"""
    p = Planner(2, run="r2")
    p.worker_hello(0, "e0", "d0")
    p.worker_hello(1, "e1", "d1")
    p.running(0, 1, ["a"], [3], [2], "r1.0")  # worker 0 still runs plan 1 of our previous run
    p.worker_gone(1, Why("worker 1 disconnected", "connection"), reset=False)  # its daemon died
    p.worker_hello(1, "f1", "d1b")  # and started again
    assert p.endings == 1 and p.lanes == "r2.1" and p.ended(fused_name(0, 1, "float32", False, "r1.0"))
    assert not p.running_plans and not p.running_names and 1 in p.excused
    assert p.report(1, ["a"], [F32], [2], rounds=[2]) == [] and p.take_resends() == []  # one plan behind: not sent
    p.running(0, 1, ["a"], [3], [2], "r1.0")  # told again (a reconnect): ignored
    assert not p.running_plans and p.take_resends() == []


def test_a_name_that_waits_for_a_worker_without_processes_fails_after_the_timeout():
    """Worker 1's processes left (its Reset) and worker 0's issue "x": it waited for ever (a review's case; the
    unfused rounds fail after the timeout, RoundTable.sweep). Now it fails for worker 0 after the timeout; as
    any failure, it waits for worker 1's processes to report "x" (they come at the peers' step)."""
    p = Planner(2)
    p.worker_gone(1, Why("every training process of worker 1 left", "round_failed"), reset=True)
    p.report(0, ["x"], [F32], now=100.0)
    assert p.sweep(104.9, {0, 1}, 5.0) == []
    (failed,) = p.sweep(105.0, {0, 1}, 5.0)
    assert failed.worker == 0 and failed.name == "x" and failed.why.code == "connection"
    assert failed.why.text == "worker 1 had no training processes: none had started yet, or they had left (waited 5 s); round 0 of 'x' cannot complete"
    assert "x" not in p.waiting and p.failed["x"][0][1] == {1}
    [heard] = p.report(1, ["x"], [F32], now=106.0)  # its processes are back: they hear that round's failure
    assert heard.worker == 1 and "no training processes" in heard.why.text
    p.report(1, ["y"], [F32], now=110.0)
    assert p.sweep(200.0, {0, 1}, 5.0) == []  # worker 0 has processes (it reported): "y" waits for it


def test_a_name_that_waits_for_a_worker_not_connected_fails_after_the_timeout_and_it_hears_it_later():
    p = Planner(2)
    p.report(0, ["x"], [F32], now=100.0)
    assert p.sweep(104.0, {0}, 5.0) == []
    (failed,) = p.sweep(105.5, {0}, 5.0)
    assert failed.why.text == "worker 1 was not connected to this server (waited 5 s); round 0 of 'x' cannot complete"
    assert p.failed["x"][0][1] == {1}  # its processes live on: they hear it when they report it
    named = Planner(2, server="server 3")  # (the daemon names itself: its workers' processes hear which server)
    named.report(0, ["x"], [F32], now=100.0)
    (failed,) = named.sweep(105.5, {0}, 5.0)
    assert failed.why.text.startswith("worker 1 was not connected to server 3 (waited 5 s)")


def test_a_name_that_waits_for_a_connected_worker_that_never_reported_is_not_failed():
    """A job's start: a machine's processes may come long after the others' (a stall note says so)."""
    p = Planner(2)
    p.report(0, ["x"], [F32], now=100.0)
    assert p.sweep(1000.0, {0, 1}, 5.0) == [] and "x" in p.waiting


def test_no_failure_of_a_job_waits_for_the_next_job():
    """Worker 1's processes were gone (a Reset) when worker 0's job issued "x" and was killed (its Reset): the
    failure of that round waited for worker 1, whose next job's first report of "x" heard it (a review's case:
    every process of the next job failed its first step). Once every worker's processes are gone, the job is
    over: none of its failures waits for the next."""
    p = Planner(2)
    p.worker_gone(1, Why("every training process of worker 1 left", "round_failed"), reset=True)
    p.report(0, ["x"], [F32])
    assert p.worker_gone(0, Why("every training process of worker 0 left", "round_failed"), reset=True) == []
    assert p.failed == {} and p.waiting == {}
    assert p.report(1, ["x"], [F32]) == [] and p.report(0, ["x"], [F32]) == []  # the next job: a clean slate
    assert [names for _, names in p.take_plans()] == [["x"]]


def test_a_daemon_idle_since_it_started_leaves_no_failure_for_the_next_job():
    """Fresh daemons; worker 0's job alone issued "x" and was killed (its Reset). Worker 1's daemon never had
    processes, so it never said Reset, and the failure waited for it: the next job's first report from worker 1
    heard it while worker 0's waited, and every later step of worker 1 was summed with worker 0's previous one
    (wrong sums, a review's case). A worker never active here counts as without processes for the clean slate."""
    p = Planner(2)
    p.report(0, ["x"], [F32], rounds=[0])
    p.worker_gone(0, Why("every training process of worker 0 left", "round_failed"), reset=True, epoch="e0b")
    assert p.failed == {}
    assert p.report(1, ["x"], [F32], rounds=[0]) == [] and p.report(0, ["x"], [F32], rounds=[0]) == []
    assert [names for _, names in p.take_plans()] == [["x"]]


def test_a_failure_still_waits_for_a_worker_whose_processes_were_seen_here():
    p = Planner(2)
    p.processes_seen(1)  # it pushed here (an unfused round): its processes live on
    p.report(0, ["x"], [F32])
    p.worker_gone(0, Why("every training process of worker 0 left", "round_failed"), reset=True)
    assert p.failed["x"][0][1] == {1}  # they hear it when they report "x"


def test_a_worker_that_pushed_since_its_reset_has_processes_and_is_waited_for():
    """Its processes pushed an unfused tensor here and fall behind on a small one: a stall, not a timeout (the
    round table takes any push as its processes back; the planner only took a report: a review's case)."""
    p = Planner(2)
    p.worker_gone(1, Why("every training process of worker 1 left", "round_failed"), reset=True)
    p.processes_seen(1)
    p.report(0, ["x"], [F32], now=100.0)
    assert p.sweep(1000.0, {0, 1}, 5.0) == [] and "x" in p.waiting


def test_with_a_stall_timeout_a_name_that_waits_for_a_connected_worker_fails_naming_it():
    """cluster.stall_timeout: a connected worker whose processes never report the name (they name their tensor
    otherwise, or are stuck) fails it for the reporters once it waited that long; it hears it when it reports."""
    p = Planner(3)
    p.report(0, ["x"], [F32], now=100.0)
    assert p.sweep(119.9, {0, 1, 2}, 5.0, stall_s=20.0) == []
    (failed,) = p.sweep(120.0, {0, 1, 2}, 5.0, stall_s=20.0)
    assert failed.worker == 0 and failed.name == "x" and failed.why.code == "timeout"  # (alive, connected: stuck)
    assert failed.why.text == ("round 0 of 'x' failed: workers 1, 2 did not push it (cluster.stall_timeout), "
                               "waited 20 s")
    assert failed.why.timeout_s == 20.0 and failed.why.detail == "workers 1, 2 did not push it (cluster.stall_timeout)"
    assert "x" not in p.waiting and p.failed["x"][0][1] == {1, 2}
    [heard] = p.report(1, ["x"], [F32], now=130.0)
    assert heard.worker == 1 and "cluster.stall_timeout" in heard.why.text


def test_with_a_stall_timeout_a_name_waiting_for_a_worker_that_reports_or_pushes_other_names_does_not_fail():
    """Worker 1 catches up on names worker 0 reported first (in its own order): busy; a name only it reports
    (its processes moved on) does not count."""
    p = Planner(2)
    p.report(0, ["x", "y"], [F32, F32], now=100.0)
    p.report(1, ["y"], [F32], now=150.0)  # (planned: both reported it)
    p.report(1, ["z"], [F32], now=190.0)  # its own: no catching up
    assert p.sweep(200.0, {0, 1}, 5.0, stall_s=60.0) == []
    assert p.sweep(230.0, {0, 1}, 5.0, stall_s=60.0, pushed={1: 190.0}) == []  # a push here (the round table's)
    (failed,) = [f for f in p.sweep(250.0, {0, 1}, 5.0, stall_s=60.0, pushed={1: 190.0}) if f.name == "x"]
    assert failed.name == "x" and "worker 1 did not push it (cluster.stall_timeout)" in failed.why.text


def test_a_sweeps_failure_names_the_round_by_its_step_index_where_the_reporters_say_it():
    """The count of plans the name was in misses its failed steps: the second failed step said "round 0" (a
    review's case); the index the reports carry says which."""
    p = Planner(2)
    p.report(0, ["x"], [F32], now=100.0, rounds=[3])
    (failed,) = p.sweep(200.0, {0, 1}, 5.0, stall_s=60.0)
    assert failed.why.text.startswith("round 3 of 'x' failed")


def test_a_worker_that_says_it_has_no_processes_fails_the_names_that_wait_for_it_until_it_says_joined():
    """Hello.processes (see the round table's test): a name waiting for a daemon idle since it started fails after
    the timeout naming it; once it says Joined, it is waited for (stall warnings, no failure)."""
    p = Planner(2)
    p.worker_idle(1)
    p.report(0, ["x"], [F32], now=100.0)
    (failed,) = p.sweep(106.0, {0, 1}, 5.0)
    assert failed.worker == 0 and "worker 1 had no training processes" in failed.why.text
    p.worker_joined(1)
    p.report(0, ["y"], [F32], now=200.0)
    assert p.sweep(1000.0, {0, 1}, 5.0) == []


def test_a_jobs_per_name_counts_go_when_it_ends_but_a_next_jobs_names_stay():
    """Names that never repeat (a step number in each) kept their counts and specs for good, and the plans kept
    for them with it: a server grew 0.3-0.45 MB a job of 6,000 such names (a review). Once every worker that
    counted a name has new processes, it goes; a name a worker of the next job reported already stays, even where
    that job began before the last one ended everywhere."""
    p = Planner(2)
    for step in range(50):
        names = [f"loss.{step}", f"acc.{step}"]
        p.report(0, names, [F32] * 2)
        p.report(1, names, [F32] * 2)
        p.take_plans()
    assert len(p.heard) == len(p.spec_of) == 100
    p.worker_gone(0, Why("every training process of worker 0 left", "round_failed"), reset=True, epoch="e1")
    assert len(p.heard) == 100  # (the job goes on on worker 1)
    p.report(0, ["next"], [F32])  # worker 0's next job begins (its round fails with worker 1's reset: spare_none)
    p.worker_gone(1, Why("every training process of worker 1 left", "round_failed"), reset=True, epoch="f1")
    assert set(p.heard) == {"next"} and set(p.spec_of) <= {"next"} and not p.floors, (p.heard, p.spec_of)
    for worker in (0, 1):
        assert p.report(worker, ["loss.0"], [F32]) == []  # a name of the last job, again: counted from 0
    assert p.take_plans() == [(50, ["loss.0"])] and p.heard["loss.0"] == [1, 1]
