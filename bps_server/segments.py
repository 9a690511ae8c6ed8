"""Mapping POSIX shared-memory segments that another process created.

The worker daemon creates (and owns) every segment; training processes and the
colocated Summation Service only attach. Python's resource tracker would unlink
an attached segment when the attaching process exits, so attaching unregisters
it; the descriptor is closed at once (the mapping outlives it), or thousands of
segments would exhaust the fd limit.
"""

from __future__ import annotations

import os
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory


def untrack(seg: SharedMemory) -> None:
    try:
        resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:
        pass


def close_fd(seg: SharedMemory) -> None:
    """The mapping outlives the descriptor: close it."""
    fd = getattr(seg, "_fd", -1)
    if fd >= 0:
        os.close(fd)
        seg._fd = -1  # type: ignore[attr-defined]


def attach_segment(name: str) -> SharedMemory:
    """Map an existing segment (OSError if it is gone or not ours to read)."""
    seg = SharedMemory(name=name, create=False)
    untrack(seg)
    close_fd(seg)
    return seg


def release(seg: SharedMemory, unlink: bool) -> None:
    """Close our mapping (ignoring live exports) and optionally remove the name."""
    try:
        seg.close()
    except BufferError:
        # A view still uses the mapping: drop our references, so the mapping goes with the last view
        # (and SharedMemory.__del__ does not try, and fail, again).
        seg._buf = None  # type: ignore[attr-defined]
        seg._mmap = None  # type: ignore[attr-defined]
    if unlink:
        try:
            seg.unlink()
        except FileNotFoundError:
            pass
