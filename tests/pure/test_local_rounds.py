"""A machine's local rounds and their numbering (``bps_worker.local_rounds``), without sockets or a loop."""

from __future__ import annotations

from typing import Any

from bps_worker.local_rounds import Failed, LocalRound, LocalRounds, Opened, Ready, Refused, RoundNumbers, agree
from protocol.messages import KIND_BROADCAST, Op, Why

WORKER = 1
OFFSET = 3  # worker 1's local rank 0 is global rank 3 (worker 0 has 3 processes)


def op(name: str = "w", req: int = 1, shape: tuple[int, ...] = (4, 3), dtype: str = "float32", **kw: Any) -> Op:
    fields: dict[str, Any] = dict(req=req, name=name, kind="sum", segment="seg", offset=0, dtype=dtype,
                                  shape=list(shape))
    fields.update(kw)
    return Op(**fields)


def rounds(local_size: int = 3) -> LocalRounds[str]:
    return LocalRounds(local_size, WORKER, OFFSET)


def kinds(actions: list[Any]) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_a_round_is_ready_once_every_local_rank_submitted_in_any_order():
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        lr = rounds(3)
        first = lr.submit(f"s{order[0]}", order[0], op(req=10 + order[0]))
        assert kinds(first) == ["Opened"]
        opened = first[0].round
        assert (opened.round, opened.first_rank, opened.expected) == (0, OFFSET + order[0], set(order[1:]))
        assert lr.submit(f"s{order[1]}", order[1], op(req=10 + order[1])) == []
        last = lr.submit(f"s{order[2]}", order[2], op(req=10 + order[2]))
        assert kinds(last) == ["Ready"] and last[0].round is opened
        # the local sum runs in local-rank order, whatever the arrival order
        assert [(m, o.req) for m, o in opened.ordered()] == [("s0", 10), ("s1", 11), ("s2", 12)]
        assert lr.open == {}  # a round that starts is no longer open


def test_one_process_is_ready_at_once():
    lr = rounds(1)
    assert kinds(lr.submit("s0", 0, op())) == ["Opened", "Ready"]


def test_names_collect_independently():
    lr = rounds(2)
    lr.submit("s0", 0, op("a"))
    lr.submit("s0", 0, op("b"))
    assert sorted(lr.open) == ["a", "b"]
    assert kinds(lr.submit("s1", 1, op("b"))) == ["Ready"]
    assert list(lr.open) == ["a"]


def test_a_mismatch_names_both_ranks_and_both_tensors_and_late_ranks_get_it_too():
    lr = rounds(3)
    lr.submit("s0", 0, op(req=1, shape=(4, 3)))
    actions = lr.submit("s2", 2, op(req=2, shape=(4, 4)))
    assert kinds(actions) == ["Failed"]
    failed = actions[0]
    assert failed.code == "mismatch"
    assert failed.reason == "tensor 'w' mismatch: rank 3 has float32[4,3] but rank 5 has float32[4,4]"
    assert [(m, o.req) for m, o in failed.members] == [("s0", 1), ("s2", 2)]
    assert failed.server_round is None  # the base is not learned yet: the daemon aborts once it is
    # rank 1 is late: it joins the failed round (not the next one) and gets the same error
    late = lr.submit("s1", 1, op(req=3))
    assert kinds(late) == ["Refused"]
    assert (late[0].member, late[0].op.req, late[0].reason, late[0].code) == ("s1", 3, failed.reason, "mismatch")
    assert lr.open == {}  # every rank heard of it: retired
    # the next round of the name is round 1
    assert lr.submit("s0", 0, op(req=4))[0].round.round == 1


def test_every_field_of_the_agreement_counts():
    base = op()
    assert agree(base, op(req=9, segment="other", offset=64, priority=5))  # where it lives does not matter
    for different in (op(dtype="float64"), op(shape=(3, 4)), op(shape=(12,)), op(average=True),
                      op(kind=KIND_BROADCAST, root=0), op(cuda=[[4, 3], "x"])):
        assert not agree(base, different)
    lr = rounds(2)
    lr.submit("s0", 0, op(kind=KIND_BROADCAST, root=0))
    failed = lr.submit("s1", 1, op(kind=KIND_BROADCAST, root=4))[0]
    assert failed.reason == ("tensor 'w' mismatch: rank 3 has float32[4,3] (broadcast from rank 0) but rank 4 "
                             "has float32[4,3] (broadcast from rank 4)")
    lr.submit("s0", 0, op("g", average=True))
    failed = lr.submit("s1", 1, op("g", dtype="int32"))[0]
    assert failed.reason == "tensor 'g' mismatch: rank 3 has float32[4,3] (average) but rank 4 has int32[4,3]"


def test_an_op_in_flight_is_refused_until_its_round_completes():
    lr = rounds(2)
    lr.submit("s0", 0, op(req=1))
    again = lr.submit("s0", 0, op(req=2))
    assert kinds(again) == ["Refused"]
    assert again[0].code == "bad_request" and again[0].op.req == 2
    assert again[0].reason == ("tensor 'w' is already in flight for rank 3; synchronize it before pushing it "
                               "again")
    assert len(lr.open["w"]) == 1 and 0 in lr.open["w"][0].members  # the first op still waits for rank 1
    assert kinds(lr.submit("s1", 1, op(req=3))) == ["Ready"]
    assert lr.submit("s0", 0, op(req=4))[0].round.round == 1  # after it completed, the next round


def test_a_fast_rank_starts_the_next_round_while_a_failed_one_waits_for_a_late_rank():
    lr = rounds(3)
    lr.submit("s0", 0, op(req=1))
    lr.submit("s1", 1, op(req=2, dtype="int64"))  # round 0 fails; rank 2 has not submitted yet
    nxt = lr.submit("s0", 0, op(req=3))  # rank 0 goes on: a new round, not "in flight"
    assert kinds(nxt) == ["Opened"] and nxt[0].round.round == 1
    late = lr.submit("s2", 2, op(req=4))  # rank 2's op belongs to round 0: it gets round 0's error
    assert kinds(late) == ["Refused"] and late[0].code == "mismatch"
    assert [r.round for r in lr.open["w"]] == [1]


def test_a_rank_that_leaves_mid_round_fails_it_without_being_answered():
    lr = rounds(3)
    lr.submit("s0", 0, op(req=1))
    lr.submit("s1", 1, op(req=2))
    actions = lr.leave(1, pid=4242)
    assert kinds(actions) == ["Failed"]
    assert actions[0].reason == "tensor 'w': rank 4 (pid 4242) disconnected during round 0"
    assert [m for m, _ in actions[0].members] == ["s0"]  # the leaver's memory is about to go: not a member
    # rank 2 still joins round 0 and gets the error; then the round is gone
    assert kinds(lr.submit("s2", 2, op(req=3))) == ["Refused"]
    assert lr.open == {}


def test_a_rank_that_leaves_fails_the_rounds_that_wait_for_it_and_not_finished_ones():
    lr = rounds(2)
    lr.submit("s1", 1, op("a"))
    lr.submit("s0", 0, op("b"))
    lr.submit("s1", 1, op("b"))  # ready: not open any more
    actions = lr.leave(0, pid=7)
    assert kinds(actions) == ["Failed"] and actions[0].round.name == "a"
    assert actions[0].reason == "tensor 'a': rank 3 (pid 7) disconnected during round 0"
    assert lr.open == {}  # the only other rank (1) is in it: heard from everyone left
    assert lr.leave(1, pid=8) == []


def test_a_leaver_of_a_failed_round_retires_it():
    lr = rounds(3)
    lr.submit("s0", 0, op(req=1))
    lr.submit("s1", 1, op(req=2, shape=(1,)))
    assert lr.leave(2, pid=9) == []  # already failed: no second failure, and no one left to hear it
    assert lr.open == {}


def test_every_round_consumes_a_number_success_or_failure():
    lr = rounds(2)
    numbers = []
    for step, shape in enumerate([(2,), (2,), (3,), (2,), (5,)]):
        opened = lr.submit("s0", 0, op(req=2 * step, shape=(2,)))
        numbers.append(opened[0].round.round)
        lr.submit("s1", 1, op(req=2 * step + 1, shape=shape))  # steps 2 and 4 mismatch
    assert numbers == [0, 1, 2, 3, 4]
    lr.submit("s0", 0, op(req=20))
    assert kinds(lr.leave(1, pid=1)) == ["Failed"]  # round 5 fails by a departure
    assert lr.submit("s0", 0, op(req=21))[0].round.round == 6
    assert lr.submit("s0", 0, op("other", req=22))[0].round.round == 0  # per name


def test_the_round_base_turns_our_numbers_into_the_servers():
    numbers = RoundNumbers()
    assert [numbers.take("w") for _ in range(3)] == [0, 1, 2]
    assert numbers.base("w") is None and numbers.server_round("w", 2) is None
    # we came back: the servers are at round 17 of "w" when we ask before our round 2
    assert numbers.learn("w", 2, 17) == 15
    assert numbers.server_round("w", 2) == 17 and numbers.server_round("w", 5) == 20
    assert numbers.base("other") is None
    numbers.reset()
    assert numbers.base("w") is None and numbers.take("w") == 0


def test_a_failure_after_the_base_is_known_names_the_servers_round():
    lr = rounds(2)
    first = lr.submit("s0", 0, op(req=1))[0].round
    lr.numbers.learn("w", first.round, 40)
    lr.submit("s1", 1, op(req=2))
    lr.submit("s0", 0, op(req=3))  # round 1
    failed = lr.submit("s1", 1, op(req=4, dtype="int32"))[0]
    assert isinstance(failed, Failed) and failed.round.round == 1 and failed.server_round == 41


def test_the_watch_fails_a_round_only_for_a_process_that_is_not_connected():
    lr = rounds(3)
    opened = lr.submit("s0", 0, op())[0].round
    assert lr.overdue(opened, connected={0, 1, 2}, waited_s=5.0) == []  # slow, not absent: look again
    actions = lr.overdue(opened, connected={0}, waited_s=5.0)
    assert kinds(actions) == ["Failed"]
    assert actions[0].reason == "tensor 'w': rank 4, 5 of worker 1 is not connected (waited 5 s)"
    assert lr.overdue(opened, connected={0}, waited_s=5.0) is None  # failed: stop watching
    ready = rounds(1).submit("s0", 0, op())
    done = ready[0].round
    assert rounds(1).overdue(done, connected=set(), waited_s=1.0) is None  # not open (it started)


def test_the_watch_of_every_open_round_fails_those_open_a_timeout_for_a_process_not_connected():
    """The daemon's tick runs it over every open round: only a round open ``timeout_s`` or more (since the daemon
    stamped it opened) that waits for a process that is not connected fails; a slow one is looked at again."""
    lr = rounds(3)
    old = lr.submit("s0", 0, op(name="old"))[0].round
    young = lr.submit("s0", 0, op(name="young"))[0].round
    slow = lr.submit("s0", 0, op(name="slow"))[0].round
    unstamped = lr.submit("s0", 0, op(name="unstamped"))[0].round
    old.opened_at, young.opened_at = 100.0, 104.5
    slow.opened_at = 100.0
    lr.submit("s1", 1, op(name="slow", req=2))  # slow waits only for rank 2, which is connected
    actions = lr.overdue_rounds(connected={0, 2}, now=105.0, timeout_s=5.0)
    assert kinds(actions) == ["Failed"] and actions[0].round is old
    assert actions[0].reason == "tensor 'old': rank 4 of worker 1 is not connected (waited 5 s)"
    assert old.failed and young.failed is None and slow.failed is None and unstamped.failed is None
    assert lr.overdue_rounds(connected={0, 2}, now=105.0, timeout_s=5.0) == []  # failed once, not again
    later = lr.overdue_rounds(connected={0}, now=109.5, timeout_s=5.0)
    assert sorted(a.round.name for a in later) == ["slow", "young"]


def test_reset_fails_every_open_round_and_numbering_starts_again():
    lr = rounds(2)
    lr.submit("s0", 0, op("a"))
    lr.submit("s1", 1, op("b"))
    lr.submit("s0", 0, op("b"))  # b round 0 ready
    lr.submit("s0", 0, op("b"))  # b round 1 open
    lr.numbers.learn("b", 1, 9)
    actions = lr.reset()
    assert kinds(actions) == ["Failed", "Failed"]
    assert {a.reason for a in actions} == {"tensor 'a': every process of worker 1 left",
                                           "tensor 'b': every process of worker 1 left"}
    assert {a.round.name: a.server_round for a in actions} == {"a": None, "b": 9}  # known before the reset
    assert lr.open == {} and lr.numbers.base("b") is None
    assert lr.submit("s0", 0, op("b"))[0].round.round == 0


def test_failing_twice_does_nothing_the_second_time():
    lr = rounds(2)
    opened: LocalRound[str] = lr.submit("s0", 0, op())[0].round
    assert kinds(lr.fail(opened, "first")) == ["Failed"]
    assert lr.fail(opened, "second") == [] and opened.failed == "first"


def test_action_types_carry_the_round():
    lr = rounds(1)
    opened, ready = lr.submit("s0", 0, op())
    assert isinstance(opened, Opened) and isinstance(ready, Ready) and opened.round is ready.round
    lr2 = rounds(2)
    lr2.submit("s0", 0, op())
    refused = lr2.submit("s0", 0, op(req=5))[0]
    assert isinstance(refused, Refused)


def test_each_failure_carries_its_code_and_facts_for_the_typed_error():
    """The Failure each process gets names its own tensor as ``ours`` (a mismatch), the process that left
    as ``peer``, or what timed out and after how long: the client builds the typed error from these."""
    from bps_worker.errors import BPSConnectionError, BPSMismatchError, BPSTimeoutError, error_from_failure

    lr = rounds(3)
    first, bad, late = op(req=1, shape=(4, 3)), op(req=2, shape=(4, 4)), op(req=3, shape=(4, 3))
    lr.submit("s0", 0, first)
    failed = lr.submit("s1", 1, bad)[0]
    assert isinstance(failed, Failed)
    answers = {o.req: failed.failure(o) for _, o in failed.members}
    answers[3] = lr.submit("s2", 2, late)[0].failure()  # the late rank hears the same, from its side
    for req, (ours, theirs) in {1: ("float32[4,3]", "float32[4,4]"), 2: ("float32[4,4]", "float32[4,3]"),
                                3: ("float32[4,3]", "float32[4,4]")}.items():
        f = answers[req]
        assert (f.req, f.code, f.name, f.ours, f.theirs) == (req, "mismatch", "w", ours, theirs)
        assert f.message == failed.reason  # the text is unchanged
        error = error_from_failure(f)
        assert isinstance(error, BPSMismatchError) and (error.name, error.ours, error.theirs) == ("w", ours, theirs)
        assert "rank 3 has float32[4,3] but rank 4 has float32[4,4]" in str(error)

    lr = rounds(2)
    lr.submit("s0", 0, op(req=1))
    lr.submit("s1", 1, op(req=2))  # ready: gone
    lr.submit("s0", 0, op(req=3))
    left = lr.leave(1, pid=77)[0]
    assert isinstance(left, Failed)
    f = left.failure(op(req=3))
    assert (f.code, f.peer) == ("connection", "rank 4 (pid 77)")
    assert isinstance(error_from_failure(f), BPSConnectionError) and error_from_failure(f).peer == "rank 4 (pid 77)"

    lr = rounds(2)
    opened = lr.submit("s0", 0, op(req=1))[0].round
    overdue = lr.overdue(opened, connected={0}, waited_s=5.0)
    assert overdue is not None and isinstance(overdue[0], Failed)
    f = overdue[0].failure(op(req=1))
    assert (f.code, f.what, f.timeout_s) == ("timeout", "tensor 'w'", 5.0)
    error = error_from_failure(f)
    assert isinstance(error, BPSTimeoutError) and (error.what, error.timeout_s) == ("tensor 'w'", 5.0)
    assert str(error) == "tensor 'w' timed out after 5 s: rank 4 of worker 1 is not connected"


def test_failing_a_name_does_not_wait_for_the_ranks_that_heard_it_through_their_fused_entries():
    """Local rank 0 pushed "w" too large to fuse, ranks 1 and 2 small enough (their fused entries were
    answered): the round fails now, is aborted at the anchor, and is gone, so the name's next round is new."""
    lr = rounds(3)
    (opened,) = lr.submit("p0", 0, op())
    assert isinstance(opened, Opened)
    why = Why.mismatch("w", "float32[2]", "float32[4,3]", "sizes on both sides of the fusion limit")
    (failed,) = lr.fail_name("w", why, {1, 2})
    assert isinstance(failed, Failed) and [m for m, _ in failed.members] == ["p0"]
    assert failed.failure(failed.members[0][1]).code == "mismatch"
    assert "w" not in lr.open
    assert kinds(lr.submit("p1", 1, op(req=2))) == ["Opened"]  # a new round, not the failed one's error
    assert lr.fail_name("nothing", why, {0}) == []


def test_a_failed_round_still_waits_for_a_rank_that_heard_nothing():
    lr = rounds(3)
    lr.submit("p0", 0, op())
    why = Why.mismatch("w", "float32[2]", "float32[4,3]", "sizes on both sides of the fusion limit")
    lr.fail_name("w", why, {1})
    assert lr.open["w"][0].expected == {2}
    (refused,) = lr.submit("p2", 2, op(req=3))  # the late rank gets the round's error, and then it is gone
    assert isinstance(refused, Refused) and refused.code == "mismatch" and "w" not in lr.open


def test_with_a_stall_timeout_the_watch_fails_a_round_that_waits_for_a_connected_process():
    """cluster.stall_timeout: a round open that long for processes that are connected but never submit it fails,
    naming them; one open less long is looked at again (a process not connected fails after the timeout, as
    before)."""
    lr = rounds(3)
    stuck = lr.submit("s0", 0, op(name="stuck"))[0].round
    young = lr.submit("s0", 0, op(name="young"))[0].round
    stuck.opened_at, young.opened_at = 100.0, 140.0
    assert lr.overdue_rounds(connected={0, 1, 2}, now=159.9, timeout_s=5.0, stall_s=60.0) == []
    actions = lr.overdue_rounds(connected={0, 1, 2}, now=160.0, timeout_s=5.0, stall_s=60.0)
    assert kinds(actions) == ["Failed"] and actions[0].round is stuck
    assert actions[0].reason == ("tensor 'stuck': rank 4, 5 of worker 1 did not submit it (cluster.stall_timeout), "
                                 "waited 60 s")
    f = actions[0].failure(op(req=7))
    assert (f.code, f.timeout_s, f.detail) == ("timeout", 60.0, "rank 4, 5 of worker 1 did not submit it "
                                                                "(cluster.stall_timeout)")
    assert young.failed is None and lr.overdue_rounds(connected={0, 1, 2}, now=1000.0, timeout_s=5.0) == []


def test_with_a_stall_timeout_a_round_waiting_for_a_rank_that_keeps_submitting_does_not_fail():
    """A rank issuing its names in another order submits others while this round waits for it: busy, not
    stalled (``heard``: when each local rank last submitted)."""
    lr = rounds(3)
    waiting = lr.submit("s0", 0, op(name="w1"))[0].round
    waiting.opened_at = 100.0
    assert lr.overdue_rounds(connected={0, 1, 2}, now=200.0, timeout_s=5.0, stall_s=60.0,
                             heard={1: 190.0, 2: 150.0}) == []  # rank 1 (local 1) busy
    (failed,) = lr.overdue_rounds(connected={0, 1, 2}, now=251.0, timeout_s=5.0, stall_s=60.0,
                                  heard={1: 190.0, 2: 150.0})
    assert "rank 4, 5 of worker 1 did not submit it" in failed.reason
