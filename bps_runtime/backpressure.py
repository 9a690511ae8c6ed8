"""Back-pressure on a peer that does not read: stop reading it while our writes to it pile up.

What a daemon writes to a peer are answers to what it read from that peer (results and failures of its
pushes or ops), plus a few heartbeats. A peer that sends but never reads would make the write buffer grow
without bound: a training process that never read its socket took a worker daemon from 163 to 627 MiB of
failures (issue 14, item 5). So above a named high-water mark the protocol stops reading the peer (asyncio
calls ``pause_writing``); once the buffer drains below the low-water mark (a quarter of the high one,
asyncio's default ratio) it reads again. While paused, what is already read may still be answered, so the
buffer stays within the mark plus the answers of one read; the peer's own sends stop at its kernel's
socket buffer. While paused, the peer's own bytes (its pings) wait unread in the kernel, so a silence
watch must not take that for silence: :meth:`BackPressure.draining` tells it the peer took some of what
waits for it (it reads, if slowly). A paused peer that takes nothing for the timeout is dropped as silent.

Thin protocol classes only call :meth:`pause_writing` and :meth:`resume_writing` from theirs.
"""

from __future__ import annotations

from typing import Protocol


class FlowTransport(Protocol):
    """What back-pressure needs of a transport (an asyncio stream transport has it all)."""

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def is_closing(self) -> bool: ...

    def get_write_buffer_size(self) -> int: ...


class BackPressure:
    """Pause reading ``transport`` while its write buffer is over ``high_bytes`` (see the module docstring)."""

    __slots__ = ("transport", "high_bytes", "paused", "pauses", "_waiting")

    def __init__(self, transport: FlowTransport, high_bytes: int) -> None:
        self.transport = transport
        self.high_bytes = high_bytes
        self.paused = False
        self.pauses = 0  # times reading was paused (tests, stats)
        self._waiting = 0  # bytes waiting to be written at the last look (see draining)
        transport.set_write_buffer_limits(high=high_bytes)

    def pause_writing(self) -> None:
        self.paused = True
        self.pauses += 1
        self._waiting = self.transport.get_write_buffer_size()
        if not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if not self.transport.is_closing():
            self.transport.resume_reading()

    def draining(self) -> bool:
        """Whether reading is paused and the peer took some of our bytes since the last call: it is alive,
        and what it sent waits unread because of us (a silence watch calls this before judging it)."""
        waiting = self.transport.get_write_buffer_size()
        took = waiting < self._waiting
        self._waiting = waiting
        return self.paused and took
