"""Admission of connections that have not finished their handshake: bounded in number and in time.

A daemon gives a stranger nothing until it proves who it is (the handshake, ``protocol.handshake``).
Until then the connection is *pending*, and what pending connections may take is bounded three ways:

* in number: at most ``per_peer`` pending connections from one peer (a TCP host, or a local uid on a
  Unix socket) and ``total`` in all. One over is closed at once, before the daemon sends or allocates
  anything for it. Honest peers are pending for one round trip, so the bounds are far above what a
  cluster's start (every worker opening all of its streams at once) needs;
* in time: a connection that has not finished its handshake ``deadline_s`` after it opened is closed;
* in the log: the lines about refused and overdue connections are rate-limited (:class:`LogLimit`),
  so that a flood of connections does not become a flood of lines.

A connection's :class:`Ticket` holds its place; ``release()`` (handshake done, or connection gone)
frees it. :class:`AdmittedProtocol` is what both daemons' listening protocols share: admission at
``connection_made``, the deadline's close, and back-pressure (``bps_runtime.backpressure``). The memory a pending connection may allocate is the caller's to keep small (a receive buffer
sized for the Hello alone, see ``protocol.frames.FrameReader.set_limits``). Without these bounds, 4,000
idle TCP connections took a server from 167 MB to 1.2 GB of RSS, for ever (issue 14, item 5).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Callable, Final

from .backpressure import BackPressure

# At most this many pending connections from one peer (TCP host, or local uid), and in all.
PENDING_PER_PEER: Final = 64
PENDING_TOTAL: Final = 512
# A connection must finish its handshake within this of opening: far longer than an honest one takes, even on
# a machine so loaded that a reply waits seconds for the CPU (the cluster's timeout can be shorter: a stranger
# is closed, never a worker failed, so the bound is not tied to it), and short enough that the places of a
# flood free up soon.
HANDSHAKE_DEADLINE_S: Final = 10.0
# Of the lines about refused or overdue connections: at most LOG_BURST per LOG_INTERVAL_S.
LOG_BURST: Final = 5
LOG_INTERVAL_S: Final = 10.0


class LogLimit:
    """At most ``burst`` lines per ``interval_s``; the next line allowed says how many were left out."""

    __slots__ = ("burst", "interval_s", "_window_start", "_in_window", "suppressed")

    def __init__(self, *, burst: int = LOG_BURST, interval_s: float = LOG_INTERVAL_S) -> None:
        self.burst = burst
        self.interval_s = interval_s
        self._window_start = float("-inf")
        self._in_window = 0
        self.suppressed = 0  # lines left out since the last one allowed

    def allow(self, now: float) -> bool:
        """May a line be logged now? (If so, :attr:`suppressed` says how many were left out before it.)"""
        if now - self._window_start >= self.interval_s:
            self._window_start, self._in_window = now, 0
        if self._in_window >= self.burst:
            self.suppressed += 1
            return False
        self._in_window += 1
        return True

    def log(self, logger: logging.Logger, level: int, message: str, *args: object) -> None:
        """``logger.log(level, message, *args)`` unless over the limit, with the count left out before it."""
        if not self.allow(time.monotonic()):
            return
        if self.suppressed:
            message += " (%d similar lines left out)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        logger.log(level, message, *args)


class Ticket:
    """One pending connection's place: counted until :meth:`release`, closed by its deadline before that."""

    __slots__ = ("admission", "peer", "_timer")

    def __init__(self, admission: Admission, peer: str, timer: asyncio.TimerHandle | None) -> None:
        self.admission = admission
        self.peer = peer
        self._timer = timer

    def release(self) -> None:
        """The handshake finished or the connection is gone: free the place (once; later calls do nothing)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.peer:
            self.admission.counts[self.peer] -= 1
            if not self.admission.counts[self.peer]:
                del self.admission.counts[self.peer]
            self.peer = ""


class Admission:
    """The pending connections of one listening daemon, by peer (see the module docstring).

    ``what`` names the daemon's side in the log lines (``"server 0"``, ``"worker 1's socket"``).
    """

    __slots__ = ("log", "what", "per_peer", "total", "deadline_s", "counts", "refusals_log", "overdue_log", "refused")

    def __init__(self, log: logging.Logger, what: str, *, deadline_s: float = HANDSHAKE_DEADLINE_S,
                 per_peer: int = PENDING_PER_PEER, total: int = PENDING_TOTAL) -> None:
        self.log = log
        self.what = what
        self.per_peer = per_peer
        self.total = total
        self.deadline_s = deadline_s
        self.counts: Counter[str] = Counter()
        self.refusals_log = LogLimit()  # apart, so that a flood of refusals does not hide the deadline's lines
        self.overdue_log = LogLimit()
        self.refused = 0  # connections refused since start (over a bound)

    @property
    def pending(self) -> int:
        return sum(self.counts.values())

    def refusal(self, peer: str) -> str | None:
        """Why one more pending connection from ``peer`` is refused, or None if it may wait."""
        if self.counts[peer] >= self.per_peer:
            return f"{self.counts[peer]} connections from {peer} have not finished their handshake " \
                   f"(at most {self.per_peer} per peer)"
        if self.pending >= self.total:
            return f"{self.pending} connections have not finished their handshake (at most {self.total})"
        return None

    def enter(self, peer: str, label: str, overdue: Callable[[], None]) -> Ticket | None:
        """A new connection from ``peer`` (``label``: its address for the log): its ticket, or None if it
        must be closed at once (logged). ``overdue`` is called if the ticket is still held at the deadline."""
        reason = self.refusal(peer)
        if reason is not None:
            self.refused += 1
            self.refusals_log.log(self.log, logging.WARNING, "%s refuses a connection from %s: %s", self.what, label,
                               reason)
            return None
        self.counts[peer] += 1

        def on_deadline() -> None:
            ticket._timer = None
            if ticket.peer:
                self.overdue_log.log(self.log, logging.WARNING, "%s closes the connection from %s: no handshake "
                                   "within %g s", self.what, label, self.deadline_s)
                ticket.release()
                overdue()

        ticket = Ticket(self, peer, None)
        ticket._timer = asyncio.get_running_loop().call_later(self.deadline_s, on_deadline)
        return ticket


class AdmittedProtocol(asyncio.BufferedProtocol):
    """A listening daemon's connection protocol, bounded: :meth:`admit` first in ``connection_made``
    (False: refused and aborted, do nothing more), :meth:`admitted` once the handshake is verified,
    :meth:`left` in ``connection_lost``. Until :meth:`admitted` the connection's deadline may abort it."""

    closed: bool
    ticket: Ticket | None = None
    flow: BackPressure | None = None
    _bounded: asyncio.Transport | None = None

    def admit(self, transport: asyncio.Transport, admission: Admission, peer: str, label: str,
              write_high_bytes: int) -> bool:
        """Take a place among ``admission``'s pending connections and stop reading the peer while more
        than ``write_high_bytes`` wait to be written to it; False (aborted, logged) if there is no place."""
        self._bounded = transport
        self.ticket = admission.enter(peer, label, self._handshake_overdue)
        if self.ticket is None:
            self.closed = True
            transport.abort()
            return False
        self.flow = BackPressure(transport, write_high_bytes)
        return True

    def admitted(self) -> None:
        """The handshake is verified: the connection no longer counts as pending."""
        if self.ticket is not None:
            self.ticket.release()

    def left(self) -> None:
        self.admitted()

    def pause_writing(self) -> None:
        if self.flow is not None:
            self.flow.pause_writing()

    def resume_writing(self) -> None:
        if self.flow is not None:
            self.flow.resume_writing()

    def _handshake_overdue(self) -> None:
        """No handshake by the deadline (logged by the admission): drop the peer, unflushed."""
        self.closed = True
        if self._bounded is not None:
            self._bounded.abort()
