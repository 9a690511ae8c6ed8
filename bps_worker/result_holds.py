"""Results a training process was told of and has not taken yet: kept in the results arena until it has.

A ``Done`` that names the worker's results segment (an ``Op`` with ``handback`` false) tells the process where
its result lies; the process's reader thread maps that segment as the Done arrives, and says so with ``Taken``
(ahead of its next message, or when asked by a Ping: the daemon asks the holders where it waits for room).
From then on its mapping keeps the memory, whatever the daemon frees. Before that, the segment must not be freed
for room (``Arena.alloc``'s ``busy``): a process descheduled between the two would find it gone although its
round succeeded everywhere, and its call would fail.

Bounded: a hold ends when the process takes the result, when it is told of the name's next result, when it
leaves, or ``hold_s`` (the cluster's timeout) after the Done, so that a process that never reads cannot pin the
arena for ever. A result it maps after that may be gone: its call fails with an error naming the cap. An
operation that finds no room only because of holds waits for them to end (:meth:`ResultHolds.ended`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable, Iterable
from typing import Callable


class ResultHolds:
    """Per tensor name, the processes (sessions) answered with its result in the results arena, not yet taken.

    A process's Dones of one name that name one segment, one after the other, are a *run*: the process maps
    the segment at the run's first Done and keeps it mapped while the run lasts (the client's
    ``SlotMap.result_segment`` keeps a name's last results segment mapped), so it says ``Taken`` for that first
    Done only. Once it did, the run's results need no hold; until then each is held (the newest replaces the
    one before). A Done naming another segment starts a new run, held again until taken.
    """

    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._by_name: dict[str, dict[Hashable, tuple[int, float]]] = {}  # tensor -> {session: (req, deadline)}
        self._runs: dict[tuple[Hashable, str], tuple[str, int, bool]] = {}  # (session, tensor) -> (segment,
        #                                                                   its first Done's req, taken)
        self._starts: dict[tuple[Hashable, int], str] = {}  # (session, a run's first req) -> tensor
        self._ended: asyncio.Event | None = None  # set (and dropped) when a hold ends before its deadline

    def __len__(self) -> int:
        return sum(len(holders) for holders in self._by_name.values())

    def answered(self, session: Hashable, req: int, name: str, segment: str) -> None:
        """``session`` was answered ``Done(req)`` naming ``segment`` for ``name``'s result: held, unless the
        process has that segment mapped for the name already (a run it took)."""
        key = (session, name)
        run = self._runs.get(key)
        if run is None or run[0] != segment:
            if run is not None:
                self._starts.pop((session, run[1]), None)
            run = self._runs[key] = (segment, req, False)
            self._starts[(session, req)] = name
        if run[2]:
            self._end(session, name)  # (an earlier hold of the run, if it is still there)
            return
        holders = self._by_name.setdefault(name, {})
        holders[session] = (req, self._clock() + self.hold_s)

    def holders(self) -> list[Hashable]:
        """The processes (sessions) whose holds are in force: asked for their Taken where room is wanted."""
        now = self._clock()
        return list({session: None for holders in self._by_name.values()
                     for session, (_, deadline) in holders.items() if deadline > now})

    def held(self, name: str) -> bool:
        """Whether some process has yet to take ``name``'s result (and its hold has not run out)."""
        holders = self._by_name.get(name)
        if not holders:
            return False
        now = self._clock()
        return any(deadline > now for _, deadline in holders.values())

    def release(self, session: Hashable, reqs: Iterable[int]) -> None:
        """``session`` took the results of ``reqs`` (``Taken``: the first Done of a run each); a request that
        starts no current run is skipped (its name has moved to another segment since)."""
        ended = False
        for req in reqs:
            name = self._starts.pop((session, req), None)
            if name is None:
                continue
            segment, first, _ = self._runs[(session, name)]
            if first == req:
                self._runs[(session, name)] = (segment, first, True)
                ended = self._end(session, name) or ended
        if ended:
            self._signal()

    def _end(self, session: Hashable, name: str) -> bool:
        """End ``session``'s hold of ``name``, if any (whether there was one)."""
        holders = self._by_name.get(name)
        if holders is None or holders.pop(session, None) is None:
            return False
        if not holders:
            del self._by_name[name]
        return True

    def drop(self, session: Hashable) -> None:
        """``session`` left: its holds end (its mappings went with it)."""
        ended = False
        for name in [name for (who, name) in self._runs if who == session]:
            ended = self._end(session, name) or ended
            del self._runs[(session, name)]
        for start in [start for start in self._starts if start[0] == session]:
            del self._starts[start]
        if ended:
            self._signal()

    def clear(self) -> None:
        self._by_name.clear()
        self._runs.clear()
        self._starts.clear()
        self._signal()

    async def ended(self, until: float) -> bool:
        """Wait until a hold ends or runs out, but not past ``until`` (this clock's time). False at once, without
        waiting, where no hold is in force or ``until`` has passed: waiting would not make room then."""
        now = self._clock()
        deadlines = [d for holders in self._by_name.values() for _, d in holders.values() if d > now]
        if not deadlines or now >= until:
            return False
        if self._ended is None:
            self._ended = asyncio.Event()
        try:
            await asyncio.wait_for(self._ended.wait(), min(min(deadlines), until) - now)
        except asyncio.TimeoutError:
            pass
        return True

    def _signal(self) -> None:
        if self._ended is not None:
            self._ended.set()
            self._ended = None
