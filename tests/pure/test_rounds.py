"""The round table's decisions, without sockets, asyncio or a clock: events in, actions out."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from bps_server.rounds import (
    Add,
    Answer,
    Cleared,
    Complete,
    Fail,
    FailRound,
    Note,
    Redispatch,
    RoundTable,
    Settled,
    StartGrace,
    sizes_differ,
    SumAll,
    Why,
)
from protocol import messages
from protocol.messages import Push


def _push(worker: int, *, rnd: int = 0, name: str = "t", part: int = 0, shape: list[int] | None = None,
          dtype: str = "float32", replay: bool = False) -> Push:
    shape = [4] if shape is None else shape
    count = int(np.prod(shape))
    return Push(req=worker, name=name, part=part, round=rnd, worker=worker, dtype=dtype, shape=shape, offset=0,
                count=count, replay=replay)


def _data(value: float = 1.0) -> np.ndarray:
    return np.full(4, value, np.float32)


def _fails(actions: list) -> dict[str, str]:
    """handle -> reason of every push failed by these actions (directly or through a failed round)."""
    out: dict[str, str] = {}
    for a in actions:
        for f in (a.fails if isinstance(a, FailRound) else (a,) if isinstance(a, Fail) else ()):
            out[f.handle] = f.reason
    return out


def _facts(actions: list) -> dict[str, tuple]:
    """handle -> (code, name, ours, theirs, peer, what, timeout_s) of every push failed by these actions."""
    out: dict[str, tuple] = {}
    for a in actions:
        for f in (a.fails if isinstance(a, FailRound) else (a,) if isinstance(a, Fail) else ()):
            w = f.why
            out[f.handle] = (w.code, w.name, w.ours, w.theirs, w.peer, w.what, w.timeout_s)
    return out


def _sum_round(table: RoundTable[str], rnd: int, workers: range, now: float = 0.0) -> Complete[str]:
    """Push, add and complete one round the way the driver does."""
    adds = [table.push(_push(w, rnd=rnd), _data(), f"w{w}", now) for w in workers]
    tokens = [a[0].token for a in adds]
    assert all(isinstance(a[0], Add) for a in adds)
    assert [table.added(t) for t in tokens] == [False] * (len(tokens) - 1) + [True]
    done = table.complete(tokens[-1])
    assert done is not None
    return done


def test_a_round_completes_once_every_worker_added_and_opens_the_next():
    table: RoundTable[str] = RoundTable(3)
    done = _sum_round(table, 0, range(3), now=5.0)
    assert done.round == 0 and done.opened == 5.0 and [w.handle for w in done.waiters] == ["w0", "w1", "w2"]
    assert table.keys[("t", 0)].round == 1


def test_a_stale_push_is_refused_naming_both_rounds():
    table: RoundTable[str] = RoundTable(1)
    _sum_round(table, 3, range(1))
    assert _fails(table.push(_push(0, rnd=2), _data(), "late", 0.0)) == {
        "late": "tensor 't' part 0: stale round 2, the server is at round 4"}


def test_a_later_round_abandons_the_incomplete_one_and_late_pushes_learn_why():
    table: RoundTable[str] = RoundTable(3)
    table.push(_push(0, rnd=0), _data(), "w0r0", 0.0)
    actions = table.push(_push(1, rnd=1), _data(), "w1r1", 0.0)
    assert isinstance(actions[0], FailRound) and actions[0].round == 0
    assert _fails(actions) == {"w0r0": "tensor 't' round 0 abandoned: worker 1 moved on to round 1"}
    assert isinstance(actions[-1], Add) and actions[-1].token.round == 1
    # a push of the abandoned round, after it: the round's own reason, not "stale"
    assert _fails(table.push(_push(2, rnd=0), _data(), "w2r0", 0.0)) == {
        "w2r0": "tensor 't' round 0 abandoned: worker 1 moved on to round 1"}


def test_a_descriptor_mismatch_fails_the_round_naming_the_tensor_and_both_shapes():
    table: RoundTable[str] = RoundTable(3)
    first = table.push(_push(0, shape=[2, 2]), _data(), "a", 0.0)
    actions = table.push(_push(1, shape=[4]), _data(), "b", 0.0)
    why = "tensor 't' mismatch: worker 0 pushed float32[2,2] but worker 1 pushed float32[4]"
    assert [type(a) for a in actions] == [FailRound] and _fails(actions) == {"a": why, "b": why}
    assert not table.current(first[0].token)  # the driver drops worker 0's addition
    assert table.added(first[0].token) is False and table.complete(first[0].token) is None
    late = table.push(_push(2, shape=[2, 2]), _data(), "c", 0.0)
    assert _fails(late) == {"c": why}
    # the code and facts a worker builds its BPSMismatchError from: each side's own descriptor is ours
    assert actions[0].why.code == "mismatch"
    assert _facts(actions) == {"a": ("mismatch", "t", "float32[2,2]", "float32[4]", "", "", 0.0),
                               "b": ("mismatch", "t", "float32[4]", "float32[2,2]", "", "", 0.0)}
    assert _facts(late) == {"c": ("mismatch", "t", "float32[2,2]", "float32[4]", "", "", 0.0)}
    failure = actions[0].fails[1].why.failure(7)  # what the connection sends
    assert (failure.req, failure.message, failure.code, failure.name, failure.ours, failure.theirs) == (
        7, why, "mismatch", "t", "float32[4]", "float32[2,2]")
    assert failure.detail == "worker 0 pushed float32[2,2] but worker 1 pushed float32[4]"
    done = _sum_round(table, 1, range(3))  # the next round works
    assert done.round == 1


def test_a_duplicate_push_fails_only_itself():
    table: RoundTable[str] = RoundTable(2)
    table.push(_push(0), _data(), "first", 0.0)
    assert _fails(table.push(_push(0), _data(), "again", 0.0)) == {
        "again": "tensor 't' part 0: worker 0 pushed round 0 twice"}
    assert isinstance(table.push(_push(1), _data(), "other", 0.0)[0], Add)


def test_deterministic_rounds_hold_every_input_and_sum_them_in_worker_order():
    table: RoundTable[str] = RoundTable(3, deterministic=True)
    xs = {w: _data(w) for w in range(3)}
    assert table.push(_push(2), xs[2], "w2", 0.0) == [] and table.push(_push(0), xs[0], "w0", 0.0) == []
    (work,) = table.push(_push(1), xs[1], "w1", 0.0)
    assert isinstance(work, SumAll) and [x[0] for x in work.inputs] == [0.0, 1.0, 2.0]
    assert table.keys[("t", 0)].held == {}
    done = table.complete(work.token)
    assert done is not None and sorted(w.handle for w in done.waiters) == ["w0", "w1", "w2"]


def test_half_types_take_the_one_pass_path_without_deterministic_mode():
    table: RoundTable[str] = RoundTable(1)
    (work,) = table.push(_push(0, dtype="float16"), np.zeros(4, np.uint16), "w0", 0.0)
    assert isinstance(work, SumAll)


def test_a_one_pass_sum_carries_the_leases_of_its_borrowed_inputs():
    table: RoundTable[str] = RoundTable(3, deterministic=True)

    def lease() -> None:
        pass

    table.push(_push(0), _data(), "w0", 0.0, borrowed=lease)
    table.push(_push(1), _data(), "w1", 0.0)
    (work,) = table.push(_push(2), _data(), "w2", 0.0, borrowed=lease)
    assert isinstance(work, SumAll) and work.leases == (lease, lease)
    (add,) = RoundTable(2).push(_push(0), _data(), "w0", 0.0, borrowed=lease)
    assert isinstance(add, Add) and add.borrowed is lease


def test_the_driver_fails_a_round_it_cannot_sum_for_everyone_and_late_pushes_hear_why():
    table: RoundTable[str] = RoundTable(3)
    (add,) = table.push(_push(0), _data(), "w0", 0.0)
    table.push(_push(1), _data(), "w1", 0.0)
    why = Why("shared memory 'x' has 0 bytes now")
    assert _fails(table.fail(add.token, why)) == {"w0": why.text, "w1": why.text}
    assert not table.current(add.token) and table.fail(add.token, why) == []  # once
    assert _fails(table.push(_push(2), _data(), "w2", 0.0)) == {"w2": why.text}


def test_abort_fails_waiters_and_late_pushes():
    table: RoundTable[str] = RoundTable(3)
    table.push(_push(0), _data(), "w0", 0.0)
    actions = table.abort("t", 0, 0, worker=2, why=Why("local mismatch"))
    assert _fails(actions) == {"w0": "tensor 't' round 0 aborted by worker 2: local mismatch"}
    assert _fails(table.push(_push(1), _data(), "w1", 0.0)) == {
        "w1": "tensor 't' round 0 aborted by worker 2: local mismatch"}


def test_the_workers_that_gave_a_failed_round_up_are_past_it():
    """``past``: what the planner asks of a late push's round (see bps_server.fusion.pushed_unfused): the fused
    reports of workers that aborted the round are of a later step. Not while the round is open, nor for a worker
    that did not abort it."""
    table: RoundTable[str] = RoundTable(3)
    assert not table.past("t", {0})  # no round
    table.push(_push(1), _data(), "w1", 0.0)
    assert not table.past("t", {1})  # open
    table.abort("t", 0, 0, worker=0, why=Why("local mismatch"))
    table.abort("t", 0, 0, worker=2, why=Why("local mismatch"))  # (failed already: recorded all the same)
    assert table.past("t", {0}) and table.past("t", {0, 2})
    assert not table.past("t", {1}) and not table.past("t", {0, 1}) and not table.past("t", set())
    assert not table.past("other", {0})
    table.push(_push(0, rnd=1), _data(), "w0", 0.0)  # the next round
    assert not table.past("t", {0})


def test_a_replayed_sum_answers_who_missed_it_and_settles_the_round():
    table: RoundTable[str] = RoundTable(3)
    total = np.array([1.5, -2.25, 1e-8, 0], np.float32)
    table.push(_push(1, rnd=4), _data(), "w1", 0.0)
    actions = table.replay(_push(0, rnd=4, replay=True), total, 1.0)
    (answer,) = actions
    assert isinstance(answer, Answer) and [w.handle for w in answer.waiters] == ["w1"]
    np.testing.assert_array_equal(answer.result, total)
    actions = table.push(_push(2, rnd=4), _data(7), "w2", 2.0)
    assert isinstance(actions[0], Answer) and actions[0].waiters[0].handle == "w2"
    assert actions[1:] == [Settled(("t", 0), 4), Redispatch(())]
    assert table.keys[("t", 0)].round == 5


def test_a_replayers_next_round_is_held_until_the_replayed_round_settles():
    table: RoundTable[str] = RoundTable(2)
    table.replay(_push(0, rnd=7, replay=True), _data(3), 0.0)
    assert table.push(_push(0, rnd=8), _data(1), "w0r8", 0.0) == []  # held, not abandoning round 7
    assert table.keys[("t", 0)].round == 7
    actions = table.push(_push(1, rnd=7), _data(9), "w1r7", 0.0)
    assert isinstance(actions[0], Answer) and isinstance(actions[1], Settled)
    (redispatch,) = actions[2:]
    assert isinstance(redispatch, Redispatch) and [h.handle for h in redispatch.held] == ["w0r8"]
    assert redispatch.held[0].push.round == 8 and table.keys[("t", 0)].round == 8


def test_an_abort_carrying_a_mismatch_is_heard_by_each_push_as_its_own_side():
    """Worker 2's processes disagreed (float32[4] against float32[5]) and it gave the round up: its Abort carries
    the mismatch whole, and the other workers' pushes, of either shape, waiting or late, each hear it as a
    mismatch with their own tensor as ``ours`` (as the connection answers a push: ``for_push``), and who gave it
    up (it was a round_failed without facts)."""
    table: RoundTable[str] = RoundTable(3)
    table.push(_push(0), _data(), "w0", 0.0)
    local = messages.Why.mismatch("t", "float32[4]", "float32[5]", "rank 4 has float32[4] but rank 5 has float32[5]")
    abort = messages.Abort("t", 0, 0, 2, **local.carry())  # as the worker's link sends it
    actions = table.abort("t", 0, 0, worker=2, why=Why.carried(abort, abort.name))
    actions += table.push(_push(1, shape=[5]), _data(), "w1", 0.0)
    heard = {f.handle: f.why.for_push(f.push) for a in actions
             for f in (a.fails if isinstance(a, FailRound) else (a,) if isinstance(a, Fail) else ())}
    assert {h: (w.code, w.name, w.ours, w.theirs) for h, w in heard.items()} == {
        "w0": ("mismatch", "t", "float32[4]", "float32[5]"), "w1": ("mismatch", "t", "float32[5]", "float32[4]")}
    assert heard["w1"].detail == "tensor 't' round 0 aborted by worker 2: rank 4 has float32[4] but rank 5 has " \
        "float32[5]"


def test_a_held_push_fails_with_its_round_when_the_replayed_round_fails():
    table: RoundTable[str] = RoundTable(2)
    table.replay(_push(0, rnd=7, replay=True), _data(3), 0.0)
    table.push(_push(0, rnd=8), _data(1), "held", 0.0)
    actions = table.abort("t", 0, 7, worker=1, why=Why("gave up"))
    assert _fails(actions) == {"held": "tensor 't' round 8 cannot start: round 7 failed: tensor 't' round 7 "
                                       "aborted by worker 1: gave up"}


def test_an_abort_of_the_next_round_fails_a_held_push_of_it_rather_than_dropping_it():
    # A server restarted: worker 0 replayed round 7 and pushed round 8 (held); worker 1's abort of round 8 (queued
    # while its link was down, sent before its replays) comes before its replay of round 7. The held push must hear
    # that round 8 failed: dropped with round 7's state, it was never answered (its operation waited for ever).
    table: RoundTable[str] = RoundTable(2)
    table.replay(_push(0, rnd=7, replay=True), _data(3), 0.0)
    assert table.push(_push(0, rnd=8), _data(1), "w0r8", 0.0) == []
    actions = table.abort("t", 0, 8, worker=1, why=Why("gave up"))
    assert _fails(actions) == {"w0r8": "tensor 't' round 8 cannot start: round 7 failed: tensor 't' round 7 "
                                       "abandoned: worker 1 aborted round 8"}
    st = table.keys[("t", 0)]
    assert st.round == 8 and st.failed is not None and not st.restart.held_next
    (note,) = table.replay(_push(1, rnd=7, replay=True), _data(3), 0.0)  # its replay, late: nothing to do
    assert isinstance(note, Note) and "the server is at round 8 (failed)" in note.message


def test_when_everyone_replays_the_round_just_moves_on():
    table: RoundTable[str] = RoundTable(2)
    assert table.replay(_push(1, rnd=2, replay=True), _data(), 0.0) == []
    assert table.replay(_push(0, rnd=2, replay=True), _data(), 0.0) == [Settled(("t", 0), 2), Redispatch(())]
    assert table.keys[("t", 0)].round == 3


def test_a_later_replay_supersedes_an_earlier_one_and_frees_what_was_held():
    table: RoundTable[str] = RoundTable(2)
    table.replay(_push(0, rnd=7, replay=True), _data(7), 0.0)
    table.push(_push(0, rnd=8), _data(1), "w0r8", 0.0)
    actions = table.replay(_push(1, rnd=8, replay=True), _data(8), 0.0)
    assert isinstance(actions[0], Redispatch) and [h.handle for h in actions[0].held] == ["w0r8"]
    assert table.keys[("t", 0)].round == 8 and table.keys[("t", 0)].restart.replayers == {1}


def test_stale_or_mismatched_replays_are_ignored_with_a_note():
    table: RoundTable[str] = RoundTable(2)
    _sum_round(table, 5, range(2))
    (note,) = table.replay(_push(0, rnd=4, replay=True), _data(9), 0.0)
    assert isinstance(note, Note) and note.level == logging.INFO
    assert note.message == "ignoring worker 0's replay of 't' part 0 round 4: the server is at round 6"
    table.push(_push(1, rnd=6), _data(), "w1", 0.0)
    (note,) = table.replay(_push(0, rnd=6, shape=[3], replay=True), np.zeros(3, np.float32), 0.0)
    assert note.level == logging.WARNING and "float32[3], but the round's pushes are float32[4]" in note.message
    assert table.keys[("t", 0)].restart.result is None


def test_a_push_unlike_the_replay_that_came_first_fails_the_round_rather_than_get_its_sum():
    # The replay came before any push: a later push must still be compared, with it (it was answered with the
    # replayed sum, of another size, which its worker refused as a protocol error, breaking the connection).
    table: RoundTable[str] = RoundTable(3)
    table.replay(_push(0, rnd=6, replay=True), _data(9), 0.0)
    (note,) = table.replay(_push(1, rnd=6, shape=[3], replay=True), np.zeros(3, np.float32), 0.0)
    assert note.level == logging.WARNING and "float32[3], but the round's pushes are float32[4]" in note.message
    actions = table.push(_push(2, rnd=6, shape=[3]), np.zeros(3, np.float32), "w2", 0.0)
    assert not any(isinstance(a, Answer) for a in actions)
    assert _facts(actions)["w2"][0] == "mismatch" and "float32[4]" in _fails(actions)["w2"]
    assert isinstance(table.push(_push(2, rnd=6), _data(), "again", 0.0)[0], Fail)  # the round failed for all


def test_a_replay_during_an_addition_makes_the_addition_stale():
    table: RoundTable[str] = RoundTable(2)
    (add,) = table.push(_push(1, rnd=4), _data(), "w1", 0.0)
    table.replay(_push(0, rnd=4, replay=True), _data(2), 0.0)
    assert table.added(add.token) is False and table.complete(add.token) is None


def test_sweep_fails_a_round_waiting_for_an_unconnected_worker_after_the_grace():
    connected = {0, 1}
    table: RoundTable[str] = RoundTable(3, lost_grace_s=10, connected=lambda w: w in connected)
    for w in (0, 1):
        table.push(_push(w), _data(), f"w{w}", 100.0)
    assert table.sweep(109.0) == []  # too early
    actions = table.sweep(110.5)
    why = "worker 2 was not connected to this server (waited 10 s); round 0 of 't' cannot complete"
    assert len(actions) == 1 and _fails(actions) == {"w0": why, "w1": why}
    assert _facts(actions)["w0"] == ("connection", "", "", "", "worker 2", "round 0 of 't'", 10)
    assert actions[0].why.failure(0).detail == why
    named: RoundTable[str] = RoundTable(3, lost_grace_s=10, connected=lambda w: w in connected, server="server 4")
    named.push(_push(0), _data(), "w0", 100.0)
    assert _fails(named.sweep(110.5))["w0"].startswith("worker 2 was not connected to server 4 (waited 10 s)")
    slow: RoundTable[str] = RoundTable(3, lost_grace_s=10)  # connected but slow: waited for
    slow.push(_push(0), _data(), "w0", 100.0)
    assert slow.sweep(1000.0) == []


def test_sweep_fails_a_round_waiting_for_a_worker_without_processes():
    table: RoundTable[str] = RoundTable(2, lost_grace_s=10)
    table.worker_reset(1)
    table.push(_push(0), _data(), "w0", 0.0)
    assert _fails(table.sweep(11.0)) == {
        "w0": "worker 1 had no training processes: none had started yet, or they had left (waited 10 s); round 0 of 't' cannot complete"}


def test_a_daemon_that_says_it_has_no_processes_is_one_without_them_until_it_says_joined():
    """Hello.processes: a daemon idle since it started (it never says Reset) fails the rounds that wait for it after
    the timeout, as one that reset does; once it says Joined, it is waited for as any connected worker (its
    processes may be busy with other servers' tensors)."""
    table: RoundTable[str] = RoundTable(2, lost_grace_s=10)
    table.worker_hello(1, "e1", fresh=True)
    table.worker_idle(1)
    table.push(_push(0), _data(), "w0", 0.0)
    assert _fails(table.sweep(11.0)) == {
        "w0": "worker 1 had no training processes: none had started yet, or they had left (waited 10 s); round 0 of 't' cannot complete"}
    table.worker_joined(1)
    table.push(_push(0, rnd=1), _data(), "w0", 20.0)
    assert table.sweep(1000.0) == []


def test_a_worker_back_after_a_dropped_connection_is_waited_for_as_a_connected_one():
    # The same daemon (the same numbering) back after its connection dropped: its processes never left, so a
    # round waiting for them is not failed for "no training processes" however slow they are.
    table: RoundTable[str] = RoundTable(2, lost_grace_s=10)
    table.worker_hello(1, "epoch-a")
    table.worker_lost(1)
    table.worker_hello(1, "epoch-a")
    table.push(_push(0), _data(), "w0", 0.0)
    assert table.sweep(1000.0) == []
    # A new daemon (a new numbering) is new processes: none until it pushes, as before.
    table.worker_lost(1)
    table.worker_hello(1, "epoch-b")
    table.push(_push(0, name="u"), _data(), "u0", 1000.0)
    assert _fails(table.sweep(1011.0)) == {
        "u0": "worker 1 had no training processes: none had started yet, or they had left (waited 10 s); round 0 of 'u' cannot complete"}
    # A worker that reset stays one without processes across a dropped connection and the same numbering.
    table.worker_reset(1, "epoch-c")
    table.worker_lost(1)
    table.worker_hello(1, "epoch-c")
    table.push(_push(0, name="v"), _data(), "v0", 2000.0)
    assert _fails(table.sweep(2011.0)) == {
        "v0": "worker 1 had no training processes: none had started yet, or they had left (waited 10 s); round 0 of 'v' cannot complete"}


def test_a_lost_worker_fails_pending_rounds_now_and_later_ones_once_its_grace_expires():
    table: RoundTable[str] = RoundTable(2, lost_grace_s=5)
    table.push(_push(0, name="pending"), _data(), "pending", 0.0)
    actions = table.worker_lost(1)
    assert actions[0] == StartGrace(1, actions[0].gone, "is disconnected")
    assert _fails(actions) == {"pending": "worker 1 is disconnected; round 0 of 'pending' cannot complete"}
    assert _facts(actions) == {"pending": ("connection", "", "", "", "worker 1", "", 0.0)}
    assert table.push(_push(0, name="later"), _data(), "later", 1.0)[0].__class__ is Add  # may come back
    gone = actions[0].gone
    assert _fails(table.grace_expired(1, gone, "is disconnected")) == {
        "later": "worker 1 is disconnected; round 0 of 'later' cannot complete"}
    after = table.push(_push(0, name="after"), _data(), "after", 2.0)
    assert "worker 1 is gone" in _fails(after)["after"]
    assert _facts(after)["after"][0::4] == ("connection", "worker 1")
    table.worker_joined(1)
    assert isinstance(table.push(_push(0, name="back"), _data(), "back", 3.0)[0], Add)


def test_a_grace_timer_of_a_worker_that_came_back_changes_nothing():
    table: RoundTable[str] = RoundTable(2, lost_grace_s=5)
    (grace,) = table.worker_lost(1)
    table.worker_hello(1, "")
    table.push(_push(0), _data(), "w0", 0.0)
    assert table.grace_expired(1, grace.gone, grace.why) == [] and not table.lost_workers


def test_reset_fails_pending_rounds_and_once_every_worker_reset_clears_all_keys():
    table: RoundTable[str] = RoundTable(2, lost_grace_s=10)
    table.push(_push(0, name="x", rnd=7), _data(), "w0", 0.0)
    actions = table.worker_reset(1)
    assert _fails(actions) == {"w0": "worker 1 has no training processes left (they exited or died); round 7 "
                                     "of 'x' cannot complete"}
    assert _facts(actions)["w0"][0::4] == ("connection", "worker 1")
    assert not any(isinstance(a, Cleared) for a in actions) and table.keys
    assert Cleared(1) in table.worker_reset(0)
    assert table.keys == {}
    assert isinstance(table.push(_push(0, name="x", rnd=0), _data(), "w0", 0.0)[0], Add)  # round 0 again


def test_a_reset_spares_the_rounds_it_is_told_are_of_a_later_job_and_they_complete_with_its_next_processes():
    """Worker 0's trainer of the next job opened 'next' while worker 1's of the last job lingered (its 'last'
    open): worker 1's Reset failed 'next' too (bps_server.jobs). Spared, it waits for worker 1's next processes,
    whose push joins it."""
    table: RoundTable[str] = RoundTable(2, lost_grace_s=10)
    table.push(_push(1, name="last", rnd=3), _data(), "l1", 0.0)
    table.push(_push(0, name="next", rnd=0), _data(), "n0", 0.0)
    actions = table.worker_reset(1, "epoch-b", spared=lambda workers: 1 not in workers)
    assert _fails(actions) == {"l1": "worker 1 has no training processes left (they exited or died); round 3 of "
                                     "'last' cannot complete"}
    assert not any(isinstance(a, Fail) for a in table.push(_push(1, name="next", rnd=0), _data(), "n1", 1.0))
    assert set(table.keys[("next", 0)].waiters) == {0, 1}


def test_a_machine_idle_since_it_started_beside_a_dropped_one_is_not_the_jobs_end():
    """Worker 1's processes have not started (its daemon said so) and its connection drops (the round waiting for
    it fails), then worker 0's: neither said its processes left, so nothing is cleared, and worker 1's late push of
    the failed round fails at once. Taken for the job's end, the failure was forgotten and the late push opened the
    round afresh, waiting for ever for worker 0, which had moved on (test_dropped_links, 1 run in 5)."""
    table: RoundTable[str] = RoundTable(2, lost_grace_s=10)
    for w in range(2):
        table.worker_hello(w, f"epoch-{w}")
    table.worker_idle(1)
    table.push(_push(0), _data(), "w0", 0.0)
    assert "worker 1 is disconnected" in _fails(table.worker_lost(1))["w0"]
    assert not any(isinstance(a, Cleared) for a in table.worker_lost(0)) and table.keys
    table.worker_hello(0, "epoch-0")
    table.worker_hello(1, "epoch-1")
    table.worker_joined(1)
    assert "worker 1 is disconnected" in _fails(table.push(_push(1), _data(), "w1", 1.0))["w1"]
    # Its processes left for good instead (a Reset): the job is over, as before.
    table.worker_lost(0)
    table.worker_reset(1, "epoch-1b")
    assert table.keys == {}


def test_connections_that_all_dropped_keep_the_keys_and_a_failed_round_stays_failed():
    # Worker 1's connection drops (the round waiting for it fails), then worker 0's: no worker said its
    # processes left, so nothing is cleared, and worker 1's late push of the failed round fails at once.
    table: RoundTable[str] = RoundTable(2, lost_grace_s=10)
    for w in range(2):
        table.worker_hello(w, f"epoch-{w}")
    table.push(_push(0, rnd=3), _data(), "w0", 0.0)
    assert "worker 1 is disconnected" in _fails(table.worker_lost(1))["w0"]
    assert not any(isinstance(a, Cleared) for a in table.worker_lost(0)) and table.keys
    assert table.worker_hello(0, "epoch-0") == [] and table.worker_hello(1, "epoch-1") == []
    assert "worker 1 is disconnected" in _fails(table.push(_push(1, rnd=3), _data(), "w1", 1.0))["w1"]
    # A dropped worker back as a new daemon is one whose processes left: with every other worker without
    # processes, the job is over, as when every worker reset.
    table.worker_lost(0)
    table.worker_reset(1, "epoch-1b")
    assert table.keys == {}  # (a reset beside a dropped connection: cleared, as before)
    fresh: RoundTable[str] = RoundTable(2, lost_grace_s=10)
    for w in range(2):
        fresh.worker_hello(w, f"epoch-{w}")
    fresh.push(_push(0), _data(), "w0", 0.0)
    fresh.worker_lost(1)
    fresh.worker_lost(0)
    assert fresh.keys and Cleared(1) in fresh.worker_hello(0, "epoch-0b")
    assert fresh.keys == {}


def test_round_for_a_rejoining_worker_is_the_round_the_others_are_in():
    table: RoundTable[str] = RoundTable(2)
    for w in range(2):
        table.worker_hello(w, f"epoch-{w}")
    _sum_round(table, 0, range(2))
    _sum_round(table, 1, range(2))
    assert table.round_for("t", 0, 1) == 0  # not rejoining: every worker starts a job together
    assert table.round_for("t", 0, 1, local=3) == 3  # (its numbers are the servers', asked at any round)
    assert table.round_for("t", 0, 1, local=3, failed=True) == 3
    (note,) = table.worker_hello(1, "a-new-daemon")
    assert table.round_for("t", 0, 1, local=0, failed=True) == -1  # a failed step's number: ask again later
    assert note.message == "worker 1 came back (a new daemon) while other workers are mid-job: it rejoins them"
    assert table.round_for("t", 0, 1) == 2
    table.push(_push(0, rnd=2), _data(), "w0", 0.0)
    assert table.round_for("t", 0, 1) == 2  # the others' round, still open for it
    table.push(_push(1, rnd=2), _data(), "w1", 0.0)
    assert table.round_for("t", 0, 1) == 3  # it already pushed this one
    assert table.round_for("unknown", 0, 1) == 0


def test_a_fresh_worker_unknown_to_a_restarted_server_rejoins_when_another_is_mid_job():
    """A double fault: this server restarted while worker 1's machine was down too, so it never saw worker 1's
    earlier numbering. Worker 0's hello says its numbering is in use (mid-job, numbered against our
    predecessor) and it tells the round it gave up (7); worker 1's new daemon says its numbering is fresh. It
    rejoins at worker 0's next round, in either order of the hellos, and is never waited for in a round it had
    no part in."""
    for first in (0, 1):
        table: RoundTable[str] = RoundTable(2)
        hellos = {0: lambda: table.worker_hello(0, "epoch-0", fresh=False),
                  1: lambda: table.worker_hello(1, "new-daemon", fresh=True)}
        actions = hellos[first]() + hellos[1 - first]()
        assert [a.message for a in actions if isinstance(a, Note)] == [
            "worker 1 came back (a new daemon, or new processes) while this server was down and other workers "
            "are mid-job: it rejoins them"], first
        table.abort("t", 0, 7, 0, Why("given up", "round_failed"))
        assert table.round_for("t", 0, 1) == 8  # not 0: round 0 would be a stale push here
        table.push(_push(0, rnd=8), _data(2), "w0", 0.0)
        (add,) = table.push(_push(1, rnd=8), _data(3), "w1", 0.0)[-1:]
        assert isinstance(add, Add) and add.token.round == 8


def test_a_replayed_round_does_not_wait_for_a_worker_that_rejoined_after_a_double_fault():
    """Worker 0 replays round 4's sum (it pushed round 5 next): a round our predecessor summed with worker 1's
    old processes. Worker 1's new processes rejoin: the replayed round settles without them, worker 0's held
    push of round 5 goes on, and worker 1 is placed at round 5, whichever came first."""
    for replay_first in (True, False):
        table: RoundTable[str] = RoundTable(2)
        table.worker_hello(0, "epoch-0", fresh=False)
        actions = []
        if replay_first:
            table.replay(_push(0, rnd=4, replay=True), _data(2), 0.0)
            assert table.push(_push(0, rnd=5), _data(1), "w0r5", 0.0) == []  # held: round 4 waits for worker 1
            actions = table.worker_hello(1, "new-daemon", fresh=True)
        else:
            table.worker_hello(1, "new-daemon", fresh=True)
            actions = table.replay(_push(0, rnd=4, replay=True), _data(2), 0.0)
            actions += table.push(_push(0, rnd=5), _data(1), "w0r5", 0.0)
        redispatched = [h.handle for a in actions if isinstance(a, Redispatch) for h in a.held]
        assert Settled(("t", 0), 4) in actions and redispatched == (["w0r5"] if replay_first else []), actions
        if replay_first:
            assert table.keys[("t", 0)].round == 5 and table.round_for("t", 0, 1) == 5
            continue
        assert table.round_for("t", 0, 1) == 5
        assert isinstance(table.push(_push(1, rnd=5), _data(3), "w1", 0.0)[-1], Add)


def test_with_three_workers_a_rejoiner_waits_for_the_replayed_round_to_settle():
    """Worker 0 replayed round 4 and holds its push of round 5; worker 1's replay has not come yet. The rejoiner
    (worker 2) is told round 5 and its push is held with worker 0's until round 4 settles, not taken for a
    worker that moved on (round 4 abandoned, worker 0's held push failed: a review's case)."""
    table: RoundTable[str] = RoundTable(3)
    table.worker_hello(0, "e0", fresh=False)
    table.worker_hello(1, "e1", fresh=False)
    table.worker_hello(2, "new", fresh=True)
    table.replay(_push(0, rnd=4, replay=True), _data(2), 0.0)
    assert table.push(_push(0, rnd=5), _data(1), "w0r5", 0.0) == []
    assert table.round_for("t", 0, 2) == 5
    assert table.push(_push(2, rnd=5), _data(3), "w2r5", 0.0) == []  # held too
    actions = table.replay(_push(1, rnd=4, replay=True), _data(2), 0.0)
    (redispatch,) = [a for a in actions if isinstance(a, Redispatch)]
    assert [h.handle for h in redispatch.held] == ["w0r5", "w2r5"] and table.keys[("t", 0)].round == 5


def test_a_rejoiner_told_a_round_is_waited_for_in_it_when_a_replay_of_it_comes_later():
    """Worker 0 pushed round 4 again (it never got its sum); the rejoiner is told round 4; then worker 1 replays
    round 4. The round waits for the rejoiner's push (answered with the replayed sum, as every worker's), not
    settled without it (its push was then a stale round: a review's case)."""
    table: RoundTable[str] = RoundTable(3)
    table.worker_hello(0, "e0", fresh=False)
    table.worker_hello(1, "e1", fresh=False)
    table.worker_hello(2, "new", fresh=True)
    table.push(_push(0, rnd=4), _data(1), "w0r4", 0.0)
    assert table.round_for("t", 0, 2) == 4
    table.replay(_push(1, rnd=4, replay=True), _data(2), 0.0)
    actions = table.push(_push(2, rnd=4), _data(3), "w2", 0.0)
    assert isinstance(actions[0], Answer) and [w.handle for w in actions[0].waiters] == ["w2"]
    assert Settled(("t", 0), 4) in actions and _fails(actions) == {}


def test_a_peer_back_on_a_server_that_never_restarted_makes_no_starting_worker_rejoin():
    """A job starts (every hello fresh) and worker 0's connection drops and comes back, its numbering now in use:
    that is no restart of this server. Worker 1, which pushed nothing here yet, is a worker starting, asked its
    own round: its step 0 of a name whose step 0 failed at worker 0 fails too, not summed with worker 0's step
    1 (and every later step one off: a review's case)."""
    table: RoundTable[str] = RoundTable(2)
    table.worker_hello(0, "e0", fresh=True)
    table.worker_hello(1, "e1", fresh=True)
    table.push(_push(0, name="A"), _data(), "w0A0", 0.0)
    table.worker_lost(0)
    assert not [a for a in table.worker_hello(0, "e0", fresh=False) if isinstance(a, Note)]
    table.abort("B", 0, 0, 0, Why("local mismatch", "round_failed"))
    assert table.round_for("B", 0, 1, local=0) == 0


def test_a_new_workers_query_waits_for_every_other_workers_replays_once():
    """Only a worker new to this run (fresh, or rejoining) waits, and only until every other worker told its
    replays (Restored) or once its wait ran out (the server's bound): never again then."""
    table: RoundTable[str] = RoundTable(3)
    table.worker_hello(0, "e0", fresh=False)
    table.worker_restored(0)
    assert not table.query_waits(0, "t")  # mid-job: answered at once
    table.worker_hello(1, "e1", fresh=True)
    assert table.query_waits(1, "t")  # worker 2 has not told its replays
    table.worker_hello(2, "e2", fresh=False)
    assert table.query_waits(1, "t")
    table.worker_restored(2)
    table.push(_push(2, rnd=4), _data(), "w2", 0.0)
    assert not table.query_waits(1, "t") and table.round_for("t", 0, 1, local=3) == 4  # rejoins: at the others' round
    other: RoundTable[str] = RoundTable(2)
    other.worker_hello(1, "e1", fresh=True)
    assert other.query_waits(1, "t")
    other.waited_out.add(1)
    assert not other.query_waits(1, "t")


def test_a_fresh_worker_that_pushed_before_the_mid_job_peers_hello_still_rejoins():
    """The last server back: the restarted machine's queued pushes reach it before the mid-job peer's hello. The
    machine is new to that peer's job all the same and rejoins it (taken for a job starting, its names anchored
    here were numbered from 0 while the peer's were at 5: a hang, ``benchmarks/double_fault.py``)."""
    table: RoundTable[str] = RoundTable(2)
    table.worker_hello(1, "new", fresh=True)
    table.worker_restored(1)
    table.push(_push(1, rnd=1, name="u", part=3), _data(), "w1u", 0.0)
    assert [a for a in table.worker_hello(0, "e0", fresh=False) if isinstance(a, Note)]  # "it rejoins them"
    table.worker_restored(0)
    table.push(_push(0, rnd=5), _data(), "w0", 0.0)
    assert not table.query_waits(1, "t") and table.round_for("t", 0, 1, local=1) == 5


def test_a_rejoiners_query_waits_for_a_mid_job_peers_push_of_its_key():
    """After a restart, no state of a key is not "a name nobody pushed yet": the peers' round of it is known once
    one of them pushed it here (its aborts of earlier rounds come first), and the query waits till then (the
    server bounds the wait). A failed round's query does not wait (-1 whatever the peers do); nor does any query
    where no peer numbered against our predecessor (a server that never restarted saw every round)."""
    table: RoundTable[str] = RoundTable(2)
    table.worker_hello(0, "e0", fresh=False)
    table.worker_restored(0)
    table.worker_hello(1, "new", fresh=True)
    table.worker_restored(1)
    assert table.query_waits(1, "t")
    assert not table.query_waits(1, "t", failed=True) and table.round_for("t", 0, 1, local=0, failed=True) == -1
    table.abort("t", 0, 4, 0, Why("cannot reach a server", "round_failed"))
    assert table.query_waits(1, "t")  # round 4 given up: where the peer goes next is its push's to say
    table.push(_push(0, rnd=5, part=1), _data(), "w0p1", 0.0)
    assert table.query_waits(1, "t")  # (another key)
    table.push(_push(0, rnd=5), _data(), "w0", 0.0)
    assert not table.query_waits(1, "t") and table.round_for("t", 0, 1, local=1) == 5
    other: RoundTable[str] = RoundTable(2)
    for worker in (0, 1):
        other.worker_hello(worker, f"e{worker}", fresh=True)
        other.worker_restored(worker)
        other.push(_push(worker, name="a"), _data(), f"w{worker}", 0.0)
    other.worker_hello(1, "e1-new", fresh=True)  # a new daemon on machine 1: it rejoins, and "t" is a new name
    assert not other.query_waits(1, "t") and other.round_for("t", 0, 1, local=0) == 0


def test_a_rejoiners_round_given_up_beside_its_steps_other_names_is_placed_at_the_peers_round_failed_or_open():
    """RoundQuery.given_up: the round failed on the rejoining machine before its push while its step's other names
    went to the servers. It is placed at the peers' current round to be given up there: an open one (their step
    fails in this name as on the machine), or a failed one (they failed that step by the same fault), not the
    next one after it as a round to join would be (which the machine's next step takes: a step apart). Its query
    waits for a peer's push or a failed round of the key; never for a worker not rejoining (its own number)."""
    table: RoundTable[str] = RoundTable(2)
    table.worker_hello(0, "e0", fresh=False)
    table.worker_restored(0)
    table.worker_hello(1, "new", fresh=True)
    table.worker_restored(1)
    assert table.query_waits(1, "t", given_up=True)
    table.abort("t", 0, 6, 0, Why("cannot reach a server", "round_failed"))
    assert not table.query_waits(1, "t", given_up=True) and table.query_waits(1, "t")
    assert table.round_for("t", 0, 1, local=2, given_up=True) == 6 and table.round_for("t", 0, 1, local=3) == 7
    table.push(_push(0, rnd=7), _data(), "w0", 0.0)
    assert table.round_for("t", 0, 1, local=3, given_up=True) == 7  # open without it: this one
    table.push(_push(1, rnd=7), _data(), "w1", 0.0)
    assert table.round_for("t", 0, 1, local=3, given_up=True) == 8  # (its push is in round 7: a later round)
    other: RoundTable[str] = RoundTable(2)
    other.worker_hello(0, "e0", fresh=True)
    other.worker_hello(1, "e1", fresh=True)
    assert other.round_for("t", 0, 1, local=2, given_up=True) == 2


def test_another_rejoiners_push_does_not_tell_a_rejoiner_the_peers_round():
    """Two machines back from a double fault: worker 2's query of "t" waited its longest and was answered 0
    (nothing known here), and it pushed round 0. That push is no mid-job peer's round: worker 1's query still
    waits for worker 0's (a review's case: answered 0 at once, while worker 0 was at round 5)."""
    table: RoundTable[str] = RoundTable(3)
    table.worker_hello(0, "e0", fresh=False)
    table.worker_restored(0)
    for w in (1, 2):
        table.worker_hello(w, f"new{w}", fresh=True)
        table.worker_restored(w)
    table.waited_out.add(2)
    assert table.round_for("t", 0, 2, local=0) == 0
    table.push(_push(2, rnd=0), _data(), "w2", 0.0)
    assert table.query_waits(1, "t")
    table.push(_push(0, rnd=5), _data(), "w0", 0.0)
    assert not table.query_waits(1, "t") and table.round_for("t", 0, 1, local=0) == 5


def test_a_new_worker_rejoins_when_the_mid_job_peer_comes_back_from_a_dropped_connection():
    """The mid-job peer's connection dropped just as the restarted machine said hello: its query waits for the
    peer (not connected: it may come back), and the peer back with its numbering makes it rejoin (it was taken
    for a job starting: a review's case)."""
    links = {0, 1}
    table: RoundTable[str] = RoundTable(2, lost_grace_s=10, connected=links.__contains__)
    table.worker_hello(0, "e0", fresh=False)
    table.worker_restored(0)
    table.replay(_push(0, rnd=7, replay=True), _data(), 0.0)
    links.discard(0)
    table.worker_lost(0)
    table.worker_hello(1, "new", fresh=True)
    table.worker_restored(1)
    assert table.query_waits(1, "t")
    links.add(0)
    table.worker_hello(0, "e0", fresh=False)
    assert not table.query_waits(1, "t") and table.round_for("t", 0, 1) == 8


def test_fresh_workers_alone_are_a_job_starting_not_a_rejoin():
    """Every hello says fresh (a job's daemons starting, in any order, or all of them after a restart of
    this server with nothing in flight): no worker rejoins, each is asked its own round (0). Nor does a worker
    whose numbering is in use make a fresh one rejoin once it has no processes (a Reset)."""
    table: RoundTable[str] = RoundTable(2)
    assert table.worker_hello(0, "e0", fresh=True) == []
    table.push(_push(0), _data(), "w0", 0.0)
    assert table.worker_hello(1, "e1", fresh=True) == []
    assert table.round_for("t", 0, 1) == 0 and table.round_for("t", 0, 1, local=0, failed=True) == 0
    other: RoundTable[str] = RoundTable(2)
    other.worker_hello(0, "e0", fresh=False)
    other.worker_reset(0, "e0b")
    assert not [a for a in other.worker_hello(1, "e1", fresh=True) if isinstance(a, Note)]
    assert other.round_for("t", 0, 1, local=2) == 2


def test_tokens_of_past_rounds_are_never_current():
    table: RoundTable[str] = RoundTable(1)
    (add,) = table.push(_push(0), _data(), "w0", 0.0)
    assert table.current(add.token) and table.added(add.token)
    assert table.complete(add.token) is not None
    assert not table.current(add.token) and table.complete(add.token) is None
    replaced = dataclasses.replace(add.token, round=1, gen=add.token.gen + 1)
    assert table.current(replaced)  # the next round's generation, opened by complete


def test_every_other_failure_is_round_failed_without_facts():
    """Stale, duplicate, abandoned, aborted and held-behind-a-failed-round pushes: code round_failed, no facts."""
    plain = ("round_failed", "", "", "", "", "", 0.0)
    table: RoundTable[str] = RoundTable(3)
    _sum_round(table, 0, range(3))
    assert _facts(table.push(_push(0, rnd=0), _data(), "stale", 0.0)) == {"stale": plain}
    table.push(_push(0, rnd=1), _data(), "w0", 0.0)
    assert _facts(table.push(_push(0, rnd=1), _data(), "twice", 0.0)) == {"twice": plain}
    assert _facts(table.push(_push(1, rnd=2), _data(), "w1", 0.0)) == {"w0": plain}  # abandoned
    assert _facts(table.abort("t", 0, 2, 2, Why("local trouble"))) == {"w1": plain}


def test_an_open_round_meets_a_fused_report_of_its_name_and_fails_for_every_pusher():
    """Partition 0 at the anchor: the workers that pushed the name's open round, and its failure when another
    worker issued the name fused (sizes on both sides of the fusion limit)."""
    table: RoundTable[str] = RoundTable(3)
    assert table.unfused("t") is None
    table.push(_push(0), _data(), "w0", 0.0)
    table.push(_push(1), _data(), "w1", 0.0)
    pushers, first = table.unfused("t")
    assert pushers == {0, 1} and first.worker == 0
    why = sizes_differ("t", ("float32", (2,), False, ""), 2, "float32[4]", 0)
    facts = _facts(table.fail_open("t", why))
    assert facts == {f"w{w}": ("mismatch", "t", "float32[4]", "float32[2]", "", "", 0.0) for w in (0, 1)}
    assert "worker 2 issued it as float32[2] (fused) but worker 0 as float32[4]" in why.text
    assert table.unfused("t") is None and table.fail_open("t", why) == []  # failed once
    # a late push of that round hears why; the next round is a round like any
    assert "(fused)" in _fails(table.push(_push(2), _data(), "w2", 0.0))["w2"]
    assert isinstance(table.push(_push(0, rnd=1), _data(), "w0", 0.0)[0], Add)


def test_each_accepted_push_has_its_lag_behind_the_rounds_first_push():
    table: RoundTable[str] = RoundTable(3)
    table.push(_push(1), _data(), "a", now=10.0)
    assert table.lag == 0.0  # the first push opens the round
    table.push(_push(0), _data(), "b", now=10.25)
    assert table.lag == 0.25
    table.push(_push(2, name="u"), _data(), "c", now=11.0)
    assert table.lag == 0.0  # another key: its own round, its own first push
    table.push(_push(2), _data(), "d", now=12.5)
    assert table.lag == 2.5  # the straggler of key t's round 0
    table.push(_push(2, shape=[5]), np.zeros(5, np.float32), "e", now=13.0)
    assert table.lag is None  # refused (a duplicate push of round 0, or a mismatch): no lag
    table.push(_push(0, rnd=1, name="u"), _data(), "f", now=14.0)
    assert table.lag == 0.0  # round 1 of key u abandons round 0 and opens with this push


def test_fail_ended_fails_the_open_rounds_of_the_names_it_is_told_of_every_part_and_no_other():
    """The anchor ends a lane generation (bps_server.fusion): the open rounds of its fused tensors fail, every
    part of them; other keys' rounds, and keys with nothing pushed, are untouched."""
    table: RoundTable[str] = RoundTable(2)
    for name, part in (("old", 0), ("old", 1), ("new", 0)):
        table.push(_push(0, name=name, part=part), _data(), f"{name}{part}", 0.0)
    table.abort("idle", 0, 0, 0, Why("given up"))  # a failed round: not failed again
    actions = table.fail_ended(lambda name: name in ("old", "idle"), Why("lanes ended"))
    assert _fails(actions) == {"old0": "lanes ended", "old1": "lanes ended"}
    assert table.keys[("new", 0)].busy and set(table.keys) == {("new", 0)}  # the ended keys forgotten


# -- a push sent again after its worker's connection to the same run broke ------------------------


def _resumed(worker: int, rnd: int = 0) -> Push:
    return dataclasses.replace(_push(worker, rnd=rnd), req=100 + worker, resumed=True)


def test_a_resumed_push_of_a_round_that_holds_it_takes_its_answer_on_the_new_connection_and_adds_nothing():
    table: RoundTable[str] = RoundTable(2)
    (add0,) = table.push(_push(0), _data(), "w0", 0.0)
    table.worker_lost(0)  # (its own push is in: the round does not wait for it, and stays open)
    assert table.push(_resumed(0), _data(), "w0-again", 0.0) == []  # nothing to add: its contribution is in
    (add1,) = table.push(_push(1), _data(), "w1", 0.0)
    assert isinstance(add0, Add) and isinstance(add1, Add)
    assert [table.added(t) for t in (add0.token, add1.token)] == [False, True]
    done = table.complete(add1.token)
    assert done is not None and [(w.handle, w.push.req) for w in done.waiters] == [("w0-again", 100), ("w1", 1)]


def test_a_resumed_push_of_a_summed_round_hears_that_its_answer_was_lost():
    table: RoundTable[str] = RoundTable(2)
    _sum_round(table, 0, range(2))
    (fail,) = table.push(_resumed(0), _data(), "w0-again", 0.0)
    assert isinstance(fail, Fail) and fail.handle == "w0-again" and fail.why.code == "answer_lost"
    assert fail.reason == ("tensor 't' part 0: round 0 was summed for the other workers, but worker 0's answer "
                           "was lost with its connection")
    assert table.keys[("t", 0)].round == 1 and not table.keys[("t", 0)].waiters  # round 1 untouched


def test_a_resumed_push_of_a_failed_round_hears_its_failure_open_or_past():
    table: RoundTable[str] = RoundTable(2)
    table.push(_push(1), _data(), "w1", 0.0)
    table.worker_lost(0)  # the round waited for worker 0's push, which the broken connection lost: it fails
    assert _fails(table.push(_resumed(0), _data(), "w0-again", 0.0))["w0-again"].startswith(
        "worker 0 is disconnected")
    table.push(_push(1, rnd=1), _data(), "w1", 0.0)  # worker 1 moved on: round 0 is the failed one before
    (fail,) = table.push(_resumed(0), _data(), "w0-again", 0.0)
    assert isinstance(fail, Fail) and fail.reason.startswith("worker 0 is disconnected")


def test_a_resumed_push_the_server_never_got_is_an_ordinary_push_and_anything_older_is_stale():
    table: RoundTable[str] = RoundTable(2)
    (add,) = table.push(_resumed(0), _data(), "w0", 0.0)
    assert isinstance(add, Add) and table.keys[("t", 0)].waiters[0].handle == "w0"
    table2: RoundTable[str] = RoundTable(2)
    _sum_round(table2, 0, range(2))
    _sum_round(table2, 1, range(2))  # (round 0 is not the last sum)
    assert "stale round 0" in _fails(table2.push(_resumed(1), _data(), "w1-again", 0.0))["w1-again"]


def test_a_resumed_push_of_the_last_sum_hears_its_answer_was_lost_however_far_the_peer_moved_on():
    """Round 0 summed, its answer to worker 0 died with worker 0's connection; worker_lost(0) failed worker 1's
    round 1 (it waited for worker 0) and worker 1 moved on to round 2 before worker 0 was back. Round 0 is still
    the key's last sum: worker 0 must hear "answer lost", not "stale" (it would take the round as failed while
    the peer summed it: the drift of fused names). Found by a review."""
    table: RoundTable[str] = RoundTable(2)
    _sum_round(table, 0, range(2))
    table.push(_push(1, rnd=1), _data(), "w1-r1", 0.0)
    assert set(_fails(table.worker_lost(0))) == {"w1-r1"}
    table.push(_push(1, rnd=2), _data(), "w1-r2", 0.0)  # the peer's next step
    table.worker_hello(0, "")
    (fail,) = table.push(_resumed(0), _data(), "w0-again", 0.0)
    assert isinstance(fail, Fail) and fail.why.code == "answer_lost", fail


def test_a_resumed_push_a_replay_answered_already_is_answered_again_at_once():
    """After a restart (3 workers): worker 0's held push of round 0 is answered by worker 1's replay, the round
    still open for worker 2; worker 0's connection breaks with that answer on the wire, and its resumed push finds
    itself in the round. It must get the replayed sum again: the round answers nobody twice, and worker 2's
    replay then settles it (before, the resumed push waited for ever). Found by a review."""
    table: RoundTable[str] = RoundTable(3)
    (answered,) = table.push(_push(0), _data(), "w0", 0.0)  # (a held push, on the restarted run: waits)
    table.replay(_push(1, replay=True), _data(3.0), 0.0)
    table.worker_lost(0)
    table.worker_hello(0, "")
    (again,) = table.push(_resumed(0), _data(), "w0-again", 0.0)
    assert isinstance(again, Answer) and [w.handle for w in again.waiters] == ["w0-again"]
    assert np.array_equal(again.result, _data(3.0))
    assert any(isinstance(a, Settled) for a in table.replay(_push(2, replay=True), _data(3.0), 0.0))


def test_summed_says_whether_a_round_is_the_keys_last_sum():
    """RoundQuery.fate's answer: a worker whose link gave up while its push was out asks it, after its abort."""
    table: RoundTable[str] = RoundTable(2)
    assert not table.summed("t", 0, 0)  # (a key never pushed)
    _sum_round(table, 0, range(2))
    table.push(_push(1, rnd=1), _data(), "w1", 0.0)
    table.abort("t", 0, 1, 0, Why("gave up"))
    assert table.summed("t", 0, 0) and not table.summed("t", 0, 1)
    table.push(_push(1, rnd=2), _data(), "w1", 0.0)  # (the peer moved on: round 0 is still the last sum)
    assert table.summed("t", 0, 0) and not table.summed("t", 0, 2)


def test_a_lane_key_forgotten_as_its_generation_ended_still_says_its_last_sum():
    """Three workers: round 0 of a lane key is summed, worker 0's answer was lost and its link gave up; a third
    worker's reset ends the lane generation meanwhile, and the anchor forgets its keys (fail_ended). Worker 0's
    fate query must still hear "summed" (worker 1 took no unfused number for the step). Found by a review."""
    table: RoundTable[str] = RoundTable(3)
    _sum_round(table, 0, range(3))
    table.fail_ended(lambda name: name == "t", Why("lanes ended"))
    assert ("t", 0) not in table.keys and table.summed("t", 0, 0) and not table.summed("t", 0, 1)


def test_a_job_that_ends_beside_a_daemon_idle_since_it_started_leaves_a_clean_slate():
    """Fresh daemons; worker 0's job alone pushed "G" and was killed (its Reset). Worker 1's daemon never had
    processes, so it never said Reset, and the failed round stayed: the next job's first push from worker 1
    was refused with it, worker 0's processes were placed at round 1, and from then on each step of one machine
    was summed with the next step of the other (wrong sums, a review's case). A worker that never pushed here is
    as one without processes when the others' job ends."""
    table: RoundTable[str] = RoundTable(2, lost_grace_s=3.0, connected=lambda w: True)
    table.worker_hello(0, "e0")
    table.worker_hello(1, "e1")
    table.push(_push(0, name="G"), _data(), "a0", 0.0)
    assert Cleared(1) in table.worker_reset(0, "e0b")
    assert not _fails(table.push(_push(1, name="G"), _data(), "b1", 1.0))  # the next job's round 0
    assert table.round_for("G", 0, 0, 0) == 0


def test_a_worker_that_pushed_here_keeps_the_last_jobs_failure_until_it_resets():
    table: RoundTable[str] = RoundTable(2, lost_grace_s=3.0, connected=lambda w: True)
    table.push(_push(1, name="H"), _data(), "h1", 0.0)  # worker 1 is active here
    table.push(_push(0, name="G"), _data(), "a0", 0.0)
    assert not any(isinstance(a, Cleared) for a in table.worker_reset(0, "e0b"))
    assert "G" in {k[0] for k in table.keys}


def test_with_a_stall_timeout_sweep_fails_a_round_waiting_for_a_connected_worker():
    """cluster.stall_timeout: the round waits for worker 2, connected, whose processes never push it (stuck, or
    naming their tensor otherwise): it fails once it waited that long, not before; without it, never."""
    table: RoundTable[str] = RoundTable(3, lost_grace_s=10, stall_s=60)
    for w in (0, 1):
        table.push(_push(w), _data(), f"w{w}", 100.0)
    assert table.sweep(159.9) == []
    actions = table.sweep(160.0)
    why = "round 0 of 't' failed: worker 2 did not push it (cluster.stall_timeout), waited 60 s"
    assert len(actions) == 1 and _fails(actions) == {"w0": why, "w1": why}
    assert _facts(actions)["w0"] == ("timeout", "", "", "", "", "round 0 of 't'", 60)
    assert table.sweep(1000.0) == []  # failed once


def test_with_a_stall_timeout_a_round_waiting_for_a_worker_busy_pushing_its_other_tensors_does_not_fail():
    """Worker 2 issues the names in another order: it pushes the others' other keys while this round waits for it.
    The sweep counted from the round's first push and failed it (a review's case); it counts from worker 2's last
    push into a round another worker had opened. A round it opens itself (it moved on) does not count."""
    table: RoundTable[str] = RoundTable(3, lost_grace_s=10, stall_s=60)
    for w in (0, 1):
        table.push(_push(w), _data(), f"w{w}", 100.0)
    for t in (130.0, 170.0, 210.0):
        for w in (0, 1, 2):
            table.push(_push(w, name=f"other{t}"), _data(), f"o{w}", t)
    table.push(_push(2, name="its.own"), _data(), "mine", 240.0)
    assert table.sweep(250.0) == []  # worker 2 caught up 40 s ago
    (failed,) = table.sweep(270.0)  # (its own round, 30 s old, waits on)
    assert _fails([failed])["w0"].startswith("round 0 of 't' failed: worker 2 did not push it")
