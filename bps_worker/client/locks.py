"""Locks taken on the way out: :func:`bps_worker.client.shutdown` never waits for ever on one.

A signal handler that calls ``shutdown()`` (a pod's SIGTERM handler, a Ctrl-C handler) runs in the main thread,
between two of its bytecodes, wherever that thread was: possibly inside a call that holds one of the client's
locks (the module's, the connection's send lock, its handles' lock, the fusion buffer's, the slots'). Those locks
are not re-entrant, and the handler's ``shutdown()`` waited for ever on the lock its own thread held. On the way
out, each lock is therefore waited for a little only (another thread's hold ends within that: a send of a control
message, a bookkeeping step), and what cannot be taken is skipped: the Leave is not sent (the daemon sees the
process leave when its connection closes, as for a crash), the fusion buffer's waiting sums are not sent, the
shared memory stays mapped until the process ends.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Final, Iterator, Union

# How long shutdown() waits for each lock it needs (see the module docstring).
SHUTDOWN_LOCK_WAIT_S: Final = 1.0

Lock = Union["threading.Lock", "threading.Condition"]


@contextlib.contextmanager
def held_within(lock: Lock, seconds: float = SHUTDOWN_LOCK_WAIT_S) -> Iterator[bool]:
    """Hold ``lock`` for the block if it comes within ``seconds``; the block learns whether it does."""
    got = lock.acquire(timeout=seconds)
    try:
        yield got
    finally:
        if got:
            lock.release()
