"""The Summation Service's driver: runs the round table's decisions on the event loop.

:class:`~bps_server.rounds.RoundTable` decides everything about a key's rounds (its
module docstring is the theory of operation); :class:`Aggregator` owns what takes time
or touches the outside: the accumulators and the kernels that fill them, a lock per
round that serializes its additions, the thread pool, the grace timers, the counters
and the timeline. Each event goes to the table, and the driver carries out the
actions it returns, in order.

Summation runs in a thread pool (the kernels release the GIL), serialized per round
by a lock; the first contribution of a round is adopted as the accumulator without a
copy where its dtype needs no widening (never a *borrowed* one: a view of the
colocated worker's shared memory, which the worker owns). Partitions under
``INLINE_SUM_MAX_BYTES`` are summed on the event loop.

After every suspension (the lock, a kernel in the pool) the driver asks the table
once whether the round's :class:`~bps_server.rounds.Token` still stands (``current``,
``added``, ``complete``); a round that failed, was answered by a replay or was
superseded meanwhile is simply dropped: the table has told its waiters already.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Coroutine, Final, Iterator, NamedTuple

import numpy as np

from protocol import dtypes
from protocol.messages import Push

from bps_runtime import kernels
from bps_runtime.loglimit import failed_rounds_log
from bps_runtime.metrics import LATENCY_BUCKETS, Histogram
from bps_runtime.stalls import Stall, StallWatch
from bps_runtime.timeline import Timeline, now_us

from .rounds import (
    Action,
    Add,
    Answer,
    Cleared,
    Fail,
    FailRound,
    Held,
    Key,
    Lease,
    Note,
    Redispatch,
    Round,
    RoundTable,
    Settled,
    StartGrace,
    SumAll,
    Token,
    Why,
    describe,
)
from .jobs import Spared, spare_none

__all__ = ["INLINE_SUM_MAX_BYTES", "Aggregator", "Contributor", "Counters", "FailFn", "Key", "ReplyFn", "Why",
           "describe"]

log = logging.getLogger("bps.server.aggregator")

# A kernel that reads fewer bytes than this runs on the event loop; larger ones go to the summation threads.
# The hop there and back (the pool's queue, a thread's wake-up, the loop's wake-up by call_soon_threadsafe, a
# task) cost 150-240 CPU-us on the 2-core test box, against 13 us for the whole sum of a 256 KiB pair and 90 us
# for a 2 MiB one (benchmarks/offload.py; RESULTS.md, session 21): at 256 KiB, every piece of a 1 Gbit/s link
# (about 240 kB) made the hop, ten times the CPU of its sum. Above this a sum is long enough that the loop had
# better go on with I/O while it runs, and the pool sums several keys at once on a server with cores to spare.
INLINE_SUM_MAX_BYTES: Final = 2 << 20

# reply(push, result bytes) on success; fail(push, why) on failure (why: its text, code and facts).
ReplyFn = Callable[[Push, np.ndarray], None]
FailFn = Callable[[Push, Why], None]


@dataclass(frozen=True, slots=True)
class Contributor:
    """How to answer one push: the table's waiter handle."""

    reply: ReplyFn
    fail: FailFn


@dataclass(slots=True, eq=False)
class _Sum:
    """The accumulator of one round (``token``): the driver's, never the table's."""

    token: Token
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    acc: np.ndarray | None = None
    first_borrowed: np.ndarray | None = None  # a first push in the colocated worker's memory, not yet summed
    first_lease: Lease | None = None  # first_borrowed's: checked right before it is read


class _Kernel(NamedTuple):
    """One kernel call of the summing work, over ``nbytes`` of memory (which decides where it runs)."""

    fn: Callable[..., None]
    args: tuple[Any, ...]
    nbytes: int

    def run(self) -> None:
        self.fn(*self.args)


@dataclass
class Counters:
    """Totals exposed through Stats (tests and metrics)."""

    bytes_received: int = 0
    bytes_sent: int = 0
    pushes: int = 0
    rounds_completed: int = 0
    rounds_failed: int = 0
    rounds_replayed: int = 0  # rounds settled after a restart with a sum a worker replayed
    bytes_by_worker: dict[int, int] = field(default_factory=dict)
    bytes_shm: int = 0  # of bytes_received: read from the colocated worker's shared memory
    round_seconds: Histogram = field(default_factory=Histogram)  # first push to sum sent
    push_lag: dict[int, Histogram] = field(default_factory=dict)  # worker -> its push after the round's first

    def received(self, worker: int, nbytes: int, shm: bool) -> None:
        """A push's tensor bytes from ``worker`` (``shm``: read from its shared memory), synchronous or not."""
        self.bytes_received += nbytes
        self.bytes_by_worker[worker] = self.bytes_by_worker.get(worker, 0) + nbytes
        if shm:
            self.bytes_shm += nbytes

    def as_dict(self) -> dict[str, object]:
        return {
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "pushes": self.pushes,
            "rounds_completed": self.rounds_completed,
            "rounds_failed": self.rounds_failed,
            "rounds_replayed": self.rounds_replayed,
            "bytes_by_worker": {str(k): v for k, v in self.bytes_by_worker.items()},
            "bytes_shm": self.bytes_shm,
            # bps-launch --stragglers (bps_worker.stragglers): each worker's lag histogram
            "push_lag": {str(w): {"count": h.count, "seconds": h.total, "counts": list(h.counts)}
                         for w, h in self.push_lag.items()},
            "push_lag_buckets": list(LATENCY_BUCKETS),
        }


class Aggregator:
    """Sums the ``n_workers`` pushes of every key and round (see the module docstring)."""

    def __init__(self, n_workers: int, executor: Executor | None = None, lost_grace_s: float = 30.0,
                 deterministic: bool = False, connected: Callable[[int], bool] = lambda worker: True,
                 timeline: Timeline | None = None, stall_s: float = 0.0, server: str = "this server") -> None:
        self.n_workers = n_workers
        self.executor = executor
        self.lost_grace_s = lost_grace_s
        self.timeline = timeline
        self.table: RoundTable[Contributor] = RoundTable(n_workers, lost_grace_s=lost_grace_s,
                                                         deterministic=deterministic, connected=connected,
                                                         stall_s=stall_s, server=server)
        self.counters = Counters()
        # Rounds that wait for workers whose processes have not pushed are logged (bps_runtime.stalls).
        self.stalls: StallWatch[tuple[Key, int]] = StallWatch(warn_after_s=lost_grace_s)
        # Failed rounds are logged a few at a time: a mismatch of a tensor of many partitions, or a worker gone
        # with thousands of names in flight, failed a round per partition and name, each a line (flush_logs).
        self.failures_log = failed_rounds_log()
        self._sums: dict[Key, _Sum] = {}  # each key's accumulator of its open round, once summing started
        self._tasks: set[asyncio.Future[None]] = set()

    def flush_logs(self) -> None:
        """Say how many lines about failed rounds were left out (now and then: see ``failures_log``)."""
        self.failures_log.flush(log)

    @property
    def keys(self) -> dict[Key, Round[Contributor]]:
        """Every key's open round, as the table holds it."""
        return self.table.keys

    # -- events ----------------------------------------------------------------------
    async def push(self, push: Push, payload: np.ndarray, reply: ReplyFn, fail: FailFn,
                   borrowed: Lease | None = None) -> None:
        """Add one worker's contribution; replies go through ``reply``/``fail`` callbacks.

        ``borrowed``: ``payload`` is memory the server does not own (the colocated worker's
        shared memory), and its lease (``rounds.Lease``): it is read, never adopted or written, and not
        kept past the round; the lease is checked right before every read, and a failed check fails the
        round (see :meth:`_leases_hold`).
        """
        later = self.submit(push, payload, reply, fail, borrowed)
        if later is not None:
            await later

    def submit(self, push: Push, payload: np.ndarray, reply: ReplyFn, fail: FailFn,
               borrowed: Lease | None = None) -> Coroutine[Any, Any, None] | None:
        """:meth:`push` without a task where it can: the summing work that needs no wait (its round's lock
        is free and its kernels are small enough to run on the event loop, as most partitions' are) is done
        here and now; what is left comes back as a coroutine for the caller to run as a task (None: all done).
        A task per push cost more than the push itself (issue 13's parity)."""
        self._count(push, payload, borrowed)
        return self._submit(push, payload, reply, fail, borrowed)

    def _count(self, push: Push, payload: np.ndarray, borrowed: Lease | None) -> None:
        self.counters.pushes += 1
        self.counters.received(push.worker, payload.nbytes, borrowed is not None)

    def _submit(self, push: Push, payload: np.ndarray, reply: ReplyFn, fail: FailFn,
                borrowed: Lease | None) -> Coroutine[Any, Any, None] | None:
        """:meth:`submit` of a push counted already."""
        actions = self.table.push(push, payload, Contributor(reply, fail), time.monotonic(), borrowed=borrowed)
        lag, c = self.table.lag, self.counters
        if lag is not None:
            (c.push_lag.get(push.worker) or c.push_lag.setdefault(push.worker, Histogram())).observe(lag)
        work = self._execute(actions)
        while work and self._now(work[0]):
            work.pop(0)
        return self._later(work) if work else None

    async def _later(self, work: list[Add | SumAll]) -> None:
        """The summing work :meth:`submit` could not do at once, in order."""
        for item in work:
            if isinstance(item, Add):
                await self._add(item)
            else:
                await self._sum_all(item)

    def _now(self, work: Add | SumAll) -> bool:
        """Do ``work`` now, without a suspension, if it needs none: True when done (False: nothing done)."""
        if isinstance(work, Add):
            s = self._sum_of(work.token)
            if s.lock.locked() or not self._inline(2 * work.payload.nbytes):  # a pair's sum reads two
                return False
            for kernel in self._add_steps(s, work):
                kernel.run()
            return True
        if not self._inline(work.push.payload_nbytes * len(work.inputs)):
            return False
        for kernel in self._sum_all_steps(work):
            kernel.run()
        return True

    def replay(self, push: Push, data: np.ndarray) -> None:
        """A worker's copy of a round's sum from this server's previous run (see "Server restarts")."""
        self._run(self.table.replay(push, data, time.monotonic()))

    def round_for(self, name: str, part: int, worker: int, local: int = 0, failed: bool = False,
                  given_up: bool = False) -> int:
        """The round ``worker``'s round ``local`` of (name, part) is (see RoundTable.round_for)."""
        return self.table.round_for(name, part, worker, local, failed, given_up)

    def sweep(self, now: float) -> int:
        """Fail every round that waited longer than ``lost_grace_s`` for a worker that is not connected
        or has no training processes (``now``: ``time.monotonic()``); returns how many failed."""
        return self._run(self.table.sweep(now))

    def stall_warnings(self, now: float) -> list[Stall]:
        """A round waiting for a connected worker is not failed (its processes may be slow, not dead), but
        said after the grace, and again every grace: which workers pushed and which did not (told to both:
        those that pushed wait, and the others' processes learn who waits for them)."""
        waits = {(st.key, st.round): st.opened for st in self.table.keys.values()
                 if st.busy and self.table.waiting_for(st)}
        stalls = []
        for (key, round_), waited in self.stalls.due(now, waits):
            st = self.table.keys[key]
            missing = self.table.waiting_for(st)
            stalls.append(Stall(
                f"stall: round {round_} of {key[0]!r} part {key[1]} has waited {waited:.1f} s for worker "
                f"{', '.join(map(str, missing))}, whose processes have not pushed it (pushed by "
                f"worker {', '.join(map(str, sorted(st.waiters)))})", tuple(sorted({*st.waiters, *missing}))))
        return stalls

    def abort(self, name: str, part: int, round_: int, worker: int, why: Why) -> None:
        """A worker gave up a round (``why``): fail it for every worker (now and for late pushes)."""
        self._run(self.table.abort(name, part, round_, worker, why))

    def unfused(self, name: str) -> tuple[set[int], Push] | None:
        """The workers in ``name``'s open round at this anchor, and its first push (RoundTable.unfused)."""
        return self.table.unfused(name)

    def past(self, name: str, workers: AbstractSet[int]) -> bool:
        """Whether ``workers`` all gave up ``name``'s current round, which failed (RoundTable.past)."""
        return self.table.past(name, workers)

    def fail_open(self, name: str, why: Why) -> None:
        """Fail ``name``'s open round here (another worker issued it fused, see RoundTable.fail_open)."""
        self._run(self.table.fail_open(name, why))

    def fail_ended(self, ended: Callable[[str], bool], why: Why) -> None:
        """Fail the open rounds of the ``ended`` names (RoundTable.fail_ended)."""
        self._run(self.table.fail_ended(ended, why))

    def worker_lost(self, worker: int) -> int:
        """The worker daemon's connection dropped: fail every incomplete round still waiting for it;
        later ones wait ``lost_grace_s`` for it. Returns how many rounds failed now."""
        return self._run(self.table.worker_lost(worker))

    def worker_hello(self, worker: int, epoch: str, fresh: bool = False) -> None:
        """A worker daemon connected, with its round numbering (``fresh``: unused, Hello.fresh)."""
        self._run(self.table.worker_hello(worker, epoch, fresh))

    def worker_reset(self, worker: int, epoch: str = "", spared: Spared = spare_none) -> int:
        """The worker has no training processes any more; returns how many rounds failed (not those ``spared``
        says are of a later job: RoundTable.worker_reset)."""
        return self._run(self.table.worker_reset(worker, epoch, spared))

    def processes_ended(self, worker: int) -> Spared:
        """``worker``'s processes ended: whether a round of given pushers is of a later job (RoundTable's)."""
        return self.table.processes_ended(worker, time.monotonic())

    def had_processes(self, worker: int) -> bool:
        """Whether the worker's processes were there when its daemon was last heard of (RoundTable.had_processes)."""
        return self.table.had_processes(worker)

    def worker_joined(self, worker: int) -> None:
        """The worker has training processes again (its Joined)."""
        self.table.worker_joined(worker)

    def worker_idle(self, worker: int) -> None:
        """The worker's daemon has no training processes (its Hello.processes)."""
        self.table.worker_idle(worker)

    # -- carrying out the table's actions ----------------------------------------------
    def _run(self, actions: list[Action[Contributor]]) -> int:
        """Carry out the actions of an event that sums nothing; returns how many rounds failed."""
        work = self._execute(actions)
        assert not work, "only a push makes summing work"
        return sum(isinstance(a, FailRound) for a in actions)

    def _execute(self, actions: list[Action[Contributor]]) -> list[Add | SumAll]:
        """Carry out every action that takes no time; return the summing work, for the caller to await."""
        work: list[Add | SumAll] = []
        for action in actions:
            if isinstance(action, Fail):
                action.handle.fail(action.push, action.why)
            elif isinstance(action, FailRound):
                self.failures_log.log(log, logging.WARNING, "%s", action.reason)
                self.counters.rounds_failed += 1
                self._drop_sum(action.key)
                for f in action.fails:
                    f.handle.fail(f.push, f.why)
            elif isinstance(action, Answer):
                for waiter in action.waiters:
                    waiter.handle.reply(waiter.push, action.result)
            elif isinstance(action, (Add, SumAll)):
                work.append(action)
            elif isinstance(action, Settled):
                self.counters.rounds_replayed += 1
            elif isinstance(action, Redispatch):
                for held in action.held:
                    self._spawn(self._push_held(held))
            elif isinstance(action, StartGrace):
                asyncio.get_running_loop().call_later(self.lost_grace_s, self._grace_expired, action)
            elif isinstance(action, Cleared):
                log.info("every worker reset: dropping the state of %d keys", action.keys)
                self._sums.clear()
            elif isinstance(action, Note):
                log.log(action.level, "%s", action.message)
        return work

    def _grace_expired(self, grace: StartGrace) -> None:
        self._run(self.table.grace_expired(grace.worker, grace.gone, grace.why))

    async def _push_held(self, held: Held[Contributor]) -> None:
        """Push again a push that waited for a replayed round to settle (counted when it came)."""
        later = self._submit(held.push, held.payload, held.handle.reply, held.handle.fail, held.borrowed)
        if later is not None:
            await later

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _drop_sum(self, key: Key) -> None:
        """The key's open round ended without a sum: its accumulator goes (an addition in flight
        keeps its own reference and learns from the table that its round is gone)."""
        self._sums.pop(key, None)

    def _sum_of(self, token: Token) -> _Sum:
        s = self._sums.get(token.key)
        if s is None or s.token != token:
            s = self._sums[token.key] = _Sum(token)
        return s

    # -- summing ---------------------------------------------------------------------
    # Each kind of work is written once, as steps that yield the kernels to run (_add_steps,
    # _sum_all_steps); the async drivers (_add, _sum_all) run each kernel inline or in the summation
    # threads and may wait for the round's lock, while _now runs them all inline when nothing must wait.
    async def _add(self, work: Add) -> None:
        """Add one contribution to its round's accumulator; complete the round after the last."""
        if not self.table.current(work.token):
            return  # (an accumulator made for it now would be kept for a key the table may have forgotten)
        s = self._sum_of(work.token)
        async with s.lock:
            for kernel in self._add_steps(s, work):
                await self._offload(kernel)

    def _add_steps(self, s: _Sum, work: Add) -> Iterator[_Kernel]:
        push = work.push
        if not self.table.current(work.token):
            return  # the round failed, was answered or moved on while we waited; waiters were told
        if not self._leases_hold(work.token, push, (work.borrowed, s.first_lease)):
            return
        t_add = now_us() if self.timeline is not None else 0
        kernel = self._accumulate(s, work.payload, push.dtype, work.borrowed)
        if kernel is not None:
            yield kernel
        if self.timeline is not None:
            self.timeline.span(f"{push.name} p{push.part}", f"add worker {push.worker}", t_add, now_us(),
                               round=push.round, bytes=work.payload.nbytes, shm=work.borrowed is not None)
        if self.table.added(work.token):
            out, kernel = self._finish(s, push)
            if kernel is not None:
                yield kernel
            self._complete(work.token, out)

    async def _sum_all(self, work: SumAll) -> None:
        """One pass over every contribution, in the order given (deterministic, half types)."""
        for kernel in self._sum_all_steps(work):
            await self._offload(kernel)

    def _sum_all_steps(self, work: SumAll) -> Iterator[_Kernel]:
        push = work.push
        if not self._leases_hold(work.token, push, work.leases):
            return
        out = np.empty(push.count, dtype=kernels.STORAGE[push.dtype])
        t_sum = now_us() if self.timeline is not None else 0
        inputs = list(work.inputs)
        yield _Kernel(kernels.sum_into, (out, inputs, push.dtype, push.divisor), out.nbytes * len(inputs))
        if self.timeline is not None:
            self.timeline.span(f"{push.name} p{push.part}", "sum", t_sum, now_us(), round=push.round,
                               inputs=len(inputs), bytes=out.nbytes)
        self._complete(work.token, out)

    def _leases_hold(self, token: Token, push: Push, leases: tuple[Lease | None, ...]) -> bool:
        """Check every borrowed view the next read touches (``None``: not borrowed). One that shrank fails
        the round for every worker, naming the segment and both sizes, and the server reads nothing of it:
        a bad segment fails its operation, never the server (issue 14, item 3)."""
        try:
            for lease in leases:
                if lease is not None:
                    lease()
        except OSError as exc:  # the FailRound drops the round's accumulator (only if it is still current)
            self._run(self.table.fail(token, Why(f"tensor {push.name!r} round {push.round} cannot be summed: "
                                                 f"{exc.strerror or exc}")))
            return False
        return True

    def _accumulate(self, s: _Sum, payload: np.ndarray, dtype: str, borrowed: Lease | None) -> _Kernel | None:
        """Take one contribution into ``s``: the kernel that adds it, or None where it is kept as it is."""
        if s.acc is None and s.first_borrowed is None and dtype not in dtypes.HALF_TYPES:
            if borrowed is not None:
                # the worker's memory: summed with the next push, never copied
                s.first_borrowed, s.first_lease = payload, borrowed
            else:
                s.acc = payload  # adopt the freshly received buffer: no copy
            return None
        if s.first_borrowed is not None:  # acc = first + this, in one pass (no copy of the first)
            pair, s.first_borrowed, s.first_lease = [s.first_borrowed, payload], None, None
            s.acc = np.empty(payload.size, dtype=kernels.ACCUMULATOR[dtype])
            return _Kernel(kernels.sum_into, (s.acc, pair, dtype), 2 * payload.nbytes)
        first = s.acc is None
        if first:
            s.acc = kernels.new_accumulator(dtype, payload.size)
        return _Kernel(kernels.accumulate, (s.acc, payload, dtype, first), payload.nbytes)

    def _finish(self, s: _Sum, push: Push) -> tuple[np.ndarray, _Kernel | None]:
        """The round's sum from its full accumulator: the accumulator itself where it is in the tensor's
        dtype and needs no division, else a new array, with the kernel that rounds (and divides) into it."""
        if s.first_borrowed is not None:  # a single worker: its own memory is the sum, copied once
            # (its lease was checked by _add_steps in this same step of the loop, with no suspension since)
            s.acc, s.first_borrowed, s.first_lease = s.first_borrowed.copy(), None, None
        acc = s.acc
        assert acc is not None  # set by the first add
        if push.dtype not in dtypes.HALF_TYPES and push.divisor == 1:
            return acc, None
        out = np.empty(acc.size, dtype=kernels.STORAGE[push.dtype])
        return out, _Kernel(kernels.finalize, (out, acc, push.dtype, push.divisor), out.nbytes)

    def _inline(self, nbytes: int) -> bool:
        """Whether a kernel over ``nbytes`` runs on the event loop (small: the thread hop costs more)."""
        return nbytes < INLINE_SUM_MAX_BYTES or self.executor is None

    async def _offload(self, kernel: _Kernel) -> None:
        """Run a kernel on the event loop if it is small, else in the summation threads."""
        if self._inline(kernel.nbytes):
            kernel.run()
        else:
            await asyncio.get_running_loop().run_in_executor(self.executor, kernel.fn, *kernel.args)

    def _complete(self, token: Token, out: np.ndarray) -> None:
        """Answer every contributor with the round's sum, unless the round failed or was superseded
        while the sum was being made (the table then answers None and has told the waiters)."""
        done = self.table.complete(token)
        if done is None:
            return
        s = self._sums.get(token.key)
        if s is not None and s.token == token:
            del self._sums[token.key]
        elapsed = time.monotonic() - done.opened
        self.counters.rounds_completed += 1
        self.counters.round_seconds.observe(elapsed)
        if self.timeline is not None:
            end = now_us()
            self.timeline.span(f"{token.key[0]} p{token.key[1]}", f"round {done.round}", end - int(elapsed * 1e6),
                               end, bytes=out.nbytes, workers=sorted(w.push.worker for w in done.waiters))
        for waiter in done.waiters:
            self.counters.bytes_sent += out.nbytes
            waiter.handle.reply(waiter.push, out)
