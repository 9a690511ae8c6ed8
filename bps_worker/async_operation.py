"""One local round of an asynchronous name: the machine's delta (or its init) pushed to the values' servers.

The stages are :class:`~bps_worker.operation.Operation`'s (gather: the local processes' deltas summed, or the
root's tensor for an init; scatter; wait; hand back; reply), with three differences:

* no round to learn: each piece is a key of the servers' value store (``bps_server.values``), and its push
  carries this machine's *step* for that key. The init's answer says, per key, the last step of ours that
  the value holds (``Result.applied``); the steps go on from there, one per local round, so a worker
  daemon that rejoins a running job (its rounds counted from 0 again) is not taken for a replay;
* every piece travels on the server's first link (stream 0), where a restarted server gets our copies of
  the values before anything else (``bps_worker.link``, ``Restored``);
* a failure is not told to the servers: an asynchronous push has no round that peers wait for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.messages import KIND_ASYNC_INIT, Failure, Result

from .errors import BPSError
from .link import ServerLink
from .local_rounds import LocalRound
from .operation import Operation, OperationHost, Scattered
from .placement import Piece
from .session import ClientSession


@dataclass(slots=True)
class AsyncName:
    """What this machine knows of an asynchronous name: per part, the step of local round 0 (the step of a
    local round is ``base[part] + round``), and the staleness bound its init set (-1: none)."""

    staleness: int
    base: dict[int, int] = field(default_factory=dict)


class AsyncOperation(Operation):
    """An ``async_init`` or ``async`` local round (see the module docstring)."""

    ABORTS = False

    def __init__(self, host: OperationHost, lr: LocalRound[ClientSession], names: dict[str, AsyncName]) -> None:
        super().__init__(host, lr)
        self.names = names
        self.worker = host.config.worker_id
        self.init = self.op.kind == KIND_ASYNC_INIT
        self.applied: dict[int, int] = {}  # an init's answer: per part, our last step in the value
        if self.init:
            self.on_result = self._learn

    async def learn_round(self) -> int | None:
        """Our local round (each piece's step follows from it); None, every member answered, for a push of
        a name this machine has not initialised in this job."""
        if not self.init and self.name not in self.names:
            self.host.counters.ops_failed += 1
            reason = (f"tensor {self.name!r}: async_push_pull before async_init on worker {self.worker} in this "
                      f"job; call async_init first")
            self.answer_failure(lambda req, _: Failure(req, reason, code="bad_request"))
            return None
        self.server_round = self.local_round
        return self.local_round

    def push_fields(self, piece: Piece, server_round: int) -> dict[str, Any]:
        fields = super().push_fields(piece, server_round)
        if self.init:
            fields.update(staleness=self.op.staleness)
            return fields
        known = self.names[self.name]
        base = known.base.get(piece.part)
        if base is None:
            raise BPSError(f"tensor {self.name!r}: part {piece.part} was not initialised (async_init with another "
                           f"shape?)")
        fields.update(round=base + server_round, staleness=known.staleness)
        return fields

    def link_for(self, piece: Piece) -> ServerLink:
        return self.host.links[piece.server]

    def _learn(self, result: Result) -> None:
        if self.worker < len(result.applied):
            self.applied[result.part] = result.applied[self.worker]

    def reply_done(self, scattered: Scattered) -> None:
        if self.init:  # before the processes hear it: their next push may come in the next callback
            self.names[self.name] = AsyncName(
                self.op.staleness, {part: step - self.local_round for part, step in self.applied.items()})
        super().reply_done(scattered)
