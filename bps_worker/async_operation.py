"""One local round of an asynchronous name: the machine's delta (or its init) pushed to the values' servers.

The stages are :class:`~bps_worker.operation.Operation`'s (gather: the local processes' deltas summed, or the
root's tensor for an init; scatter; wait; hand back; reply), with three differences:

* no round to learn: each piece is a key of the servers' value store (``bps_server.values``), and its push
  carries this machine's *step* for that key. The init's answer says, per key, the last step of ours that
  the value holds (``Result.applied``); the steps go on from there, one per push that reached the servers,
  so a worker daemon that rejoins a running job (its rounds counted from 0 again) is not taken for a replay.
  (Where our processes come back to a job that went on without them, the server raised our entry to the
  furthest machine's first: see ``bps_server.values``.)
  A push refused before it was sent (another dtype or shape than the init's), or refused by the servers as a
  mismatch (nothing added), takes no step: the staleness bound compares the machines' steps, and one a step
  ahead for ever held its own answers back for ever under ``staleness=0``. A push that failed otherwise
  (a lost connection, a peer declared dead) may have been added: its step is taken, and the next one skips;
* every piece travels on the server's first link (stream 0), where a restarted server gets our copies of
  the values before anything else (``bps_worker.link``, ``Restored``);
* a failure is not told to the servers: an asynchronous push has no round that peers wait for;
* every piece names the job of this machine's processes (``Push.job``, from their hellos): a server holds a
  value for one job, so the next job's init is not taken for a rejoin of the last one's value where a machine
  of the last job still lingers (``bps_server.values``, "Jobs").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import asyncio

from protocol.messages import KIND_ASYNC_INIT, Failure, Result, describe_spec

from .errors import BPSError, BPSMismatchError, failure_from_error
from .link import ServerLink
from .local_rounds import LocalRound
from .operation import Operation, OperationHost, Scattered
from .placement import Piece
from .session import ClientSession


@dataclass(slots=True)
class AsyncName:
    """What this machine knows of an asynchronous name: the staleness bound its init set (-1: none), its
    dtype and shape, and per part the step its next push carries."""

    staleness: int
    dtype: str
    shape: tuple[int, ...]
    next_step: dict[int, int] = field(default_factory=dict)


class AsyncOperation(Operation):
    """An ``async_init`` or ``async`` local round (see the module docstring)."""

    ABORTS = False

    def __init__(self, host: OperationHost, lr: LocalRound[ClientSession], names: dict[str, AsyncName]) -> None:
        super().__init__(host, lr)
        self.names = names
        self.worker = host.config.worker_id
        self.init = self.op.kind == KIND_ASYNC_INIT
        self.job = host.job  # of the processes whose round this is (the servers hold a value for one job)
        self.applied: dict[int, int] = {}  # an init's answer: per part, our last step in the value
        if self.init:
            self.on_result = self._learn

    async def learn_round(self) -> int | None:
        """Our local round (each piece's step follows from it); None, every member answered, for a push of
        a name this machine has not initialised in this job."""
        known = None if self.init else self.names.get(self.name)
        if not self.init and known is None:
            self.host.counters.ops_failed += 1
            reason = (f"tensor {self.name!r}: async_push_pull before async_init on worker {self.worker} in this "
                      f"job; call async_init first")
            self.answer_failure(lambda req, _: Failure(req, reason, code="bad_request"))
            return None
        if known is not None and (known.dtype, known.shape) != (self.op.dtype, tuple(self.op.shape)):
            self.host.counters.ops_failed += 1  # (refused here, before any piece is pushed: no step is taken)
            ours, theirs = (describe_spec((dtype, shape, False, "")) for dtype, shape in
                            ((self.op.dtype, tuple(self.op.shape)), (known.dtype, known.shape)))
            error = BPSMismatchError(f"async_init on worker {self.worker} made it {theirs}; a delta is {ours}",
                                     name=self.name, ours=ours, theirs=theirs)
            self.answer_failure(lambda req, _: failure_from_error(req, error))
            return None
        self.server_round = self.local_round
        return self.local_round

    def push_fields(self, piece: Piece, server_round: int) -> dict[str, Any]:
        fields = super().push_fields(piece, server_round)
        fields["job"] = self.job
        if self.init:
            fields["staleness"] = self.op.staleness
            return fields
        known = self.names[self.name]
        step = known.next_step[piece.part]
        known.next_step[piece.part] = step + 1  # taken as the piece is pushed (given back if refused: see wait)
        fields.update(round=step, staleness=known.staleness)
        return fields

    async def wait(self, futures: list[tuple[Piece, asyncio.Future[None]]], server_round: int) -> BPSError | None:
        error = await super().wait(futures, server_round)
        known = None if self.init else self.names.get(self.name)
        if known is not None:  # a push the servers refused as a mismatch added nothing: its step is free again
            for piece, future in futures:
                if future.done() and not future.cancelled() and isinstance(future.exception(), BPSMismatchError):
                    known.next_step[piece.part] -= 1
        return error

    def link_for(self, piece: Piece) -> ServerLink:
        return self.host.links[piece.server]

    def _learn(self, result: Result) -> None:
        if self.worker < len(result.applied):
            self.applied[result.part] = result.applied[self.worker]

    def reply_done(self, scattered: Scattered) -> None:
        # Before the processes hear it: their next push may come in the next callback. Not where the job ended here
        # meanwhile (an init answered after every process left would be the next job's, which never made it).
        if self.init and self._job_current():
            self.names[self.name] = AsyncName(self.op.staleness, self.op.dtype, tuple(self.op.shape),
                                              {part: step + 1 for part, step in self.applied.items()})
        super().reply_done(scattered)
