"""The capped arena (bps_runtime.segments.Arena, cluster.arena_bytes) and the client's side of it
(bps_worker.client.slots.SlotMap): least recently used idle tensors go first, busy ones never, a tensor
that cannot fit is an ArenaFullError naming it and the cap; and check_size sees a shrunk or replaced segment."""

from __future__ import annotations

import os

import pytest

from bps_runtime import segments
from bps_runtime.segments import Arena, ArenaFullError, SegmentSizeError
from bps_worker.client.slots import SlotMap

BIG = 256 << 10  # above the slab item size: a segment of its own


@pytest.fixture
def arena():
    a = Arena(902, cap_bytes=3 * BIG)
    yield a
    a.release_all()


def test_the_least_recently_used_idle_tensor_is_freed_for_room(arena: Arena):
    for name in "abc":
        arena.alloc(name, BIG)
    arena.touch("a")  # b is now the least recently used
    slot_b = arena.slots["b"]
    _, freed = arena.alloc("d", BIG)
    assert freed == [slot_b.segment] and set(arena.slots) == {"a", "c", "d"}
    assert not os.path.exists(os.path.join(segments.SHM_DIR, slot_b.segment))
    assert arena.held_bytes == 3 * BIG


def test_busy_tensors_are_never_freed_and_the_error_names_the_cap(arena: Arena):
    for name in "abc":
        arena.alloc(name, BIG)
    _, freed = arena.alloc("d", BIG, busy=lambda t: t != "c")  # only c is idle
    assert len(freed) == 1 and "c" not in arena.slots
    with pytest.raises(ArenaFullError) as info:
        arena.alloc("e", BIG, busy=lambda t: True)
    assert info.value.tensor == "e" and info.value.cap == 3 * BIG and info.value.held == 3 * BIG
    assert set(arena.slots) == {"a", "b", "d"}  # nothing freed in vain
    with pytest.raises(ArenaFullError, match=r"'huge' needs 786433 bytes .* may hold 786432 bytes"):
        arena.alloc("huge", 3 * BIG + 1)


def test_a_slab_goes_with_its_last_slot():
    arena = Arena(903, cap_bytes=segments.SLAB_BYTES)
    try:
        slot_a, _ = arena.alloc("a", 100)
        arena.alloc("b", 100)
        assert arena.drop("a") == []  # b still lives in the slab
        assert arena.drop("b") == [slot_a.segment] and arena.held_bytes == 0
        arena.alloc("c", 100)  # a new slab
        assert arena.held_bytes == arena.slab_bytes == segments.slab_bytes(segments.SLAB_BYTES)
    finally:
        arena.release_all()


def test_a_slab_whose_slots_were_outgrown_or_abandoned_goes_too():
    """A slab slot outgrown or abandoned is never reused; the slab went only with a slot dropped, so a slab
    left with none that way stayed (a name growing a little every round took the whole cap, idle)."""
    arena = Arena(904, cap_bytes=3 * segments.SLAB_BYTES)
    try:
        size = 64
        for _ in range(2000):  # one small name that grows every round
            arena.alloc("grow", size)
            size = size + 64 if size + 64 <= (60 << 10) else 64
        assert arena.held_bytes <= 2 * segments.SLAB_BYTES
        first, _ = arena.alloc("x", 100)
        while arena.slots["x"].segment == arena._slab:  # x's slab is no longer the one carved from
            arena.alloc("filler", 2 * (60 << 10))
            arena.drop("filler")
            arena.alloc("x", arena.slots["x"].capacity + 64)
        old = arena.slots["x"].segment
        if any(s.segment == old for n, s in arena.slots.items() if n != "x"):
            pytest.skip("another slot shares x's slab")
        assert arena.abandon("x") == old and old not in arena.segments
    finally:
        arena.release_all()


def test_under_the_smallest_cap_small_tensors_in_flight_leave_room_and_the_error_counts_them():
    """Under the 4 MiB minimum a slab is 256 KiB: tensors in flight in one slab leave fifteen for the rest (one
    slab of 4 MiB left none). Where there is no room, the error says how many tensors in flight hold the
    segments and how many bytes of their own: small tensors share segments. A fused tensor's says its names."""
    arena = Arena(906, cap_bytes=4 << 20)
    try:
        for i in range(200):  # 200 KiB of small tensors in flight
            arena.alloc(f"t{i}", 1024)
        arena.alloc("fused", 90 << 10, busy=lambda t: True)  # a segment of its own beside their slab
        with pytest.raises(ArenaFullError) as info:
            arena.alloc("huge", (4 << 20) - (128 << 10), busy=lambda t: t != "fused")
        error = info.value
        assert error.in_flight == (200, 200 * 1024) and error.held == 256 << 10
        assert "(262144 bytes of its segments are held by 200 slots in use, 204800 bytes of them: small ones share " \
               "segments)" in error.strerror and error.strerror.startswith("tensor 'huge' needs")
        about = error.about("the fused tensor of 'a', 'b' (2 small tensors summed as one)")
        assert about.strerror.startswith("the fused tensor of 'a', 'b' (2 small tensors summed as one) needs 4063232 "
                                     "bytes") and (about.tensor, about.held, about.in_flight) == ("huge", error.held,
                                                                                                  error.in_flight)
    finally:
        arena.release_all()


def test_the_slab_carved_from_is_given_up_for_room_once_nothing_lives_in_it():
    """A name grown out of its slab (or abandoned) leaves the slab we carve from empty: it went only with a slot
    dropped, so a sixteenth of the smallest cap stayed held by nothing, and a tensor that fits beside everything
    alive failed as 'held by tensors in flight' (a review's case). It is given up when the room is needed, and
    said freed; the error counts only the slots in use, and their bytes."""
    arena = Arena(907, cap_bytes=4 << 20)
    try:
        arena.alloc("g", 1024)
        slab = arena.slots["g"].segment
        arena.alloc("g", 100 << 10)  # a segment of its own now
        assert slab in arena.segments
        _, freed = arena.alloc("big", (4 << 20) - (100 << 10), busy=lambda t: t == "g")
        assert freed == [slab] and arena.held_bytes == 4 << 20
        arena.drop("big")
        for i in range(100):
            arena.alloc(f"t{i}", 4)
        with pytest.raises(ArenaFullError) as info:
            arena.alloc("huge", (4 << 20) - (64 << 10), busy=lambda t: t in ("t0", "g"))
        assert info.value.in_flight == (2, 64 + (100 << 10))
    finally:
        arena.release_all()


def test_segments_freed_by_an_alloc_that_fails_are_reported_by_the_next():
    arena = Arena(905, cap_bytes=2 * BIG)
    try:
        arena.alloc("a", BIG)
        old = arena.slots["a"].segment
        arena.alloc("b", BIG)
        with pytest.raises(ArenaFullError):  # a outgrows its segment (unlinked), and there is no room for it
            arena.alloc("a", 2 * BIG, busy=lambda t: True)
        assert old not in arena.segments
        _, freed = arena.alloc("c", BIG)
        assert old in freed  # the server that maps it hears of it now
    finally:
        arena.release_all()


def test_check_size_sees_a_truncated_or_replaced_segment():
    seg = segments.create_segment(segments.segment_name(904), 8192)
    path = os.path.join(segments.SHM_DIR, seg.name)
    try:
        segments.check_size(seg, 8192)
        os.truncate(path, 100)
        with pytest.raises(SegmentSizeError) as info:
            segments.check_size(seg, 8192, "t")
        assert (info.value.size, info.value.needed, info.value.segment) == (100, 8192, seg.name)
        assert f"{seg.name!r} of tensor 't' has 100 bytes now; 8192 bytes are needed" in str(info.value)
        os.unlink(path)
        with open(path, "wb") as f:  # another file under the same name: not the one mapped
            f.write(b"\0" * 8192)
        with pytest.raises(SegmentSizeError, match="was removed or replaced; 8192 bytes are needed "
                                                   r"\(removed from /dev/shm by something other than its worker"):
            segments.check_size(seg, 8192)
    finally:
        segments.release(seg, unlink=True)


def test_the_client_gives_up_its_least_recently_used_idle_slots_under_the_cap():
    arena = Arena(905, cap_bytes=3 * BIG)
    asked: list[tuple[str, list[str]]] = []

    def allocate(name: str, nbytes: int, free) -> tuple[str, int, int]:
        asked.append((name, list(free)))
        for tensor in free:
            arena.drop(tensor)
        slot, _ = arena.alloc(name, nbytes, busy=lambda t: True)  # as the daemon: only the client frees
        return slot.segment, slot.offset, slot.capacity

    busy = {"a"}
    slots = SlotMap(allocate, cap_bytes=3 * BIG, busy=busy.__contains__)
    try:
        for name in "abc":
            slots.slot_for(name, BIG)
        slots.slot_for("b", BIG)  # used again: c is now the least recently used idle one
        slots.slot_for("d", BIG)
        assert asked[-1] == ("d", ["c"]) and set(slots.slots) == {"a", "b", "d"}
        assert len(slots.attached) == 3
        busy.update("bd")
        with pytest.raises(Exception, match="may hold"):  # nothing idle: the daemon refuses, nothing given up
            slots.slot_for("e", BIG)
        assert asked[-1] == ("e", []) and set(slots.slots) == {"a", "b", "d"}
    finally:
        slots.close()
        arena.release_all()


def test_a_segment_goes_exactly_when_its_last_slot_does_whatever_the_order():
    """Whether a segment still holds a slot is a count per segment (a process freeing a thousand names in one
    Alloc made it a walk over every slot for each, seconds of the daemon's loop): random allocations, growths,
    drops and abandons, checked against a walk after each step."""
    import random

    rng = random.Random(7)
    arena = Arena(904)
    try:
        for _ in range(600):
            name = f"t{rng.randrange(40)}"
            action = rng.random()
            if action < 0.5:
                arena.alloc(name, rng.choice([100, 5000, BIG, 2 * BIG]))
            elif action < 0.8:
                arena.drop(name)
            else:
                arena.abandon(name)
            living = {slot.segment for slot in arena.slots.values()}
            assert arena._living == {seg: sum(s.segment == seg for s in arena.slots.values()) for seg in living}
            assert living <= set(arena.segments)
            assert set(arena.segments) - living <= {arena._slab}  # only the slab carved from may be empty
            for seg in set(arena.segments) - living:
                assert os.path.exists(os.path.join(segments.SHM_DIR, seg))
    finally:
        arena.release_all()
    assert arena._living == {} and arena.segments == {}
