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
    """Rank 0 starts an async push of 'x' (its peers do not push it yet), then pushes 'x' again four times
    larger before synchronizing: that Alloc would move the slot of the op in flight and must be refused.
    Then every rank pushes 'x' (rank 0's first push completes) and 'y'."""
    rank = bps.rank()
    error: dict[str, Any] = {}
    if rank == 0:
        handle = bps.push_pull_async(np.ones(1000, np.float32), "x", average=False)
        try:
            bps.push_pull_async(np.ones(4000, np.float32), "x", average=False)
        except bps.BPSError as exc:
            error = {"type": type(exc).__name__, "text": str(exc)}
        bps.barrier() if hasattr(bps, "barrier") else None
        first = bps.synchronize(handle)
    else:
        time.sleep(1.0)  # rank 0's second push happens while its first waits for us
        first = bps.push_pull(np.ones(1000, np.float32), "x", average=False)
    then = bps.push_pull(np.full(10, float(rank), np.float32), "y", average=False)
    return {"error": error, "first": float(np.asarray(first)[0]), "then": float(np.asarray(then)[0])}
