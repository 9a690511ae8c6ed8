"""ServerConnection driven through a fake transport: the protocol class without sockets."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bps_server.connection import ServerConnection
from bps_server.server import ServerConfig, SummationServer
from protocol import PROTOCOL_VERSION
from protocol.config import parse_config
from protocol.frames import FrameReader, encode_header
from protocol.messages import ROLE_WORKER, Challenge, Failure, Hello, Push, Result, Stats, StatsRequest, Welcome, auth_digest, parse, to_header


class FakeTransport:
    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def writelines(self, chunks: list) -> None:
        for c in chunks:
            self.data += bytes(c)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str) -> object:
        return ("127.0.0.1", 1)

    def messages(self, with_challenge: bool = False) -> list:
        reader = FrameReader()
        out = [(parse(f.header), f.payload) for f in reader.receive_data(bytes(self.data))]
        return out if with_challenge else [(m, p) for m, p in out if not isinstance(m, Challenge)]


def _server(workers: int = 2, token: bytes | None = None) -> SummationServer:
    cluster = parse_config({
        "cluster": {"workers": workers},
        "server": [{"id": 0, "address": "127.0.0.1:9"}],  # never bound: no socket here
        "worker": [{"id": w, "local_size": 1, "socket": f"/tmp/none{w}"} for w in range(workers)],
    })
    return SummationServer(ServerConfig(cluster, 0, threads=1, token=token))


def _connect(server: SummationServer) -> tuple[ServerConnection, FakeTransport]:
    conn, transport = ServerConnection(server), FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


def _feed(conn: ServerConnection, data: bytes) -> None:
    view = memoryview(data)
    while view:
        buf = conn.get_buffer(-1)
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        view = view[n:]
        conn.buffer_updated(n)


def _frame(message, payload: bytes = b"") -> bytes:
    return encode_header(to_header(message), len(payload)) + payload


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
    nonce = t.messages(True)[0][0].nonce
    _feed(conn, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, auth=auth_digest(b"wrong-token-0123456789", nonce,
                                                                                "worker", 0))))
    assert "a wrong proof" in t.messages()[-1][0].message and t.closed
    conn, t = _connect(server)
    nonce = t.messages(True)[0][0].nonce
    _feed(conn, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, auth=auth_digest(token, nonce, "worker", 0))))
    assert isinstance(t.messages()[-1][0], Welcome) and not t.closed
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
