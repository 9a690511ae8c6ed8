"""A daemon's health: the probes' decisions (pure) and the event loop's pulse that feeds them.

Theory of operation. The event loop runs a :class:`Pulse`: every ``PULSE_INTERVAL_S`` (or half the
systemd watchdog period, if shorter) it asks the daemon for its :class:`Verdict` (why it is not ready,
if it is not; what it waits for), and publishes a :class:`Health` snapshot stamped with the time of that
beat, by replacing one attribute. Everything that judges the daemon from outside reads that snapshot
and never the daemon's own state, so it needs no lock and cannot race the loop:

- ``GET /livez`` (:func:`livez`): 503 once the latest beat is older than ``stall_limit_s``: the loop
  stalled (a busy callback, a deadlock, a blocking call). A stopped process (SIGSTOP) answers nothing
  at all: a probe's timeout is its failure.
- ``GET /readyz`` (:func:`readyz`): 503 with the daemon's reason, or with the stall, since a stalled
  loop's verdict is stale.
- systemd: ``WATCHDOG=1`` is sent from the beat itself, so that a stalled loop stops the pings and
  systemd's ``WatchdogSec=`` restarts the daemon; ``STATUS=`` is sent whenever the status line changes (one
  dropped on a full notify socket goes again at the next beat).

The clock is ``time.monotonic`` (the HTTP thread compares the beat with it); the decisions take the
time as an argument.

:func:`from_environment` checks, at start, what a daemon takes from its environment (its command line reads
it): its id (:mod:`bps_runtime.identity`), the notify socket and the watchdog's period.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Final, Mapping

from .identity import Resolved, daemon_id
from .lifecycle import sd_notify

log = logging.getLogger("bps.health")

# How often the loop publishes its health when no watchdog asks for more.
PULSE_INTERVAL_S: Final = 1.0
# /livez fails once the loop has not beaten for this long (``--stall-limit`` of both daemons). Ten
# beats: a long garbage collection or a slow callback is not a stall; a probe's own period and failure
# threshold come on top.
STALL_LIMIT_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a daemon says of itself at a beat: ``not_ready`` is why it is not ready (None: ready);
    ``status`` is the line systemd shows (what it serves, or what it waits for)."""

    not_ready: str | None
    status: str


@dataclass(frozen=True, slots=True)
class Health:
    """The latest beat's snapshot: when (``time.monotonic()``) and the daemon's verdict then."""

    beat: float
    verdict: Verdict


def livez(health: Health | None, now: float, stall_limit_s: float) -> tuple[int, str]:
    """The liveness probe's answer, (HTTP status, one line): 503 when the loop has not beaten for
    ``stall_limit_s`` (or never did)."""
    if health is None:
        return 503, "event loop has not started its pulse"
    age = now - health.beat
    if age > stall_limit_s:
        return 503, f"event loop stalled: last beat {age:.1f} s ago (limit {stall_limit_s:g} s)"
    return 200, "ok"


def readyz(health: Health | None, now: float, stall_limit_s: float) -> tuple[int, str]:
    """The readiness probe's answer: a live loop's verdict (a stalled one's is stale: not ready)."""
    code, text = livez(health, now, stall_limit_s)
    if code != 200 or health is None:
        return code, text
    reason = health.verdict.not_ready
    return (200, "ready") if reason is None else (503, reason)


def watchdog_seconds(usec: str | None, pid: str | None, our_pid: int) -> float | None:
    """systemd's watchdog period from ``WATCHDOG_USEC``/``WATCHDOG_PID`` (as sd_watchdog_enabled reads
    them): None where there is none or it is another process's. ValueError naming a malformed value."""
    if not usec:
        return None
    if pid:
        if not pid.isdigit():
            raise ValueError(f"WATCHDOG_PID must be a process id, got {pid!r}")
        if int(pid) != our_pid:
            return None
    if not usec.isdigit() or int(usec) == 0:
        raise ValueError(f"WATCHDOG_USEC must be a positive number of microseconds, got {usec!r}")
    return int(usec) / 1e6


def watchdog_period(stall_limit_s: float, usec: str | None, pid: str | None, our_pid: int) -> float | None:
    """A daemon's settings of its health, checked at start: ``--stall-limit`` (seconds, > 0) and the
    watchdog's period (:func:`watchdog_seconds`), which it returns. ValueError naming what is wrong."""
    if not stall_limit_s > 0:
        raise ValueError(f"--stall-limit must be > 0 seconds, got {stall_limit_s:g}")
    return watchdog_seconds(usec, pid, our_pid)


class Pulse:
    """The loop's beat (see the module docstring). ``verdict`` is the daemon's, called on the loop.
    ``latest`` is read from any thread. ``watchdog_s``: systemd's period (:func:`watchdog_seconds`);
    pings go every half of it, as systemd asks."""

    def __init__(self, verdict: Callable[[], Verdict], *, notify_socket: str | None = None,
                 watchdog_s: float | None = None, interval_s: float = PULSE_INTERVAL_S) -> None:
        self._verdict = verdict
        self.notify_socket = notify_socket
        self.ping_every_s = watchdog_s / 2 if watchdog_s is not None and notify_socket else None
        self.interval_s = min(interval_s, self.ping_every_s) if self.ping_every_s is not None else interval_s
        self.latest: Health | None = None
        self._status_sent: str | None = None  # the last STATUS= line that went (one dropped goes at a later beat)
        self._next_ping = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.beat()
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def beat(self) -> None:
        now = time.monotonic()
        try:
            verdict = self._verdict()
        except Exception as exc:  # the loop is alive: a bug in a verdict makes the daemon not ready, not dead
            log.exception("internal error in the health verdict")
            verdict = Verdict(f"internal error in the health verdict: {exc!r}", "internal error in the health verdict")
        previous, self.latest = self.latest, Health(now, verdict)
        if previous is None or previous.verdict.status != verdict.status:
            log.debug("status: %s", verdict.status)
        # Until it went: a line dropped on a full socket (sd_notify never waits for these) would leave systemd
        # showing a status that is no longer true until the next change, which may never come.
        if self.notify_socket and verdict.status != self._status_sent \
                and sd_notify(f"STATUS={verdict.status}", self.notify_socket):
            self._status_sent = verdict.status
        if self.ping_every_s is not None and now >= self._next_ping:
            self._next_ping = now + self.ping_every_s
            sd_notify("WATCHDOG=1", self.notify_socket)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.beat()


@dataclass(frozen=True)
class FromEnvironment:
    """What a daemon takes from its environment, which only its command line reads and passes here: its id
    (``--id`` or the scheduler's, :mod:`bps_runtime.identity`) and systemd's notify socket and watchdog."""

    ident: Resolved
    notify_socket: str | None
    watchdog_s: float | None


def from_environment(given_id: int | None, stall_limit_s: float, env: Mapping[str, str], hostname: str,
                     pid: int) -> FromEnvironment:
    """The daemon's settings from ``env``; a ValueError (an ``IdentityError`` for the id) with the one line
    the daemon prints before it exits 2."""
    ident = daemon_id(given_id, env, hostname)
    watchdog_s = watchdog_period(stall_limit_s, env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID"), pid)
    return FromEnvironment(ident, env.get("NOTIFY_SOCKET"), watchdog_s)
