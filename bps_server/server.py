"""The Summation Service daemon: a thin asyncio transport around :class:`Aggregator`."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from multiprocessing.shared_memory import SharedMemory
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol import PROTOCOL_VERSION
from protocol.config import ClusterConfig
from protocol.errors import ProtocolError
from protocol.frames import DEFAULT_MAX_HEADER_BYTES, FrameReader, encode_header

# Before the handshake a peer may send only a small header and no payload: nothing is
# allocated for an unauthenticated peer.
HANDSHAKE_MAX_HEADER_BYTES = 4096
from protocol.messages import (
    MAX_BATCH_ITEMS,
    ROLE_OBSERVER,
    ROLE_WORKER,
    Abort,
    Batch,
    Challenge,
    Failure,
    Message,
    Ping,
    Push,
    Release,
    Reset,
    Result,
    RoundInfo,
    RoundQuery,
    Stats,
    StatsRequest,
    Welcome,
    BATCH_HEADER_BUDGET,
    batch_header,
    check_auth,
    estimated_header_bytes,
    expect_hello,
    parse,
    split_batch,
    to_header,
)

from bps_runtime import kernels, metrics
from .aggregator import INLINE_SUM_MAX_BYTES, Aggregator
from bps_runtime.lowat import ReceiveLowWater
from bps_runtime.timeline import Timeline
from bps_runtime.segments import attach_segment, owned_by, release

log = logging.getLogger("bps.server")

# Replies with payloads up to this size are coalesced into one Batch frame per loop iteration.
BATCH_REPLY_MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServerConfig:
    """Everything a Summation Service needs, built once from the cluster file and the command line."""

    cluster: ClusterConfig
    server_id: int
    threads: int = 2
    token: bytes | None = None  # from cluster.token_file
    host: str | None = None  # overrides the address in the cluster file (bind address)
    port: int | None = None
    timeline: str | None = None  # Chrome-trace file of every partition's rounds (bps_runtime.timeline)

    @property
    def bind(self) -> tuple[str, int]:
        spec = self.cluster.server(self.server_id)
        return (self.host or spec.host, spec.port if self.port is None else self.port)


class ServerConnection(asyncio.BufferedProtocol):
    """One worker's TCP connection: handshake first, then pushes and aborts."""

    def __init__(self, server: "SummationServer") -> None:
        self.server = server
        self.reader = FrameReader(max_header_bytes=HANDSHAKE_MAX_HEADER_BYTES, max_payload_bytes=0)
        self.nonce = secrets.token_hex(16)
        self.transport: asyncio.Transport | None = None
        self.low_water: ReceiveLowWater | None = None
        self.worker: int | None = None
        self.stream = 0  # which of the worker's connections (Hello.stream)
        self.observer = False
        self.peer = "?"
        self.closed = False
        self.shm = False  # the worker shares this host and its memory (see Hello.shm)
        self.segments: dict[str, SharedMemory] = {}  # the worker's segments this connection mapped
        self._outbox: list[tuple[Message, np.ndarray | None]] = []
        self._outbox_header_bytes = 0
        self._outbox_payload_bytes = 0

    # -- asyncio.BufferedProtocol ----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.last_seen = asyncio.get_running_loop().time()
        self.peer = str(transport.get_extra_info("peername"))
        self.low_water = ReceiveLowWater(transport)
        self.server.connections.add(self)
        self.send(Challenge(self.nonce, PROTOCOL_VERSION))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.last_seen = asyncio.get_running_loop().time()
        try:
            for frame in self.reader.buffer_updated(nbytes):
                message = parse(frame.header)
                self.handle(message, frame.payload)
        except ProtocolError as exc:
            self.protocol_error(str(exc))
            return
        if self.low_water is not None:
            self.low_water.follow(self.reader.payload_wanted)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self.unmap_all()
        if self.stream:
            if self.server.streams.get((self.worker, self.stream)) is self:
                del self.server.streams[(self.worker, self.stream)]
                log.info("worker %d stream %d (%s) disconnected", self.worker, self.stream, self.peer)
            return
        if self.worker is not None and self.server.links.get(self.worker) is self:
            del self.server.links[self.worker]
            if not self.server.stopping:
                failed = self.server.aggregator.worker_lost(self.worker)
                level = logging.WARNING if failed else logging.INFO
                log.log(level, "worker %d (%s) disconnected; %d pending rounds failed", self.worker, self.peer, failed)

    # -- messages --------------------------------------------------------------------
    def handle(self, message: Message, payload: memoryview | None) -> None:
        if self.observer:
            if not isinstance(message, StatsRequest):
                raise ProtocolError(f"an observer may only send stats requests, not {message.TYPE}")
            self.send(Stats(message.req, self.server.stats()))
            return
        if self.worker is None:
            self.handshake(message)
            return
        if isinstance(message, Batch):
            for item, item_payload in split_batch(message, payload):
                self.handle(item, item_payload)
        elif isinstance(message, Push) and message.segment:
            self.shm_push(message, payload)
        elif isinstance(message, Push):
            if message.payload_nbytes != (payload.nbytes if payload is not None else 0):
                raise ProtocolError(
                    f"push of {message.name!r} part {message.part} announces {message.count} {message.dtype} "
                    f"elements but carries {0 if payload is None else payload.nbytes} bytes"
                )
            if message.worker != self.worker:
                raise ProtocolError(f"worker {self.worker} pushed as worker {message.worker}")
            total = 1
            for d in message.shape:
                total *= d
            if message.offset + message.count > total:
                raise ProtocolError(f"push of {message.name!r} part {message.part} exceeds its tensor's "
                                    f"{total} elements")
            data = (kernels.as_array(payload, message.dtype) if payload is not None
                    else np.empty(0, dtype=kernels.STORAGE[message.dtype]))
            if message.replay:
                self.server.aggregator.replay(message, data)
            else:
                self.server.spawn(self.server.aggregator.push(message, data, self.reply, self.fail))
        elif isinstance(message, Abort):
            self.server.aggregator.abort(message.name, message.part, message.round, self.worker, message.message)
        elif isinstance(message, RoundQuery):
            self.send(RoundInfo(message.req, self.server.aggregator.round_for(message.name, message.part, self.worker)))
        elif isinstance(message, Release):
            seg = self.segments.pop(message.segment, None)
            if seg is not None:
                release(seg, unlink=False)
        elif isinstance(message, Ping):
            self.send(Ping(message.seq))
        elif isinstance(message, Reset):
            if message.worker != self.worker:
                raise ProtocolError(f"worker {self.worker} sent a reset for worker {message.worker}")
            failed = self.server.aggregator.worker_reset(self.worker, message.epoch)
            log.info("worker %d has no training processes; %d pending rounds failed", self.worker, failed)
        elif isinstance(message, StatsRequest):
            self.send(Stats(message.req, self.server.stats()))
        else:
            raise ProtocolError(f"unexpected {message.TYPE} message from worker {self.worker}")

    def shm_push(self, push: Push, payload: memoryview | None) -> None:
        """A push whose partition lies in the colocated worker's shared memory."""
        if not self.shm:
            raise ProtocolError(f"push of {push.name!r} names shared memory, but this connection has none")
        if payload is not None and payload.nbytes:
            raise ProtocolError(f"push of {push.name!r} names shared memory and also carries a payload")
        if push.worker != self.worker:
            raise ProtocolError(f"worker {self.worker} pushed as worker {push.worker}")
        total = 1
        for d in push.shape:
            total *= d
        if push.offset + push.count > total:
            raise ProtocolError(f"push of {push.name!r} part {push.part} exceeds its tensor's {total} elements")
        segments = []
        for name, offset in ((push.segment, push.seg_offset), (push.out_segment, push.out_offset)):
            if not owned_by(name, self.worker):
                raise ProtocolError(f"push of {push.name!r} names segment {name!r}, not one of worker "
                                    f"{self.worker}'s")
            seg = self.segments.get(name)
            if seg is None:
                try:
                    seg = self.segments[name] = attach_segment(name)
                except OSError as exc:
                    self.fail(push, f"server cannot map shared memory {name!r} of {push.name!r}: {exc}")
                    return
            if offset + push.payload_nbytes > seg.size:
                raise ProtocolError(f"push of {push.name!r} part {push.part} runs past the end of segment {name!r}")
            segments.append(seg)
        data = np.frombuffer(segments[0].buf, dtype=kernels.STORAGE[push.dtype], count=push.count,
                             offset=push.seg_offset)
        if push.replay:
            self.server.aggregator.replay(push, data)
        else:
            self.server.spawn(self.server.aggregator.push(push, data, self.reply, self.fail, borrowed=True))

    def unmap_all(self) -> None:
        for seg in self.segments.values():
            release(seg, unlink=False)
        self.segments.clear()

    def _accept_shm(self, hello: Message) -> bool:
        """Whether the worker's shared-memory offer holds: we can map its probe and read the key in it,
        so we share its host (and may read its segments)."""
        if not hello.shm or not self.server.config.cluster.colocated_shm:
            return False
        if not owned_by(hello.shm, hello.id):
            return False
        try:
            probe = attach_segment(hello.shm)
        except OSError as exc:
            log.warning("worker %d offered shared memory %r but it cannot be mapped here (%s); using TCP",
                        hello.id, hello.shm, exc)
            return False
        try:
            ok = probe.size >= 32 and bytes(probe.buf[:32]).hex() == hello.shm_key
        finally:
            release(probe, unlink=False)
        if not ok:
            log.warning("worker %d offered shared memory %r with the wrong key; using TCP", hello.id, hello.shm)
        return ok

    def handshake(self, message: Message) -> None:
        message = expect_hello(message, "server")
        token = self.server.config.token
        if token is not None and not check_auth(token, self.nonce, message):
            raise ProtocolError(f"authentication failed for {message.role} {message.id}: "
                                f"{'no' if not message.auth else 'a wrong'} proof of the cluster token")
        self.reader.max_header_bytes = DEFAULT_MAX_HEADER_BYTES
        self.reader.max_payload_bytes = self.server.config.cluster.max_payload_bytes
        if message.role == ROLE_OBSERVER:
            self.observer = True
            self.send(Welcome(PROTOCOL_VERSION, workers=self.server.config.cluster.workers))
            return
        if message.role != ROLE_WORKER or not 0 <= message.id < self.server.config.cluster.workers:
            raise ProtocolError(f"hello from {message.role} {message.id}: only workers "
                                f"0..{self.server.config.cluster.workers - 1} may connect")
        self.worker = message.id
        self.stream = message.stream
        if message.stream:
            # An extra connection for pushes (see Hello.stream): the worker's state follows stream 0.
            old = self.server.streams.get((message.id, message.stream))
            self.server.streams[(message.id, message.stream)] = self
        else:
            old = self.server.links.get(message.id)
            self.server.links[message.id] = self
        if old is not None and not old.closed:
            log.warning("worker %d reconnected from %s; closing its old connection", message.id, self.peer)
            old.close()
        if not message.stream:
            self.server.aggregator.worker_hello(message.id, message.epoch)
        self.shm = self._accept_shm(message)
        log.info("worker %d connected from %s%s", message.id, self.peer, " (shared memory)" if self.shm else "")
        self.send(Welcome(PROTOCOL_VERSION, worker=message.id, workers=self.server.config.cluster.workers,
                          shm=self.shm, incarnation=self.server.incarnation))

    # -- replies ---------------------------------------------------------------------
    def reply(self, push: Push, out: np.ndarray) -> None:
        if push.segment and out.nbytes < INLINE_SUM_MAX_BYTES:
            self._write_in_place(push, out)  # small: at once, no task
        elif push.segment:
            self.server.spawn(self._reply_in_place(push, out))
        else:
            self.send(Result(push.req, push.name, push.part, push.round), out)

    def _write_in_place(self, push: Push, out: np.ndarray) -> None:
        seg = self.segments.get(push.out_segment)
        if seg is None or self.closed:
            return  # the worker released the segment or left: nobody waits for this answer
        np.copyto(np.frombuffer(seg.buf, dtype=out.dtype, count=out.size, offset=push.out_offset), out)
        self.send(Result(push.req, push.name, push.part, push.round, inplace=True))

    async def _reply_in_place(self, push: Push, out: np.ndarray) -> None:
        """Write a large sum where the worker asked for it (in a thread), then tell it."""
        seg = self.segments.get(push.out_segment)
        if seg is None or self.closed:
            return
        dest = np.frombuffer(seg.buf, dtype=out.dtype, count=out.size, offset=push.out_offset)
        await asyncio.get_running_loop().run_in_executor(self.server.executor, np.copyto, dest, out)
        del dest
        self.send(Result(push.req, push.name, push.part, push.round, inplace=True))

    def fail(self, push: Push, message: str) -> None:
        self.send(Failure(push.req, message, code="round_failed"))

    def send(self, message: Message, payload: np.ndarray | None = None) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        if isinstance(message, (Result, Failure, RoundInfo)) and message.req >= 0 and \
                (payload is None or payload.nbytes <= BATCH_REPLY_MAX_BYTES):
            # Many small rounds complete in one loop iteration (thousands of tiny tensors):
            # answer them in one frame.
            nbytes = 0 if payload is None else payload.nbytes
            if self._outbox_payload_bytes + nbytes > self.server.config.cluster.max_payload_bytes:
                self._flush()  # a batch is one frame: the peer's payload limit holds for it too
            if not self._outbox:
                asyncio.get_running_loop().call_soon(self._flush)
            self._outbox.append((message, payload))
            self._outbox_header_bytes += estimated_header_bytes(message)
            self._outbox_payload_bytes += nbytes
            if len(self._outbox) >= MAX_BATCH_ITEMS or self._outbox_header_bytes >= BATCH_HEADER_BUDGET:
                self._flush()
            return
        self._write(message, payload)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        self._outbox_header_bytes = 0
        self._outbox_payload_bytes = 0
        if not outbox or self.closed or self.transport is None or self.transport.is_closing():
            return
        if len(outbox) == 1:
            self._write(*outbox[0])
            return
        parts = [(m, 0 if p is None else p.nbytes) for m, p in outbox]
        payload = b"".join(memoryview(p).cast("B") for _, p in outbox if p is not None and p.nbytes)
        head = encode_header(batch_header(parts), len(payload),
                             max_payload_bytes=self.server.config.cluster.max_payload_bytes)
        self.transport.writelines([head, payload])

    def _write(self, message: Message, payload: np.ndarray | None) -> None:
        assert self.transport is not None
        nbytes = 0 if payload is None else payload.nbytes
        head = encode_header(to_header(message), nbytes,
                             max_payload_bytes=self.server.config.cluster.max_payload_bytes)
        if payload is None or nbytes == 0:
            self.transport.write(head)
        else:
            self.transport.writelines([head, memoryview(payload).cast("B")])

    def protocol_error(self, reason: str) -> None:
        who = f"worker {self.worker}" if self.worker is not None else "unidentified peer"
        log.warning("dropping %s at %s: %s", who, self.peer, reason)
        self.send(Failure(-1, reason, code="protocol_error"))
        self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self.closed = True


class SummationServer:
    """Server-wide state: the aggregator, live connections and tasks."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.incarnation = secrets.token_hex(8)  # this run of the server: workers notice a restart by it
        self.executor = ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="bps-sum")
        self.links: dict[int, ServerConnection] = {}  # each worker's stream 0
        self.streams: dict[tuple[int, int], ServerConnection] = {}  # (worker, stream) for streams 1, 2, ...
        self.timeline = Timeline(config.timeline, f"bps-server {config.server_id}") if config.timeline else None
        self.aggregator = Aggregator(config.cluster.workers, self.executor, lost_grace_s=config.cluster.timeout,
                                     deterministic=config.cluster.deterministic,
                                     connected=lambda w: w in self.links, timeline=self.timeline)
        self.connections: set[ServerConnection] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._silence_watch: asyncio.Future[None] | None = None
        self._metrics: asyncio.AbstractServer | None = None

    async def start(self) -> tuple[str, int]:
        """Listen; returns the bound (host, port)."""
        host, port = self.config.bind
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: ServerConnection(self), host, port, reuse_address=True)
        sockname = self._server.sockets[0].getsockname()
        log.info("summation service %d listening on %s:%d (%d workers)", self.config.server_id,
                 sockname[0], sockname[1], self.config.cluster.workers)
        self._silence_watch = asyncio.ensure_future(self._watch_silence())
        spec = self.config.cluster.server(self.config.server_id)
        if spec.metrics is not None:
            self._metrics = await metrics.serve(*spec.metrics, self.metric_families)
        return sockname[0], sockname[1]

    def metric_families(self) -> list[metrics.Family]:
        c = self.aggregator.counters
        label = {"server": str(self.config.server_id)}
        per_worker = tuple(({**label, "worker": str(w)}, float(n)) for w, n in sorted(c.bytes_by_worker.items()))
        return [
            metrics.Family("bps_server_bytes_received_total", "counter", "Tensor bytes received in pushes",
                           per_worker or ((label, 0.0),)),
            metrics.Family("bps_server_bytes_shared_memory_total", "counter",
                           "Of the bytes received, those read from the colocated worker's shared memory",
                           ((label, float(c.bytes_shm)),)),
            metrics.Family("bps_server_bytes_sent_total", "counter", "Tensor bytes sent in results",
                           ((label, float(c.bytes_sent)),)),
            metrics.Family("bps_server_pushes_total", "counter", "Pushes received", ((label, float(c.pushes)),)),
            metrics.Family("bps_server_rounds_completed_total", "counter", "Rounds summed and answered",
                           ((label, float(c.rounds_completed)),)),
            metrics.Family("bps_server_rounds_failed_total", "counter", "Rounds failed (mismatch, abort, lost worker)",
                           ((label, float(c.rounds_failed)),)),
            metrics.Family("bps_server_workers_connected", "gauge", "Worker connections",
                           ((label, float(len(self.links))),)),
            metrics.Family("bps_server_keys", "gauge", "Partition keys with state",
                           ((label, float(len(self.aggregator.keys))),)),
            metrics.Family("bps_server_round_seconds", "histogram", "From a round's first push to its sum being sent",
                           ((label, c.round_seconds),)),
        ]

    async def _watch_silence(self) -> None:
        """Drop a worker that has sent nothing (not even a ping) for ``cluster.timeout``: it died or
        stalled without closing its connection, and the rounds waiting for it must fail, not hang.
        Checks every ``timeout / 4``, so a round fails within 1.25 x the timeout."""
        timeout = self.config.cluster.timeout
        loop = asyncio.get_running_loop()
        while not self.stopping:
            await asyncio.sleep(timeout / 4)
            now = loop.time()
            for conn in [*self.links.values(), *self.streams.values()]:
                if now - conn.last_seen > timeout and not conn.closed:
                    log.warning("worker %s sent nothing for %.1f s (limit %g s): dropping it", conn.worker,
                                now - conn.last_seen, timeout)
                    if conn.transport is not None:
                        conn.transport.abort()  # close() would wait to flush to a peer that reads nothing
                    conn.connection_lost(None)
            # Rounds that wait for a worker which is not connected at all (never came, or did not
            # come back after this server restarted) fail rather than wait for ever.
            self.aggregator.sweep(time.monotonic())

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("internal error in a push", exc_info=task.exception())

    def stats(self) -> dict[str, Any]:
        data = self.aggregator.counters.as_dict()
        data["server"] = self.config.server_id
        data["connections"] = len(self.connections)
        data["streams"] = len(self.streams)  # workers' extra connections (Hello.stream > 0)
        data["keys"] = len(self.aggregator.keys)
        return data

    async def stop(self) -> None:
        """Stop accepting, let in-flight sums finish briefly, close every connection."""
        self.stopping = True
        if self._silence_watch is not None:
            self._silence_watch.cancel()
        if self._metrics is not None:
            self._metrics.close()
        if self._server is not None:
            self._server.close()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=2.0)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.timeline is not None:
            self.timeline.close()
