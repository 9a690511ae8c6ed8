"""One worker's (or observer's) TCP connection to the Summation Service: a thin protocol class.

Bytes go into a :class:`~protocol.frames.FrameReader`; each parsed message goes, after the
handshake, to the handler its type names in :attr:`ServerConnection.HANDLERS`; pushes go to
the server's :class:`~bps_server.aggregator.Aggregator` once :meth:`ServerConnection.push_data`
has checked them (the one check of both push paths: payload and shared memory). Replies of
up to ``BATCH_REPLY_MAX_BYTES`` that complete in one loop iteration leave in one Batch frame.
Any :class:`ProtocolError` from the peer is answered with a ``Failure(-1)`` and a close.

Before its handshake a connection is a stranger's: it holds a place in the server's
:class:`~bps_runtime.admission.Admission` (bounded per host and in all, closed at a deadline) and a
receive buffer with room for the Hello alone; only a verified Hello makes it grow. While the write
buffer is over :data:`WRITE_BUFFER_HIGH_BYTES` (or the cluster's credit, if larger) the connection
stops reading the peer (:class:`~bps_runtime.backpressure.BackPressure`).

One worker id, one daemon: see :meth:`ServerConnection.handshake` for how a reconnect of the daemon
holding a worker id is told from a second daemon with the same id, which is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Final, cast

import numpy as np

from protocol import PROTOCOL_VERSION
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.frames import DEFAULT_MAX_HEADER_BYTES, BatchWriter, FrameReader, encode_frame
from protocol.handshake import (
    HANDSHAKE_BUFFER_BYTES,
    HANDSHAKE_MAX_HEADER_BYTES,
    ConfigMismatchError,
    ServerHandshake,
    ShmOffer,
)
from protocol.messages import (
    ASYNC_KINDS,
    MAX_MESSAGE_CHARS,
    ROLE_OBSERVER,
    ROLE_WORKER,
    Abort,
    Batch,
    Failure,
    FuseAbort,
    FuseFailed,
    FusePlan,
    FuseReady,
    FuseResync,
    FusePast,
    FuseRunning,
    Hello,
    InitFailed,
    Message,
    Ping,
    Push,
    Release,
    Announce,
    Joined,
    Reset,
    Restored,
    Result,
    RoundInfo,
    RoundQuery,
    Stats,
    StatsRequest,
    Spec,
    Welcome,
    check_spec,
    parse,
    split_batch,
)

from bps_runtime import kernels
from bps_runtime.admission import AdmittedProtocol
from bps_runtime.lowat import ReceiveLowWater
from bps_runtime.segments import SegmentSizeError, attach_owned, attach_segment, check_size, owned_by, release

from .aggregator import INLINE_SUM_MAX_BYTES
from .rounds import Lease, Why, describe, sizes_differ

if TYPE_CHECKING:
    from .server import SummationServer

log = logging.getLogger("bps.server")

# The most segments a worker may have announced (and not released) on one connection: far more than its
# arenas hold, so that only a peer that announces without end meets it.
MAX_ANNOUNCED: Final = 1 << 18
# Replies with payloads up to this size are coalesced into one Batch frame per loop iteration.
BATCH_REPLY_MAX_BYTES: Final = 64 * 1024
# Above this many bytes waiting to be written to a peer (or the cluster's credit_bytes, if larger: what an
# honest worker may have in flight, so it never meets the mark) the server stops reading that peer.
WRITE_BUFFER_HIGH_BYTES: Final = 16 * 1024 * 1024
# A worker's connection silent for more than this fraction of the timeout no longer holds the worker id for
# its daemon against another one (its daemon pings every timeout / 4): see ServerConnection.handshake.
HOLDER_SILENCE_FRACTION: Final = 0.5
# The numberings an extra connection of a worker remembers having been told (its Hello's, its Resets'): a Reset on
# the worker's first connection that names one of them came after it there (see ServerConnection.on_reset).
MAX_JOBS_KEPT: Final = 16


def address(peername: object) -> str:
    """``host:port`` of a socket's peer name (``[host]:port`` for IPv6); the text of anything else."""
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(peername)


def _mapped(seg: SharedMemory) -> memoryview:
    """A mapped segment's memory (typeshed allows None: a closed segment, which is never kept)."""
    buf = seg.buf
    if buf is None:
        raise ValueError(f"shared memory {seg.name!r} is closed")
    return buf


Handler = Callable[["ServerConnection", Any, "memoryview | None"], None]


def _fresh_payload(header: dict[str, Any], nbytes: int) -> memoryview:
    """Memory for a received payload, left as it comes (the socket writes every byte of it; a ``bytearray``
    would be zeroed first). A push's payload becomes its round's accumulator or is summed into one."""
    return np.empty(nbytes, np.uint8).data


class ServerConnection(AdmittedProtocol):
    """One worker's TCP connection: handshake first, then pushes, aborts and queries."""

    HANDLERS: ClassVar[dict[type[Message], Handler]]  # message type -> handler, after the handshake

    def __init__(self, server: SummationServer) -> None:
        self.server = server
        # Until the handshake, a small header, no payload and a small buffer (it grows for a large Hello):
        # next to nothing is allocated for a stranger.
        self.reader = FrameReader(max_header_bytes=HANDSHAKE_MAX_HEADER_BYTES, max_payload_bytes=0,
                                  buffer_bytes=HANDSHAKE_BUFFER_BYTES, payload_sink=_fresh_payload)
        self.greeting = ServerHandshake(
            peers={ROLE_WORKER: server.config.cluster.workers, ROLE_OBSERVER: None}, token=server.config.token,
            config_items=server.placement_items, server=server.config.server_id,
            who=f"server {server.config.server_id}")
        # HMAC key of this connection, for MACs on later frames (None without a token); see protocol.handshake.
        self.session_key: bytes | None = None
        self.transport: asyncio.Transport | None = None
        self.low_water: ReceiveLowWater | None = None
        self.loop = asyncio.get_running_loop()  # asked once: every ask is a getpid system call
        self.last_seen = 0.0  # loop time of the last bytes received (the server's silence watch)
        self.worker: int | None = None
        self.daemon = ""  # the worker daemon's id for its run (Hello.daemon), and its round numbering:
        self.epoch = ""   # the two say which daemon holds the worker id (see handshake)
        self.stream = 0  # which of the worker's connections (Hello.stream)
        # An extra connection's numberings: the one its Hello said and those its Resets said since (the last few).
        # While the worker's first connection has said one (its Reset) that this one has not yet, what comes here is
        # of an ended job (``draining`` for that one: its pushes are refused; see on_reset).
        self.jobs: deque[str] = deque(maxlen=MAX_JOBS_KEPT)
        self.draining: str | None = None
        self.observer = False
        self.peer = "?"
        self.closed = False
        self.shm = False  # the worker shares this host and its memory (see Hello.shm)
        self.shm_uid: int | None = None  # who owns the probe: every segment a push names must be owned by it
        self.segments: dict[str, SharedMemory] = {}  # the worker's segments this connection mapped
        self.announced: set[str] = set()  # the segments the worker announced on this connection (Announce)
        # Small replies of one loop iteration, sent as one Batch frame (see send).
        self._outbox = BatchWriter(max_payload_bytes=server.config.cluster.max_payload_bytes,
                                   item_max_bytes=BATCH_REPLY_MAX_BYTES)

    # -- asyncio.BufferedProtocol ----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = tcp = cast(asyncio.Transport, transport)  # create_server's: a TCP transport
        self.last_seen = self.loop.time()
        peername = transport.get_extra_info("peername")
        self.peer = address(peername)
        host = str(peername[0]) if isinstance(peername, tuple) else self.peer
        self.admit(tcp, self.server.admission, host, self.peer,
                   max(WRITE_BUFFER_HIGH_BYTES, self.server.config.cluster.credit_bytes))
        self.low_water = ReceiveLowWater(transport)
        self.server.connections.add(self)
        challenge = self.greeting.start()
        assert challenge is not None  # a TCP handshake always starts with the server's challenge
        self.send(challenge)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.last_seen = self.loop.time()
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
        self.left()
        self.server.connections.discard(self)
        self.unmap_all()
        if self.worker is None:
            return  # never got past the handshake
        if self.stream:
            if self.server.streams.get((self.worker, self.stream)) is self:
                del self.server.streams[(self.worker, self.stream)]
                log.info("worker %d stream %d (%s) disconnected", self.worker, self.stream, self.peer)
            return
        if self.server.links.get(self.worker) is self:
            del self.server.links[self.worker]
            self.server.values.disconnected(self.worker)
            if not self.server.stopping:
                failed = self.server.aggregator.worker_lost(self.worker)
                self._fused_drop()
                level = logging.WARNING if failed else logging.INFO
                log.log(level, "worker %d (%s) disconnected; %d pending rounds failed", self.worker, self.peer, failed)

    # -- messages --------------------------------------------------------------------
    def handle(self, message: Message, payload: memoryview | None) -> None:
        """One message from the peer: the handshake's, an observer's, or a worker's (see HANDLERS)."""
        if self.observer:
            if not isinstance(message, StatsRequest):
                raise RemoteProtocolError(f"an observer may only send stats requests, not {message.TYPE}")
            self.on_stats_request(message, payload)
            return
        if self.worker is None:
            self.handshake(message)
            return
        handler = self.HANDLERS.get(type(message))
        if handler is None:
            raise RemoteProtocolError(f"unexpected {message.TYPE} message from worker {self.worker}")
        handler(self, message, payload)

    def on_batch(self, batch: Batch, payload: memoryview | None) -> None:
        for item, item_payload in split_batch(batch, payload):
            self.handle(item, item_payload)

    def on_push(self, push: Push, payload: memoryview | None) -> None:
        if self.draining is not None:  # (see on_reset)
            self.fail(push, Why(f"tensor {push.name!r} round {push.round}: of a job that ended on worker {push.worker} "
                                f"(every training process left)", "round_failed"))
            return
        fusion = self.server.fusion
        if push.worker in fusion.without_processes or push.worker not in fusion.active:
            fusion.processes_seen(push.worker)  # (its processes are there: the planner's sweep does not fail it)
        data = self.push_data(push, payload)
        if data is None:
            return  # answered already (a segment the server cannot map)
        if self.server.fusion.ended(push.name):
            self.fail(push, self.server.lanes_ended_why(push.name))
            return
        if push.kind in ASYNC_KINDS or self.server.values.has(push.name, push.part):
            self._async_push(push, data)
            return
        if push.replay:
            self.server.aggregator.replay(push, data)
        else:
            lease = self._lease(push) if push.segment else None
            try:
                later = self.server.aggregator.submit(push, data, self.reply, self.fail, borrowed=lease)
            except Exception:  # a bug of ours: logged as a push task's would be; the connection stays
                log.exception("internal error in a push")
                return
            if later is not None:
                self.server.spawn(later)
            if self.server.waiting_queries and push.part == 0:  # (a rejoiner's query may wait for this key)
                self.server.recheck_waiting_queries()
            if push.part == 0 and (push.name in self.server.fusion.waiting or push.name in self.server.fusion.failed):
                self._pushed_unfused(push)

    def _async_push(self, push: Push, data: np.ndarray) -> None:
        """An asynchronous push (bps_server.values), or a push of a name used in the other mode: refused."""
        values = self.server.values
        asynchronous = push.kind in ASYNC_KINDS
        fused = push.part == 0 and push.name in self.server.fusion.waiting
        if not asynchronous or fused or (push.name, push.part) in self.server.aggregator.keys:
            why = self._misuse(push.name, asynchronous, describe(push))
            self.fail(push, why)
            # The synchronous side (a round here, or a fused sum) hears it as its own: "ours" is the synchronous use.
            synchronous = dataclasses.replace(why, ours=why.theirs, theirs=why.ours) if asynchronous else why
            st = self.server.aggregator.keys.get((push.name, push.part))
            if st is not None:  # the synchronous side waits for our push in a round: it fails too
                self.server.aggregator.abort(push.name, push.part, st.round, push.worker, synchronous)
            if fused:  # or in a fused sum
                self.server.fused(self.server.fusion.abort(push.worker, [push.name], synchronous, told=False))
        elif push.replay:
            values.restore(push, data)
        else:
            values.push(push, data, self, self._lease(push) if push.segment else None)

    def on_restored(self, message: Restored, payload: memoryview | None) -> None:
        if message.worker != self.worker:
            raise RemoteProtocolError(f"worker {self.worker} sent a restored message for worker {message.worker}")
        self._stream_zero(message)
        self.server.values.restored(message.worker)
        self.server.aggregator.table.worker_restored(message.worker)
        self.server.answer_waiting_queries()

    def on_abort(self, abort: Abort, payload: memoryview | None) -> None:
        assert self.worker is not None  # dispatched after the handshake only
        if self.server.fusion.ended(abort.name):
            return  # its rounds fail anyway (see on_push)
        why = Why.carried(abort, abort.name)  # the worker's reason, code and facts
        self.server.aggregator.abort(abort.name, abort.part, abort.round, self.worker, why)
        if self.server.waiting_queries and abort.part == 0:  # (a round given up may wait for a failed round)
            self.server.recheck_waiting_queries()

    def on_init_failed(self, message: InitFailed, payload: memoryview | None) -> None:
        """The root's machine of an asynchronous name failed its init before pushing it (see InitFailed)."""
        if message.worker != self.worker:
            raise RemoteProtocolError(f"worker {self.worker} sent an init failure for worker {message.worker}")
        self.server.values.init_failed(message.name, message.root, message.round, Why.carried(
            message, message.name).relayed(f"worker {message.worker} (the root's machine) failed async_init of "
                                           f"{message.name!r} before pushing it"), message.worker)

    def on_round_query(self, query: RoundQuery, payload: memoryview | None) -> None:
        assert self.worker is not None
        aggregator = self.server.aggregator
        if query.fate >= 0:  # whether a round was summed (RoundQuery.fate): settled first, whatever came before
            summed = aggregator.table.summed(query.name, query.part, query.fate)
            if not summed and not self.server.fusion.ended(query.name):  # (an abort, as the worker's own)
                aggregator.abort(query.name, query.part, query.fate, self.worker, Why.worker_gone(
                    self.worker, f"worker {self.worker}'s link to this server gave up while its push of round "
                                 f"{query.fate} of {query.name!r} was out"))
            self.send(RoundInfo(query.req, int(summed)))
            return
        if aggregator.table.query_waits(self.worker, query.name, query.part, query.failed, query.given_up):
            self.server.wait_query(self, query)
            return
        self.answer_round_query(query)

    def answer_round_query(self, query: RoundQuery) -> None:
        """Which round our worker's round ``query.local`` of the key is (RoundTable.round_for)."""
        assert self.worker is not None
        self.send(RoundInfo(query.req, self.server.aggregator.round_for(query.name, query.part, self.worker,
                                                                        query.local, query.failed, query.given_up)))

    def on_announce(self, message: Announce, payload: memoryview | None) -> None:
        """Segments the worker's pushes on this connection will name: the only ones we map. An honest
        worker announces only its own, and only where we accepted its shared memory."""
        if not self.shm:
            raise RemoteProtocolError(f"worker {self.worker} announced shared memory, but this connection has none")
        for name in message.segments:
            if not owned_by(name, self.worker if self.worker is not None else -1):
                raise RemoteProtocolError(f"worker {self.worker} announced segment {name!r}, not one of its own")
        if len(self.announced) + len(message.segments) > MAX_ANNOUNCED:
            raise RemoteProtocolError(f"worker {self.worker} announced more than {MAX_ANNOUNCED} live segments",
                                      what="announced segments", size=len(self.announced) + len(message.segments),
                                      limit=MAX_ANNOUNCED)
        self.announced.update(message.segments)

    def on_release(self, message: Release, payload: memoryview | None) -> None:
        self.announced.discard(message.segment)
        seg = self.segments.pop(message.segment, None)
        if seg is not None:
            release(seg, unlink=False)

    def on_ping(self, ping: Ping, payload: memoryview | None) -> None:
        self.send(Ping(ping.seq))

    def on_reset(self, reset: Reset, payload: memoryview | None) -> None:
        """Every training process of the worker left. On its first connection the worker's state here resets; each
        extra connection carries the same Reset behind the ended job's last pushes on it, and what reaches us there
        between the two is refused: the Reset may overtake a piece on another connection, which would open the ended
        job's round again after it (the next job's first sum of that partition was stale)."""
        if reset.worker != self.worker:
            raise RemoteProtocolError(f"worker {self.worker} sent a reset for worker {reset.worker}")
        if self.stream:  # (an older one, behind which came the next ended job's pushes, does not end the draining)
            self.jobs.append(reset.epoch)
            if self.draining == reset.epoch:
                self.draining = None
            return
        self.drain_streams(reset.epoch)
        failed = self._processes_gone(reset.worker, reset.epoch, Why.worker_gone(  # (a BPSConnectionError naming
            reset.worker, f"every training process of worker {reset.worker} left"))  # the worker, as elsewhere)
        self.server.values.reset(reset.worker, reset.epoch)
        log.info("worker %d has no training processes; %d pending rounds failed", reset.worker, failed)

    def _processes_gone(self, worker: int, epoch: str, why: Why) -> int:
        """Every training process of ``worker`` is gone (its Reset, or its daemon's restart), its numbering now
        ``epoch``: the rounds and the fused sums that waited for them fail (``why``); how many rounds."""
        spared = self.server.aggregator.processes_ended(worker)  # (a later job's rounds: bps_server.jobs)
        failed = self.server.aggregator.worker_reset(worker, epoch, spared)
        endings = self.server.fusion.endings
        self.server.fused(self.server.fusion.worker_gone(worker, why, reset=True, epoch=epoch, spared=spared))
        if self.server.fusion.endings != endings:
            self.server.lanes_ended()
        return failed

    def drain_streams(self, epoch: str) -> None:
        """Our worker's stream 0 said numbering ``epoch`` (a Reset, or a Hello: a Reset lost with a connection is
        heard so): each extra connection of the worker that has not said it is of an ended job, and refused, until
        it does; not one that said it already, nor one that said a numbering stream 0 never did (a newer one: its
        Hello came first)."""
        assert self.worker is not None
        said = self.server.numberings.setdefault(self.worker, deque(maxlen=MAX_JOBS_KEPT))
        if epoch not in said:
            said.append(epoch)
        for (worker, _), conn in self.server.streams.items():
            if worker == self.worker and epoch not in conn.jobs and all(job in said for job in conn.jobs):
                conn.draining = epoch

    def on_joined(self, joined: Joined, payload: memoryview | None) -> None:
        if joined.worker != self.worker:
            raise RemoteProtocolError(f"worker {self.worker} sent a Joined for worker {joined.worker}")
        self.server.aggregator.worker_joined(joined.worker)
        self.server.values.joined(joined.worker, joined.job, joined.job_age_s)
        self.server.fusion.worker_joined(joined.worker)

    def on_fuse_ready(self, message: FuseReady, payload: memoryview | None) -> None:
        assert self.worker is not None
        self._stream_zero(message)
        specs = [check_spec(s) for s in message.specs]  # checked when built: as hashable tuples
        names, spec_of, counts, rounds = message.names, message.spec, message.counts, message.rounds
        if self.server.values.store.keys and any(self.server.values.has(n, 0) for n in names):
            keep = [i for i, n in enumerate(names) if not self._fused_misuse(n)]
            for i in set(range(len(names))) - set(keep):  # refused, yet told of (see Planner.resync)
                self.server.fusion.heard_of(self.worker, names[i])
            names, spec_of = [names[i] for i in keep], [spec_of[i] for i in keep]
            counts = [counts[i] for i in keep] if counts else counts
            rounds = [rounds[i] for i in keep] if rounds else rounds
        named = [specs[i] for i in spec_of]
        failures = self.server.fusion.report(self.worker, names, named, counts, time.monotonic(), rounds)
        aggregator = self.server.aggregator
        for name, spec in zip(names, named):
            open_round = aggregator.unfused(name)
            if open_round is not None and self.worker not in open_round[0]:  # other workers pushed it unfused
                pushers, first = open_round
                why = sizes_differ(name, spec, self.worker, describe(first), first.worker)
                failures += self.server.fusion.reported_beside_unfused(self.worker, name, why, pushers)
                aggregator.fail_open(name, why)
        self.server.fused(failures)

    def _fused_misuse(self, name: str) -> bool:
        """A small synchronous sum of an asynchronous name (fused, so no push shows it): refused, as a push."""
        assert self.worker is not None
        if not self.server.values.has(name, 0):
            return False
        why = self._misuse(name, asynchronous=False, ours="a fused sum")
        self.send(FuseFailed(name, epoch=self.server.fusion.epoch(self.worker), **why.carry()))
        return True

    def _misuse(self, name: str, asynchronous: bool, ours: str) -> Why:
        """Why this worker's use of ``name`` is refused: the job uses it in the other mode."""
        mode, other = ("asynchronously", "synchronously") if asynchronous else ("synchronously", "asynchronously")
        detail = (f"worker {self.worker} used it {mode}, but the job uses it {other}; a name is either synchronous "
                  f"or asynchronous for the life of a job")
        return Why(f"tensor {name!r}: {detail}", "mismatch", name=name, ours=f"{ours}, {mode}",
                   theirs=f"used {other} in this job", detail=detail)

    def _pushed_unfused(self, push: Push) -> None:
        """A push of partition 0 of a name that waits (or failed) at this anchor's planner: the sizes differ
        between workers (one side fused, the other not) unless this worker's report is the one waiting."""
        assert self.worker is not None
        pushers = (self.server.aggregator.unfused(push.name) or ({self.worker}, push))[0]
        waiting = self.server.fusion.waiting.get(push.name)
        fused_worker = waiting.first if waiting is not None else -1
        whys: list[Why] = []

        def why(spec: Spec) -> Why:
            whys.append(sizes_differ(push.name, spec, fused_worker, describe(push), self.worker or 0))
            return whys[-1]

        # (A late push of a round that the reporters waiting here gave up: their reports are of a later step.)
        past = waiting is not None and self.server.aggregator.past(push.name, waiting.workers)
        failures = self.server.fusion.pushed_unfused(self.worker, push.name, why, pushers, past)
        if whys:
            self.server.aggregator.fail_open(push.name, whys[0])
        self.server.fused(failures)

    def on_fuse_running(self, message: FuseRunning, payload: memoryview | None) -> None:
        assert self.worker is not None
        self._stream_zero(message)
        self.server.fusion.running(self.worker, message.seq, message.names, message.counts, message.rounds,
                                   message.lanes)
        self.server.fused([])

    def on_fuse_past(self, message: FusePast, payload: memoryview | None) -> None:
        assert self.worker is not None
        self._stream_zero(message)
        self.server.fused(self.server.fusion.past(self.worker, message.names, message.rounds, message.counts))

    def on_fuse_abort(self, message: FuseAbort, payload: memoryview | None) -> None:
        assert self.worker is not None
        self._stream_zero(message)
        why = Why.carried(message).relayed(f"worker {self.worker} gave the fused sum up")
        aggregator = self.server.aggregator

        def unfused(name: str) -> set[int]:
            open_round = aggregator.unfused(name)
            return open_round[0] if open_round is not None else set()

        self.server.fused(self.server.fusion.abort(self.worker, message.names, why, unfused, message.reported,
                                                   rounds=message.rounds))

    def on_fuse_resync(self, message: FuseResync, payload: memoryview | None) -> None:
        assert self.worker is not None
        self._stream_zero(message)
        if message.incarnation != self.server.incarnation or message.epoch != self.epoch:
            return  # counts of our previous run (the worker reports again), or of processes gone since (reset)
        if message.next_plan >= 0:
            plans = self.server.fusion.sent_since(message.next_plan, self.worker)
            if plans is None:
                log.error("worker %d lost fused plans from %d on with its connection, and this server no longer "
                          "keeps them: its fused sums of this server may be numbered unlike its peers'",
                          self.worker, message.next_plan)
            fusion = self.server.fusion
            for seq, names, lanes in plans or ():
                groups, group = fusion.groups(names)
                self.send(FusePlan(seq, names, resent="lost", groups=groups, group=group,
                                   epoch=fusion.epoch(self.worker), lanes=lanes))
        why = Why(f"worker {self.worker}'s connection to server {self.server.config.server_id} broke with this "
                  f"fused sum's round on its way", "connection", peer=f"worker {self.worker}",
                  detail="its message about the round was lost with its connection")
        failures = self.server.fusion.resync(self.worker, message.names, message.counts, why, message.rounds)
        log.info("worker %d is back: %d fused names resynchronised, %d failures told", self.worker,
                 len(message.names), len(failures))
        self.server.fused(failures)

    def _stream_zero(self, message: Message) -> None:
        if self.stream:
            raise RemoteProtocolError(f"worker {self.worker} sent {message.TYPE} on stream {self.stream}, not 0")

    def on_stats_request(self, request: StatsRequest, payload: memoryview | None) -> None:
        self.send(Stats(request.req, self.server.stats()))

    # -- pushes ----------------------------------------------------------------------
    def push_data(self, push: Push, payload: memoryview | None) -> np.ndarray | None:
        """The one check of a push against this connection, and its data: the payload, or a view of
        the colocated worker's shared memory (``push.segment``). RemoteProtocolError for a push no honest
        worker sends; None when the push was failed (a segment this server cannot map)."""
        if push.worker != self.worker:
            raise RemoteProtocolError(f"worker {self.worker} pushed as worker {push.worker}")
        push.check_extent()
        limit = self.server.config.cluster.max_payload_bytes
        if push.payload_nbytes > limit:  # (the frame reader's limit, for a push by shared-memory reference too)
            raise RemoteProtocolError(f"push of {push.name!r} part {push.part} has {push.payload_nbytes} bytes, more "
                                      f"than cluster.max_payload_bytes", what="push payload",
                                      size=push.payload_nbytes, limit=limit)
        if push.segment:
            return self._shm_data(push, payload)
        if push.payload_nbytes != (payload.nbytes if payload is not None else 0):
            raise RemoteProtocolError(f"push of {push.name!r} part {push.part} announces {push.count} {push.dtype} "
                                      f"elements but carries {0 if payload is None else payload.nbytes} bytes",
                                      what="push payload", size=0 if payload is None else payload.nbytes,
                                      limit=push.payload_nbytes)
        if payload is None:
            return np.empty(0, dtype=kernels.STORAGE[push.dtype])
        return kernels.as_array(payload, push.dtype)

    def _shm_data(self, push: Push, payload: memoryview | None) -> np.ndarray | None:
        """A view of the push's partition in the worker's segment; both named segments mapped and
        checked to be the worker's and large enough (the sum is written to the second)."""
        if not self.shm:
            raise RemoteProtocolError(f"push of {push.name!r} names shared memory, but this connection has none")
        if payload is not None and payload.nbytes:
            raise RemoteProtocolError(f"push of {push.name!r} names shared memory and also carries a payload")
        segments = []
        for name, offset in ((push.segment, push.seg_offset), (push.out_segment, push.out_offset)):
            if not owned_by(name, push.worker):
                raise RemoteProtocolError(f"push of {push.name!r} names segment {name!r}, not one of worker "
                                          f"{push.worker}'s")
            seg = self._segment(push, name, offset + push.payload_nbytes)
            if seg is None:
                return None
            segments.append(seg)
        return np.frombuffer(_mapped(segments[0]), dtype=kernels.STORAGE[push.dtype], count=push.count,
                             offset=push.seg_offset)

    def _lease(self, push: Push) -> Lease:
        """The check the aggregator makes right before each read of this push's view (``rounds.Lease``):
        its data segment is still the file we mapped, and still large enough. Its error names the worker whose
        memory it is (the round fails for every worker: a peer whose daemon died meanwhile took its segments
        with it, and the others hear whose)."""
        seg, needed, tensor, worker = (self.segments[push.segment], push.seg_offset + push.payload_nbytes, push.name,
                                       push.worker)

        def lease() -> None:
            try:
                check_size(seg, needed, tensor)
            except SegmentSizeError as exc:
                exc.strerror = f"worker {worker}'s {exc.strerror}"
                raise
        return lease

    def _segment(self, push: Push, name: str, needed: int) -> SharedMemory | None:
        """Our mapping of segment ``name`` for ``push``, with ``needed`` bytes right now; None, and the push
        failed, where the worker did not announce it on this connection, we cannot map it, or it is smaller
        (a training process truncated it: a bad segment fails its one push, never the link or the server).

        The size is checked with one ``stat`` here, again right before each read of the view (the push's
        lease: a round may hold it while it waits for the other workers' pushes) and before the sum is
        written; a process that truncates in the microseconds between a check and its access can still
        make the server touch a missing page: only memory sealed against shrinking would not."""
        if name not in self.announced:
            self.fail(push, Why(f"push of {push.name!r} names shared memory {name!r}, which worker {push.worker} "
                                f"did not announce on this connection"))
            return None
        seg = self.segments.get(name)
        if seg is None:
            try:
                seg = self.segments[name] = attach_segment(name, owner_uid=self.shm_uid)
            except OSError as exc:
                self.fail(push, Why(f"server cannot map shared memory {name!r} of {push.name!r}: {exc}"))
                return None
        try:
            if needed > seg.size:
                raise SegmentSizeError(name, seg.size, needed, push.name)
            check_size(seg, needed, push.name)
        except SegmentSizeError as exc:
            self.fail(push, Why(f"server {self.server.config.server_id}: {exc.strerror}"))
            return None
        return seg

    def unmap_all(self) -> None:
        for seg in self.segments.values():
            release(seg, unlink=False)
        self.segments.clear()

    def _accept_shm(self, offer: ShmOffer | None, worker: int, stream: int) -> int | None:
        """The owner uid of the worker's shared-memory probe if its offer holds, else None.

        It holds when shared memory is on, the offer comes on the worker's first connection (stream 0:
        placement offers it on no other), the probe is named as the worker's, we can map it, and the key
        is in it: we share the worker's host and may read its segments. Every segment a push names later
        must belong to the probe's owner (issue 14, item 2): another local user who gets in as this worker
        with a probe of its own can name only its own memory, never the real worker's."""
        if offer is None or stream or not self.server.config.cluster.colocated_shm:
            return None
        if not owned_by(offer.segment, worker):
            return None
        try:
            probe, owner = attach_owned(offer.segment)
        except OSError as exc:
            log.warning("worker %d offered shared memory %r but it cannot be mapped here (%s); using TCP",
                        worker, offer.segment, exc)
            return None
        try:
            ok = probe.size >= 32 and bytes(_mapped(probe)[:32]).hex() == offer.key
        finally:
            release(probe, unlink=False)
        if not ok:
            log.warning("worker %d offered shared memory %r with the wrong key; using TCP", worker, offer.segment)
        return owner if ok else None

    def handshake(self, message: Message) -> None:
        """The peer's Hello, checked by :class:`~protocol.handshake.ServerHandshake` (version, the token's
        proof over both nonces and every field, role and id, the placement digest) before anything else;
        then the registration and the signed Welcome. A HandshakeError is a ProtocolError (refused, closed);
        another cluster file is refused with code ``mismatch`` and both digests (the worker stops retrying).

        One worker id, one daemon. Each worker daemon says in its Hello who it is for this run of it
        (``Hello.daemon``: random, kept across its epochs, which change at every job reset) and each of its
        connections has its own ``stream``. A Hello for a worker id is accepted, and replaces the old
        connection of its (worker, stream), when it comes from the daemon that holds the id (the same
        ``daemon``: a reconnect, whatever the epoch), or when no connection of that worker is alive and was
        heard within :data:`HOLDER_SILENCE_FRACTION` of the timeout (the holder died, or its host did: a
        live daemon pings every timeout / 4, so a silent connection is a dead one, which the silence watch
        would drop anyway). Otherwise a second daemon runs with the same id (a stale service unit and a
        manual start): it is refused with code ``duplicate``, naming the worker, both daemons' addresses,
        ids and epochs, and the holder keeps its connections. The epoch alone cannot tell the two apart
        (a reset daemon has a new one), and closing the old connection, as before, made the two daemons
        take turns in a reconnect storm in which every operation failed."""
        if self.closed:
            return  # refused already: the rest of what the peer sent in the same read is ignored
        try:
            hello = self.greeting.receive(message)
        except ConfigMismatchError as exc:
            log.warning("refusing %s: %s", self.peer, exc)
            self.send(self.greeting.refuse(Failure(-1, str(exc), code="mismatch",
                                                   name="the cluster file's placement digest",
                                                   ours=exc.ours, theirs=exc.theirs)))
            self.close()
            return
        holder = self.server.holder(hello.id, hello.daemon) if hello.role == ROLE_WORKER else None
        if holder is not None:
            self._refuse_second_daemon(hello, holder)
            return
        self.admitted()  # a proven peer (with a token): no longer a stranger
        workers = self.server.config.cluster.workers
        if hello.role == ROLE_OBSERVER:
            self.observer = True  # stats requests only: the small reader stays
            self._welcome(Welcome(PROTOCOL_VERSION, workers=workers))
            return
        self.reader.set_limits(max_header_bytes=DEFAULT_MAX_HEADER_BYTES,
                               max_payload_bytes=self.server.config.cluster.max_payload_bytes)
        self._register(hello)
        self.shm_uid = self._accept_shm(self.greeting.shm_offer, hello.id, hello.stream)
        self.shm = self.shm_uid is not None
        log.info("worker %d connected from %s%s", hello.id, self.peer, " (shared memory)" if self.shm else "")
        self._welcome(Welcome(PROTOCOL_VERSION, worker=hello.id, workers=workers, shm=self.shm,
                              incarnation=self.server.incarnation))

    def _register(self, hello: Hello) -> None:
        """Make this the connection of (worker, stream), replacing (and closing) the daemon's old one."""
        self.worker, self.stream, self.daemon, self.epoch = hello.id, hello.stream, hello.daemon, hello.epoch
        self.jobs = deque([hello.epoch], maxlen=MAX_JOBS_KEPT)
        if hello.stream:
            # An extra connection for pushes (see Hello.stream): the worker's state follows stream 0.
            old = self.server.streams.get((hello.id, hello.stream))
            self.server.streams[(hello.id, hello.stream)] = self
        else:
            old = self.server.links.get(hello.id)
            self.server.links[hello.id] = self
        if old is not None and not old.closed:
            log.warning("worker %d reconnected from %s; closing its old connection", hello.id, self.peer)
            old.close()
            if not hello.stream:  # its loss will not be heard as this worker's (it is not its link now)
                self._fused_drop()
        if not hello.stream:
            known = self.server.fusion.daemons.get(hello.id)  # (its daemon at its last hello: worker_hello below)
            if known is not None and known != hello.daemon and self.server.aggregator.had_processes(hello.id):
                self._daemon_restarted(hello)  # (one that ended its processes, or had none, left nothing open)
            if hello.epoch:
                self.drain_streams(hello.epoch)
            endings = self.server.fusion.endings
            self.server.fusion.worker_hello(hello.id, hello.epoch, hello.daemon)
            self.server.aggregator.worker_hello(hello.id, hello.epoch, hello.fresh)
            if not hello.processes:  # (a daemon idle since it started, or since its processes left)
                self.server.aggregator.worker_idle(hello.id)
                self.server.fusion.worker_idle(hello.id)
            self.server.answer_waiting_queries()
            if self.server.fusion.endings != endings:  # (its Reset was lost with a connection)
                self.server.lanes_ended()
            self.server.values.connected(hello.id, hello.epoch, hello.job if hello.processes else "", hello.job_age_s)

    def _daemon_restarted(self, hello: Hello) -> None:
        """Worker ``hello.id`` is back with another daemon run than the one this server knew: the old daemon died
        (killed, or its machine), and every round in flight with it died too, for its processes: each heard a
        connection error, and one that lives on (``init()`` again) goes on with its next step. Those rounds fail
        here now, as the old daemon's Reset would have failed them. They waited for the worker (or for what it
        had reported), and the new daemon's first pushes and reports would otherwise have completed them: with a
        surviving process's next step, summed into its peers' step before (a review's reproducer: every later
        step of those names a step apart, silently). Only where the old daemon's processes were there when it
        went: one whose processes had left (its Reset) or never came had nothing open, and the rounds open now
        are the next job's first ones, waiting for the new daemon's processes (a review of this change: a CPU
        server serving job after job failed each new job's first rounds)."""
        worker = hello.id
        failed = self._processes_gone(worker, hello.epoch, Why(
            f"worker {worker}'s daemon restarted: its processes' rounds in flight were lost with it", "connection",
            peer=f"worker {worker}"))
        log.warning("worker %d is back with a new daemon (%s): the rounds in flight with its old one fail (%d here)",
                    worker, self.describe_daemon(), failed)

    def _fused_drop(self) -> None:
        """This worker's connection is gone (closed, or replaced by its reconnect): the fused sums waiting on
        what it reported on it fail, at the same boundary as the worker's (what it sent on the old connection
        is failed there too, see bps_worker.fused_driver's link_ready)."""
        assert self.worker is not None  # a worker's connection, past its handshake
        self.server.fused(self.server.fusion.worker_gone(self.worker, Why(
            f"worker {self.worker} disconnected from server {self.server.config.server_id}", "connection",
            peer=f"worker {self.worker}", detail="it disconnected while fused sums waited for it"), reset=False))

    def describe_daemon(self) -> str:
        """This worker connection's daemon, for the log and a refusal: where from, which run, which epoch."""
        return f"from {self.peer} (daemon {self.daemon or '?'}, epoch {self.epoch or '?'})"

    def _refuse_second_daemon(self, hello: Hello, holder: ServerConnection) -> None:
        """Refuse ``hello``: worker ``hello.id`` is held by ``holder``'s daemon, alive (see handshake)."""
        self.daemon, self.epoch = hello.daemon, hello.epoch
        heard = asyncio.get_running_loop().time() - holder.last_seen
        reason = (f"worker {hello.id} is already served by another daemon, connected {holder.describe_daemon()} "
                  f"and heard {heard:.1f} s ago; refusing this second daemon of worker {hello.id} "
                  f"{self.describe_daemon()}: stop one of them (a stale service unit beside a manual start?)")
        self.server.refusals.log(log, logging.ERROR, "server %d: %s", self.server.config.server_id, reason)
        holder_text = f"worker {hello.id} {holder.describe_daemon()}"[:MAX_MESSAGE_CHARS]
        self.send(self.greeting.refuse(Failure(-1, reason[:MAX_MESSAGE_CHARS], code="duplicate", peer=holder_text)))
        self.close()

    def _welcome(self, welcome: Welcome) -> None:
        """Send ``welcome``, signed by the handshake (its proof and our placement digest)."""
        established = self.greeting.accept(welcome)
        self.session_key = established.session_key
        self.send(established.welcome)

    # -- replies ---------------------------------------------------------------------
    def reply(self, push: Push, out: np.ndarray, applied: list[int] | None = None) -> None:
        """Answer ``push`` with ``out`` (a sum, or an asynchronous key's value and its ``applied`` vector)."""
        if push.segment and out.nbytes < INLINE_SUM_MAX_BYTES:
            self._write_in_place(push, out, applied)  # small: at once, no task
        elif push.segment:
            self.server.spawn(self._reply_in_place(push, out, applied))
        else:
            self.send(Result(push.req, push.name, push.part, push.round, applied=applied or []), out)

    def _write_in_place(self, push: Push, out: np.ndarray, applied: list[int] | None) -> None:
        seg = self.segments.get(push.out_segment)
        if seg is None or self.closed:
            return  # the worker released the segment or left: nobody waits for this answer
        if not self._still_fits(push, seg, out.nbytes):
            return
        np.copyto(np.frombuffer(_mapped(seg), dtype=out.dtype, count=out.size, offset=push.out_offset), out)
        self.send(Result(push.req, push.name, push.part, push.round, inplace=True, applied=applied or []))

    async def _reply_in_place(self, push: Push, out: np.ndarray, applied: list[int] | None) -> None:
        """Write a large sum where the worker asked for it (in a thread), then tell it."""
        seg = self.segments.get(push.out_segment)
        if seg is None or self.closed or not self._still_fits(push, seg, out.nbytes):
            return
        dest = np.frombuffer(_mapped(seg), dtype=out.dtype, count=out.size, offset=push.out_offset)
        await asyncio.get_running_loop().run_in_executor(self.server.executor, np.copyto, dest, out)
        del dest
        self.send(Result(push.req, push.name, push.part, push.round, inplace=True, applied=applied or []))

    def _still_fits(self, push: Push, seg: SharedMemory, nbytes: int) -> bool:
        """Whether the push's result segment still has room for its sum (one ``stat``); else the push fails."""
        try:
            check_size(seg, push.out_offset + nbytes, push.name)
        except SegmentSizeError as exc:
            self.fail(push, Why(f"server {self.server.config.server_id}: {exc.strerror}"))
            return False
        return True

    def fail(self, push: Push, why: Why) -> None:
        """Tell the push's sender that it failed: the text, code and facts of ``why``."""
        self.send(why.for_push(push).failure(push.req))

    def send(self, message: Message, payload: np.ndarray | None = None) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        nbytes = 0 if payload is None else payload.nbytes
        if isinstance(message, (Result, Failure, RoundInfo)) and message.req >= 0 and self._outbox.batchable(nbytes):
            # Many small rounds complete in one loop iteration (thousands of tiny tensors):
            # answer them in one frame.
            if not self._outbox.fits(nbytes):
                self._flush()  # a batch is one frame: the peer's payload limit holds for it too
            if not len(self._outbox):
                self.loop.call_soon(self._flush)
            if self._outbox.add(message, payload):
                self._flush()
            return
        self.transport.writelines(encode_frame(message, payload,
                                               max_payload_bytes=self.server.config.cluster.max_payload_bytes))

    def _flush(self) -> None:
        buffers = self._outbox.flush()
        if buffers and not (self.closed or self.transport is None or self.transport.is_closing()):
            self.transport.writelines(buffers)

    def protocol_error(self, reason: str) -> None:
        """Drop the peer, saying why (in a Failure that fits a frame, and a log line that a stranger, who may
        send such frames as fast as it connects, cannot make more than the strangers' rate allows)."""
        reason = reason[:MAX_MESSAGE_CHARS]
        if self.worker is not None:
            log.warning("dropping worker %d at %s: %s", self.worker, self.peer, reason)
        else:
            self.server.refusals.log(log, logging.WARNING, "dropping unidentified peer at %s: %s", self.peer, reason)
        try:
            self.send(self.greeting.refuse(Failure(-1, reason, code="protocol_error")))
        finally:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self.closed = True


ServerConnection.HANDLERS = {
    Batch: ServerConnection.on_batch,
    Push: ServerConnection.on_push,
    Abort: ServerConnection.on_abort,
    InitFailed: ServerConnection.on_init_failed,
    RoundQuery: ServerConnection.on_round_query,
    Release: ServerConnection.on_release,
    Announce: ServerConnection.on_announce,
    Ping: ServerConnection.on_ping,
    Reset: ServerConnection.on_reset,
    Joined: ServerConnection.on_joined,
    StatsRequest: ServerConnection.on_stats_request,
    FuseReady: ServerConnection.on_fuse_ready,
    FuseAbort: ServerConnection.on_fuse_abort,
    FuseRunning: ServerConnection.on_fuse_running,
    FusePast: ServerConnection.on_fuse_past,
    FuseResync: ServerConnection.on_fuse_resync,
    Restored: ServerConnection.on_restored,
}
