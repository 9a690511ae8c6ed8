"""The Summation Service's round logic, without sockets."""

from __future__ import annotations

import logging

import asyncio
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

from bps_server.aggregator import INLINE_SUM_MAX_BYTES, Aggregator, Why
from protocol.messages import Push

# Float32 elements of a partition of 4 x INLINE_SUM_MAX_BYTES: every kernel over it (an addition, a rounding)
# goes to the pool.
LARGE = INLINE_SUM_MAX_BYTES


class Recorder:
    def __init__(self) -> None:
        self.results: dict[int, np.ndarray] = {}
        self.failures: dict[int, str] = {}  # worker -> the text of its failure
        self.whys: dict[int, Why] = {}  # worker -> its failure's code and facts

    def reply(self, push: Push, out: np.ndarray) -> None:
        self.results[push.worker] = out.copy()

    def fail(self, push: Push, why: Why) -> None:
        self.failures[push.worker] = why.text
        self.whys[push.worker] = why


def _push(worker: int, data: np.ndarray, *, name: str = "t", rnd: int = 0, dtype: str = "float32",
          shape: list[int] | None = None, divisor: int = 1, part: int = 0) -> tuple[Push, np.ndarray]:
    shape = [data.size] if shape is None else shape
    push = Push(req=worker, name=name, part=part, round=rnd, worker=worker, dtype=dtype, shape=shape, offset=0,
                count=data.size, divisor=divisor)
    storage = data.view(np.uint16) if dtype in ("float16", "bfloat16") else data
    return push, storage.copy()


async def _feed(agg: Aggregator, rec: Recorder, pushes: list[tuple[Push, np.ndarray]]) -> None:
    await asyncio.gather(*(agg.push(p, d, rec.reply, rec.fail) for p, d in pushes))


async def test_sum_is_sent_to_every_worker_once_all_pushed():
    agg, rec = Aggregator(3), Recorder()
    xs = [np.arange(5, dtype=np.float32) * (w + 1) for w in range(3)]
    await _feed(agg, rec, [_push(w, xs[w]) for w in (2, 0)])
    assert rec.results == {}  # two of three: nothing yet
    await _feed(agg, rec, [_push(1, xs[1])])
    assert sorted(rec.results) == [0, 1, 2]
    for out in rec.results.values():
        np.testing.assert_array_equal(out, np.arange(5, dtype=np.float32) * 6)
    assert agg.keys[("t", 0)].round == 1 and agg.counters.rounds_completed == 1


async def test_rounds_do_not_mix():
    agg, rec = Aggregator(2), Recorder()
    for rnd in range(5):
        await _feed(agg, rec, [_push(w, np.full(3, rnd * 10 + w, np.int64), dtype="int64", rnd=rnd) for w in (1, 0)])
        assert all((out == rnd * 20 + 1).all() for out in rec.results.values())
        rec.results.clear()


@pytest.mark.parametrize("dtype,np_dtype", [("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)])
async def test_half_types_accumulate_in_float32_and_round_once(dtype, np_dtype):
    # In 16 bits 2048 + 1 + 1 stays 2048 (each +1 rounds away); in float32 it is 2050, which float16 holds.
    big = 2048.0 if dtype == "float16" else 256.0
    agg, rec = Aggregator(3), Recorder()
    xs = [np.array([big], np_dtype), np.array([1.0], np_dtype), np.array([1.0], np_dtype)]
    await _feed(agg, rec, [_push(w, xs[w], dtype=dtype) for w in range(3)])
    got = rec.results[0].view(np_dtype)
    assert float(got[0]) == big + 2


async def test_divisor_divides_in_float32_before_the_single_rounding():
    agg, rec = Aggregator(2), Recorder()
    xs = [np.array([1.0, 3.0], np.float16), np.array([2.0, 4.0], np.float16)]
    await _feed(agg, rec, [_push(w, xs[w], dtype="float16", divisor=3) for w in range(2)])
    expect = (np.array([3.0, 7.0], np.float32) / np.float32(3)).astype(np.float16)
    assert rec.results[0].view(np.float16).tobytes() == expect.tobytes()


async def test_large_partitions_are_summed_in_the_thread_pool():
    with ThreadPoolExecutor(2) as pool:
        agg, rec = Aggregator(2, pool), Recorder()
        xs = [np.full(LARGE, w + 0.5, np.float32) for w in range(2)]
        await _feed(agg, rec, [_push(w, xs[w]) for w in range(2)])
        assert (rec.results[1] == 2.0).all()


async def test_shape_mismatch_fails_everyone_in_the_round_and_names_both():
    agg, rec = Aggregator(3), Recorder()
    await _feed(agg, rec, [_push(0, np.zeros(4, np.float32), shape=[2, 2])])
    await _feed(agg, rec, [_push(1, np.zeros(4, np.float32), shape=[4])])
    assert set(rec.failures) == {0, 1}
    assert "'t'" in rec.failures[0] and "float32[2,2]" in rec.failures[0] and "float32[4]" in rec.failures[0]
    # each side hears the facts from where it stands: its own descriptor is ours
    assert [(rec.whys[w].code, rec.whys[w].name, rec.whys[w].ours, rec.whys[w].theirs) for w in (0, 1)] == [
        ("mismatch", "t", "float32[2,2]", "float32[4]"), ("mismatch", "t", "float32[4]", "float32[2,2]")]
    await _feed(agg, rec, [_push(2, np.zeros(4, np.float32), shape=[2, 2])])  # late push of the failed round
    assert "mismatch" in rec.failures[2]
    rec.failures.clear()
    await _feed(agg, rec, [_push(w, np.ones(4, np.float32), rnd=1) for w in range(3)])  # the next round works
    assert rec.failures == {} and (rec.results[0] == 3).all()


async def test_duplicate_push_fails_only_the_duplicate():
    agg, rec = Aggregator(2), Recorder()
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32))])
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32))])
    assert "twice" in rec.failures[0]
    rec.failures.clear()
    await _feed(agg, rec, [_push(1, np.ones(2, np.float32))])
    assert (rec.results[1] == 2).all()


async def test_stale_round_is_refused():
    agg, rec = Aggregator(1), Recorder()
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32), rnd=3)])
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32), rnd=2)])
    assert "stale round 2" in rec.failures[0]


async def test_a_later_round_abandons_an_incomplete_one():
    agg, rec = Aggregator(2), Recorder()
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32), rnd=0)])
    await _feed(agg, rec, [_push(1, np.ones(2, np.float32), rnd=1)])
    assert "abandoned" in rec.failures[0]
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32), rnd=1)])
    assert (rec.results[0] == 2).all() and (rec.results[1] == 2).all()


async def test_abort_fails_waiters_and_late_pushes():
    agg, rec = Aggregator(3), Recorder()
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32))])
    agg.abort("t", 0, 0, worker=2, why=Why("local mismatch"))
    assert "aborted by worker 2: local mismatch" in rec.failures[0]
    await _feed(agg, rec, [_push(1, np.ones(2, np.float32))])
    assert "aborted" in rec.failures[1]


async def test_lost_worker_fails_pending_rounds_at_once_and_later_ones_after_the_grace():
    agg, rec = Aggregator(2, lost_grace_s=0.2), Recorder()
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32), name="pending")])
    assert agg.worker_lost(1) == 1
    assert rec.whys[0].code == "connection" and rec.whys[0].peer == "worker 1"
    assert "worker 1 is disconnected" in rec.failures.pop(0)
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32), name="later")])
    assert rec.failures == {}  # within the grace period it may still come back
    await asyncio.sleep(0.3)
    assert "worker 1 is disconnected" in rec.failures.pop(0)
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32), name="after", rnd=0)])
    assert "worker 1" in rec.failures.pop(0)  # past the grace: at once
    agg.worker_joined(1)
    await _feed(agg, rec, [_push(w, np.ones(2, np.float32), name="back") for w in range(2)])
    assert rec.failures == {} and (rec.results[0] == 2).all()


async def test_empty_partition_completes():
    agg, rec = Aggregator(2), Recorder()
    await _feed(agg, rec, [_push(w, np.zeros(0, np.float32), shape=[0, 3]) for w in range(2)])
    assert rec.results[0].size == 0 and rec.failures == {}


async def test_reset_fails_pending_rounds_and_clears_state_once_every_worker_reset():
    agg, rec = Aggregator(2, lost_grace_s=10), Recorder()
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32), name="x", rnd=7)])
    assert agg.worker_reset(1) == 1
    assert "no training processes" in rec.failures.pop(0)
    assert agg.keys  # worker 0 has not reset: state stays
    agg.worker_reset(0)
    assert agg.keys == {}  # both reset: the next job starts from round 0
    await _feed(agg, rec, [_push(w, np.ones(2, np.float32), name="x", rnd=0) for w in range(2)])
    assert rec.failures == {} and (rec.results[0] == 2).all()


async def test_abort_of_a_later_round_fails_the_waiting_one():
    agg, rec = Aggregator(2), Recorder()
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32), rnd=3)])
    agg.abort("t", 0, 4, worker=1, why=Why("gave up"))
    assert "abandoned" in rec.failures[0]


# -- after a server restart: replayed sums ------------------------------------------------
def _replay(worker: int, total: np.ndarray, rnd: int) -> tuple[Push, np.ndarray]:
    import dataclasses

    push, data = _push(worker, total, rnd=rnd)
    return dataclasses.replace(push, replay=True), data


async def test_a_replayed_sum_answers_the_workers_that_missed_it():
    """Worker 0 got round 4's sum before the crash, workers 1 and 2 did not: they push round 4 again,
    and get exactly the replayed bytes (not a new sum of what happens to arrive)."""
    agg, rec = Aggregator(3), Recorder()
    total = np.array([1.5, -2.25, 1e-8], dtype=np.float32)
    await _feed(agg, rec, [_push(1, np.ones(3, np.float32), rnd=4)])
    agg.replay(*_replay(0, total, 4))
    assert sorted(rec.results) == [1]  # answered at once with the replayed sum
    await _feed(agg, rec, [_push(2, np.full(3, 7, np.float32), rnd=4)])
    for w in (1, 2):
        np.testing.assert_array_equal(rec.results[w], total)
    assert agg.keys[("t", 0)].round == 5 and agg.counters.rounds_replayed == 1
    assert rec.failures == {}


async def test_a_replayers_next_round_waits_for_the_replayed_round_to_settle():
    agg, rec = Aggregator(2), Recorder()
    total = np.full(4, 3.0, np.float32)
    agg.replay(*_replay(0, total, 7))
    await _feed(agg, rec, [_push(0, np.full(4, 1.0, np.float32), rnd=8)])  # worker 0 moved on: held, not abandoning
    assert rec.results == {} and rec.failures == {} and agg.keys[("t", 0)].round == 7
    await _feed(agg, rec, [_push(1, np.full(4, 9.0, np.float32), rnd=7)])  # worker 1 missed round 7's sum
    np.testing.assert_array_equal(rec.results.pop(1), total)
    await asyncio.sleep(0)  # the held round-8 push goes in
    await _feed(agg, rec, [_push(1, np.full(4, 2.0, np.float32), rnd=8)])
    for w in (0, 1):
        np.testing.assert_array_equal(rec.results[w], np.full(4, 3.0, np.float32))  # round 8: 1 + 2
    assert agg.keys[("t", 0)].round == 9 and rec.failures == {}


async def test_when_everyone_replays_the_round_just_moves_on():
    agg, rec = Aggregator(2), Recorder()
    total = np.arange(3, dtype=np.float32)
    for w in (1, 0):
        agg.replay(*_replay(w, total, 2))
    assert agg.keys[("t", 0)].round == 3 and rec.results == {}
    await _feed(agg, rec, [_push(w, np.full(3, w + 1.0, np.float32), rnd=3) for w in (0, 1)])
    np.testing.assert_array_equal(rec.results[0], np.full(3, 3.0, np.float32))


async def test_stale_or_mismatched_replays_are_ignored():
    agg, rec = Aggregator(2), Recorder()
    await _feed(agg, rec, [_push(w, np.ones(2, np.float32), rnd=5) for w in (0, 1)])  # round 5 done here
    agg.replay(*_replay(0, np.full(2, 9.0, np.float32), 4))  # older than the server's round: ignored
    assert agg.keys[("t", 0)].round == 6 and not agg.keys[("t", 0)].restart.replayers
    await _feed(agg, rec, [_push(1, np.ones(2, np.float32), rnd=6)])
    agg.replay(*_replay(0, np.full(3, 9.0, np.float32), 6))  # another shape than the round's pushes
    assert agg.keys[("t", 0)].restart.result is None


async def test_a_round_waiting_for_a_worker_that_is_not_connected_fails_after_the_grace():
    connected = {0, 1}
    agg, rec = Aggregator(3, lost_grace_s=0.2, connected=lambda w: w in connected), Recorder()
    await _feed(agg, rec, [_push(w, np.ones(2, np.float32)) for w in (0, 1)])
    import time

    assert agg.sweep(time.monotonic()) == 0  # too early
    assert agg.sweep(time.monotonic() + 0.3) == 1
    assert set(rec.failures) == {0, 1} and "worker 2 was not connected" in rec.failures[0]
    # A connected but slow worker is waited for.
    agg2, rec2 = Aggregator(3, lost_grace_s=0.2), Recorder()
    await _feed(agg2, rec2, [_push(w, np.ones(2, np.float32)) for w in (0, 1)])
    assert agg2.sweep(time.monotonic() + 10) == 0 and rec2.failures == {}


async def test_a_later_replay_supersedes_an_earlier_one():
    """Worker 1 got round 8's sum, worker 0 only round 7's (its round-8 sum was lost in the crash):
    worker 0 replays 7 and pushes 8 again, worker 1 replays 8 and pushes 9."""
    agg, rec = Aggregator(2), Recorder()
    seven, eight = np.full(2, 7.0, np.float32), np.full(2, 8.0, np.float32)
    agg.replay(*_replay(0, seven, 7))
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32), rnd=8)])  # held behind round 7
    agg.replay(*_replay(1, eight, 8))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    np.testing.assert_array_equal(rec.results.pop(0), eight)  # worker 0 gets round 8's real sum
    await _feed(agg, rec, [_push(w, np.full(2, w + 1.0, np.float32), rnd=9) for w in (1, 0)])
    for w in (0, 1):
        np.testing.assert_array_equal(rec.results[w], np.full(2, 3.0, np.float32))
    assert rec.failures == {} and agg.keys[("t", 0)].round == 10


async def test_a_push_held_behind_a_replayed_round_is_counted_once():
    agg, rec = Aggregator(2), Recorder()
    agg.replay(*_replay(0, np.full(2, 7.0, np.float32), 7))
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32), rnd=8)])  # held behind round 7
    await _feed(agg, rec, [_push(1, np.ones(2, np.float32), rnd=7)])  # round 7 settles: the held push goes in
    await asyncio.sleep(0)
    await _feed(agg, rec, [_push(1, np.ones(2, np.float32), rnd=8)])
    assert rec.failures == {} and agg.keys[("t", 0)].round == 9
    c = agg.counters
    assert c.pushes == 3 and c.bytes_received == 3 * 8 and c.bytes_by_worker == {0: 8, 1: 16}


async def test_a_round_waiting_for_a_worker_without_processes_fails_after_the_grace():
    """Worker 1 is connected but its processes left (Reset): a round it never joins fails after the grace,
    naming it; worker 0's next job must not wait for ever on a peer with nothing running."""
    import time

    agg, rec = Aggregator(2, lost_grace_s=0.2), Recorder()
    agg.worker_reset(1)
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32))])
    assert agg.sweep(time.monotonic() + 0.3) == 1
    assert "worker 1 had no training processes" in rec.failures[0]


class _HeldPool(Executor):
    """A thread pool stand-in that runs each kernel only when the test says so."""

    def __init__(self) -> None:
        self.pending: list[tuple[Future, object, tuple]] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        future: Future = Future()
        self.pending.append((future, fn, args))
        return future

    def run_pending(self) -> int:
        pending, self.pending = self.pending, []
        for future, fn, args in pending:
            future.set_result(fn(*args))  # type: ignore[operator]
        return len(pending)


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_round_that_fails_while_its_sum_is_being_finished_is_not_answered_nor_reopened():
    """Both workers reset while the averaged sum is rounded in the pool: they get the failure, no sum, and
    the key stays dropped (the next job starts at round 0), not reopened at round 1 by the late sum."""
    pool = _HeldPool()
    agg, rec = Aggregator(2, pool, lost_grace_s=10), Recorder()
    size = LARGE  # added and finalized in the pool
    task = asyncio.ensure_future(_feed(agg, rec, [_push(w, np.full(size, 1.0, np.float32), divisor=2)
                                                  for w in range(2)]))
    await _turns()
    assert pool.run_pending() == 1  # the second worker's addition (the first one's buffer was adopted)
    await _turns()
    assert len(pool.pending) == 1  # the rounding of the averaged sum
    agg.worker_reset(0)
    agg.worker_reset(1)
    assert set(rec.failures) == {0, 1} and "no training processes" in rec.failures[0]
    pool.run_pending()
    await task
    assert rec.results == {} and agg.keys == {} and agg.counters.rounds_completed == 0


async def test_a_round_that_fails_while_an_addition_is_in_the_pool_drops_the_addition():
    pool = _HeldPool()
    agg, rec = Aggregator(3, pool), Recorder()
    size = LARGE
    task = asyncio.ensure_future(_feed(agg, rec, [_push(w, np.full(size, 1.0, np.float32)) for w in range(2)]))
    await _turns()
    assert len(pool.pending) == 1  # worker 1's addition (worker 0's buffer was adopted)
    agg.abort("t", 0, 0, worker=2, why=Why("gave up"))
    pool.run_pending()
    await task
    assert set(rec.failures) == {0, 1} and rec.results == {}
    await _feed(agg, rec, [_push(2, np.ones(4, np.float32))])  # a late push learns why
    assert "aborted by worker 2: gave up" in rec.failures[2] and agg.keys[("t", 0)].round == 0


@pytest.mark.parametrize("count", [1024, 125_000], ids=["4KiB", "a-1Gbit-piece"])
async def test_a_small_push_is_summed_and_answered_at_once_without_a_task(count):
    """submit() does what needs no wait in the call itself: no task per push (issue 13's parity), for pieces
    up to 4 ms of a 1 Gbit/s link (500 kB) too, even with summation threads (the hop costs more than the sum)."""
    with ThreadPoolExecutor(1) as pool:
        agg, rec = Aggregator(2, pool), Recorder()
        xs = [np.full(count, w + 1, np.float32) for w in range(2)]
        assert agg.submit(*_push(0, xs[0]), rec.reply, rec.fail) is None and rec.results == {}
        assert agg.submit(*_push(1, xs[1]), rec.reply, rec.fail) is None
    assert sorted(rec.results) == [0, 1] and all((out == 3.0).all() for out in rec.results.values())


async def test_a_large_push_is_left_to_a_task_that_sums_it_in_the_pool():
    with ThreadPoolExecutor(1) as pool:
        agg, rec = Aggregator(2, executor=pool), Recorder()
        n = LARGE // 2  # a pair's sum reads 4 x INLINE_SUM_MAX_BYTES
        for w in range(2):
            later = agg.submit(*_push(w, np.full(n, w + 1.0, np.float32)), rec.reply, rec.fail)
            assert later is not None and rec.results == {}
            await later
        assert sorted(rec.results) == [0, 1] and all((out == 3.0).all() for out in rec.results.values())


async def test_a_lane_generation_that_ends_before_its_addition_starts_leaves_no_accumulator():
    """An addition left to a task (a large push) that starts after its key's lane generation ended: the table
    forgot the key (RoundTable.fail_ended), and the driver keeps no accumulator for it, which nothing would ever
    drop (one a reset, for as long as the job runs)."""
    agg, rec = Aggregator(2, _HeldPool()), Recorder()
    later = agg.submit(*_push(0, np.full(LARGE, 1.0, np.float32), name="old"), rec.reply, rec.fail)
    assert later is not None  # large: its addition is left to a task
    agg.fail_ended(lambda name: name == "old", Why("lanes ended"))
    assert agg.keys == {} and rec.failures == {0: "lanes ended"}
    await later
    assert agg._sums == {} and rec.results == {}


async def test_many_failed_rounds_are_a_few_lines_and_a_count(caplog):
    """One line per failed round: a mismatch of a tensor of many partitions (25 lines in a review), or a worker
    gone with thousands of names in flight, flooded the log. A few lines, then the count of the rest."""
    import logging

    from bps_runtime.loglimit import FAILURE_LINES_BURST

    caplog.set_level(logging.WARNING, "bps.server.aggregator")
    agg, rec = Aggregator(2), Recorder()
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32), part=p) for p in range(500)])
    for p in range(500):
        agg.abort("t", p, 0, worker=1, why=Why("local mismatch"))
    assert len(rec.failures) == 1 and "aborted by worker 1" in rec.failures[0]
    lines = [r.getMessage() for r in caplog.records if "aborted by worker 1" in r.getMessage()]
    assert len(lines) == FAILURE_LINES_BURST, len(lines)
    agg.failures_log._window_start = float("-inf")  # (the limit's interval has passed)
    agg.flush_logs()
    assert caplog.records[-1].getMessage() == f"{500 - FAILURE_LINES_BURST} more lines about failed rounds left out"


async def test_thousands_of_stalled_rounds_are_a_few_lines_and_a_count():
    from bps_runtime.stalls import STALL_LINES, Notices, capped

    agg, rec = Aggregator(2, lost_grace_s=0.01), Recorder()
    await _feed(agg, rec, [_push(0, np.ones(2, np.float32), name=f"late.{i}") for i in range(300)])
    await asyncio.sleep(0.05)
    assert agg.sweep(time.monotonic()) == 0  # (worker 1 is connected: a stall fails nothing)
    stalls = agg.stall_warnings(time.monotonic())
    assert len(stalls) == 300 and all(s.told == (0, 1) for s in stalls)  # told to both
    assert stalls[0].text.startswith("stall: round 0 of 'late.") and "for worker 1, whose processes" in stalls[0].text
    lines = capped(stalls, "rounds have waited as long")
    assert len(lines) == STALL_LINES + 1 and lines[-1] == f"stall: {300 - STALL_LINES} more rounds have waited " \
                                                          "as long (not listed)", lines
    notices = Notices()
    notices.say(stalls, "rounds have waited as long", logging.getLogger("test"))
    told = notices.take([0, 1, 2])
    assert list(told) == [0, 1] and len(told[1]) == STALL_LINES + 1, told  # (worker 2: not in these rounds)
    assert told[1][-1] == f"stall: {300 - STALL_LINES} more stall lines (not listed)"


async def test_the_value_stores_sweep_is_not_armed_again_after_stop():
    """The sweep is armed while keys exist; a server that stops still reads for a while (its tasks drain):
    a push then must not arm it again, or it swept for ever in a loop that outlives the server (a review's
    case)."""
    from bps_server.async_values import AsyncValues
    from protocol.messages import KIND_ASYNC_INIT

    values = AsyncValues(1, 8.0, lambda rank: 0)
    values.restored(0)
    init = Push(req=1, name="v", part=0, round=0, worker=0, dtype="float32", shape=[2], offset=0, count=2,
                kind=KIND_ASYNC_INIT, root=0, holds_root=True)
    answered = []

    class Replier:
        def reply(self, push: Push, out: np.ndarray, applied: list[int] | None = None) -> None:
            answered.append(out.tolist())

        def fail(self, push: Push, why: Why) -> None:
            raise AssertionError(why.text)

    rec = Replier()
    values.push(init, np.ones(2, np.float32), rec, None)
    assert answered == [[1.0, 1.0]] and values._sweeper is not None  # a key exists: swept every quarter timeout
    values.stop()
    assert values._sweeper is None
    values.push(init, np.ones(2, np.float32), rec, None)  # read while the server drains
    values.connected(0, "e")
    assert values._sweeper is None
