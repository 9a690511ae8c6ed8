"""Rank programs of the worker-session tests (top-level, so spawn can import them): a mismatch between the
two processes of one machine, and an Alloc that would move a slot while its op is in flight."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import bps_worker.client as bps


def local_mismatch() -> dict[str, Any]:
    """Ranks 0 and 1 (one machine) disagree about 'w': float32[4] against float32[5]; the others push [4]."""
    rank = bps.rank()
    n = 5 if rank == 1 else 4
    facts: dict[str, Any] = {}
    start = time.monotonic()
    try:
        bps.push_pull(np.ones(n, np.float32), "w", average=False)
    except bps.BPSError as exc:
        facts = {"type": type(exc).__name__, "name": getattr(exc, "name", None),
                 "ours": getattr(exc, "ours", None), "theirs": getattr(exc, "theirs", None), "text": str(exc)}
    elapsed = time.monotonic() - start
    after = bps.push_pull(np.ones(1, np.float32), "w.after", average=False)
    return {"facts": facts, "elapsed": elapsed, "after": float(after[0])}


def alloc_while_in_flight() -> dict[str, Any]:
    """Rank 0 starts an async push of 'x' (1 MiB: a dedicated segment) that waits for rank 1, then asks its
    daemon for a four times larger slot of 'x' before synchronizing (the client itself never does; here
    through its connection): that Alloc would free the memory the op in flight reads, and must be refused.
    Then both ranks' 'x' completes, and so does 'y'."""
    rank = bps.rank()
    n = 1 << 18
    error: dict[str, Any] = {}
    if rank == 0:
        handle = bps.push_pull_async(np.ones(n, np.float32), "x", average=False)
        try:
            bps._operations().conn.allocate("x", 4 * n * 4)
        except bps.BPSError as exc:
            error = {"type": type(exc).__name__, "text": str(exc)}
        first = bps.synchronize(handle)
    else:
        time.sleep(1.0)  # rank 0's Alloc arrives while its op waits for ours
        first = bps.push_pull(np.ones(n, np.float32), "x", average=False)
    then = bps.push_pull(np.full(10, float(rank), np.float32), "y", average=False)
    return {"error": error, "first": float(np.asarray(first).min()), "first_max": float(np.asarray(first).max()),
            "then": float(np.asarray(then)[0])}


def slab_given_up_in_flight() -> dict[str, Any]:
    """Rank 0 starts an async push of the small 's' (carved from its first slab) that waits for rank 1, then gives
    that slab up through its connection (an Alloc whose ``free`` names it; the client itself never does while
    one of its tensors is in flight). The daemon must not free memory an op in flight reads: 's' completes,
    exact, and so does a small 't' after it (carved from the same slab, which the client still maps)."""
    rank = bps.rank()
    ops = bps._operations()
    if rank == 0:
        handle = bps.push_pull_async(np.full(100, 3.0, np.float32), "s", average=False)
        bps.poll(handle)  # sends its fused batch now (not at the cycle's end): on the socket before the Alloc
        [slab] = ops.slots._slabs.values()
        ops.conn.allocate("other", 1 << 20, [slab])  # a large tensor's slot, giving the slab up first
        first = bps.synchronize(handle)
    else:
        time.sleep(1.0)  # rank 0's Alloc arrives while its op waits for ours
        first = bps.push_pull(np.full(100, 3.0, np.float32), "s", average=False)
    then = bps.push_pull(np.full(10, float(rank), np.float32), "t", average=False)
    return {"first": sorted(set(np.asarray(first).tolist())), "then": sorted(set(np.asarray(then).tolist())),
            "slabs": len(ops.slots._slabs)}
