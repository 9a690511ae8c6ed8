"""POSIX shared-memory segments owned by the worker daemon.

The worker creates every segment (owner-only permissions) and unlinks it when
the client that uses it disconnects, is killed, or the daemon stops; clients
only attach. The worker's segments stay registered with Python's resource
tracker, so even a SIGKILLed daemon's segments are unlinked by the tracker; a
client unregisters what it attaches, or its tracker would unlink segments it
does not own when it exits.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Final

SEGMENT_PREFIX: Final = "bps_"


def _untrack(shm: SharedMemory) -> None:
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:
        pass


def segment_name(worker_id: int) -> str:
    return f"{SEGMENT_PREFIX}w{worker_id}_{os.getpid()}_{secrets.token_hex(6)}"


def create_segment(name: str, nbytes: int, mode: int = 0o600) -> SharedMemory:
    """A new segment of at least ``nbytes`` (a zero-size segment cannot be mapped, so at least 1).

    Created owner-only, then opened up to ``mode`` (e.g. 0o660 for a shared group).
    """
    seg = SharedMemory(name=name, create=True, size=max(nbytes, 1))
    if mode != 0o600:
        os.fchmod(seg._fd, mode)  # type: ignore[attr-defined]
    _close_fd(seg)
    return seg


def _close_fd(shm: SharedMemory) -> None:
    """The mapping outlives the descriptor: close it, or thousands of segments exhaust the fd limit."""
    fd = getattr(shm, "_fd", -1)
    if fd >= 0:
        os.close(fd)
        shm._fd = -1  # type: ignore[attr-defined]


def attach_segment(name: str) -> SharedMemory:
    shm = SharedMemory(name=name, create=False)
    _untrack(shm)
    _close_fd(shm)
    return shm


def release(shm: SharedMemory, unlink: bool) -> None:
    """Close our mapping (ignoring live exports) and optionally remove the name."""
    try:
        shm.close()
    except BufferError:
        pass  # a numpy view still references the mapping; it is freed with the view
    if unlink:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
