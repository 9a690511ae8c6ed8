"""A machine's fused small sums (``bps_worker.fusion``), without sockets or a loop (one test: with the daemon's
way in for ops, on a fake daemon)."""

from __future__ import annotations

import types
from typing import Any

from bps_worker.daemon import WorkerDaemon
from bps_worker.fusion import FusedRounds
from bps_worker.local_rounds import LocalRounds
from protocol.messages import KIND_SUM, Op, Spec, Why

WORKER = 1
OFFSET = 3  # worker 1's local rank 0 is global rank 3
F32: Spec = ("float32", (4,), False, "")
F16: Spec = ("float16", (4,), False, "")


def rounds(local_size: int = 2) -> FusedRounds[str]:
    return FusedRounds(local_size, WORKER, OFFSET)


def entries(names: list[str], req0: int = 1, spec: Spec = F32) -> list[tuple[int, str, Spec, str, int, int]]:
    return [(req0 + i, n, spec, "seg", 64 * i, 0) for i, n in enumerate(names)]


def sent(out: Any) -> Any:
    """The daemon sent the reports of the rounds ``out`` made ready (as fused_driver's ``_report`` does)."""
    for fr in out.ready:
        fr.sent = True
    return out


def answered(out: Any) -> list[tuple[str, int, str, str]]:
    return [(member, f.req, f.code, f.message) for member, f in out.answers]


def test_names_are_ready_once_every_local_rank_issued_them_in_any_order_and_batches():
    fr = rounds(3)
    assert fr.submit("p0", 0, entries(["a", "b", "c"])).ready == []
    assert [r.name for r in fr.submit("p2", 2, entries(["c", "a"], 10)).ready] == []
    ready = fr.submit("p1", 1, entries(["b", "a", "c", "d"], 20)).ready
    assert [r.name for r in ready] == ["a", "c"]  # b waits for rank 2, d for ranks 0 and 2
    a = next(r for r in ready if r.name == "a")
    # the local sum runs in local-rank order, whatever the arrival order
    assert [(e.member, e.req) for e in a.members()] == [("p0", 1), ("p1", 21), ("p2", 11)]
    assert a.first_rank == OFFSET + 0
    assert set(fr.reported) == {"a", "c"} and set(fr.collecting) == {"b", "d"}
    assert [r.name for r in fr.submit("p2", 2, entries(["b"], 30)).ready] == ["b"]


def test_a_single_process_machine_reports_at_once():
    fr = rounds(1)
    out = fr.submit("p0", 0, entries(["x", "y"]))
    assert [r.name for r in out.ready] == ["x", "y"] and not fr.collecting


def test_a_name_issued_twice_by_one_process_is_refused_while_in_flight():
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a"]))
    out = fr.submit("p0", 0, entries(["a"], 5))
    assert answered(out) == [("p0", 5, "bad_request", "tensor 'a' is already in flight for rank 3; synchronize it "
                                                      "before pushing it again")]
    fr.submit("p1", 1, entries(["a"], 7))  # complete: reported, still in flight until planned
    assert fr.submit("p1", 1, entries(["a"], 8)).answers[0][1].code == "bad_request"
    rounds_, missing = fr.planned(["a"])
    assert [r.name for r in rounds_] == ["a"] and missing == {}
    assert fr.submit("p1", 1, entries(["a"], 9)).answers == []  # planned: the next round opens


def test_a_mismatch_fails_that_name_only_for_every_local_rank_and_the_peers():
    fr = rounds(3)
    fr.submit("p0", 0, entries(["a", "b"]))
    out = fr.submit("p1", 1, [(10, "a", F16, "seg", 0, 0), (11, "b", F32, "seg", 64, 0)])
    failures = {(m, f.req): f for m, f in out.answers}
    assert set(failures) == {("p0", 1), ("p1", 10)}
    mine, theirs = failures[("p0", 1)], failures[("p1", 10)]
    assert mine.code == theirs.code == "mismatch" and mine.name == "a"
    assert (mine.ours, mine.theirs) == ("float32[4]", "float16[4]")
    assert (theirs.ours, theirs.theirs) == ("float16[4]", "float32[4]")
    assert [name for name, _, _ in out.aborts] == ["a"]  # the anchor tells the other machines
    # the late rank gets the same error for its round of "a"; "b" completes normally
    late = fr.submit("p2", 2, entries(["a", "b"], 20))
    assert [(m, f.req, f.code) for m, f in late.answers] == [("p2", 20, "mismatch")]
    assert [r.name for r in late.ready] == ["b"]
    assert "a" not in fr.failed  # every local rank heard it: forgotten
    assert fr.submit("p0", 0, entries(["a"], 30)).answers == []  # and the name works again


def test_a_process_that_leaves_fails_every_round_it_is_part_of_or_awaited_by():
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a", "b"]))
    sent(fr.submit("p1", 1, entries(["b"], 10)))  # b reported, a collecting
    out = fr.leave(1, pid=99)
    assert sorted((m, f.req, f.code) for m, f in out.answers) == [("p0", 1, "connection"), ("p0", 2, "connection")]
    assert sorted(name for name, _, _ in out.aborts) == ["a", "b"]
    assert not fr.collecting and not fr.reported and not fr.failed
    # a plan that names b (already on its way) finds it missing, with its spec: its group fails
    rounds_, missing = fr.planned(["b"])
    assert rounds_ == [] and missing == {"b": F32}


def test_a_failure_at_the_anchor_fails_the_reported_round_only():
    """The anchor answers reports: a round still collecting here was never reported, so a failure of the
    name (a stale answer to a round that failed here already) is not its."""
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a"]))
    assert fr.failed_at_anchor("a", Why("stale", "round_failed")).answers == [] and "a" in fr.collecting
    fr.submit("p1", 1, entries(["a"], 10))
    out = fr.failed_at_anchor("a", Why("worker 0 disagrees", "round_failed"))
    # (each process's answer names its tensor: a fused failure's words may be about the whole plan)
    assert sorted((m, f.req, f.message) for m, f in out.answers) == [("p0", 1, "tensor 'a': worker 0 disagrees"),
                                                                      ("p1", 10, "tensor 'a': worker 0 disagrees")]
    assert out.aborts == [] and not fr.failed and not fr.abandoned  # the anchor knows; nobody is late
    assert fr.submit("p0", 0, entries(["a"], 2)).answers == [] and "a" in fr.collecting  # the next round


def test_a_broken_link_fails_only_the_rounds_reported_to_that_server():
    fr = rounds(1)
    out = fr.submit("p0", 0, entries(["a", "b"]))
    out.ready[0].server, out.ready[1].server = 0, 2
    lost = fr.link_lost(2, Why("server 2 went away", "connection"))
    assert [(f.req, f.code) for _, f in lost.answers] == [(2, "connection")]
    assert list(fr.reported) == ["a"]


def test_a_reset_fails_everything_and_keeps_nothing():
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a", "b"]))
    fr.submit("p1", 1, entries(["a"], 10))
    out = fr.reset()
    assert sorted((m, f.req) for m, f in out.answers) == [("p0", 1), ("p0", 2), ("p1", 10)]
    assert out.aborts == [] and not (fr.collecting or fr.reported or fr.failed or fr.abandoned)


def test_a_late_rank_joins_its_failed_round_even_after_the_others_started_the_next():
    fr = rounds(3)
    fr.submit("p0", 0, [(1, "a", F16, "seg", 0, 0)])
    fr.submit("p1", 1, entries(["a"], 10))  # mismatch: round 0 fails, rank 2 still to come
    fr.submit("p0", 0, entries(["a"], 2))  # ranks 0 and 1 go on to round 1
    fr.submit("p1", 1, entries(["a"], 11))
    late = fr.submit("p2", 2, entries(["a"], 20))  # rank 2's round-0 entry
    assert [(m, f.req, f.code) for m, f in late.answers] == [("p2", 20, "mismatch")] and late.ready == []
    ready = fr.submit("p2", 2, entries(["a"], 21)).ready  # its round-1 entry completes round 1
    assert [(e.member, e.req) for e in ready[0].members()] == [("p0", 2), ("p1", 11), ("p2", 21)]


def test_a_round_that_waits_for_a_process_that_is_not_connected_fails_after_the_timeout():
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a"]), now=100.0)
    fr.submit("p0", 0, entries(["b"], 5), now=104.0)
    assert fr.overdue({0, 1}, now=200.0, timeout=5.0).answers == []  # rank 1 connected: merely slow
    out = fr.overdue({0}, now=105.5, timeout=5.0)
    assert [(m, f.req, f.code, f.timeout_s) for m, f in out.answers] == [("p0", 1, "timeout", 5.0)]
    assert "rank 4 of worker 1 is not connected" in out.answers[0][1].message
    assert [name for name, _, _ in out.aborts] == ["a"] and list(fr.collecting) == ["b"]


def test_failing_a_name_answers_its_entries_and_does_not_wait_for_ranks_that_heard_it_unfused():
    """Local rank 0 issued "a" fused, rank 1 too large to fuse (its op heard the failure through its round):
    the fused round fails, the anchor is told, and the name's next fused round is new."""
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a"]))
    why = Why.mismatch("a", "float32[4]", "float32[400]", "sizes on both sides of the fusion limit")
    out = fr.fail_name("a", why, {1})
    assert [(m, f.code) for m, f in out.answers] == [("p0", "mismatch")]
    assert [name for name, _, _ in out.aborts] == ["a"]
    assert not fr.busy("a") and "a" not in fr.failed
    nxt = fr.submit("p1", 1, entries(["a"], 9))
    assert nxt.answers == [] and "a" in fr.collecting  # a new round, not the failed one's error


def test_a_failed_fused_round_takes_its_steps_unfused_round_number_unless_one_was_taken_beside_it():
    """A step of a name is one unfused round number on every machine, whichever path it took (see the module):
    a fused round that fails says so (``steps``), once, for a mismatch here, a failure heard from the anchor or a
    process that left; not where an unfused round of the step failed beside it, nor at a reset (the numbering
    starts again)."""
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a", "b", "c", "d"]))
    local = fr.submit("p1", 1, entries(["a"], 9, F16))  # the two processes disagree
    assert local.steps == ["a"]
    sent(fr.submit("p1", 1, entries(["b", "c"], 10)))
    assert fr.failed_at_anchor("b", Why("worker 0 gave the fused sum up", "round_failed")).steps == ["b"]
    assert fr.failed_at_anchor("b", Why("again", "round_failed")).steps == []  # failed once, counted once
    why = Why.mismatch("d", "float32[4]", "float32[400]", "sizes on both sides of the fusion limit")
    assert fr.fail_name("d", why, {1}, unfused=True).steps == []  # rank 1's unfused round took it
    assert fr.leave(1, 99).steps == ["c"]
    fr.submit("p0", 0, entries(["e"], 20))
    assert fr.reset().steps == []


def test_a_failed_fused_round_still_waits_for_a_rank_that_heard_nothing():
    fr = rounds(3)
    fr.submit("p0", 0, entries(["a"]))
    why = Why.mismatch("a", "float32[4]", "float32[400]", "sizes on both sides of the fusion limit")
    fr.fail_name("a", why, {1})
    assert "a" in fr.failed  # rank 2 has not issued it yet: it will get this error
    late = fr.submit("p2", 2, entries(["a"], 5))
    assert [(m, f.code) for m, f in late.answers] == [("p2", "mismatch")]


def test_a_slow_rank_two_failed_rounds_behind_joins_each_in_turn_and_no_steps_are_summed_together():
    """Ranks 0 and 1 fail two rounds of ``a`` in a row (they disagree) before rank 2 submits the first: rank 2's
    entries each get their own round's error, and its third entry is summed with the others' third. Keeping
    one failed round per name, rank 2's second entry would open a round that the others' third entries join."""
    fr = rounds(3)
    for step, why in ((0, "mismatch"), (1, "mismatch")):
        fr.submit("p0", 0, [(10 * step, "a", F16, "seg", 0, 0)])
        out = fr.submit("p1", 1, [(10 * step + 1, "a", F32, "seg", 0, 0)])
        assert sorted(f.req for _, f in out.answers) == [10 * step, 10 * step + 1]
    assert [len(fr.failed["a"])] == [2]
    fr.submit("p0", 0, entries(["a"], 20))  # step 2, ranks 0 and 1
    fr.submit("p1", 1, entries(["a"], 21))
    first = fr.submit("p2", 2, [(100, "a", F16, "seg", 0, 0)])
    second = fr.submit("p2", 2, [(101, "a", F16, "seg", 0, 0)])
    assert [(m, f.req, f.code) for m, f in first.answers + second.answers] == [("p2", 100, "mismatch"),
                                                                               ("p2", 101, "mismatch")]
    assert not fr.failed
    ready = fr.submit("p2", 2, entries(["a"], 102)).ready
    assert [(e.member, e.req) for e in ready[0].members()] == [("p0", 20), ("p1", 21), ("p2", 102)]


def test_a_new_process_of_a_rank_that_left_does_not_join_the_rounds_the_old_one_was_part_of():
    fr = rounds(3)
    fr.submit("p0", 0, entries(["a"]))
    fr.submit("p1", 1, entries(["a"], 10))
    fr.leave(1, pid=99)  # a fails; rank 2 still to submit it
    assert len(fr.failed["a"]) == 1
    nxt = fr.submit("p1'", 1, entries(["a"], 50))  # a new process as rank 1: its first round is a new one
    assert nxt.answers == [] and fr.collecting["a"].entries[1] is not None


def test_an_abort_says_whether_the_anchor_had_the_round_already():
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a", "b"]))
    sent(fr.submit("p1", 1, entries(["b"], 10)))  # b reported, a collecting
    out = fr.leave(1, pid=99)
    assert sorted((name, reported) for name, _, reported in out.aborts) == [("a", False), ("b", True)]
    assert [r.name for r in fr.abandoned["b"]] == ["b"] and "a" not in fr.abandoned


def test_a_round_whose_report_was_held_is_given_up_as_never_reported():
    """Complete here, its report waited (a fused operation with the anchor ran): the anchor never heard of it,
    so its abort is of our next round there, and no answer is awaited."""
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a"]))
    held = fr.submit("p1", 1, entries(["a"], 10)).ready
    assert [r.name for r in held] == ["a"] and not held[0].sent
    out = fr.leave(1, pid=99)
    assert [(name, reported) for name, _, reported in out.aborts] == [("a", False)] and not fr.abandoned
    assert held[0].why is not None  # the daemon drops it from what it reports


def test_a_broken_connection_fails_what_went_on_it_and_not_the_reports_held_for_the_next():
    fr = rounds(1)
    out = fr.submit("p0", 0, entries(["a", "b"]))
    a, b = out.ready
    a.server = b.server = 0
    a.sent, a.generation = True, 0  # reported on connection 0; b held
    lost = fr.link_lost(0, Why("broke", "connection"), before=1)
    assert [f.req for _, f in lost.answers] == [1] and list(fr.reported) == ["b"]


def test_the_anchors_answers_go_to_the_abandoned_rounds_first_in_order():
    """Round 1 of ``a`` was reported, then failed here (abandoned); round 2 was reported since. The anchor's
    answers come in the order of the reports: the first (a plan, or a failure) is round 1's and must neither
    run nor fail round 2."""
    why = Why.mismatch("a", "float32[4]", "float32[400]", "sizes on both sides of the fusion limit")
    for answer in ("plan", "failure"):
        fr = rounds(1)
        sent(fr.submit("p0", 0, entries(["a"], 1)))
        out = fr.fail_name("a", why)
        assert [(n, rep) for n, _, rep in out.aborts] == [("a", True)]
        fr.submit("p0", 0, entries(["a"], 2))  # round 2, reported
        if answer == "plan":
            run, missing = fr.planned(["a"])
            assert run == [] and missing == {"a": F32}  # round 1's plan: its group fails
        else:
            assert fr.failed_at_anchor("a", Why("round 1 failed", "round_failed")).answers == []
        assert not fr.abandoned and "a" in fr.reported
        run, missing = fr.planned(["a"])  # round 2's plan
        assert [e.req for r in run for e in r.members()] == [2] and missing == {}


def test_answers_that_will_not_come_are_forgotten_with_their_connection():
    fr = rounds(1)
    out = sent(fr.submit("p0", 0, entries(["a", "b"])))
    out.ready[0].server, out.ready[1].server = 0, 2
    out.ready[0].generation = out.ready[1].generation = 0
    fr.fail_name("a", Why("gave up", "round_failed"))
    fr.fail_name("b", Why("gave up", "round_failed"))
    assert set(fr.abandoned) == {"a", "b"}
    fr.forget_answers(2, before=1)  # server 2 restarted: it forgot b's report
    assert set(fr.abandoned) == {"a"}
    fr.link_lost(0, Why("server 0 went away", "connection"), before=1)
    assert not fr.abandoned


def test_a_plan_lost_with_a_connection_names_the_rounds_that_failed_with_it_and_not_the_later_ones():
    """Round 1 of ``a`` was reported on connection 0, which broke with its plan on the way: the round failed
    here. Round 2 was reported on the next connection, and given up there. The lost plan, sent again, is
    round 1's: its group must fail here as it does for the peers; round 2's answer is still to come."""
    fr = rounds(1)
    out = sent(fr.submit("p0", 0, entries(["a"], 1)))
    out.ready[0].server = 0
    fr.link_lost(0, Why("broke", "connection"), before=1)
    r2 = sent(fr.submit("p0", 0, entries(["a"], 2))).ready[0]
    r2.server, r2.generation = 0, 1
    fr.fail_name("a", Why("given up", "round_failed"))
    run, missing = fr.planned(["a"], lost=True)
    assert run == [] and missing == {"a": F32}
    assert [r.members()[0].req for r in fr.abandoned["a"]] == [2] and fr.counts["a"] == 1
    fr.submit("p0", 0, entries(["a"], 3))  # round 3 reported; the lost plan named no round of it
    assert fr.planned(["a"], lost=True) == ([], {"a": None})
    assert "a" in fr.reported


class Member:
    """A process as the daemon answers it (its session)."""

    def __init__(self, local_rank: int) -> None:
        self.local_rank = local_rank
        self.got: list[Any] = []

    def send(self, message: Any) -> None:
        self.got.append(message)


def daemon_of(fr: FusedRounds[Any]) -> Any:
    """The worker daemon's own way in for processes' ops (``WorkerDaemon.submit`` and ``_execute``), on the real
    fused and local rounds, with what they reach beyond those faked."""
    daemon = types.SimpleNamespace(
        fusion=types.SimpleNamespace(rounds=fr), rounds=LocalRounds(fr.local_size, WORKER, OFFSET),
        stalls=types.SimpleNamespace(began=lambda lr, now: None), round_base=lambda name, r: None,
        watched=[], submitted_at={})
    daemon._watch = daemon.watched.append
    daemon._execute = types.MethodType(WorkerDaemon._execute, daemon)
    daemon.submit = types.MethodType(WorkerDaemon.submit, daemon)
    return daemon


async def test_an_unfused_op_of_a_rank_late_for_a_failed_fused_round_is_its_part_of_that_round():
    """Local rank 1 was not connected: rank 0's fused round of ``a`` failed as overdue, and waits for rank 1.
    Rank 1 then issues ``a`` unfused (too large to fuse, once): that op is its part of the failed round (its
    step), as a fused entry would be. It hears that round's error, the round stops waiting, and no round of its
    own opens. Before, it opened an unfused round that took an index of its own (``skip``: no fused round was
    open), so the machine's next round of ``a`` said index 2 where the peers' said 1 (stale, at the anchor, for
    good), and the unfused round waited to be paired with rank 0's next step."""
    fr = rounds(2)
    daemon = daemon_of(fr)
    fr.submit("p0", 0, entries(["a"]), now=100.0)
    out = fr.overdue({0}, now=200.0, timeout=5.0)
    assert out.abort_rounds == [0] and len(fr.failed["a"]) == 1
    p1 = Member(1)
    daemon.submit(p1, Op(req=7, name="a", kind=KIND_SUM, dtype="float32", shape=[400], segment="seg"))
    assert [(f.req, f.code) for f in p1.got] == [(7, "timeout")]
    assert not daemon.rounds.open and not fr.failed and not daemon.watched
    fr.submit("p0", 0, entries(["a"], 2))  # the next step, fused by both
    ready = fr.submit("p1", 1, entries(["a"], 8)).ready
    assert [(r.index, [e.req for e in r.members()]) for r in ready] == [(1, [2, 8])]


async def test_a_failed_steps_round_is_given_up_at_the_anchor_once_the_base_is_learned_in_the_same_job():
    """WorkerDaemon._give_up_step (on a fake daemon): the base learned from the anchor's answer, and the step's
    round given up there; nothing learned or given up where the answer says we rejoined (-1), or comes after
    a reset (another epoch: the job it was asked for is over)."""
    import asyncio

    from bps_worker.local_rounds import RoundNumbers

    aborted: list[tuple[str, int]] = []
    answers: list[asyncio.Future[int]] = []

    def query_round(name: str, part: int, local: int, failed: bool, given_up: bool) -> asyncio.Future[int]:
        assert failed and not given_up and part == 0
        answers.append(asyncio.get_running_loop().create_future())
        return answers[-1]

    daemon = types.SimpleNamespace(
        rounds=types.SimpleNamespace(numbers=RoundNumbers()), epoch="e1", worker_id=WORKER,
        _anchor_link=lambda name: types.SimpleNamespace(query_round=query_round),
        abort_at_anchor=lambda name, server_round, why: aborted.append((name, server_round)))
    for answer, epoch, want_base, want_aborted in ((4, "e1", 0, [("n", 4)]), (-1, "e1", None, []),
                                                   (4, "e2", None, [])):
        daemon.rounds.numbers.reset()
        daemon.epoch, aborted[:] = "e1", []
        task = asyncio.ensure_future(WorkerDaemon._give_up_step(daemon, "n", 4, "e1",  # type: ignore[arg-type]
                                                                Why("failed here", "round_failed")))
        await asyncio.sleep(0)
        daemon.epoch = epoch
        answers[-1].set_result(answer)
        await task
        assert daemon.rounds.numbers.base("n") == want_base and aborted == want_aborted, (answer, epoch)


def test_with_a_stall_timeout_a_fused_round_that_waits_for_a_connected_process_fails():
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a"]), now=100.0)
    assert fr.overdue({0, 1}, now=159.9, timeout=5.0, stall_s=60.0).answers == []
    out = fr.overdue({0, 1}, now=160.0, timeout=5.0, stall_s=60.0)
    assert [(m, f.req, f.code, f.timeout_s) for m, f in out.answers] == [("p0", 1, "timeout", 60.0)]
    assert "rank 4 of worker 1 did not submit it (cluster.stall_timeout)" in out.answers[0][1].message
    assert [name for name, _, _ in out.aborts] == ["a"] and not fr.collecting


def test_with_a_stall_timeout_a_fused_round_waiting_for_a_rank_that_keeps_submitting_does_not_fail():
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a"]), now=100.0)
    assert fr.overdue({0, 1}, now=200.0, timeout=5.0, stall_s=60.0, heard={1: 150.0}).answers == []
    assert fr.overdue({0, 1}, now=210.0, timeout=5.0, stall_s=60.0, heard={1: 150.0}).answers != []
