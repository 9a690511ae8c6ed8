"""The client carves its small tensors from slabs of its own (bps_worker.client.slots): one Alloc per slab, not
one round trip per tensor; each slab is one slot of the daemon's arena under a name of the client's
(SLAB_PREFIX), given up by that name, in the next Alloc once no slot lives in it."""

from __future__ import annotations

import numpy as np
import pytest

from bps_runtime import segments
from bps_runtime.segments import Arena
from bps_worker.client.arguments import SLAB_PREFIX, check_name
from bps_worker.client.slots import FREE_MAX_NAMES, SlotMap
from bps_worker.errors import BPSError

BIG = 256 << 10  # above the slab item size: a segment of its own
# The slabs under the small caps of the tests below (segments.slab_bytes): the smallest.
SLAB = segments.MIN_SLAB_BYTES


class Daemon:
    """The daemon's side of Alloc, on a real arena (so the client can map what it is given)."""

    def __init__(self, cap_bytes: int | None = None) -> None:
        self.arena = Arena(911, cap_bytes=cap_bytes)
        self.asked: list[tuple[str, int, list[str]]] = []

    def allocate(self, name: str, nbytes: int, free) -> tuple[str, int, int]:
        self.asked.append((name, nbytes, list(free)))
        for tensor in free:
            self.arena.drop(tensor)
        slot, _ = self.arena.alloc(name, nbytes, busy=lambda t: True)  # as the daemon: only the client frees
        return slot.segment, slot.offset, slot.capacity


@pytest.fixture
def daemon():
    d = Daemon()
    yield d
    d.arena.release_all()


def _spans(slots: SlotMap, names) -> list[tuple[str, int, int]]:
    return sorted((slots.slots[n].segment_name, slots.slots[n].offset, slots.slots[n].capacity) for n in names)


def test_slabs_are_smaller_under_a_small_cap_on_both_sides():
    """Under a cap of fewer than 16 slabs of 4 MiB the slabs are a sixteenth of it (at least 256 KiB), in the
    daemon's arenas and the slabs a process asks for alike: a busy slab holds less of the cap (under the 4 MiB
    minimum, one busy slab of 4 MiB left no room: 200 tensors of 1 KiB in flight failed)."""
    assert segments.slab_bytes(None) == segments.slab_bytes(0) == segments.SLAB_BYTES
    assert segments.slab_bytes(64 << 20) == segments.slab_bytes(1 << 40) == segments.SLAB_BYTES
    assert segments.slab_bytes(8 << 20) == 512 << 10 and segments.slab_bytes(4 << 20) == 256 << 10 == SLAB
    assert segments.slab_bytes(1 << 20) == SLAB and segments.slab_bytes((32 << 20) + 100) % segments.SLOT_ALIGN == 0
    daemon = Daemon(cap_bytes=4 << 20)
    busy: set[str] = set()
    slots = SlotMap(daemon.allocate, cap_bytes=4 << 20, busy=busy.__contains__)
    try:
        for i in range(16 * (SLAB // 1024)):  # sixteen slabs, each with a tensor in flight
            slots.slot_for(f"t{i}", 1024)
            busy.add(f"t{i}")
        assert [a[1] for a in daemon.asked] == [SLAB] * 16 and daemon.arena.held_bytes == 4 << 20
        with pytest.raises(Exception, match=r"slab/16' needs 262144 bytes.*4194304 bytes of its segments are held "
                                            r"by 16 slots in use"):  # (the slabs: the daemon's tensors)
            slots.slot_for("more", 1024)
    finally:
        slots.close()
        daemon.arena.release_all()


def test_thousands_of_small_tensors_take_one_alloc_and_never_overlap(daemon: Daemon):
    slots = SlotMap(daemon.allocate)
    try:
        names = [f"t{i}" for i in range(3000)]
        for i, name in enumerate(names):
            slot = slots.slot_for(name, 1 + (i * 37) % 1000)
            assert slot.capacity >= 1 + (i * 37) % 1000 and slot.offset % segments.SLOT_ALIGN == 0
        assert daemon.asked == [(f"{SLAB_PREFIX}0", segments.SLAB_BYTES, [])]
        spans = _spans(slots, names)
        assert all(a[1] + a[2] <= b[1] for a, b in zip(spans, spans[1:]))  # disjoint
        assert spans[-1][1] + spans[-1][2] <= segments.SLAB_BYTES
        for name in names[:50]:  # the same slot again, no Alloc
            assert slots.slot_for(name, 1) is slots.slots[name]
        slots.slot_for("big", BIG)  # a large tensor: its own slot, asked by its name
        assert daemon.asked[-1] == ("big", BIG, []) and len(daemon.asked) == 2
        view = slots.slots["t1"].view(np.dtype("float32"), (9,))
        view[...] = 7.0  # the memory is the daemon's slab, mapped here
        seg = daemon.arena.segments[slots.slots["t1"].segment_name]
        assert bytes(seg.buf[slots.slots["t1"].offset:slots.slots["t1"].offset + 4]) == bytes(view[:1])
    finally:
        slots.close()


def test_a_full_slab_makes_the_next_one(daemon: Daemon):
    slots = SlotMap(daemon.allocate)
    try:
        per_slab = segments.SLAB_BYTES // segments.SLAB_ITEM_MAX_BYTES
        for i in range(per_slab + 1):
            slots.slot_for(f"t{i}", segments.SLAB_ITEM_MAX_BYTES)
        assert [a[0] for a in daemon.asked] == [f"{SLAB_PREFIX}0", f"{SLAB_PREFIX}1"]
        assert len({slots.slots[f"t{i}"].segment_name for i in range(per_slab + 1)}) == 2
    finally:
        slots.close()


def test_under_the_cap_a_slab_is_given_up_by_its_name_whatever_its_tensors():
    """More tensors in the slab than one Alloc may name (FREE_MAX_NAMES): the slab is one name."""
    daemon = Daemon(cap_bytes=2 * SLAB)
    busy: set[str] = set()
    slots = SlotMap(daemon.allocate, cap_bytes=2 * SLAB, busy=busy.__contains__)
    try:
        first = [f"a{i}" for i in range(FREE_MAX_NAMES + 50)]
        for name in first:
            slots.slot_for(name, 256)
        per_slab = SLAB // 256
        second = [f"b{i}" for i in range(per_slab - len(first) + per_slab)]  # fills slab 0, then all of slab 1
        for name in second:
            slots.slot_for(name, 256)
        assert [a[0] for a in daemon.asked] == [f"{SLAB_PREFIX}0", f"{SLAB_PREFIX}1"]
        busy.update(second)  # slab 1's tensors, and slab 0's later ones, are in flight: slab 0 is not idle
        with pytest.raises(Exception, match="may hold"):
            slots.slot_for("c", 256)
        assert daemon.asked[-1] == (f"{SLAB_PREFIX}2", SLAB, [])  # nothing idle: nothing given up
        busy.clear()
        busy.update(second[-per_slab:])  # only slab 1's: slab 0 is idle, the least recently used
        slots.slot_for("c", 256)
        assert daemon.asked[-1] == (f"{SLAB_PREFIX}3", SLAB, [f"{SLAB_PREFIX}0"])
        assert not set(first) & set(slots.slots) and "c" in slots.slots
        assert len(slots.attached) == 2 and daemon.arena.held_bytes == 2 * SLAB
    finally:
        slots.close()
        daemon.arena.release_all()


def test_a_slab_no_slot_lives_in_is_given_up_at_the_next_alloc(daemon: Daemon):
    slots = SlotMap(daemon.allocate)
    try:
        slots.slot_for("s", 100)
        slab = slots.slots["s"].segment_name
        slots.slot_for("s", BIG)  # it grew out of the slab: the slab's last slot is gone
        assert slab not in slots.attached
        assert daemon.asked[-1] == ("s", BIG, [])
        slots.slot_for("t", 100)  # a new slab (the old one is no longer ours), the old one given up with it
        assert daemon.asked[-1] == (f"{SLAB_PREFIX}1", segments.SLAB_BYTES, [f"{SLAB_PREFIX}0"])
        assert slab not in daemon.arena.segments
    finally:
        slots.close()


def test_a_slab_that_cannot_be_mapped_is_given_up_at_the_next_alloc(daemon: Daemon, monkeypatch):
    slots = SlotMap(daemon.allocate)
    real = segments.attach_segment

    def refused(name: str, *args):
        raise OSError(24, "Too many open files")

    try:
        monkeypatch.setattr(segments, "attach_segment", refused)
        with pytest.raises(BPSError, match="cannot attach"):
            slots.slot_for("a", 64)
        monkeypatch.setattr(segments, "attach_segment", real)
        slots.slot_for("b", 64)
        assert daemon.asked == [(f"{SLAB_PREFIX}0", segments.SLAB_BYTES, []),
                                (f"{SLAB_PREFIX}1", segments.SLAB_BYTES, [f"{SLAB_PREFIX}0"])]
    finally:
        slots.close()


def test_a_user_cannot_name_a_tensor_as_a_slab():
    with pytest.raises(BPSError, match="client's own"):
        check_name(f"{SLAB_PREFIX}0")
    with pytest.raises(BPSError, match="client's own"):
        check_name(f"{SLAB_PREFIX}0", internal=True)


@pytest.mark.parametrize("slab_busy", [False, True])
def test_under_the_cap_a_carved_slot_that_moves_leaves_its_slab_counted_in_full(slab_busy: bool):
    """A small tensor that grows out of its slab (a slot of its own now): the daemon does not free a carved slot
    (the slab is one slot there, ours to give up), so while another tensor lives in the slab, the client counts
    the whole slab as held, and the next allocation that does not fit gives up the least recently used idle
    segment: the slab by its name, or, with the slab's tensor in flight, the moved tensor's own."""
    cap = SLAB + BIG
    daemon = Daemon(cap_bytes=cap)
    busy: set[str] = set()
    slots = SlotMap(daemon.allocate, cap_bytes=cap, busy=busy.__contains__)
    try:
        slots.slot_for("u", 100)
        slots.slot_for("s", 100)
        slab = slots.slots["s"].segment_name
        slots.slot_for("s", BIG)  # moves out; u still lives in the slab, which stays ours and mapped
        assert daemon.asked[-1] == ("s", BIG, []) and slab in slots.attached and slab in daemon.arena.segments
        assert daemon.arena.held_bytes == cap  # the slab in full, and s's own segment
        if slab_busy:
            busy.add("u")
        slots.slot_for("t", BIG)  # does not fit beside both: one idle segment goes in the same Alloc
        if slab_busy:
            assert daemon.asked[-1] == ("t", BIG, ["s"])
            assert "s" not in slots.slots and "u" in slots.slots and slab in slots.attached
        else:
            assert daemon.asked[-1] == ("t", BIG, [f"{SLAB_PREFIX}0"])  # the least recently used: u's slab
            assert "u" not in slots.slots and "s" in slots.slots and slab not in slots.attached
            assert slab not in daemon.arena.segments
        assert daemon.arena.held_bytes <= cap
    finally:
        slots.close()
        daemon.arena.release_all()


@pytest.mark.parametrize("reserved", [False, True])
def test_under_a_cap_too_small_for_both_a_slot_that_moves_out_of_its_slab_gives_the_slab_up_in_the_same_alloc(
        reserved: bool):
    """The moving tensor is its slab's only tenant and the cap cannot hold the slab and the new slot: the daemon
    would keep the slab (it frees no carved slot), so the client gives the slab up by its name in the Alloc that
    asks for the new slot, and the daemon has room. Also when the tensor is in flight (``reserved``: a push
    marks its name before it asks for the slot): its old slot is the one being replaced, nothing reads it."""
    cap = SLAB + BIG - segments.SLOT_ALIGN
    daemon = Daemon(cap_bytes=cap)
    busy = {"s"} if reserved else set()
    slots = SlotMap(daemon.allocate, cap_bytes=cap, busy=busy.__contains__)
    try:
        slots.slot_for("s", 100)
        slab = slots.slots["s"].segment_name
        slots.slot_for("s", BIG)
        assert daemon.asked[-1] == ("s", BIG, [f"{SLAB_PREFIX}0"])
        assert slab not in slots.attached and slab not in daemon.arena.segments
        assert daemon.arena.held_bytes == BIG and slots.slots["s"].capacity >= BIG
        busy.clear()
        slots.slot_for("t", 100)  # a new slab beside s does not fit either: s goes; the old slab is not named twice
        assert daemon.asked[-1] == (f"{SLAB_PREFIX}1", SLAB, ["s"])
    finally:
        slots.close()
        daemon.arena.release_all()


def test_names_that_never_repeat_keep_a_bounded_table_and_their_slabs_are_given_up(daemon: Daemon, monkeypatch):
    """A job whose names never repeat (``f"loss.{step}"``) kept a slot per name for good: about a kilobyte of the
    process's memory each (a review: 30,000 names, +35 MB). Past MAX_SMALL_SLOTS the least recently used idle ones
    are forgotten (never one in flight, nor the name being carved), the slabs left empty are given up in the next
    Alloc, and a forgotten name used again gets memory of its own, apart from every live slot."""
    from bps_worker.client import slots as slots_module
    monkeypatch.setattr(slots_module, "MAX_SMALL_SLOTS", 400)
    busy = {"kept.busy"}
    slots = SlotMap(daemon.allocate, busy=busy.__contains__)
    try:
        slots.slot_for("kept.busy", 1024)
        per_slab = segments.SLAB_BYTES // segments.slab_slot_bytes(1024)
        steps = 3 * per_slab + 500  # the last 400 in the fourth slab
        for i in range(steps):
            slots.slot_for(f"step{i}", 1024)
            if i % 100 == 0:
                slots.slot_for("kept.hot", 1024)  # used all along: never the least recently used
            assert len(slots.slots) <= 400 + 1, i  # (the slot in use, "kept.busy", beside the limit)
        assert {"kept.busy", "kept.hot", f"step{steps - 1}"} <= set(slots.slots)
        assert "step0" not in slots.slots
        slabs = [a for a in daemon.asked if a[0].startswith(SLAB_PREFIX)]
        assert len(slabs) == 4, slabs  # each slab asked for once...
        assert len(slots.attached) == 2  # the first ("kept.busy" lives in it) and the last: the emptied unmapped
        slots.slot_for("big", BIG)  # the next Alloc
        given_up = {name for a in daemon.asked for name in a[2]}
        assert given_up == {f"{SLAB_PREFIX}1", f"{SLAB_PREFIX}2"}  # ... and the emptied ones given up
        again = slots.slot_for("step0", 1024)
        spans = _spans(slots, slots.slots)
        assert all(a[0] != b[0] or a[1] + a[2] <= b[1] for a, b in zip(spans, spans[1:]))  # disjoint
        view = again.view(np.dtype(np.float32), (256,))
        view[:] = 5
        assert np.frombuffer(slots.attached[again.segment_name].buf, np.float32, 256, again.offset).sum() == 1280
    finally:
        slots.close()


def test_a_table_of_slots_in_use_is_not_walked_at_every_new_name(daemon: Daemon, monkeypatch):
    """Past MAX_SMALL_SLOTS with most slots in use (a model's live shared arrays): nothing can be forgotten, and the
    first version walked and sorted the whole table at every new name (46 ms each at 65,536, a review of it).
    Now the next walk waits for a quarter of the limit more names; the table stays bounded all the same."""
    from bps_worker.client import slots as slots_module
    monkeypatch.setattr(slots_module, "MAX_SMALL_SLOTS", 100)
    walks = []
    forget = SlotMap._forget_idle
    monkeypatch.setattr(SlotMap, "_forget_idle", lambda self, name: (walks.append(name), forget(self, name)))
    busy = {f"live{i}" for i in range(80)}
    slots = SlotMap(daemon.allocate, busy=busy.__contains__)
    try:
        for name in sorted(busy):
            slots.slot_for(name, 1024)
        for i in range(400):
            slots.slot_for(f"step{i}", 1024)
            assert len(slots.slots) <= 80 + 100 + 25, i
        assert 12 <= len(walks) <= 17, len(walks)
        assert busy <= set(slots.slots) and "step399" in slots.slots
    finally:
        slots.close()
