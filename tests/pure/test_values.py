"""bps_server.values: the asynchronous value store's decisions, with no I/O (time passed in)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from bps_server.rounds import Why
from bps_server.values import RESTORE_GRACE_S, Answer, Fail, Note, ValueStore
from protocol.messages import KIND_ASYNC, KIND_ASYNC_INIT, Push

N = 3
T = 10.0  # the timeout


def restarted(n: int = N) -> ValueStore[str]:
    """A run no worker has reached yet (its start, or a restart)."""
    return ValueStore(n, timeout_s=T, worker_of_rank=lambda rank: rank // 2)


def store(n: int = N) -> ValueStore[str]:
    """A run every worker reached, with no copies to restore."""
    s = restarted(n)
    for w in range(n):
        s.worker_restored(w, 0.0)
    return s


def init(worker: int, *, root: int = 0, staleness: int = -1, count: int = 4, dtype: str = "float32") -> Push:
    return Push(0, "w", 0, 0, worker, dtype, [count], 0, count, kind=KIND_ASYNC_INIT, root=root,
                holds_root=worker == root // 2, staleness=staleness)


def delta(worker: int, step: int, *, count: int = 4, dtype: str = "float32") -> Push:
    return Push(step, "w", 0, step, worker, dtype, [count], 0, count, kind=KIND_ASYNC)


def arr(*values: float, dtype: str = "float32") -> np.ndarray:
    if dtype == "float16":
        return np.array(values, dtype=np.float16).view(np.uint16)  # as the server sees it: its storage dtype
    return np.array(values, dtype=dtype)


def answers(actions: list) -> dict[str, Answer]:
    return {a.handle: a for a in actions if isinstance(a, Answer)}


def initialised(s: ValueStore[str], value: np.ndarray, staleness: int = -1) -> None:
    for w in range(s.n):
        s.push(init(w, staleness=staleness, count=value.size), value, f"init{w}", 0.0)


def test_root_init_sets_the_value_and_answers_the_inits_that_waited() -> None:
    s = store()
    assert s.push(init(1), arr(9, 9, 9, 9), "a", 0.0) == []  # worker 1 holds no root: waits
    got = answers(s.push(init(0), arr(1, 2, 3, 4), "b", 0.1))
    assert set(got) == {"a", "b"}
    assert got["a"].value.tolist() == [1, 2, 3, 4] and got["a"].applied == [0, 0, 0]
    late = answers(s.push(init(2), arr(0, 0, 0, 0), "c", 0.2))  # the value is there: at once
    assert late["c"].value.tolist() == [1, 2, 3, 4]


def test_deltas_add_at_once_exactly_once_and_steps_may_skip() -> None:
    s = store()
    initialised(s, arr(0, 0, 0, 0))
    assert answers(s.push(delta(0, 1), arr(1, 1, 1, 1), "x", 1.0))["x"].value.tolist() == [1, 1, 1, 1]
    got = answers(s.push(delta(1, 1), arr(2, 0, 0, 0), "y", 1.1))["y"]
    assert got.value.tolist() == [3, 1, 1, 1] and got.applied == [1, 1, 0]
    replay = answers(s.push(delta(1, 1), arr(2, 0, 0, 0), "again", 1.2))["again"]  # a replay: not added twice
    assert replay.value.tolist() == [3, 1, 1, 1] and replay.applied == [1, 1, 0]
    skipped = answers(s.push(delta(2, 3), arr(5, 5, 5, 5), "skip", 1.3))["skip"]  # steps 1 and 2 failed locally
    assert skipped.value.tolist() == [8, 6, 6, 6] and skipped.applied == [1, 1, 3]
    (zero,) = s.push(delta(2, 0), arr(5, 5, 5, 5), "zero", 1.4)
    assert isinstance(zero, Fail) and "step 0" in zero.why.text


def test_float16_accumulates_in_float32() -> None:
    s = store(1)
    s.push(init(0, dtype="float16"), arr(2048, 0, 0, 0, dtype="float16"), "i", 0.0)
    for step in range(1, 9):  # 2048 + 1 is not a float16; eight of them are 2056, which is
        out = answers(s.push(delta(0, step, dtype="float16"), arr(1, 0, 0, 0, dtype="float16"), "d", 1.0))["d"]
    assert out.value.view(np.float16).tolist() == [2056, 0, 0, 0]


def test_a_bound_holds_the_answer_until_the_slowest_live_machine_is_within_it() -> None:
    s = store()
    initialised(s, arr(0, 0, 0, 0), staleness=1)
    one = arr(1, 1, 1, 1)
    assert answers(s.push(delta(0, 1), one, "a1", 1.0))  # 1 - 1 = 0: nobody is below
    assert s.push(delta(0, 2), one, "a2", 1.1) == []  # workers 1 and 2 are at 0 < 2 - 1
    assert answers(s.push(delta(1, 1), one, "b1", 1.2)).keys() == {"b1"}
    got = answers(s.push(delta(2, 1), one, "c1", 1.3))
    assert got.keys() == {"a2", "c1"}
    assert got["a2"].value.tolist() == [4, 4, 4, 4] and got["a2"].applied == [2, 1, 1]  # the value of now


def test_unbounded_never_holds() -> None:
    s = store()
    initialised(s, arr(0, 0, 0, 0))
    for step in range(1, 50):
        assert answers(s.push(delta(0, step), arr(1, 1, 1, 1), f"s{step}", 1.0))
    assert s.keys[("w", 0)].applied == [49, 0, 0]


def test_a_dead_machine_fails_what_it_holds_back_then_holds_nobody() -> None:
    s = store()
    initialised(s, arr(0, 0, 0, 0), staleness=0)
    s.worker_disconnected(2, 5.0)
    s.push(delta(0, 1), arr(1, 1, 1, 1), "a", 6.0)
    assert s.push(delta(1, 1), arr(1, 1, 1, 1), "b", 6.0) == []  # (a) waits for 1 and 2, (b) for 2
    assert [a for a in s.sweep(14.9) if not isinstance(a, Note)] == []  # disconnected 9.9 s: still waited for
    failed = [a for a in s.sweep(15.0) if isinstance(a, Fail)]
    assert {f.handle for f in failed} == {"a", "b"}
    assert all(f.why.code == "connection" and f.why.peer == "worker 2" for f in failed)
    assert answers(s.push(delta(0, 2), arr(1, 1, 1, 1), "c", 16.0)).keys() == set()  # waits for worker 1 only
    assert answers(s.push(delta(1, 2), arr(1, 1, 1, 1), "d", 16.0)).keys() == {"c", "d"}
    s.worker_connected(2)  # back: it is waited for again
    assert s.push(delta(0, 3), arr(1, 1, 1, 1), "e", 17.0) == []


def test_a_machine_that_never_connects_to_a_restarted_server_holds_nobody_back_after_the_timeout() -> None:
    """A server restarted after machine 2 died: the new run never hears from it, and used to count it live for
    ever (only a connection lost in this run made a machine count as gone), holding the others' steps back. Now
    the restore waits for it for its grace, and the steps it holds back by the bound fail once it is declared
    dead, as for any machine gone."""
    s = restarted()
    s.worker_connected(0)
    s.worker_connected(1)
    assert s.sweep(1.0) == []  # no value yet: nobody to declare anything to
    s.restore(restore_push(0, [0, 0, 0], staleness=0), arr(5, 5, 5, 5), 2.0)  # the survivors' copy
    s.worker_restored(0, 2.0)
    s.worker_restored(1, 2.0)
    s.push(delta(0, 1), arr(1, 1, 1, 1), "a", 3.0)
    assert answers(s.push(delta(1, 1), arr(1, 1, 1, 1), "b", 3.0)) == {}  # both wait for machine 2
    assert s.sweep(2.0 + RESTORE_GRACE_S - 0.1) == []  # the restore waits for machine 2's copy ...
    assert answers(s.sweep(2.0 + RESTORE_GRACE_S)) == {}  # ... for its grace (it never connected); the steps,
    actions = s.sweep(1.0 + T)  # applied, wait for it by the bound until it is declared dead (away since 1.0)
    assert any("worker 2 has been disconnected" in n.message for n in actions if isinstance(n, Note))
    assert {a.handle for a in actions if isinstance(a, Fail)} == {"a", "b"}
    assert answers(s.push(delta(0, 2), arr(1, 1, 1, 1), "c", 12.0)).keys() == set()  # waits for worker 1 only


def test_a_slow_connected_machine_is_waited_for_with_a_stall_note() -> None:
    s = store()
    initialised(s, arr(0, 0, 0, 0), staleness=0)
    s.push(delta(0, 1), arr(1, 1, 1, 1), "a", 1.0)
    notes = s.sweep(100.0)
    assert [a for a in notes if not isinstance(a, Note)] == []
    assert any("stall" in n.message and "worker 1, 2" in n.message for n in notes if isinstance(n, Note))


def test_an_init_without_its_root_fails_naming_the_root_machine() -> None:
    s = store()
    s.push(init(1, root=4), arr(0, 0, 0, 0), "a", 0.0)
    (fail,) = [a for a in s.sweep(T) if isinstance(a, Fail)]
    assert fail.why.code == "timeout" and "root rank 4 on worker 2" in fail.why.what
    # The detail (what the process's error shows after "timed out after T s") says what to look for, rather
    # than nothing (the worker's link then gave "server 0" alone: the server, healthy, read as the culprit).
    assert fail.why.detail.startswith("the root's value did not arrive (worker 2 never pushed it: its processes "
                                      "may have failed this async_init there"), fail.why.detail


def test_mismatches_name_both_sides() -> None:
    s = store()
    initialised(s, arr(0, 0, 0, 0), staleness=2)
    (bad,) = s.push(delta(1, 1, count=3), arr(1, 1, 1), "x", 1.0)
    assert isinstance(bad, Fail) and bad.why.code == "mismatch"
    assert bad.why.ours == "float32[3] (async)" and bad.why.theirs.startswith("float32[4]")
    (other,) = s.push(init(2, staleness=3), arr(0, 0, 0, 0), "y", 1.0)
    assert isinstance(other, Fail) and "staleness 3" in other.why.ours and "staleness 2" in other.why.theirs


def test_an_init_refused_as_a_mismatch_is_heard_by_the_other_machines_at_their_next_delta() -> None:
    """Worker 1's init of another shape is refused; worker 0 (the root's, which set the value) and worker 2 (whose
    init came later and agreed) hear the mismatch at their next delta, their side as "ours": refused, as any push
    refused as a mismatch, so nothing is added and the machine numbers its next delta alike (the worker gives the
    step back: adding it made that next delta a replay, lost, a review). Once each, and not by worker 1's next
    processes. The root's went on with the first shape, never told (a review)."""
    s = store()
    s.push(init(0), arr(1, 2, 3, 4), "i0", 0.0)
    (refused,) = s.push(init(1, count=3), arr(0, 0, 0), "i1", 0.1)
    assert isinstance(refused, Fail) and refused.why.code == "mismatch" and refused.why.name == "w"
    assert (refused.why.ours, refused.why.theirs) == ("float32[3] (async_init from rank 0, unbounded)",
                                                      "float32[4] (async_init from rank 0, unbounded)")
    assert answers(s.push(init(2), arr(0, 0, 0, 0), "i2", 0.2))["i2"].value.tolist() == [1, 2, 3, 4]
    for worker, handle in ((0, "d0"), (2, "d2")):
        (heard,) = s.push(delta(worker, 1), arr(1, 1, 1, 1), handle, 1.0)
        assert isinstance(heard, Fail) and heard.why.code == "mismatch", heard
        assert (heard.why.ours, heard.why.theirs) == (refused.why.theirs, refused.why.ours)
    again = answers(s.push(delta(0, 1), arr(1, 1, 1, 1), "again", 1.1))["again"]  # the same step: fresh
    assert again.value.tolist() == [2, 3, 4, 5] and again.applied == [1, 0, 0] and s.replays == 0
    s.worker_reset(1)
    assert answers(s.push(init(1), arr(0, 0, 0, 0), "back", 2.0))["back"].value.tolist() == [2, 3, 4, 5]
    assert answers(s.push(delta(1, 5), arr(1, 0, 0, 0), "d1", 2.1))["d1"].value.tolist() == [3, 3, 4, 5]  # not owed


def test_a_refused_init_is_not_owed_to_a_machine_away_then() -> None:
    """Worker 2's processes had left (reset) when worker 1's init was refused: its next processes, which init alike,
    were not involved and hear nothing (they did, a review)."""
    s = store()
    s.push(init(0), arr(1, 2, 3, 4), "i0", 0.0)
    s.worker_reset(2)
    (refused,) = s.push(init(1, count=3), arr(0, 0, 0), "i1", 0.1)
    assert isinstance(refused, Fail) and refused.why.code == "mismatch"
    assert answers(s.push(init(2), arr(0, 0, 0, 0), "i2", 0.2))["i2"].value.tolist() == [1, 2, 3, 4]
    assert answers(s.push(delta(2, 1), arr(1, 1, 1, 1), "d2", 1.0))["d2"].value.tolist() == [2, 3, 4, 5]


def test_inits_before_the_roots_value_are_judged_by_the_root_not_by_the_first_that_came() -> None:
    """Worker 1 inits another shape first, worker 2 the root's; then the root: worker 1 is refused, worker 2 gets
    the value (it was refused against worker 1's, and the root heard that refusal with worker 1's side as its
    own: a review); the root hears worker 1's refusal, its own side as "ours"."""
    s = store()
    assert s.push(init(1, count=3), arr(0, 0, 0), "i1", 0.0) == []
    assert s.push(init(2), arr(0, 0, 0, 0), "i2", 0.1) == []  # (waits for the root's value, as worker 1's does)
    got = s.push(init(0), arr(1, 2, 3, 4), "i0", 0.2)
    assert [a.handle for a in got if isinstance(a, Fail)] == ["i1"] and answers(got).keys() == {"i0", "i2"}
    assert answers(got)["i2"].value.tolist() == [1, 2, 3, 4]
    (heard,) = s.push(delta(0, 1), arr(1, 1, 1, 1), "d0", 1.0)
    assert isinstance(heard, Fail) and heard.why.ours.startswith("float32[4]") and heard.why.theirs.startswith(
        "float32[3]")


def restore_push(worker: int, applied: list[int], staleness: int = -1) -> Push:
    return Push(0, "w", 0, 0, worker, "float32", [4], 0, 4, kind=KIND_ASYNC, replay=True, applied=applied,
                staleness=staleness)


def test_a_restart_takes_the_freshest_copy_and_applies_no_delta_twice() -> None:
    s = restarted()
    s.restore(restore_push(0, [2, 1, 0]), arr(3, 3, 3, 3), 0.0)
    assert s.push(delta(0, 3), arr(1, 0, 0, 0), "a3", 0.1) == []  # restoring: waits for every worker
    s.restore(restore_push(1, [2, 2, 0]), arr(4, 4, 4, 4), 0.2)  # fresher: taken
    s.restore(restore_push(2, [1, 0, 0]), arr(1, 1, 1, 1), 0.2)  # older: ignored
    s.worker_restored(0, 0.3)
    s.worker_restored(1, 0.3)
    assert s.push(delta(1, 2), arr(100, 0, 0, 0), "b2", 0.4) == []  # covered by the copy, but waits anyway
    got = answers(s.worker_restored(2, 0.5))
    assert got["a3"].value.tolist() == [5, 4, 4, 4] and got["a3"].applied == [3, 2, 0]
    assert got["b2"].value.tolist() == [5, 4, 4, 4]  # its delta was in the copy: not added again


def test_a_restore_without_every_worker_ends_at_the_timeout() -> None:
    s = restarted()
    s.restore(restore_push(0, [1, 0, 0]), arr(1, 1, 1, 1), 0.0)
    s.push(delta(0, 2), arr(1, 1, 1, 1), "a", 0.1)
    assert answers(s.sweep(T - 0.1)) == {}
    got = answers(s.sweep(T))
    assert got["a"].value.tolist() == [2, 2, 2, 2]


def test_every_worker_reset_drops_the_values() -> None:
    s = store()
    initialised(s, arr(0, 0, 0, 0))
    for w in range(N):
        s.worker_reset(w)
    assert s.keys == {}
    assert answers(s.push(init(0, staleness=0), arr(7, 7, 7, 7), "new", 1.0))["new"].value.tolist() == [7, 7, 7, 7]
    assert s.push(delta(0, 1), arr(1, 1, 1, 1), "held", 1.1) == []  # the next job waits for every machine again
    s.push(delta(1, 1), arr(1, 1, 1, 1), "w1", 1.2)
    assert answers(s.push(delta(2, 1), arr(1, 1, 1, 1), "w2", 1.3)).keys() == {"held", "w1", "w2"}


def test_random_interleavings_with_restarts_keep_every_delta_exactly_once() -> None:
    """Three machines push random integer deltas in random order under a random bound; now and then the
    server restarts (every machine restores its last answer, then pushes again what had no answer)."""
    rng = random.Random(17)
    covered = 0
    for trial in range(30):
        s, bound = store(), rng.choice([-1, 0, 2])
        initialised(s, arr(0, 0, 0, 0), staleness=bound)
        expected = np.zeros(4, np.float32)
        kept = {w: (np.zeros(4, np.float32), [0] * N) for w in range(N)}
        step = [0] * N
        waiting: dict[int, tuple[Push, np.ndarray]] = {}  # each machine's push without an answer yet
        replays: list[Note] = []

        def settle(actions: list) -> None:
            for a in actions:
                if isinstance(a, Note):
                    replays.append(a)
                    continue
                assert isinstance(a, Answer), a
                who = a.push.worker
                kept[who] = (a.value.copy(), a.applied)
                waiting.pop(who, None)

        for now in np.arange(1.0, 2.0, 0.01):
            if rng.random() < 0.05:  # a restart
                s = restarted()
                for who, (value, applied) in kept.items():
                    s.restore(restore_push(who, applied, bound), value, now)
                for who in range(N):
                    settle(s.worker_restored(who, now))
                for p, d in list(waiting.values()):
                    settle(s.push(p, d, "again", now))
                continue
            w = rng.randrange(N)
            if w in waiting:
                continue
            step[w] += 1
            d = np.array([rng.randint(-5, 5) for _ in range(4)], np.float32)
            expected += d
            waiting[w] = (delta(w, step[w]), d)
            settle(s.push(delta(w, step[w]), d, "d", now))
        st = s.keys[("w", 0)]
        assert st.value is not None and st.value.tolist() == expected.tolist(), (trial, st.applied, step)
        assert st.applied == step
        covered += len(replays)
    assert covered > 0  # deltas pushed again that a restored copy held (3 with this seed): the case tested


def test_a_machine_whose_processes_left_holds_nobody_back_until_it_pushes_again_even_if_it_reconnects() -> None:
    """Its daemon reconnecting (a blip, a systemd restart) does not bring its processes back: a bound must not
    wait for steps nobody will push. Its next push does."""
    s = store()
    initialised(s, arr(0, 0, 0, 0), staleness=0)
    s.worker_reset(2)
    s.worker_disconnected(2, 1.0)
    s.worker_connected(2)
    s.push(delta(0, 1), arr(1, 1, 1, 1), "a", 2.0)
    assert answers(s.push(delta(1, 1), arr(1, 1, 1, 1), "b", 2.0)).keys() == {"a", "b"}  # not held for worker 2
    s.push(delta(2, 1), arr(1, 1, 1, 1), "c", 3.0)  # its processes are back: it is waited for again
    s.push(delta(0, 2), arr(1, 1, 1, 1), "d", 4.0)
    assert answers(s.push(delta(1, 2), arr(1, 1, 1, 1), "e", 4.0)) == {}  # both wait for worker 2's step 2


def test_a_machine_back_in_a_job_that_went_on_is_level_with_the_furthest_and_a_late_starter_is_not() -> None:
    """Worker 2's processes leave under a bound of 1; the others go on to step 5; its new process inits again.
    Its entry goes up to 5 at that init (its skipped steps were never pushed): the others' steps 6 are not held
    for steps it never pushes (its steps went on from 2 before, and held them for as many as it missed: a
    review's find). A machine that inits late at the job's start never left: its entry stays, and the bound
    holds the early one to its pace (a first version, numbering from the vector's largest entry in the
    worker, let the early machine run 3 steps ahead under a bound of 2)."""
    s = store()
    initialised(s, arr(0, 0, 0, 0), staleness=1)
    one = arr(1, 1, 1, 1)
    for step in (1, 2):
        for w in range(3):
            s.push(delta(w, step), one, f"{w}.{step}", float(step))
    s.worker_reset(2)
    for step in (3, 4, 5):
        assert answers(s.push(delta(0, step), one, f"0.{step}", float(step))).keys() >= {f"0.{step}"}
        assert f"1.{step}" in answers(s.push(delta(1, step), one, f"1.{step}", float(step)))
    back = answers(s.push(init(2, staleness=1), arr(0, 0, 0, 0), "again", 6.0))["again"]
    assert back.applied == [5, 5, 5] and back.value.tolist() == [12, 12, 12, 12]
    assert "0.6" in answers(s.push(delta(0, 6), one, "0.6", 6.1))  # 6 - 1 = 5: nobody is below (was: held)
    late = store()
    late.push(init(0, staleness=1), arr(0, 0, 0, 0), "i0", 0.0)
    late.push(init(1, staleness=1), arr(0, 0, 0, 0), "i1", 0.0)
    late.push(delta(0, 1), one, "early.1", 0.1)
    assert late.push(delta(0, 2), one, "early.2", 0.2) == []  # worker 2 (connected, at 0) holds it
    assert answers(late.push(init(2, staleness=1), arr(0, 0, 0, 0), "i2", 0.3))["i2"].applied == [2, 0, 0]


def test_a_restarted_run_takes_the_copies_before_a_push_that_came_first() -> None:
    """After a restart, the rejoining root's machine (a new daemon: no copies) reached the new run first. Its init
    was applied at once and became the value; the survivor's copy then replaced it (the root's next steps, from
    its init's vector, were replays of old ones) or was ignored. No push is applied before every worker said
    which copies it holds, from the run's first contact on."""
    s: ValueStore[str] = ValueStore(2, timeout_s=T, worker_of_rank=lambda rank: rank // 2)
    assert s.push(init(0), arr(9, 9, 9, 9), "root", 0.0) == []  # copies may come: it waits
    s.worker_restored(0, 0.0)  # the new daemon holds none
    s.restore(Push(0, "w", 0, 0, 1, "float32", [4], 0, 4, kind=KIND_ASYNC, replay=True, applied=[5, 3]),
              arr(4, 4, 4, 4), 0.1)
    got = answers(s.worker_restored(1, 0.2))
    assert got["root"].value.tolist() == [4, 4, 4, 4] and got["root"].applied == [5, 3]  # its steps go on from 5


def test_a_fresh_run_waits_only_its_grace_for_a_machine_that_never_connects() -> None:
    """A fresh cluster whose machine 2 is down (or starts late): the restore opened at the first contact used to
    hold every asynchronous push back for a whole timeout; a machine that never connected to this run has no
    link alive through a restart, and so no copies: it is waited for RESTORE_GRACE_S."""
    s = restarted()
    for w in (0, 1):
        s.worker_connected(w)
        s.worker_restored(w, 0.0)
    assert answers(s.push(init(0), arr(1, 2, 3, 4), "init0", 0.5)) == {}
    assert s.sweep(RESTORE_GRACE_S - 0.1) == []
    actions = s.sweep(RESTORE_GRACE_S)
    assert answers(actions).keys() == {"init0"} and RESTORE_GRACE_S < T
    assert any("no word from worker 2" in a.message for a in actions if isinstance(a, Note))


def test_a_connected_machine_that_has_not_restored_is_waited_for_the_timeout() -> None:
    """A survivor that reconnected and is still replaying its copies is waited for past the grace."""
    s = restarted()
    for w in (0, 1, 2):
        s.worker_connected(w)
    s.worker_restored(0, 0.0)
    s.worker_restored(1, 0.0)
    assert answers(s.push(init(0), arr(1, 2, 3, 4), "init0", 0.5)) == {}
    assert answers(s.sweep(T - 0.1)) == {}
    assert answers(s.sweep(T)).keys() == {"init0"}


def test_a_run_without_asynchronous_values_ends_its_restore_without_a_word() -> None:
    """A synchronous cluster whose machine 2 starts late: its first connections' Restored used to leave a
    warning about a restore in the log of a job that has no asynchronous values."""
    s = restarted()
    for w in (0, 1):
        s.worker_connected(w)
        s.worker_restored(w, 0.0)
    assert s.sweep(RESTORE_GRACE_S) == [] and s.restoring_since is None


def test_a_worker_back_with_another_numbering_is_a_reset_and_the_same_one_is_not() -> None:
    """A machine's daemon killed and started again by its supervisor, with no training process: it connects with
    another epoch and never sends a Reset. It used to count as live again, and held the others back by the bound
    for ever (a review's reproducer: 30 s, ten timeouts). Back with the same epoch (a dropped connection), its
    processes are still there and it is waited for."""
    s = store()
    for w in range(3):
        s.worker_connected(w, f"e{w}")
    initialised(s, arr(0, 0, 0, 0), staleness=0)
    s.worker_disconnected(1, 1.0)
    assert s.worker_connected(1, "e1") == []  # the same daemon: waited for
    s.push(delta(0, 1), arr(1, 1, 1, 1), "a", 2.0)
    assert s.push(delta(2, 1), arr(1, 1, 1, 1), "b", 2.0) == []  # both wait for worker 1
    s.worker_disconnected(1, 3.0)
    released = answers(s.worker_connected(1, "new"))  # a new daemon: its processes are gone
    assert released.keys() == {"a", "b"} and s.reset_workers == {1}
    s.push(delta(1, 1), arr(1, 1, 1, 1), "c", 4.0)  # its processes came back: waited for again
    s.push(delta(0, 2), arr(1, 1, 1, 1), "d", 5.0)
    assert answers(s.push(delta(2, 2), arr(1, 1, 1, 1), "e", 5.0)) == {}  # both wait for worker 1's step 2


def test_a_reset_says_its_numbering_so_a_later_reconnect_is_not_another() -> None:
    s = store()
    for w in range(3):
        s.worker_connected(w, f"e{w}")
    initialised(s, arr(0, 0, 0, 0), staleness=0)
    s.worker_reset(2, "e2b")  # its processes left; it numbers anew from now on
    s.push(delta(2, 1), arr(1, 1, 1, 1), "a", 1.0)  # and came back
    s.worker_disconnected(2, 2.0)
    s.worker_connected(2, "e2b")  # a dropped connection of that daemon: not a reset
    assert s.reset_workers == set() and 2 not in s.excluded


def test_the_next_job_does_not_find_the_values_of_one_whose_daemon_started_anew() -> None:
    """Worker 0's processes ended (Reset), worker 1's daemon crashed and was started again (no Reset, another
    epoch): every machine's processes are gone, so the job is over and its values go. The next job's root
    init sets the value again (it was answered with the last job's)."""
    s = store(2)
    for w in range(2):
        s.worker_connected(w, f"e{w}")
    initialised(s, arr(1, 1, 1, 1))
    s.push(delta(1, 1), arr(5, 5, 5, 5), "d", 1.0)
    s.worker_reset(0, "e0b")
    s.worker_disconnected(1, 2.0)
    actions = s.worker_connected(1, "e1b")
    assert s.keys == {} and any(isinstance(a, Note) and "dropping 1 asynchronous values" in a.message
                                for a in actions)
    got = answers(s.push(init(0), arr(100, 100, 100, 100), "next", 3.0))
    assert got["next"].value.tolist() == [100] * 4 and got["next"].applied == [0, 0]


def test_an_init_after_a_restore_from_a_delta_is_held_to_its_bound_then_to_the_first_root() -> None:
    """A restarted run rebuilt "w" from a copy of a delta's answer (bound 1, no root): an init with bound 3 was
    answered as if it agreed (before the restart it is refused). Now it is refused; the first init that agrees
    stands for the root, and a later one with another root is refused as before a restart."""
    s = restarted(2)
    s.restore(restore_push(0, [5, 4], staleness=1), arr(9, 9, 9, 9), 0.0)
    for w in range(2):
        s.worker_restored(w, 0.0)
    (refused,) = s.push(init(1, staleness=3), arr(0, 0, 0, 0), "bound", 1.0)
    assert isinstance(refused, Fail) and refused.why.code == "mismatch" and "restored" in refused.why.text
    assert answers(s.push(init(1, staleness=1), arr(0, 0, 0, 0), "agrees", 1.0))["agrees"].value.tolist() == [9] * 4
    (other_root,) = s.push(init(0, root=2, staleness=1), arr(0, 0, 0, 0), "root", 1.0)
    assert isinstance(other_root, Fail) and other_root.why.code == "mismatch"


def test_with_a_stall_timeout_an_answer_held_for_a_connected_machine_fails_naming_it() -> None:
    """cluster.stall_timeout: a machine alive and connected but not pushing (stuck) held the others' answers by the
    staleness bound for ever, with a stall note; now they fail once held that long (the delta was applied)."""
    s = ValueStore(N, timeout_s=T, worker_of_rank=lambda rank: rank // 2, stall_s=60.0)
    for w in range(N):
        s.worker_restored(w, 0.0)
    initialised(s, arr(0, 0, 0, 0), staleness=0)
    s.push(delta(0, 1), arr(1, 1, 1, 1), "a", 1.0)
    assert [a for a in s.sweep(60.9) if not isinstance(a, Note)] == []
    (fail,) = [a for a in s.sweep(61.0) if isinstance(a, Fail)]
    assert fail.handle == "a" and fail.why.code == "timeout" and fail.why.timeout_s == 60.0
    assert fail.why.text == ("step 1 of 'w' failed: worker 1, 2 did not come within the staleness bound 0 "
                             "(cluster.stall_timeout), waited 60 s (the delta was applied)")
    assert not [a for a in s.sweep(200.0) if isinstance(a, Fail)]  # failed once
    # the delta stands: the others' steps add to it
    s.push(delta(1, 1), arr(2, 2, 2, 2), "b", 201.0)
    assert answers(s.push(delta(2, 1), arr(3, 3, 3, 3), "c", 202.0))["c"].value.tolist() == [6, 6, 6, 6]


def test_with_a_stall_timeout_an_answer_held_for_a_machine_still_pushing_does_not_fail() -> None:
    s = ValueStore(N, timeout_s=T, worker_of_rank=lambda rank: rank // 2, stall_s=60.0)
    for w in range(N):
        s.worker_restored(w, 0.0)
    initialised(s, arr(0, 0, 0, 0), staleness=0)
    s.push(delta(0, 1), arr(1, 1, 1, 1), "a", 1.0)
    s.pushed_at.update({1: 50.0, 2: 50.0})  # (their pushes of other keys here)
    assert [a for a in s.sweep(100.0) if isinstance(a, Fail)] == []
    assert [a.handle for a in s.sweep(110.0) if isinstance(a, Fail)] == ["a"]


def _init_key(worker: int, name: str, part: int = 0, staleness: int = 1) -> Push:
    """An init of partition ``part`` (4 of 8 floats) of ``name``, bound ``staleness``."""
    return Push(0, name, part, 0, worker, "float32", [8], 4 * part, 4, kind=KIND_ASYNC_INIT, root=0,
                holds_root=worker == 0, staleness=staleness)


def _delta_key(worker: int, name: str, step: int, part: int = 0) -> Push:
    return Push(step, name, part, step, worker, "float32", [8], 4 * part, 4, kind=KIND_ASYNC)


ONES, ZEROS = np.ones(4, np.float32), np.zeros(4, np.float32)
KEYS = [("w", 0), ("w", 1), ("v", 0)]  # two partitions of one name and a second name, all on this server


def _job_that_went_on(s: ValueStore[str]) -> None:
    for name, part in KEYS:
        for w in range(N):
            s.push(_init_key(w, name, part), ZEROS, f"i{w}{name}{part}", 0.0)
    for step in (1, 2):
        for w in range(N):
            for name, part in KEYS:
                s.push(_delta_key(w, name, step, part), ONES, f"{w}.{name}{part}.{step}", float(step))


def test_every_key_of_a_machine_back_in_the_job_is_raised_not_only_its_first_init() -> None:
    """Worker 2's processes leave (Reset); workers 0 and 1 go on to step 5 on every key; worker 2's new process
    inits every key again. Each key's entry of worker 2 goes up to 5 (the module docstring). A first version
    raised only the first init after the reset (push() clears `excluded` via _joined): the other keys kept entry
    2, and workers 0/1's step 6 of those keys was held (6 - 1 > 2) until worker 2 pushed 3 more steps."""
    s = store()
    _job_that_went_on(s)
    s.worker_reset(2)
    for step in (3, 4, 5):
        for w in (0, 1):
            for name, part in KEYS:
                s.push(_delta_key(w, name, step, part), ONES, f"{w}.{name}{part}.{step}", float(step))
    got = {}
    for name, part in KEYS:
        got[(name, part)] = answers(s.push(_init_key(2, name, part), ZEROS, f"back.{name}{part}", 6.0)
                                    )[f"back.{name}{part}"]
    entries = {k: a.applied[2] for k, a in got.items()}
    held = [k for k in KEYS if f"0.{k[0]}{k[1]}.6" not in answers(s.push(_delta_key(0, k[0], 6, k[1]), ONES,
                                                                           f"0.{k[0]}{k[1]}.6", 6.1))]
    assert entries == {k: 5 for k in KEYS} and held == [], f"worker 2's entries {entries}; step 6 held on {held}"


def test_a_machine_declared_dead_is_raised_at_its_init_as_the_docstring_says() -> None:
    """Worker 2 disconnects (same daemon) past the timeout: declared dead, excluded; 0 and 1 go on to step 5.
    It reconnects (same epoch) and inits again: its entry goes up to 5. A first version never raised it
    (worker_connected() drops it from `excluded` at the hello, before any init can come): entry 2."""
    s = store()
    for w in range(N):
        s.worker_connected(w, "e")
    _job_that_went_on(s)
    s.worker_disconnected(2, 3.0)
    s.sweep(3.0 + T)  # declared dead
    assert 2 in s.excluded
    for step in (3, 4, 5):
        for w in (0, 1):
            s.push(_delta_key(w, "w", step), ONES, f"{w}.{step}", 14.0)
    s.worker_connected(2, "e")  # its connection again: the hello comes before any push on it
    back = answers(s.push(_init_key(2, "w"), ZEROS, "back", 15.0))["back"]
    assert back.applied[2] == 5, f"worker 2's entry after its init: {back.applied}"


def test_a_machine_back_without_an_init_owes_no_raise_at_a_later_one() -> None:
    """Worker 2 declared dead, then back with the same processes (no init: they go on pushing) and in the job for
    ten steps; later it is 2 steps behind (within a bound of 2) when a new local process inits again. It never
    left since: its entry stays (a review found the mark of long ago raising it, loosening the bound)."""
    s = store()
    for w in range(N):
        s.push(_init_key(w, "w", staleness=2), ZEROS, f"i{w}", 0.0)
    for step in (1, 2):
        for w in range(N):
            s.push(_delta_key(w, "w", step), ONES, f"{w}.{step}", float(step))
    s.worker_disconnected(2, 3.0)
    s.sweep(3.0 + T)  # declared dead
    for step in range(3, 11):
        for w in (0, 1):
            s.push(_delta_key(w, "w", step), ONES, f"{w}.{step}", 14.0)
    s.worker_connected(2, "e")
    for step in range(3, 21):
        for w in ((2,) if step < 11 else range(N)):
            s.push(_delta_key(w, "w", step), ONES, f"{w}.{step}", 15.0)
    for step in (21, 22):
        for w in (0, 1):
            s.push(_delta_key(w, "w", step), ONES, f"{w}.{step}", 17.0)
    back = answers(s.push(_init_key(2, "w", staleness=2), ZEROS, "reinit", 18.0))["reinit"]
    assert back.applied == [22, 22, 20], back.applied


def test_the_root_machines_failed_init_fails_its_attempts_inits_waiting_or_late_and_never_a_retry() -> None:
    """Worker 0 (root rank 1's machine) failed its async_init, local round 0 of the name, before pushing it (its
    processes disagreed about the tensor: InitFailed): the other machines' inits waited the whole timeout for a
    value that never came (a review). Now the inits of that attempt fail, waiting or late, each with its own side
    of the mismatch as "ours"; a retry (the machines' next local round of the name) waits for the root's value,
    also from a machine whose attempt never came here (failed at home too, or timed out here): the first version
    failed such a machine's good retry (a review of it)."""
    import dataclasses

    from protocol.messages import Why

    def attempt(worker: int, round_: int) -> Push:
        return dataclasses.replace(init(worker, root=1), round=round_)

    s = store()
    assert s.push(attempt(1, 0), arr(0, 0, 0, 0), "w1", 0.0) == []  # waits for worker 0's value
    ours, other = "float32[4] (async_init from rank 1, unbounded)", "float32[5] (async_init from rank 1, unbounded)"
    why = Why.mismatch("w", other, ours, f"rank 0 has {other} but rank 1 has {ours}")
    assert s.init_failed("w", 3, 0, why) == []  # (another root's attempt: not this one)
    (failed,) = s.init_failed("w", 1, 0, why)
    assert isinstance(failed, Fail) and failed.handle == "w1" and failed.why.code == "mismatch"
    assert (failed.why.ours, failed.why.theirs) == (ours, other)  # (its own side: "ours")
    (late,) = s.push(attempt(2, 0), arr(0, 0, 0, 0), "w2", 1.0)  # worker 2's init of the same attempt, after it
    assert isinstance(late, Fail) and late.handle == "w2" and late.why.name == "w"
    assert s.push(attempt(1, 1), arr(0, 0, 0, 0), "w1 again", 2.0) == []  # a retry: waits for the root's
    assert s.push(attempt(2, 1), arr(0, 0, 0, 0), "w2 again", 2.0) == []
    got = answers(s.push(attempt(0, 1), arr(1, 2, 3, 4), "w0 again", 3.0))
    assert set(got) == {"w1 again", "w2 again", "w0 again"} and got["w2 again"].value.tolist() == [1, 2, 3, 4]
    assert s.failed_inits == {}


def test_a_retry_of_a_machine_whose_attempt_never_came_waits_for_the_root() -> None:
    """Worker 2 failed the attempt at home too (or its init timed out here before the InitFailed came): its retry
    is its next local round of the name, which waits for the root's value, however soon it comes."""
    import dataclasses

    from protocol.messages import Why

    s = store()
    s.init_failed("w", 1, 0, Why("rank 0 and rank 1 disagree", "error"))
    retry = dataclasses.replace(init(2, root=1), round=1)
    assert s.push(retry, arr(0, 0, 0, 0), "w2 retry", 1.0) == []
    got = answers(s.push(dataclasses.replace(init(0, root=1), round=1), arr(5, 5, 5, 5), "w0 retry", 2.0))
    assert set(got) == {"w2 retry", "w0 retry"}


def test_a_machine_that_reset_counts_its_attempts_anew_and_is_neither_failed_nor_left_waiting() -> None:
    """Rounds count from 0 again on a machine whose processes were replaced (a reset), so attempts no longer
    align across machines (a review of the numbered attempts): a non-root machine back with its round 0 was
    failed by the record of the root's failed round 0, and the root's machine, restarted, failed its round 0
    while another waited in its round 1, which then waited the whole timeout. Now a reset drops the records, and
    a failed attempt fails every init from that root that waits, whatever its round."""
    import dataclasses

    from protocol.messages import Why

    def attempt(worker: int, round_: int) -> Push:
        return dataclasses.replace(init(worker, root=1), round=round_)

    s = store()
    why = Why("rank 0 and rank 1 disagree", "error")
    s.init_failed("w", 1, 0, why)
    s.worker_reset(2)  # worker 2's processes exit; new ones come
    assert s.push(attempt(2, 0), arr(0, 0, 0, 0), "w2 new", 1.0) == []  # waits for the root's value
    assert s.push(attempt(1, 1), arr(0, 0, 0, 0), "w1 retry", 1.0) == []
    s.worker_reset(0)  # the root's machine restarted: its next attempt is its round 0 again, and fails
    failed = s.init_failed("w", 1, 0, why)
    assert sorted(a.handle for a in failed if isinstance(a, Fail)) == ["w1 retry", "w2 new"]



# -- jobs ----------------------------------------------------------------------------------------------

def of(push: Push, job: str) -> Push:
    return dataclasses.replace(push, job=job)


def overlapping(last: str, next_: str, value: float) -> ValueStore[str]:
    """Two machines: job ``last`` inits 'w' to 1s on both, its process leaves machine 0 (machine 1's lingers),
    and job ``next_`` begins there (t = 10) and inits 'w' to ``value``."""
    s = store(2)
    for w in range(2):
        s.worker_joined(w, last, 0.0)
        s.push(of(init(w), last), arr(1, 1, 1, 1), f"{last}{w}", 0.5)
    s.worker_reset(0)
    s.worker_joined(0, next_, 10.0)
    s.push(of(init(0), next_), arr(value, value, value, value), f"{next_}0", 10.1)
    return s


def test_the_next_jobs_init_beside_a_lingering_machine_of_the_last_one_begins_the_value_anew() -> None:
    """Job a's machines 1 and 2 linger (connected, after their last step: no reset) while machine 0 starts job
    b. Its init was taken for a rejoin and answered with job a's value; now it begins the value from job b's
    root, and a delta of job a after that is refused, naming both jobs (nothing added to b's value)."""
    s = store()
    for w in range(N):
        s.push(of(init(w), "a"), arr(1, 1, 1, 1), f"a{w}", 0.0)
    s.push(of(delta(1, 1), "a"), arr(5, 5, 5, 5), "a-delta", 0.5)
    s.worker_reset(0)  # job a's processes left machine 0 only
    got = answers(s.push(of(init(0), "b"), arr(7, 8, 9, 10), "b0", 1.0))
    assert got["b0"].value.tolist() == [7, 8, 9, 10] and got["b0"].applied == [0, 0, 0]
    (refused,) = s.push(of(delta(1, 2), "a"), arr(100, 100, 100, 100), "late-a", 1.1)
    assert isinstance(refused, Fail) and refused.handle == "late-a"
    assert "job 'a'" in refused.why.text and "job 'b'" in refused.why.text, refused.why.text
    later = answers(s.push(of(init(1), "b"), arr(0, 0, 0, 0), "b1", 1.2))  # machine 1's job b: the value as is
    assert later["b1"].value.tolist() == [7, 8, 9, 10]
    assert answers(s.push(of(delta(0, 1), "b"), arr(1, 1, 1, 1), "b-delta", 1.3))["b-delta"].value.tolist() \
        == [8, 9, 10, 11]


def test_a_rejoin_within_the_same_job_or_where_no_job_is_named_still_takes_the_value_as_it_is() -> None:
    for first, again in (("a", "a"), ("", ""), ("a", ""), ("", "a")):
        s = store()
        for w in range(N):
            s.push(of(init(w), first), arr(1, 1, 1, 1), f"i{w}", 0.0)
        s.push(of(delta(1, 1), first), arr(5, 5, 5, 5), "d", 0.5)
        s.worker_reset(0)
        got = answers(s.push(of(init(0), again), arr(7, 7, 7, 7), "back", 1.0))
        assert got["back"].value.tolist() == [6, 6, 6, 6], (first, again)


def test_the_inits_that_waited_for_the_last_jobs_root_fail_naming_both_jobs() -> None:
    """Job a's init of machine 1 waits for its root (machine 0), which never came: job b's root init begins the
    value anew, and the waiting init fails at once instead of being answered with job b's value."""
    s = store()
    assert s.push(of(init(1), "a"), arr(3, 3, 3, 3), "a1", 0.0) == []
    actions = s.push(of(init(0), "b"), arr(7, 7, 7, 7), "b0", 1.0)
    fails = [a for a in actions if isinstance(a, Fail)]
    assert [f.handle for f in fails] == ["a1"] and "job 'a'" in fails[0].why.text and "job 'b'" in fails[0].why.text
    assert answers(actions)["b0"].value.tolist() == [7, 7, 7, 7]


def test_a_restarted_servers_copies_are_of_their_job() -> None:
    """A restarted server: machine 1 (job a, lingering) gives its copy back, and machine 0's init of job b waits
    for the restore's end; then it begins the value anew from job b's root, not from job a's copy, and a later
    copy of job a is ignored."""
    s = restarted()
    assert s.push(of(init(0), "b"), arr(7, 7, 7, 7), "b0", 0.0) == []
    copy = dataclasses.replace(delta(1, 3), replay=True, applied=[0, 3, 0])
    (ignored,) = s.restore(of(copy, "a"), arr(9, 9, 9, 9), 0.1)  # (job b pushed here, job a never did)
    assert isinstance(ignored, Note) and "job 'a'" in ignored.message and "ignored" in ignored.message
    actions = [a for w in range(N) for a in s.worker_restored(w, 0.2)]
    assert answers(actions)["b0"].value.tolist() == [7, 7, 7, 7]


def test_a_restarted_server_learns_from_the_workers_hellos_which_job_began_last() -> None:
    """Restarted while job b runs and machine 1 lingers in job a: whichever copy or push comes first, job a is
    the older (its processes began 50 s ago, b's 5 s ago): its copy is ignored, its late delta refused, and job b
    goes on from its own copy (the order of first pushes made a the newest, and dropped b's value, a review)."""
    s = restarted()
    for w, job, age in ((1, "a", 50.0), (0, "b", 5.0), (2, "b", 4.0)):
        s.worker_connected(w, f"e{w}", now=100.0, job=job, job_age_s=age)
    old = of(dataclasses.replace(delta(1, 9), replay=True, applied=[9, 9, 9]), "a")
    (ignored,) = s.restore(old, arr(1, 1, 1, 1), 100.1)
    assert isinstance(ignored, Note) and "ignored" in ignored.message
    assert s.restore(of(dataclasses.replace(delta(0, 3), replay=True, applied=[3, 0, 3]), "b"), arr(7, 7, 7, 7),
                     100.2) == []
    assert not [a for w in range(N) for a in s.worker_restored(w, 100.3) if not isinstance(a, Note)]
    (refused,) = s.push(of(delta(1, 10), "a"), arr(5, 5, 5, 5), "late-a", 100.4)
    assert isinstance(refused, Fail) and "job 'b' began after it" in refused.why.text, refused
    assert answers(s.push(of(delta(0, 4), "b"), arr(1, 1, 1, 1), "b", 100.5))["b"].value.tolist() == [8] * 4


def test_a_job_is_as_old_as_its_processes_not_as_its_first_push_here() -> None:
    """Job a ran synchronously (nothing pushed to this server); machine 1's process of it lingers, and its first
    asynchronous push comes after job b's: refused as the older job's, not taken for a new job that dropped
    b's values (a review's reproducer, on real daemons too)."""
    s = store(2)
    s.worker_joined(0, "a", 0.0)
    s.worker_joined(1, "a", 0.0)
    s.worker_reset(0)
    s.worker_joined(0, "b", 10.0)
    s.push(of(init(0), "b"), arr(100, 100, 100, 100), "b0", 11.0)
    (refused,) = s.push(of(dataclasses.replace(init(1), name="a.late"), "a"), arr(1, 1, 1, 1), "late", 12.0)
    assert isinstance(refused, Fail) and "job 'a'" in refused.why.text and "job 'b' began after it" in \
        refused.why.text, refused
    assert answers(s.push(of(delta(0, 1), "b"), arr(1, 1, 1, 1), "b1", 13.0))["b1"].value.tolist() == [101] * 4


def test_a_jobs_name_used_again_once_the_other_job_ran_everywhere_begins_anew() -> None:
    """a, then b on every machine (their processes overlapping, so no worker-wide reset), then a again: the old
    order refused the new a for the life of the server run (a review)."""
    s = store(2)
    for t, job in ((0.0, "a"), (10.0, "b"), (20.0, "a")):
        for w in range(2):
            s.worker_reset(w) if t else None
            s.worker_joined(w, job, t + w)
            s.push(of(init(w), job), arr(t, t, t, t), f"{job}{w}", t + w + 0.5)
    assert answers(s.push(of(delta(1, 1), "a"), arr(1, 1, 1, 1), "d", 30.0))["d"].value.tolist() == [21] * 4


def test_a_push_of_the_last_job_after_the_next_one_began_is_refused_and_leaves_its_value_alone() -> None:
    """A restarted process of the last job re-inits (or pushes a delta for a key the next job has not made yet):
    refused at once naming both jobs, not a new beginning that wiped the running job's value (a review)."""
    s = store()
    for w in range(N):
        s.push(of(init(w), "a"), arr(1, 1, 1, 1), f"a{w}", 0.0)
    s.worker_reset(0)
    s.push(of(init(0), "b"), arr(7, 7, 7, 7), "b0", 1.0)
    s.push(of(delta(0, 1), "b"), arr(1, 1, 1, 1), "b0d1", 1.1)
    for late in (of(init(1), "a"), of(dataclasses.replace(delta(2, 5), name="other"), "a")):
        (refused,) = s.push(late, arr(1, 1, 1, 1), "late", 1.2)
        assert isinstance(refused, Fail) and "job 'a'" in refused.why.text and "job 'b' began after it" in \
            refused.why.text, refused.why.text
    assert answers(s.push(of(delta(0, 2), "b"), arr(1, 1, 1, 1), "b0d2", 1.3))["b0d2"].value.tolist() == [9] * 4
    assert s.pending == []


def test_the_next_jobs_first_push_drops_every_value_of_the_jobs_before_it() -> None:
    """Jobs that overlap never reset every worker at once: the last job's names the next one does not use stayed
    for good (and made a synchronous use of them a misuse, a review)."""
    s = store(2)
    for w in range(2):
        for name in ("old.w", "shared.w"):
            s.push(of(dataclasses.replace(init(w), name=name), "a"), arr(1, 1, 1, 1), f"a{w}{name}", 0.0)
    s.worker_reset(0)
    actions = s.push(of(dataclasses.replace(init(0), name="new.w"), "b"), arr(2, 2, 2, 2), "b0", 1.0)
    assert any(isinstance(a, Note) and "dropping 2 asynchronous values" in a.message for a in actions), actions
    assert {k: st.job for k, st in s.keys.items()} == {("new.w", 0): "b"}
    assert not s.has("old.w", 0)


def test_a_machine_still_in_the_last_job_holds_none_of_the_next_jobs_values_back() -> None:
    """staleness=0: machine 1 lingers in job a while machine 0 runs job b; b's steps were held until a's process
    left (a review). Once machine 1's process of job b inits, its entry starts at machine 0's, as a machine
    that left the job does, so neither waits for the other's past."""
    s = store(2)
    for w in range(2):
        s.push(of(init(w, staleness=0), "a"), arr(1, 1, 1, 1), f"a{w}", 0.0)
    s.worker_reset(0)
    s.push(of(init(0, staleness=0), "b"), arr(7, 7, 7, 7), "b0", 1.0)
    for step in (1, 2, 3):
        assert "b0d" in str(answers(s.push(of(delta(0, step), "b"), arr(1, 1, 1, 1), f"b0d{step}", 1.0 + step)))
    s.worker_reset(1)
    got = answers(s.push(of(init(1, staleness=0), "b"), arr(0, 0, 0, 0), "b1", 5.0))["b1"]
    assert got.value.tolist() == [10] * 4 and got.applied == [3, 3]
    assert s.push(of(delta(1, 4), "b"), arr(1, 1, 1, 1), "b1d4", 5.1) == []  # bulk-synchronous: waits for machine 0
    assert set(answers(s.push(of(delta(0, 4), "b"), arr(1, 1, 1, 1), "b0d4", 5.2))) == {"b1d4", "b0d4"}


def test_a_machine_whose_processes_joined_again_keeps_the_jobs_values_through_its_peers_restart() -> None:
    """Job a's process left machine 1 (a Reset) and job b's connected there (Joined) but had not pushed yet when
    machine 0's process of job b restarted (a Reset): taken for every worker reset, b's value and steps were
    dropped (a review)."""
    s = store(2)
    for w in range(2):
        s.push(of(init(w), "a"), arr(1, 1, 1, 1), f"a{w}", 0.0)
    s.worker_reset(0)
    s.push(of(init(0), "b"), arr(7, 7, 7, 7), "b0", 1.0)
    s.push(of(delta(0, 1), "b"), arr(1, 1, 1, 1), "b0d1", 1.1)
    s.worker_reset(1)
    s.worker_joined(1)
    assert not any(isinstance(a, Note) for a in s.worker_reset(0))
    assert answers(s.push(of(init(0), "b"), arr(7, 7, 7, 7), "again", 2.0))["again"].value.tolist() == [8] * 4


def test_a_failed_init_of_a_process_of_the_ended_job_fails_none_of_the_next_jobs_inits() -> None:
    s = store(2)
    s.worker_joined(0, "a", 0.0)
    s.worker_joined(1, "a", 0.0)
    s.worker_reset(0)
    s.worker_joined(0, "b", 10.0)
    assert s.push(of(init(0, root=2), "b"), arr(0, 0, 0, 0), "b0", 11.0) == []  # waits for the root's machine, 1
    (note,) = s.init_failed("w", 2, 0, Why("the processes disagreed", "mismatch"), worker=1)
    assert isinstance(note, Note) and "job 'a'" in note.message and "ignored" in note.message
    assert [w.handle for w in s.keys[("w", 0)].inits] == ["b0"] and "w" not in s.failed_inits


def test_a_restarted_process_of_the_lingering_job_is_a_rejoin_of_it_not_a_new_job() -> None:
    """Machine 1 lingers in job k while job j runs on machine 0; its k process restarts (torchrun), and machine
    0's link reconnects in between. k was forgotten then, begun anew as the newest job, and j's values dropped
    and j refused for good (a review). k is remembered while machine 1's last processes were of it: the
    restarted process rejoins it, still the older job, and its pushes are refused."""
    s = overlapping("k", "j", 7)
    s.worker_reset(1)  # the lingering k process crashed
    s.worker_connected(0, "e0", now=11.0, job="j", job_age_s=1.0)
    assert s.worker_joined(1, "k", 12.0) == []  # its restart: nothing of j's dropped
    (refused,) = s.push(of(delta(1, 2), "k"), arr(5, 5, 5, 5), "late-k", 12.1)
    assert isinstance(refused, Fail) and "job 'j' began after it" in refused.why.text, refused
    assert answers(s.push(of(delta(0, 1), "j"), arr(1, 1, 1, 1), "j1", 12.2))["j1"].value.tolist() == [8] * 4


def test_a_job_taken_for_the_newest_locks_nobody_out_once_its_processes_left() -> None:
    """A restarted server told (by an older worker daemon's Hello) that machine 1's job k began after job j:
    j's pushes are refused while k's process is there, and j went on being refused after it left, until every
    worker reset (a review). The newest job is the one that began last among those with processes somewhere."""
    s = restarted(2)
    s.worker_connected(0, "e0", now=100.0, job="j", job_age_s=60.0)
    s.worker_connected(1, "e1", now=100.0, job="k", job_age_s=10.0)
    for w in range(2):
        s.worker_restored(w, 100.1)
    (refused,) = s.push(of(init(0), "j"), arr(7, 7, 7, 7), "j0", 100.2)
    assert isinstance(refused, Fail) and "job 'k' began after it" in refused.why.text
    s.worker_reset(1)  # k's process left machine 1; j's comes there
    s.worker_joined(1, "j", 120.0)
    assert answers(s.push(of(init(0), "j"), arr(7, 7, 7, 7), "j0", 120.1))["j0"].value.tolist() == [7] * 4
    assert answers(s.push(of(init(1), "j"), arr(0, 0, 0, 0), "j1", 120.2))["j1"].value.tolist() == [7] * 4


def test_the_values_of_a_job_taken_for_the_newest_go_once_its_processes_left() -> None:
    s = restarted(2)
    s.worker_connected(1, "e1", now=100.0, job="k", job_age_s=10.0)
    assert s.restore(of(dataclasses.replace(delta(1, 5), replay=True, applied=[0, 5]), "k"), arr(3, 3, 3, 3),
                     100.05) == []
    s.worker_connected(0, "e0", now=100.0, job="j", job_age_s=60.0)
    for w in range(2):
        s.worker_restored(w, 100.1)
    s.worker_reset(1)
    actions = s.worker_joined(1, "j", 120.0)
    assert any(isinstance(a, Note) and "dropping 1 asynchronous values" in a.message for a in actions), actions
    assert s.keys == {}


def test_the_running_job_between_two_of_its_processes_is_still_the_newest() -> None:
    """Job b's processes restart (torchrun restarts a machine's local group) while machine 1 lingers in job a:
    in that gap a was taken for the newest again, its late delta deleted b's value, and b's restarted process
    got its own init back, its training gone (a review). a's delta is refused, b rejoins its value."""
    s = overlapping("a", "b", 100)
    s.push(of(delta(0, 1), "b"), arr(1, 1, 1, 1), "b1", 12.0)
    s.worker_reset(0)  # b's process crashed; torchrun restarts it
    (refused,) = s.push(of(delta(1, 2), "a"), arr(5, 5, 5, 5), "late-a", 13.0)
    assert isinstance(refused, Fail) and "job 'b' began after it" in refused.why.text, refused
    assert s.worker_joined(0, "b", 14.0) == []
    assert answers(s.push(of(init(0), "b"), arr(100, 100, 100, 100), "again", 14.5))["again"].value.tolist() == \
        [101] * 4


def test_a_named_jobs_values_outlive_a_moment_when_no_machine_has_processes() -> None:
    """The lingering machine's process of the last job ends while the running job's only machine restarts its
    process: every worker reset, and the running job's values were dropped, its training lost (a review). A named
    job's values wait for its processes; an unnamed job's go, as before."""
    s = overlapping("a", "b", 100)
    for step in (1, 2, 3):
        s.push(of(delta(0, step), "b"), arr(1, 1, 1, 1), f"b{step}", 11.0 + step)
    s.worker_reset(0)
    (note,) = s.worker_reset(1)
    assert "keeping job 'b''s 1" in note.message, note
    s.worker_joined(0, "b", 20.0)
    assert answers(s.push(of(init(0), "b"), arr(100, 100, 100, 100), "again", 20.5))["again"].value.tolist() == \
        [103] * 4
    unnamed = store(2)
    initialised(unnamed, arr(1, 1, 1, 1))
    unnamed.worker_reset(0)
    unnamed.worker_reset(1)
    assert unnamed.keys == {}


def test_a_restarted_process_of_the_last_job_after_every_worker_reset_is_still_the_older() -> None:
    """Every worker reset (the last job ended on machine 0, its process on machine 1 crashed), the next job began
    on machine 0, then torchrun restarted the last job's process on machine 1: the reset had forgotten when
    that job began, so it began anew, the newest, and the running job's values were dropped (a review)."""
    s = store(2)
    for w in range(2):
        s.worker_joined(w, "a", 0.0)
        s.push(of(init(w), "a"), arr(1, 1, 1, 1), f"a{w}", 0.5)
    s.worker_reset(0)
    s.worker_reset(1)
    s.worker_joined(0, "b", 10.0)
    s.push(of(init(0), "b"), arr(7, 7, 7, 7), "b0", 10.1)
    s.push(of(delta(0, 1), "b"), arr(1, 1, 1, 1), "b1", 10.2)
    assert s.worker_joined(1, "a", 11.0) == []
    assert answers(s.push(of(delta(0, 2), "b"), arr(1, 1, 1, 1), "b2", 11.5))["b2"].value.tolist() == [9] * 4


def test_a_restarted_server_dates_a_job_by_the_age_its_joined_says() -> None:
    """A restarted server, machine 1's process of the lingering job between two of its lives (no processes at
    its Hello): its later Joined dated the job now, the newest, and the running job's restored value was dropped
    (a review). Joined says how long ago the job's first processes came there."""
    s = restarted(2)
    s.worker_connected(0, "e0", now=100.0, job="b", job_age_s=5.0)
    s.worker_connected(1, "e1", now=100.0)
    s.restore(of(dataclasses.replace(delta(0, 3), replay=True, applied=[3, 0]), "b"), arr(7, 7, 7, 7), 100.1)
    for w in range(2):
        s.worker_restored(w, 100.2)
    assert s.worker_joined(1, "a", 101.0, job_age_s=60.0) == []
    assert answers(s.push(of(delta(0, 4), "b"), arr(1, 1, 1, 1), "b4", 101.5))["b4"].value.tolist() == [8] * 4
