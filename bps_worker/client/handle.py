"""``Handle``: one operation in flight, from its start to its one :func:`~bps_worker.client.synchronize`.

The reader thread completes a handle (:meth:`Handle.succeed` / :meth:`Handle.fail`); the thread that
started it waits on it and reads its result. Everything but ``req``, ``name``, ``dtype``, ``shape`` and
``out`` is the client package's own bookkeeping.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from ..errors import BPSError
from .arrays import view_of

__all__ = ["Handle"]


@dataclass(eq=False)
class Handle:
    """An operation in flight; pass it to :func:`poll` or :func:`synchronize`."""

    req: int
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    out: np.ndarray | None
    # Where the input was handed over and, after a hand-back, where the result is; None: a CUDA tensor the
    # daemon reads and writes itself.
    segment: SharedMemory | None = field(default=None, repr=False)
    offset: int = field(default=0, repr=False)
    in_place: bool = field(default=False, repr=False)  # the input was the slot itself (a shared array)
    result_at: tuple[str, int] | None = field(default=None, repr=False)  # the worker's segment holding the result
    times: list[int] | None = field(default=None, repr=False)  # timeline: start, filled, done
    error: BPSError | None = field(default=None, repr=False)
    consumed: bool = field(default=False, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def done(self) -> bool:
        """Whether the operation finished (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: for ever) for the end; whether it ended."""
        return self._done.wait(timeout)

    def succeed(self, result_at: tuple[str, int] | None, now: int | None) -> None:
        """The daemon answered Done; ``result_at``: the worker's segment and offset holding the result, if it
        did not hand it back into the slot. ``now``: the timeline's clock, when tracing."""
        if self.times is not None and now is not None:
            self.times[2] = now
        self.result_at = result_at
        self._done.set()

    def fail(self, error: BPSError, now: int | None = None) -> None:
        """The operation failed with ``error`` (raised by :func:`synchronize`)."""
        if self.times is not None and now is not None:
            self.times[2] = now
        self.error = error
        self._done.set()

    def result_view(self) -> np.ndarray:
        """The result in shared memory, as an array (the slot, or the worker's results segment)."""
        assert self.segment is not None, "a CUDA operation's result is its tensor"
        return view_of(self.segment.buf, self.dtype, self.shape, self.offset)
