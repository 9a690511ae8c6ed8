"""``Handle``: one operation in flight, from its start to its one :func:`~bps_worker.client.synchronize`.

The reader thread completes a handle (:meth:`Handle.succeed` / :meth:`Handle.fail`); the thread that
started it waits on it and reads its result. Everything but ``req``, ``name``, ``dtype``, ``shape`` and
``out`` is the client package's own bookkeeping.
"""

from __future__ import annotations

import _thread
import threading
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ..errors import BPSError

__all__ = ["Handle", "checked"]

H = TypeVar("H")


# Makes a handle's gate when a first thread waits for an unfinished one (most finish before anyone waits).
_GATES = threading.Lock()


@dataclass(eq=False, slots=True)
class Handle:
    """An operation in flight; pass it to :func:`poll` or :func:`synchronize`."""

    req: int
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    out: np.ndarray | None
    # The slot the input was handed over in (SlotMap's view of it), where the result is unless ``result_at``
    # names another place; None: a CUDA tensor the daemon reads and writes itself.
    view: np.ndarray | None = field(default=None, repr=False)
    in_place: bool = field(default=False, repr=False)  # the input was the slot itself (a shared array)
    result_at: tuple[str, int] | None = field(default=None, repr=False)  # the worker's segment holding the result
    times: list[int] | None = field(default=None, repr=False)  # timeline: start, filled, done
    call: str = field(default="push_pull", repr=False)  # the call that started it, as the timeline names it
    error: BPSError | None = field(default=None, repr=False)
    consumed: bool = field(default=False, repr=False)
    queued: bool = field(default=False, repr=False)  # waits in the fusion buffer, not sent yet
    abandoned: bool = field(default=False, repr=False)  # sent by a failed group call: nobody will synchronize it
    # The connection (client.operations.Operations) that started it: after shutdown() and init() another one
    # answers, and this handle's result (a segment of the old connection's) is gone.
    owner: object = field(default=None, repr=False)
    _finished: bool = field(default=False, repr=False)
    _gate: _thread.LockType | None = field(default=None, repr=False)  # made by the first waiter (see wait)

    def done(self) -> bool:
        """Whether the operation finished (successfully or not)."""
        return self._finished

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: for ever) for the end; whether it ended.

        The gate is made only for a handle that is not finished when waited for (thousands of small sums a
        step are finished by then): the waiter sets it and then reads ``_finished``; ``_finish`` writes
        ``_finished`` and then reads it. Under the GIL one of the two sees the other's write.

        The gate is a bare lock, made held and released by ``_finish``: each waiter takes it and gives it
        back at once, so every thread waiting on the handle passes. (A ``threading.Event`` made its waiter a
        ``Condition`` and a lock of its own, and its ``set`` a notify: about 40 Python calls a synchronous
        sum on the two threads, where this is two C calls.)"""
        if self._finished:
            return True
        if timeout is not None and timeout > threading.TIMEOUT_MAX:
            timeout = None  # (math.inf, or longer than a lock can wait: for ever)
        with _GATES:
            gate = self._gate
            if gate is None:
                gate = self._gate = _thread.allocate_lock()
                gate.acquire()
        if self._finished:
            return True
        if not gate.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
            return self._finished
        gate.release()
        return True

    def _finish(self) -> None:
        self._finished = True
        gate = self._gate
        if gate is not None:
            with _GATES:  # not while a waiter makes it held (wait): released once, after that
                if gate.locked():
                    gate.release()

    def succeed(self, result_at: tuple[str, int] | None, now: int | None) -> None:
        """The daemon answered Done; ``result_at``: the worker's segment and offset holding the result, if it
        did not hand it back into the slot. ``now``: the timeline's clock, when tracing."""
        if self.times is not None and now is not None:
            self.times[2] = now
        self.result_at = result_at
        self._finish()

    def fail(self, error: BPSError, now: int | None = None) -> None:
        """The operation failed with ``error`` (raised by :func:`synchronize`)."""
        if self.times is not None and now is not None:
            self.times[2] = now
        self.error = error
        self._finish()


def checked(handle: object, call: str, kind: type[H] = Handle) -> H:  # type: ignore[assignment]
    """``handle`` if it is a ``kind`` (a :class:`Handle`, or the torch layer's); else a BPSError naming ``call``
    and what it got (every failure a user can meet is a BPSError, a wrong argument's too)."""
    if not isinstance(handle, kind):
        raise BPSError(f"{call}: expected a handle from push_pull_async (or the like), got {type(handle).__name__}")
    return handle
