"""The rounds a worker gave up, or heard fail, at a server, told again to a restarted run of it
(bps_worker.link: ServerLink.given_up, _tell_given_up; bps_server.rounds: RoundTable.replay).

A peer that never heard such a round fail pushes it again to the new run, which would wait for us for ever: so a
link tells a restarted server the last given-up round of each partition that no later sum followed. Nothing of
a job that ended is told in the next (it numbers rounds from 0 again); a part's sums, on its own stream, prune
what its abort (on stream 0) recorded; a mismatch keeps both sides; and a restarted server that hears such an
abort before a later round's replay still settles that replay.
"""

from __future__ import annotations

import asyncio

import numpy as np

from bps_server.rounds import Answer, RoundTable
from bps_server.rounds import Why as ServerWhy
from bps_worker.daemon import WorkerConfig, WorkerDaemon
from bps_worker.link import ServerLink, _LinkProtocol
from fake_transport import FakeTransport, reconnect_link
from protocol.config import ServerSpec, parse_config
from protocol.messages import Abort, Failure, Push, Result, Why


def _link(stream: int = 0) -> tuple[ServerLink, _LinkProtocol, FakeTransport]:
    link = ServerLink(ServerSpec(0, "127.0.0.1", 9, None), 0, credit_bytes=1 << 20, timeout=5.0,
                      max_payload_bytes=1 << 20, stream=stream)
    proto = _LinkProtocol(link)
    transport = FakeTransport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.proven = True  # (as once its Welcome is verified)
    link._proto, link._ready = proto, True
    link.incarnation = "run-1"
    return link, proto, transport


def _fields(rnd: int, part: int = 0) -> dict:
    return {"name": "w", "part": part, "round": rnd, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}


def _restart(link: ServerLink, proto: _LinkProtocol) -> FakeTransport:
    return reconnect_link(link, proto, restarted=True)


async def test_a_failure_of_the_old_jobs_push_after_a_reset_is_not_told_to_a_restarted_server_in_the_next_job():
    """Every process of the worker left mid-step: the daemon resets its links (given_up cleared), and the server
    then fails the old job's in-flight push (worker_reset fails the rounds that have waiters). That Failure must
    not be remembered: the next job numbers from 0 again, so no later sum ever prunes round 500, and a server
    restart in the next job hears Abort(w, 0, 500) (the table then opens the key at 500, failed: every push of
    the new job's rounds < 500 is 'stale')."""
    link, proto, transport = _link()
    link.push(_fields(500), memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    ((sent, _),) = transport.messages()
    link.reset()  # every local process left (WorkerDaemon._reset)
    link.on_message(proto, Failure(sent.req, "worker 0 has no training processes left", code="connection"), None)
    # The next job: its round 3 of "w" is summed, then the server restarts.
    fut = link.push(_fields(3), memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    (sent3,) = [m for m, _ in transport.messages() if isinstance(m, Push) and m.round == 3]
    link.on_message(proto, Result(sent3.req, "w", 0, 3), memoryview(np.ones(2, np.float32)).cast("B"))
    assert fut.done() and fut.exception() is None
    t2 = _restart(link, proto)
    told = [m for m, _ in t2.messages() if isinstance(m, Abort)]
    try:
        assert told == [], f"a restarted server in the new job hears the old job's round: {told}"
    finally:
        link.close()
        await asyncio.sleep(0)


async def test_an_abort_of_a_part_on_another_stream_is_pruned_by_its_later_sums():
    """Operation.wait aborts a failed part on the server's stream-0 link (host.links), but the part's pushes and
    sums travel on its own stream (Piece.stream = index % streams): stream 0's given_up entry is never pruned by
    a later sum, and every later restart of that server hears the stale Abort."""
    link0, proto0, _ = _link(0)
    link1, proto1, t1 = _link(1)
    link1.given_up = link0.given_up  # as the daemon shares them (test below)
    link0.abort("w", 1, 4, Why("gave up"))  # as Operation.wait does: host.links[server].abort(name, part, ...)
    fut = link1.push(_fields(9, part=1), memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    ((sent, _),) = t1.messages()
    link1.on_message(proto1, Result(sent.req, "w", 1, 9), memoryview(np.ones(2, np.float32)).cast("B"))
    assert fut.done() and fut.exception() is None  # rounds 5..9 of (w, 1) were summed since
    t2 = _restart(link0, proto0)
    told = [m for m, _ in t2.messages() if isinstance(m, Abort)]
    try:
        assert told == [], f"a stale Abort told to the restarted server: {told}"
    finally:
        link0.close()
        link1.close()
        await asyncio.sleep(0)


def _push(worker: int, rnd: int, replay: bool = False) -> Push:
    return Push(req=1, name="w", part=0, round=rnd, worker=worker, dtype="float32", shape=[2], offset=0, count=2,
                replay=replay)


def test_a_stale_abort_that_reaches_a_restarted_server_first_makes_it_ignore_a_later_rounds_replay():
    """Worker 1's stale Abort of round 4 (told at its reconnect) reaches the restarted server before worker 0's
    replay of round 9 (worker 0 got round 9's sum, worker 1 did not: its push of 9 is held and pushed again).
    The replay must still settle round 9: worker 1 gets the sum. On current code the table sits on failed
    round 4, ignores the replay, opens 10 for worker 0's next push, and worker 1's push of 9 is 'stale'."""
    table: RoundTable[str] = RoundTable(2)
    table.abort("w", 0, 4, 1, Why("worker 1 gave up round 4"))  # the stale Abort, first
    table.replay(_push(0, 9, replay=True), np.full(2, 7, np.float32), 0.0)
    table.push(_push(0, 10), np.ones(2, np.float32), "w0-10", 0.0)  # worker 0 goes on
    actions = table.push(_push(1, 9), np.ones(2, np.float32), "w1-9", 0.0)
    assert any(isinstance(a, Answer) for a in actions), f"worker 1's round 9 is not answered: {actions}"


async def test_a_mismatch_heard_from_the_server_and_told_again_keeps_each_side_its_own():
    """Worker 0 heard round 0 of 'w' fail as a mismatch (ours float32[2], theirs float32[3]); the Abort it tells
    a restarted server is built from that Failure, with no sides: worker 1, which re-pushes its float32[3], hears
    worker 0's tensor as its own ('ours' float32[2]), where a live abort (Why.mismatch, with sides) says
    'ours' float32[3]."""
    link, proto, transport = _link()
    link.push(_fields(0), memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    ((sent, _),) = transport.messages()
    link.on_message(proto, Failure(sent.req, "tensor 'w' mismatch: ...", code="mismatch", name="w",
                                   ours="float32[2]", theirs="float32[3]", detail="d"), None)
    t2 = _restart(link, proto)
    (abort,) = [m for m, _ in t2.messages() if isinstance(m, Abort)]
    link.close()
    await asyncio.sleep(0)
    table: RoundTable[str] = RoundTable(2)
    theirs = Push(req=1, name="w", part=0, round=0, worker=1, dtype="float32", shape=[3], offset=0, count=3)
    table.push(theirs, np.ones(3, np.float32), "w1", 0.0)
    (failed,) = table.abort("w", 0, 0, 0, ServerWhy.carried(abort, "w"))
    (fail,) = failed.fails
    assert fail.why.ours == "float32[3]", f"worker 1 hears {fail.why.ours!r} as its own tensor"


def test_a_worker_daemon_shares_one_record_of_given_up_rounds_among_a_servers_streams():
    servers = [{"id": i, "address": f"10.0.0.{i}:9000"} | ({"worker": i} if i < 4 else {}) for i in range(6)]
    workers = [{"id": i, "local_size": 1, "socket": f"/tmp/w{i}.sock"} for i in range(4)]
    daemon = WorkerDaemon(WorkerConfig(parse_config({"cluster": {"workers": 4}, "server": servers,
                                                     "worker": workers}), 0))
    assert any(len(links) > 1 for links in daemon.streams.values())
    for links in daemon.streams.values():
        assert all(link.given_up is links[0].given_up for link in links)
