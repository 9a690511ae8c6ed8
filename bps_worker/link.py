"""The worker's TCP link to one Summation Service: connecting, the handshake, writing and answers.

What leaves next, and when, is decided by the link's :class:`~bps_worker.window.SendWindow` (the
priority queue, credit, pacing window and batching, sans-IO); the link does the I/O around it. A
worker may open several links (streams) to one server, see ``bps_worker.placement``.

Results are received straight into the destination the push named (a slice of the tensor's
staging buffer or of the client's segment): no copy after the socket.

Shared memory: the link to the server on this worker's own host offers it the worker's segments at
the handshake (a probe segment holding a random key). If the server can read the key, pushes name
``(segment, offset)`` of the data and of the result instead of carrying bytes, and the server
writes the sum in place: no socket copies, no loopback TCP. Such a push stays in the server's hands
until it answers it, so an abandoned one is never forgotten early (the server could still write
into the result memory); a lost connection fails it with a :class:`~bps_worker.errors.LinkBrokenError`
whose ``unanswered_shm`` is set, and the caller stops reusing that memory.

Liveness: the daemon pings every server a few times per timeout (:meth:`ServerLink.heartbeat`), and
any bytes from it are a sign of life. A connection silent for the timeout (a stalled or vanished
server that never closed it) is dropped, and the reconnect window runs from the same last sign of
life, not from the drop: a stalled server fails what waits on it about one timeout after it went
quiet (not after a silence window plus a full reconnect window). The silence is not cut shorter to
start reconnecting early: a connection we drop makes a same-run server fail the rounds that needed
us anyway, so an early drop would only turn a pause shorter than the timeout into errors.

Server restarts: every Welcome carries the server's *incarnation*, a random id of that run of it.
When a connection breaks, what is in flight is held, not failed, while the link reconnects (until
the timeout after the server's last sign of life: a closed connection is one). If the server that
answers is a new incarnation, its predecessor's state is lost: the link first *replays* the last
finished sum of every partition key it got from that server (a peer may not have received it
before the crash), then pushes again every partition still in flight (the contributions are
intact: results land in a separate buffer). If it is the same incarnation (the connection alone
broke, and the server already failed the rounds that waited for our push), the held pushes go again
marked ``resumed``, and the server answers each from its round (``bps_server.rounds``, "Dropped
connections"): the sum where the round was still open with our push in it (or without it), its failure,
or an :class:`~bps_worker.errors.AnswerLostError` where the peers got the sum and our answer died with
the connection. A held asynchronous push fails: its delta may have been applied. Round queries
sent and not answered are asked again on the new connection, whichever incarnation answers. On
stream 0 the replays end with ``Restored``, which the link's first connection sends too (it holds no
copies for a run it never talked to): a server run applies no asynchronous push before every worker
sent it (``bps_server.values``).

Authentication: every connection starts with :class:`protocol.handshake.ClientHandshake` (the Hello
carries our cluster file's placement entries). With a cluster token the server must prove it on our
nonce and this very Hello; a server that does not (a stranger on its port, a relay) is treated as a
dead one: retried within the timeout, then every push fails with a BPSConnectionError naming it. Nothing
is sent on an unproven connection: no push and no replay. A server that read another cluster file (or
speaks another protocol version) fails the pushes at once: retrying cannot mend it.

One daemon per worker id: every Hello carries this process's :func:`daemon_id`. A server that has a
live connection of our worker id from another daemon refuses us with code ``duplicate`` (its message
names the other daemon's address, id and epoch): the link logs it as an error, fails what waits at once
with that message, and tries again only one timeout later, never in a storm.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import os
import secrets
from dataclasses import dataclass
from functools import partial
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Callable, Container, Final, Sequence, cast

from protocol import PROTOCOL_VERSION
from protocol.config import ServerSpec
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.frames import BatchWriter, FrameReader, encode_frame
from protocol.handshake import (
    ClientHandshake,
    ConfigMismatchError,
    Established,
    HandshakeError,
    HandshakeRefused,
    VersionMismatchError,
)
from protocol.messages import (
    ASYNC_KINDS,
    MAX_MESSAGE_CHARS,
    ROLE_WORKER,
    Abort,
    Announce,
    Batch,
    Challenge,
    Failure,
    FuseAbort,
    FuseFailed,
    FusePlan,
    FuseReady,
    FuseResync,
    FusePast,
    FuseRunning,
    Joined,
    Hello,
    InitFailed,
    Message,
    Notice,
    Ping,
    Push,
    Release,
    Reset,
    Restored,
    Result,
    RoundInfo,
    RoundQuery,
    Welcome,
    Why,
    estimated_header_bytes,
    parse,
    split_batch,
)

from bps_runtime import segments as shm
from bps_runtime.lowat import ReceiveLowWater
from bps_runtime.timeline import Timeline, now_us

from .errors import AnswerLostError, BPSConnectionError, BPSError, LinkBrokenError, error_from_failure, why_from_error
from .window import BATCH_MAX_BYTES, Piece, SendWindow

log = logging.getLogger("bps.worker.link")

# Between connection attempts: doubling from the first to the last, until the link's timeout.
RECONNECT_DELAY_S: Final = 0.05
RECONNECT_DELAY_MAX_S: Final = 1.0
# Connections in a row that the server closed for a protocol error of ours, with nothing answered between:
# what we send again on each is what it refuses, so the link fails it instead (see ServerLink._on_failure).
REFUSED_IN_A_ROW: Final = 3

Wire = tuple[Push, memoryview | None]  # a push as written: the message and its payload (None: by reference)


@dataclass(slots=True, eq=False, kw_only=True)
class OutgoingPush(Piece):
    """One push on this link: the window's :class:`Piece` plus its bytes, its result's
    destination and its caller's future (these the link owns)."""

    push: Push
    payload: memoryview  # the partition's bytes
    dest: memoryview  # where its sum goes
    future: asyncio.Future[None]
    shm_ref: tuple[str, int] | None = None  # (segment, byte offset) of payload
    out_ref: tuple[str, int] | None = None  # (segment, byte offset) of dest
    via_shm: bool = False  # last sent as a shared-memory reference
    on_result: Callable[[Result], None] | None = None  # the caller's, before the future resolves
    # An asynchronous push's answer: the value and its vector, replayed to a restarted server. A copy, not
    # ``dest``: a server killed while it wrote the next answer into ``dest`` (in place, or a frame cut short)
    # would leave there a newer value than the vector says, and a delta would be applied twice.
    applied: list[int] | None = None
    kept: bytes = b""
    times: list[int] | None = None  # timeline: queued, sent, sum arriving
    reached: str | None = None  # the server run (incarnation) it was last sent to
    given_up: bool = False  # its caller gave it up (forget) and waits only for the server to be done with it

    def settled(self) -> bool:
        return self.future.done()  # the operation already failed elsewhere, or gave the push up


# What a worker tells an anchor of its processes' fused sums (see ControlMessages.drop_fused).
_FUSED_TOLD: Final = (FuseReady, FuseAbort, FuseResync, FusePast, FuseRunning)
# What says a round of ours to a server (with pushes): once one reached it, our numbering is not fresh there.
_NUMBERED: Final = (Abort, FuseReady, FuseAbort, FusePast, FuseRunning)


class ControlMessages:
    """A link's messages other than pushes (aborts, resets, round queries) that wait for a ready
    connection, and its round queries that wait for the server's RoundInfo."""

    __slots__ = ("_waiting", "_queries")

    def __init__(self) -> None:
        self._waiting: list[Message] = []
        self._queries: dict[int, tuple[RoundQuery, asyncio.Future[int]]] = {}

    def keep(self, message: Message) -> None:
        """``message`` goes once a connection is ready."""
        self._waiting.append(message)

    @property
    def waiting(self) -> bool:
        """Messages wait for a ready connection."""
        return bool(self._waiting)

    def take(self) -> list[Message]:
        """A connection is ready: what waited for it, in order."""
        waiting, self._waiting = self._waiting, []
        return waiting

    def ask(self, query: RoundQuery) -> asyncio.Future[int]:
        """``query`` goes out: the future of its answer."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._queries[query.req] = (query, future)
        return future

    def answer(self, info: RoundInfo) -> None:
        _, future = self._queries.pop(info.req, (None, None))
        if future is not None and not future.done():
            future.set_result(info.round)

    def ask_again(self) -> None:
        """The connection broke: every round query sent and not answered goes again on the next one. The
        answer does not depend on the connection, and a restarted server gives the one the next attempt
        would get anyway (the round the others are in, from their replays, or 0): failing the query
        would fail an operation in a restart that every push rides out."""
        others = [m for m in self._waiting if not isinstance(m, RoundQuery)]
        self._waiting = others + [q for q, f in self._queries.values() if not f.done()]

    def drop_fused(self) -> None:
        """Every local process left (a reset): what they told of fused sums and has not gone yet (reports,
        aborts, a resync, what our processes were past) is not sent. Read after the next hello, which carries
        the new processes' epoch, it would be taken for theirs (reports are matched by order then), and the
        Reset behind it says all it meant: the old processes' rounds fail."""
        self._waiting = [m for m in self._waiting if not isinstance(m, _FUSED_TOLD)]

    def fail_queries(self, exc: BPSError) -> None:
        """Fail every round query, sent or waiting (the link gave up)."""
        self._waiting = [m for m in self._waiting if not isinstance(m, RoundQuery)]
        queries, self._queries = self._queries, {}
        for _, future in queries.values():
            if not future.done():
                future.set_exception(exc)


class _LinkProtocol(asyncio.BufferedProtocol):
    """One connection's transport callbacks (bytes into the frame reader, frames and flow control to
    the link) and its own state: the handshake's two answers and when the server last sent bytes."""

    def __init__(self, link: ServerLink) -> None:
        self.link = link
        self.reader = FrameReader(max_payload_bytes=link.max_payload_bytes, payload_sink=self._payload_destination)
        self.transport: asyncio.Transport | None = None
        self.low_water: ReceiveLowWater | None = None
        self.loop = loop = asyncio.get_running_loop()  # asked once: every ask is a getpid system call
        self.challenge: asyncio.Future[Challenge] = loop.create_future()
        self.welcome: asyncio.Future[Welcome | Failure] = loop.create_future()  # or the server's refusal
        self.last_seen = loop.time()  # loop time of the last bytes from the server
        self.announced: set[str] = set()  # the segments this connection announced (Announce)
        # The server proved the token (its Welcome verified): only then is anything it sends acted on. What it
        # sends before that waits here (headers only: a payload before it is refused).
        self.proven = False
        self.early: list[Message] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_connection's: a TCP transport
        self.low_water = ReceiveLowWater(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.last_seen = self.loop.time()
        try:
            for frame in self.reader.buffer_updated(nbytes):
                self.link.on_message(self, parse(frame.header), frame.payload)
        except ProtocolError as exc:
            self.link.on_broken(self, f"server {self.link.spec.id} sent a bad frame: {exc}")
            return
        if self.low_water is not None:
            self.low_water.follow(self.reader.payload_wanted)

    def _payload_destination(self, header: dict[str, Any], nbytes: int) -> memoryview:
        if not self.proven:  # (no handshake message has one: nothing of an unproven peer is written anywhere)
            raise RemoteProtocolError(f"a payload of {nbytes} bytes before the server proved the token",
                                      what="payload before the handshake", size=nbytes)
        return self.link.payload_destination(header, nbytes)

    def pause_writing(self) -> None:
        self.link.window.pause_writing()

    def resume_writing(self) -> None:
        self.link.window.resume_writing()
        self.link.pump()

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.on_broken(self, f"lost connection to server {self.link.spec.id} at {self.link.spec.address}"
                                  + (f": {exc}" if exc else ""))


# Messages a server may send before the worker has verified its Welcome (they wait; more is refused): an honest
# one's registration of us may fail our old rounds or resend plans on the new connection before its Welcome.
MAX_EARLY_MESSAGES: Final = 256


def _handshake_message(proto: _LinkProtocol, message: Message) -> bool:
    """Whether ``message`` is part of the handshake (acted on before the server proved the token): its Challenge,
    its Welcome, or its refusal before a Welcome."""
    return isinstance(message, (Challenge, Welcome)) or (
        isinstance(message, Failure) and message.req == -1 and not proto.welcome.done())


def _hold_early(proto: _LinkProtocol, message: Message, server: int) -> None:
    """Keep what a server sent before it proved the token, for once it has (dropped with the connection if
    it never does): nothing an unproven peer says fails, answers or tells the worker anything."""
    if len(proto.early) >= MAX_EARLY_MESSAGES:
        raise RemoteProtocolError(f"server {server} sent more than {MAX_EARLY_MESSAGES} messages before it proved "
                                  f"the token", what="messages before the handshake")
    proto.early.append(message)


def _plain(push: Push) -> Push:
    """``push`` without shared-memory references: what goes with its bytes in the payload (a push made while the
    connection shared memory, sent or replayed on one that does not)."""
    if not push.segment:
        return push
    return dataclasses.replace(push, segment="", seg_offset=0, out_segment="", out_offset=0)


def write_message(transport: asyncio.Transport, message: Message, payload: memoryview | None,
                  max_payload_bytes: int) -> None:
    """Write one frame: ``message`` and its payload (nothing on a closing transport)."""
    if transport.is_closing():
        return
    transport.writelines(encode_frame(message, payload, max_payload_bytes=max_payload_bytes))


def write_batch(transport: asyncio.Transport, wires: list[Wire], max_payload_bytes: int) -> None:
    """Write several pushes as one Batch frame: their headers, then their payloads back to back (the
    window already chose them within the batch limits)."""
    if transport.is_closing():
        return
    batch = BatchWriter(max_payload_bytes=max_payload_bytes)
    for push, payload in wires:
        batch.add(push, payload)
    transport.writelines(batch.flush())


def make_probe(worker_id: int, mode: int, server_id: int) -> tuple[SharedMemory, str] | None:
    """The shared-memory offer of one handshake: a segment holding a random key that the server
    must read back (proving it shares our host and may map our segments). None if none can be made."""
    try:
        probe = shm.create_segment(shm.segment_name(worker_id), 32, mode)
    except OSError as exc:
        log.warning("cannot create a shared-memory probe (%s); server %d gets TCP", exc, server_id)
        return None
    key = os.urandom(32)
    probe.buf[:32] = key  # type: ignore[index]  # typeshed: buf is None only once closed
    return probe, key.hex()


_daemon_id: tuple[int, str] | None = None  # (pid, id) of this process: see daemon_id


def daemon_id() -> str:
    """This process's random id for its run (Hello.daemon), the same on every link and across epochs;
    a forked child gets its own."""
    global _daemon_id
    if _daemon_id is None or _daemon_id[0] != os.getpid():
        _daemon_id = (os.getpid(), secrets.token_hex(8))
    return _daemon_id[1]


def _held_elsewhere(exc: HandshakeError) -> bool:
    """The server refused us because another live daemon has our worker id (see the module docstring)."""
    return isinstance(exc, HandshakeRefused) and exc.code == "duplicate"


def _cannot_change(exc: HandshakeError) -> bool:
    """A refusal that retrying within the timeout cannot mend: the two sides read different cluster
    files or speak different protocol versions (the server says so with code ``mismatch``). Never on
    unproven words (a version said before any proof of the token: retried as from a server not up)."""
    if isinstance(exc, VersionMismatchError):
        return exc.proven
    return isinstance(exc, ConfigMismatchError) or (isinstance(exc, HandshakeRefused) and exc.code == "mismatch")


def failure_error(server_id: int, failure: Failure) -> BPSError:
    """The error a push's caller gets for the server's Failure: the subclass its code names, with the
    server's facts (:func:`~bps_worker.errors.error_from_failure`, never the text), saying which server."""
    where = f"server {server_id}"
    return error_from_failure(Failure(
        failure.req, f"{where}: {failure.message}"[:MAX_MESSAGE_CHARS], code=failure.code, name=failure.name,
        ours=failure.ours, theirs=failure.theirs, peer=failure.peer, what=failure.what, timeout_s=failure.timeout_s,
        detail=(f"{where}: {failure.detail}" if failure.detail else where)[:MAX_MESSAGE_CHARS]))


def connection_error(lost: BPSConnectionError | str, via_shm: bool) -> LinkBrokenError:
    """The error of a push the connection's loss failed (``lost``: that loss); ``unanswered_shm`` when
    it went by reference, so the server may still write its sum into our memory."""
    if isinstance(lost, str):
        return LinkBrokenError(lost, unanswered_shm=via_shm)
    return LinkBrokenError(lost.detail, peer=lost.peer, unanswered_shm=via_shm)


class ServerLink:
    """One reusable connection to server ``spec``; reconnects when needed (see the module docstring).

    Who owns what: :attr:`window` every push from queued to answered (and the sums kept for
    replays), :attr:`control` the other messages and the round queries, the current connection's
    protocol object its handshake and liveness, this class the reconnects and the pushes' futures.
    """

    def __init__(self, spec: ServerSpec, worker_id: int, *, credit_bytes: int, timeout: float,
                 window_pieces: int = 0, stream: int = 0, max_payload_bytes: int, token: bytes | None = None,
                 shm_mode: int | None = None, timeline: Timeline | None = None,
                 config_items: Sequence[str] = (), given_up: dict[tuple[str, int], Abort] | None = None) -> None:
        self.timeline = timeline
        # Our cluster file's placement entries (protocol.config.placement_items): the server refuses other ones.
        self.config_items = tuple(config_items)
        self.spec = spec
        self.shm_mode = shm_mode  # offer shared memory (segments of this mode) to a server on this host
        self.token = token
        self.worker_id = worker_id
        self.credit_bytes = credit_bytes
        self.stream = stream  # which of our connections to this server (Hello.stream; 0 carries control)
        self.timeout = timeout
        self.max_payload_bytes = max_payload_bytes
        self.window: SendWindow[OutgoingPush] = SendWindow(
            credit_bytes=credit_bytes, window_pieces=window_pieces,  # Placement.stream_window; 0: no pacing
            batch_max_bytes=min(BATCH_MAX_BYTES, max_payload_bytes))  # a batch is one frame: the peer's limit
        self.control = ControlMessages()
        # By (name, part): the last round of it this worker gave up (an Abort) or heard fail at this server, told
        # again to a restarted server (see _settle_held) unless a later round's sum came since. One for all the
        # server's streams (the daemon passes each the same): a part's sums come on its own stream, its aborts go
        # on stream 0.
        self.given_up: dict[tuple[str, int], Abort] = {} if given_up is None else given_up
        self.incarnation: str | None = None  # of the server run we last talked to
        self.epoch = ""  # of this worker's round numbering (set by the daemon)
        self._hello_epoch: str | None = None  # the numbering our last Hello said (see _told_on_ready)
        self._reset_told: str | None = None  # the numbering whose Reset this connection carried (see tell_reset)
        # Whether a round of that numbering reached the server on this link (a push, an abort, a fused report; sent,
        # not queued: a server down meanwhile never heard of it) or was learned from it (a round query's answer);
        # and whether that holds for no link to this server (Hello.fresh; set by the daemon).
        self.numbered = False
        self.numbering_fresh: Callable[[], bool] = lambda: not self.numbered
        self.has_processes: Callable[[], bool] = lambda: True  # whether our daemon has any now (Hello.processes)
        self.job_now: Callable[[], tuple[str, float]] = lambda: ("", 0.0)  # their job and its age (Hello.job)
        self.closed, self.stopping = False, False  # stopping: the daemon stops, a lost connection stays lost
        self._proto: _LinkProtocol | None = None
        self._ready = False  # handshake complete: pushes may flow
        self._connecting: asyncio.Task[None] | None = None
        self._req = itertools.count(1)
        self._pings = itertools.count()
        self._acks: list[tuple[int, asyncio.Future[None]]] = []  # (Ping seq, its waiter): see acknowledged
        self._broken_reason = ""
        self._refused = 0  # connections in a row closed by the server for a protocol error (REFUSED_IN_A_ROW)
        self._attempt_error = ""  # the last reason an idle attempt failed (logged once: see _attempt)
        self._attempt_after = 0.0  # no idle attempt before then (loop time)
        self._unreachable: list[float] = []  # [since, last said] while no attempt reaches it (loop time): _unreached
        self._stall: asyncio.TimerHandle | None = None  # wakes the link at the window's stall deadline
        self._loop: asyncio.AbstractEventLoop | None = None  # the running loop, once asked (see running_loop)
        # Refused because another daemon has our worker id: until when no attempt is made, and the error.
        self._held_elsewhere: tuple[float, BPSConnectionError] | None = None
        self._silence: asyncio.TimerHandle | None = None  # fires once the connection was silent for the timeout
        # The daemon's handlers of fused sums (bps_worker.fused_driver): what the server planned or failed, a
        # ready connection lost, ready again (whether the server restarted), given up.
        self.on_fused: Callable[[Message], None] | None = None
        self.on_lost: Callable[[str], None] | None = None
        self.on_ready: Callable[[bool], None] | None = None
        self.on_gave_up: Callable[[str], None] | None = None
        # The server's stall lines about rounds that wait with our pushes in them (Notice): for our processes.
        self.on_notice: Callable[[list[str]], None] | None = None

    @property
    def connected(self) -> bool:
        """The handshake of the current connection is done: pushes may flow."""
        return self._ready

    @property
    def peer(self) -> str:
        """The server as BPSConnectionError.peer names it."""
        return f"server {self.spec.id} at {self.spec.address}"

    def keep_connected(self) -> None:
        """Connect while idle, so that the daemon is ready before the first push and again after a server
        comes back (its readiness is being connected to every server). One attempt at a time, which fails
        nothing (pushes keep their own timeout, see :meth:`_attempt`). Where another daemon with our worker id
        was refused, none until one timeout after that refusal (a second daemon must not keep knocking; its
        pushes still try): then one, so that once the holder is gone (stopped, or a stranger that borrowed our
        id and left) we are back within a timeout, not only at our next push, after the server failed our
        peers' rounds for want of us."""
        held = self._held_elsewhere
        if self.closed or self._ready or (held is not None and asyncio.get_running_loop().time() < held[0]):
            return
        if (self._connecting is None or self._connecting.done()) and \
                asyncio.get_running_loop().time() >= self._attempt_after:
            self._connecting = asyncio.ensure_future(self._attempt())

    def keep_trying(self) -> None:
        """Connect again where this link holds work but is neither connected nor connecting (by the daemon,
        every second): whatever left it so, what it holds is sent or fails within the timeout, never waits for
        ever."""
        if self.closed or self._ready or (self._connecting is not None and not self._connecting.done()):
            return
        if self._holds_work():
            self._ensure_connecting()

    def _holds_work(self) -> bool:
        """Pieces in the window, or control messages waiting for a connection."""
        return next(self.window.pieces(), None) is not None or bool(self.control.waiting)

    @property
    def shm(self) -> bool:
        """This connection's server accepted the shared-memory offer (pushes go by reference)."""
        return self.window.by_reference

    # -- public ----------------------------------------------------------------------
    def running_loop(self) -> asyncio.AbstractEventLoop:
        """The loop this link runs on, asked once (``asyncio.get_running_loop`` makes a getpid system
        call each time, and the hot path asked several times per piece)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def push(self, push_fields: dict[str, Any], payload: memoryview, dest: memoryview, priority: int,
             shm_ref: tuple[str, int] | None = None, out_ref: tuple[str, int] | None = None,
             on_result: Callable[[Result], None] | None = None) -> asyncio.Future[None]:
        """Queue a push of ``payload``; the future resolves once the sum was written into ``dest``.

        ``shm_ref`` and ``out_ref`` locate ``payload`` and ``dest`` in shared-memory segments
        (name, byte offset), for a server that shares this host. ``payload`` must stay unchanged
        until the future is done, and ``dest`` until the next push of the same partition is
        answered (a restarted server may need them again).
        """
        future: asyncio.Future[None] = self.running_loop().create_future()
        if self.shm and shm_ref is not None and out_ref is not None:  # as _wire sends it: no copy per piece there
            push = Push(req=next(self._req), worker=self.worker_id, segment=shm_ref[0], seg_offset=shm_ref[1],
                        out_segment=out_ref[0], out_offset=out_ref[1], **push_fields)
        else:
            push = Push(req=next(self._req), worker=self.worker_id, **push_fields)
        item = OutgoingPush(req=push.req, key=(push.name, push.part), priority=priority, nbytes=payload.nbytes,
                            header_bytes=estimated_header_bytes(push),
                            in_segments=shm_ref is not None and out_ref is not None,
                            push=push, payload=payload, dest=dest, future=future, shm_ref=shm_ref, out_ref=out_ref,
                            on_result=on_result,
                            times=[now_us(), 0, 0] if self.timeline is not None else None)
        self.window.offer(item)
        if self._proto is None:
            self._ensure_connecting()
        else:
            self.pump()
        return future

    def forget(self, future: asyncio.Future[None]) -> bool:
        """Drop an abandoned push: a late result for it is discarded, not written to its destination.

        Returns False, and keeps the push, when it went as a shared-memory reference: the server
        writes its answer straight into our memory, so the caller must wait for that answer (it
        always comes: a result, a failure, or the loss of the connection) before reusing it. A held
        push is still in the hands of the broken connection's server, which may be alive and write.
        """
        item = next((p for p in self.window.pieces() if p.future is future), None)
        if item is not None:
            in_flight = self.window.in_flight(item.req) is item
            if item.via_shm and not future.done() and (in_flight or item.held):
                item.given_up = True  # (never sent again as a contribution: see _settle_held)
                return False
            self._round_lost(item)
            if self.window.abandon(item):
                self._after_answer(item)
                reader = self._proto.reader if self._proto is not None else None
                if reader is not None and reader.pending_destination is item.dest:
                    reader.discard_pending_payload()  # its result is arriving right now: not into dest
        if not future.done():
            future.cancel()
        return True

    def query_round(self, name: str, part: int = 0, local: int = 0, failed: bool = False,
                    fate: int = -1, given_up: bool = False) -> asyncio.Future[int]:
        """Ask the server which round our round ``local`` of (name, part) is, or (``fate``) whether it summed
        that round (see RoundQuery)."""
        req = next(self._req)
        query = RoundQuery(req, name, part, local, failed, fate, given_up)
        future = self.control.ask(query)
        self._send_control(query)
        if fate < 0:
            future.add_done_callback(partial(self._learned, self.epoch))
        return future

    def _learned(self, epoch: str, answer: asyncio.Future[int]) -> None:
        """A round query's answer came: our numbering (of ``epoch``, if still ours) is this server's now."""
        if epoch == self.epoch and not answer.cancelled() and answer.exception() is None:
            self.numbered = True

    def abort(self, name: str, part: int, round_: int, why: Why) -> None:
        """Tell the server that this worker gave up a round, and why (sent once connected, if need be)."""
        message = Abort(name, part, round_, self.worker_id, **why.carry())
        self.given_up[(name, part)] = message
        self._send_control(message)

    def init_failed(self, name: str, root: int, round_: int, why: Why) -> None:
        """Tell the server that this machine, root rank ``root``'s, failed its async_init of ``name`` (our local
        round ``round_`` of it) before pushing it (sent once connected)."""
        self._send_control(InitFailed(name, self.worker_id, root, round_, **why.carry()))

    def fuse(self, message: FuseReady | FuseAbort | FuseRunning | FusePast) -> None:
        """Report fused sums to this server (their anchor), or give them up (sent once connected)."""
        self._send_control(message)

    def first_on_reconnect(self, message: FuseResync) -> None:
        """``message`` goes first on the next connection, before what is sent from now on (called from
        ``on_lost``: the link reconnects on its own terms, within the window of the connection it lost)."""
        self.control.keep(message)

    def queued_bytes(self) -> int:
        """Payload bytes waiting in the priority queue plus bytes in the transport's write buffer."""
        buffered = 0
        if self._proto is not None and self._proto.transport is not None:
            buffered = self._proto.transport.get_write_buffer_size()
        return buffered + self.window.queued_wire_bytes()

    def heartbeat(self) -> None:
        """Ping the server, so that a live one shows it (its answer; see :meth:`_watch_silence`)."""
        proto = self._proto
        if proto is not None and self._ready:
            self._send(proto, Ping(next(self._pings)))

    def acknowledged(self) -> asyncio.Future[None]:
        """Done once the server answered a Ping sent now: it handled everything we sent before on this connection
        (a server handles a connection's frames in order; a worker's Reset, for one). Done at once where the link is
        not ready (nothing went: a server that comes back hears what it must from our hello, see the daemon's
        _link_ready), and when the connection is lost meanwhile."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        proto = self._proto
        if proto is None or not self._ready:
            done.set_result(None)
            return done
        seq = next(self._pings)
        self._acks.append((seq, done))
        self._send(proto, Ping(seq))
        return done

    def _pinged(self, seq: int | None) -> None:
        """The server answered our Ping ``seq`` (None: the connection is gone): every waiter up to it is done."""
        if not self._acks:
            return
        keep = []
        for sent, done in self._acks:
            if seq is not None and sent > seq:
                keep.append((sent, done))
            elif not done.done():
                done.set_result(None)
        self._acks = keep

    def _watch_silence(self, proto: _LinkProtocol) -> None:
        """Wake up once ``proto``'s connection will have been silent for the timeout (module docstring)."""
        if self._silence is not None:
            self._silence.cancel()
        self._silence = asyncio.get_running_loop().call_at(proto.last_seen + self.timeout, self._silence_over,
                                                           proto, proto.last_seen)

    def _silence_over(self, proto: _LinkProtocol, armed_at: float) -> None:
        self._silence = None
        if proto is not self._proto or not self._ready:
            return
        if proto.last_seen != armed_at:  # bytes came since: the deadline moved
            self._watch_silence(proto)
            return
        silent = asyncio.get_running_loop().time() - proto.last_seen
        if proto.transport is not None:
            proto.transport.abort()  # close() would wait to flush to a peer that reads nothing
        self.on_broken(proto, f"server {self.spec.id} at {self.spec.address} sent nothing for {silent:.1f} s "
                              f"(limit {self.timeout:g} s)", since=proto.last_seen)

    def reset(self) -> None:
        """Tell the server that this worker has no training processes left (see Reset). What their operations had
        queued and not sent fails unsent: behind the Reset it would open the ended job's rounds again at the server,
        and the next job's first rounds met them as stale (a review's case: shutdown() with a large sum in flight,
        init() again)."""
        self.window.drop_sums()  # the next job starts at round 0; the buffers are being freed
        self._fail_ended(self.window.take_queued())
        self.given_up.clear()
        self.control.drop_fused()
        # On every connection: the server's state of this worker follows its first, where the Reset acts; on the
        # others (Hello.stream) it says that the ended job's pushes on it are all in. Without it, a piece still on
        # its way there reached the server after the Reset and opened the ended job's round again: the next job's
        # first sum of that partition was stale (several connections to a server: separate hosts). An extra one that
        # is down says nothing: its next Hello carries the new numbering.
        if self.stream == 0 or (self._proto is not None and self._ready):
            self.tell_reset()

    def _fail_ended(self, items: list[OutgoingPush]) -> None:
        """Fail ``items``, of a job that ended here: none goes (again)."""
        ended = BPSError(f"every training process of worker {self.worker_id} left: its job ended here")
        for item in items:
            if not item.future.done():
                item.future.set_exception(ended)

    def tell_reset(self) -> None:
        """Tell the server that this worker has no training processes (again, to a server that restarted: the
        run before heard it, this one knows only that the worker connected); once per numbering a connection."""
        if self._reset_told != self.epoch:
            self._reset_told = self.epoch
            self._send_control(Reset(self.worker_id, self.epoch))

    def tell_joined(self) -> None:
        """Tell the server that this worker, which had no training processes (its Reset, or its hello said so), has
        some now: a round that waits for them waits on (a process busy with other servers' tensors is waited for
        as any, not failed as a machine without processes)."""
        self._send_control(Joined(self.worker_id, *self.job_now()))

    def forget_sums(self, names: Container[str]) -> None:
        """Tensors ``names`` are never pushed again: their last sums are not kept for a restarted server."""
        self.window.drop_sums_of(names)
        for key in [key for key in self.given_up if key[0] in names]:
            del self.given_up[key]

    def release_segments(self, names: list[str]) -> None:
        """Segments we unlinked: a server that maps our memory unmaps them (a new connection maps
        nothing, so there is nothing to tell a server we are not connected to). A kept sum that lies in one
        is copied out of it: its view would keep the freed memory mapped (the arena's cap would free no
        room), and a restarted server could not map it for the replay (which then goes with the copy)."""
        freed = set(names)
        for item in self.window.kept():
            if item.out_ref is not None and item.out_ref[0] in freed:
                item.dest, item.out_ref = memoryview(bytes(item.dest)), None
        if self.shm and self._proto is not None and self._ready:
            for name in names:
                self._proto.announced.discard(name)
                self._send(self._proto, Release(name))

    async def wait_closed(self) -> None:
        """After :meth:`close`: its connection attempt (cancelled there) has ended, so that no task of it is
        left pending when the daemon's loop closes."""
        if self._connecting is not None:
            await asyncio.gather(self._connecting, return_exceptions=True)

    def close(self) -> None:
        self.closed = True
        if self._silence is not None:
            self._silence.cancel()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self._connecting is not None:
            self._connecting.cancel()
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._pinged(None)
        self._fail_all(BPSConnectionError("worker daemon is stopping"))

    # -- sending ---------------------------------------------------------------------
    def pump(self) -> None:
        """Write the frames the window lets go now (see ``bps_worker.window``)."""
        proto = self._proto
        if proto is None or proto.transport is None or not self._ready:
            return
        transport = proto.transport
        now = self.running_loop().time()
        incarnation = self.incarnation
        while pieces := self.window.next_to_send(now, transport.get_write_buffer_size()):
            self.numbered = True  # (Hello.fresh: a push of ours reached this server)
            for item in pieces:
                item.reached = incarnation
            try:
                if len(pieces) == 1:
                    self._send(proto, *self._wire(pieces[0]))
                else:
                    write_batch(transport, [self._wire(item) for item in pieces], self.max_payload_bytes)
            except LocalProtocolError as exc:  # a bug of ours: fail loudly, never leave a push unsent and waiting
                log.error("cannot send to server %d: %s", self.spec.id, exc)
                self.on_broken(proto, f"cannot send to server {self.spec.id}: {exc}")
                return
        self._follow_stall()

    def _follow_stall(self) -> None:
        """Keep a wake-up armed while a piece waits for the window, at or before its stall deadline.

        A deadline mostly moves later (a piece's wait starts after the last answer), so a wake-up armed for an
        earlier one is left to fire: :meth:`_stall_over` pumps, and arms the next if a piece still waits. A
        paced stream clears and sets the deadline at every answer; a timer cancelled and made anew each time
        cost two event-loop calls a piece. Only a deadline before the armed one (a fast answer shortened the
        stall, which follows the answer time) moves the wake-up."""
        deadline = self.window.stall_deadline
        if deadline is None:
            return
        stall = self._stall
        if stall is not None:
            if deadline >= stall.when():
                return
            stall.cancel()
        self._stall = self.running_loop().call_at(deadline, self._stall_over)

    def _stall_over(self) -> None:
        self._stall = None
        self.pump()  # the window opens now (or the wake-up is armed again, if the clock fired early)

    def _after_answer(self, item: OutgoingPush | None) -> None:
        """``item`` left the window (answered, failed or abandoned): what it held back may go."""
        if item is None:
            return
        if self.window.has_queued and self._proto is not None:
            self.pump()

    def _wire(self, item: OutgoingPush) -> Wire:
        """What goes on the wire for ``item``: the push and its bytes, or a shared-memory reference."""
        if item.times is not None:
            item.times[1] = now_us()
        if self.shm and item.shm_ref is not None and item.out_ref is not None:
            item.via_shm = True
            self._announce(self._proto, item.shm_ref[0], item.out_ref[0])
            push = item.push
            if not push.segment:  # queued before this connection shared memory (push made it with the references)
                push = dataclasses.replace(push, segment=item.shm_ref[0], seg_offset=item.shm_ref[1],
                                           out_segment=item.out_ref[0], out_offset=item.out_ref[1])
            return push, None
        item.via_shm = False
        return _plain(item.push), item.payload

    def _announce(self, proto: _LinkProtocol | None, *segments: str) -> None:
        """Tell the server the segments a push is about to name, unless this connection did already: it
        maps only those (see Announce). Written before the push, on the same connection."""
        if proto is None:
            return
        announced = proto.announced
        if announced.issuperset(segments):
            return  # every piece but a segment's first
        new = [s for s in dict.fromkeys(segments) if s not in announced]
        announced.update(new)
        self._send(proto, Announce(new))

    def _send(self, proto: _LinkProtocol, message: Message, payload: memoryview | None = None) -> None:
        if proto.transport is not None:
            write_message(proto.transport, message, payload, self.max_payload_bytes)

    def _send_control(self, message: Message) -> None:
        if self._proto is not None and self._ready:
            self.numbered = self.numbered or isinstance(message, _NUMBERED)
            self._send(self._proto, message)
        else:
            self.control.keep(message)
            self._ensure_connecting()

    # -- receiving -------------------------------------------------------------------
    def payload_destination(self, header: dict[str, Any], nbytes: int) -> memoryview:
        req = header.get("req")
        item = self.window.in_flight(req) if isinstance(req, int) else None
        if header.get("t") == Result.TYPE and item is not None:
            if item.dest.nbytes != nbytes:
                raise RemoteProtocolError(f"result for {item.push.name!r} part {item.push.part} has {nbytes} "
                                          f"bytes, expected {item.dest.nbytes}", what="result payload", size=nbytes,
                                          limit=item.dest.nbytes)
            if item.times is not None:
                item.times[2] = now_us()
            return item.dest
        return memoryview(bytearray(nbytes))  # a late result of an abandoned push: discard

    def on_message(self, proto: _LinkProtocol, message: Message, payload: memoryview | None) -> None:
        if not proto.proven and not _handshake_message(proto, message):
            _hold_early(proto, message, self.spec.id)
            return
        match message:
            case Batch():
                for inner, inner_payload in split_batch(message, payload):
                    self.on_message(proto, inner, inner_payload)
            case Ping():
                self._pinged(message.seq)  # (a heartbeat's answer: last_seen is already updated)
            case Challenge():
                if not proto.challenge.done():
                    proto.challenge.set_result(message)
            case Welcome():
                if not proto.welcome.done():
                    proto.welcome.set_result(message)
            case Failure() if message.req == -1 and not self._ready and not proto.welcome.done():
                proto.welcome.set_result(message)  # refused at the handshake: the handshake says why
            case Result():
                self._on_result(message, payload)
            case RoundInfo():
                self._refused = 0
                self.control.answer(message)
            case FusePlan() | FuseFailed() if self.on_fused is not None and self.stream == 0:
                self.on_fused(message)
            case Notice():
                if self.on_notice is not None:
                    self.on_notice(message.lines)
            case Failure():
                self._on_failure(proto, message)
            case _:
                raise RemoteProtocolError(f"unexpected {message.TYPE} message from server {self.spec.id}")

    def _on_result(self, message: Result, payload: memoryview | None) -> None:
        self._check_result(message, payload)  # (while its piece is in flight: a refusal holds it for the next server)
        self._refused = 0  # (the server answers what we send)
        item = self.window.answered(message.req, self.running_loop().time())
        self._after_answer(item)
        if item is None:
            return  # an abandoned push
        try:
            self._take_result(item, message, payload)
        except BaseException as exc:  # out of the window now: nothing else would ever answer its caller
            if not item.future.done():
                item.future.set_exception(BPSError(f"the sum of {item.push.name!r} part {item.push.part} from "
                                                   f"server {self.spec.id} could not be taken: {exc!r}"))
            raise

    def _check_result(self, message: Result, payload: memoryview | None) -> None:
        """RemoteProtocolError for an answer no honest server sends (the connection breaks on it)."""
        item = self.window.in_flight(message.req)
        if item is None:
            return
        if message.inplace:
            if not item.via_shm:
                raise RemoteProtocolError(f"server {self.spec.id} answered {item.push.name!r} part "
                                          f"{item.push.part} in shared memory, but it was pushed over TCP")
        elif not item.future.done():
            got = 0 if payload is None else payload.nbytes
            if got != item.dest.nbytes:
                raise RemoteProtocolError(f"result for {item.push.name!r} part {item.push.part} has {got} bytes, "
                                          f"expected {item.dest.nbytes}", what="result payload", size=got,
                                          limit=item.dest.nbytes)

    def _take_result(self, item: OutgoingPush, message: Result, payload: memoryview | None) -> None:
        """The piece's sum arrived (checked): in its destination, its caller told, kept for a restarted server."""
        if not message.inplace and not item.future.done():
            if payload is not None and payload is not item.dest:  # a batched result: not received in place
                item.dest[:] = payload
        if not item.future.done():
            if item.push.resumed:  # (answered: a restarted server gets this push again as a plain replay)
                item.push = dataclasses.replace(item.push, resumed=False)
            if message.applied:
                item.applied, item.kept = message.applied, bytes(item.dest)
            if item.on_result is not None:
                item.on_result(message)
            item.future.set_result(None)
            self.window.keep_sum(item)
            given_up = self.given_up.get(item.key)
            if given_up is not None and given_up.round <= item.push.round:
                del self.given_up[item.key]
            self._trace(item)

    def _on_failure(self, proto: _LinkProtocol, message: Failure) -> None:
        if message.req == -1:
            # The server closes the connection. Usually something broke on the way (it is retried, as any lost
            # connection); but where the same pushes are refused again on every new connection, holding them
            # would resend them for ever (a push no error ever ended: a hang), so they fail.
            self._refused += 1
            reason = f"server {self.spec.id} refused the connection: {message.message}"
            if self._refused < REFUSED_IN_A_ROW:
                self.on_broken(proto, reason)
                return
            self._refused = 0
            self.on_broken(proto, f"{reason} ({REFUSED_IN_A_ROW} connections in a row refused, nothing answered "
                                  f"between: what they carried fails)", give_up=True)
            return
        self._refused = 0
        item = self.window.answered(message.req, self.running_loop().time())
        self._after_answer(item)
        if item is not None:
            self._round_lost(item)
            if message.code == "answer_lost":  # (the round was summed: nothing to tell a restarted server)
                if not item.future.done():  # (by reference: the old connection may still be writing the sum)
                    item.future.set_exception(AnswerLostError(f"server {self.spec.id}: {message.message}",
                                                              unanswered_shm=item.via_shm))
                return
            error = failure_error(self.spec.id, message)
            if item.push.kind not in ASYNC_KINDS and self.window.of_this_job(item):  # (a mismatch: both sides)
                self.given_up[item.key] = Abort(item.push.name, item.push.part, item.push.round, self.worker_id,
                                                **why_from_error(error, message.message).carry())
            if not item.future.done():
                item.future.set_exception(error)

    def _round_lost(self, item: OutgoingPush) -> None:
        """``item`` failed or was given up: the last sum of a synchronous partition is no longer replayed. An
        asynchronous partition's copy is: an older value with its vector is still a good copy (and may hold
        deltas of ours that no other copy holds)."""
        if item.push.kind not in ASYNC_KINDS:
            self.window.drop_sum(item.key)

    def _trace(self, item: OutgoingPush) -> None:
        """Timeline of one answered push: waiting in our queue, on the server, and its sum arriving."""
        if self.timeline is None or item.times is None:
            return
        queued, sent, arriving = item.times
        done = now_us()
        lane = f"{item.push.name} p{item.push.part} (server {self.spec.id})"
        args = {"round": item.push.round, "bytes": item.payload.nbytes, "shm": item.via_shm}
        self.timeline.span(lane, "queued", queued, sent or done, **args)
        self.timeline.span(lane, "push, server sum", sent or done, arriving or done, **args)
        if arriving:
            self.timeline.span(lane, "pull", arriving, done, **args)

    # -- losing the connection -------------------------------------------------------
    def on_broken(self, proto: _LinkProtocol, reason: str, since: float | None = None, *,
                  give_up: bool = False) -> None:
        """``proto``'s connection is gone: hold what is in flight while reconnecting, or fail it (``give_up``:
        what it carried fails at once, the queries and fused reports too; what never went on it goes on the next).

        ``since``: the server's last sign of life (default: now, as for a closed connection); the
        reconnect window ends one timeout after it."""
        if proto is not self._proto:
            return
        if self._silence is not None:
            self._silence.cancel()
            self._silence = None
        if not self.closed:  # (while the daemon stops, as when a box's units all stop at once: no alarm)
            log.log(logging.INFO if self.stopping else logging.WARNING, "%s", reason)
        self._proto = None
        was_ready, self._ready = self._ready, False
        self._pinged(None)
        self.window.by_reference = False
        self.window.resume_writing()
        for waiter in (proto.welcome, proto.challenge):
            if not waiter.done():
                waiter.set_exception(ConnectionError(reason))
                waiter.exception()  # retrieved here: the handshake may not be waiting on it yet
        if proto.transport is not None:
            proto.transport.close()
        if not was_ready and not self.closed:
            return  # lost during the handshake: the connecting loop retries (see _connect), nothing was sent
        if self.on_lost is not None:
            self.on_lost(reason)
        if self.incarnation is None or self.closed or self.stopping:
            self._fail_all(BPSConnectionError(reason, peer=self.peer))
            return
        if give_up:
            self._fail_sent(BPSConnectionError(reason, peer=self.peer), self.window.take_inflight())
        # The server may be restarting: hold what is in flight until we know (see the module docstring).
        self.control.ask_again()
        self._broken_reason = reason
        self._fail_ended(self.window.hold())  # (its stall deadline cleared: a wake-up still armed finds nothing)
        loop = asyncio.get_running_loop()
        self._ensure_connecting((loop.time() if since is None else since) + self.timeout, reason)

    def _fail_all(self, exc: BPSConnectionError) -> None:
        self._fail_sent(exc, self.window.clear())

    def _fail_sent(self, exc: BPSConnectionError, items: list[OutgoingPush]) -> None:
        """Fail ``items`` (taken out of the window), the round queries, and the fused sums that wait on us."""
        self.control.fail_queries(exc)
        if self.on_gave_up is not None:
            self.on_gave_up(exc.detail or str(exc))  # (the reason: the fused sums' failure says the peer)
        for item in items:
            if item.future.done():
                continue
            # A push that reached the run we talked to last (in flight, held, or queued again after a reconnect to
            # it): that run may have summed its round.
            if self.incarnation is not None and item.reached == self.incarnation and item.push.kind not in ASYNC_KINDS:
                item.future.set_exception(LinkBrokenError(exc.detail, peer=exc.peer, unanswered_shm=item.via_shm,
                                                          fate_unknown=True))
            else:
                item.future.set_exception(connection_error(exc, True) if item.via_shm else exc)

    # -- connecting ------------------------------------------------------------------
    def _ensure_connecting(self, deadline: float | None = None, why: str = "no attempt") -> None:
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect(deadline, why))

    async def _connect(self, deadline: float | None, why: str) -> None:
        """Connect (again), retrying with a doubling delay until ``deadline`` (None: the timeout from
        now); then fail everything, saying ``why`` if no attempt got further."""
        loop = asyncio.get_running_loop()
        if self._held_elsewhere is not None and loop.time() < self._held_elsewhere[0]:
            self._fail_all(self._held_elsewhere[1])  # another daemon has our id: no attempt before then
            return
        if deadline is None:
            deadline = loop.time() + self.timeout
        delay = RECONNECT_DELAY_S
        last_error = why
        while not self.closed and not self.stopping and loop.time() < deadline:
            permanent = False
            try:
                await self._open(deadline)
                return
            except HandshakeError as exc:  # an unproven or refusing server: as a dead one, unless it cannot change
                if str(exc) != last_error:
                    log.log(logging.ERROR if _held_elsewhere(exc) else logging.WARNING, "%s", exc)
                last_error = str(exc)
                permanent = _cannot_change(exc) or _held_elsewhere(exc)
                if _held_elsewhere(exc):
                    self._held_elsewhere = (loop.time() + self.timeout, BPSConnectionError(last_error, peer=self.peer))
            except (OSError, asyncio.TimeoutError, ConnectionError) as exc:
                last_error = str(exc) or exc.__class__.__name__
                self._unreached(last_error)
            except Exception as exc:  # a bug of ours: said, and the attempt fails as any (never a task that
                log.exception("server %d: connection attempt failed", self.spec.id)  # died: a silent hang)
                last_error, self._ready = f"internal error: {exc!r}", False
            if self._proto is not None and self._proto.transport is not None:
                self._proto.transport.close()
            self._proto = None
            if permanent:
                self._fail_all(BPSConnectionError(last_error, peer=self.peer))
                return
            if loop.time() + delay > deadline:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_DELAY_MAX_S)
        self._fail_all(BPSConnectionError(f"cannot reach it within {self.timeout:g} s: {last_error}", peer=self.peer))

    async def _attempt(self) -> None:
        """One connection attempt of :meth:`keep_connected`. A failure is logged when its reason changes
        and fails nothing; what was queued meanwhile then starts the ordinary reconnection (its timeout)."""
        loop = asyncio.get_running_loop()
        try:
            await self._open(loop.time() + self.timeout)
            return
        except HandshakeError as exc:
            if _held_elsewhere(exc):
                self._held_elsewhere = (loop.time() + self.timeout, BPSConnectionError(str(exc), peer=self.peer))
            if _cannot_change(exc):  # e.g. another token: no attempt per second (nor a refusal logged by each)
                self._attempt_after = loop.time() + self.timeout
            if str(exc) != self._attempt_error:
                log.log(logging.ERROR if _held_elsewhere(exc) else logging.WARNING, "%s", exc)
            self._attempt_error = str(exc)
        except (OSError, asyncio.TimeoutError, ConnectionError) as exc:
            self._unreached(str(exc) or exc.__class__.__name__)
        except Exception:  # a bug of ours: said, and the attempt fails as any (see _connect)
            log.exception("server %d: connection attempt failed", self.spec.id)
            self._ready = False
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None
        if self._holds_work():
            self._connecting = None
            self._ensure_connecting()

    def _unreached(self, error: str) -> None:
        """An attempt did not reach the server (``error``). Said once it has been so for the timeout, then once a
        timeout while it stays so: a server's address that does not resolve, or one that nobody serves, was in no
        log (the worker looked idle and healthy; only a process's error, a timeout after its call, said why: a
        review). Not before: workers may start before their servers."""
        now = asyncio.get_running_loop().time()
        if not self._unreachable:
            self._unreachable = [now, -math.inf]
        since, said = self._unreachable
        if now - since >= self.timeout and now >= said + self.timeout and self.stream == 0:
            self._unreachable[1] = now
            log.warning("cannot reach server %d at %s for %.0f s: %s (retrying)", self.spec.id, self.spec.address,
                        now - since, error)

    async def _open(self, deadline: float) -> None:
        """One attempt: the TCP connection, the handshake, then what waited for them."""
        loop = asyncio.get_running_loop()
        _, proto = await asyncio.wait_for(
            loop.create_connection(lambda: _LinkProtocol(self), self.spec.host, self.spec.port),
            timeout=max(0.1, deadline - loop.time()))
        if proto.transport is None or proto.transport.is_closing():  # (the server closed it at once: a server
            raise ConnectionError("connection closed as it opened")  # over its bound of pending connections)
        proto.transport.set_write_buffer_limits(high=self.credit_bytes)
        self._proto = proto
        welcome = (await self._handshake(proto, deadline)).welcome  # the server proved itself: now we may talk
        log.info("connected to server %d at %s%s", self.spec.id, self.spec.address,
                 " (shared memory)" if self.shm else "")
        previous, self.incarnation = self.incarnation, welcome.incarnation
        self._ready = True
        waited = self.control.take()
        self._told_on_ready(waited)
        self._held_elsewhere = None  # the server took us: whoever held our id is gone
        self._attempt_error = ""
        self._unreachable = []
        proto.last_seen = loop.time()
        self._watch_silence(proto)
        for message in waited:  # (after our Hello: a run that never heard of them)
            self.numbered = self.numbered or isinstance(message, _NUMBERED)
            self._send(proto, message)
        restarted = previous is not None and previous != welcome.incarnation
        self._settle_held(proto, restarted=restarted)
        if previous is None and self.stream == 0:  # a run we never talked to: we hold no copies for it, and its
            self._send(proto, Restored(self.worker_id))  # values wait until every worker said so (bps_server.values)
        if self.on_ready is not None:
            self.on_ready(restarted)
        self.pump()

    def _told_on_ready(self, waited: list[Message]) -> None:
        """A new connection is ready, to carry ``waited`` (what waited for it): it carried no Reset yet but the one
        that waited, if any; where every process of ours left during its handshake (our Hello said the numbering
        before), the server hears it first."""
        self._reset_told = self.epoch if any(isinstance(m, Reset) and m.epoch == self.epoch for m in waited) else None
        if self._hello_epoch != self.epoch:
            self.tell_reset()

    async def _handshake(self, proto: _LinkProtocol, deadline: float) -> Established:
        """Challenge, Hello (with the shared-memory offer), the Welcome verified by
        :class:`~protocol.handshake.ClientHandshake`; sets :attr:`shm` from it. HandshakeError for a
        server that does not prove the token (with one), refuses us, or read another cluster file:
        nothing else is sent on such a connection (no replay, no push)."""
        loop = asyncio.get_running_loop()
        challenge = await asyncio.wait_for(asyncio.shield(proto.challenge), timeout=max(0.1, deadline - loop.time()))
        probe = make_probe(self.worker_id, self.shm_mode, self.spec.id) if self.shm_mode is not None else None
        self._hello_epoch = self.epoch
        job, job_age_s = self.job_now()
        greeting = ClientHandshake(
            Hello(PROTOCOL_VERSION, ROLE_WORKER, self.worker_id, shm=probe[0].name if probe else "",
                  shm_key=probe[1] if probe else "", epoch=self.epoch, fresh=self.numbering_fresh(),
                  processes=self.has_processes(), job=job, job_age_s=job_age_s,
                  stream=self.stream,
                  config_items=list(self.config_items), daemon=daemon_id()),
            token=self.token, server=self.spec.id, who=f"server {self.spec.id} at {self.spec.address}")
        try:
            self._send(proto, greeting.receive(challenge))
            answer = await asyncio.wait_for(asyncio.shield(proto.welcome), timeout=max(0.1, deadline - loop.time()))
        finally:
            if probe is not None:
                shm.release(probe[0], unlink=True)
        established = greeting.receive(answer)
        if self._proto is not proto:
            raise ConnectionError("connection closed during the handshake")
        proto.proven = True
        early, proto.early = proto.early, []
        try:
            for message in early:  # (what it sent around its Welcome, in order: as if it came now)
                self.on_message(proto, message, None)
        except ProtocolError as exc:
            raise ConnectionError(f"server {self.spec.id} sent a bad frame: {exc}") from None
        if self._proto is not proto:  # (what it sent broke the connection: a refusal after its Welcome)
            raise ConnectionError("connection closed during the handshake")
        self.window.by_reference = established.welcome.shm and probe is not None
        if probe is not None and not self.shm:
            log.warning("server %d shares this host but cannot map this worker's shared memory (other "
                        "user? see --shm-mode, or colocated_shm = false); using TCP", self.spec.id)
        return established

    def _settle_held(self, proto: _LinkProtocol, restarted: bool) -> None:
        """Settle the pushes held since the connection broke (see the module docstring)."""
        if restarted:
            log.warning("server %d restarted (its state is lost): replaying %d finished sums, pushing %d "
                        "partitions again", self.spec.id, self.window.sums_kept, self.window.held_count)
            for item in self.window.restarted():
                self._replay(proto, item)
            if self.stream == 0:  # (every stream's link of a server shares one given_up: told once)
                self._tell_given_up(proto)
                # asynchronous values travel on stream 0: every copy of ours is there now
                self._send(proto, Restored(self.worker_id))
            return
        for item in self.window.resumed():
            if item.future.done():
                continue
            if item.push.kind in ASYNC_KINDS or item.given_up:  # (a delta may be in the value already: not sent
                # twice; a push given up, whose abort may have died with the connection, would open its round anew)
                item.future.set_exception(connection_error(self._broken_reason, item.via_shm))
            else:
                item.push = dataclasses.replace(item.push, resumed=True)

    def _tell_given_up(self, proto: _LinkProtocol) -> None:
        """Tell a restarted server the rounds this worker gave up at its predecessor, or heard fail there, that
        no later sum came after: the Abort may have died with it, or a peer that never heard the failure
        pushes that round again to the new run, which would wait for us for ever (we moved on)."""
        for abort in self.given_up.values():
            self._send(proto, abort)

    def _replay(self, proto: _LinkProtocol, item: OutgoingPush) -> None:
        """Give a restarted server the sum of ``item``'s round, which we got from its predecessor."""
        push = dataclasses.replace(_plain(item.push), replay=True, resumed=False)
        if push.kind in ASYNC_KINDS:  # our copy of the value, and the vector saying which deltas it holds
            self._send(proto, dataclasses.replace(push, applied=item.applied or []), memoryview(item.kept))
            return
        if self.shm and item.out_ref is not None:
            self._announce(proto, item.out_ref[0])
            self._send(proto, dataclasses.replace(push, segment=item.out_ref[0], seg_offset=item.out_ref[1],
                                                  out_segment=item.out_ref[0], out_offset=item.out_ref[1]))
        else:
            self._send(proto, push, item.dest)
