"""The stall inspector's decision: which waits have gone on long enough to be logged, pure.

A training process that never submits a tensor its peers did (a hang, a slow evaluation, a bug that
skips a step) blocks them without any error: it is alive and connected, so no timeout fails the
round. As Horovod's stall inspector does, the daemons say so in their logs instead: the worker daemon
names the tensor and the local ranks that have and have not submitted it; a server names the
workers it still waits for in a round. Nothing fails: the round completes if the process comes, unless
``cluster.stall_timeout`` is set (Horovod's stall shutdown time): a round that waited that long fails then,
naming them (the watches that fail rounds for absent processes do it: ``LocalRounds.overdue_rounds``,
``FusedRounds.overdue``, ``RoundTable.sweep``, ``Planner.sweep``).

Each time a daemon looks (a few times per timeout), it passes every wait going on (a key and when
it began, on one clock) to :meth:`StallWatch.due`, which answers which to warn about now: a wait once
it is ``warn_after_s`` old, then again every ``repeat_s`` while it lasts. Waits that ended are
forgotten. Both daemons warn after ``cluster.timeout`` and repeat every timeout (Horovod: after 60 s,
repeating): the one setting a user already chose for "too long".

The lines reach the training processes too (:class:`Stall`, ``Notice``): a worker daemon tells each process
the lines about its rounds, and a server tells each worker of a round the lines about it, which the worker
passes on to its processes; each party hears one Notice a look, of a few lines whoever said them
(:class:`Notices`). A process logs them as warnings: its own output then says which of its tensors stall and
who it waits for, as Horovod's stall inspector says on rank 0, and not only a daemon's log that a systemd
journal may hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from protocol.messages import notice_lines

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class StallWatch(Generic[K]):
    """When each wait was last warned about (see the module docstring)."""

    __slots__ = ("warn_after_s", "repeat_s", "_warned")

    def __init__(self, *, warn_after_s: float, repeat_s: float | None = None) -> None:
        self.warn_after_s = warn_after_s
        self.repeat_s = warn_after_s if repeat_s is None else repeat_s
        self._warned: dict[K, float] = {}  # key -> when it was last warned about

    def due(self, now: float, waits: Mapping[K, float]) -> list[tuple[K, float]]:
        """Of ``waits`` (key -> when it began), those to warn about at ``now``, each with how long it has
        waited, oldest first; they count as warned. Keys not in ``waits`` ended: they are forgotten."""
        self._warned = {key: at for key, at in self._warned.items() if key in waits}
        due: list[tuple[K, float]] = []
        for key, began in sorted(waits.items(), key=lambda item: item[1]):
            last = self._warned.get(key)
            if now - began >= self.warn_after_s and (last is None or now - last >= self.repeat_s):
                self._warned[key] = now
                due.append((key, now - began))
        return due


def stalled(waiting: list[int], opened: float, now: float, stall_s: float, heard: Mapping[int, float]) -> bool:
    """Whether a round open since ``opened`` that waits for ``waiting`` (connected parties: local ranks, or
    workers) has stalled: ``stall_s`` (cluster.stall_timeout; 0: never) since it opened, and since each of them
    was last ``heard`` (a submission to a worker daemon; a push or a fused report to a server): one that is busy
    with its other tensors, in its own order, is not stalled however long the round waits for it (a review's
    case: every round failed where machines issued the names in other orders)."""
    if not waiting or not 0.0 < stall_s <= now - opened:
        return False
    return all(now - heard.get(w, opened) >= stall_s for w in waiting)


STALL_LINES = 10  # stall warnings logged each time a daemon looks; the rest as a count (capped)


def capped(items: Sequence[T], what: str, line: Callable[[T], str] = str, limit: int = STALL_LINES) -> list[str]:
    """The lines of the first ``limit`` of ``items`` (``line`` makes each) and, for the rest, one line that counts
    them (``what``: e.g. "rounds have waited as long"). Thousands of rounds can stall at once (a rank that lags
    with a model's whole step in flight): a line each, every look, flooded the log."""
    lines = [line(item) for item in items[:limit]]
    if len(items) > limit:
        lines.append(f"stall: {len(items) - limit} more {what} (not listed)")
    return lines


@dataclass(frozen=True, slots=True)
class Stall:
    """One stall warning: its line, and whom it is told to beside the log (a ``Notice``): the local ranks of a
    worker daemon's round (those that submitted it and those it waits for), or the workers of a server's round
    (those that pushed it and those it waits for)."""

    text: str
    told: tuple[int, ...]

    def __str__(self) -> str:
        return self.text


class Notices:
    """The stall lines each party is to be told, gathered over one look (a daemon's own, and a worker's also those
    its servers sent it) and told in one ``Notice`` a party: at most STALL_LINES lines and a count of the rest,
    whoever said them (each server's own cap let a process be told one look's lines once per server). Party
    None is every party. Holds at most STALL_LINES lines a party, whatever comes."""

    __slots__ = ("_lines", "_more")

    def __init__(self) -> None:
        self._lines: dict[int | None, list[str]] = {}
        self._more: dict[int | None, int] = {}

    def add(self, party: int | None, lines: Sequence[str]) -> None:
        kept = self._lines.setdefault(party, [])
        room = max(0, STALL_LINES - len(kept))
        kept += lines[:room]
        if len(lines) > room:
            self._more[party] = self._more.get(party, 0) + len(lines) - room

    def say(self, stalls: Sequence[Stall], what: str, log: logging.Logger) -> None:
        """A daemon's stall warnings of one look: logged (a few lines and a count: capped), and each stall's line
        kept for each party it is told to (:meth:`take`)."""
        for text in capped(stalls, what):
            log.warning("%s", text)
        for stall in stalls:
            for party in stall.told:
                self.add(party, [stall.text])

    def take(self, parties: Iterable[int]) -> dict[int, list[str]]:
        """The lines of each of ``parties`` (its own, then those for every party), fit for one Notice; all
        gathered lines are forgotten."""
        common, common_more = self._lines.pop(None, []), self._more.pop(None, 0)
        out = {}
        for party in parties:
            mine = self._lines.get(party, []) + common
            more = self._more.get(party, 0) + common_more + max(0, len(mine) - STALL_LINES)
            mine = mine[:STALL_LINES]
            if more:
                mine.append(f"stall: {more} more stall lines (not listed)")
            if mine:
                out[party] = notice_lines(mine)
        self._lines.clear()
        self._more.clear()
        return out
