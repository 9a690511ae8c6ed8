"""One local round's collective operation on this machine, stage by stage.

A round whose local processes all submitted and agree (``bps_worker.local_rounds``) runs as an
``Operation``:

1. *round*: the servers' number of the round (our local number plus the name's base, see RoundQuery);
2. *gather*: this machine's contribution. The processes' tensors are summed into a staging buffer in
   shared memory. A single process's own slot is pushed directly, with no copy, and so is a broadcast
   root's: the servers copy the root's bytes (a machine without the root pushes any slot of its own,
   whose data the servers ignore), so a broadcast is bit-exact. Where the tensors
   live is a small strategy: ``CpuPath`` (the processes' shared-memory slots) or ``CudaPath`` (their
   GPU tensors, opened by CUDA IPC, summed on the GPU and staged in page-locked memory);
3. *scatter*: the contribution cut into pieces by ``bps_worker.placement`` and pushed on the links,
   with the sums landing in the name's results buffer;
4. *wait*: for every piece's sum; on the first failure the rest are abandoned and every server that
   did not deliver its piece is told (the peers waiting there must fail now, not at a timeout);
5. *hand back*: each piece's sum is copied into the slots of the processes that want it there (a
   shared array pushed in place) as soon as it arrives, while the other pieces are still on the
   network; CUDA results are copied back to the GPU tensors at the end;
6. *reply*: ``Done`` to every member, or ``Failure`` (after some partitions, saying how many the
   in-place arrays now hold). Whatever fails, every process gets an answer, and where we never pushed
   the round is aborted at the anchor server, where the peers on other machines wait for us.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from math import prod
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Final, Protocol

import numpy as np

from bps_runtime import cuda, kernels
from bps_runtime import segments as shm
from bps_runtime.timeline import Timeline, now_us
from protocol import dtypes
from protocol.messages import ROOTED_KINDS, Done, Failure, Op, Result, Why, detail_about

from .errors import AnswerLostError, BPSConnectionError, BPSError, LinkBrokenError, failure_from_error, why_from_error
from .link import ServerLink
from .local_rounds import LocalRound
from .placement import Piece, Placement
from .session import ClientSession

if TYPE_CHECKING:
    from .daemon import WorkerConfig, WorkerCounters

log = logging.getLogger("bps.worker")

# Local sums and copies at least this large run in the thread pool, off the event loop.
OFFLOAD_MIN_BYTES: Final = 1 << 20

Member = tuple[ClientSession, Op]


class Path(Protocol):
    """Where an operation's tensors live: its gather and hand-back stages (CpuPath, CudaPath,
    bps_worker.fused_operation.FusedPath).

    A path is handed its operation on every call and keeps no reference to it: an operation and its path
    referring to each other made every finished operation cyclic garbage (with its rounds, entries and
    tables), which only the cyclic collector could free: 20-40 thousand objects a second in a worker daemon
    at 5000 small tensors a step (``benchmarks/RESULTS.md``, session 13)."""

    async def gather(self, o: Operation) -> Contribution: ...

    def handback_slots(self, o: Operation) -> list[np.ndarray]: ...

    def intact(self, o: Operation) -> bool: ...

    async def copy_back(self, o: Operation, out: np.ndarray) -> None: ...

    def done(self, op: Op, out_segment: str, out_base: int) -> Done: ...


class OperationHost(Protocol):
    """What an operation needs from its daemon: the links, the arenas, the thread pool and the counters."""

    config: WorkerConfig
    counters: WorkerCounters
    placement: Placement
    streams: dict[int, list[ServerLink]]  # every server's links, by stream
    links: dict[int, ServerLink]  # every server's stream 0 (control messages)
    results: shm.Arena  # per name, where the global sums land
    staging: shm.Arena  # per name, the machine's local sum
    executor: ThreadPoolExecutor
    timeline: Timeline | None
    rank_offset: int
    epoch: str  # of the round numbering: a new one after every reset (the job ended or died)
    job: str  # the job of the processes connected now (Hello.job; "" where they named none)

    def round_base(self, name: str, local_round: int) -> asyncio.Future[int]: ...

    async def cuda_bridge(self) -> cuda.CudaBridge: ...

    def staging_buffer(self, arena: shm.Arena, name: str, nbytes: int, dtype: str, count: int
                       ) -> tuple[np.ndarray, str, int]: ...

    async def results_buffer(self, name: str, nbytes: int, dtype: str, count: int) -> tuple[np.ndarray, str, int]: ...

    def segments_freed(self, names: list[str]) -> None: ...

    def abort_at_anchor(self, name: str, server_round: int, why: Why) -> None: ...

    def give_up_failed_round(self, name: str, local_round: int, why: Why) -> Coroutine[Any, Any, None]: ...

    def spawn(self, coro: Any) -> asyncio.Future[Any]: ...


@dataclass
class Contribution:
    """What this machine pushes: an array in shared memory, its segment and byte offset there."""

    buf: np.ndarray
    segment: str
    base: int
    direct: bool  # a process's own slot, pushed with no local sum


@dataclass
class Scattered:
    """The pushes of one operation: each piece's future, and where the sums land."""

    out: np.ndarray
    out_segment: str
    out_base: int
    futures: list[tuple[Piece, asyncio.Future[None]]]
    slots: list[np.ndarray]  # the slots that get each piece's sum as it arrives


async def run_operation(host: OperationHost, lr: LocalRound[ClientSession]) -> None:
    """Run a ready local round (see ``Operation``)."""
    await Operation(host, lr).run()


class Operation:
    """One local round's collective, from the local processes' tensors to their answers."""

    # Whether a failure is told to the servers (Abort): peers wait for a synchronous round there; an
    # asynchronous push has no round (bps_worker.async_operation).
    ABORTS = True
    # Called with each piece's Result before its future resolves (an asynchronous value's vector).
    on_result: Callable[[Result], None] | None = None

    def __init__(self, host: OperationHost, lr: LocalRound[ClientSession]) -> None:
        self.host = host
        self.name = lr.name
        self.local_round = lr.round
        self.op = op = lr.first
        self.members = lr.ordered()
        self.count = prod(op.shape)
        self.itemsize = dtypes.ITEMSIZE[op.dtype]
        self.nbytes = self.count * self.itemsize
        local = op.root - host.rank_offset
        # A broadcast's root as a local rank, None where it is on another machine.
        self.root = local if op.kind in ROOTED_KINDS and 0 <= local < host.config.local_size else None
        self.priority = max((o.priority for _, o in self.members), default=0)
        self.path: Path = CudaPath() if op.cuda else CpuPath()
        self.server_round: int | None = None
        self.pushed = False
        self.summed = False  # every piece's sum arrived (a failure after that is this machine's alone)
        # Every piece was summed, some for the peers only (AnswerLostError): our failure is ours alone.
        self.summed_elsewhere = False
        # The pieces not summed for us where the first failure left a piece's fate unknown (the link gave up
        # while its push was out, LinkBrokenError.fate_unknown): their servers may have summed them for the peers.
        self.unsettled: list[Piece] = []
        self.epoch = host.epoch  # the job this operation belongs to

    def _job_current(self) -> bool:
        """Whether our job still runs here. After a reset its rounds are gone at the servers, and the
        next job's rounds reuse their numbers: an abort of ours would fail one of those."""
        return self.host.epoch == self.epoch

    async def run(self) -> None:
        """The stages in turn; whatever fails, every member gets an answer (see the module docstring)."""
        started = time.monotonic()
        counters = self.host.counters
        try:
            server_round = await self.learn_round()
            if server_round is None:
                return
            t_sum = now_us()
            contribution = await self.path.gather(self)
            t_push = now_us()
            scattered = await self.scatter(contribution, server_round)
            error = await self.wait(scattered.futures, server_round)
            if error is not None:
                self.reply_failed(error, scattered)
                return
            self.summed = True
            counters.bytes_pulled += self.nbytes
            t_back = now_us()
            await self.path.copy_back(self, scattered.out)
            self.reply_done(scattered)
            self.trace(t_sum, t_push, t_back, contribution.direct, len(scattered.futures))
            counters.ops += 1
            counters.op_seconds.observe(time.monotonic() - started)
        except Exception as exc:  # never leave the processes (or the peers) hanging
            self.reply_error(exc)

    # -- stages ----------------------------------------------------------------------
    async def learn_round(self) -> int | None:
        """The servers' number of this round; None (every member answered) if it cannot be learned."""
        try:
            self.server_round = self.local_round + await self.host.round_base(self.name, self.local_round)
            return self.server_round
        except (BPSError, asyncio.CancelledError) as exc:
            self.host.counters.ops_failed += 1
            why = f"tensor {self.name!r}: cannot learn its round from the servers"
            reason = f"{why}: {str(exc) or 'job reset'}"
            # The servers' error keeps its class and facts (a connection's peer, a timeout); the text, and the
            # detail that the process builds its text from beside them, say why here.
            self.answer_failure(lambda req, _: _said(failure_from_error(req, exc), self.name, why, reason)
                                if isinstance(exc, BPSError) else Failure(req, reason))
            if self._job_current():  # peers that learned it wait for our pushes: they fail once we learn it
                self.host.spawn(self.host.give_up_failed_round(self.name, self.local_round, why_from_error(exc, reason)))
            return None

    async def scatter(self, contribution: Contribution, server_round: int) -> Scattered:
        """Push every piece on its server's link; the sums land in the name's results buffer (room for it may have
        to wait for results that processes have yet to take: ``results_buffer``)."""
        host, op, name, itemsize = self.host, self.op, self.name, self.itemsize
        try:
            out, out_segment, out_base = await host.results_buffer(name, self.nbytes, op.dtype, self.count)
        except shm.ArenaFullError as exc:
            raise exc.about(self.memory_of()) from None
        if not self._job_current():  # every process left meanwhile (a reset): nothing of the ended job goes
            raise BPSError("every training process of this machine left: its job ended here")
        raw = contribution.buf.data.cast("B") if self.nbytes else memoryview(b"")
        out_raw = out.data.cast("B") if self.nbytes else memoryview(b"")
        priority = self.priority
        slots = self.path.handback_slots(self)
        intact = partial(self.path.intact, self)
        futures = []
        for piece in host.placement.issue_order(name, self.count, itemsize):
            lo, hi = piece.offset * itemsize, (piece.offset + piece.count) * itemsize
            future = self.link_for(piece).push(
                self.push_fields(piece, server_round), raw[lo:hi], out_raw[lo:hi], priority,
                shm_ref=(contribution.segment, contribution.base + lo), out_ref=(out_segment, out_base + lo),
                on_result=self.on_result)
            if slots and piece.count:
                future.add_done_callback(HandBack(out, slots, piece.offset, piece.offset + piece.count, intact))
            futures.append((piece, future))
        self.pushed = True
        host.counters.bytes_pushed += self.nbytes
        return Scattered(out, out_segment, out_base, futures, slots)

    def push_fields(self, piece: Piece, server_round: int) -> dict[str, Any]:
        """What the push of ``piece`` says (its Push's fields but the link's own)."""
        op = self.op
        fields = dict(name=self.name, part=piece.part, round=server_round, dtype=op.dtype, shape=list(op.shape),
                      offset=piece.offset, count=piece.count,
                      divisor=self.host.config.cluster.size if op.average else 1, kind=op.kind, layout=op.layout)
        if op.kind in ROOTED_KINDS:  # the servers compare the root, and copy the data of the machine holding it
            fields.update(root=op.root, holds_root=self.root is not None)
        return fields

    def link_for(self, piece: Piece) -> ServerLink:
        return self.host.streams[piece.server][piece.stream]

    async def wait(self, futures: list[tuple[Piece, asyncio.Future[None]]], server_round: int) -> BPSError | None:
        """Wait for every piece; on the first failure abandon the rest and return its error. A piece whose sum
        the peers got while its answer died with our connection (AnswerLostError) is no reason to give the
        others up: they may be summed too, and then the peers' whole round succeeded (``summed_elsewhere``)."""
        pending = {f for _, f in futures}
        lost: AnswerLostError | None = None
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for f in done:
                exc = f.exception()
                if isinstance(exc, AnswerLostError):
                    lost = lost or exc
                elif exc is not None:
                    error = exc if isinstance(exc, BPSError) else BPSError(f"internal error: {exc!r}")
                    if isinstance(exc, LinkBrokenError) and exc.fate_unknown:  # (each one aborted, then asked)
                        self.unsettled = [piece for piece, fut in futures
                                          if fut.cancelled() or not fut.done() or fut.exception()]
                    await self._give_up_rest(futures, pending, error, server_round)
                    return error
        if lost is not None:
            self.summed_elsewhere = True
            self._abandon_if_unanswered(futures)
        return lost

    async def _give_up_rest(self, futures: list[tuple[Piece, asyncio.Future[None]]], pending: set[asyncio.Future[None]],
                            error: BPSError, server_round: int) -> None:
        """A piece failed with ``error``: tell every server that did not deliver its piece's sum (the peers
        waiting there must fail now, not at a timeout; the failing server itself may not know, e.g. when the
        connection broke before the push arrived), and wait for those still in a server's hands."""
        host = self.host
        why = why_from_error(error, str(error))
        answers = []
        for piece, fut in futures:
            if fut in pending or fut.cancelled() or ((e := fut.exception()) is not None
                                                     and not isinstance(e, AnswerLostError)):
                if not self.link_for(piece).forget(fut):
                    answers.append(fut)  # in the server's hands, in our memory: wait for its answer
                if self._job_current() and self.ABORTS:
                    host.links[piece.server].abort(self.name, piece.part, server_round, why)
        if answers:
            await asyncio.wait(answers)  # the server answers every push; a lost link fails them
        self._abandon_if_unanswered(futures)

    def _abandon_if_unanswered(self, futures: list[tuple[Piece, asyncio.Future[None]]]) -> None:
        """A server that went silent with our memory in hand might still write into it: the name's results
        memory is not used again."""
        if any(not f.cancelled() and isinstance(e := f.exception(), LinkBrokenError) and e.unanswered_shm
               for _, f in futures):
            freed = self.host.results.abandon(self.name)
            if freed is not None:
                self.host.segments_freed([freed])

    # -- replies ---------------------------------------------------------------------
    def reply_done(self, scattered: Scattered) -> None:
        for session, o in self.members:
            session.send(self.path.done(o, scattered.out_segment, scattered.out_base))

    def answer_failure(self, failure_for: Callable[[int, bool], Failure]) -> None:
        """Answer every member with ``failure_for(req, handback)`` (whether its slot gets the sum)."""
        for session, o in self.members:
            session.send(failure_for(o.req, o.handback))

    def reply_failed(self, error: BPSError, scattered: Scattered) -> None:
        """Some piece failed: every member hears why (the error's class and attributes travel as the
        Failure's code and facts), and one whose array was pushed in place how many partitions it now
        holds the sums of."""
        self.host.counters.ops_failed += 1
        futures = scattered.futures
        summed = sum(1 for _, f in futures if f.done() and not f.cancelled() and f.exception() is None)

        def failure(req: int, handback: bool) -> Failure:
            note = (f" (the array pushed in place now holds the sums of {summed} of its {len(futures)} "
                    f"partitions)" if summed and handback and scattered.slots else "")
            return _said(failure_from_error(req, error, note), self.name, f"tensor {self.name!r}", f"{error}{note}")

        self.answer_failure(failure)

    def reply_error(self, exc: Exception) -> None:
        """Any other failure: every member hears it, and the peers too where we never pushed."""
        self.host.counters.ops_failed += 1
        if isinstance(exc, BPSError):
            reason = f"tensor {self.name!r}: {exc}"
            log.warning("%s", reason)
        elif isinstance(exc, OSError):  # the arenas: no room in /dev/shm (SegmentSpaceError) or the like
            reason = f"tensor {self.name!r}: {exc.strerror or exc}"
            log.warning("%s", reason)
            exc = BPSError(reason)
        else:
            reason = f"tensor {self.name!r}: internal error in the worker: {exc!r}"
            log.exception("round %d of %r failed", self.local_round, self.name)
        # A typed error keeps its class and facts (failure_from_error); the text names the tensor.
        self.answer_failure(lambda req, _: _said(failure_from_error(req, exc), self.name, f"tensor {self.name!r}",
                                                 reason) if isinstance(exc, BPSError) else Failure(req, reason))
        if self.server_round is not None and not self.pushed and self._job_current() and self.ABORTS:
            self.host.abort_at_anchor(self.name, self.server_round, why_from_error(exc, reason))  # peers wait there

    def trace(self, t_sum: int, t_push: int, t_back: int, direct: bool, pieces: int) -> None:
        timeline = self.host.timeline
        if timeline is None:
            return
        t_end = now_us()
        timeline.span(self.name, f"round {self.server_round}", t_sum, t_end, bytes=self.nbytes,
                      ranks=len(self.members))
        if not direct:
            timeline.span(self.name, "local sum", t_sum, t_push)
        timeline.span(self.name, "push-pull", t_push, t_back, pieces=pieces)
        timeline.span(self.name, "hand-back", t_back, t_end)

    # -- memory ----------------------------------------------------------------------
    def staging(self) -> tuple[np.ndarray, str, int]:
        """The name's staging buffer: where the local sum goes."""
        try:
            return self.host.staging_buffer(self.host.staging, self.name, self.nbytes, self.op.dtype, self.count)
        except shm.ArenaFullError as exc:
            raise exc.about(self.memory_of()) from None

    def memory_of(self) -> str:
        """Whose memory this operation's buffers are, in its processes' words (an ArenaFullError's)."""
        return f"tensor {self.name!r}"

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a sum or copy over ``args[0]`` in the thread pool if it is large, else right here."""
        nbytes = args[0].nbytes if isinstance(args[0], np.ndarray) else 0
        if nbytes >= OFFLOAD_MIN_BYTES:
            await asyncio.get_running_loop().run_in_executor(self.host.executor, fn, *args)
        else:
            fn(*args)



class CpuPath:
    """Tensors in the processes' shared-memory slots (``Op.segment``/``Op.offset``)."""

    def __init__(self) -> None:
        self.views: list[np.ndarray] = []
        self.targets: list[np.ndarray] = []  # the slots that get the sum (handback_slots, check_slots)
        self._checked = False  # check_slots passed in this pass of the event loop (see intact)

    async def gather(self, o: Operation) -> Contribution:
        """The processes' arrays, summed; one process's own slot is pushed as it is (the direct path), and so
        is a broadcast root's (or, on a machine without the root, any slot: the servers ignore its data)."""
        storage = kernels.STORAGE[o.op.dtype]
        segments = [member_segment(s, m.segment, o.name) for s, m in o.members]
        for seg, (_, m) in zip(segments, o.members):  # a process may have shrunk its slot since its Op came
            shm.check_size(seg, m.offset + o.nbytes, o.name)
        self.views = [np.frombuffer(_buffer(seg), dtype=storage, count=o.count, offset=m.offset)
                      for seg, (_, m) in zip(segments, o.members)]
        if len(self.views) == 1 or o.op.kind in ROOTED_KINDS:
            index = o.root or 0
            member = o.members[index][1]
            return Contribution(self.views[index], member.segment, member.offset, direct=True)
        buf, segment, base = o.staging()
        await o.off_loop(kernels.sum_into, buf, self.views, o.op.dtype)
        return Contribution(buf, segment, base, direct=False)

    def handback_slots(self, o: Operation) -> list[np.ndarray]:
        """Only the processes that want the result in their slot (a shared array) get it copied there, a
        piece at a time as the sums arrive; the others read it from our results segment (Op.handback). The list
        is kept current by :meth:`check_slots` (the pieces' hand-backs hold it): a process that left gets no
        more of the sum."""
        self.targets = [v for v, (_, m) in zip(self.views, o.members) if m.handback]
        return self.targets

    async def copy_back(self, o: Operation, out: np.ndarray) -> None:
        """Nothing left: the slots got their pieces as they arrived (unless one shrank meanwhile: its error)."""
        self.check_slots(o)

    def check_slots(self, o: Operation) -> None:
        """SegmentSizeError unless the slots that get the sum, of the processes still here, and the results
        segment still have their size. A process that left meanwhile gets no more pieces (its memory went with
        it; nothing is copied into it unchecked), and its live local peers get theirs: the round was summed for
        every machine (a process killed with a step in flight failed its local peers' sums, a review's case)."""
        left = False
        for session, m in o.members:
            if m.handback:
                if session.closed:
                    left = True
                    continue
                shm.check_size(member_segment(session, m.segment, o.name), m.offset + o.nbytes, o.name)
        if left:
            self.targets[:] = [v for v, (s, m) in zip(self.views, o.members) if m.handback and not s.closed]
        slot = o.host.results.slots.get(o.name)
        if slot is not None:
            shm.check_size(o.host.results.segments[slot.segment], slot.offset + o.nbytes, o.name)

    def intact(self, o: Operation) -> bool:
        """Whether a piece's sum may be copied into the slots now (see check_slots).

        Checked once per pass of the event loop, not per piece: the pieces whose sums one read of a
        connection brought are handed back in one run of callbacks, right after the check (two ``stat``
        calls a piece were 4% of the worker's CPU). The window in which a truncation can still make the
        copy touch a missing page is that run of copies, at most a read's worth of sums."""
        if self._checked:
            return True
        try:
            self.check_slots(o)
        except (OSError, BPSError) as exc:  # (a slot shrank, or its process left: the operation fails at its end)
            log.warning("%s", exc)
            return False
        self._checked = True
        asyncio.get_running_loop().call_soon(self._recheck)
        return True

    def _recheck(self) -> None:
        self._checked = False

    def done(self, op: Op, out_segment: str, out_base: int) -> Done:
        return Done(op.req) if op.handback else Done(op.req, out_segment, out_base)


class CudaPath:
    """Tensors on the processes' GPUs (``Op.cuda``): summed there into page-locked staging memory."""

    def __init__(self) -> None:
        self.tensors: list[Any] = []
        self.bridge: cuda.CudaBridge | None = None

    async def gather(self, o: Operation) -> Contribution:
        """Open the members' tensors and sum them on the GPU into the staging buffer, both in a thread (an
        allocation's first opening maps it, and a device's first use starts its CUDA context)."""
        self.bridge = bridge = await o.host.cuda_bridge()  # BPSError where this daemon cannot do CUDA
        loop = asyncio.get_running_loop()
        try:
            self.tensors = await loop.run_in_executor(o.host.executor, bridge.open_all, [m.cuda for _, m in o.members])
        except cuda.CudaUnavailableError as exc:  # a member's memory is gone (its process died)
            raise BPSError(str(exc)) from None
        buf, segment, base = o.staging()
        if o.op.kind not in ROOTED_KINDS or o.root is not None:  # without the root, the servers ignore our data
            await loop.run_in_executor(o.host.executor, bridge.sum_to_host, self.tensors, buf, o.root)
        return Contribution(buf, segment, base, direct=False)

    def handback_slots(self, o: Operation) -> list[np.ndarray]:
        return []  # the sums go back to the GPUs at the end (copy_back)

    def intact(self, o: Operation) -> bool:
        return True  # no slot gets a piece (handback_slots)

    async def copy_back(self, o: Operation, out: np.ndarray) -> None:
        assert self.bridge is not None  # gather opened the tensors
        await asyncio.get_running_loop().run_in_executor(o.host.executor, self.bridge.copy_back, out, self.tensors)

    def done(self, op: Op, out_segment: str, out_base: int) -> Done:
        return Done(op.req)


def _said(failure: Failure, name: str, why: str, reason: str) -> Failure:
    """``failure`` (tensor ``name``'s error handed on to its processes) with ``reason`` as its text, and ``why``
    (what it is about) before its detail: a process builds its error's text from the attributes and the detail
    (``error_from_failure``), so ``reason`` alone was lost where they are set (a connection's peer said which
    server, and no longer which tensor). Not where the rest names the tensor already (a mismatch's name, a
    timeout's ``what``, the detail itself: :func:`~protocol.messages.detail_about`)."""
    detail = detail_about(name, failure.code, failure.what, failure.detail, why)
    return replace(failure, message=reason, detail=failure.detail if detail is None else detail)


class HandBack:
    """Done-callback of one piece's future: copy its sum into the slots of the processes that want it
    there (a shared array pushed in place), while the other pieces are still on the network.

    The piece's input, which may be the same slot, is no longer needed once its sum arrived. An
    operation that fails leaves such a slot holding some pieces' sums (the error says so).
    """

    __slots__ = ("out", "slots", "lo", "hi", "intact")

    def __init__(self, out: np.ndarray, slots: list[np.ndarray], lo: int, hi: int,
                 intact: Callable[[], bool]) -> None:
        self.out, self.slots, self.lo, self.hi = out, slots, lo, hi
        self.intact = intact  # whether the memory still has its size (a process may truncate it, issue 14 item 3)

    def __call__(self, future: asyncio.Future[None]) -> None:
        if future.cancelled() or future.exception() is not None or not self.intact():
            return
        part = self.out[self.lo:self.hi]
        for slot in self.slots:
            np.copyto(slot[self.lo:self.hi], part)


def segment_buffer(arena: shm.Arena, segment: str) -> memoryview:
    """The memory of one of a process's segments (checked to exist when its Op arrived)."""
    return _buffer(arena.segments[segment])


def _buffer(seg: SharedMemory) -> memoryview:
    buf = seg.buf
    if buf is None:
        raise BPSError(f"segment {seg.name!r} is closed")
    return buf


def member_segment(session: ClientSession, segment: str, tensor: str) -> SharedMemory:
    """The segment of a member's Op; BPSConnectionError naming the process if it left since (its memory went
    with it: the round it was part of fails, as every round of a process that leaves does)."""
    seg = session.arena.segments.get(segment)
    if seg is None:
        who = f"local rank {session.local_rank} (pid {session.pid})"
        if session.closed:
            raise BPSConnectionError(f"tensor {tensor!r}: its memory went with the process while the operation ran",
                                     peer=who)
        raise BPSError(f"tensor {tensor!r}: segment {segment!r} of {who} was freed while the operation ran")
    return seg
