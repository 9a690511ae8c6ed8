"""An operation's aborts (bps_worker.operation) go to the servers only while its job still runs here.

After a reset (every local process left) the servers have failed the job's rounds already, and the next
job's rounds reuse their numbers: an abort sent then would fail the new job's round of the same name.
Seen in a fresh-clone run under load: job 2's round 0 of 'x' "aborted by worker 0" with job 1's reason.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from bps_worker.errors import AnswerLostError, BPSConnectionError
from bps_worker.local_rounds import LocalRound
from bps_worker.operation import Operation
from bps_worker.placement import Piece
from protocol.messages import Op


class RecordingLink:
    def __init__(self) -> None:
        self.aborts: list[tuple[str, int, int]] = []

    def forget(self, future: asyncio.Future[None]) -> bool:
        if not future.done():
            future.cancel()  # (as the link does)
        return True  # never in the server's hands: nothing to wait for

    def abort(self, name: str, part: int, round_: int, message: str) -> None:
        self.aborts.append((name, part, round_))


def _operation(link: RecordingLink) -> tuple[Operation, Any]:
    host = SimpleNamespace(epoch="job-1", rank_offset=0, config=SimpleNamespace(local_size=1),
                           streams={0: [link]}, links={0: link}, results=None, segments_freed=lambda names: None)
    first = Op(req=1, name="x", kind="sum", segment="seg", offset=0, dtype="float32", shape=[4])
    lr: LocalRound[Any] = LocalRound("x", 0, first, 0, set(), {0: ("session", first)})
    return Operation(host, lr), host  # type: ignore[arg-type]


async def _failed_wait(operation: Operation) -> str:
    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    failed.set_exception(BPSConnectionError("worker 0 has no training processes left", peer="worker 0"))
    error = await operation.wait([(Piece(part=0, server=0, offset=0, count=4), failed)], server_round=0)
    return str(error)


async def test_a_failed_piece_is_aborted_at_its_server_while_the_job_runs():
    link = RecordingLink()
    operation, _ = _operation(link)
    assert "no training processes left" in await _failed_wait(operation)
    assert link.aborts == [("x", 0, 0)]


async def test_no_abort_once_the_job_was_reset():
    link = RecordingLink()
    operation, host = _operation(link)
    host.epoch = "job-2"  # every process left while the pieces were out; a new job numbers from 0 again
    assert "no training processes left" in await _failed_wait(operation)
    assert link.aborts == []


def _pieces(n: int) -> list[Piece]:
    return [Piece(part=p, server=0, offset=4 * p, count=4) for p in range(n)]


async def test_an_answer_lost_with_the_connection_gives_no_piece_up_and_says_the_peers_round_was_summed():
    """A piece whose round the server summed for the peers while our answer died with the connection
    (AnswerLostError): the other pieces are not aborted (they may be summed too: then the peers' whole round
    succeeded, and a fused round of ours takes no unfused number, FusedOperation.failed_steps)."""
    link = RecordingLink()
    operation, _ = _operation(link)
    loop = asyncio.get_running_loop()
    lost, later = loop.create_future(), loop.create_future()
    lost.set_exception(AnswerLostError("server 0: round 0 was summed for the other workers"))
    loop.call_later(0.01, later.set_result, None)
    error = await operation.wait(list(zip(_pieces(2), (lost, later))), server_round=0)
    assert isinstance(error, AnswerLostError) and operation.summed_elsewhere
    assert link.aborts == [] and later.done()


async def test_an_answer_lost_beside_a_failed_piece_aborts_only_the_pieces_not_summed():
    link = RecordingLink()
    operation, _ = _operation(link)
    loop = asyncio.get_running_loop()
    lost, failed, pending = loop.create_future(), loop.create_future(), loop.create_future()
    lost.set_exception(AnswerLostError("server 0: round 0 was summed for the other workers"))
    loop.call_later(0.01, failed.set_exception, BPSConnectionError("worker 1 is disconnected", peer="worker 1"))
    error = await operation.wait(list(zip(_pieces(3), (lost, failed, pending))), server_round=0)
    assert isinstance(error, BPSConnectionError) and not isinstance(error, AnswerLostError)
    assert not operation.summed_elsewhere
    assert sorted(link.aborts) == [("x", 1, 0), ("x", 2, 0)]
