"""Which workers' training processes are of a later job than another's: pure bookkeeping, no I/O.

Daemons outlive jobs, and a job need not end on every machine at once: machine 0's trainer of the next job may
start (and open that job's first rounds here) while machine 1's trainer of the last one still lingers, connected
(a checkpoint, an evaluation). When that one leaves, its Reset must not fail the rounds machine 0's new trainer
opened: they wait for machine 1's next processes, as rounds wait for any machine's that have not come yet (up to
the timeout: ``RoundTable.sweep``). A review's case: every machine's next job failed at its first round.

Names carry no job, so the server tells by time and by meeting: a worker's processes *began* at its last Reset
(or its daemon's restart), and every worker whose processes were alive then, and which they have not met since
(completed a round with), may be of an earlier job. A round all of whose pushers (reporters, for a fused name)
are such for ``v``, and to which ``v`` never pushed, is of a later job than ``v``'s processes: their leaving
spares it. Every other round fails at once, as before (a trainer that died mid-step fails its peers' step fast).
Processes of one job meet at their first round together, so the relation lasts only until then: the next job's
trainer that began after its peer's (the same job) is not "later" than it once they summed a round.

The relation lasts at most ``window`` (the cluster's timeout) after the later processes began: a round waiting that
long for a machine without processes fails anyway (``RoundTable.sweep``), so a spare past it would only delay a
failure (a server that holds none of the job's first names sees no meeting: a review). Until they meet, and within
that window, a real failure is slower: a worker whose daemon restarted mid-job, or the next job's trainer
that began beside a lingering one, is "later" than its peers; where one of those peers' processes die before
they completed a round together, the rounds the later ones opened fail after the timeout (the sweep) rather than
at once (a review measured 8 s against 3 s, with an 8 s timeout), and the dead peer's relaunched processes may
join them meanwhile. Bounded by the timeout, and only in that window.

Asynchronous values (``bps_server.values``) do not follow this: a next job's ``async_init`` beside a lingering
process of the last job is taken for a rejoin, and gets the last job's value (README, "Asynchronous training").
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Callable

__all__ = ["Jobs", "Spared", "spare_none"]

# Whether a round (or fused name) pushed by these workers is of a later job than the processes that ended.
Spared = Callable[[Collection[int]], bool]


def spare_none(workers: Collection[int]) -> bool:
    """No round is of a later job (the default where nothing is known of jobs)."""
    return False


class Jobs:
    """For each worker, the workers whose processes were alive when its own began (see the module docstring)."""

    def __init__(self, window: float = 30.0) -> None:
        self.window = window
        self._alive_at_start: dict[int, set[int]] = {}  # (empty sets dropped: see pending)
        self._began: dict[int, float] = {}  # when each one's processes began (the caller's clock)

    @property
    def pending(self) -> bool:
        """Whether any worker's processes began beside others they have not met (the hot path asks this)."""
        return bool(self._alive_at_start)

    def ended(self, worker: int, alive: Iterable[int], now: float) -> Spared:
        """``worker``'s processes ended (its next ones begin ``now``); ``alive``: the workers with processes now.
        Returns whether a round that ``workers`` pushed (or reported) is of a later job than the processes that
        ended: spared by their end."""
        for r in [r for r, began in self._began.items() if now - began >= self.window]:
            self._alive_at_start.pop(r, None)  # (past the window: see the module docstring)
            del self._began[r]
        later = frozenset(r for r, alive_then in self._alive_at_start.items() if worker in alive_then)
        for r in later:
            self._drop(r, (worker,))  # (they began before its next processes: no later than those)
        self._alive_at_start.pop(worker, None)
        self._began.pop(worker, None)
        if any(w != worker for w in alive):
            self._alive_at_start[worker] = set(alive) - {worker}
            self._began[worker] = now
        return lambda workers: bool(workers) and worker not in workers and later.issuperset(workers)

    def met(self, workers: Collection[int]) -> None:
        """``workers``' processes completed a round together: one job."""
        for r in workers:
            if r in self._alive_at_start:
                self._drop(r, workers)

    def _drop(self, worker: int, others: Collection[int]) -> None:
        alive_then = self._alive_at_start[worker]
        alive_then.difference_update(others)
        if not alive_then:
            del self._alive_at_start[worker]
            del self._began[worker]
