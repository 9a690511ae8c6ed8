"""The worker daemon's shared memory as this process maps it: one slot per tensor name, and result segments.

The daemon creates every segment; this process only attaches (maps) them. A name's *slot* is where its input
is handed over, reused while the size fits. A large tensor's (over ``SLAB_ITEM_MAX_BYTES``) is asked of the
daemon once per name (``Alloc``). Small ones are carved here from *slabs*: segments of ``SLAB_BYTES`` (less under
a small cap, as the daemon's own arenas: ``segments.slab_bytes``) asked of the daemon under names of our own
(``SLAB_PREFIX``), one slot each on its side. A model's first step with
thousands of small tensors then makes one ``Alloc`` per slab, not one round trip per tensor (5,000 of them
took 10 s on the one-box cluster); the daemon checks each op's memory against the segments it made for us,
whatever our tables say, and frees no slab an op in flight reads. A slab no slot lives in any more is given
up in the next ``Alloc`` (``free``). A plain array's *result* may
instead lie in the worker's results segment (named in ``Done``); the last one per name stays mapped, because
the worker unlinks a segment it moved away from, and our mapping is then all that keeps it.

Bounded: the daemon lets a process hold at most ``cap_bytes`` of slots (``Welcome.arena_bytes``, the cluster's
``arena_bytes``). Before asking for a slot that would take us over it, we give up the least recently used
slots of names not in flight (``busy``), whole segments at a time, in the same ``Alloc`` (``free``); the
daemon frees them, and refuses (a BPSError naming the tensor and the cap) what still does not fit. Only this
process chooses, because only it knows which slot a thread is about to fill. The table is bounded in names too:
past ``MAX_SMALL_SLOTS`` names with slots carved from slabs, the least recently used idle ones are forgotten
(a job whose names never repeat), and the slabs left without a slot are given up. Result segments the daemon
freed (its results arena is capped too) are unmapped here once noticed: every time the mappings doubled,
one ``stat`` per result segment tells which names are gone.

A segment is unmapped once no slot and no last result lives in it. One lock guards the tables, so operations
on different names may run on different threads; a slot that is there and fits is found without it (a name's
slot changes only in ``slot_for`` of that name, which one thread at a time runs for a name in flight, and is
given up only while its name is idle).

A :class:`Slot` keeps the array view of itself that was last asked for (:meth:`Slot.view`): a name pushed
every step with the same dtype and shape reuses it, instead of a ``numpy.frombuffer`` per operation. A slot
that moves is a new :class:`Slot`, so no view outlives the memory it was made for.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import Counter
from multiprocessing.shared_memory import SharedMemory
from typing import Callable, Final, Sequence

import numpy as np

from bps_runtime import segments as shm
from bps_runtime.locks import OwnedLock

from ..errors import BPSError
from .arguments import SLAB_PREFIX
from .arrays import view_of

__all__ = ["Allocate", "Slot", "SlotMap"]

# Asks the daemon for ``nbytes`` for tensor ``name``, giving up the slots of the names in the sequence first:
# (segment name, offset, capacity).
Allocate = Callable[[str, int, Sequence[str]], tuple[str, int, int]]

# The most names with a slot carved from a slab that this process keeps: past it, the least recently used idle ones
# are forgotten, down to three quarters of it (a job whose names never repeat, ``f"loss.{step}"``, kept about a
# kilobyte of this process's memory per name for good, a review; a slab's slot costs the daemon nothing).
MAX_SMALL_SLOTS: Final = 1 << 16

# The most names one Alloc frees, and their characters together: the Alloc stays a small frame.
FREE_MAX_NAMES: Final = 256
FREE_MAX_CHARS: Final = 8 * 1024


def _never(name: str) -> bool:
    return False


class Slot:
    """Where one tensor name is handed over: ``capacity`` bytes at ``offset`` in ``segment`` (its name as the
    daemon knows it: ``segment_name``)."""

    __slots__ = ("segment", "segment_name", "offset", "capacity", "used", "_view")

    def __init__(self, segment: SharedMemory, offset: int, capacity: int, used: int, segment_name: str = "") -> None:
        self.segment = segment
        # (SharedMemory.name is a property that builds a new string each time: the table's own, where given)
        self.segment_name = segment_name or segment.name
        self.offset = offset
        self.capacity = capacity
        self.used = used  # when it was last asked for (SlotMap's clock): the least recently used go first
        self._view: np.ndarray | None = None  # the last view asked for (see view)

    def view(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The slot as an array of ``dtype`` and ``shape`` (which must fit its capacity). The same array again
        for the same dtype and shape: the client's own, never handed to the user as it is (they may reshape
        it in place)."""
        view = self._view
        if view is None or view.shape != shape or view.dtype != dtype:
            view = self._view = view_of(self.segment.buf, dtype, shape, self.offset)
        return view


class SlotMap:
    """Segments mapped in this process, each name's slot, and each name's last result segment."""

    __slots__ = ("_allocate", "_allocating", "_lock", "_busy", "_clock", "_slab", "_slab_ids", "_slabs", "_dead",
                 "_swept_at", "_living", "_forget_at", "attached", "cap_bytes", "results", "slab_bytes", "slots")

    def __init__(self, allocate: Allocate, cap_bytes: int = 0, busy: Callable[[str], bool] = _never) -> None:
        self._allocate = allocate
        self._lock = OwnedLock()
        self._allocating = threading.Lock()  # one allocation at a time: each sees what the last one holds
        # Whether a name is in flight (or about to be, or its slot handed out to be filled): its slot is never
        # given up, nor its last result unmapped.
        self._busy = busy
        self.cap_bytes = cap_bytes  # 0: no cap (a daemon that sets none)
        self.slab_bytes = shm.slab_bytes(cap_bytes)  # as the daemon's arenas carve under that cap
        self.attached: dict[str, SharedMemory] = {}  # segment name -> our mapping
        self.slots: dict[str, Slot] = {}  # tensor name -> its slot
        self.results: dict[str, str] = {}  # tensor name -> the worker's segment that held its last result
        self._clock = itertools.count()
        self._slab: tuple[str, int, int] | None = None  # the slab we carve small tensors from: segment, used, end
        self._slab_ids = itertools.count()
        self._slabs: dict[str, str] = {}  # segment -> the name of the slab we asked for (SLAB_PREFIX)
        self._dead: list[str] = []  # slabs no slot lives in any more: given up at the next Alloc
        self._swept_at = 1  # how many segments were mapped at the last sweep of freed result segments
        self._living: Counter[str] = Counter()  # segment name -> how many of our slots live in it
        # Past MAX_SMALL_SLOTS, the table's size at which small slots are next forgotten (_forget_idle): a
        # quarter of it above the size the last forgetting left (slots in use, or large ones, are never
        # forgotten: a table full of them is not walked again at every new name, a review).
        self._forget_at = 0

    def slot_for(self, name: str, nbytes: int) -> Slot:
        """The slot where tensor ``name`` is handed over: a large tensor's is asked of the daemon once per name,
        a small one is carved here from a slab asked of the daemon (see the module)."""
        slot = self.slots.get(name)
        if slot is not None and slot.capacity >= nbytes:
            slot.used = next(self._clock)
            if self.slots.get(name) is slot:  # (not forgotten meanwhile by another thread: _forget_idle)
                return slot
        small = nbytes <= shm.SLAB_ITEM_MAX_BYTES
        need = shm.slab_slot_bytes(nbytes)
        with self._allocating:
            if not small or not self._slab_fits(need):
                with self._lock:
                    free = self._give_up(name, nbytes) + self._dead
                    self._dead = []
                asked = f"{SLAB_PREFIX}{next(self._slab_ids)}" if small else name
                try:
                    segment, offset, capacity = self._allocate(asked, self.slab_bytes if small else nbytes, free)
                except BPSError as exc:  # (a lost daemon's BPSConnectionError, or the like, stays as it is)
                    if not small:
                        self._forget_replaced(name)
                    if not small or type(exc) is not BPSError:
                        raise
                    raise BPSError(f"tensor {name!r} of {nbytes} bytes is carved from a slab of {self.slab_bytes} "
                                   f"bytes of shared memory, which cannot be had: {exc}") from None
                if small:
                    self._slabs[segment] = asked
                    self._slab = (segment, offset, offset + capacity)
            with self._lock:
                if small:
                    assert self._slab is not None
                    segment, offset, end = self._slab
                    capacity = need
                    self._slab = (segment, offset + need, end)
                new = Slot(self._attach_new(segment, name), offset, capacity, next(self._clock), segment)
                slot = self.slots.get(name)
                self.slots[name] = new
                self._living[segment] += 1
                if slot is not None:
                    self._unliving(slot.segment_name)
                    self._release_unused(slot.segment_name)  # the tensor moved: its old segment may be unused
                elif small and len(self.slots) > max(self._forget_at, MAX_SMALL_SLOTS):
                    self._forget_idle(name)
                    self._forget_at = len(self.slots) + MAX_SMALL_SLOTS // 4
        return new

    def _forget_idle(self, name: str) -> None:
        """Forget the least recently used idle slots carved from slabs, but ``name``'s, down to three quarters of
        MAX_SMALL_SLOTS of them (a name forgotten is carved a new slot at its next push, as a new name is); the
        slabs no slot lives in any more are given up at the next Alloc."""
        small = [(slot.used, tensor) for tensor, slot in self.slots.items()
                 if slot.segment_name in self._slabs and tensor != name and not self._busy(tensor)]
        excess = len(small) + 1 - MAX_SMALL_SLOTS * 3 // 4
        if excess <= 0:
            return
        small.sort()
        segments = set()
        for used, tensor in small[:excess]:
            slot = self.slots[tensor]
            if slot.used != used or self._busy(tensor):  # another thread took it up since (see slot_for)
                continue
            del self.slots[tensor]
            self._unliving(slot.segment_name)
            segments.add(slot.segment_name)
        for segment in segments:
            self._release_unused(segment)

    def _forget_replaced(self, name: str) -> None:
        """The daemon refused ``name``'s larger slot (no room under the cap, say): it had dropped the slot the new
        one was to replace, before it found no room (not one carved from a slab of ours: see _give_up). Ours is
        forgotten too, or the name's next push, at its old size, named memory the daemon no longer counted as
        ours, and failed so for the rest of the job (a review's case)."""
        with self._lock:
            old = self.slots.get(name)
            if old is not None and old.segment_name not in self._slabs:
                del self.slots[name]
                self._unliving(old.segment_name)
                self._release_unused(old.segment_name)

    def _slab_fits(self, need: int) -> bool:
        """Whether ``need`` more bytes fit the slab we carve from (still ours)."""
        slab = self._slab
        return slab is not None and slab[0] in self.attached and slab[1] + need <= slab[2]

    def result_segment(self, name: str, segment: str) -> SharedMemory:
        """The mapping of ``segment``, the worker's segment that holds ``name``'s result; forgets the one of
        the last round when the worker moved it."""
        with self._lock:
            seg = self._attach(segment, name)
            previous = self.results.get(name)
            self.results[name] = segment
            if previous is not None and previous != segment:
                self._release_unused(previous)
        return seg

    def close(self) -> None:
        """Unmap everything (the daemon frees the segments when this process disconnects); where this thread holds
        the slots' lock (shutdown() from a signal handler that interrupted a call holding it, see bps_runtime.locks),
        nothing: the memory stays mapped until the process ends."""
        if self._lock.mine():
            return
        with self._lock:
            for seg in self.attached.values():
                shm.release(seg, unlink=False)
            self.attached.clear()
            self.slots.clear()
            self.results.clear()
            self._living.clear()
            self._slab = None
            self._slabs.clear()
            self._dead = []

    # -- the cap ---------------------------------------------------------------------
    def _new_bytes(self, nbytes: int) -> int:
        """The bytes of the segment the daemon makes for a new slot of ``nbytes`` (0: it fits our slab)."""
        if nbytes > shm.SLAB_ITEM_MAX_BYTES:
            return nbytes
        return 0 if self._slab_fits(shm.slab_slot_bytes(nbytes)) else self.slab_bytes

    def _give_up(self, name: str, nbytes: int) -> list[str]:
        """The least recently used idle slots to give up so that ``name``'s new one fits under the cap
        (none if it fits, or if even all of them would not make room: the daemon then says so)."""
        if not self.cap_bytes:
            return []
        # Whether it fits, from the segments our slots live in (a few slabs for thousands of small tensors):
        # the full reckoning below, over every slot, only when it does not.
        old = self.slots.get(name)
        # The daemon frees the slot it replaces (and its segment if nothing else lives there); not a slot carved
        # from a slab of ours: that slab goes only when we give it up.
        replaced = old.segment_name if old is not None and old.segment_name not in self._slabs else None
        held = sum(self.attached[s].size for s, n in self._living.items() if n > (1 if s == replaced else 0))
        if held <= self.cap_bytes - self._new_bytes(nbytes):
            return []
        by_segment: dict[str, list[str]] = {}
        for tensor, slot in self.slots.items():
            by_segment.setdefault(slot.segment_name, []).append(tensor)
        if replaced is not None:
            by_segment[replaced].remove(name)
        held = sum(self.attached[s].size for s, tensors in by_segment.items() if tensors)
        room = self.cap_bytes - self._new_bytes(nbytes)
        if held <= room:
            return []
        # ``name`` itself is in flight (reserved by its caller), but its old slot is being replaced: nothing reads it.
        idle = sorted((max(self.slots[t].used for t in tensors), s, tensors) for s, tensors in by_segment.items()
                      if tensors and not any(t != name and self._busy(t) for t in tensors))
        free: list[str] = []  # what the daemon frees: its slots' tensors, and our slabs (by name)
        gone: list[str] = []
        chars = 0
        for _, s, tensors in idle:
            given = [self._slabs[s]] if s in self._slabs else tensors
            if held <= room or len(free) + len(given) > FREE_MAX_NAMES or \
                    chars + sum(map(len, given)) > FREE_MAX_CHARS:
                break
            held -= self.attached[s].size
            free += given
            gone += tensors
            chars += sum(map(len, given))
        if held > room:
            return []  # not enough idle memory: give up nothing, the daemon refuses with the cap
        for tensor in gone:
            seg = self.slots.pop(tensor).segment
            self._unliving(seg.name)
            self._release_unused(seg.name, given_up=True)
        return free

    def _unliving(self, segment: str) -> None:
        self._living[segment] -= 1
        if self._living[segment] <= 0:
            del self._living[segment]

    # -- mappings --------------------------------------------------------------------
    def _attach(self, segment: str, name: str) -> SharedMemory:
        seg = self.attached.get(segment)
        if seg is None:
            try:
                seg = self.attached[segment] = shm.attach_segment(segment)
            except OSError as exc:
                raise BPSError(f"cannot attach shared-memory segment {segment!r} for {name!r}: {exc}") from None
            if len(self.attached) >= 2 * self._swept_at:
                self._sweep()
        return seg

    def _attach_new(self, segment: str, name: str) -> SharedMemory:
        """:meth:`_attach` of the segment a slot was just carved from; a slab of ours that cannot be mapped is
        given up at the next Alloc (the daemon holds it for us until then, counted against our cap)."""
        try:
            return self._attach(segment, name)
        except BPSError:
            slab = self._slabs.pop(segment, None) if segment not in self.attached else None
            if slab is not None:
                self._dead.append(slab)
                self._slab = None
            raise

    def _sweep(self) -> None:
        """Unmap the result segments the daemon freed (for room) that no slot of ours lives in; not the one of a
        name in flight (``busy``): an operation that ended and is not synchronized yet reads its result there."""
        slotted = {slot.segment_name for slot in self.slots.values()}
        for tensor, segment in list(self.results.items()):
            if segment not in slotted and not self._busy(tensor) and \
                    not os.path.exists(os.path.join(shm.SHM_DIR, segment)):
                del self.results[tensor]
                self._release_unused(segment)
        self._swept_at = max(len(self.attached), 1)

    def _release_unused(self, segment: str, given_up: bool = False) -> None:
        """Unmap ``segment`` unless a slot or a last result still lives there; a slab of ours is then given up
        at the next Alloc (the daemon holds it for us until then), unless ``given_up`` already."""
        if segment in self.attached and not self._living.get(segment) and segment not in self.results.values():
            shm.release(self.attached.pop(segment), unlink=False)
            slab = self._slabs.pop(segment, None)
            if slab is not None:
                if not given_up:
                    self._dead.append(slab)
                if self._slab is not None and self._slab[0] == segment:
                    self._slab = None
