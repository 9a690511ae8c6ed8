"""Rank programs of tests/daemons/test_client_group.py: ``push_pull_group`` on a whole tree of tensors."""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

import numpy as np

import bps_worker.client as bps

# (dtype, shape): small ones (fused at every hop) and large ones (split over servers and partitions).
TREE = [("float32", (3,)), ("float16", (2, 2)), ("int64", (5,)), ("float64", (1,)), ("int32", (7,)),
        ("float32", (300, 100)), ("float16", (40000,)), ("float32", ()), ("int32", (0,)), ("float64", (9000,))]


def _tree(rank: int, step: int, copies: int) -> tuple[list[np.ndarray], list[str]]:
    arrays, names = [], []
    for c in range(copies):
        for i, (dtype, shape) in enumerate(TREE):
            arrays.append(np.full(shape, (rank + i + c + step) % 5, dtype))
            names.append(f"gp.{c}.{i}")
    return arrays, names


def group_steps(steps: int, copies: int) -> dict[str, Any]:
    """A tree of mixed dtypes and sizes summed with one push_pull_group a step, in an order of this rank's own
    (a new one every step); every result checked exactly against numpy, and so are the means of the float ones."""
    rank, size = bps.rank(), bps.size()
    rng = random.Random(7 + rank)
    wrong: list[str] = []
    for step in range(steps):
        arrays, names = _tree(rank, step, copies)
        order = list(range(len(names)))
        rng.shuffle(order)
        results = bps.push_pull_group([arrays[k] for k in order], [names[k] for k in order], average=False)
        for k, y in zip(order, results):
            c, i = (int(part) for part in names[k].split(".")[1:])
            dtype, shape = TREE[i]
            expect = np.full(shape, sum((r + i + c + step) % 5 for r in range(size)), dtype)
            if y.dtype != expect.dtype or y.shape != expect.shape or not np.array_equal(y, expect):
                wrong.append(f"{names[k]} step {step}: {y.ravel()[:4]} != {expect.ravel()[:4]}")
        floats = [k for k in order if TREE[int(names[k].split(".")[2])][0].startswith("float")]
        means = bps.push_pull_group([arrays[k] for k in floats], [names[k] + ".mean" for k in floats])
        for k, y in zip(floats, means):
            c, i = (int(part) for part in names[k].split(".")[1:])
            total = sum((r + i + c + step) % 5 for r in range(size))  # a multiple of 1/size: exact in every dtype
            if not np.array_equal(y, np.full(TREE[i][1], total / size, TREE[i][0])):
                wrong.append(f"{names[k]}.mean step {step}: {y.ravel()[:4]} != {total / size}")
    return {"wrong": wrong}


BAD = {"shape": ((4,), "float32", (5,), "float32"), "dtype": ((4,), "float32", (4,), "float64"),
       # small (packed) on most processes, large (by name) on the bad one
       "size": ((4,), "float32", (40000,), "float32")}


def group_mismatch(bad_rank: int, n: int, how: str = "shape") -> dict[str, Any]:
    """A group of ``n`` small sums and one large, in which ``bad_rank`` gives "gm.bad" another shape or dtype
    (``BAD[how]``): the group raises the mismatch naming it, every other name completed (none stays in flight:
    the same group without it runs at once, exact)."""
    rank, size = bps.rank(), bps.size()
    arrays = [np.full(4, rank + i, np.float32) for i in range(n)] + [np.ones(50000, np.float32)]
    names = [f"gm.{i}" for i in range(n)] + ["gm.large"]
    good_shape, good_dtype, bad_shape, bad_dtype = BAD[how]
    bad = np.ones(bad_shape, bad_dtype) if rank == bad_rank else np.ones(good_shape, good_dtype)
    error: dict[str, Any] = {}
    try:
        bps.push_pull_group(arrays[: n // 2] + [bad] + arrays[n // 2:], names[: n // 2] + ["gm.bad"] + names[n // 2:],
                            average=False)
    except bps.BPSError as exc:
        error = {"type": type(exc).__name__, "text": str(exc), "name": getattr(exc, "name", None)}
    again = bps.push_pull_group(arrays, names, average=False)
    wrong = sum(int(not (y == size * i + size * (size - 1) // 2).all()) for i, y in enumerate(again[:n]))
    wrong += int(not (again[n] == size).all())
    return {"error": error, "wrong": wrong}


def group_bad_calls() -> dict[str, Any]:
    """Bad groups start nothing: each is refused with a BPSError naming what was wrong, and every name of it
    works right after."""
    refused: dict[str, str] = {}
    a = [np.ones(3, np.float32), np.ones(2, np.float32)]
    for label, call in [
        ("lengths", lambda: bps.push_pull_group(a, ["gb.0"])),
        ("twice", lambda: bps.push_pull_group(a, ["gb.0", "gb.0"])),
        ("dtype", lambda: bps.push_pull_group([a[0], np.ones(2, np.complex64)], ["gb.0", "gb.1"])),
    ]:
        try:
            call()
        except bps.BPSError as exc:
            refused[label] = str(exc)
    held = bps.push_pull_async(np.ones(2, np.float32), "gb.1", average=False)
    try:
        bps.push_pull_group([a[0], a[1]], ["gb.0", "gb.1"], average=False)
    except bps.BPSError as exc:
        refused["in flight"] = str(exc)
    held_sum = bps.synchronize(held, timeout=30)
    ok = bps.push_pull_group(a, ["gb.0", "gb.1"], average=False)  # gb.0 was not left claimed by any of those
    return {"refused": refused, "held": held_sum.tolist(), "ok": [y.tolist() for y in ok]}


def group_many(n: int, steps: int) -> dict[str, Any]:
    """``n`` small float32 sums a step with one push_pull_group, in an order of this rank's own; exact."""
    rank, size = bps.rank(), bps.size()
    order = list(range(n))
    random.Random(rank).shuffle(order)
    wrong = 0
    for step in range(steps):
        arrays = [np.full(1 + i % 5, rank + step + i % 13, np.float32) for i in order]
        results = bps.push_pull_group(arrays, [f"gn.{i}" for i in order], average=False)
        for i, y in zip(order, results):
            wrong += int(y.shape != (1 + i % 5,) or not (y == size * (step + i % 13) + size * (size - 1) // 2).all())
    return {"wrong": wrong}


def group_average_mismatch(bad_rank: int, n: int) -> dict[str, Any]:
    """A group of ``n`` small sums that ``bad_rank`` averages and the others sum: the error names one of the
    group's tensors (the packed tensor's internal name before: its agreement did not cover ``average``); then
    the same group, agreed, is exact."""
    rank, size = bps.rank(), bps.size()
    arrays = [np.full(4, rank + i, np.float32) for i in range(n)]
    names = [f"ga.{i}" for i in range(n)]
    error: dict[str, Any] = {}
    try:
        bps.push_pull_group(arrays, names, average=rank == bad_rank)
    except bps.BPSError as exc:
        error = {"type": type(exc).__name__, "text": str(exc), "name": getattr(exc, "name", None)}
    again = bps.push_pull_group(arrays, names, average=False)
    wrong = sum(int(not (y == size * i + size * (size - 1) // 2).all()) for i, y in enumerate(again))
    return {"error": error, "wrong": wrong}


def group_names_differ(how: str, n: int, stall_s: float) -> dict[str, Any]:
    """A group of ``n`` small entries in which rank 0 names one entry more ("extra") or names its last one
    otherwise ("rename"). Under cluster.stall_timeout every process's group fails, its error and the stall lines
    it logged naming the group (its first names), never the agreement's internal name; then another group,
    the same on every process, packed, is exact."""
    rank, size = bps.rank(), bps.size()
    begun = time.time()  # (the ranks start together: the same moment on every one)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("bps_worker.client").addHandler(handler)
    arrays = [np.full(3, rank + i, np.float32) for i in range(n)]
    names = [f"gd.{i}" for i in range(n)]
    mine_a, mine_n = list(arrays), list(names)
    if rank == 0 and how == "extra":
        mine_a.append(np.ones(3, np.float32))
        mine_n.append("gd.extra")
    elif rank == 0 and how == "rename":
        mine_n[-1] = "gd.mine"
    error: dict[str, Any] = {}
    try:
        bps.push_pull_group(mine_a, mine_n, average=False)
    except bps.BPSError as exc:
        error = {"type": type(exc).__name__, "text": str(exc), "what": getattr(exc, "what", None)}
    time.sleep(max(0.0, begun + stall_s + 3.0 - time.time()))  # (every group failed by now: the next is a step)
    # Another group: its agreement is a name no process pushed yet. (The group of gd.* again would not do: the
    # processes that pushed its agreement once, failed, are a round ahead of rank 0 on that name, as on any name
    # some processes push and others do not.)
    names = [f"gd2.{i}" for i in range(n)]
    again = bps.push_pull_group(arrays, names, average=False)
    wrong = sum(int(not (y == size * i + size * (size - 1) // 2).all()) for i, y in enumerate(again))
    return {"error": error, "wrong": wrong, "stall_lines": [line for line in lines if line.startswith("stall")]}


def group_threads(n: int) -> dict[str, Any]:
    """Two threads, each with a group of its own, started in another order on every other rank: both sum."""
    rank, size = bps.rank(), bps.size()
    done: dict[str, bool] = {}
    order = ["A", "B"] if rank % 2 == 0 else ["B", "A"]

    def run(label: str) -> None:
        ys = bps.push_pull_group([np.full(2, rank, np.float32) for _ in range(n)],
                                 [f"gt.{label}.{i}" for i in range(n)], average=False)
        done[label] = all(bool((y == size * (size - 1) // 2).all()) for y in ys)

    threads = [threading.Thread(target=run, args=(label,), daemon=True) for label in order]
    threads[0].start()
    time.sleep(0.3)
    threads[1].start()
    for t in threads:
        t.join(30)
    return {"done": done, "alive": [t.is_alive() for t in threads]}
