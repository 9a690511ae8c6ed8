"""The worker's link to a server that goes silent (stalled, its TCP connection still up), through a fake
transport: what waits on it fails one timeout after the server's last sign of life, not after a silence
window plus a reconnect window; a server that keeps talking is never dropped; a closed connection still
gets a whole reconnect window (a restarting server must be found again)."""

from __future__ import annotations

import asyncio

import pytest

from bps_worker.cluster_file import free_ports
from bps_worker.errors import BPSConnectionError
from bps_worker.link import ServerLink, _LinkProtocol
from fake_transport import FakeTransport
from protocol.config import ServerSpec
from protocol.frames import encode_frame
from protocol.messages import Ping

TIMEOUT_S = 1.0
FIELDS = {"name": "w", "part": 0, "round": 0, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}
pytestmark = pytest.mark.timeout(30)


def _connected_link() -> tuple[ServerLink, _LinkProtocol]:
    """A link whose handshake is done (as ``_open`` leaves it) to a port where nothing listens now."""
    link = ServerLink(ServerSpec(0, "127.0.0.1", free_ports(1)[0], None), 0, credit_bytes=1 << 20,
                      timeout=TIMEOUT_S, max_payload_bytes=1 << 20)
    proto = _LinkProtocol(link)
    proto.connection_made(FakeTransport())  # type: ignore[arg-type]
    proto.proven = True  # (as once its Welcome is verified)
    link._proto, link._ready = proto, True
    link.incarnation = "run-1"  # a server we talked to: a broken connection holds what is in flight
    link._watch_silence(proto)
    return link, proto


def _hear(proto: _LinkProtocol, message: Ping) -> None:
    """The server's bytes arrive."""
    data = b"".join(bytes(chunk) for chunk in encode_frame(message))
    while data:
        buf = proto.get_buffer(len(data))
        n = min(len(buf), len(data))
        buf[:n] = data[:n]
        proto.buffer_updated(n)
        data = data[n:]


async def _failed_at(future: asyncio.Future[None], within_s: float) -> tuple[float, BaseException]:
    """When (loop time) ``future`` failed, and with what."""
    await asyncio.wait([future], timeout=within_s)
    assert future.done(), f"still waiting after {within_s} s"
    error = future.exception()
    assert error is not None
    return asyncio.get_running_loop().time(), error


async def _beat(link: ServerLink) -> None:
    """Ping as the daemon does (a few times per timeout)."""
    while True:
        link.heartbeat()
        await asyncio.sleep(TIMEOUT_S / 4)


async def test_a_silent_server_fails_the_push_one_timeout_after_its_last_sign_of_life():
    link, proto = _connected_link()
    beats = asyncio.ensure_future(_beat(link))
    try:
        future = link.push(FIELDS, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
        at, error = await _failed_at(future, 4 * TIMEOUT_S)
    finally:
        beats.cancel()
        link.close()
    waited = at - proto.last_seen
    assert 0.95 * TIMEOUT_S <= waited <= 1.3 * TIMEOUT_S + 0.3, waited  # was about 2.25 x: silence, then reconnects
    assert isinstance(error, BPSConnectionError), error
    assert "server 0 at 127.0.0.1" in str(error) and "sent nothing for" in str(error), error


async def test_a_server_that_keeps_answering_is_never_dropped():
    link, proto = _connected_link()
    beats = asyncio.ensure_future(_beat(link))
    try:
        future = link.push(FIELDS, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
        loop = asyncio.get_running_loop()
        until = loop.time() + 3 * TIMEOUT_S  # slow: no sum for three timeouts, but it answers the pings
        seq = 0
        while loop.time() < until:
            _hear(proto, Ping(seq))
            seq += 1
            await asyncio.sleep(TIMEOUT_S / 4)
        assert not future.done() and link._proto is proto
        quiet = proto.last_seen  # from now on it says nothing
        at, error = await _failed_at(future, 4 * TIMEOUT_S)
    finally:
        beats.cancel()
        link.close()
    assert 0.95 * TIMEOUT_S <= at - quiet <= 1.3 * TIMEOUT_S + 0.3, at - quiet
    assert isinstance(error, BPSConnectionError) and "sent nothing for" in str(error), error


async def test_a_closed_connection_still_gets_a_whole_reconnect_window():
    link, proto = _connected_link()
    try:
        future = link.push(FIELDS, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
        await asyncio.sleep(TIMEOUT_S / 2)  # the server was last heard at the start
        closed = asyncio.get_running_loop().time()
        proto.connection_lost(None)  # a server that died (and may be restarting): its host closed the connection
        assert not future.done()  # held while the link retries
        at, error = await _failed_at(future, 4 * TIMEOUT_S)
    finally:
        link.close()
    # (the retries stop once the next doubled delay would pass the deadline: here after 0.75 s)
    assert 0.7 * TIMEOUT_S <= at - closed <= 1.3 * TIMEOUT_S + 0.3, at - closed
    assert isinstance(error, BPSConnectionError) and "connection to server 0 at" in str(error) and "cannot reach it" in str(error), error


async def test_a_connection_the_server_closes_as_it_opens_is_a_connection_error(monkeypatch):
    """A server over its bound of pending connections closes the oldest (bps_runtime.admission); one closed
    before ``_open`` got to it made uvloop raise RuntimeError ('the handler is closed'), logged as a bug of
    ours with its traceback ('connection attempt failed'). It is a closed connection, tried again as any."""
    link = ServerLink(ServerSpec(0, "127.0.0.1", free_ports(1)[0], None), 0, credit_bytes=1 << 20,
                      timeout=TIMEOUT_S, max_payload_bytes=1 << 20)
    loop = asyncio.get_running_loop()

    class ClosedAtOnce(FakeTransport):
        def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
            if self.closed:
                raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    async def connect(factory, host, port):  # type: ignore[no-untyped-def]
        proto = factory()
        transport = ClosedAtOnce()
        proto.connection_made(transport)
        transport.abort()
        return transport, proto

    monkeypatch.setattr(loop, "create_connection", connect)
    with pytest.raises(ConnectionError, match="connection closed as it opened"):
        await link._open(loop.time() + TIMEOUT_S)
