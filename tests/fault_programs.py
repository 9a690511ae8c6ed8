"""Programs that each rank process runs in the tests of dropped connections (top-level, so the forkserver's
children can import them)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import bps_worker.client as bps


def wait_for(path: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def one_step(name: str, count: int, step: int, timeout_s: float, said: bool = False) -> str:
    """Push ``name`` (integers that depend on the step and rank) and wait: ``exact``, ``wrong``, or the error's
    class name and how long it took (``said``: and its text)."""
    rank, size = bps.rank(), bps.size()
    base = np.arange(count, dtype=np.int64) % 61 + step
    t0 = time.monotonic()
    try:
        got = bps.synchronize(bps.push_pull_async((base + rank).astype(np.float32), name, average=False),
                              timeout=timeout_s)
    except bps.BPSError as exc:
        return f"{type(exc).__name__} after {time.monotonic() - t0:.1f} s" + (f": {exc}" if said else "")
    return "exact" if (got == base * size + size * (size - 1) // 2).all() else "wrong"


def late_peer_then_steps(name: str, count: int, go: str, done: str, steps: int, timeout_s: float) -> list[Any]:
    """Step 0: rank 0 pushes ``name`` at once, rank 1 only once file ``go`` exists (the test drops the
    connections in between); rank 1 then writes file ``done``, which rank 0 waits for before the later
    steps (it moved on: it pushes nothing more of the name until then). Every step's outcome."""
    if bps.rank() == 1:
        wait_for(go)
    out = [one_step(name, count, 0, timeout_s)]
    if bps.rank() == 1:
        open(done, "w").close()
    else:
        wait_for(done)
    return out + [one_step(name, count, step, timeout_s) for step in range(1, steps)]


def late_peer_said_then_meet(name: str, count: int, go: str, met: str, steps: int, timeout_s: float) -> list[Any]:
    """Step 0 as in :func:`late_peer_then_steps`, its error said in full (class and text); then every rank waits
    for every other to end step 0 (files ``met<rank>``) before the later steps."""
    rank = bps.rank()
    if rank == 1:
        wait_for(go)
    first = one_step(name, count, 0, timeout_s, said=True)
    open(f"{met}{rank}", "w").close()
    for other in range(bps.size()):
        wait_for(f"{met}{other}")
    return [first] + [one_step(name, count, step, timeout_s) for step in range(1, steps)]


def given_up_while_frozen(name: str, count: int, go: str, gave_up: str, done: str, steps: int,
                          timeout_s: float) -> list[Any]:
    """Step 0: every rank pushes ``name``. Step 1: rank 0 pushes it at once; the others (one machine) only
    once file ``go`` exists, and disagree among themselves (rank 2 has one element more), so their machine
    gives the round up; the first of them then writes file ``gave_up``. Rank 0 writes file ``done`` once its
    step 1 ended, which the others wait for before the later steps (they moved on: they push nothing more of
    the name until then). Every step's outcome."""
    rank = bps.rank()
    out = [one_step(name, count, 0, timeout_s)]
    if rank:
        wait_for(go)
    out.append(one_step(name, count + (rank == 2), 1, timeout_s))
    if rank:
        open(gave_up, "w").close()
        wait_for(done)
    else:
        open(done, "w").close()
    return out + [one_step(name, count, step, timeout_s) for step in range(2, steps)]


def fused_then_unfused(name: str, go: str, met: str, go2: str, timeout_s: float) -> list[Any]:
    """Step 0: ``name`` small (fused); rank 1 issues it at once, rank 0 once file ``go`` exists. Then every rank
    waits for the others (files ``met<rank>``) and file ``go2``, and steps 1 and 2 push ``name`` too large to
    fuse; a step's error said in full."""
    rank = bps.rank()
    if rank == 0:
        wait_for(go)
    first = one_step(name, 4, 0, timeout_s)
    open(f"{met}{rank}", "w").close()
    for other in range(bps.size()):
        wait_for(f"{met}{other}")
    wait_for(go2)
    out = [first]
    for step in (1, 2):
        out.append(one_step(name, 100_000, step, timeout_s, said=True)[:300])
    return out
