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
    """Per tensor name, the processes (sessions) answered with its result in the results arena, not yet taken."""

    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._by_name: dict[str, dict[Hashable, tuple[int, float]]] = {}  # tensor -> {session: (req, deadline)}
        self._by_req: dict[tuple[Hashable, int], str] = {}  # (session, req) -> tensor
        self._ended: asyncio.Event | None = None  # set (and dropped) when a hold ends before its deadline

    def __len__(self) -> int:
        return len(self._by_req)

    def hold(self, session: Hashable, req: int, name: str) -> None:
        """``session`` was answered ``Done(req)`` naming ``name``'s result (it replaces the name's last one)."""
        holders = self._by_name.setdefault(name, {})
        last = holders.get(session)
        if last is not None:
            self._by_req.pop((session, last[0]), None)
        holders[session] = (req, self._clock() + self.hold_s)
        self._by_req[(session, req)] = name

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
        """``session`` took the results of ``reqs`` (``Taken``); requests not held are skipped."""
        ended = False
        for req in reqs:
            name = self._by_req.pop((session, req), None)
            if name is None:
                continue
            holders = self._by_name[name]
            if holders.get(session, (None, 0.0))[0] == req:
                del holders[session]
                ended = True
                if not holders:
                    del self._by_name[name]
        if ended:
            self._signal()

    def drop(self, session: Hashable) -> None:
        """``session`` left: its holds end (its mappings went with it)."""
        reqs = [req for who, req in self._by_req if who == session]
        self.release(session, reqs)

    def clear(self) -> None:
        self._by_name.clear()
        self._by_req.clear()
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
