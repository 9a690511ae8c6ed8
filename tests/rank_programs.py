"""Programs that each rank process runs in the integration tests (top-level, so spawn can import them).

Inputs are deterministic functions of (case seed, rank), so every rank can build
the numpy reference of the whole cluster's sum by itself.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import numpy as np

import bps_worker.client as bps
from bps_worker.client import NUMPY_DTYPES


def make_input(dtype: str, shape: tuple[int, ...], rank: int, seed: int) -> np.ndarray:
    """Integer-valued data in [-8, 8]: every partial sum is exact in every dtype, even bfloat16.

    Drawn as int8: 64 MiB of input then takes 0.1 CPU-s, not 1.4-2.1 (int64 drawn, then cast); every rank
    builds the whole cluster's reference from it, so it was most of test_64_mib_tensors' time."""
    rng = np.random.default_rng(seed * 1000 + rank)
    return rng.integers(-8, 9, size=shape, dtype=np.int8).astype(NUMPY_DTYPES[dtype])


def reference(dtype: str, shape: tuple[int, ...], size: int, seed: int, average: bool) -> np.ndarray:
    acc_dtype = np.float32 if dtype in ("float16", "bfloat16") else NUMPY_DTYPES[dtype].type
    total = np.zeros(shape, dtype=acc_dtype)
    for r in range(size):
        total = total + make_input(dtype, shape, r, seed).astype(acc_dtype)
    if average:
        total = total / acc_dtype(size)
    return total.astype(NUMPY_DTYPES[dtype])


def raw(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(raw(a)).hexdigest()


def sum_cases(cases: list[tuple[str, str, tuple[int, ...], bool, int]], use_out: bool = False) -> list[dict[str, Any]]:
    """Push-pull every case; report whether it equals the reference bit for bit, and its digest."""
    rank, size = bps.rank(), bps.size()
    report = []
    for name, dtype, shape, average, seed in cases:
        x = make_input(dtype, shape, rank, seed)
        before = x.copy()
        out = np.empty_like(x) if use_out else None
        y = bps.push_pull(x, name, average=average, out=out)
        ref = reference(dtype, shape, size, seed, average)
        report.append({
            "name": name,
            "exact": bool(y.dtype == ref.dtype and y.shape == ref.shape
                          and raw(y) == raw(ref)),
            "input_unchanged": bool(raw(x) == raw(before)),
            "is_out": out is None or y is out,
            "digest": digest(y),
            "shape": y.shape,
            "dtype": str(y.dtype),
        })
    return report


def float_noise(name: str, n: int) -> dict[str, Any]:
    """Non-integer float32 data: close to numpy's sum, and identical bytes on every rank."""
    rank, size = bps.rank(), bps.size()
    xs = [np.random.default_rng(77 + r).standard_normal(n).astype(np.float32) for r in range(size)]
    y = bps.push_pull(xs[rank], name, average=False)
    return {"close": bool(np.allclose(y, np.sum(xs, axis=0), rtol=1e-5, atol=1e-5)), "digest": digest(y)}


def many_rounds(rounds: int, names: int) -> dict[str, Any]:
    """The same names round after round; each round's values differ so mixed rounds would show."""
    rank, size = bps.rank(), bps.size()
    wrong = 0
    for rnd in range(rounds):
        handles = []
        for i in range(names):
            x = np.full(17 + i, rnd * 100 + rank + i, dtype=np.int64)
            handles.append((i, bps.push_pull_async(x, f"round.{i}", average=False)))
        for i, h in handles:
            expect = size * (rnd * 100 + i) + size * (size - 1) // 2
            y = bps.synchronize(h)
            wrong += int(not (y == expect).all())
    return {"wrong": wrong}


def out_of_order(names: int, elems: int) -> dict[str, Any]:
    """Issue ``names`` tensors at once in a rank-specific order, synchronize in another order."""
    rank, size = bps.rank(), bps.size()
    rng = np.random.default_rng(1234 + rank)
    order = rng.permutation(names)
    handles = {}
    for i in order:
        handles[i] = bps.push_pull_async(np.full(elems + i, float(rank + i), np.float32), f"ooo.{i}",
                                         average=False, priority=int(rng.integers(0, 3)))
    wrong = 0
    for i in rng.permutation(names):
        y = bps.synchronize(handles[i], timeout=60)
        wrong += int(not np.array_equal(y, np.full(elems + i, float(size * i + size * (size - 1) // 2), np.float32)))
    return {"wrong": wrong, "order": [int(i) for i in order[:5]]}


def broadcast_check(root: int) -> dict[str, Any]:
    rank = bps.rank()
    values = {
        "f32": np.array([-0.0, 1.5, np.inf, -7.25], dtype=np.float32) * (1 if rank == root else 3),
        "i64": np.arange(5, dtype=np.int64) + 10 * rank,
        "bf16": (np.arange(6, dtype=np.float32) * 0.1 + rank).astype(NUMPY_DTYPES["bfloat16"]),
        "scalar": np.array(float(rank), dtype=np.float64),
    }
    out = {}
    for key, x in values.items():
        y = bps.broadcast(x, root, f"bcast.{key}")
        out[key] = digest(y)
        if rank == root:
            out[key + ".root_exact"] = bool(raw(y) == raw(x))
    return out


def mismatch(bad_rank: int, kind: str) -> dict[str, Any]:
    """Every rank pushes 'bad'; ``bad_rank`` disagrees. Report the error and that 'good' still works."""
    rank, size = bps.rank(), bps.size()
    shape, dtype = (4, 3), np.float32
    if rank == bad_rank:
        if kind == "shape":
            shape = (4, 5)
        else:
            dtype = np.float64
    start = time.monotonic()
    error = None
    try:
        bps.push_pull(np.ones(shape, dtype), "bad", average=False)
    except bps.BPSError as exc:
        error = str(exc)
    elapsed = time.monotonic() - start
    good = bps.push_pull(np.full(3, rank, np.int64), "good", average=False)
    again = bps.push_pull(np.ones((4, 3), np.float32), "bad", average=False)  # the name is usable again
    return {"error": error, "elapsed": elapsed, "good": good.tolist(), "again": again.tolist(),
            "error_type": None if error is None else "BPSError", "size": size}


def mismatches(sizes: list[int], odd: int) -> dict[str, Any]:
    """Rank ``odd`` pushes each of ``sizes`` float32 elements as float64, the others as float32 (one name each:
    a mismatch, small ones fused); then one sum that works. The errors' classes, and that sum."""
    errors = []
    for n in sizes:
        try:
            bps.push_pull(np.ones(n, np.float64 if bps.rank() == odd else np.float32), f"mm.{n}", average=False)
            errors.append(None)
        except bps.BPSError as exc:
            errors.append(type(exc).__name__)
    after = bps.push_pull(np.ones(1, np.float32), "mm.after", average=False)
    return {"errors": errors, "after": float(after[0])}


def ranks_info() -> dict[str, int]:
    return {"rank": bps.rank(), "size": bps.size(), "local_rank": bps.local_rank(), "local_size": bps.local_size()}


def mismatch_by_worker() -> dict[str, Any]:
    rank = bps.rank()
    n = 8 if rank < 2 else 9
    start = time.monotonic()
    error = None
    facts: dict[str, Any] = {}
    try:
        bps.push_pull(np.ones(n, np.float32), "w", average=False)
    except bps.BPSError as exc:
        error = str(exc)
        facts = {"type": type(exc).__name__, "name": getattr(exc, "name", None),
                 "ours": getattr(exc, "ours", None), "theirs": getattr(exc, "theirs", None)}
    elapsed = time.monotonic() - start
    after = bps.push_pull(np.ones(1, np.float32), "w.after", average=False)
    return {"error": error, "elapsed": elapsed, "after": float(after[0]), "facts": facts}


def mismatch_facts(name: str, odd: list[int], n: int) -> dict[str, Any]:
    """Ranks ``odd`` push ``name`` as float32 (n + 1,), the others as (n,) (an average, as push_pull's default):
    the error each process gets, as its class, attributes and text; then a name that works."""
    facts: dict[str, Any] = {}
    try:
        bps.push_pull(np.ones(n + 1 if bps.rank() in odd else n, np.float32), name)
    except bps.BPSError as exc:
        facts = {"type": type(exc).__name__, "name": getattr(exc, "name", None), "ours": getattr(exc, "ours", None),
                 "theirs": getattr(exc, "theirs", None), "text": str(exc)}
    after = bps.push_pull(np.ones(1, np.float32), f"{name}.after", average=False)
    return {"facts": facts, "after": float(after[0])}


def die_before_push(victim: int) -> dict[str, Any]:
    """``victim`` is SIGKILLed after connecting; the others push a tensor it will never push."""
    import os
    import signal

    rank = bps.rank()
    x = np.ones(1000, np.float32)
    if rank == victim:
        bps.push_pull(x, "warmup", average=False)
        os.kill(os.getpid(), signal.SIGKILL)
    bps.push_pull(x, "warmup", average=False)
    time.sleep(0.5 if rank % 2 else 0.0)  # some push before the death is noticed, some after
    start = time.monotonic()
    try:
        bps.push_pull(x, "victim", average=False)
        error = None
    except bps.BPSError as exc:
        error = str(exc)
    return {"error": error, "elapsed": time.monotonic() - start}


def model_mix(seed: int, rounds: int) -> dict[str, Any]:
    """A model-like mix of tensor sizes, pushed ``rounds`` times; exactness checked every round."""
    rank, size = bps.rank(), bps.size()
    rng = np.random.default_rng(seed)
    counts = [int(c) for c in np.concatenate([rng.integers(1, 600, 30), rng.integers(1000, 60000, 20),
                                              rng.integers(100_000, 400_000, 6)])]
    wrong = 0
    total_bytes = 0
    for rnd in range(rounds):
        handles = []
        for i, c in enumerate(counts):
            x = np.full(c, float(rank + rnd + i % 7), np.float32)
            handles.append((i, c, bps.push_pull_async(x, f"mix.{i}", average=False, priority=-i)))
        for i, c, h in handles:
            y = bps.synchronize(h, timeout=60)
            wrong += int(not (y == float(size * (rnd + i % 7) + size * (size - 1) // 2)).all())
            total_bytes += c * 4
    return {"wrong": wrong, "bytes_per_round": total_bytes // rounds, "counts": counts}


def priority_race(big_elems: int) -> dict[str, Any]:
    """A large low-priority tensor, then a small high-priority one: which finishes first?"""
    big = bps.push_pull_async(np.ones(big_elems, np.float32), "race.big", average=False, priority=0)
    small = bps.push_pull_async(np.ones(1000, np.float32), "race.small", average=False, priority=100)
    done: dict[str, float] = {}
    start = time.monotonic()
    while len(done) < 2 and time.monotonic() - start < 60:
        for label, h in (("big", big), ("small", small)):
            if label not in done and bps.poll(h):
                done[label] = time.monotonic() - start
        time.sleep(0.0005)
    ok = bool((bps.synchronize(big) == bps.size()).all() and (bps.synchronize(small) == bps.size()).all())
    return {"done": done, "ok": ok}


def crossed_large(n: int) -> dict[str, Any]:
    """Two large tensors waited for in opposite orders: rank 0 pushes A then B and waits for B first; the
    others push B, wait for it, and only then push A. Rank 0's pushes of A fill its links' windows (their
    sums wait for the others' A), so B must get past them (see ServerLink.pump) or nothing completes."""
    rank, size = bps.rank(), bps.size()
    a, b = np.full(n, rank + 1, np.float32), np.full(n, 10 * (rank + 1), np.float32)
    start = time.monotonic()
    if rank == 0:
        ha = bps.push_pull_async(a, "crossed.a", average=False)
        hb = bps.push_pull_async(b, "crossed.b", average=False)
        yb = bps.synchronize(hb, timeout=60)
        ya = bps.synchronize(ha, timeout=60)
    else:
        yb = bps.push_pull(b, "crossed.b", average=False)
        ya = bps.push_pull(a, "crossed.a", average=False)
    total = size * (size + 1) // 2
    return {"ok": bool((ya == total).all() and (yb == 10 * total).all()), "seconds": time.monotonic() - start}


def tiny_tensors(n: int, rounds: int) -> dict[str, Any]:
    rank, size = bps.rank(), bps.size()
    wrong = 0
    start = time.monotonic()
    for rnd in range(rounds):
        handles = [bps.push_pull_async(np.full(1 + i % 5, rank * 3 + rnd + i, np.int32), f"tiny.{i}", average=False)
                   for i in range(n)]
        for i, h in enumerate(handles):
            y = bps.synchronize(h, timeout=120)
            wrong += int(not (y == 3 * size * (size - 1) // 2 + size * (rnd + i)).all())
    return {"wrong": wrong, "seconds": time.monotonic() - start}


def in_place_push_that_fails(n: int) -> dict[str, Any]:
    """A shared array pushed in place while one server is frozen: the operation fails, and the array
    holds the sums of the partitions that the live servers answered and its input elsewhere."""
    rank, size = bps.rank(), bps.size()
    a = bps.shared_array("inplace.partial", (n,), np.float32)
    ramp = (np.arange(n) % 97).astype(np.float32)
    a[...] = ramp + 1000 * (rank + 1)
    total = size * ramp + 1000 * size * (size + 1) / 2
    try:
        bps.push_pull(a, "inplace.partial", average=False, out=a)
    except bps.BPSError as exc:
        return {"error": str(exc), "summed": int((a == total).sum()),
                "kept": int((a == ramp + 1000 * (rank + 1)).sum())}
    return {"error": None}


def push_until_error(max_seconds: float, n: int = 50_000) -> dict[str, Any]:
    """Push round after round until an error (a peer died) or ``max_seconds``; report when it came, its class and
    its ``peer`` (a BPSConnectionError's)."""
    rank = bps.rank()
    start = time.monotonic()
    rounds = 0
    while time.monotonic() - start < max_seconds:
        try:
            bps.push_pull(np.full(n, rank, np.float32), "steady", average=False)
        except bps.BPSError as exc:
            return {"error": str(exc), "at": time.time(), "rounds": rounds, "class": type(exc).__name__,
                    "peer": getattr(exc, "peer", None)}
        rounds += 1
    return {"error": None, "at": time.time(), "rounds": rounds}


def lonely_step(names: int, n: int) -> dict[str, Any]:
    """One step of ``names`` tensors of ``n`` float32 each, issued at once: each one's error, and when it came."""
    start = time.monotonic()
    handles = [bps.push_pull_async(np.ones(n, np.float32), f"lonely.{j}") for j in range(names)]
    errors: list[str | None] = []
    for handle in handles:
        try:
            bps.synchronize(handle)
            errors.append(None)
        except bps.BPSError as exc:
            errors.append(str(exc))
    return {"errors": errors, "seconds": time.monotonic() - start}


def late_rank_after_mismatch() -> dict[str, Any]:
    """Rank 0 pushes a wrong shape at step 0 and rank 2 (same worker) comes 1 s late; step 1 is clean."""
    rank, size = bps.rank(), bps.size()
    out: dict[str, Any] = {}
    for step in range(2):
        shape = (5,) if (rank == 0 and step == 0) else (4,)
        if rank == 2 and step == 0:
            time.sleep(1.0)
        try:
            y = bps.push_pull(np.full(shape, 100.0 * step + rank, np.float32), "late", average=False)
            out[f"step{step}"] = float(y[0])
        except bps.BPSError as exc:
            out[f"step{step}"] = f"error: {exc}"
    out["expect1"] = float(sum(100.0 + r for r in range(size)))
    return out


def die_after_one_round(victim: int, n: int = 50_000) -> dict[str, Any]:
    """``victim``'s process dies after one round; its worker daemon stays up. The others push on (tensors of
    ``n`` float32: fused where small)."""
    import os
    import signal

    bps.push_pull(np.ones(10, np.float32), "steady", average=False)
    if bps.rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return push_until_error(30.0, n)


def die_mid_job() -> None:
    """Job 1 of the cross-job test: rank 0 pushes 'x' and dies; rank 1 dies without pushing."""
    import os
    import signal

    if bps.rank() == 0:
        bps.push_pull_async(np.full(4, 1000.0, np.float32), "x", average=False)
        time.sleep(0.5)
    else:
        time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


def clean_job(steps: int) -> list[float]:
    """Job 2: x = 10 * step + rank, so every step's sum is known."""
    rank = bps.rank()
    return [float(bps.push_pull(np.full(4, 10.0 * s + rank, np.float32), "x", average=False)[0])
            for s in range(steps)]


def shared_rounds(rounds: int, shape: tuple[int, ...], dtype: str) -> dict[str, Any]:
    """Zero-copy arrays: fill the shared slot, sum in place; the slot stays put across rounds."""
    rank, size = bps.rank(), bps.size()
    a = bps.shared_array("shared.x", shape, NUMPY_DTYPES[dtype])
    address = a.__array_interface__["data"][0]
    exact, same_memory, returned_itself = [], [], []
    for r in range(rounds):
        a[...] = make_input(dtype, shape, rank, seed=r)
        y = bps.push_pull(a, "shared.x", average=False, out=a)
        returned_itself.append(y is a)
        exact.append(raw(a) == raw(reference(dtype, shape, size, r, average=False)))
        again = bps.shared_array("shared.x", shape, NUMPY_DTYPES[dtype])
        same_memory.append(again.__array_interface__["data"][0] == address)
    # Without out=: a new array comes back, and the shared array is left as it was, like any input (also
    # through push_pull_async and push_pull_group, and where the sum is small enough to travel fused).
    unchanged = []
    calls = {99: lambda: bps.push_pull(a, "shared.x", average=False),
             98: lambda: bps.synchronize(bps.push_pull_async(a, "shared.x", average=False)),
             97: lambda: bps.push_pull_group([a], ["shared.x"], average=False)[0]}
    for seed, call in calls.items():
        a[...] = make_input(dtype, shape, rank, seed=seed)
        y = call()
        ref = reference(dtype, shape, size, seed, average=False)
        unchanged.append((raw(y) == raw(ref) and y is not a, raw(a) == raw(make_input(dtype, shape, rank, seed=seed))))
    return {"exact": all(exact), "same_memory": all(same_memory), "returned_itself": all(returned_itself),
            "copy_exact": all(c for c, _ in unchanged), "input_unchanged": [u for _, u in unchanged]}


def results_in_place(sizes: list[int]) -> dict[str, Any]:
    """Plain arrays read their sums from the worker's results segment (no hand-back into the slot). One name
    grows, so the worker moves its results; the process must drop its mapping of the old segment."""
    from bps_worker import client

    rank, size = bps.rank(), bps.size()
    conn = client._operations()
    exact, segments, attached = [], [], []
    for r, n in enumerate(sizes):
        x = make_input("float32", (n,), rank, seed=r)
        y = bps.push_pull(x, "grow", average=False)
        exact.append(raw(y) == raw(reference("float32", (n,), size, r, average=False))
                     and raw(x) == raw(make_input("float32", (n,), rank, seed=r)))
        segments.append(conn.slots.results.get("grow"))
        attached.append(sorted(conn.slots.attached))
    return {"exact": exact, "segments": segments, "attached": attached}


def shared_torch(rounds: int, n: int) -> dict[str, Any]:
    """bps_worker.torch.shared_tensor: in-place push_pull on a tensor whose storage is the slot."""
    import torch

    import bps_worker.torch as bpt

    rank, size = bps.rank(), bps.size()
    t = bpt.shared_tensor("shared.t", (n,), torch.float32)
    ptr = t.data_ptr()
    ok = []
    for r in range(rounds):
        t.copy_(torch.from_numpy(make_input("float32", (n,), rank, seed=r)))
        out = bpt.push_pull(t, "shared.t", average=False, out=t)
        ok.append(out is t and t.data_ptr() == ptr
                  and raw(t.numpy()) == raw(reference("float32", (n,), size, r, average=False)))
    return {"ok": all(ok)}


def ordered_sum(n: int, delay: float, seed: int) -> dict[str, Any]:
    """Floats of very different magnitudes (so the order of additions shows in the bytes), pushed after
    ``delay`` seconds: the test controls which worker's push reaches the servers first."""
    rank, size = bps.rank(), bps.size()
    xs = [(np.random.default_rng(seed + r).standard_normal(n) * 10.0 ** np.random.default_rng(seed + r)
           .integers(-6, 7, n)).astype(np.float32) for r in range(size)]
    time.sleep(delay)
    y = bps.push_pull(xs[rank], "ordered", average=False)
    in_rank_order = xs[0].copy()
    for x in xs[1:]:
        in_rank_order += x
    return {"digest": digest(y), "rank_order": raw(y) == raw(in_rank_order)}


def steady_rounds(rounds: int, pause: float) -> dict[str, Any]:
    """Training-like rounds: a big tensor over every server and a few small ones, each round's values
    different (a lost, doubled or mixed round shows), checked bit for bit; errors are collected, not
    raised, so the test sees how many rounds went wrong."""
    rank, size = bps.rank(), bps.size()
    tensors = {"big": (600_001,), "mid": (70_000,), "bias.0": (17,), "bias.1": (1,)}
    exact = 0
    errors: list[str] = []
    started = time.monotonic()
    for r in range(rounds):
        handles = []
        for i, (name, shape) in enumerate(tensors.items()):
            x = make_input("float32", shape, rank, seed=r * 10 + i)
            handles.append((name, shape, i, bps.push_pull_async(x, name, average=False)))
        for name, shape, i, h in handles:
            try:
                y = bps.synchronize(h)
            except bps.BPSError as exc:
                errors.append(f"round {r} {name}: {exc}")
                continue
            exact += raw(y) == raw(reference("float32", shape, size, r * 10 + i, average=False))
        time.sleep(pause)
    return {"exact": exact, "expected": rounds * len(tensors), "errors": errors[:5],
            "seconds": time.monotonic() - started}


def rejoin_loop(role: str, steps: int, max_seconds: float, n: int = 200_003) -> dict[str, Any]:
    """Two ranks, one per worker. Each pushes ``base(rank) + step``; the sum is ``base(0) + base(1) +
    my step + the other's step``, so each side can read which step of the other it was summed with.

    healthy: keeps training through errors until it has been summed with a restarted partner's steps
    0 .. ``steps`` - 1 (the partner's step going back marks the restart); victim: pushes until its
    worker daemon is killed; new: a restarted process, ``steps`` steps. ``n`` float64 elements a step."""
    rank = bps.rank()
    bases = [np.random.default_rng(500 + r).integers(-1000, 1000, n).astype(np.float64) for r in range(2)]
    both = bases[0] + bases[1]
    partner_steps: list[float] = []
    errors: list[str] = []
    deadline = time.monotonic() + max_seconds
    step = 0
    restarted_at: int | None = None  # index in partner_steps of the restarted partner's first step
    while time.monotonic() < deadline:
        try:
            y = bps.push_pull(bases[rank] + step, "rejoin", average=False)
        except bps.BPSError as exc:
            errors.append(str(exc))
            if role == "victim":
                break
            time.sleep(0.05)
            step += 1
            continue
        other = y - both - step
        partner_steps.append(float(other[0]) if (other == other[0]).all() else float("nan"))
        step += 1
        if role == "new" and len(partner_steps) == steps:
            break
        if role == "healthy":
            if restarted_at is None and len(partner_steps) > 1 and partner_steps[-1] <= partner_steps[-2]:
                # (equal where the victim ran only its step 0: partners' steps never repeat otherwise)
                restarted_at = len(partner_steps) - 1
            if restarted_at is not None and len(partner_steps) - restarted_at >= steps:
                break  # summed with the new process's last step
    return {"partner_steps": partner_steps, "errors": errors[:3], "error_count": len(errors), "steps": step,
            "restarted_at": restarted_at}


def three_sums(name: str, linger: float = 0.0, n: int = 4) -> list[float]:
    """Three push_pulls of ``n`` times ``rank + 1`` under ``name``: what each summed to (after ``linger`` seconds
    more, still connected)."""
    out = [float(bps.push_pull(np.full(n, bps.rank() + 1.0), name, average=False)[0]) for _ in range(3)]
    time.sleep(linger)
    return out


def survivor_steps(sock: str, steps: int, n: int, flags: str) -> list[dict[str, Any]]:
    """``steps`` steps of ``n`` small names issued together (pushing ``10 * step + rank``), each step's outcome:
    its errors and the distinct sums its names got. A step with an error is skipped, then ``init()`` again (it
    reconnects where the worker daemon died and was restarted under this process) after 1 s, as a training loop
    that survives its daemon would. Writes ``flags/<rank>.<step>`` as each step starts. At step 3 each rank issues
    half its names, writes ``flags/<rank>.half`` and waits for ``flags/killed`` before the rest (the fault lands
    mid-issue, as in a backward pass that issues its names over time)."""
    rank = bps.rank()
    out: list[dict[str, Any]] = []
    for step in range(steps):
        open(f"{flags}/{rank}.{step}", "w").close()
        handles, sums, errors = [], set(), 0
        for i in range(n):
            try:
                handles.append(bps.push_pull_async(np.full(4, 10 * step + rank, np.float32), f"surv.{i}",
                                                   average=False))
            except bps.BPSError:  # (the daemon is gone: the issue itself fails)
                errors += 1
            if step == 3 and i == n // 2 - 1:
                open(f"{flags}/{rank}.half", "w").close()
                deadline = time.monotonic() + 30
                while not os.path.exists(f"{flags}/killed") and time.monotonic() < deadline:
                    time.sleep(0.002)
        for h in handles:
            try:
                sums.add(float(bps.synchronize(h, timeout=30)[0]))
            except bps.BPSError:
                errors += 1
        out.append({"step": step, "errors": errors, "sums": sorted(sums)})
        if errors:
            time.sleep(1.0)
            bps.init(socket=sock, local_rank=0, timeout=10.0)
    return out


def cuda_push_pulls(n: int) -> dict[str, Any]:
    """CUDA tensors through CUDA IPC: sum, average, in place, float16 (integer values: exact)."""
    import torch

    import bps_worker.torch as bpt

    rank, size = bps.rank(), bps.size()
    ok = {}
    x = torch.arange(n, dtype=torch.float32, device="cuda") + rank
    y = bpt.push_pull(x, "cuda.sum", average=False)
    want = torch.arange(n, dtype=torch.float32) * size + sum(range(size))
    ok["sum"] = y.is_cuda and torch.equal(y.cpu(), want) and torch.equal(x.cpu(), torch.arange(n) + float(rank))
    z = torch.full((n,), float(rank), device="cuda", dtype=torch.float16)
    out = bpt.push_pull(z, "cuda.half", average=False, out=z)
    ok["in_place_half"] = out is z and torch.equal(z.cpu(), torch.full((n,), float(sum(range(size))),
                                                                         dtype=torch.float16))
    a = bpt.push_pull(torch.ones(n, device="cuda"), "cuda.avg")
    ok["average"] = torch.equal(a.cpu(), torch.ones(n))
    return ok


def cuda_allocations(count: int, big: int, reps: int) -> dict[str, Any]:
    """CUDA tensors that are views into one allocation, ``count`` of them in flight at once and summed in place
    (an IPC handle names the allocation, the offset the view), then one of ``big`` float32 elements over many
    partitions, timed over ``reps`` calls."""
    import torch

    import bps_worker.torch as bpt

    rank, size = bps.rank(), bps.size()
    total = float(sum(range(size)))
    block = torch.full((count * 1000 + 7,), -1.0, device="cuda")
    views = [block[7 + i * 1000:7 + i * 1000 + 999] for i in range(count)]  # one element of -1 after each
    for i, v in enumerate(views):
        v.fill_(float(rank * (i + 1)))
    handles = [bpt.push_pull_async(v, f"view.{i}", average=False, out=v) for i, v in enumerate(views)]
    for h in handles:
        bpt.synchronize(h)
    want = torch.full((count * 1000 + 7,), -1.0)
    for i in range(count):
        want[7 + i * 1000:7 + i * 1000 + 999] = total * (i + 1)
    ok = {"views": bool(torch.equal(block.cpu(), want))}
    ramp = (torch.arange(big, device="cuda") % 1_000_000).float()  # sums of integers below 2**24: exact
    x = ramp + rank
    seconds = []
    for r in range(reps):
        start = time.perf_counter()
        y = bpt.push_pull(x, "big", average=False)
        seconds.append(time.perf_counter() - start)
    ok["big"] = bool(y.is_cuda and torch.equal(y, ramp * size + total))
    ok["seconds"] = sorted(seconds)[len(seconds) // 2]
    return ok


def cuda_failures(victim: int, rounds: int) -> dict[str, Any]:
    """CUDA tensors when things go wrong: a mismatch (rank 0 pushes 6 elements, the others 8), the next name
    still exact; ``rounds`` pushes of a fresh 4 MiB tensor each, the GPU memory this process holds sampled
    (the daemon must let go of every allocation it opened); then ``victim`` dies by SIGKILL with a CUDA push
    in flight while the others push on until their error."""
    import os
    import signal

    import torch

    import bps_worker.torch as bpt

    rank, size = bps.rank(), bps.size()
    out: dict[str, Any] = {"mismatch": None}
    try:
        bpt.push_pull(torch.ones(6 if rank == 0 else 8, device="cuda"), "cuda.bad", average=False)
    except bps.BPSError as exc:
        out["mismatch"] = [type(exc).__name__, str(exc)]
    out["after"] = bpt.push_pull(torch.full((5,), float(rank), device="cuda"), "cuda.after", average=False).tolist()
    steady, reserved = True, []
    for r in range(rounds):
        y = bpt.push_pull(torch.full((1 << 20,), float(rank), device="cuda"), "cuda.steady", average=False)
        steady = steady and bool((y == sum(range(size))).all())
        del y
        if r in (rounds // 4, rounds - 1):
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
    out.update(steady=steady, reserved=reserved)
    if rank == victim:
        bpt.push_pull_async(torch.ones(1 << 20, device="cuda"), "cuda.last", average=False)
        os.kill(os.getpid(), signal.SIGKILL)
    start, out["error"] = time.monotonic(), None
    while time.monotonic() - start < 30:
        try:
            bpt.push_pull(torch.ones(1 << 20, device="cuda"), "cuda.last", average=False)
        except bps.BPSError as exc:
            out["error"] = str(exc)
            break
    out["seconds"] = time.monotonic() - start
    return out


def cuda_description_errors() -> dict[str, str]:
    """Without a GPU: a malformed CUDA description is refused; a well-formed one fails cleanly."""
    from bps_worker.client import adapter

    out = {}
    for label, desc in (("malformed", [1, 2, 3]),
                        ("no_gpu", [[4], [1], 0, "float32", 0, b"h" * 64, 16, 0, b"r", 0, b"e" * 64, False])):
        try:
            bps.synchronize(adapter.start_cuda(f"cuda.{label}", "float32", (4,), desc, average=False, priority=0),
                            timeout=20)
            out[label] = "no error"
        except bps.BPSError as exc:
            out[label] = str(exc)
    bps.push_pull(np.ones(3, np.float32), "after")  # the connection still works
    return out


def late_rounds(n: int, rounds: int, late_rank: int, delay: float) -> dict[str, Any]:
    """One round of "sync" to line the ranks up, then ``rounds`` of "lag" where ``late_rank`` pushes
    ``delay`` seconds after the others: the servers see that worker's pushes late by about ``delay``."""
    rank, size = bps.rank(), bps.size()
    ok = bool(bps.push_pull(np.full(n, rank, np.float32), "sync", average=False)[0] == sum(range(size)))
    for _ in range(rounds):
        if rank == late_rank:
            time.sleep(delay)
        y = bps.push_pull(np.full(n, rank + 1, np.float32), "lag", average=False)
        ok = ok and bool((y == sum(range(1, size + 1))).all())
    return {"ok": ok}


def phantom_rejoin(role: str, go: Any, cross: bool) -> dict[str, Any]:
    """Name "pr" on 2 machines of one process each (a 1 KiB fusion limit). Step 0: "steady" (machine 0) and
    "first" (machine 1) push it small with other sizes: a fused mismatch, a failed step on both. "first" leaves
    and "again" joins machine 1 mid-job (a rejoin); steps 1-3 push it too large to fuse, 10**step each. With
    ``cross``, "again"'s step 1 pushes it small (fused) while "steady"'s is large: a mismatch. What each step
    gave, per step: the set of values, or the error's class."""
    out: dict[str, Any] = {}

    def step(n: int, shape: int, value: float) -> None:
        try:
            got = bps.synchronize(bps.push_pull_async(np.full(shape, value, np.float32), "pr", average=False),
                                  timeout=30)
            out[f"step{n}"] = sorted(set(got.tolist()))
        except bps.BPSError as exc:
            out[f"step{n}"] = type(exc).__name__

    if role != "again":  # (a key on every server: machine 0 is mid-job on each when machine 1 resets)
        bps.push_pull(np.ones(100000, np.float32), "pr.warm", average=False)
        step(0, 3 if role == "steady" else 4, 1.0)
    if role == "first":
        return out
    if role == "steady":
        go.wait(60)
    for n in (1, 2, 3):
        step(n, 3 if cross and role == "again" and n == 1 else 400, 10.0 ** n)
    return out


def error_attributes(name: str, n: int) -> dict[str, Any]:
    """push_pull of ``n`` float32 under ``name``; the error's class and the attributes the contract names."""
    try:
        bps.push_pull(np.ones(n, np.float32), name)
    except bps.BPSError as exc:
        return {"class": type(exc).__name__, "message": str(exc),
                **{key: getattr(exc, key) for key in ("peer", "what", "timeout_s", "name") if hasattr(exc, key)}}
    return {"class": None}


def names_that_never_repeat(count: int, table: int) -> dict[str, Any]:
    """``count`` sums of names used once (``step{i}``), issued async in tens as a JAX step's leaves are, with this
    process keeping at most ``table`` small slots and ``table`` names' modes; then the first ten names again
    (forgotten by then), and a delta of an asynchronous name initialised first (its mode is never forgotten).
    Reports whether every sum was exact and the most slots and modes the process kept."""
    from bps_worker.client import _operations
    from bps_worker.client import operations as operations_module
    from bps_worker.client import slots as slots_module
    slots_module.MAX_SMALL_SLOTS = operations_module.MAX_MODES = table
    bps.async_init(np.zeros(4, np.float32), "value")
    size, exact, most, modes = bps.size(), True, 0, 0
    for i in range(0, count, 10):
        handles = [(j, bps.push_pull_async(np.full(8, j + bps.rank(), np.float32), f"step{j}", average=False))
                   for j in range(i, i + 10)]
        for j, handle in handles:
            exact &= bps.synchronize(handle).tolist() == [size * j + size * (size - 1) / 2] * 8
        most = max(most, len(_operations().slots.slots))
        modes = max(modes, len(_operations().modes))
    for j in range(10):
        exact &= bps.push_pull(np.full(8, j + bps.rank(), np.float32), f"step{j}", average=False).tolist() == \
            [size * j + size * (size - 1) / 2] * 8
    value = bps.async_push_pull(np.ones(4, np.float32), "value")
    return {"exact": exact, "most": most, "modes": modes, "value": value.tolist()}


def fused_error_attributes(names: list[str]) -> dict[str, Any]:
    """Small sums of ``names`` issued together (fused), then each synchronized: per name, None or its error's
    class and contract attributes."""
    handles = [(name, bps.push_pull_async(np.ones(4, np.float32), name)) for name in names]
    out: dict[str, Any] = {}
    for name, handle in handles:
        try:
            bps.synchronize(handle)
            out[name] = None
        except bps.BPSError as exc:
            out[name] = {"class": type(exc).__name__, "message": str(exc), "peer": getattr(exc, "peer", None)}
    return out
