"""ServerConnection with a fake transport: what a stranger may take before its handshake (issue 14, item 5),
back-pressure on a peer that does not read, and one daemon per worker id (item 6)."""

from __future__ import annotations

import asyncio
import logging

from bps_server.connection import HOLDER_SILENCE_FRACTION, WRITE_BUFFER_HIGH_BYTES, ServerConnection
from bps_server.server import ServerConfig, SummationServer
from fake_transport import FakeTransport, feed as _feed
from protocol import PROTOCOL_VERSION
from protocol.config import parse_config
from protocol.frames import RECEIVE_BUFFER_BYTES, encode_message
from protocol.handshake import HANDSHAKE_BUFFER_BYTES
from protocol.messages import ROLE_OBSERVER, ROLE_WORKER, Failure, Hello, Welcome


class Transport(FakeTransport):
    """A fake transport from ``host:port`` that records flow control."""

    def __init__(self, host: str = "10.0.0.1", port: int = 40000) -> None:
        super().__init__()
        self.peername = (host, port)
        self.limits: tuple[int | None, int | None] = (None, None)
        self.reading = True
        self.aborted = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self.peername if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.limits = (high, low)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def abort(self) -> None:
        self.aborted = True
        super().abort()


def _server(timeout: float = 8.0, **config) -> SummationServer:
    cluster = parse_config({
        "cluster": {"workers": 2, "timeout": timeout},
        "server": [{"id": 0, "address": "127.0.0.1:9"}],  # never bound: no socket here
        "worker": [{"id": w, "local_size": 1, "socket": f"/tmp/none{w}"} for w in range(2)],
    })
    return SummationServer(ServerConfig(cluster, 0, threads=1, **config))


def _connect(server: SummationServer, host: str = "10.0.0.1", port: int = 40000) -> tuple[ServerConnection, Transport]:
    conn, transport = ServerConnection(server), Transport(host, port)
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


def _hello(conn: ServerConnection, worker: int = 0, **fields) -> object:
    """Send worker ``worker``'s Hello; the server's answer (a Welcome, or a Failure) or None."""
    transport = conn.transport
    assert isinstance(transport, Transport)
    before = len(transport.messages())
    _feed(conn, encode_message(Hello(PROTOCOL_VERSION, ROLE_WORKER, worker, **fields)))
    answers = transport.messages()[before:]
    return answers[0][0] if answers else None


# -- before the handshake ------------------------------------------------------------------------------

async def test_a_stranger_gets_a_small_buffer_and_a_worker_the_full_one():
    server = _server()
    worker, _ = _connect(server)
    observer, _ = _connect(server, port=40001)
    assert worker.reader.buffer_bytes == observer.reader.buffer_bytes == HANDSHAKE_BUFFER_BYTES
    assert isinstance(_hello(worker, 0), Welcome)
    assert worker.reader.buffer_bytes == RECEIVE_BUFFER_BYTES
    _feed(observer, encode_message(Hello(PROTOCOL_VERSION, ROLE_OBSERVER, 0)))
    assert observer.observer and observer.reader.buffer_bytes == HANDSHAKE_BUFFER_BYTES  # stats requests only
    await server.stop()


async def test_pending_connections_are_bounded_per_host_and_in_all(caplog):
    """Over a bound, the oldest pending connection that counts against it is closed for the new one."""
    caplog.set_level(logging.WARNING, "bps.server")
    server = _server(pending_per_host=3, pending_total=5)
    first = [_connect(server, "10.0.0.1", 40000 + i) for i in range(3)]
    conn, t = _connect(server, "10.0.0.1", 40099)
    assert not t.closed and conn in server.connections  # the newest waits its turn ...
    oldest, old_t = first.pop(0)
    assert old_t.aborted and oldest.closed  # ... and the oldest from that host is closed
    oldest.connection_lost(None)
    assert oldest not in server.connections
    first.append((conn, t))
    others = [_connect(server, "10.0.0.2", 41000 + i) for i in range(2)]
    assert not any(t.closed for _, t in first + others)
    _, t = _connect(server, "10.0.0.3", 42000)
    assert not t.closed and first[0][1].aborted  # five pending in all: the oldest of all goes
    assert "server 0 closes the connection from 10.0.0.1:40000, pending for " in caplog.text
    assert "for a new one from 10.0.0.1:40099: 3 connections from 10.0.0.1 have not finished their handshake " \
           "(at most 3 per peer)" in caplog.text
    assert "for a new one from 10.0.0.3:42000: 5 connections have not finished their handshake (at most 5)" \
           in caplog.text
    # A finished handshake, or a connection gone, frees a place.
    first[0][0].connection_lost(None)
    assert isinstance(_hello(first[1][0], 0), Welcome)
    first[2][0].connection_lost(None)
    assert server.admission.pending == 3
    assert not _connect(server, "10.0.0.1", 40100)[1].closed
    assert not _connect(server, "10.0.0.1", 40101)[1].closed
    assert server.admission.pending == 5
    assert server.stats()["pending_connections"] == 5 and server.stats()["refused_connections"] == 2
    await server.stop()


async def test_a_connection_without_a_hello_is_closed_at_the_deadline(caplog):
    caplog.set_level(logging.WARNING, "bps.server")
    server = _server(handshake_deadline_s=0.1)
    idle, t_idle = _connect(server, port=40001)
    quick, t_quick = _connect(server, port=40002)
    assert isinstance(_hello(quick, 1), Welcome)
    for _ in range(100):
        if t_idle.closed:
            break
        await asyncio.sleep(0.05)
    assert t_idle.aborted and idle.closed and not t_quick.closed
    assert "server 0 closes the connection from 10.0.0.1:40001: no handshake within 0.1 s" in caplog.text
    idle.connection_lost(None)
    assert server.admission.pending == 0
    await server.stop()


async def test_the_handshake_deadline_is_a_constant_whatever_the_timeout():
    """A stranger is closed at the deadline, never a worker failed: a short cluster timeout on a loaded
    machine must not cut an honest handshake short."""
    assert _server(timeout=1.0).admission.deadline_s == _server(timeout=300.0).admission.deadline_s == 10.0


async def test_reading_pauses_while_the_write_buffer_is_over_the_mark():
    server = _server()
    conn, t = _connect(server)
    assert t.limits[0] is not None and t.limits[0] >= WRITE_BUFFER_HIGH_BYTES
    assert t.limits[0] >= server.config.cluster.credit_bytes  # an honest worker never meets it
    conn.pause_writing()  # what asyncio calls above the mark
    assert not t.reading
    conn.resume_writing()
    assert t.reading
    await server.stop()


# -- one daemon per worker id ---------------------------------------------------------------------------

async def test_a_second_daemon_of_a_connected_worker_is_refused_naming_both():
    server = _server()
    holder, t_holder = _connect(server, "10.0.0.5", 50000)
    assert isinstance(_hello(holder, 0, daemon="aaaa", epoch="e1"), Welcome)
    second, t_second = _connect(server, "10.0.0.6", 50001)
    refusal = _hello(second, 0, daemon="bbbb", epoch="e2")
    assert isinstance(refusal, Failure) and refusal.code == "duplicate" and refusal.req == -1
    for fact in ("worker 0", "10.0.0.5:50000", "daemon aaaa", "epoch e1", "10.0.0.6:50001", "daemon bbbb",
                 "epoch e2"):
        assert fact in refusal.message, (fact, refusal.message)
    assert refusal.peer == "worker 0 from 10.0.0.5:50000 (daemon aaaa, epoch e1)"
    assert t_second.closed and not t_holder.closed and server.links[0] is holder
    # Its other streams are refused too: the worker id is held by the other daemon.
    stream, t_stream = _connect(server, "10.0.0.6", 50002)
    assert isinstance(_hello(stream, 0, daemon="bbbb", epoch="e2", stream=1), Failure) and t_stream.closed
    assert (0, 1) not in server.streams
    await server.stop()


async def test_the_same_daemon_reconnects_with_any_epoch_and_replaces_its_connection():
    server = _server()
    old, t_old = _connect(server, port=50000)
    assert isinstance(_hello(old, 0, daemon="aaaa", epoch="e1"), Welcome)
    new, _ = _connect(server, port=50001)  # the daemon reset (new epoch) and its link reconnected
    assert isinstance(_hello(new, 0, daemon="aaaa", epoch="e2"), Welcome)
    assert t_old.closed and server.links[0] is new and new.epoch == "e2"
    stream, _ = _connect(server, port=50002)
    assert isinstance(_hello(stream, 0, daemon="aaaa", epoch="e2", stream=1), Welcome)
    await server.stop()


async def test_a_silent_holder_gives_the_worker_id_up():
    server = _server(timeout=8.0)
    old, t_old = _connect(server, port=50000)
    assert isinstance(_hello(old, 0, daemon="aaaa", epoch="e1"), Welcome)
    old.last_seen -= 8.0 * HOLDER_SILENCE_FRACTION + 0.5  # no ping for half the timeout: its host died
    new, _ = _connect(server, port=50001)
    assert isinstance(_hello(new, 0, daemon="bbbb", epoch="e9"), Welcome)  # the restarted daemon
    assert t_old.closed and server.links[0] is new
    # A closed holder holds nothing either.
    other, _ = _connect(server, port=50002)
    assert isinstance(_hello(other, 1, daemon="cccc"), Welcome)
    other.connection_lost(None)
    again, _ = _connect(server, port=50003)
    assert isinstance(_hello(again, 1, daemon="dddd"), Welcome)
    await server.stop()


class _SlowReader(FakeTransport):
    """A peer that reads our writes slowly: ``waiting`` bytes are still in the write buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0

    def get_write_buffer_size(self) -> int:
        return self.waiting


def test_a_paused_peer_that_drains_is_alive_and_one_that_takes_nothing_is_not():
    """While reading is paused the peer's pings wait unread: what tells the silence watch it lives is
    that our write buffer shrinks (a worker on a slow link taking a backlog of sums)."""
    from bps_runtime.backpressure import BackPressure

    t = _SlowReader()
    flow = BackPressure(t, high_bytes=1 << 20)
    t.waiting = 3 << 20
    flow.pause_writing()
    assert not flow.draining()  # nothing taken yet
    t.waiting = 2 << 20
    assert flow.draining()  # it took 1 MiB
    assert not flow.draining()  # and nothing since
    flow.resume_writing()
    t.waiting = 0
    assert not flow.draining()  # not paused: its own bytes are read, the usual watch judges it
