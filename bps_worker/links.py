"""The worker's TCP link to one Summation Service, with a priority send queue.

Pushes wait in a heap ordered by (priority, sequence); they leave it while the
transport's write buffer is under the link's credit (``cluster.credit_bytes``
split over the links), so a huge tensor queued first cannot delay a small,
higher-priority one by more than the credit. Credit is released as the kernel
takes the bytes, not when the sum comes back: a round that waits for a slow
peer therefore never blocks other tensors' pushes (no credit deadlock). Large
TCP pushes are also paced by a window of unanswered pieces (see ``pump``), which
opens after ``WINDOW_STALL_S`` without an answer for the same reason. A worker
may open several links (streams) to one server, see ``bps_worker.placement``.

Results are received straight into the destination the push named (a slice
of the tensor's staging buffer or of the client's segment): no copy after the
socket.

Shared memory: the link to the server on this worker's own host offers it the
worker's segments at the handshake (a probe segment holding a random key). If
the server can read the key, pushes name ``(segment, offset)`` of the data and
of the result instead of carrying bytes, and the server writes the sum in
place: no socket copies, no loopback TCP. Such a push stays in the server's
hands until it answers it, so an abandoned one is never forgotten early (the
server could still write into the result memory); a lost connection fails it
with ``unanswered_shm`` set, and the caller stops reusing that memory.

Server restarts: every Welcome carries the server's *incarnation*, a random id
of that run of it. When a connection breaks, what is in flight is held, not
failed, while the link reconnects (for up to the timeout). If the server that
answers is a new incarnation, its predecessor's state is lost: the link first
*replays* the last finished sum of every partition key it got from that server
(a peer may not have received it before the crash), then pushes again every
partition still in flight (the contributions are intact: results land in a
separate buffer). If it is the same incarnation (the connection alone broke,
and the server already failed the rounds that needed us), the held pushes fail.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import dataclasses
import os
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from typing import Any

from protocol import PROTOCOL_VERSION
from protocol.config import ServerSpec
from protocol.errors import LocalProtocolError, ProtocolError
from protocol.frames import FrameReader, encode_header
from protocol.messages import (
    BATCH_HEADER_BUDGET,
    MAX_BATCH_ITEMS,
    MAX_MESSAGE_CHARS,
    ROLE_WORKER,
    Abort,
    Batch,
    Challenge,
    Failure,
    Hello,
    Message,
    Ping,
    Push,
    Release,
    Reset,
    Result,
    RoundInfo,
    RoundQuery,
    Welcome,
    auth_digest,
    batch_header,
    estimated_header_bytes,
    parse,
    split_batch,
    to_header,
)

from bps_runtime.lowat import ReceiveLowWater
from bps_runtime.timeline import Timeline, now_us

from bps_runtime import segments as shm
from .errors import BPSConnectionError, BPSError, BPSMismatchError

log = logging.getLogger("bps.worker.link")

RECONNECT_DELAY_S = 0.05
RECONNECT_DELAY_MAX_S = 1.0
# Pushes up to this size leave in Batch frames, up to BATCH_MAX_BYTES of payload per frame.
BATCH_ITEM_MAX_BYTES = 64 * 1024
BATCH_MAX_BYTES = 1 << 20
# Pacing (see ServerLink.pump): TCP pushes over PACED_MIN_BYTES count against the window; after
# WINDOW_STALL_S without an answer the window opens until the next one.
PACED_MIN_BYTES = 16 * 1024
WINDOW_STALL_S = 0.25


@dataclass(order=True)
class _Queued:
    sort_key: tuple[int, int]
    push: Push = field(compare=False)
    payload: memoryview = field(compare=False)  # the partition's bytes
    dest: memoryview = field(compare=False)  # where its sum goes
    future: asyncio.Future[None] = field(compare=False)
    shm_ref: tuple[str, int] | None = field(compare=False, default=None)  # (segment, byte offset) of payload
    out_ref: tuple[str, int] | None = field(compare=False, default=None)  # (segment, byte offset) of dest
    via_shm: bool = field(compare=False, default=False)  # sent as a shared-memory reference
    times: list[int] | None = field(compare=False, default=None)  # timeline: queued, sent, sum arriving
    held: bool = field(compare=False, default=False)  # sent on a connection that broke; awaiting the verdict
    paced: int = field(compare=False, default=0)  # bytes it counts against the link's window while unanswered

    def wire_nbytes(self, shm: bool) -> int:
        return 0 if shm and self.shm_ref is not None and self.out_ref is not None else self.payload.nbytes


class _LinkProtocol(asyncio.BufferedProtocol):
    def __init__(self, link: "ServerLink") -> None:
        self.link = link
        self.reader = FrameReader(max_payload_bytes=link.max_payload_bytes, payload_sink=link.payload_destination)
        self.transport: asyncio.Transport | None = None
        self.low_water: ReceiveLowWater | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.low_water = ReceiveLowWater(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.link.last_seen = asyncio.get_running_loop().time()
        try:
            for frame in self.reader.buffer_updated(nbytes):
                self.link.on_message(self, parse(frame.header), frame.payload)
        except ProtocolError as exc:
            self.link.on_broken(self, f"server {self.link.spec.id} sent a bad frame: {exc}")
            return
        if self.low_water is not None:
            self.low_water.follow(self.reader.payload_wanted)

    def pause_writing(self) -> None:
        self.link.paused = True

    def resume_writing(self) -> None:
        self.link.paused = False
        self.link.pump()

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.on_broken(self, f"lost connection to server {self.link.spec.id} at {self.link.spec.address}"
                                  + (f": {exc}" if exc else ""))


class ServerLink:
    """One reusable connection to server ``spec``; reconnects when needed."""

    def __init__(self, spec: ServerSpec, worker_id: int, *, credit_bytes: int, timeout: float,
                 window_pieces: int = 0, stream: int = 0,
                 max_payload_bytes: int, token: bytes | None = None,
                 shm_mode: int | None = None, timeline: Timeline | None = None) -> None:
        self.timeline = timeline
        self.spec = spec
        self.shm_mode = shm_mode  # offer shared memory (segments of this mode) to a server on this host
        self.shm = False  # this connection's server accepted the offer
        self.token = token
        self.worker_id = worker_id
        self.credit_bytes = credit_bytes
        self.window_pieces = window_pieces  # cluster.window_pieces; 0: no pacing
        self.stream = stream  # which of our connections to this server (Hello.stream; 0 carries control)
        self.timeout = timeout
        self.max_payload_bytes = max_payload_bytes
        self.paused = False
        self._proto: _LinkProtocol | None = None
        self._ready = False  # handshake complete: pushes may flow
        self.last_seen = 0.0  # loop time of the last bytes from the server
        self._pings = itertools.count()
        self._connecting: asyncio.Task[None] | None = None
        self._welcome: asyncio.Future[Welcome] | None = None
        self._challenge: asyncio.Future[str] | None = None
        self._queue: list[_Queued] = []
        self._seq = itertools.count()
        self._req = itertools.count(1)
        self._inflight: dict[int, _Queued] = {}
        self._control: list[Message] = []  # aborts, resets and queries waiting for a connection
        self._queries: dict[int, asyncio.Future[int]] = {}
        self.incarnation: str | None = None  # of the server run we last talked to
        self.epoch = ""  # of this worker's round numbering (set by the daemon)
        # The last answered push of every (name, part): its sum is replayed to a restarted server.
        self._answered: dict[tuple[str, int], _Queued] = {}
        self._broken_reason = ""
        self.closed = False
        self._paced = 0  # bytes of unanswered paced pushes (see pump)
        self._unit = 0  # the largest of them since the window was last empty (see _window_blocks)
        self._window_open = False  # no answer for WINDOW_STALL_S: the window is ignored until the next one
        self._stall: asyncio.TimerHandle | None = None

    # -- public ----------------------------------------------------------------------
    def push(self, push_fields: dict[str, Any], payload: memoryview, dest: memoryview, priority: int,
             shm_ref: tuple[str, int] | None = None, out_ref: tuple[str, int] | None = None
             ) -> asyncio.Future[None]:
        """Queue a push of ``payload``; the future resolves once the sum was written into ``dest``.

        ``shm_ref`` and ``out_ref`` locate ``payload`` and ``dest`` in shared-memory segments
        (name, byte offset), for a server that shares this host. ``payload`` must stay unchanged
        until the future is done, and ``dest`` until the next push of the same partition is
        answered (a restarted server may need them again).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        req = next(self._req)
        push = Push(req=req, worker=self.worker_id, **push_fields)
        item = _Queued((-priority, next(self._seq)), push, payload, dest, future, shm_ref, out_ref)
        if self.timeline is not None:
            item.times = [now_us(), 0, 0]
        heapq.heappush(self._queue, item)
        if self._proto is None:
            self._ensure_connecting()
        else:
            self.pump()
        return future

    def forget(self, future: asyncio.Future[None]) -> bool:
        """Drop an abandoned push: a late result for it is discarded, not written to its destination.

        Returns False, and keeps the push, when it went as a shared-memory reference: the server
        writes its answer straight into our memory, so the caller must wait for that answer (it
        always comes: a result, a failure, or the loss of the connection) before reusing it.
        """
        for req, item in list(self._inflight.items()):
            if item.future is future:
                if item.via_shm and not future.done():
                    return False
                del self._inflight[req]
                self._answered.pop((item.push.name, item.push.part), None)
                self._answered_one(item)
                reader = self._proto.reader if self._proto is not None else None
                if reader is not None and reader.pending_destination is item.dest:
                    reader.discard_pending_payload()  # its result is arriving right now: not into dest
        for item in self._queue:
            if item.future is future:
                if item.held and item.via_shm and not future.done():
                    return False  # the broken connection's server may still be alive and write
                self._answered.pop((item.push.name, item.push.part), None)
        if not future.done():
            future.cancel()
        return True

    def query_round(self, name: str, part: int = 0) -> asyncio.Future[int]:
        """Ask the server which round our next push of (name, part) is (see RoundQuery)."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        req = next(self._req)
        self._queries[req] = future
        self._send_control(RoundQuery(req, name, part))
        return future

    def abort(self, name: str, part: int, round_: int, message: str) -> None:
        """Tell the server that this worker gave up a round (sent once connected, if need be)."""
        self._send_control(Abort(name, part, round_, self.worker_id, message[:MAX_MESSAGE_CHARS]))

    def queued_bytes(self) -> int:
        """Payload bytes waiting in the priority queue plus bytes in the transport's write buffer."""
        buffered = 0
        if self._proto is not None and self._proto.transport is not None:
            buffered = self._proto.transport.get_write_buffer_size()
        return buffered + sum(item.wire_nbytes(self.shm) for item in self._queue)

    def heartbeat(self, now: float) -> None:
        """Ping the server; drop a connection that has been silent for longer than the timeout
        (a dead or stalled server that never closed it) so that what waits on it fails."""
        proto = self._proto
        if proto is None or not self._ready:
            return
        if now - self.last_seen > self.timeout:
            if proto.transport is not None:
                proto.transport.abort()
            self.on_broken(proto, f"server {self.spec.id} at {self.spec.address} sent nothing for "
                                  f"{now - self.last_seen:.1f} s (limit {self.timeout:g} s)")
            return
        self._send(proto, Ping(next(self._pings)))

    def reset(self) -> None:
        """Tell the server that this worker has no training processes left (see Reset)."""
        self._answered.clear()  # the next job starts at round 0; the buffers are being freed
        if self.stream == 0:  # the server's state of this worker follows its first connection
            self._send_control(Reset(self.worker_id, self.epoch))

    def release_segments(self, names: list[str]) -> None:
        """Segments we unlinked: a server that maps our memory unmaps them (a new connection maps
        nothing, so there is nothing to tell a server we are not connected to)."""
        if self.shm and self._proto is not None and self._ready:
            for name in names:
                self._send(self._proto, Release(name))

    def _send_control(self, message: Message) -> None:
        if self._proto is not None and self._ready:
            self._send(self._proto, message)
        else:
            self._control.append(message)
            self._ensure_connecting()

    def close(self) -> None:
        self.closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._fail_all(BPSConnectionError("worker daemon is stopping"))

    # -- sending ---------------------------------------------------------------------
    def pump(self) -> None:
        """Send queued pushes in priority order while the transport's buffer is under the credit.

        TCP pushes over ``PACED_MIN_BYTES`` are also paced by a window of unanswered bytes: one
        leaves while this link's unanswered paced pushes, with it, come to at most ``window_pieces``
        (``cluster.window_pieces``) times the largest of them (a range's first and last pieces are
        smaller, ``bps_worker.placement``; counted in their own size, they would shrink the window to a
        piece or two and stall the flow at its end: measured 1.16x the optimal time at k=4). A server
        answers a partition only once every worker pushed it, so a worker whose flow to a server runs
        ahead of the others' flows to it stops there, and its uplink carries its flows to the servers
        where it is behind; all flows into a server progress together, and each partition's sum
        leaves as soon as possible (measured on emulated links, ``benchmarks/RESULTS.md``). A round
        that waits for a slow peer must not block other tensors for ever (names may come in different
        orders on different processes), so after ``WINDOW_STALL_S`` without any answer the window
        opens until the next answer comes. Shared-memory pushes (a few header bytes each) are held by
        neither: all of a large tensor's go to the server at once, and priorities do not reorder them
        there.
        """
        proto = self._proto
        if proto is None or proto.transport is None or not self._ready:
            return
        transport = proto.transport
        while self._queue and not self.paused:
            item = self._queue[0]
            if item.future.done():  # the operation already failed elsewhere
                heapq.heappop(self._queue)
                continue
            size = item.wire_nbytes(self.shm)
            if self._window_blocks(size):
                if self._stall is None:
                    self._stall = asyncio.get_running_loop().call_later(WINDOW_STALL_S, self._open_window)
                break
            heapq.heappop(self._queue)
            self._take(item, size)
            try:
                if size <= BATCH_ITEM_MAX_BYTES and self._queue:
                    self._send_batch(proto, item)
                else:
                    self._send(proto, *self._wire(item))
            except LocalProtocolError as exc:  # a bug of ours: fail loudly, never leave a push unsent and waiting
                log.error("cannot send to server %d: %s", self.spec.id, exc)
                self.on_broken(proto, f"cannot send to server {self.spec.id}: {exc}")
                return
            if transport.get_write_buffer_size() >= self.credit_bytes:
                break

    def _window_blocks(self, size: int) -> bool:
        """Whether a push of ``size`` wire bytes must wait for answers (see pump)."""
        return (size > PACED_MIN_BYTES and self.window_pieces > 0 and self._paced > 0
                and self._paced + size > self.window_pieces * max(size, self._unit) and not self._window_open)

    def _take(self, item: _Queued, size: int) -> None:
        """``item`` (``size`` wire bytes) goes out now: in flight, and in the window if paced."""
        if size > PACED_MIN_BYTES and self.window_pieces > 0:
            item.paced = size
            self._paced += size
            self._unit = max(self._unit, size)
        self._inflight[item.push.req] = item

    def _open_window(self) -> None:
        self._stall = None
        self._window_open = True
        self.pump()

    def _answered_one(self, item: _Queued | None) -> None:
        """``item`` left the server's hands (answered, failed or abandoned): its bytes leave the window."""
        if item is not None and item.paced:
            self._paced -= item.paced
            item.paced = 0
            if self._paced == 0:
                self._unit = 0
        if item is not None:
            self._window_open = False
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None
            if self._queue and self._proto is not None:
                self.pump()

    def _reset_window(self) -> None:
        self._paced = 0
        self._unit = 0
        self._window_open = False
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        for item in self._queue:
            item.paced = 0

    def _wire(self, item: _Queued) -> tuple[Push, memoryview | None]:
        """What goes on the wire for ``item``: the push and its bytes, or a shared-memory reference."""
        if item.times is not None:
            item.times[1] = now_us()
        if self.shm and item.shm_ref is not None and item.out_ref is not None:
            item.via_shm = True
            return dataclasses.replace(item.push, segment=item.shm_ref[0], seg_offset=item.shm_ref[1],
                                       out_segment=item.out_ref[0], out_offset=item.out_ref[1]), None
        item.via_shm = False
        return item.push, item.payload

    def _replay(self, proto: _LinkProtocol, item: _Queued) -> None:
        """Give a restarted server the sum of ``item``'s round, which we got from its predecessor."""
        push = dataclasses.replace(item.push, replay=True)
        if self.shm and item.out_ref is not None:
            self._send(proto, dataclasses.replace(push, segment=item.out_ref[0], seg_offset=item.out_ref[1],
                                                  out_segment=item.out_ref[0], out_offset=item.out_ref[1]))
        else:
            self._send(proto, push, item.dest)

    def _send_batch(self, proto: _LinkProtocol, first: _Queued) -> None:
        """Send ``first`` together with the small pushes queued right behind it (in priority order)."""
        items = [first]
        nbytes = first.wire_nbytes(self.shm)
        limit = min(BATCH_MAX_BYTES, self.max_payload_bytes)  # a batch is one frame: the peer's limit holds
        header_bytes = estimated_header_bytes(first.push)
        while self._queue and len(items) < MAX_BATCH_ITEMS and header_bytes < BATCH_HEADER_BUDGET:
            nxt = self._queue[0]
            size = nxt.wire_nbytes(self.shm)
            if size > BATCH_ITEM_MAX_BYTES or nbytes + size > limit or self._window_blocks(size):
                break
            heapq.heappop(self._queue)
            if nxt.future.done():
                continue
            self._take(nxt, size)
            items.append(nxt)
            nbytes += size
            header_bytes += estimated_header_bytes(nxt.push)
        if len(items) == 1:
            self._send(proto, *self._wire(first))
            return
        transport = proto.transport
        if transport is None or transport.is_closing():
            return
        wires = [self._wire(i) for i in items]
        head = encode_header(batch_header([(m, 0 if p is None else p.nbytes) for m, p in wires]), nbytes,
                             max_payload_bytes=self.max_payload_bytes)
        transport.writelines([head, *(p for _, p in wires if p is not None and p.nbytes)])  # type: ignore[list-item]

    def _send(self, proto: _LinkProtocol, message: Message, payload: memoryview | None = None) -> None:
        transport = proto.transport
        if transport is None or transport.is_closing():
            return
        nbytes = 0 if payload is None else payload.nbytes
        head = encode_header(to_header(message), nbytes, max_payload_bytes=self.max_payload_bytes)
        if nbytes:
            transport.writelines([head, payload])  # type: ignore[list-item]
        else:
            transport.write(head)

    # -- receiving -------------------------------------------------------------------
    def payload_destination(self, header: dict[str, Any], nbytes: int) -> memoryview:
        req = header.get("req")
        item = self._inflight.get(req) if isinstance(req, int) else None
        if header.get("t") == Result.TYPE and item is not None:
            if item.dest.nbytes != nbytes:
                raise ProtocolError(f"result for {item.push.name!r} part {item.push.part} has {nbytes} bytes, "
                                    f"expected {item.dest.nbytes}")
            if item.times is not None:
                item.times[2] = now_us()
            return item.dest
        return memoryview(bytearray(nbytes))  # a late result of an abandoned push: discard

    def on_message(self, proto: _LinkProtocol, message: Message, payload: memoryview | None) -> None:
        if isinstance(message, Batch):
            for item, item_payload in split_batch(message, payload):
                self.on_message(proto, item, item_payload)
            return
        if isinstance(message, Ping):
            return  # the server's answer to our heartbeat: last_seen is already updated
        if isinstance(message, Challenge):
            if self._challenge is not None and not self._challenge.done():
                self._challenge.set_result(message.nonce)
            return
        if isinstance(message, Welcome):
            if self._welcome is not None and not self._welcome.done():
                self._welcome.set_result(message)
            return
        if isinstance(message, Result):
            item = self._inflight.pop(message.req, None)
            self._answered_one(item)
            if message.inplace:
                if item is not None and not item.via_shm:
                    raise ProtocolError(f"server {self.spec.id} answered {item.push.name!r} part "
                                        f"{item.push.part} in shared memory, but it was pushed over TCP")
                if item is not None and not item.future.done():
                    item.future.set_result(None)
                    self._answered[(item.push.name, item.push.part)] = item
                    self._trace(item)
                return
            if item is not None and not item.future.done():
                got = 0 if payload is None else payload.nbytes
                if got != item.dest.nbytes:
                    raise ProtocolError(f"result for {item.push.name!r} part {item.push.part} has {got} bytes, "
                                        f"expected {item.dest.nbytes}")
                if payload is not None and payload is not item.dest:  # a batched result: not received in place
                    item.dest[:] = payload
                item.future.set_result(None)
                self._answered[(item.push.name, item.push.part)] = item
                self._trace(item)
            return
        if isinstance(message, RoundInfo):
            query = self._queries.pop(message.req, None)
            if query is not None and not query.done():
                query.set_result(message.round)
            return
        if isinstance(message, Failure):
            if message.req == -1:
                self.on_broken(proto, f"server {self.spec.id} refused the connection: {message.message}")
                return
            item = self._inflight.pop(message.req, None)
            self._answered_one(item)
            if item is not None:
                self._answered.pop((item.push.name, item.push.part), None)
            if item is not None and not item.future.done():
                cls = BPSMismatchError if "mismatch" in message.message else BPSError
                item.future.set_exception(cls(f"server {self.spec.id}: {message.message}"))
            return
        raise ProtocolError(f"unexpected {message.TYPE} message from server {self.spec.id}")

    def _trace(self, item: _Queued) -> None:
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

    def on_broken(self, proto: _LinkProtocol, reason: str) -> None:
        if proto is not self._proto:
            return
        if not self.closed:
            log.warning("%s", reason)
        self._proto = None
        self._ready = False
        self.shm = False
        self.paused = False
        for waiter in (self._welcome, self._challenge):
            if waiter is not None and not waiter.done():
                waiter.set_exception(ConnectionError(reason))
                waiter.exception()  # retrieved here: the handshake may not be waiting on it yet
        if proto.transport is not None:
            proto.transport.close()
        if self.incarnation is None or self.closed:
            self._fail_all(BPSConnectionError(reason))
            return
        # The server may be restarting: hold what is in flight until we know (see the module docstring).
        self._fail_queries(BPSConnectionError(reason))  # a restarted server would not know the answer
        self._broken_reason = reason
        for item in self._inflight.values():
            item.held = True
            heapq.heappush(self._queue, item)
        self._inflight.clear()
        self._reset_window()
        self._ensure_connecting()

    def _fail_queries(self, exc: BPSError) -> None:
        queries, self._queries = self._queries, {}
        self._control = [m for m in self._control if not isinstance(m, RoundQuery)]
        for query in queries.values():
            if not query.done():
                query.set_exception(exc)

    def _fail_all(self, exc: BPSError) -> None:
        self._fail_queries(exc)
        items = list(self._inflight.values()) + self._queue
        self._inflight.clear()
        self._queue = []
        self._reset_window()
        for item in items:
            if not item.future.done():
                if item.via_shm:
                    unanswered = type(exc)(str(exc))
                    unanswered.unanswered_shm = True  # type: ignore[attr-defined]
                    item.future.set_exception(unanswered)
                else:
                    item.future.set_exception(exc)

    # -- connecting ------------------------------------------------------------------
    def _after_reconnect(self, proto: _LinkProtocol, restarted: bool) -> None:
        """Settle the pushes held since the connection broke (see the module docstring)."""
        held = [item for item in self._queue if item.held]
        if restarted:
            log.warning("server %d restarted (its state is lost): replaying %d finished sums, pushing %d "
                        "partitions again", self.spec.id, len(self._answered), len(held))
            for item in list(self._answered.values()):
                self._replay(proto, item)
            for item in held:
                item.held = False
            return
        if held:
            self._queue = [item for item in self._queue if not item.held]
            heapq.heapify(self._queue)
            for item in held:
                item.held = False
                if not item.future.done():
                    exc = BPSConnectionError(self._broken_reason)
                    if item.via_shm:
                        exc.unanswered_shm = True  # type: ignore[attr-defined]
                    item.future.set_exception(exc)

    def _make_probe(self) -> tuple[SharedMemory, str] | None:
        """The shared-memory offer of one handshake: a segment holding a random key that the server
        must read back (proving it shares our host and may map our segments)."""
        if self.shm_mode is None:
            return None
        try:
            probe = shm.create_segment(shm.segment_name(self.worker_id), 32, self.shm_mode)
        except OSError as exc:
            log.warning("cannot create a shared-memory probe (%s); server %d gets TCP", exc, self.spec.id)
            return None
        key = os.urandom(32)
        probe.buf[:32] = key
        return probe, key.hex()

    def _ensure_connecting(self) -> None:
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        delay = RECONNECT_DELAY_S
        last_error = "no attempt"
        while not self.closed:
            try:
                self._challenge = loop.create_future()
                _, proto = await asyncio.wait_for(
                    loop.create_connection(lambda: _LinkProtocol(self), self.spec.host, self.spec.port),
                    timeout=max(0.1, deadline - loop.time()))
                assert proto.transport is not None
                proto.transport.set_write_buffer_limits(high=self.credit_bytes)
                self._welcome = loop.create_future()
                self._proto = proto
                nonce = await asyncio.wait_for(asyncio.shield(self._challenge),
                                               timeout=max(0.1, deadline - loop.time()))
                auth = auth_digest(self.token, nonce, ROLE_WORKER, self.worker_id) if self.token else ""
                probe = self._make_probe()
                try:
                    self._send(proto, Hello(PROTOCOL_VERSION, ROLE_WORKER, self.worker_id, auth=auth,
                                            shm=probe[0].name if probe else "", shm_key=probe[1] if probe else "",
                                            epoch=self.epoch, stream=self.stream))
                    welcome = await asyncio.wait_for(asyncio.shield(self._welcome),
                                                     timeout=max(0.1, deadline - loop.time()))
                finally:
                    if probe is not None:
                        shm.release(probe[0], unlink=True)
                if self._proto is not proto:
                    raise ConnectionError("connection closed during the handshake")
                self.shm = welcome.shm and probe is not None
                log.info("connected to server %d at %s%s", self.spec.id, self.spec.address,
                         " (shared memory)" if self.shm else "")
                previous, self.incarnation = self.incarnation, welcome.incarnation
                if probe is not None and not self.shm:
                    log.warning("server %d shares this host but cannot map this worker's shared memory (other "
                                "user? see --shm-mode, or colocated_shm = false); using TCP", self.spec.id)
                self._ready = True
                self.last_seen = loop.time()
                control, self._control = self._control, []
                for message in control:
                    self._send(proto, message)
                self._after_reconnect(proto, restarted=previous is not None and previous != welcome.incarnation)
                self.pump()
                return
            except (OSError, asyncio.TimeoutError, ConnectionError) as exc:
                last_error = str(exc) or exc.__class__.__name__
                if self._proto is not None and self._proto.transport is not None:
                    self._proto.transport.close()
                self._proto = None
            if loop.time() + delay > deadline:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_DELAY_MAX_S)
        self._fail_all(BPSConnectionError(
            f"cannot reach server {self.spec.id} at {self.spec.address} within {self.timeout:g} s: {last_error}"))
