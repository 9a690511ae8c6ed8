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
    holds.hold(p0, 7, "A")
    holds.hold(p1, 3, "A")
    holds.release(p0, [7, 99])  # (a request it holds nothing for is skipped)
    assert holds.held("A")  # p1 has yet to take it
    holds.drop(p1)
    assert not holds.held("A") and len(holds) == 0
    holds.hold(p0, 8, "B")
    clock.now += 4.9
    assert holds.held("B")
    clock.now += 0.2
    assert not holds.held("B")  # the bound: a process that never reads pins nothing past the timeout
    holds.hold(p0, 9, "B")  # the name's next result replaces its last one: one entry per process and name
    assert holds.held("B") and len(holds) == 1
    holds.release(p0, [8])  # the older Done's Taken, late: the newer result stays held
    assert holds.held("B")


@pytest.mark.timeout(10)
def test_a_held_result_is_not_freed_for_room_and_is_once_its_hold_runs_out():
    clock = Clock()
    holds = ResultHolds(5.0, clock)
    arena = shm.Arena(worker_id=990, cap_bytes=2 * MB)
    try:
        (a, _), (b, _) = arena.alloc("A", MB, busy=holds.held), arena.alloc("B", MB, busy=holds.held)
        holds.hold("p0", 1, "A")  # answered, not mapped yet; B's taken
        slot, freed = arena.alloc("C", MB, busy=holds.held)
        assert freed == [b.segment] and a.segment in arena.segments  # B went, though A was less recently used
        holds.hold("p0", 2, "C")
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
        holds.hold("p0", 1, "A")
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, holds.release, "p0", [1])
        started = time.monotonic()
        assert await holds.ended(time.monotonic() + 30)
        assert time.monotonic() - started < 5  # woken by the Taken, not by the hold's end
        holds.hold("p0", 2, "A")
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
