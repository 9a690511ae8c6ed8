"""Rank programs of the fusion tests (tests/daemons/test_fusion.py): thousands of small sums per step."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import numpy as np

import bps_worker.client as bps


def shuffled_steps(n: int, steps: int) -> dict[str, Any]:
    """``n`` small sums per step, issued in an order of this rank's own (a new one every step), all async,
    then synchronized in yet another order; every value checked exactly."""
    rank, size = bps.rank(), bps.size()
    rng = random.Random(1000 + rank)
    wrong = 0
    start = time.monotonic()
    for step in range(steps):
        order = list(range(n))
        rng.shuffle(order)
        handles = {i: bps.push_pull_async(np.full(1 + i % 7, rank + step + i % 11, np.float32), f"fs.{i}",
                                          average=False) for i in order}
        rng.shuffle(order)
        for i in order:
            y = bps.synchronize(handles[i], timeout=120)
            expect = size * (step + i % 11) + size * (size - 1) // 2
            wrong += int(y.shape != (1 + i % 7,) or not (y == expect).all())
    return {"wrong": wrong, "seconds": time.monotonic() - start}


def mismatch_in_a_batch(bad_rank: int, n: int) -> dict[str, Any]:
    """``n`` small sums at once; ``bad_rank`` gives one of them ("fm.bad") another shape. Only that name fails,
    on every process, naming it; the others are exact."""
    rank, size = bps.rank(), bps.size()
    handles = {f"fm.{i}": bps.push_pull_async(np.full(3, rank + i, np.float32), f"fm.{i}", average=False)
               for i in range(n // 2)}
    shape = (5,) if rank == bad_rank else (4,)
    handles["fm.bad"] = bps.push_pull_async(np.ones(shape, np.float32), "fm.bad", average=False)
    handles.update({f"fm.{i}": bps.push_pull_async(np.full(3, rank + i, np.float32), f"fm.{i}", average=False)
                    for i in range(n // 2, n)})
    errors: dict[str, dict[str, Any]] = {}
    wrong = 0
    for name, h in handles.items():
        try:
            y = bps.synchronize(h, timeout=60)
        except bps.BPSError as exc:
            errors[name] = {"type": type(exc).__name__, "text": str(exc), "name": getattr(exc, "name", None)}
            continue
        i = int(name.split(".")[1])
        wrong += int(not (y == size * i + size * (size - 1) // 2).all())
    again = bps.push_pull(np.ones(4, np.float32), "fm.bad", average=False)  # the name works again
    return {"errors": errors, "wrong": wrong, "again": again.tolist()}


def shape_and_dtype_change(bad_rank: int) -> dict[str, Any]:
    """One name, step by step, as float32 (4,), then (2, 2) and int32 (2, 2) (the same bytes: the same slot)
    and float64 (4,) (more), on every process: each sum exact, of the step's dtype and shape. Then ``bad_rank``
    alone pushes it as (2, 2) again while the others push (4,): a mismatch, on every process, naming it;
    then (4,) works again everywhere."""
    rank, size = bps.rank(), bps.size()
    wrong: list[str] = []
    for dtype, shape in [("float32", (4,)), ("float32", (2, 2)), ("int32", (2, 2)), ("float64", (4,)),
                         ("float32", (4,))]:
        for step in range(2):
            y = bps.synchronize(bps.push_pull_async(np.full(shape, rank + step, dtype), "sc", average=False))
            want = np.full(shape, size * step + size * (size - 1) // 2, dtype)
            if y.dtype != want.dtype or y.shape != want.shape or not (y == want).all():
                wrong.append(f"{dtype}{shape} step {step}: {y.dtype}{y.shape} {y.tolist()}")
    error = None
    try:
        bps.push_pull(np.ones((2, 2) if rank == bad_rank else (4,), np.float32), "sc", average=False)
    except bps.BPSError as exc:
        error = str(exc)
    again = bps.push_pull(np.ones(4, np.float32), "sc", average=False)
    return {"wrong": wrong, "error": error, "again": again.tolist()}


MIXED = [("float32", (3,), False), ("float16", (2, 2), False), ("int64", (5,), False), ("float64", (1,), True),
         ("int32", (7,), False), ("float16", (6,), True), ("int32", (4,), False), ("float32", (2, 3), True)]


def mixed_dtypes(steps: int) -> dict[str, Any]:
    """Small sums of several dtypes, shapes and averages in one step (fused by dtype), against numpy."""
    rank, size = bps.rank(), bps.size()
    wrong: list[str] = []
    for step in range(steps):
        handles = []
        for i, (dtype, shape, average) in enumerate(MIXED * 3):
            x = np.full(shape, (rank + i + step) % 5, dtype)
            handles.append((i, dtype, shape, average, bps.push_pull_async(x, f"mx.{i}", average=average)))
        for i, dtype, shape, average, h in handles:
            y = bps.synchronize(h, timeout=60)
            total = sum((r + i + step) % 5 for r in range(size))
            expect = np.full(shape, total / size if average else total).astype(dtype)
            if y.dtype != np.dtype(dtype) or y.shape != shape or not np.array_equal(y, expect):
                wrong.append(f"mx.{i} {dtype}{shape}: {y.tolist()} != {expect.tolist()}")
    return {"wrong": wrong}


def killed_mid_batch(victim: int, n: int) -> dict[str, Any]:
    """One clean fused step, then ``victim`` issues half a step and dies; the others must get a BPSError for
    the names it never issued (or that were in flight), within the timeout, never hang."""
    rank = bps.rank()
    for h in [bps.push_pull_async(np.ones(2, np.float32), f"fk.{i}", average=False) for i in range(n)]:
        bps.synchronize(h, timeout=60)
    if rank == victim:
        for i in range(n // 2):
            bps.push_pull_async(np.ones(2, np.float32), f"fk.{i}", average=False)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    handles = [bps.push_pull_async(np.ones(2, np.float32), f"fk.{i}", average=False) for i in range(n)]
    errors, ok = 0, 0
    first_error = None
    for h in handles:
        try:
            bps.synchronize(h, timeout=90)
            ok += 1
        except bps.BPSError as exc:
            errors += 1
            first_error = first_error or f"{type(exc).__name__}: {exc}"
    return {"errors": errors, "ok": ok, "first_error": first_error, "seconds": time.monotonic() - start}


def steady_fused(steps: int, n: int, lag: float = 0.0) -> dict[str, Any]:
    """``n`` small sums a step for ``steps`` steps, each checked exactly; errors collected, not raised. The last
    rank rests ``lag`` seconds longer than the others between steps, so that its machine reports each step's
    names that much after the other machine: their anchors hold the names (Stats ``fused_waiting``) for about
    that long. (The pushes are not staggered: a plan sends both machines' together.)"""
    rank, size = bps.rank(), bps.size()
    errors: list[str] = []
    exact = 0
    for step in range(steps):
        handles = [(i, bps.push_pull_async(np.full(1 + i % 5, rank * 10 + step + i, np.float64), f"fr.{i}",
                                           average=False)) for i in range(n)]
        for i, h in handles:
            try:
                y = bps.synchronize(h, timeout=120)
            except bps.BPSError as exc:
                errors.append(f"step {step} fr.{i}: {type(exc).__name__}: {exc}")
                continue
            exact += int((y == 10 * size * (size - 1) // 2 + size * (step + i)).all())
        time.sleep(0.01 + (lag if rank == size - 1 else 0.0))
    return {"errors": errors[:10], "exact": exact, "expected": steps * n}


def paths_differ(bad_ranks: list[int], bad_large: bool) -> dict[str, Any]:
    """Every rank issues "pd" small enough to fuse, except ``bad_ranks``, whose "pd" is too large to (or, with
    ``bad_large`` False, the other way round): a mismatch between the fused and the unfused path, which every
    process must get (naming both shapes), not a hang. Names beside it complete; "pd" works again after."""
    rank, size = bps.rank(), bps.size()
    small, large = (4,), (400,)  # 16 and 1600 bytes: the fusion limit here is 1 KiB
    mine = (large if bad_large else small) if rank in bad_ranks else (small if bad_large else large)
    before = [bps.push_pull_async(np.full(3, i, np.float32), f"pd.before.{i}", average=False) for i in range(20)]
    handle = bps.push_pull_async(np.ones(mine, np.float32), "pd", average=False)
    after = [bps.push_pull_async(np.full(3, i, np.float32), f"pd.after.{i}", average=False) for i in range(20)]
    error: dict[str, Any] = {}
    try:
        bps.synchronize(handle, timeout=60)
    except bps.BPSError as exc:
        error = {"type": type(exc).__name__, "text": str(exc)}
    wrong = 0
    for i, h in enumerate(before):
        wrong += int(not (bps.synchronize(h, timeout=60) == size * i).all())
    for i, h in enumerate(after):
        wrong += int(not (bps.synchronize(h, timeout=60) == size * i).all())
    again = bps.push_pull(np.ones(small, np.float32), "pd", average=False)
    try:  # and too large to fuse, on every process: the unfused rounds of the name still line up
        large_again = bps.synchronize(bps.push_pull_async(np.ones(large, np.float32), "pd", average=False), timeout=30)
        again_large = sorted(set(large_again.tolist()))
    except bps.BPSError as exc:
        again_large = [f"{type(exc).__name__}: {exc}"]
    return {"error": error, "wrong": wrong, "again": again.tolist(), "again_large": again_large}


def unfused_mismatch_then_fused(bad_rank: int, names: int) -> dict[str, Any]:
    """Each of ``names`` fresh names: a step too large to fuse in which ``bad_rank`` disagrees (its machine's
    local round fails, and tells the anchor once it learned the name's round base), then a step small enough
    to fuse that every process agrees on. The second step must be summed: before, the fused report of it could
    reach the anchor ahead of the first step's abort, meet the other machine's unfused push of the first step
    there, and fail as a fused/unfused mismatch."""
    rank, size = bps.rank(), bps.size()
    errors, wrong = 0, []
    for i in range(names):
        name = f"umf.{i}"
        shape = (401,) if rank == bad_rank else (400,)  # 1.6 KB: over this cluster's 1 KiB fusion limit
        try:
            bps.synchronize(bps.push_pull_async(np.ones(shape, np.float32), name, average=False), timeout=30)
        except bps.BPSError:
            errors += 1
        try:
            got = bps.synchronize(bps.push_pull_async(np.full(3, i, np.float32), name, average=False), timeout=30)
            if not (got == size * i).all():
                wrong.append((name, got.tolist()))
        except bps.BPSError as exc:
            wrong.append((name, f"{type(exc).__name__}: {exc}"))
    return {"errors": errors, "wrong": wrong}


def unfused_failure_beside_fused() -> dict[str, Any]:
    """Machine 0's processes push "ufb" too large to fuse and disagree (400 and 401 elements): its local round
    fails; machine 1's push it small (3 elements, fused). Every process must get an error in that step, not wait
    at the anchor's planner for ever (machine 1's report did: the failure only reached the round table). Then a
    barrier, and a step that every process agrees on."""
    rank = bps.rank()
    shape = {0: 400, 1: 401}.get(rank, 3)
    out: dict[str, Any] = {}
    try:
        bps.synchronize(bps.push_pull_async(np.ones(shape, np.float32), "ufb", average=False), timeout=20)
        out["step1"] = "summed"
    except bps.BPSError as exc:
        out["step1"] = type(exc).__name__
    out["barrier"] = bps.push_pull(np.ones(2, np.float32), "ufb.barrier", average=False).tolist()
    got = bps.synchronize(bps.push_pull_async(np.full(400, 7, np.float32), "ufb", average=False), timeout=20)
    out["step2"] = sorted(set(got.tolist()))
    return out


def reset_loop(role: str, n: int, steps: int, kill_after: int, max_seconds: float) -> dict[str, Any]:
    """Two ranks, one per machine, ``n`` small sums a step, all fused. Rank r pushes ``base(r, i) + step`` for
    name i, so each side reads, per name, which step of the other it was summed with (NaN: elements of two
    different steps in one result, a wrong sum).

    healthy: steps on through errors until every name has been summed with a restarted partner's steps 0 ..
    ``steps`` - 1 (the partner's step going back marks the restart); victim: ``kill_after`` clean steps, then
    half of the next step's names issued and SIGKILL at once (its machine's processes are all gone: a reset); new: the
    victim's machine's process started again, ``steps`` steps."""
    rank = bps.rank()
    bases = [np.random.default_rng(700 + r).integers(-1000, 1000, (n, 3)).astype(np.float64) for r in range(2)]
    both = bases[0] + bases[1]
    seen: list[list[float]] = [[] for _ in range(n)]  # per name: the partner's steps summed with ours
    restarted = [-1] * n  # per name: the index in seen of the restarted partner's first step
    errors: list[str] = []
    deadline = time.monotonic() + max_seconds
    step = 0
    while time.monotonic() < deadline:
        if role == "victim" and step == kill_after:
            for i in range(n // 2):
                bps.push_pull_async(bases[rank][i] + step, f"rl.{i}", average=False)
            os.kill(os.getpid(), signal.SIGKILL)  # at once: the plans of those names may come after the reset
        handles = [bps.push_pull_async(bases[rank][i] + step, f"rl.{i}", average=False) for i in range(n)]
        for i, h in enumerate(handles):
            try:
                y = bps.synchronize(h, timeout=60)
            except bps.BPSError as exc:
                errors.append(f"step {step} rl.{i}: {exc}")
                continue
            other = y - both[i] - step
            seen[i].append(float(other[0]) if (other == other[0]).all() else float("nan"))
            if restarted[i] < 0 and len(seen[i]) > 1 and not seen[i][-1] > seen[i][-2]:
                restarted[i] = len(seen[i]) - 1
        step += 1
        if role == "new" and step == steps:
            break
        if role == "healthy" and all(r >= 0 and len(s) - r >= steps for r, s in zip(restarted, seen)):
            break
        if errors and role == "healthy":
            time.sleep(0.05)
    return {"seen": seen, "restarted": restarted, "errors": errors[:3], "error_count": len(errors),
            "steps": step}


def small_sums(names: list[str], n: int, die_after_s: float | None = None) -> dict[str, Any]:
    """One small (fused) sum of each of ``names``, of ``rank + 1`` each: each name's sum, or its error's class
    and text, and how long the process waited. ``die_after_s``: killed (-9) that long after issuing them (a job
    killed while it waits)."""
    rank, size = bps.rank(), bps.size()
    start = time.monotonic()
    handles = [bps.push_pull_async(np.full(n, rank + 1, np.float32), name, average=False) for name in names]
    if die_after_s is not None:
        time.sleep(die_after_s)
        os.kill(os.getpid(), signal.SIGKILL)
    out: dict[str, Any] = {"waited": 0.0, "exact": {}, "errors": {}}
    for name, h in zip(names, handles):
        try:
            y = bps.synchronize(h, timeout=60)
            out["exact"][name] = bool((y == sum(range(1, size + 1))).all())
        except bps.BPSError as exc:
            out["errors"][name] = (type(exc).__name__, str(exc))
    out["waited"] = time.monotonic() - start
    return out


def big_then_small(late: int, delay_s: float) -> dict[str, Any]:
    """A large (unfused) sum by every process, then a small (fused) one that rank ``late`` issues ``delay_s``
    late: whether both are exact, or the error."""
    rank, size = bps.rank(), bps.size()
    total = sum(range(1, size + 1))
    try:
        big = bps.push_pull(np.full(200_000, rank + 1, np.float32), "bts.big", average=False)
        if rank == late:
            time.sleep(delay_s)
        small = bps.push_pull(np.full(8, rank + 1, np.float32), "bts.small", average=False)
    except bps.BPSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, "exact": bool((big == total).all() and (small == total).all())}
