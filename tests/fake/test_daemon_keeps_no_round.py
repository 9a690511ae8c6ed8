"""A worker daemon keeps nothing of a local round once it is over (bps_worker.daemon, .local_rounds, .stalls).

Each opened round used to arm a timer of a whole cluster timeout (the watch for processes that are not even
connected), and the stall inspector kept every round until it first looked at it after the timeout: a daemon
held every round of the last 30 s, with its ops and closures (about 60 MB a worker daemon after 20,000 small
sums a few seconds apart), and the collector walked them. The watch now runs over the open rounds on the
daemon's tick, and the inspector forgets a round when the daemon says it ended.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any, AsyncIterator

import pytest

from bps_worker.daemon import WorkerDaemon
from bps_worker.errors import BPSError
from bps_worker.local_rounds import LocalRound
from fake_transport import FakeSession, worker_daemon
from protocol.messages import Failure, Op


@pytest.fixture
async def made() -> AsyncIterator[list[WorkerDaemon]]:
    """The daemons a test made: their links closed and their tasks ended before the test's loop closes (its
    teardown waited 30 s, the cluster's timeout, under pytest -n: a link still connecting, started by a task
    that the loop's own cancelling of every task set off again)."""
    daemons: list[WorkerDaemon] = []
    yield daemons
    for daemon in daemons:
        for link in daemon.all_links:
            link.close()
        for task in list(daemon.tasks):
            task.cancel()
        if daemon.tasks:
            await asyncio.wait(list(daemon.tasks), timeout=5.0)


def _daemon(local_size: int, made: list[WorkerDaemon]) -> WorkerDaemon:
    daemon: WorkerDaemon = worker_daemon(local_size)
    made.append(daemon)

    def unreachable(name: str, local_round: int) -> asyncio.Future[int]:  # no server runs here
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        future.set_exception(BPSError("server 1 is unreachable"))
        future.exception()  # (retrieved: a round whose base nobody awaits logs nothing)
        return future

    daemon.round_base = unreachable  # type: ignore[method-assign]
    return daemon


def _holders(obj: Any, *known: Any) -> list[str]:
    """What refers to ``obj`` besides ``known`` and this test (its coroutine)."""
    gc.collect()
    ignore = {id(k) for k in known} | {id(asyncio.current_task().get_coro())}  # type: ignore[union-attr]
    return [type(r).__name__ for r in gc.get_referrers(obj)
            if id(r) not in ignore and not isinstance(r, type(gc.get_referrers)) and type(r).__name__ != "frame"]


async def test_a_round_that_ended_is_kept_by_nothing(made):
    daemon = _daemon(1, made)
    session = FakeSession(0)
    op = Op(req=1, name="w", kind="sum", segment="seg", offset=0, dtype="float32", shape=[4])
    daemon.submit(session, op)  # opened and ready at once (one local process); its round cannot be learned
    (lr,) = daemon.stalls._since  # the inspector follows it
    assert isinstance(lr, LocalRound)
    await asyncio.wait(list(daemon.tasks), timeout=5.0)
    await asyncio.sleep(0)
    (answer,) = session.answers
    assert isinstance(answer, Failure) and "server 1 is unreachable" in answer.message
    assert not daemon.stalls._since and not daemon.rounds.open
    assert _holders(lr) == [], "an ended round is still referred to"


async def test_an_open_round_is_kept_by_the_rounds_alone_and_failed_by_the_tick_watch(made):
    daemon = _daemon(2, made)
    session = FakeSession(0)
    daemon.sessions[0] = session  # type: ignore[assignment]  # local rank 1 never connects
    op = Op(req=1, name="w", kind="sum", segment="seg", offset=0, dtype="float32", shape=[4])
    daemon.submit(session, op)
    (lr,) = daemon.rounds.open["w"]
    assert sorted(_holders(lr, daemon.rounds.open["w"], daemon.stalls._since)) == [], \
        "an open round is referred to by more than the rounds and the stall inspector (a timer per round?)"
    assert lr.opened_at is not None
    now = lr.opened_at + daemon.config.cluster.timeout
    assert daemon.rounds.overdue_rounds(daemon.sessions.keys(), now - 0.1, daemon.config.cluster.timeout) == []
    daemon._execute(daemon.rounds.overdue_rounds(daemon.sessions.keys(), now, daemon.config.cluster.timeout))
    assert not daemon.stalls._since
    await asyncio.wait(list(daemon.tasks), timeout=5.0)  # (answered once the abort is queued, or cannot be)
    (answer,) = session.answers
    assert isinstance(answer, Failure) and "rank 1 of worker 0 is not connected" in answer.message
