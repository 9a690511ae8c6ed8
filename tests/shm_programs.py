"""Rank programs for the shared-memory space tests (top-level, so spawn can import them)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import bps_worker.client as bps


def big_then_small(big_elems: int, small_elems: int) -> dict[str, Any]:
    """A tensor too large for /dev/shm must fail as a BPSError; the next, small one must still be summed."""
    error = None
    try:
        bps.push_pull(np.ones(big_elems, np.float32), "too-big", average=False)
    except bps.BPSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    small = bps.push_pull(np.full(small_elems, bps.rank() + 1, np.float32), "small", average=False)
    return {"error": error, "small": small.tolist()}


def truncate_own_slot(elems: int) -> dict[str, Any]:
    """Rank 0 truncates its shared array's segment to 0 bytes between two rounds (as a buggy or hostile training
    process could): that round must fail with an error naming the tensor, the segment and both sizes, and
    nothing may die; a fresh name must then be summed as usual."""
    a = bps.shared_array("victim", (elems,), np.float32)
    a[:] = bps.rank() + 1
    first = bps.push_pull(a, "victim", average=False, out=a)
    first_ends = [float(first[0]), float(first[-1])]
    segment = _slot_segment("victim")
    if bps.rank() == 0:
        os.truncate(os.path.join("/dev/shm", segment), 0)
    error = None
    try:
        bps.push_pull(a, "victim", average=False, out=a)  # the slot itself: this process never touches it
    except bps.BPSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    fresh = bps.push_pull(np.full(elems, bps.rank() + 1, np.float32), "fresh", average=False)
    return {"first": first_ends, "segment": segment, "error": error,
            "fresh": [float(fresh.min()), float(fresh.max())]}


def _slot_segment(name: str) -> str:
    """The name of the segment that holds ``name``'s slot in this process (the client's own table)."""
    ops = bps._operations()  # type: ignore[attr-defined]  # the process's client state, for a test
    return ops.slots.slots[name].segment_name


def many_names(count: int, elems: int) -> dict[str, Any]:
    """``count`` distinct names of ``elems`` float32 each, once each: every sum right, and after each one the
    shared memory of our worker daemon (its files in /dev/shm) and this process's mappings noted."""
    ops = bps._operations()  # type: ignore[attr-defined]
    wrong = []
    daemon_bytes = mapped_bytes = 0
    for i in range(count):
        out = bps.push_pull(np.full(elems, bps.rank() + i, np.float32), f"name-{i}", average=False)
        expected = sum(r + i for r in range(bps.size()))
        if not (out.min() == out.max() == expected):
            wrong.append((i, float(out.min()), float(out.max()), expected))
        pid = next(iter(ops.slots.attached)).split("_")[2]
        prefix = f"bps_w{ops.worker}_{pid}_"
        files = [e for e in os.scandir("/dev/shm") if e.name.startswith(prefix)]
        total = 0
        for entry in files:
            try:
                total += entry.stat().st_blocks * 512
            except FileNotFoundError:
                pass  # freed while we looked
        daemon_bytes = max(daemon_bytes, total)
        mapped_bytes = max(mapped_bytes, sum(seg.size for seg in ops.slots.attached.values()))
    return {"wrong": wrong, "daemon_bytes": daemon_bytes, "mapped_bytes": mapped_bytes,
            "cap": ops.slots.cap_bytes}


def grow_out_of_slab(small: int, large: int) -> dict[str, Any]:
    """One name pushed small (carved from a slab of ours), then large (a segment of its own), then large again,
    under a cap that cannot hold the slab and the large slot together: every sum, or the error."""
    out: dict[str, Any] = {"sums": [], "error": ""}
    try:
        for n in (small, large, large):
            got = bps.push_pull(np.full(n, bps.rank() + 1, np.float32), "grows", average=False)
            out["sums"].append((n, float(got.min()), float(got.max())))
    except bps.BPSError as exc:
        out["error"] = str(exc)
    return out


def beside_a_stalled_reader(elems: int, b_taken: Any) -> list[float]:
    """Machine 1's process of ``tests/daemons/test_result_holds.py``: a round of A and of B; then B, and A only
    once the other machine's process has taken B's result (``b_taken``), so that its Done of B comes before
    its Done of A although its worker daemon put A's result in place first; then C. The sums' values."""
    a = np.ones(elems, np.float32)
    sums = [bps.push_pull(a, name, average=False) for name in ("A", "B", "B")]
    if not b_taken.wait(60):
        raise TimeoutError("the other process never took B's result")
    sums += [bps.push_pull(a, name, average=False) for name in ("A", "C")]
    return [float(s.min()) if s.min() == s.max() else float("nan") for s in sums]
