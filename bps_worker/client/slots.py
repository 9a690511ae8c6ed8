"""The worker daemon's shared memory as this process maps it: one slot per tensor name, and result segments.

The daemon creates every segment; this process only attaches (maps) them. A name's *slot* is where its input
is handed over (asked of the daemon once per name, reused while the size fits). A plain array's *result* may
instead lie in the worker's results segment (named in ``Done``); the last one per name stays mapped, because
the worker unlinks a segment it moved away from, and our mapping is then all that keeps it.

A segment is unmapped once no slot and no last result lives in it. One lock guards the three tables, so
operations on different names may run on different threads.
"""

from __future__ import annotations

import threading
from multiprocessing.shared_memory import SharedMemory
from typing import Callable

from bps_runtime import segments as shm

from ..errors import BPSError

__all__ = ["Allocate", "SlotMap"]

# Asks the daemon for ``nbytes`` for tensor ``name``: (segment name, offset, capacity).
Allocate = Callable[[str, int], tuple[str, int, int]]


class SlotMap:
    """Segments mapped in this process, each name's slot, and each name's last result segment."""

    __slots__ = ("_allocate", "_lock", "attached", "slots", "results")

    def __init__(self, allocate: Allocate) -> None:
        self._allocate = allocate
        self._lock = threading.Lock()
        self.attached: dict[str, SharedMemory] = {}  # segment name -> our mapping
        self.slots: dict[str, tuple[SharedMemory, int, int]] = {}  # tensor name -> (segment, offset, capacity)
        self.results: dict[str, str] = {}  # tensor name -> the worker's segment that held its last result

    def slot_for(self, name: str, nbytes: int) -> tuple[SharedMemory, int]:
        """The shared memory where tensor ``name`` is handed over (asked of the daemon once per name)."""
        with self._lock:
            slot = self.slots.get(name)
        if slot is not None and slot[2] >= nbytes:
            return slot[0], slot[1]
        segment, offset, capacity = self._allocate(name, nbytes)
        with self._lock:
            seg = self._attach(segment, name)
            self.slots[name] = (seg, offset, capacity)
            if slot is not None:
                self._release_unused(slot[0].name)  # the daemon moved the tensor and freed its old segment
        return seg, offset

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
        """Unmap everything (the daemon frees the segments when this process disconnects)."""
        with self._lock:
            for seg in self.attached.values():
                shm.release(seg, unlink=False)
            self.attached.clear()
            self.slots.clear()
            self.results.clear()

    def _attach(self, segment: str, name: str) -> SharedMemory:
        seg = self.attached.get(segment)
        if seg is None:
            try:
                seg = self.attached[segment] = shm.attach_segment(segment)
            except OSError as exc:
                raise BPSError(f"cannot attach shared-memory segment {segment!r} for {name!r}: {exc}") from None
        return seg

    def _release_unused(self, segment: str) -> None:
        """Unmap ``segment`` unless a slot or a last result still lives there."""
        if segment in self.attached and all(s[0].name != segment for s in self.slots.values()) \
                and segment not in self.results.values():
            shm.release(self.attached.pop(segment), unlink=False)
