"""``bps-launch --stragglers``: which worker the rounds waited for, from the servers' push lag (pure).

Every server measures, per worker, how long after a round's first push that worker's push arrived
(``bps_server_push_lag_seconds``; in its ``Stats`` as ``push_lag``: per worker the count, the seconds in
all and the counts per bucket of ``push_lag_buckets``). A parameter server sees this for free, where an
all-reduce only sees that the whole ring was slow. :func:`report` merges every server's histograms per
worker and writes one line per worker: pushes, mean lag, the 90th percentile's bucket bound, and a mark on
the worker that is late by far (its mean over ``STRAGGLER_FACTOR`` times the next one's and over
``STRAGGLER_MIN_S``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Mapping

__all__ = ["STRAGGLER_FACTOR", "STRAGGLER_MIN_S", "Lag", "merge", "report"]

STRAGGLER_FACTOR: Final = 2.0
STRAGGLER_MIN_S: Final = 0.001  # below a millisecond, who is "last" is noise


@dataclass
class Lag:
    """One worker's push lag over every server: the histogram merged."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def mean(self) -> float:
        return self.seconds / self.count if self.count else 0.0

    def quantile_bound(self, q: float) -> float:
        """The upper bound of the bucket that holds quantile ``q`` (inf for the last bucket)."""
        rank, seen = q * self.count, 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            seen += n
            if seen >= rank:
                return bound
        return float("inf")


def merge(stats: Mapping[int, Mapping[str, Any]]) -> dict[int, Lag]:
    """Every server's ``push_lag`` (their Stats by server id) merged per worker. ValueError naming the
    server whose buckets differ from the others' (servers of different versions)."""
    lags: dict[int, Lag] = {}
    for sid, server in sorted(stats.items()):
        bounds = tuple(server.get("push_lag_buckets", ()))
        for worker, h in server.get("push_lag", {}).items():
            lag = lags.setdefault(int(worker), Lag(bounds, [0] * (len(bounds) + 1)))
            if lag.bounds != bounds or len(h["counts"]) != len(lag.counts):
                raise ValueError(f"server {sid}'s push lag buckets differ from the other servers'")
            lag.counts = [a + b for a, b in zip(lag.counts, h["counts"])]
            lag.seconds += h["seconds"]
    return lags


def _ms(seconds: float) -> str:
    if seconds == float("inf"):
        return "inf"
    return f"{seconds:.3g} s" if seconds >= 1.0 else f"{seconds * 1e3:.3g} ms"


def report(stats: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """The lines of the summary (see the module docstring)."""
    lags = merge(stats)
    if not lags:
        return ["push lag: no pushes reached the servers"]
    means = sorted((lag.mean for lag in lags.values()), reverse=True)
    runner_up = means[1] if len(means) > 1 else 0.0
    lines = ["push lag per worker (a round's first push to this worker's, over every server):",
             f"{'worker':>8} {'pushes':>8} {'mean':>10} {'p90 <=':>10}"]
    for worker, lag in sorted(lags.items()):
        mark = ""
        if lag.mean == means[0] and lag.mean > STRAGGLER_MIN_S and lag.mean > STRAGGLER_FACTOR * runner_up:
            mark = "  <- straggler: the rounds wait for this worker"
        lines.append(f"{worker:>8} {lag.count:>8} {_ms(lag.mean):>10} {_ms(lag.quantile_bound(0.9)):>10}{mark}")
    return lines
