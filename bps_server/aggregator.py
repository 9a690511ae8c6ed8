"""The Summation Service's state: one accumulator and one round number per partition key.

Theory of operation. A key is ``(tensor name, partition index)``. In synchronous
mode a worker pushes round ``r + 1`` of a key only after it received the sum of
round ``r``, and the server sends that sum only once all ``n`` workers pushed
round ``r``. Hence, for one key, the server only ever sees pushes of its current
round, except when a round failed somewhere (a mismatch, a worker that gave
up): then a push of a *later* round means its sender has moved on, and the
current, incomplete round is abandoned (its waiters get an error). Rounds are
never mixed: every push carries its round and is checked against the key's.

Each push carries a descriptor (dtype, shape, partition offset/count, divisor,
kind). A descriptor that differs from the round's first one fails the round for
everyone who pushed it, with a message naming the tensor and both shapes.

Summation runs in a thread pool (the kernels release the GIL), serialized per
key by a lock; the first contribution of a round is adopted as the accumulator
without a copy where its dtype needs no widening (never a *borrowed* one: a
view of the colocated worker's shared memory, which the worker owns).

A round that waits longer than ``lost_grace_s`` for a worker which is not even
connected fails, naming it (a worker machine that never came, or died before a
server restart): connected but slow workers are waited for.

Server restarts. A restarted server knows nothing; the workers reconnect, replay
the last finished sum of each key they got from its predecessor (``replay``) and
push again what was in flight. A replayed sum answers the workers that pushed
that round but never got its sum; a replayer's push of the next round waits
until every worker has either replayed the round or been answered. So no round
is lost or summed twice, and the bytes are those the predecessor computed.

A worker machine that comes back (its daemon restarted, or a new job's processes
on it while other machines' processes keep training) numbers its local rounds
from 0; before the first round of each name it asks the server holding that
name's partition 0 which round that is (:meth:`round_for`) and offsets all its
pushes of the name by the answer, so it joins the round the others are in.

Deterministic mode (``cluster.deterministic``): floating-point addition is not
associative, so the sum depends on the order in which pushes arrive. With it on,
each key keeps every contribution of the round until the last one arrives and
then sums them in worker-id order in one pass (``kernels.sum_into``), so repeated
runs give identical bytes. The cost is memory: up to ``n`` received partitions
per key in flight instead of one accumulator (a borrowed shared-memory
contribution costs nothing), and the sum starts only when the last push is in,
so summing no longer overlaps receiving. float16 and bfloat16 always take this
path: one pass that reads every half-precision input once, adds in float32
registers and rounds once moves 3 bytes per 2-byte element for two workers,
where a float32 accumulator moves 5 per input (and needs a rounding pass).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable, Final

import numpy as np

from protocol import dtypes
from protocol.messages import Push

from bps_runtime import kernels
from bps_runtime.metrics import Histogram
from bps_runtime.timeline import Timeline, now_us

log = logging.getLogger("bps.server.aggregator")

# Partitions smaller than this are summed on the event loop; the thread hop costs more.
INLINE_SUM_MAX_BYTES: Final = 256 * 1024

Key = tuple[str, int]
# reply(push, result bytes) on success; fail(push, message) on failure.
ReplyFn = Callable[[Push, np.ndarray], None]
FailFn = Callable[[Push, str], None]


@dataclass(slots=True)
class Contributor:
    push: Push
    reply: ReplyFn
    fail: FailFn


@dataclass(slots=True)
class KeyState:
    round: int
    first: Push | None = None
    acc: np.ndarray | None = None
    first_borrowed: np.ndarray | None = None  # a first push in the colocated worker's memory, not yet summed
    added: int = 0
    contributors: dict[int, Contributor] = field(default_factory=dict)
    held: dict[int, tuple[np.ndarray, bool]] = field(default_factory=dict)  # deterministic: worker -> (data, borrowed)
    # After a restart: the round's sum as replayed by a worker that got it from our predecessor,
    # the workers that replayed it, those answered with it, and next-round pushes of replayers.
    result: np.ndarray | None = None
    replayers: set[int] = field(default_factory=set)
    answered: set[int] = field(default_factory=set)
    held_next: list[tuple[Any, ...]] = field(default_factory=list)
    failed: str | None = None
    previous_failure: tuple[int, str] | None = None  # (round, why) of the round before, if it failed
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    opened: float = 0.0  # time.monotonic() of the round's first push (or replay)
    opened_us: int = 0  # the same, on the timeline's clock


def describe(push: Push) -> str:
    shape = "[" + ",".join(str(d) for d in push.shape) + "]"
    extra = ""
    if push.kind != "sum":
        extra += f" ({push.kind})"
    if push.divisor != 1:
        extra += f" (average over {push.divisor})"
    return f"{push.dtype}{shape}{extra}"


def _descriptor(push: Push) -> tuple[object, ...]:
    return (push.dtype, tuple(push.shape), push.offset, push.count, push.divisor, push.kind)


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
        }


class Aggregator:
    """Sums the ``n_workers`` pushes of every key and round (see the module docstring)."""

    def __init__(self, n_workers: int, executor: Executor | None = None, lost_grace_s: float = 30.0,
                 deterministic: bool = False, connected: Callable[[int], bool] = lambda worker: True,
                 timeline: Timeline | None = None) -> None:
        self.timeline = timeline
        self.n_workers = n_workers
        self.deterministic = deterministic
        self.connected = connected
        self._tasks: set[asyncio.Future[None]] = set()
        self.executor = executor
        self.lost_grace_s = lost_grace_s
        self.keys: dict[Key, KeyState] = {}
        # Workers whose connection dropped and which did not come back within lost_grace_s:
        # rounds that need them fail at once instead of waiting.
        self.lost_workers: set[int] = set()
        self._gone: dict[int, object] = {}  # worker -> token of its latest disconnection or reset
        self._reset: set[int] = set()  # workers without training processes since their last push
        self._epochs: dict[int, str] = {}  # each worker's round numbering (Hello.epoch, Reset.epoch)
        # Workers whose numbering restarted while other workers were mid-job: they rejoin (round_for).
        self._rejoining: set[int] = set()
        self.counters = Counters()

    # -- events ----------------------------------------------------------------------
    async def push(self, push: Push, payload: np.ndarray, reply: ReplyFn, fail: FailFn,
                   borrowed: bool = False) -> None:
        """Add one worker's contribution; replies go through ``reply``/``fail`` callbacks.

        ``borrowed``: ``payload`` is memory the server does not own (the colocated worker's
        shared memory): it is read, never adopted or written, and not kept past the round.
        """
        c = self.counters
        c.pushes += 1
        c.bytes_received += payload.nbytes
        c.bytes_by_worker[push.worker] = c.bytes_by_worker.get(push.worker, 0) + payload.nbytes
        if borrowed:
            c.bytes_shm += payload.nbytes
        key = (push.name, push.part)
        st = self.keys.get(key)
        if st is None:
            st = self._open(key, push.round)
        if push.round < st.round:
            if st.previous_failure is not None and st.previous_failure[0] == push.round:
                fail(push, st.previous_failure[1])  # a late push to a failed round: tell it why
            else:
                fail(push, f"tensor {push.name!r} part {push.part}: stale round {push.round}, "
                           f"the server is at round {st.round}")
            return
        if push.round == st.round + 1 and push.worker in st.replayers and st.failed is None:
            st.held_next.append((push, payload, reply, fail, borrowed))  # see "Server restarts"
            return
        if push.round > st.round:
            if (st.contributors or st.replayers) and st.failed is None:
                self._fail_round(key, st, f"tensor {push.name!r} round {st.round} abandoned: worker "
                                          f"{push.worker} moved on to round {push.round}")
            failed = (st.round, st.failed) if st.failed is not None else None
            st = self._open(key, push.round)
            st.previous_failure = failed
        if push.worker in self._gone or push.worker in self._reset:
            self.worker_joined(push.worker)  # a push means its processes are back
        if st.failed is not None:
            fail(push, st.failed)
            return
        if push.worker in st.contributors:
            fail(push, f"tensor {push.name!r} part {push.part}: worker {push.worker} pushed round "
                       f"{push.round} twice")
            return
        missing = self.lost_workers - set(st.contributors)
        if missing:
            fail(push, f"worker {min(missing)} is gone (disconnected, or no training processes for longer than "
                       f"{self.lost_grace_s:g} s); round {push.round} of {push.name!r} cannot complete")
            return
        if st.first is None:
            st.first = push
            if not st.replayers:
                st.opened = time.monotonic()
                st.opened_us = now_us()
        elif _descriptor(st.first) != _descriptor(push):
            st.contributors[push.worker] = Contributor(push, reply, fail)
            self._fail_round(key, st, f"tensor {push.name!r} mismatch: worker {st.first.worker} pushed "
                                      f"{describe(st.first)} but worker {push.worker} pushed {describe(push)}")
            return
        st.contributors[push.worker] = Contributor(push, reply, fail)
        if st.result is not None:  # the sum is known from a replay
            st.answered.add(push.worker)
            reply(push, st.result)
            self._settle_replayed(key, st)
            return
        if self.deterministic or push.dtype in dtypes.HALF_TYPES:
            # Keep every contribution, then one pass over all of them in worker-id order (see the module
            # docstring): deterministic, and for half types cheaper than a float32 accumulator.
            st.held[push.worker] = (payload, borrowed)
            if len(st.held) < self.n_workers:
                return
            async with st.lock:
                if self.keys.get(key) is not st or st.failed is not None or st.result is not None:
                    return
                inputs = [st.held[worker][0] for worker in sorted(st.held)]  # worker-id order
                st.held.clear()
                out = np.empty(payload.size, dtype=kernels.STORAGE[push.dtype])
                t_sum = now_us() if self.timeline is not None else 0
                if out.nbytes * len(inputs) < INLINE_SUM_MAX_BYTES or self.executor is None:
                    kernels.sum_into(out, inputs, push.dtype, push.divisor)
                else:
                    await asyncio.get_running_loop().run_in_executor(self.executor, kernels.sum_into, out, inputs,
                                                                     push.dtype, push.divisor)
                if self.timeline is not None:
                    self.timeline.span(f"{push.name} p{push.part}", "sum", t_sum, now_us(), round=push.round,
                                       inputs=len(inputs), bytes=out.nbytes)
                if self.keys.get(key) is not st or st.failed is not None or st.result is not None:
                    return
                await self._complete(key, st, out)
            return
        async with st.lock:
            if self.keys.get(key) is not st or st.failed is not None:
                return  # the round was abandoned or failed while we waited; waiters were told
            t_add = now_us() if self.timeline is not None else 0
            await self._add(st, payload, push.dtype, borrowed)
            if self.timeline is not None:
                self.timeline.span(f"{push.name} p{push.part}", f"add worker {push.worker}", t_add, now_us(),
                                   round=push.round, bytes=payload.nbytes, shm=borrowed)
            if self.keys.get(key) is not st or st.failed is not None or st.result is not None:
                return
            st.added += 1
            if st.added == self.n_workers:
                await self._complete(key, st)

    def round_for(self, name: str, part: int, worker: int) -> int:
        """The round ``worker``'s next push of key (name, part) belongs to, for a worker whose round
        numbering starts afresh (see RoundQuery). 0 when no other worker was mid-job as the worker's
        numbering started (every worker starts a job together); for a rejoining worker, the round the
        others are in, or the next one if that one failed or already has the worker."""
        st = self.keys.get((name, part))
        if st is None or worker not in self._rejoining:
            return 0
        done = (st.failed is not None or worker in st.contributors or worker in st.replayers
                or worker in st.answered)
        return st.round + (1 if done else 0)

    def replay(self, push: Push, data: np.ndarray) -> None:
        """A worker's copy of a round's sum from this server's previous run (see "Server restarts")."""
        key = (push.name, push.part)
        st = self.keys.get(key)
        if st is None:
            st = self._open(key, push.round)
        if push.round > st.round and st.failed is None and not st.contributors:
            # A later round finished on our predecessor, so every worker pushed it, so nobody can
            # still need this one: what was held for the later round waits there now.
            held, st.held_next = st.held_next, []
            st = self._open(key, push.round)
            self._dispatch(held)  # they run once this replay is recorded
        if push.round != st.round or st.failed is not None:
            log.info("ignoring worker %d's replay of %r part %d round %d: the server is at round %d%s", push.worker,
                     push.name, push.part, push.round, st.round, " (failed)" if st.failed else "")
            return
        if st.first is not None and _descriptor(st.first) != _descriptor(push):
            log.warning("ignoring worker %d's replay of %r part %d: %s, but the round's pushes are %s", push.worker,
                        push.name, push.part, describe(push), describe(st.first))
            return
        if st.result is None:
            st.result = np.array(data, copy=True)  # `data` may be the worker's memory
        if not st.replayers and st.first is None:
            st.opened = time.monotonic()
        st.replayers.add(push.worker)
        for worker, contributor in list(st.contributors.items()):
            if worker not in st.answered:
                st.answered.add(worker)
                contributor.reply(contributor.push, st.result)
        self._settle_replayed(key, st)

    def _settle_replayed(self, key: Key, st: KeyState) -> None:
        """Once every worker replayed the round or got its replayed sum, move on and let the held
        next-round pushes in."""
        if len(st.replayers | st.answered) < self.n_workers or self.keys.get(key) is not st:
            return
        self._open(key, st.round + 1)
        self.counters.rounds_replayed += 1
        self._dispatch(st.held_next)

    def _dispatch(self, held: list[tuple[Any, ...]]) -> None:
        """Push again, from the event loop, pushes that waited for a round to settle."""
        for args in held:
            task = asyncio.ensure_future(self.push(*args))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _open(self, key: Key, round_: int) -> KeyState:
        st = self.keys[key] = KeyState(round=round_)
        return st

    def sweep(self, now: float) -> int:
        """Fail every round that has waited longer than ``lost_grace_s`` (since its first push) for a
        worker that is not connected or has no training processes (reset and not pushed since); the server
        calls this periodically. Returns how many failed."""
        failed = 0
        for key, st in list(self.keys.items()):
            if st.failed is not None or not (st.contributors or st.replayers) or now - st.opened < self.lost_grace_s:
                continue
            waiting = set(range(self.n_workers)) - set(st.contributors) - st.replayers - st.answered
            absent = sorted(w for w in waiting if not self.connected(w) or w in self._reset)
            if absent:
                failed += 1
                why = "has no training processes" if self.connected(absent[0]) else "is not connected to this server"
                self._fail_round(key, st, f"worker {absent[0]} {why} (waited {self.lost_grace_s:g} s); round "
                                          f"{st.round} of {key[0]!r} cannot complete")
        return failed

    def abort(self, name: str, part: int, round_: int, worker: int, message: str) -> None:
        """A worker gave up a round: fail it for every worker (now and for late pushes)."""
        key = (name, part)
        st = self.keys.get(key)
        if st is not None and round_ > st.round and st.contributors and st.failed is None:
            self._fail_round(key, st, f"tensor {name!r} round {st.round} abandoned: worker {worker} aborted "
                                      f"round {round_}")
        if st is None or round_ > st.round:
            st = self._open(key, round_)
        if st.round == round_ and st.failed is None:
            self._fail_round(key, st, f"tensor {name!r} round {round_} aborted by worker {worker}: {message}")

    def worker_lost(self, worker: int) -> int:
        """The worker daemon's connection dropped: fail every incomplete round still waiting for it.

        Rounds started later wait up to ``lost_grace_s`` for the worker to come back (a
        restarted daemon); after that they fail at once until it pushes again. Returns how
        many rounds failed now.
        """
        self._mark_gone(worker, "is disconnected")
        self._reset.add(worker)
        failed = self._fail_waiting_for(worker, "is disconnected")
        self._clear_if_all_reset()
        return failed

    def worker_hello(self, worker: int, epoch: str) -> None:
        """A worker daemon connected, with its round numbering (a hello alone does not bring training
        processes back: the worker stays reset until it pushes)."""
        self._gone.pop(worker, None)
        self.lost_workers.discard(worker)
        previous = self._epochs.get(worker)
        if epoch:
            self._epochs[worker] = epoch
        # A first hello is a job (or this server) starting, not a worker coming back: the workers of a
        # job do not connect at the same instant, and must not line up with each other's first rounds.
        if epoch and previous is not None and previous != epoch:
            self._numbering_restarted(worker)
            if worker in self._rejoining:
                log.info("worker %d came back (a new daemon) while other workers are mid-job: it rejoins them",
                         worker)

    def _numbering_restarted(self, worker: int) -> None:
        others_mid_job = any(w != worker and w not in self._reset and self.connected(w) for w in range(self.n_workers))
        if self.keys and others_mid_job:
            log.debug("worker %d starts its rounds again while other workers are mid-job: it rejoins them", worker)
            self._rejoining.add(worker)
        else:
            self._rejoining.discard(worker)

    def worker_reset(self, worker: int, epoch: str = "") -> int:
        """The worker has no training processes any more (its job ended or died).

        Every incomplete round fails: none can complete as pushed. Later rounds that need
        the worker wait up to ``lost_grace_s`` for a new job's processes. Once every worker
        has reset, all key state is dropped, so the next job starts at round 0 on a clean
        slate instead of meeting the last job's leftovers.
        """
        failed = 0
        for key, st in list(self.keys.items()):
            if st.contributors and st.failed is None:
                failed += 1
                self._fail_round(key, st, f"worker {worker} has no training processes left (they exited or "
                                          f"died); round {st.round} of {key[0]!r} cannot complete")
        self._mark_gone(worker, "has no training processes")
        self._reset.add(worker)
        if epoch:
            self._epochs[worker] = epoch
        if not self._clear_if_all_reset():
            self._numbering_restarted(worker)
        return failed

    def _clear_if_all_reset(self) -> bool:
        """No worker has training processes (or a connection): the job is over everywhere; the next one
        starts at round 0 on a clean slate. Returns whether that happened."""
        if len(self._reset) < self.n_workers:
            return False
        log.info("every worker reset: dropping the state of %d keys", len(self.keys))
        self.keys.clear()
        self._rejoining.clear()
        # The next job's workers are waited for afresh (a round fails only if one has still neither
        # connected nor pushed after the timeout: sweep), not failed at once for having been gone from the
        # last job. They stay in _reset until they push.
        self.lost_workers.clear()
        self._gone.clear()
        return True

    def _mark_gone(self, worker: int, why: str) -> None:
        token = object()
        self._gone[worker] = token

        def expire() -> None:
            if self._gone.get(worker) is token:
                self.lost_workers.add(worker)
                self._fail_waiting_for(worker, why)

        asyncio.get_running_loop().call_later(self.lost_grace_s, expire)

    def _fail_waiting_for(self, worker: int, why: str) -> int:
        failed = 0
        for key, st in list(self.keys.items()):
            if st.contributors and worker not in st.contributors and st.failed is None:
                failed += 1
                self._fail_round(key, st, f"worker {worker} {why}; round {st.round} of {key[0]!r} cannot complete")
        return failed

    def worker_joined(self, worker: int) -> None:
        """The worker is back (a hello, or a push after a reset)."""
        self._gone.pop(worker, None)
        self.lost_workers.discard(worker)
        self._reset.discard(worker)

    # -- internals -------------------------------------------------------------------
    async def _add(self, st: KeyState, payload: np.ndarray, dtype: str, borrowed: bool = False) -> None:
        if st.acc is None and st.first_borrowed is None and dtype not in dtypes.HALF_TYPES:
            if borrowed:
                st.first_borrowed = payload  # the worker's memory: summed with the next push, never copied
            else:
                st.acc = payload  # adopt the freshly received buffer: no copy
            return
        if st.first_borrowed is not None:  # acc = first + this, in one pass (no copy of the first)
            pair, st.first_borrowed = [st.first_borrowed, payload], None
            st.acc = np.empty(payload.size, dtype=kernels.ACCUMULATOR[dtype])
            await self._offload(kernels.sum_into, st.acc, pair, dtype, nbytes=2 * payload.nbytes)
            return
        first = st.acc is None
        if first:
            st.acc = kernels.new_accumulator(dtype, payload.size)
        await self._offload(kernels.accumulate, st.acc, payload, dtype, first, nbytes=payload.nbytes)

    async def _offload(self, fn: Callable[..., None], *args: Any, nbytes: int) -> None:
        """Run a kernel on the event loop if it is small, else in the summation threads."""
        if nbytes < INLINE_SUM_MAX_BYTES or self.executor is None:
            fn(*args)
        else:
            await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _complete(self, key: Key, st: KeyState, out: np.ndarray | None = None) -> None:
        """Answer every contributor with the round's sum (``out``, or made from the accumulator)."""
        first = st.first
        assert first is not None
        if st.first_borrowed is not None:  # a single worker: its own memory is the sum, copied once
            st.acc, st.first_borrowed = st.first_borrowed.copy(), None
        if out is not None:
            pass
        elif first.dtype in dtypes.HALF_TYPES or first.divisor != 1:
            acc = st.acc
            assert acc is not None  # set by the first add
            out = np.empty(acc.size, dtype=kernels.STORAGE[first.dtype])
            if out.nbytes < INLINE_SUM_MAX_BYTES or self.executor is None:
                kernels.finalize(out, acc, first.dtype, first.divisor)
            else:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self.executor, kernels.finalize, out, acc, first.dtype, first.divisor)
        else:
            out = st.acc
            assert out is not None
        # The next round starts from a fresh state; `out` stays alive as long as transports need it.
        self._open(key, st.round + 1)
        self.counters.rounds_completed += 1
        self.counters.round_seconds.observe(time.monotonic() - st.opened)
        if self.timeline is not None:
            self.timeline.span(f"{key[0]} p{key[1]}", f"round {st.round}", st.opened_us, now_us(),
                               bytes=out.nbytes, workers=sorted(st.contributors))
        for contributor in st.contributors.values():
            self.counters.bytes_sent += out.nbytes
            contributor.reply(contributor.push, out)

    def _fail_round(self, key: Key, st: KeyState, reason: str) -> None:
        log.warning("%s", reason)
        st.failed = reason
        st.held.clear()
        self.counters.rounds_failed += 1
        for worker, contributor in st.contributors.items():
            if worker not in st.answered:
                contributor.fail(contributor.push, reason)
        st.contributors.clear()
        held_next, st.held_next = st.held_next, []
        for push, _, _, fail, _ in held_next:
            fail(push, f"tensor {push.name!r} round {push.round} cannot start: round {st.round} failed: {reason}")
