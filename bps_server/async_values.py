"""The Summation Service's asynchronous mode on the event loop: the driver of :class:`~bps_server.values.ValueStore`.

The store decides everything (its module docstring is the theory of operation) and adds each delta in the call
that brings it; this driver feeds it the connections' events and the clock (a sweep every quarter of the
timeout, as the server's silence watch), and carries out its actions: answers and failures to the pushes'
connections, notes to the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

import numpy as np

from protocol.messages import Push

from .aggregator import Counters
from .rounds import Lease, Why
from .values import Action, Answer, Fail, Note, ValueStore

log = logging.getLogger("bps.server.values")


class Replier(Protocol):
    """What answers a push: the server connection it came on."""

    def reply(self, push: Push, out: np.ndarray, applied: list[int] | None = None) -> None: ...

    def fail(self, push: Push, why: Why) -> None: ...


class AsyncValues:
    """Every asynchronous key of this server, driven on the event loop."""

    def __init__(self, n_workers: int, timeout_s: float, worker_of_rank: Callable[[int], int],
                 stall_s: float = 0.0, counters: Counters | None = None) -> None:
        self.store: ValueStore[Replier] = ValueStore(n_workers, timeout_s=timeout_s, worker_of_rank=worker_of_rank,
                                                     stall_s=stall_s)
        self.timeout_s = timeout_s
        # The server's byte counts (bps_server_bytes_*), which the asynchronous pushes and answers are part of:
        # they counted the synchronous rounds' alone (a whole asynchronous job showed no bytes: a review's case).
        self.counters = Counters() if counters is None else counters
        self.deltas_by_worker: dict[int, int] = {}  # deltas received from each worker
        self._sweeper: asyncio.TimerHandle | None = None
        self._stopped = False

    @property
    def deltas(self) -> int:
        """Deltas received, from every worker."""
        return sum(self.deltas_by_worker.values())

    def has(self, name: str, part: int) -> bool:
        """Whether (name, part) is an asynchronous key here (a synchronous push of it is a misuse)."""
        return self.store.has(name, part)

    def push(self, push: Push, data: np.ndarray, replier: Replier, lease: Lease | None) -> None:
        self.deltas_by_worker[push.worker] = self.deltas_by_worker.get(push.worker, 0) + 1
        self.counters.received(push.worker, data.nbytes, lease is not None)
        self._run(self.store.push(push, data, replier, time.monotonic(), lease))

    def restore(self, push: Push, data: np.ndarray) -> None:
        """A worker's copy of a key's value from this server's previous run (a replayed async push)."""
        self._run(self.store.restore(push, data.copy(), time.monotonic()))

    def restored(self, worker: int) -> None:
        self._run(self.store.worker_restored(worker, time.monotonic()))

    def connected(self, worker: int, epoch: str = "", job: str = "", job_age_s: float = 0.0) -> None:
        self._run(self.store.worker_connected(worker, epoch, time.monotonic(), job, job_age_s))

    def joined(self, worker: int, job: str = "", job_age_s: float = 0.0) -> None:
        self._run(self.store.worker_joined(worker, job, time.monotonic(), job_age_s))

    def disconnected(self, worker: int) -> None:
        self.store.worker_disconnected(worker, time.monotonic())

    def reset(self, worker: int, epoch: str = "") -> None:
        self._run(self.store.worker_reset(worker, epoch))

    def init_failed(self, name: str, root: int, round_: int, why: Why, worker: int = -1) -> None:
        """The root's machine failed an async_init of ``name`` (InitFailed)."""
        self._run(self.store.init_failed(name, root, round_, why, worker))

    def sweep(self) -> None:
        self._sweeper = None
        self._run(self.store.sweep(time.monotonic()))
        self._arm()

    def _arm(self) -> None:
        """Sweep a quarter timeout from now while anything could wait (a value is held, a push waits for a
        restore, a machine is away): nothing else asks. Decided in constant time: it runs after every push (a
        look over every key for waiters made a push's cost grow with the keys held, 30 times at 10,000)."""
        if self._sweeper is not None or self._stopped:
            return
        s = self.store
        busy = s.keys or s.pending or s.restoring_since is not None or set(s.disconnected) - s.excluded
        if busy:
            every = self.timeout_s / 4 if s.restoring_since is None else min(self.timeout_s / 4, s.restore_grace_s())
            self._sweeper = asyncio.get_running_loop().call_later(every, self.sweep)

    def stop(self) -> None:
        """No sweep from now on (the server stops: what it still reads is not swept)."""
        self._stopped = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def _run(self, actions: list[Action[Replier]]) -> None:
        for action in actions:
            if isinstance(action, Answer):
                self.counters.bytes_sent += action.value.nbytes
                action.handle.reply(action.push, action.value, action.applied)
            elif isinstance(action, Fail):
                log.warning("%s", action.why.text)
                action.handle.fail(action.push, action.why)
            elif isinstance(action, Note):
                log.log(action.level, "%s", action.message)
        self._arm()
