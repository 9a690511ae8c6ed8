"""What a peer sends at the receive boundary ends as one ProtocolError (a Failure that fits a frame, and a close),
never another exception escaping the protocol callback: a value nested past the interpreter's recursion limit
(msgpack decodes 1023 levels; repr() and the checks recursed past 1000), and a bad field so long that the error
naming it did not fit a frame. Found by a review of the daemons' doors (session 29); each failed before."""

from __future__ import annotations

import logging
import struct
import types

import msgpack
import pytest

from bps_server.connection import ServerConnection
from bps_server.server import ServerConfig, SummationServer
from bps_runtime.admission import Admission
from bps_worker.session import ClientSession
from protocol import PROTOCOL_VERSION
from protocol.config import parse_config
from protocol.errors import ProtocolError
from protocol.frames import decode_header
from protocol.messages import Failure, parse
from fake_transport import FakeTransport, feed

TOKEN = b"0123456789abcdef0123456789abcdef"


def _raw(header_bytes: bytes) -> bytes:
    return struct.pack("!IQ", len(header_bytes), 0) + header_bytes


def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x01"  # [[[...[1]...]]]: msgpack decodes up to 1023 levels


def _hello_nested_config_item(depth: int = 1010) -> bytes:
    # {"t": "hello", "version": V, "role": "worker", "id": 0, "config_items": [<nested list>]}, no proof
    head = msgpack.packb({"t": "hello", "version": PROTOCOL_VERSION, "role": "worker", "id": 0})
    body = bytes([head[0] + 1]) + head[1:] + msgpack.packb("config_items") + b"\x91" + _nested(depth)
    return body


def _server() -> SummationServer:
    cluster = parse_config({
        "cluster": {"workers": 1},
        "server": [{"id": 0, "address": "127.0.0.1:9"}],
        "worker": [{"id": 0, "local_size": 1, "socket": "/tmp/none0"}],
    })
    return SummationServer(ServerConfig(cluster, 0, threads=1, token=TOKEN))


def test_pure_parse_of_a_nested_hello_raises_a_protocol_error():
    with pytest.raises(ProtocolError):
        parse(decode_header(_hello_nested_config_item()))


def test_pure_parse_of_a_nested_push_shape_raises_a_protocol_error():
    head = msgpack.packb({"t": "push", "req": 1, "name": "x", "part": 0, "round": 0, "worker": 0,
                          "dtype": "float32", "offset": 0, "count": 0})
    body = bytes([head[0] + 1]) + head[1:] + msgpack.packb("shape") + b"\x91" + _nested(1010)
    with pytest.raises(ProtocolError):
        parse(decode_header(body))


async def test_server_stranger_nested_hello_gets_a_failure_not_an_escaping_exception():
    server = _server()
    conn, t = ServerConnection(server), FakeTransport()
    conn.connection_made(t)  # type: ignore[arg-type]
    try:
        feed(conn, _raw(_hello_nested_config_item()))
        assert t.closed and isinstance(t.messages()[-1][0], Failure)
    finally:
        await server.stop()


async def test_server_stranger_long_type_gets_a_failure_not_an_escaping_exception():
    server = _server()
    conn, t = ServerConnection(server), FakeTransport()
    conn.connection_made(t)  # type: ignore[arg-type]
    try:
        # 16 KiB header, the most a stranger may send: its repr is 4x as long, the Failure over 64 KiB
        feed(conn, _raw(msgpack.packb({"t": "\x00" * 16378})))
        assert t.closed and isinstance(t.messages()[-1][0], Failure)
    finally:
        await server.stop()


async def test_worker_session_long_type_gets_a_failure_not_an_escaping_exception():
    daemon = types.SimpleNamespace(
        worker_id=0, arena_bytes=1 << 20, sessions={}, connections=set(), fusion_bytes=0, rank_offset=0,
        admission=Admission(logging.getLogger("x"), "worker 0's socket"),
        config=types.SimpleNamespace(segment_mode=0o600, local_size=1),
        session_lost=lambda s: None, segments_freed=lambda names: None)
    session, t = ClientSession(daemon), FakeTransport()  # type: ignore[arg-type]
    session.connection_made(t)  # type: ignore[arg-type]
    feed(session, _raw(msgpack.packb({"t": "\x00" * 60000})))
    session._flush()
    assert t.closed and isinstance(t.messages()[-1][0], Failure)
