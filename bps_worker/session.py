"""One training process's connection to its worker daemon, over the daemon's Unix socket.

The session is thin: it turns the bytes of the socket into messages (``protocol.frames``), checks the
one message that comes first (the handshake: ``Hello`` -> ``Welcome``), and dispatches the others by
type: ``Alloc`` (room for a tensor in this process's shared-memory arena), ``Op`` (a collective on
a tensor, checked against the arena and handed to the daemon's local rounds) and ``Leave`` (shutdown(),
answered once it took effect). It owns the process's
arena, so the segments go when the process does. A peer that breaks the protocol gets one ``Failure``
with code ``protocol_error`` and is disconnected.

Until its Hello a connection is a stranger's, bounded by the daemon's
:class:`~bps_runtime.admission.Admission` (per local uid and in all, and a deadline) with a receive
buffer for the Hello alone. A process that sends but never reads is no longer read while more than
:data:`CLIENT_WRITE_BUFFER_HIGH_BYTES` wait to be written to it
(:class:`~bps_runtime.backpressure.BackPressure`), so its answers cannot pile up without bound.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections import Counter
from collections.abc import Iterable
from math import prod
from typing import TYPE_CHECKING, Any, Callable, Final, Protocol, cast

from bps_runtime import cuda
from bps_runtime import segments as shm
from bps_runtime.admission import Admission, AdmittedProtocol
from protocol import PROTOCOL_VERSION, dtypes
from protocol.config import MAX_TENSOR_PAYLOADS
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.frames import FrameReader, encode_message
from protocol.handshake import HANDSHAKE_BUFFER_BYTES, ServerHandshake
from protocol.messages import (
    MAX_MESSAGE_CHARS,
    ROOTED_KINDS,
    ROLE_CLIENT,
    Alloc,
    Allocated,
    FUSED_PREFIX,
    Spec,
    Done,
    DoneBatch,
    Failure,
    Leave,
    Message,
    Op,
    OpBatch,
    Ping,
    Taken,
    Welcome,
    check_spec,
    describe_spec,
    parse,
)

from .local_rounds import describe
from .result_holds import ResultHolds

if TYPE_CHECKING:
    from .daemon import WorkerConfig

log = logging.getLogger("bps.worker")

CLIENT_MAX_HEADER_BYTES: Final = 64 * 1024  # an OpBatch: up to FUSED_NAMES_BUDGET of names
# Above this many bytes waiting to be written to a training process (answers are small control messages:
# thousands of them) the daemon stops reading it until they drain (bps_runtime.backpressure).
CLIENT_WRITE_BUFFER_HIGH_BYTES: Final = 256 * 1024


def _kept(name: str) -> bool:
    return True


class SessionHost(Protocol):
    """What a session needs from its daemon."""

    config: WorkerConfig
    worker_id: int
    rank_offset: int
    arena_bytes: int  # the cap of each process's arena (cluster.arena_bytes)
    sessions: dict[int, ClientSession]  # handshaken sessions by local rank
    connections: set[ClientSession]  # every open connection, handshaken or not
    admission: Admission  # of the connections that have not sent their Hello yet
    reset_since: bool  # every process left (a reset) and none came since
    holds: ResultHolds  # results answered in the results segment, not yet mapped by their processes
    job: str  # the job of the processes connected now, or of the last ones (Hello.job; set by the first of them)
    job_since: float  # when the first of that job's processes connected (time.monotonic), kept through rejoins

    fusion_bytes: int  # sums of at most this many bytes may come fused (OpBatch)

    def submit(self, session: ClientSession, op: Op) -> None: ...

    def submit_batch(self, session: ClientSession, entries: list[tuple[int, str, Spec, str, int, int]]) -> None: ...

    def session_lost(self, session: ClientSession) -> None: ...

    def session_left(self, session: ClientSession, req: int) -> None: ...

    def processes_joined(self) -> None: ...

    def segments_freed(self, names: list[str]) -> None: ...


class ClientSession(AdmittedProtocol):
    """One training process's connection: its handshake, its arena, and the dispatch of its messages."""

    def __init__(self, daemon: SessionHost) -> None:
        self.daemon = daemon
        # Until the Hello, a small buffer (it grows for a large frame); the full one after the handshake.
        self.reader = FrameReader(max_header_bytes=CLIENT_MAX_HEADER_BYTES, max_payload_bytes=0,
                                  buffer_bytes=HANDSHAKE_BUFFER_BYTES)
        self.transport: asyncio.Transport | None = None
        self.local_rank: int | None = None  # set by the handshake
        self.claimed: int | None = None  # the local rank its Hello asked for (its log lines before it has one)
        self.pid = 0
        self.arena = shm.Arena(daemon.worker_id, daemon.config.segment_mode, daemon.arena_bytes)  # its tensors
        self.closed = False
        self.leaving = False  # it said Leave (shutdown()): nothing but a Taken may follow
        self._outbox: list[bytes] = []  # frames of this pass of the event loop, not yet written (see send)
        # This process's ops handed to the local rounds and not answered yet: req -> tensor name, and how
        # many per name (an Alloc must not move the slot an op in flight reads).
        self.inflight: dict[int, tuple[str, str]] = {}  # req -> (tensor name, the segment it is read from)
        self.inflight_names: Counter[str] = Counter()
        # The Unix-socket handshake: no token and no challenge (the client speaks first), only local
        # ranks 0..local_size-1 (protocol.handshake).
        self.handshaker = ServerHandshake(peers={ROLE_CLIENT: daemon.config.local_size}, challenge=False,
                                          who=f"worker {daemon.worker_id}")

    @property
    def rank(self) -> int:
        return self.daemon.rank_offset + (self.local_rank or 0)

    def __repr__(self) -> str:
        if self.local_rank is None:  # (refused at its hello: "local rank None (pid 0)" said nothing, a review)
            return "a process before its hello" if self.claimed is None else \
                f"a process (pid {self.pid}) asking for local rank {self.claimed}"
        return f"local rank {self.local_rank} (pid {self.pid})"

    # -- asyncio ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = unix = cast(asyncio.Transport, transport)  # a Unix stream transport
        self.admit(unix, self.daemon.admission, *_peer(transport), CLIENT_WRITE_BUFFER_HIGH_BYTES)
        self.daemon.connections.add(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            for frame in self.reader.buffer_updated(nbytes):
                self.handle(parse(frame.header))
        except ProtocolError as exc:
            reason = str(exc)[:MAX_MESSAGE_CHARS]  # (a Failure fits a frame: the peer's bad field, shown bounded)
            log.warning("dropping client %r: %s", self, reason)
            try:
                self.send(Failure(-1, reason, code="protocol_error"))
            finally:
                self.close()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.left()
        self.daemon.connections.discard(self)
        self.daemon.session_lost(self)

    # -- messages --------------------------------------------------------------------
    def handle(self, message: Message) -> None:
        if self.local_rank is None:
            self.handshake(message)
            return
        handler = HANDLERS.get(type(message))
        if handler is None:
            raise RemoteProtocolError(f"unexpected {message.TYPE} message from a client")
        if self.leaving and not isinstance(message, Taken):
            raise RemoteProtocolError(f"{message.TYPE} message from a client after its Leave")
        handler(self, message)

    def handshake(self, message: Message) -> None:
        """The first message: a client's ``Hello`` for a free local rank, answered by ``Welcome``.

        The checks of what it is, its version, role and local rank are the handshake's
        (``ServerHandshake``, its errors are RemoteProtocolErrors); whether the rank is free is ours."""
        hello = self.handshaker.receive(message)
        self.claimed, self.pid = hello.id, hello.pid
        other = self.daemon.sessions.get(hello.id)
        if other is not None and not other.closed:
            raise RemoteProtocolError(f"local rank {hello.id} is already connected ({other!r})")
        first = not self.daemon.sessions
        if not first and hello.job != self.daemon.job:
            raise RemoteProtocolError(self._other_job(hello.job))
        self.local_rank = hello.id
        if first and (hello.job != self.daemon.job or not hello.job):  # (else its last processes' job: a rejoin)
            self.daemon.job, self.daemon.job_since = hello.job, time.monotonic()
        self.daemon.sessions[hello.id] = self
        self.daemon.reset_since = False
        if first:
            self.daemon.processes_joined()
        self.admitted()
        self.reader.set_limits(max_header_bytes=CLIENT_MAX_HEADER_BYTES, max_payload_bytes=0)
        cfg = self.daemon.config.cluster
        log.info("client %r connected", self)
        self.send(self.handshaker.accept(Welcome(PROTOCOL_VERSION, rank=self.rank, size=cfg.size, local_rank=hello.id,
                                                 local_size=self.daemon.config.local_size,
                                                 worker=self.daemon.worker_id, workers=cfg.workers,
                                                 arena_bytes=self.daemon.arena_bytes,
                                                 fusion_bytes=self.daemon.fusion_bytes)).welcome)

    def _other_job(self, job: str) -> str:
        """Why a process of ``job`` is refused beside this machine's processes of another: a worker daemon serves
        one job at a time (its rounds, and the servers' asynchronous values, are that job's)."""
        def named(j: str) -> str:
            return f"job {j!r}" if j else "no job (BPS_JOB unset)"
        others = ", ".join(repr(s) for s in self.daemon.sessions.values())
        return (f"this process is of {named(job)} but the processes connected here ({others}) are of "
                f"{named(self.daemon.job)}; start the next job once the last one's processes have left this machine")

    def alloc(self, message: Alloc) -> None:
        """Find (or make) room for tensor ``name``: small ones share slab segments, large ones get their own.

        The slots the process gives up (``Alloc.free``) go first, whatever else the answer is: it forgot them."""
        freed = []
        if message.free:
            reading = self._segments_read()
            for name in message.free:
                slot = self.arena.slots.get(name)
                if not self.inflight_names[name] and (slot is None or slot.segment not in reading):
                    freed += self.arena.drop(name)
        self.daemon.segments_freed(freed)
        if self.inflight_names[message.name]:
            # Moving the slot would free the memory the op in flight reads (issue 14, item 13).
            self.send(Failure(message.req, f"tensor {message.name!r} is in flight: synchronize it before "
                                           f"allocating it again", code="bad_request"))
            return
        old = self.arena.slots.get(message.name)
        if old is not None and old.capacity < message.nbytes and old.segment in self._segments_read():
            # (the same, where an op of another name reads that memory: a process's own slab, or its bug)
            self.send(Failure(message.req, f"tensor {message.name!r}: its memory is read by an operation in flight; "
                                           f"synchronize that before allocating it again", code="bad_request"))
            return
        limit = self.daemon.config.cluster.max_payload_bytes * MAX_TENSOR_PAYLOADS  # (a slab always fits: config)
        if message.nbytes > limit:
            self.send(Failure(message.req, f"tensor {message.name!r} of {message.nbytes} bytes is too large: at most "
                                           f"{limit} bytes ({MAX_TENSOR_PAYLOADS} times cluster.max_payload_bytes)"))
            return
        try:
            # Only the process frees its slots (Alloc.free): it knows which one a thread is about to fill.
            slot, more = self.arena.alloc(message.name, message.nbytes, busy=_kept)
        except OSError as exc:
            self.send(Failure(message.req, f"cannot allocate {message.nbytes} bytes of shared memory for "
                                           f"{message.name!r}: {exc.strerror}"))
            return
        self.daemon.segments_freed(more)
        self.send(Allocated(message.req, slot.segment, slot.capacity, slot.offset))

    def _segments_read(self) -> set[str]:
        """The segments the ops in flight read from. The process carves its small tensors from slabs of its own
        (``bps_worker.client.slots``), each one slot here under the slab's name: a slab it gives up while one
        of its tensors is in flight (a process's bug) must not be freed under that op. Only when it gives
        something up: one walk over what is in flight."""
        return {segment for _, segment in self.inflight.values()}

    def op(self, message: Op) -> None:
        """A collective on one tensor: refused here if it does not fit its memory, else a local round's."""
        error = self.check_op(message)
        if error is None and message.req in self.inflight:
            error = f"tensor {message.name!r}: request {message.req} is already in flight"
        elif error is None and self.inflight_names[message.name]:
            # (the fused rounds and a collecting local round refuse it too; a running one would share its buffers)
            error = f"tensor {message.name!r} is already in flight from this process; synchronize it first"
        if error:
            self.refuse(message.req, error)
        else:
            self.inflight[message.req] = (message.name, message.segment)
            self.inflight_names[message.name] += 1
            self.daemon.submit(self, message)

    def op_batch(self, batch: OpBatch) -> None:
        """Small sums to fuse (bps_worker.fusion): each entry checked against its memory like an Op, the ones
        that fail answered alone, the others handed to the daemon's fused rounds together."""
        specs = [check_spec(s) for s in batch.specs]
        sizes = [prod(spec[1]) * dtypes.ITEMSIZE[spec[0]] for spec in specs]
        segments = [self.arena.segments.get(name) for name in batch.segments]
        limit = self.daemon.fusion_bytes
        inflight, names_in_flight = self.inflight, self.inflight_names
        entries = []
        for req, name, k, s, offset, priority in zip(batch.reqs, batch.names, batch.spec, batch.seg, batch.offsets,
                                                     batch.priority):
            nbytes, seg = sizes[k], segments[s]
            error = None
            if req in inflight:
                error = f"tensor {name!r}: request {req} is already in flight"
            elif nbytes > limit:
                error = f"tensor {name!r} of {nbytes} bytes is too large to fuse (at most {limit} bytes)"
            elif seg is None:
                error = f"tensor {name!r}: segment {batch.segments[s]!r} was not allocated by this connection"
            elif offset + nbytes > seg.size:
                error = (f"tensor {name!r}: {describe_spec(specs[k])} needs {nbytes} bytes at offset {offset}, its "
                         f"segment has {seg.size}")
            elif name.startswith(FUSED_PREFIX):
                error = f"tensor names starting {FUSED_PREFIX!r} are the worker's own"
            if error is not None:
                self.refuse(req, error)
                continue
            inflight[req] = (name, batch.segments[s])
            names_in_flight[name] = names_in_flight.get(name, 0) + 1  # (a Counter's += on a new name calls Python)
            entries.append((req, name, specs[k], batch.segments[s], offset, priority))
        if entries:
            self.daemon.submit_batch(self, entries)

    def leave(self, message: Leave) -> None:
        """shutdown(): the process leaves now, answered once that took effect (Leave); anything after it is a
        protocol error (handle() refuses a second Leave too)."""
        self.leaving = True
        self.daemon.session_left(self, message.req)

    def taken(self, message: Taken) -> None:
        """The process mapped the results segments of these requests' Dones: they may be freed for room again."""
        self.daemon.holds.release(self, message.reqs)

    def check_op(self, op: Op) -> str | None:
        """Why ``op`` cannot run as described (its memory, dtype or root), or None."""
        if op.name.startswith(FUSED_PREFIX):
            return f"tensor names starting {FUSED_PREFIX!r} are the worker's own"
        if op.cuda:
            problem = cuda.check_description(op.cuda)
            if problem is None and list(op.cuda[0]) != list(op.shape):
                problem = f"its CUDA description has shape {op.cuda[0]}"
            if problem:
                return f"tensor {op.name!r}: {problem}"
        else:
            seg = self.arena.segments.get(op.segment)
            if seg is None:
                return f"tensor {op.name!r}: segment {op.segment!r} was not allocated by this connection"
            nbytes = prod(op.shape) * dtypes.ITEMSIZE[op.dtype]
            if op.offset + nbytes > seg.size:
                return (f"tensor {op.name!r}: {describe(op)} needs {nbytes} bytes at offset {op.offset}, its "
                        f"segment has {seg.size}")
        if op.average and op.dtype not in dtypes.FLOAT_TYPES:
            return f"tensor {op.name!r}: average=True needs a floating dtype, got {op.dtype}; pass average=False"
        size = self.daemon.config.cluster.size
        if op.kind in ROOTED_KINDS and not 0 <= op.root < size:
            return f"tensor {op.name!r}: root rank {op.root} is outside 0..{size - 1}"
        return None

    # -- sending ---------------------------------------------------------------------
    def refuse(self, req: int, error: str) -> None:
        """Refuse request ``req`` before it is taken in: answered without touching what is in flight (a request
        refused for reusing the number of one in flight must not end that one's hold on its memory)."""
        self._write(Failure(req, error, code="bad_request"))

    def send(self, message: Message) -> None:
        if isinstance(message, (Done, Failure)):
            if isinstance(message, Done) and message.segment and message.req in self.inflight:
                # Kept in the results arena until this process has mapped it (Taken), or for the timeout.
                self.daemon.holds.answered(self, message.req, self.inflight[message.req][0], message.segment)
            self._answered((message.req,))
        elif isinstance(message, DoneBatch):
            self._answered(message.reqs)
        if isinstance(message, Ping) and self.flow is not None and self.flow.paused:
            return  # the process reads nothing: a heartbeat would only add to what waits for it
        self._write(message)

    def _write(self, message: Message) -> None:
        if self.transport is not None and not self.transport.is_closing():
            # The answers of one pass of the event loop go out in one write (thousands of fused sums complete
            # in a few passes: a syscall each cost a third of the daemon's time).
            self._outbox.append(encode_message(message))
            if len(self._outbox) == 1:
                asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        out, self._outbox = self._outbox, []
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(out)

    def _answered(self, reqs: Iterable[int]) -> None:
        """These ops of this process got their answers (requests not in flight are skipped): their tensors'
        slots may move again. A fused batch answers thousands per step: one loop, no call per request."""
        inflight, names = self.inflight, self.inflight_names
        for req in reqs:
            entry = inflight.pop(req, None)
            if entry is not None:
                name = entry[0]
                left = names[name] - 1
                if left:
                    names[name] = left
                else:
                    del names[name]

    def close(self) -> None:
        self._flush()  # what was said before closing arrives (a protocol error's Failure)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def release_segments(self) -> None:
        self.daemon.segments_freed(self.arena.release_all())


# A handshaken process's messages, by type: functions of the class (bound methods kept by each session would
# make every session, with its 256 KiB read buffer, a cycle that only the cyclic collector could free).
HANDLERS: Final[dict[type[Message], Callable[[ClientSession, Any], None]]] = {
    Alloc: ClientSession.alloc, Op: ClientSession.op, OpBatch: ClientSession.op_batch, Taken: ClientSession.taken,
    Leave: ClientSession.leave}


def _peer(transport: asyncio.BaseTransport) -> tuple[str, str]:
    """Who is on the other end of a Unix-socket connection: its admission key (its uid) and a label
    (pid and uid), from SO_PEERCRED; ("local", "a local process") where the system does not say."""
    sock = transport.get_extra_info("socket")
    try:
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (AttributeError, OSError, struct.error):
        return "local", "a local process"
    return f"uid {uid}", f"pid {pid} (uid {uid})"


def client_admission(worker_id: int) -> Admission:
    """The admission of worker ``worker_id``'s socket: bounded per uid and in all, and a Hello within
    HANDSHAKE_DEADLINE_S of connecting (see bps_runtime.admission)."""
    return Admission(log, f"worker {worker_id}'s socket")
