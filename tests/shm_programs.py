"""Rank programs for the shared-memory space tests (top-level, so spawn can import them)."""

from __future__ import annotations

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
