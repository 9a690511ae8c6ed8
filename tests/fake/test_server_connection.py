"""ServerConnection driven through a fake transport: the protocol class without sockets."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from bps_server.connection import ServerConnection
from bps_server.server import ServerConfig, SummationServer
from protocol import PROTOCOL_VERSION
import dataclasses

from protocol.config import parse_config, placement_items
from protocol.frames import encode_header
from protocol.handshake import ClientHandshake, hello_proof
from protocol.messages import ROLE_WORKER, Challenge, Failure, Hello, Push, Result, Stats, StatsRequest, Welcome, to_header
from fake_transport import FakeTransport, feed as _feed


def _cluster(workers: int = 2, address: str = "127.0.0.1:9"):
    return parse_config({
        "cluster": {"workers": workers},
        "server": [{"id": 0, "address": address}],  # never bound: no socket here
        "worker": [{"id": w, "local_size": 1, "socket": f"/tmp/none{w}"} for w in range(workers)],
    })


def _server(workers: int = 2, token: bytes | None = None) -> SummationServer:
    return SummationServer(ServerConfig(_cluster(workers), 0, threads=1, token=token))


def _connect(server: SummationServer) -> tuple[ServerConnection, FakeTransport]:
    conn, transport = ServerConnection(server), FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


def _frame(message, payload: bytes = b"") -> bytes:
    return encode_header(to_header(message), len(payload)) + payload


def _workers(server: SummationServer, n: int) -> list[tuple[ServerConnection, FakeTransport]]:
    """Workers 0 to n-1, each connected and past its (tokenless) handshake."""
    conns = [_connect(server) for _ in range(n)]
    for w, (conn, _) in enumerate(conns):
        _feed(conn, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, w)))
    return conns


async def test_handshake_push_result_and_stats():
    server = _server()
    conns = [_connect(server) for _ in range(2)]
    for w, (conn, t) in enumerate(conns):
        _feed(conn, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, w)))
        assert isinstance(t.messages()[0][0], Welcome)
    for w, (conn, _) in enumerate(conns):
        data = np.full(4, w + 1, np.float32)
        push = Push(req=10 + w, name="x", part=0, round=0, worker=w, dtype="float32", shape=[4], offset=0, count=4)
        _feed(conn, _frame(push, data.tobytes()))
    await asyncio.sleep(0.05)
    for w, (_, t) in enumerate(conns):
        result, payload = t.messages()[1]
        assert isinstance(result, Result) and result.req == 10 + w
        np.testing.assert_array_equal(np.frombuffer(payload, np.float32), [3, 3, 3, 3])
    _feed(conns[0][0], _frame(StatsRequest(99)))
    stats = conns[0][1].messages()[-1][0]
    assert isinstance(stats, Stats) and stats.stats["bytes_received"] == 32 and stats.stats["rounds_completed"] == 1
    assert stats.stats["rounds_open"] == 0
    await server.stop()


async def test_rounds_open_counts_the_rounds_pushed_to_and_not_answered():
    """What the restart tests freeze a server on: a worker's push in its hands (tests/harness.py)."""
    server = _server()
    conns = _workers(server, 2)
    for name in ("a", "b"):
        push = Push(req=1, name=name, part=0, round=0, worker=0, dtype="float32", shape=[4], offset=0, count=4)
        _feed(conns[0][0], _frame(push, np.ones(4, np.float32).tobytes()))
    await asyncio.sleep(0.05)
    assert server.stats()["rounds_open"] == 2
    push = Push(req=2, name="a", part=0, round=0, worker=1, dtype="float32", shape=[4], offset=0, count=4)
    _feed(conns[1][0], _frame(push, np.ones(4, np.float32).tobytes()))
    await asyncio.sleep(0.05)
    assert server.stats()["rounds_open"] == 1 and server.stats()["rounds_completed"] == 1
    await server.stop()


@pytest.mark.parametrize("push,payload,reason", [
    (Push(req=1, name="x", part=0, round=0, worker=0, dtype="float32", shape=[4], offset=0, count=4),
     b"\0" * 12, "carries 12 bytes"),
    (Push(req=1, name="x", part=0, round=0, worker=1, dtype="int32", shape=[1], offset=0, count=1),
     b"\0" * 4, "pushed as worker 1"),
    (Push(req=1, name="x", part=1, round=0, worker=0, dtype="int32", shape=[4], offset=3, count=2),
     b"\0" * 8, "exceeds its tensor"),
], ids=["payload-size", "other-worker", "outside-tensor"])
async def test_a_bad_push_drops_the_connection(push, payload, reason):
    server = _server()
    conn, t = _connect(server)
    _feed(conn, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0)))
    _feed(conn, _frame(push, payload))
    failure = t.messages()[-1][0]
    assert isinstance(failure, Failure) and reason in failure.message and t.closed
    await server.stop()


async def test_the_first_frame_is_a_fresh_challenge_and_nothing_large_is_read_before_hello():
    server = _server()
    (c1, t1), (c2, t2) = _connect(server), _connect(server)
    first1, first2 = t1.messages(True)[0][0], t2.messages(True)[0][0]
    assert isinstance(first1, Challenge) and isinstance(first2, Challenge) and first1.nonce != first2.nonce
    # a push-sized frame before the handshake is refused from its prefix alone
    _feed(c1, encode_header({"t": "push"}, 1024))
    assert "exceeds the limit of 0 bytes" in t1.messages()[-1][0].message and t1.closed
    await server.stop()


async def test_token_is_checked_before_anything_else():
    token = b"s3cret-token-0123456789"
    server = _server(token=token)
    conn, t = _connect(server)
    _feed(conn, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0)))  # no proof
    assert "authentication failed" in t.messages()[-1][0].message and t.closed
    conn, t = _connect(server)
    wrong = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0), token=b"wrong-token-0123456789")
    _feed(conn, _frame(wrong.receive(t.messages(True)[0][0])))
    assert "a wrong proof" in t.messages()[-1][0].message and t.closed
    conn, t = _connect(server)
    right = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0), token=token, who="server 0")
    _feed(conn, _frame(right.receive(t.messages(True)[0][0])))
    welcome = t.messages()[-1][0]
    assert isinstance(welcome, Welcome) and not t.closed
    # the worker's side checks the server's proof in turn, and both hold the same session key
    established = right.receive(welcome)
    assert established.authenticated and established.session_key == conn.session_key
    await server.stop()


@pytest.mark.parametrize("change", [{"stream": 7}, {"shm": "bps_w0_1_attacker", "shm_key": "ab" * 32},
                                    {"epoch": "other"}, {"id": 1}], ids=["stream", "shm-offer", "epoch", "id"])
async def test_a_relayed_hello_with_any_field_changed_is_refused(change):
    """A relay that rewrites what a worker said (its own probe, another stream) cannot keep the proof."""
    token = b"s3cret-token-0123456789"
    server = _server(token=token)
    conn, t = _connect(server)
    hello = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0), token=token).receive(t.messages(True)[0][0])
    _feed(conn, _frame(dataclasses.replace(hello, **change)))
    failure = t.messages()[-1][0]
    assert isinstance(failure, Failure) and "authentication failed" in failure.message and t.closed
    assert conn.worker is None and not server.links and not server.streams
    await server.stop()


async def test_a_hello_proved_for_another_connection_is_refused():
    token = b"s3cret-token-0123456789"
    server = _server(token=token)
    (c1, t1), (c2, t2) = _connect(server), _connect(server)
    hello = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0), token=token).receive(t1.messages(True)[0][0])
    assert hello.auth == hello_proof(token, t1.messages(True)[0][0], dataclasses.replace(hello, auth=""))
    _feed(c2, _frame(hello))  # connection 1's proof, on connection 2 (another challenge)
    assert "authentication failed" in t2.messages()[-1][0].message and t2.closed
    await server.stop()


async def test_another_cluster_file_is_refused_with_both_digests():
    server = _server()
    conn, t = _connect(server)
    theirs = placement_items(_cluster(address="127.0.0.1:10"))
    hello = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, config_items=list(theirs)))
    _feed(conn, _frame(hello.receive(t.messages(True)[0][0])))
    failure = t.messages()[-1][0]
    assert isinstance(failure, Failure) and failure.code == "mismatch" and t.closed and conn.worker is None
    assert failure.ours and failure.theirs and failure.ours != failure.theirs
    assert failure.ours in failure.message and failure.theirs in failure.message
    assert "server.0.address is 127.0.0.1:9 at server 0, 127.0.0.1:10 at worker 0" in failure.message
    # the same file: welcomed, with the server's digest for the worker to check
    conn, t = _connect(server)
    hello = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, config_items=list(server.placement_items)))
    _feed(conn, _frame(hello.receive(t.messages(True)[0][0])))
    welcome = t.messages()[-1][0]
    assert isinstance(welcome, Welcome) and welcome.config_digest == failure.ours
    assert hello.receive(welcome).welcome is welcome
    await server.stop()


async def test_no_shared_memory_on_an_extra_stream():
    """Placement offers shared memory on stream 0 only; a probe on stream 7 is never even looked at."""
    from bps_runtime.segments import create_segment, release, segment_name

    server = _server()
    probe = create_segment(segment_name(0), 32)
    probe.buf[:32] = bytes(range(32))
    try:
        for stream, shared in ((7, False), (0, True)):
            conn, t = _connect(server)
            _feed(conn, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, stream=stream, shm=probe.name,
                                     shm_key=bytes(range(32)).hex())))
            welcome = t.messages()[-1][0]
            assert isinstance(welcome, Welcome) and welcome.shm is shared and conn.shm is shared
            assert conn.shm_uid == (os.getuid() if shared else None)
    finally:
        release(probe, unlink=True)  # (the server's attach, in this process, leaves the tracker alone)
    await server.stop()


async def test_a_message_with_no_handler_after_the_handshake_drops_the_connection():
    server = _server()
    conn, t = _connect(server)
    _feed(conn, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0)))
    _feed(conn, _frame(Challenge("abc", PROTOCOL_VERSION)))  # a server's message, from a worker
    failure = t.messages()[-1][0]
    assert isinstance(failure, Failure) and "unexpected challenge message from worker 0" in failure.message
    assert t.closed and Challenge not in ServerConnection.HANDLERS and ServerConnection.HANDLERS[Push]
    await server.stop()


async def test_fused_reports_become_one_plan_for_every_worker_and_a_mismatch_fails_both_sides():
    from protocol.messages import FuseFailed, FusePlan, FuseReady

    server = _server()
    conns = _workers(server, 2)
    f32, f16 = ["float32", [4], False, ""], ["float16", [4], False, ""]
    _feed(conns[0][0], _frame(FuseReady(["a", "b", "c"], [f32], [0, 0, 0])))
    _feed(conns[1][0], _frame(FuseReady(["c", "a", "b"], [f32, f16], [0, 0, 1])))
    await asyncio.sleep(0)  # the plans go at the end of the pass
    for w, (_, t) in enumerate(conns):
        messages = [m for m, _ in t.messages()]
        failed = [m for m in messages if isinstance(m, FuseFailed)]
        plans = [m for m in messages if isinstance(m, FusePlan)]
        assert [(f.name, f.code) for f in failed] == [("b", "mismatch")]
        assert (failed[0].ours, failed[0].theirs) == (("float32[4]", "float16[4]") if w == 0 else
                                                       ("float16[4]", "float32[4]"))
        assert [(p.seq, p.names) for p in plans] == [(0, ["c", "a"])]  # one order for both: the last report's
    await server.stop()


async def test_fused_waiting_counts_the_names_reported_by_some_workers_and_not_all():
    """The other state the restart tests freeze a server in (tests/harness.py): fused names reported to it as
    their anchor by one machine, waiting for the other's."""
    from protocol.messages import FuseReady

    server = _server()
    conns = _workers(server, 2)
    f32 = ["float32", [4], False, ""]
    _feed(conns[0][0], _frame(FuseReady(["a", "b"], [f32], [0, 0])))
    await asyncio.sleep(0)
    assert server.stats()["fused_waiting"] == 2 and server.stats()["fused_plans"] == 0
    _feed(conns[1][0], _frame(FuseReady(["b"], [f32], [0])))
    await asyncio.sleep(0)
    assert server.stats()["fused_waiting"] == 1 and server.stats()["fused_tensors"] == 1
    await server.stop()


async def test_fused_reports_on_a_second_stream_are_a_protocol_error():
    from protocol.messages import FuseReady

    server = _server()
    conn, t = _connect(server)
    _feed(conn, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, stream=1)))
    _feed(conn, _frame(FuseReady(["a"], [["float32", [4], False, ""]], [0])))
    failure = t.messages()[-1][0]
    assert isinstance(failure, Failure) and "on stream 1, not 0" in failure.message and t.closed
    await server.stop()


async def test_a_reconnect_that_replaces_the_old_connection_is_a_drop_for_fused_sums():
    """Worker 0 reconnects before its old connection's loss is seen: what it reported on the old one fails
    for the peers then (the worker fails it too), and the rounds it had not reported wait for its reports."""
    from protocol.messages import FuseFailed, FusePlan, FuseReady

    server = _server(3)
    conns = _workers(server, 3)
    f32 = ["float32", [4], False, ""]
    _feed(conns[0][0], _frame(FuseReady(["a"], [f32], [0])))
    _feed(conns[1][0], _frame(FuseReady(["a", "b"], [f32], [0, 0])))
    again, t0 = _connect(server)
    _feed(again, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0)))  # the same daemon, a new connection
    assert conns[0][1].closed and server.links[0] is again
    await asyncio.sleep(0)
    told = [m for m, _ in conns[1][1].messages() if isinstance(m, FuseFailed)]
    assert [(f.name, f.code) for f in told] == [("a", "connection"), ("b", "connection")]
    # worker 0 had not reported b: its report meets b's failure, not a new round
    t0.messages()
    _feed(again, _frame(FuseReady(["b"], [f32], [0])))
    await asyncio.sleep(0)
    assert [(m.name, m.code) for m, _ in t0.messages() if isinstance(m, (FuseFailed, FusePlan))] == [("b", "connection")]
    assert "b" not in server.fusion.waiting
    conns[0][0].connection_lost(None)  # the old connection's loss, seen late: nothing more
    assert server.links[0] is again and not server.fusion.waiting
    await server.stop()


async def test_a_worker_back_on_a_new_connection_gets_the_plans_it_lost_and_the_rounds_it_lost_fail():
    from protocol.messages import FuseFailed, FusePlan, FuseReady, FuseResync

    server = _server(2)
    conns = _workers(server, 2)
    f32 = ["float32", [4], False, ""]
    for w in (0, 1):
        _feed(conns[w][0], _frame(FuseReady(["a"], [f32], [0])))
    await asyncio.sleep(0)  # plan 0: a
    _feed(conns[1][0], _frame(FuseReady(["b"], [f32], [0])))
    conns[0][0].connection_lost(None)  # worker 0 lost plan 0, and its report of b (b waits for it)
    again, t0 = _connect(server)
    _feed(again, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0)))
    _feed(again, _frame(FuseResync(server.incarnation, ["a", "b"], [1, 1], next_plan=0)))
    await asyncio.sleep(0)
    assert [(m.seq, m.names, m.resent) for m, _ in t0.messages() if isinstance(m, FusePlan)] == [(0, ["a"], "lost")]
    # b: worker 1 heard at the drop; worker 0's lost report is failed by the resync (nobody left to tell)
    assert [(m.name, m.code) for m, _ in conns[1][1].messages() if isinstance(m, FuseFailed)] == [("b", "connection")]
    assert not server.fusion.failed and not server.fusion.waiting
    _feed(again, _frame(FuseResync("another-run", ["a"], [5], next_plan=0)))  # counts of another run: ignored
    assert len([m for m, _ in t0.messages() if isinstance(m, FusePlan)]) == 1 and not server.fusion.failed
    await server.stop()


async def test_a_fate_query_gives_an_open_round_up_before_it_answers_and_says_summed_of_the_last_sum():
    """RoundQuery.fate, from a worker whose link gave up while its pushes were out: a round still open (here with
    its push in it) is given up first, so that it cannot be summed after the answer said it was not (the
    worker's own Abort of it may have died with a connection); the key's last sum is answered 1."""
    from protocol.messages import Batch, RoundInfo, RoundQuery, split_batch

    def received(transport: FakeTransport) -> list:
        return [item for m, p in transport.messages() for item, _ in (split_batch(m, p) if isinstance(m, Batch)
                                                                      else [(m, p)])]

    server = _server()
    conns = _workers(server, 2)
    for name in ("open", "summed"):
        push = Push(req=1, name=name, part=0, round=0, worker=0, dtype="float32", shape=[4], offset=0, count=4)
        _feed(conns[0][0], _frame(push, np.ones(4, np.float32).tobytes()))
    push = Push(req=2, name="summed", part=0, round=0, worker=1, dtype="float32", shape=[4], offset=0, count=4)
    _feed(conns[1][0], _frame(push, np.ones(4, np.float32).tobytes()))
    await asyncio.sleep(0.05)
    _feed(conns[0][0], _frame(RoundQuery(7, "open", 0, fate=0)))
    _feed(conns[0][0], _frame(RoundQuery(8, "summed", 0, fate=0)))
    await asyncio.sleep(0.05)
    answers = {m.req: m.round for m in received(conns[0][1]) if isinstance(m, RoundInfo)}
    assert answers == {7: 0, 8: 1}
    late = Push(req=3, name="open", part=0, round=0, worker=1, dtype="float32", shape=[4], offset=0, count=4)
    _feed(conns[1][0], _frame(late, np.ones(4, np.float32).tobytes()))
    await asyncio.sleep(0.05)
    (failure,) = [m for m in received(conns[1][1]) if isinstance(m, Failure) and m.req == 3]
    assert failure.code == "connection" and "link to this server gave up" in failure.message
    assert server.stats()["rounds_completed"] == 1
    await server.stop()


async def test_a_new_workers_round_query_waits_for_the_others_replays_and_is_answered_as_a_rejoin():
    """A restarted server: the machine of worker 1 came back too (its hello says its numbering is fresh) and its
    process asks its first name's round before worker 0, mid-job, is back. The answer waits for worker 0's hello
    and replays (its Restored), then places worker 1 at worker 0's next round; answered at once, it was round 0
    (a job starting) and worker 1's first steps failed as stale rounds (a review's case). A round given up there
    is not where worker 0 goes next: the answer waits for its push of the name (its aborts of earlier rounds come
    first; answered at the first of them, the new machine's names were placed a step apart)."""
    from protocol.messages import Abort, RoundInfo, RoundQuery, Restored

    server = _server()
    new, new_t = _connect(server)
    _feed(new, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 1, epoch="new", fresh=True)))
    _feed(new, _frame(Restored(1)))
    _feed(new, _frame(RoundQuery(5, "w", 0, 0)))
    await asyncio.sleep(0)
    assert not [m for m, _ in new_t.messages() if isinstance(m, RoundInfo)]  # waits
    old, _ = _connect(server)
    _feed(old, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, epoch="e0", fresh=False)))
    _feed(old, _frame(Abort("w", 0, 6, 0, "given up at the server's previous run")))
    await asyncio.sleep(0)
    assert not [m for m, _ in new_t.messages() if isinstance(m, RoundInfo)]  # its replays are not all in yet
    _feed(old, _frame(Restored(0)))
    await asyncio.sleep(0)
    assert not [m for m, _ in new_t.messages() if isinstance(m, RoundInfo)]  # round 6 failed: the next is its push
    push = Push(req=1, name="w", part=0, round=7, worker=0, dtype="float32", shape=[4], offset=0, count=4)
    _feed(old, _frame(push, np.ones(4, np.float32).tobytes()))
    await asyncio.sleep(0.01)  # (re-checked once the frames read with the push are in; sent at the pass's end)
    (info,) = [m for m, _ in new_t.messages() if isinstance(m, RoundInfo)]
    assert (info.req, info.round) == (5, 7)
    await server.stop()


def _given_up_query_waiting(server: SummationServer) -> tuple[ServerConnection, FakeTransport]:
    """Worker 0 mid-job (back to this restarted server), worker 1 back from a double fault; worker 1's round
    given up beside its step's other names asks where round 0 of "w" is (RoundQuery.given_up): worker 0's
    connection, and worker 1's transport."""
    from protocol.messages import RoundQuery, Restored

    old, _ = _connect(server)
    _feed(old, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, epoch="e0", fresh=False)))
    _feed(old, _frame(Restored(0)))
    new, new_t = _connect(server)
    _feed(new, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 1, epoch="new", fresh=True)))
    _feed(new, _frame(Restored(1)))
    _feed(new, _frame(RoundQuery(5, "w", 0, 0, given_up=True)))
    return old, new_t


async def test_a_given_up_round_query_is_answered_when_the_peers_abort_makes_its_round_known():
    """A round given up beside its step's other names (RoundQuery.given_up) is placed at the peers' round, open or
    failed: the peer's Abort of it makes it known and answers the waiting query (it waited QUERY_WAIT_S: only a
    push, a hello or a Restored re-checked the waiting queries, a review's case)."""
    from protocol.messages import Abort, RoundInfo

    server = _server()
    old, new_t = _given_up_query_waiting(server)
    await asyncio.sleep(0)
    assert not [m for m, _ in new_t.messages() if isinstance(m, RoundInfo)]  # nothing known of "w" here yet
    _feed(old, _frame(Abort("w", 0, 6, 0, "cannot reach a server")))  # the peer's step failed by the same fault
    await asyncio.sleep(0.01)
    assert [(m.req, m.round) for m, _ in new_t.messages() if isinstance(m, RoundInfo)] == [(5, 6)]
    await server.stop()


async def test_a_given_up_round_query_is_answered_once_the_peers_burst_is_read_not_at_its_first_abort():
    """A peer back from a restart sends its aborts of the rounds that failed meanwhile and its next push in one
    go. The waiting query is answered after all of them: at the first abort, a round given up was placed at a
    round long past (5 instead of 7: the name's base two rounds off its step's other names')."""
    from protocol.messages import Abort, RoundInfo

    server = _server()
    old, new_t = _given_up_query_waiting(server)
    push = Push(req=1, name="w", part=0, round=7, worker=0, dtype="float32", shape=[4], offset=0, count=4)
    _feed(old, _frame(Abort("w", 0, 5, 0, "cannot reach a server")) + _frame(Abort("w", 0, 6, 0, "cannot reach"))
          + _frame(push, np.ones(4, np.float32).tobytes()))
    await asyncio.sleep(0.01)
    assert [(m.req, m.round) for m, _ in new_t.messages() if isinstance(m, RoundInfo)] == [(5, 7)]
    await server.stop()


async def test_a_waiting_round_query_is_answered_at_its_time_when_nobody_comes():
    """Nobody else comes within the wait (a job starting where a machine never came): answered as before (its
    own round), once; the worker's later queries do not wait again."""
    from bps_server import server as server_module
    from protocol.messages import RoundInfo, RoundQuery, Restored

    server = _server()
    server_module.QUERY_WAIT_S, saved = 0.05, server_module.QUERY_WAIT_S
    try:
        conn, transport = _connect(server)
        _feed(conn, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 1, epoch="e1", fresh=True)))
        _feed(conn, _frame(Restored(1)))
        _feed(conn, _frame(RoundQuery(5, "w", 0, 0)))
        await asyncio.sleep(0)
        assert not [m for m, _ in transport.messages() if isinstance(m, RoundInfo)]
        await asyncio.sleep(0.2)
        _feed(conn, _frame(RoundQuery(6, "v", 0, 0)))
        await asyncio.sleep(0)
        assert [(m.req, m.round) for m, _ in transport.messages() if isinstance(m, RoundInfo)] == [(5, 0), (6, 0)]
    finally:
        server_module.QUERY_WAIT_S = saved
    await server.stop()


async def test_a_query_kept_waiting_always_has_a_timer_to_answer_it():
    """A timer of the loop may fire a hair before the time it was set for (a coarser clock): the query it was
    for waited still, and nothing answered it ever after (a hang, found by benchmarks/double_fault.py). Every
    query kept waiting has a timer again."""
    from protocol.messages import RoundInfo, RoundQuery, Restored

    server = _server()
    conn, transport = _connect(server)
    _feed(conn, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 1, epoch="e1", fresh=True)))
    _feed(conn, _frame(Restored(1)))
    loop = asyncio.get_running_loop()
    server.waiting_queries.append((conn, RoundQuery(5, "w", 0, 0), loop.time() + 0.05))  # as if its timer fired
    server.answer_waiting_queries()  # early: it still waits
    await asyncio.sleep(0)
    assert not [m for m, _ in transport.messages() if isinstance(m, RoundInfo)]
    await asyncio.sleep(0.2)
    assert [(m.req, m.round) for m, _ in transport.messages() if isinstance(m, RoundInfo)] == [(5, 0)]
    await server.stop()


def push(conn: ServerConnection, req: int, round_: int, worker: int = 0) -> None:
    """Worker ``worker``'s push of round ``round_`` of partition 1 of "y" (4 ones) on ``conn``."""
    _feed(conn, _frame(Push(req=req, name="y", part=1, round=round_, worker=worker, dtype="float32", shape=[4],
                            offset=0, count=4), np.ones(4, np.float32).tobytes()))


def _worker_0_on_two_streams(server: SummationServer) -> tuple[ServerConnection, ServerConnection, ServerConnection,
                                                                FakeTransport]:
    """Worker 0 connected on streams 0 and 1 (numbering "e0"), and worker 1: (stream 0, worker 1, stream 1, and
    stream 1's transport)."""
    zero, other, extra = _connect(server)[0], _connect(server)[0], _connect(server)
    _feed(zero, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, epoch="e0")))
    _feed(other, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 1)))
    _feed(extra[0], _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, stream=1, epoch="e0")))
    return zero, other, extra[0], extra[1]


async def _refused_until_its_reset(extra: ServerConnection, other: ServerConnection, t1: FakeTransport,
                                   ended_round: int | None, epoch: str) -> None:
    """Worker 0's push of ``ended_round`` (None: none) on its extra connection ``extra`` is refused as of a job that
    ended; after that connection's Reset(``epoch``), its push of round 0 is summed with worker 1's (on ``other``)."""
    from protocol.messages import Reset

    if ended_round is not None:
        push(extra, 7, ended_round)
        await asyncio.sleep(0.05)
        refused = t1.messages()[-1][0]
        assert isinstance(refused, Failure) and refused.req == 7 and "of a job that ended" in refused.message
        _feed(extra, _frame(Reset(0, epoch)))
    push(extra, 8, 0)
    push(other, 9, 0, worker=1)
    await asyncio.sleep(0.05)
    assert [(m.req, m.round) for m, _ in t1.messages() if isinstance(m, Result)] == [(8, 0)], t1.messages()


@pytest.mark.parametrize("fence_first", [False, True], ids=["reset-first", "fence-first"])
async def test_a_reset_refuses_the_ended_jobs_pushes_on_another_stream_until_its_reset_there(fence_first):
    """A worker's Reset on stream 0 may overtake its ended job's last pushes on stream 1 (separate connections): those
    are refused, not summed as a round of the next job (whose first sum of the partition was then stale). Stream 1's
    own Reset says they are all in; in whichever order the two come, the next job's pushes there are summed."""
    from protocol.messages import Reset

    server = _server()
    zero, other, extra, t1 = _worker_0_on_two_streams(server)

    if fence_first:
        _feed(extra, _frame(Reset(0, "e1")))
    _feed(zero, _frame(Reset(0, "e1")))
    _feed(other, _frame(Reset(1, "f1")))  # (the job ended everywhere: the next starts at round 0)
    await _refused_until_its_reset(extra, other, t1, None if fence_first else 117, "e1")
    await server.stop()


async def test_an_older_reset_on_another_stream_does_not_end_a_newer_ones_draining():
    """Two jobs ended in a row (Resets e1 and e2 on stream 0, read first); stream 1 then says e1, behind which come
    pushes of the job e2 ended: refused too (a review's case: they were summed, and the next job's first sum of that
    partition was stale). Its e2 ends the draining."""
    from protocol.messages import Reset

    server = _server()
    zero, other, extra, t1 = _worker_0_on_two_streams(server)
    _feed(zero, _frame(Reset(0, "e1")))
    _feed(zero, _frame(Reset(0, "e2")))
    _feed(other, _frame(Reset(1, "f1")))
    _feed(extra, _frame(Reset(0, "e1")))

    await _refused_until_its_reset(extra, other, t1, 0, "e2")  # (round 0 of job e1, ended by e2's Reset)
    await server.stop()


async def test_a_reset_heard_only_from_a_hello_drains_the_other_streams_but_a_newer_streams_hello_is_not_drained():
    """Stream 0's Reset lost with its connection: its next Hello says the new numbering, and the other stream is of
    the ended job until it says so too. A stream whose Hello says a numbering stream 0 never did (newer: it came
    first) is not drained by an older Reset."""
    from protocol.messages import Reset

    server = _server()
    zero, other, extra, t1 = _worker_0_on_two_streams(server)
    again = _connect(server)[0]
    _feed(again, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, epoch="e1")))  # (replaces stream 0)
    assert extra.draining == "e1"
    _feed(extra, _frame(Reset(0, "e1")))
    assert extra.draining is None
    newer = _connect(server)[0]
    _feed(newer, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, stream=2, epoch="e3")))
    _feed(again, _frame(Reset(0, "e2")))
    assert extra.draining == "e2" and newer.draining is None
    await server.stop()
