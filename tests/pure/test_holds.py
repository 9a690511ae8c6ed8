"""The worker's holds on answered results (bps_worker.result_holds) and the results arena under them: a result a
process has yet to map is not freed for room until it has, or until its hold runs out (the bound), and a Taken
frame is a small checked message."""

from __future__ import annotations

import asyncio
import time

import pytest

from bps_runtime import segments as shm
from bps_worker.result_holds import ResultHolds
from protocol.errors import LocalProtocolError
from protocol.frames import FrameReader, encode_message
from protocol.messages import MAX_FUSED_ENTRIES, Taken, parse

MB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.timeout(10)
def test_a_hold_ends_when_taken_when_its_process_leaves_or_when_it_runs_out():
    clock = Clock()
    holds = ResultHolds(5.0, clock)
    p0, p1 = object(), object()
    holds.answered(p0, 7, "A", "s1")
    holds.answered(p1, 3, "A", "s1")
    holds.release(p0, [7, 99])  # (a request that starts no run is skipped)
    assert holds.held("A")  # p1 has yet to take it
    holds.drop(p1)
    assert not holds.held("A") and len(holds) == 0
    holds.answered(p0, 8, "B", "s2")
    clock.now += 4.9
    assert holds.held("B")
    clock.now += 0.2
    assert not holds.held("B")  # the bound: a process that never reads pins nothing past the timeout
    holds.answered(p0, 9, "B", "s3")  # the name's next result replaces its last one: one entry per process and name
    assert holds.held("B") and len(holds) == 1
    holds.release(p0, [8])  # the older Done's Taken, late, for a segment the name has left: it stays held
    assert holds.held("B")


@pytest.mark.timeout(10)
def test_a_run_of_one_segment_is_held_until_its_first_done_is_taken_then_not_at_all():
    """The client maps a name's segment at a run's first Done and keeps it mapped while the run lasts, so it
    says Taken for that one only: the run's later results need no hold, and one that came before the Taken
    (an operation issued before the first Done was read) ends with it."""
    holds = ResultHolds(5.0, Clock())
    p0 = object()
    holds.answered(p0, 1, "A", "s1")
    holds.answered(p0, 2, "A", "s1")  # (not taken yet: held, replacing the first)
    assert holds.held("A")
    holds.release(p0, [1])  # the run's first Done, taken: the process has s1 mapped
    assert not holds.held("A")
    holds.answered(p0, 3, "A", "s1")
    assert not holds.held("A") and len(holds) == 0  # no Taken will come for it, and none is needed
    holds.answered(p0, 4, "A", "s2")  # moved: a new run, held until its first Done is taken
    assert holds.held("A")
    holds.release(p0, [2, 3])  # (no run starts there)
    assert holds.held("A")
    holds.release(p0, [4])
    assert not holds.held("A")
    holds.answered(p0, 5, "A", "s1")  # back in s1: the process may have unmapped it meanwhile, so held again
    assert holds.held("A")


@pytest.mark.timeout(10)
def test_a_held_result_is_not_freed_for_room_and_is_once_its_hold_runs_out():
    clock = Clock()
    holds = ResultHolds(5.0, clock)
    arena = shm.Arena(worker_id=990, cap_bytes=2 * MB)
    try:
        (a, _), (b, _) = arena.alloc("A", MB, busy=holds.held), arena.alloc("B", MB, busy=holds.held)
        holds.answered("p0", 1, "A", "sa")  # answered, not mapped yet; B's taken
        slot, freed = arena.alloc("C", MB, busy=holds.held)
        assert freed == [b.segment] and a.segment in arena.segments  # B went, though A was less recently used
        holds.answered("p0", 2, "C", "sc")
        with pytest.raises(shm.ArenaFullError, match="arena_bytes"):
            arena.alloc("D", MB, busy=holds.held)
        clock.now += 5.0
        slot, freed = arena.alloc("D", MB, busy=holds.held)  # held no more: A goes (the least recently used)
        assert freed == [a.segment]
    finally:
        arena.release_all()


@pytest.mark.timeout(10)
def test_waiting_for_room_ends_when_a_hold_ends_and_not_at_all_without_holds():
    async def scenario() -> None:
        holds = ResultHolds(30.0)
        assert not await holds.ended(time.monotonic() + 30)  # nothing held: waiting would make no room
        holds.answered("p0", 1, "A", "sa")
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, holds.release, "p0", [1])
        started = time.monotonic()
        assert await holds.ended(time.monotonic() + 30)
        assert time.monotonic() - started < 5  # woken by the Taken, not by the hold's end
        holds.answered("p0", 2, "A", "sb")
        started = time.monotonic()
        assert await holds.ended(time.monotonic() + 0.05)  # at most until the caller's deadline
        assert time.monotonic() - started < 5
        assert not await holds.ended(time.monotonic() - 1)

    asyncio.run(scenario())


@pytest.mark.timeout(10)
def test_a_taken_frame_round_trips_and_is_bounded():
    frames = FrameReader(max_payload_bytes=0).receive_data(encode_message(Taken([3, 5])))
    assert parse(frames[0].header) == Taken([3, 5])
    for reqs in ([], [-1], list(range(MAX_FUSED_ENTRIES + 1))):
        with pytest.raises(LocalProtocolError):
            Taken(reqs)
