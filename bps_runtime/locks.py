"""A lock that knows which thread holds it: so that ``shutdown()`` called from a signal handler never deadlocks.

A signal handler runs in the main thread, between two of its bytecodes, wherever that thread was: possibly inside
a call that holds one of the client's locks (the module's, the connection's send and handles locks, the fusion
buffer's, the slots', the timeline's). Those locks are not re-entrant, and a handler's ``shutdown()`` (a pod's
SIGTERM handler) waited for ever on the lock its own thread held. On the way out, the client asks each lock
whether this thread holds it already (:meth:`OwnedLock.mine`): if so it goes on without it and skips what needs
it (the Leave is not sent, so the daemon sees the process leave when its connection closes, as for a crash; the
timeline is ended at exit; the fusion buffer's waiting sums are not sent; the shared memory stays mapped until
the process ends); a lock another thread holds is waited for as ever (shutdown() still returns once its leave
took effect).
"""

from __future__ import annotations

import threading
from typing import Any


class OwnedLock:
    """``threading.Lock`` plus the holder's thread ident (the lock itself does not know it). For a condition,
    ``threading.Condition(OwnedLock())`` (its waits release and take it again through these methods)."""

    __slots__ = ("_lock", "owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self.owner = threading.get_ident()
        return got

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def mine(self) -> bool:
        """Whether the calling thread holds it (a signal handler running inside that thread's hold of it)."""
        return self.owner == threading.get_ident()
