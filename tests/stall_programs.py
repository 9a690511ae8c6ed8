"""Rank programs of the stall tests: a server that stalls under a push, a rank that comes late
(top-level, so that spawn can import them)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import numpy as np

import bps_worker.client as bps

WARM_UP_ROUNDS = 3


def push_while_a_server_stalls(server_pid: int, resume_after_s: float | None, n: int, flags: str
                               ) -> dict[str, Any]:
    """A few rounds (every link connected and answering), then rank 0 stops the server (SIGSTOP: its TCP
    connections stay up, nothing is answered) and resumes it after ``resume_after_s`` (None: never),
    and every rank pushes once more. Reports that push's outcome and how long it took. Rank 0 stops the
    server only once every rank has its last warm-up sum (a file in ``flags`` each): stopped earlier, the
    server could hold another rank's warm-up result, and that rank failed in its warm-up."""
    rank = bps.rank()
    data = np.full(n, rank + 1, np.float32)
    for _ in range(WARM_UP_ROUNDS):
        bps.push_pull(data, "stalled", average=False)
    open(os.path.join(flags, f"warm-{rank}"), "w").close()
    if rank == 0:
        deadline = time.monotonic() + 60
        while (not all(os.path.exists(os.path.join(flags, f"warm-{r}")) for r in range(bps.size()))
               and time.monotonic() < deadline):
            time.sleep(0.01)
        os.kill(server_pid, signal.SIGSTOP)
        if resume_after_s is not None:
            threading.Timer(resume_after_s, os.kill, (server_pid, signal.SIGCONT)).start()
    start = time.monotonic()
    try:
        out = bps.push_pull(data, "stalled", average=False)
    except bps.BPSError as exc:
        return {"error": str(exc), "class": type(exc).__name__, "seconds": time.monotonic() - start}
    total = sum(range(1, bps.size() + 1))
    return {"error": None, "exact": bool((out == total).all()), "seconds": time.monotonic() - start}


class _Heard(logging.Handler):
    """The warnings the client logged (its daemon's notices)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _Strict(logging.Handler):
    """A program's logging that raises on the client's warnings (a "no warnings" setup): its reader must go on."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "bps_worker.client":
            raise RuntimeError("strict handler: no warnings allowed")


def late_rank(late: int, delay_s: float, n: int) -> dict[str, Any]:
    """Three rounds of tensor "late" by every rank; rank ``late`` comes ``delay_s`` late to round 1 (it
    stalls, alive). Round 0 connects every link (a worker connects to a server at its first push). Reports
    whether every sum was exact and what the client logged meanwhile (``heard``), with a root handler that
    raises on each of those lines."""
    heard = _Heard()
    logging.getLogger("bps_worker.client").addHandler(heard)
    logging.getLogger().addHandler(_Strict())
    rank = bps.rank()
    outs = []
    for round_ in range(3):
        if rank == late and round_ == 1:
            time.sleep(delay_s)
        outs.append(bps.push_pull(np.full(n, rank + 1, np.float32), "late", average=False))
    total = sum(range(1, bps.size() + 1))
    return {"exact": all(bool((out == total).all()) for out in outs), "heard": heard.lines}


def fused_step_issued_during_a_drop(server_pid: int, stall_s: float, wait_s: float, names: int, steps: int,
                                    warm: int, flags: str) -> dict[str, Any]:
    """``steps`` steps of ``names`` small sums each (fused; each value of its rank and step, so that a sum of
    two steps shows), with the ranks out of step at a stall of the server (SIGSTOP for ``stall_s``, longer
    than the timeout: the workers drop their connections to it and reconnect to the same run of it). Rank 1
    issues step ``warm`` at once (the server has its worker's reports), rank 0 stops the server, waits
    ``wait_s`` (its worker drops the silent connection meanwhile) and only then issues that step: its worker
    reports it on the next connection. That round failed for worker 1 when worker 0's connection broke, so it must fail
    for worker 0 too, and not wait as a new round that worker 1's next step would join."""
    rank, size = bps.rank(), bps.size()
    wrong: list[str] = []
    failed: dict[int, dict[str, str]] = {}
    for step in range(steps):
        if step == warm and rank == 0:
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(flags, "issued")) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # the server reads worker 1's reports
            os.kill(server_pid, signal.SIGSTOP)
            threading.Timer(stall_s, os.kill, (server_pid, signal.SIGCONT)).start()
            time.sleep(wait_s)
        handles = {i: bps.push_pull_async(np.full(3, 1000 * step + 10 * rank + i % 10, np.float32), f"fd.{i}",
                                          average=False) for i in range(names)}
        if step == warm and rank == 1:
            open(os.path.join(flags, "issued"), "w").close()
        for i, h in handles.items():
            try:
                y = bps.synchronize(h, timeout=60)
            except bps.BPSError as exc:
                failed.setdefault(step, {})[f"fd.{i}"] = type(exc).__name__
                continue
            want = size * (1000 * step + i % 10) + 10 * size * (size - 1) // 2
            if not (y == want).all():
                wrong.append(f"step {step} fd.{i}: {y.tolist()} instead of {want}")
    return {"wrong": wrong, "failed": failed}


def many_left_unmatched(n: int, flags: str) -> dict[str, Any]:
    """Rank 0 issues ``n`` names that rank 1 (on its machine) never issues; rank 1 leaves a second after rank 0
    issued them all (a file in ``flags``): every one of rank 0's rounds fails. Its error count."""
    rank = bps.rank()
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(flags, "issued")) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(1.0)
        return {"left": True}
    handles = [bps.push_pull_async(np.ones(1000, np.float32), f"unmatched.{i}", average=False) for i in range(n)]
    open(os.path.join(flags, "issued"), "w").close()
    failed = 0
    for handle in handles:
        try:
            bps.synchronize(handle, timeout=60)
        except bps.BPSError:
            failed += 1
    return {"failed": failed}


def names_differ(odd: int, n: int) -> dict[str, Any]:
    """Every rank sums "w"; then rank ``odd`` pushes a name of its own ("mine") where the others push "shared"
    (a rank that names its tensor differently: each waits for the others for ever, but for
    cluster.stall_timeout); then every rank sums "w" again. Reports each of the middle push's error (class,
    text) and whether both sums of "w" were exact."""
    rank, size = bps.rank(), bps.size()
    total = sum(range(1, size + 1))
    data = np.full(n, rank + 1, np.float32)
    exact = bool((bps.push_pull(data, "w", average=False) == total).all())
    name = "mine" if rank == odd else "shared"
    start = time.monotonic()
    try:
        bps.push_pull(data, name, average=False)
        error: tuple[str, str] | None = None
    except bps.BPSError as exc:
        error = (type(exc).__name__, str(exc))
    waited = time.monotonic() - start
    exact = exact and bool((bps.push_pull(data, "w", average=False) == total).all())
    return {"error": error, "waited": waited, "exact": exact}


def async_straggler(sleep_s: float) -> dict[str, Any]:
    """Asynchronous name, staleness 0: rank 1 (the other machine) stalls alive for ``sleep_s`` before its first
    delta; rank 0's first delta is applied and its answer held by the bound, which cluster.stall_timeout fails.
    Then rank 1's delta goes: its answer is both deltas summed (rank 0 waits for it without a round)."""
    rank = bps.rank()
    bps.async_init(np.zeros(4, np.float32), "a", root_rank=0, staleness=0)
    if rank == 1:
        time.sleep(sleep_s)
    try:
        value = bps.async_push_pull(np.full(4, rank + 1, np.float32), "a").tolist()
        error: tuple[str, str] | None = None
    except bps.BPSError as exc:
        value, error = None, (type(exc).__name__, str(exc))
    if rank == 0:
        time.sleep(sleep_s)  # (rank 1 pushes meanwhile; rank 0's leaving must not fail it)
    return {"error": error, "value": value}


def busy_in_another_order(k: int, n: int, interval_s: float) -> dict[str, Any]:
    """Machine 0's ranks issue ``k`` names at once; machine 1's issue them in the reverse order, one every
    ``interval_s`` (busy, never stalled): machine 0's first names wait at the servers about ``k * interval_s``
    while machine 1 pushes its others. cluster.stall_timeout below that failed them (a review's case: it counted
    from the first push, not from the waiting machine's last). Every sum must be exact."""
    rank, size = bps.rank(), bps.size()
    names = [f"o{i:02d}" for i in range(k)]
    late = rank >= size // 2  # machine 1
    if late:
        names = names[::-1]
    handles = []
    for name in names:
        handles.append((name, bps.push_pull_async(np.full(n, rank + 1, np.float32), name, average=False)))
        if late:
            time.sleep(interval_s)
    total = sum(range(1, size + 1))
    errors = []
    for name, handle in handles:
        try:
            if not (bps.synchronize(handle) == total).all():
                errors.append(f"{name}: wrong sum")
        except bps.BPSError as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    return {"errors": errors}
