"""The process's fusion buffer: small sums issued close together go to the worker daemon as one ``OpBatch``.

A sum of at most ``Welcome.fusion_bytes`` (the daemon's limit) is not sent when it starts: its input is in
its slot already, and its entry waits here until ``fusion_bytes`` (a setting) of them wait, the first one
waited ``cycle_time_ms``, or a thread synchronizes (or polls) one of them. Then every waiting entry goes in
one message (a few, each within a frame's limits), as Horovod's fusion threshold and cycle time bound its
fusion buffer. The daemon fuses them further with the other processes' (``bps_worker.fusion``).

One flusher thread (started with the first entry) sends on the cycle; every other send happens in the
thread that fills the buffer or synchronizes.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from protocol.messages import OpBatch, Spec, fused_chunks

from bps_runtime.locks import OwnedLock

from ..errors import BPSError
from .handle import Handle

__all__ = ["FusionBuffer"]

# (handle, spec, segment, offset, priority) of a sum waiting to be sent.
Entry = tuple[Handle, Spec, str, int, int]


class FusionBuffer:
    """Entries waiting to go to the daemon in one OpBatch (see the module docstring)."""

    def __init__(self, send: Callable[[list[Handle], OpBatch], None], limit_bytes: int, cycle_s: float) -> None:
        self._send = send  # registers the handles and sends (Connection.submit_many)
        self.limit_bytes = limit_bytes
        self.cycle_s = cycle_s
        self._lock = OwnedLock()
        self._cond = threading.Condition(self._lock)  # type: ignore[arg-type]
        # What waits, as columns (no tuple per entry to keep alive until it is sent, for the collector to walk):
        self._handles: list[Handle] = []
        self._specs: list[Spec] = []
        self._segments: list[str] = []
        self._offsets: list[int] = []
        self._priorities: list[int] = []
        self._bytes = 0
        self._first_at = 0.0
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, handle: Handle, spec: Spec, segment: str, offset: int, priority: int, nbytes: int,
            now: bool = False) -> None:
        """Queue a started sum (its input is in its slot); sends now if the buffer is full, or with ``now``
        (the caller waits for it at once: a synchronous push_pull, whose flush need not wake the flusher)."""
        with self._cond:
            self._append(handle, spec, segment, offset, priority)
            self._bytes += nbytes
            if now or self._bytes >= self.limit_bytes:
                self._flush_locked()
            elif len(self._handles) == 1:
                self._first_at = time.monotonic()
                if self._thread is None:
                    self._thread = threading.Thread(target=self._cycle, name="bps-client-fusion", daemon=True)
                    self._thread.start()
                else:
                    self._cond.notify()

    def add_many(self, entries: list[Entry]) -> None:
        """Queue many started sums and send them all now, with whatever waits already (a group: every name of
        it is known, nothing more will come to wait for)."""
        with self._cond:
            for entry in entries:
                self._append(*entry)
            self._flush_locked()

    def _append(self, handle: Handle, spec: Spec, segment: str, offset: int, priority: int) -> None:
        self._handles.append(handle)
        self._specs.append(spec)
        self._segments.append(segment)
        self._offsets.append(offset)
        self._priorities.append(priority)

    def flush(self) -> None:
        """Send whatever waits (a synchronize of a waiting entry, a poll, shutdown)."""
        with self._cond:
            self._flush_locked()

    def _flush_locked(self) -> None:
        all_handles, self._handles = self._handles, []
        all_specs, all_segments, all_offsets, all_priorities = self._specs, self._segments, self._offsets, \
            self._priorities
        self._specs, self._segments, self._offsets, self._priorities, self._bytes = [], [], [], [], 0
        if not all_handles:
            return
        names = [h.name for h in all_handles]
        for start, stop in fused_chunks(names):
            index: dict[Spec, int] = {}
            specs: list[Any] = []
            segments: dict[str, int] = {}
            which, segs = [], []
            for spec, segment in zip(all_specs[start:stop], all_segments[start:stop]):
                k = index.get(spec)
                if k is None:
                    k = index[spec] = len(specs)
                    specs.append([spec[0], list(spec[1]), spec[2], spec[3]])
                s = segments.get(segment)
                if s is None:
                    s = segments[segment] = len(segments)
                which.append(k)
                segs.append(s)
            handles = all_handles[start:stop]
            for handle in handles:
                handle.queued = False
            batch = OpBatch([h.req for h in handles], names[start:stop], specs, which, list(segments), segs,
                            all_offsets[start:stop], all_priorities[start:stop])
            try:
                self._send(handles, batch)
            except BaseException as exc:  # the connection broke: these handles fail, the later ones too
                error = exc if isinstance(exc, BPSError) else BPSError(f"cannot send: {exc}")
                for h in all_handles[start:]:
                    if not h.done():
                        h.fail(error)
                return

    def _cycle(self) -> None:
        """The flusher: send the buffer once its first entry waited ``cycle_s``."""
        with self._cond:
            while not self._closed:
                if not self._handles:
                    self._cond.wait()
                    continue
                left = self._first_at + self.cycle_s - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._flush_locked()

    def close(self) -> None:
        """Send what waits and stop the flusher (shutdown(): skipped where this thread holds the buffer's lock, a
        signal handler inside it, see bps_runtime.locks; the flusher, a daemon thread, then ends with the process)."""
        if self._lock.mine():
            return
        with self._cond:
            self._flush_locked()
            self._closed = True
            self._cond.notify()

