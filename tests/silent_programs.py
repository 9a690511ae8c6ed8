"""Rank programs of the silent-mismatch and bit-exact broadcast tests (issue 14 item 4; top-level, so spawn can
import them).

Each returns plain values: the error a rank got (its type and facts), or the raw bytes of its result, so that
the test compares bits, not values.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import bps_worker.client as bps
from bps_worker.client import NUMPY_DTYPES

# Bit patterns a sum would change: signalling and quiet NaNs with payloads (both signs), -0.0, the smallest
# and largest subnormals, infinities. A sum with -0.0 quiets a signalling NaN (its quiet bit is set).
SPECIAL_BITS: dict[str, list[int]] = {
    "float32": [0x7F800001, 0xFF800123, 0x7FA00000, 0x7FC00001, 0x80000000, 0x00000001, 0x807FFFFF,
                0x7F800000, 0x3F800000],
    "float64": [0x7FF0000000000001, 0xFFF0000000000ABC, 0x7FF4000000000000, 0x7FF8000000000001,
                0x8000000000000000, 0x0000000000000001, 0x800FFFFFFFFFFFFF, 0x7FF0000000000000],
    "float16": [0x7C01, 0xFC23, 0x7D00, 0x7E01, 0x8000, 0x0001, 0x83FF, 0x7C00, 0x3C00],
    "bfloat16": [0x7F81, 0xFF93, 0x7FA0, 0x7FC1, 0x8000, 0x0001, 0x807F, 0x7F80, 0x3F80],
}
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def special_array(dtype: str, rank: int, count: int) -> np.ndarray:
    """``count`` elements cycling through SPECIAL_BITS[dtype], each rank's rotated differently (the
    non-root ranks' arrays must not matter)."""
    bits = np.array(SPECIAL_BITS[dtype], dtype=_UINT[NUMPY_DTYPES[dtype].itemsize])
    pattern = np.resize(np.roll(bits, rank), count)
    return pattern.view(NUMPY_DTYPES[dtype])


def _facts(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "text": str(exc), "name": getattr(exc, "name", None),
            "ours": getattr(exc, "ours", None), "theirs": getattr(exc, "theirs", None)}


def broadcast_bits(root: int, counts: list[int]) -> dict[str, Any]:
    """Broadcast SPECIAL_BITS arrays of every float dtype and each of ``counts`` from ``root``: each rank
    reports the result's bytes (hex) and the root's input's bytes (every rank can build the root's input)."""
    out: dict[str, Any] = {}
    for count in counts:
        for dtype in SPECIAL_BITS:
            x = special_array(dtype, bps.rank(), count)
            y = bps.broadcast(x, root, f"bits.{dtype}.{count}")
            out[f"{dtype}[{count}]"] = {"got": np.ascontiguousarray(y).tobytes().hex(),
                                        "want": special_array(dtype, root, count).tobytes().hex(),
                                        "dtype": str(y.dtype), "shape": list(y.shape)}
    return out


def root_by_worker(roots: list[int]) -> dict[str, Any]:
    """Every rank broadcasts 'b' from ``roots[worker]``: the ranks of one machine agree, the machines do not."""
    rank = bps.rank()
    worker = 0 if rank < 2 else 1
    x = np.full(3, 10.0 * (worker + 1), np.float32)
    start = time.monotonic()
    result: dict[str, Any] = {"error": None}
    try:
        result["value"] = bps.broadcast(x, roots[worker], "b").tolist()
    except bps.BPSError as exc:
        result["error"] = _facts(exc)
    result["elapsed"] = time.monotonic() - start
    # the name is usable again, and so are others
    result["again"] = bps.broadcast(np.full(2, float(rank), np.float32), 1, "b").tolist()
    result["other"] = bps.push_pull(np.ones(2, np.float32), "b.other", average=False).tolist()
    return result


def optimizer_cases(cases: list[tuple[Any, ...]], steps: int) -> list[dict[str, Any]]:
    """For each case (this rank's names and sizes of a two-parameter model, and optionally the seconds to wait
    before its first step): ``steps`` of a DistributedOptimizer; the error of each step (or the gradients it
    applied)."""
    import torch

    import bps_worker.torch as tbps

    torch.set_num_threads(1)
    rank = tbps.rank()
    results = []
    for names, sizes, *late in cases:
        time.sleep(late[0] if late else 0.0)
        first = torch.nn.Parameter(torch.zeros(sizes[0]))
        second = torch.nn.Parameter(torch.zeros(sizes[1]))
        opt = tbps.DistributedOptimizer(torch.optim.SGD([first, second], lr=1.0),
                                        named_parameters=list(zip(names, [first, second])))
        outcomes: list[dict[str, Any]] = []
        for _ in range(steps):
            opt.zero_grad()
            # first's gradient is 1 + rank, second's 100 * (1 + rank): an average of first with second shows
            (first.sum() * (1 + rank) + second.sum() * 100 * (1 + rank)).backward()
            start = time.monotonic()
            try:
                opt.step()
                assert first.grad is not None and second.grad is not None
                outcomes.append({"grads": [first.grad.tolist(), second.grad.tolist()]})
            except tbps.BPSError as exc:
                outcomes.append({"error": _facts(exc), "elapsed": time.monotonic() - start})
        results.append({"outcomes": outcomes})
    return results


def optimizer_in_another_order(reversed_ranks: list[int]) -> dict[str, Any]:
    """A DistributedOptimizer whose ``named_parameters`` come reversed on ``reversed_ranks``: three layers, in
    buckets of two parameters (80 bytes: a bias and its weight), which those ranks name after the weights and
    the others after the biases (no name in common). Two steps, each one's error and seconds; then, on the same
    processes, buckets of one parameter each (``bucket_bytes=0``: the same names and contents in any order),
    whose step must average exactly."""
    import torch

    import bps_worker.torch as tbps

    torch.set_num_threads(1)
    rank = tbps.rank()
    layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
    named = [(f"reorder.{n}", p) for n, p in layers.named_parameters()]
    opt = tbps.DistributedOptimizer(torch.optim.SGD(layers.parameters(), lr=1.0),
                                    named_parameters=named[::-1] if rank in reversed_ranks else named,
                                    bucket_bytes=80)
    steps: list[dict[str, Any]] = []
    for _ in range(2):
        opt.zero_grad()
        sum(layer(torch.ones(1, 4)).sum() for layer in layers).backward()
        start = time.monotonic()
        try:
            opt.step()
            steps.append({"error": None})
        except tbps.BPSError as exc:
            steps.append({"error": _facts(exc), "elapsed": time.monotonic() - start})
    single = torch.nn.Parameter(torch.zeros(3))
    other = torch.nn.Parameter(torch.zeros(2))
    pairs = [("single.a", single), ("single.b", other)]
    opt2 = tbps.DistributedOptimizer(torch.optim.SGD([single, other], lr=1.0), bucket_bytes=0,
                                     named_parameters=pairs[::-1] if rank in reversed_ranks else pairs)
    (single.sum() * (1 + rank) + other.sum() * 10 * (1 + rank)).backward()
    opt2.step()
    return {"steps": steps, "grads": [single.grad.tolist(), other.grad.tolist()]}


def rewrap_on_one_rank(rewrap_rank: int, steps: int) -> dict[str, Any]:
    """Every rank trains one model with a DistributedOptimizer; at step 2 ``rewrap_rank`` alone wraps a new one
    over the same parameters (the same names and buckets: as a process of a machine back from a crash, or a rank
    that rebuilt its optimizer, does). The buckets agree on every process: each step's seconds and gradient."""
    import torch

    import bps_worker.torch as tbps

    torch.set_num_threads(1)
    rank = tbps.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))

    def wrap():
        return tbps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                         named_parameters=model.named_parameters())

    opt = wrap()
    times, grads = [], []
    for step in range(steps):
        if step == 2 and rank == rewrap_rank:
            opt = wrap()
        opt.zero_grad()
        (model(torch.ones(1, 4)) * (1 + rank)).sum().backward()
        start = time.monotonic()
        opt.step()
        times.append(round(time.monotonic() - start, 2))
        grads.append(model[1].bias.grad.item())
    return {"times": times, "grads": grads}


def rewrap_then_phase_two(rewrap_rank: int) -> dict[str, Any]:
    """As rewrap_on_one_rank (3 steps, ``rewrap_rank`` wraps again at step 2), then every rank wraps a phase-2
    optimizer over the same model with bucket_bytes=0 (the same on every rank) and steps twice."""
    import torch

    import bps_worker.torch as tbps

    torch.set_num_threads(1)
    rank = tbps.rank()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))

    def wrap(**kw):
        return tbps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                         named_parameters=model.named_parameters(), **kw)

    opt = wrap()
    out = []
    for step in range(5):
        if step == 2 and rank == rewrap_rank:
            opt = wrap()
        if step == 3:
            opt = wrap(bucket_bytes=0)  # phase 2, every rank
        opt.zero_grad()
        (model(torch.ones(1, 4)) * (1 + rank)).sum().backward()
        start = time.monotonic()
        try:
            opt.step()
            out.append(["ok", round(time.monotonic() - start, 2), model[1].bias.grad.item()])
        except tbps.BPSError as exc:
            out.append([type(exc).__name__, round(time.monotonic() - start, 2), str(exc)[:400]])
    return {"steps": out}
