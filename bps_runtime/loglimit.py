"""Lines that can come by the thousand, limited: a few per interval, and a count of the rest.

A flood of connections (``bps_runtime.admission``), or a rank gone with thousands of rounds in flight (each a
failed round in the worker daemon and at the servers: 175,000 lines, 48 MB of log in 30 s, before), would
otherwise bury the lines that say what happened. :class:`LogLimit` keeps ``burst`` lines per ``interval_s``;
the next line it allows says how many it left out, and :meth:`LogLimit.flush`, called now and then, says it
for a flood that ended (no next line comes to carry the count).
"""

from __future__ import annotations

import logging
import time
from typing import Final

__all__ = ["FAILURE_LINES_BURST", "LOG_BURST", "LOG_INTERVAL_S", "LogLimit", "failed_rounds_log"]

# At most LOG_BURST lines per LOG_INTERVAL_S (the admission's lines about refused or overdue connections).
LOG_BURST: Final = 5
LOG_INTERVAL_S: Final = 10.0
# Lines about failed rounds, in each daemon: at most this many per interval, then a count.
FAILURE_LINES_BURST: Final = 10


class LogLimit:
    """At most ``burst`` lines per ``interval_s``; the next line allowed says how many were left out."""

    __slots__ = ("burst", "interval_s", "what", "_window_start", "_in_window", "suppressed")

    def __init__(self, *, burst: int = LOG_BURST, interval_s: float = LOG_INTERVAL_S,
                 what: str = "similar lines") -> None:
        self.burst = burst
        self.interval_s = interval_s
        self.what = what  # what the lines left out are, in flush's line
        self._window_start = float("-inf")
        self._in_window = 0
        self.suppressed = 0  # lines left out since the last one allowed

    def _room(self, now: float) -> bool:
        """Whether the window at ``now`` has room for a line (a new window once the interval has passed)."""
        if now - self._window_start >= self.interval_s:
            self._window_start, self._in_window = now, 0
        return self._in_window < self.burst

    def allow(self, now: float) -> bool:
        """May a line be logged now? (If so, :attr:`suppressed` says how many were left out before it.)"""
        if not self._room(now):
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

    def flush(self, logger: logging.Logger, level: int = logging.WARNING) -> None:
        """Say how many lines were left out since the last one logged, if any and if the window has room now
        (call it now and then: a flood that ended has no next line to carry the count)."""
        if self.suppressed and self._room(time.monotonic()):
            self._in_window += 1
            logger.log(level, "%d more %s left out", self.suppressed, self.what)
            self.suppressed = 0


def failed_rounds_log() -> LogLimit:
    """The limit of a daemon's lines about failed rounds (flushed from its periodic watch)."""
    return LogLimit(burst=FAILURE_LINES_BURST, what="lines about failed rounds")
