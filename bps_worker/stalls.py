"""The worker daemon's stall inspector: the rounds that waited too long, in words for its log.

A round waits first for its local ranks (open in :class:`~bps_worker.local_rounds.LocalRounds`),
then, once every local rank submitted it, at the servers for the other machines' pushes (its
partitions in the links' windows). The daemon says when each phase began (:meth:`WorkerStalls.began`)
and when the round ended (:meth:`WorkerStalls.ended`: its operation is over, or it failed), and asks a few
times per timeout what to log (:meth:`WorkerStalls.warnings`); when is decided by
:class:`bps_runtime.stalls.StallWatch` (after the timeout, then every timeout). Once a round is due, it is
still waiting if it is open and not failed, or if a partition of it is still in a link's window; else it is
forgotten (one whose end was not said).
Each warning is a :class:`~bps_runtime.stalls.Stall`, told to the local ranks of its round too (those that
submitted it and those it waits for).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bps_runtime.stalls import Stall, StallWatch

from .link import ServerLink
from .local_rounds import LocalRound, LocalRounds


def local_stall(where: str, absent: Sequence[int], present: Sequence[int], rank_offset: int) -> str:
    """The stall line of a round ``where`` (its tensor, round and wait) that local ranks ``absent`` did not submit."""
    return (f"stall: {where} for {local_ranks(absent, rank_offset)}, which did not submit it; submitted by "
            f"{local_ranks(present, rank_offset)}. Every process must push every name once per round: is one stuck, "
            f"or skipping it?")


def server_stall(where: str, servers: Sequence[int]) -> str:
    """The stall line of a round ``where`` that every local rank submitted, waiting at ``servers``: for the other
    workers, or for a server that is slow or out of reach (a network cut, a frozen host: a review's case)."""
    return (f"stall: {where} at server{'s' if len(servers) > 1 else ''} {', '.join(map(str, servers))}: every "
            f"local rank submitted it; other workers have not pushed it, or the server is slow or out of reach (the "
            f"server's log names whom it waits for)")


def local_ranks(local: Sequence[int], rank_offset: int) -> str:
    """``local ranks 0, 1 (ranks 4, 5)``."""
    s = "s" if len(local) != 1 else ""
    return (f"local rank{s} {', '.join(map(str, local))} "
            f"(rank{s} {', '.join(str(rank_offset + r) for r in local)})")


class WorkerStalls:
    """When each round's current wait began, and the warnings about those that last (module docstring)."""

    __slots__ = ("watch", "worker_id", "rank_offset", "_since")

    def __init__(self, warn_after_s: float, worker_id: int, rank_offset: int) -> None:
        self.watch: StallWatch[LocalRound[Any]] = StallWatch(warn_after_s=warn_after_s)
        self.worker_id = worker_id
        self.rank_offset = rank_offset
        self._since: dict[LocalRound[Any], float] = {}

    def began(self, lr: LocalRound[Any], now: float) -> None:
        """``lr`` opened (it waits for local ranks) or started (it waits at the servers)."""
        self._since[lr] = now

    def ended(self, lr: LocalRound[Any]) -> None:
        """``lr`` waits no more (its operation ended, or it failed): forgotten now. (A round not said to have
        ended is forgotten at the first look after it became due; until then it was kept, with its ops.)"""
        self._since.pop(lr, None)

    def warnings(self, now: float, rounds: LocalRounds[Any], links: Sequence[ServerLink]) -> list[Stall]:
        """What to log now about the rounds that waited ``warn_after_s`` or more (and again later)."""
        old = [(lr, began) for lr, began in self._since.items() if now - began >= self.watch.warn_after_s]
        if not old:
            return []  # the common case, checked in one pass: no window is looked at
        pieces: dict[tuple[str, int], set[int]] = {}  # (name, server round) -> servers holding a part of it
        for link in links:
            for piece in link.window.pieces():
                pieces.setdefault((piece.push.name, piece.push.round), set()).add(link.spec.id)
        waits: dict[LocalRound[Any], float] = {}
        where: dict[LocalRound[Any], list[int]] = {}
        for lr, began in old:
            at = self._at(lr, rounds, pieces)
            if at is None:
                del self._since[lr]  # it completed or failed
            else:
                waits[lr], where[lr] = began, at
        return [Stall(self._text(lr, waited, where[lr]), tuple(sorted({*lr.members, *lr.expected})))
                for lr, waited in self.watch.due(now, waits)]

    @staticmethod
    def _at(lr: LocalRound[Any], rounds: LocalRounds[Any], pieces: dict[tuple[str, int], set[int]]
            ) -> list[int] | None:
        """Where ``lr`` waits: [] for local ranks, else the servers that hold its unanswered partitions
        (``pieces``: the links' windows); None when it waits no more."""
        if rounds.is_open(lr):
            return [] if lr.failed is None else None
        server_round = rounds.numbers.server_round(lr.name, lr.round)
        servers = pieces.get((lr.name, server_round), set()) if server_round is not None else set()
        return sorted(servers) or None

    def _text(self, lr: LocalRound[Any], waited: float, servers: list[int]) -> str:
        where = f"tensor {lr.name!r} (round {lr.round} on worker {self.worker_id}) has waited {waited:.1f} s"
        if not servers:
            return local_stall(where, sorted(lr.expected), sorted(lr.members), self.rank_offset)
        return server_stall(where, servers)
