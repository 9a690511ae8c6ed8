"""Admission of connections that have not finished their handshake: bounded in number and in time.

A daemon gives a stranger nothing until it proves who it is (the handshake, ``protocol.handshake``).
Until then the connection is *pending*, and what pending connections may take is bounded three ways:

* in number: at most ``per_peer`` pending connections from one peer (a TCP host, or a local uid on a
  Unix socket) and ``total`` in all. One over makes room: the *oldest* pending connection of that peer
  (or, over ``total``, of all) is closed, and the new one waits its turn. Honest peers are pending for one
  round trip, so the bounds are far above what a cluster's start (every worker opening all of its streams at
  once) needs, and an honest handshake is closed only by a flood that opens ``per_peer`` connections within
  that round trip. (Refusing the newest instead let anyone who shares a worker's address, another user of its
  machine or a host behind the same NAT, hold ``per_peer`` idle connections and refuse that worker's
  reconnects for as long as it liked, without a token.);
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
from typing import Callable, Final

from .backpressure import BackPressure
from .loglimit import LogLimit

# At most this many pending connections from one peer (TCP host, or local uid), and in all.
PENDING_PER_PEER: Final = 64
PENDING_TOTAL: Final = 512
# A connection must finish its handshake within this of opening: far longer than an honest one takes, even on
# a machine so loaded that a reply waits seconds for the CPU (the cluster's timeout can be shorter: a stranger
# is closed, never a worker failed, so the bound is not tied to it), and short enough that the places of a
# flood free up soon.
HANDSHAKE_DEADLINE_S: Final = 10.0
def _nothing() -> None:
    pass


class Ticket:
    """One pending connection's place: counted until :meth:`release`, closed by its deadline (or to make room
    for a newer one) before that."""

    __slots__ = ("admission", "peer", "label", "opened", "_timer", "_close")

    def __init__(self, admission: Admission, peer: str, label: str, close: Callable[[], None]) -> None:
        self.admission = admission
        self.peer = peer
        self.label = label
        self.opened = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._close = close  # closes the connection (the caller's ``overdue``)

    def release(self) -> None:
        """The handshake finished or the connection is gone: free the place (once; later calls do nothing)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.peer:
            self.admission._forget(self)
            self.peer = ""
        self._close = _nothing  # (the connection's method: it holds us, and a cycle left it to the collector)

    def close(self) -> None:
        """Free the place and close the connection (its deadline passed, or a newer one needs the place)."""
        if self.peer:
            close = self._close
            self.release()
            close()


class Admission:
    """The pending connections of one listening daemon, by peer (see the module docstring).

    ``what`` names the daemon's side in the log lines (``"server 0"``, ``"worker 1's socket"``).
    """

    __slots__ = ("log", "what", "per_peer", "total", "deadline_s", "_by_peer", "_all", "refusals_log", "overdue_log",
                 "refused")

    def __init__(self, log: logging.Logger, what: str, *, deadline_s: float = HANDSHAKE_DEADLINE_S,
                 per_peer: int = PENDING_PER_PEER, total: int = PENDING_TOTAL) -> None:
        self.log = log
        self.what = what
        self.per_peer = per_peer
        self.total = total
        self.deadline_s = deadline_s
        # The pending tickets, oldest first (dicts as ordered sets): by peer, and all of them.
        self._by_peer: dict[str, dict[Ticket, None]] = {}
        self._all: dict[Ticket, None] = {}
        self.refusals_log = LogLimit()  # apart, so that a flood of closes does not hide the deadline's lines
        self.overdue_log = LogLimit()
        self.refused = 0  # pending connections closed to make room since start (over a bound)

    @property
    def pending(self) -> int:
        return len(self._all)

    @property
    def counts(self) -> dict[str, int]:
        """Pending connections by peer."""
        return {peer: len(tickets) for peer, tickets in self._by_peer.items()}

    def _over(self, peer: str) -> tuple[Ticket, str] | None:
        """The ticket that must make room for one more pending connection from ``peer``, and why; None if
        there is room."""
        mine = self._by_peer.get(peer)
        if mine is not None and len(mine) >= self.per_peer:
            return next(iter(mine)), f"{len(mine)} connections from {peer} have not finished their handshake " \
                                     f"(at most {self.per_peer} per peer)"
        if self._all and len(self._all) >= self.total:
            return next(iter(self._all)), f"{len(self._all)} connections have not finished their handshake " \
                                          f"(at most {self.total})"
        return None

    def enter(self, peer: str, label: str, overdue: Callable[[], None]) -> Ticket:
        """A new connection from ``peer`` (``label``: its address for the log): its ticket. Over a bound, the
        oldest pending connection that counts against it is closed first (logged). ``overdue`` closes this
        connection: called if the ticket is still held at the deadline, or when a newer one needs its place."""
        over = self._over(peer)
        while over is not None:
            victim, reason = over
            self.refused += 1
            self.refusals_log.log(self.log, logging.WARNING, "%s closes the connection from %s, pending for %.1f s, "
                                  "for a new one from %s: %s", self.what, victim.label,
                                  time.monotonic() - victim.opened, label, reason)
            victim.close()
            over = self._over(peer)
        ticket = Ticket(self, peer, label, overdue)
        self._by_peer.setdefault(peer, {})[ticket] = None
        self._all[ticket] = None

        def on_deadline() -> None:
            ticket._timer = None
            if ticket.peer:
                self.overdue_log.log(self.log, logging.WARNING, "%s closes the connection from %s: no handshake "
                                     "within %g s", self.what, label, self.deadline_s)
                ticket.close()

        ticket._timer = asyncio.get_running_loop().call_later(self.deadline_s, on_deadline)
        return ticket

    def _forget(self, ticket: Ticket) -> None:
        peer = ticket.peer
        mine = self._by_peer[peer]
        del mine[ticket]
        if not mine:
            del self._by_peer[peer]
        del self._all[ticket]


class AdmittedProtocol(asyncio.BufferedProtocol):
    """A listening daemon's connection protocol, bounded: :meth:`admit` first in ``connection_made``,
    :meth:`admitted` once the handshake is verified, :meth:`left` in ``connection_lost``. Until :meth:`admitted`
    the connection's deadline, or a newer connection that needs its place, may abort it."""

    closed: bool
    ticket: Ticket | None = None
    flow: BackPressure | None = None
    _bounded: asyncio.Transport | None = None

    def admit(self, transport: asyncio.Transport, admission: Admission, peer: str, label: str,
              write_high_bytes: int) -> None:
        """Take a place among ``admission``'s pending connections (an older one may be closed for it) and stop
        reading the peer while more than ``write_high_bytes`` wait to be written to it."""
        self._bounded = transport
        self.ticket = admission.enter(peer, label, self._handshake_overdue)
        self.flow = BackPressure(transport, write_high_bytes)

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
        """No handshake by the deadline, or a newer connection needs the place (logged by the admission): drop
        the peer, unflushed."""
        self.closed = True
        if self._bounded is not None:
            self._bounded.abort()
