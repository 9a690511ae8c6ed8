"""Summation kernels (bps_server/kernels.py) against numpy, single-threaded, alternating.

    .venv/bin/python benchmarks/kernels.py                    # 64 MiB per tensor, 7 reps, print the table
    .venv/bin/python benchmarks/kernels.py --mib 1 --reps 1   # smoke test
    .venv/bin/python benchmarks/kernels.py --write-results    # also append to benchmarks/RESULTS.md
    .venv/bin/python benchmarks/kernels.py --kernels /tmp/old_kernels.py   # another version of the module

For every dtype, on tensors of ``--mib`` MiB, each kernel and its numpy equivalent:

- ``accumulate``: ``acc += x``, the server's hot path (half types widen into the float32 accumulator);
  numpy ``np.add(acc, x, out=acc)``, for half types ``np.add(acc, x.astype(np.float32), out=acc)``.
- ``first-push``: ``acc = x`` into an existing accumulator (widening half types); numpy ``np.copyto``.
- ``finalize``: the sum in the tensor's dtype (half types: round to nearest even; others: a copy);
  numpy ``np.copyto`` (a cast for half types).
- ``finalize /2``, ``finalize /3`` (float types): the average over 2 or 3 workers; numpy
  ``np.divide(acc, d, out=out)``, for half types ``(acc / d).astype(half)``.
- ``sum_into 2``, ``sum_into 4``: the worker's local sum of 2 or 4 tensors; numpy
  ``np.add(a, b, out=out)`` then ``np.add(out, x, out=out)`` per further input (half types: in a float32
  accumulator made with ``astype``, rounded once at the end).

Before timing, each kernel's result is compared with numpy's bit for bit (column ``same``). Then after
``--warmup`` untimed rounds, ``--reps`` times: ours, numpy (alternating, see ../shared/MEASURING.md).
Reported: ``GB/s = payload bytes / median time`` (min-max from the slowest and fastest repetition), where
the payload is the tensor's bytes in its own dtype (``k`` tensors for ``sum_into k``); ``mem GB/s`` counts
every byte the kernel reads or writes (a float32 accumulator is twice a half tensor); ``vs f32`` is ours
over ours for float32, same kernel, in payload bytes per second. One thread: the daemons call each kernel
from one thread.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import datetime as _dt  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Callable  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from report import append_section, machine, markdown_table, section_head, text_table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_RESULTS = REPO / "benchmarks" / "RESULTS.md"
DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
HALF = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
HEADER = ["dtype", "kernel", "ours GB/s (min-max)", "numpy GB/s (min-max)", "ours/numpy", "ours mem GB/s",
          "vs f32", "same"]
SECTION = """
## `kernels.py`
The summation kernels of `bps_server/kernels.py` against numpy equivalents, one thread, on one tensor size
(default 64 MiB). `GB/s` = payload bytes (the tensor's bytes in its own dtype; `k` tensors for `sum_into k`)
per second of the median repetition, (min-max) from the slowest and fastest; `mem GB/s` counts every byte read
or written (a half type's float32 accumulator is twice its tensor); `vs f32` = ours / ours for float32 (same
kernel, payload bytes per second). Alternating ours, numpy; results compared bit for bit first (`same`). The
kernels are described in the script's docstring.
"""


@dataclass
class Case:
    dtype: str
    kernel: str
    payload: int  # bytes
    traffic: int  # bytes read + written
    ours: Callable[[], object]
    numpy: Callable[[], object]
    same: bool


def load_kernels(path: str | None) -> ModuleType:
    if path is None:
        from bps_runtime import kernels
        return kernels
    name = "bench_kernels_under_test"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # numba's disk cache finds the module by name when it loads a kernel
    spec.loader.exec_module(module)
    return module


def tensor(rng: np.random.Generator, dtype: str, n: int) -> np.ndarray:
    """Random contents in the kernels' storage dtype (half types: bit patterns of normal values)."""
    if dtype in HALF:
        return rng.standard_normal(n, dtype=np.float32).astype(HALF[dtype]).view(np.uint16)
    if dtype.startswith("int"):
        return rng.integers(-1000, 1000, size=n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def cases(K: ModuleType, dtype: str, nbytes: int, rng: np.random.Generator) -> list[Case]:
    storage = K.STORAGE[dtype]
    accd = K.ACCUMULATOR[dtype]
    half = HALF.get(dtype)
    n = nbytes // storage.itemsize
    payload, acc_bytes = n * storage.itemsize, n * accd.itemsize
    xs = [tensor(rng, dtype, n) for _ in range(4)]
    widened = [x.view(half).astype(np.float32) if half else x for x in xs]
    start = widened[0] + widened[1]  # an accumulator holding a sum of two contributions
    out: list[Case] = []

    # accumulate / first-push: our accumulator and numpy's start equal and drift apart only by timing reps
    mine, theirs = start.copy(), start.copy()
    K.accumulate(mine, xs[2], dtype, False)
    np.add(theirs, widened[2], out=theirs)
    same = bits_equal(mine, theirs)
    x = xs[2]
    if half:
        out.append(Case(dtype, "accumulate", payload, payload + 2 * acc_bytes,
                        lambda: K.accumulate(mine, x, dtype, False),
                        lambda: np.add(theirs, x.view(half).astype(np.float32), out=theirs), same))
    else:
        out.append(Case(dtype, "accumulate", payload, payload + 2 * acc_bytes,
                        lambda: K.accumulate(mine, x, dtype, False), lambda: np.add(theirs, x, out=theirs), same))

    K.accumulate(mine, xs[3], dtype, True)
    np.copyto(theirs, xs[3].view(half) if half else xs[3])
    same = bits_equal(mine, theirs)
    y = xs[3]
    out.append(Case(dtype, "first-push", payload, payload + acc_bytes,
                    lambda: K.accumulate(mine, y, dtype, True),
                    lambda: np.copyto(theirs, y.view(half) if half else y), same))

    # finalize (divisor 1): round half types, copy the others
    acc = start
    res_ours, res_np = np.empty(n, storage), np.empty(n, storage)
    K.finalize(res_ours, acc, dtype, 1)
    if half:
        def np_finalize() -> None:
            np.copyto(res_np.view(half), acc, casting="same_kind")
    else:
        def np_finalize() -> None:
            np.copyto(res_np, acc)
    np_finalize()
    out.append(Case(dtype, "finalize", payload, payload + acc_bytes,
                    lambda: K.finalize(res_ours, acc, dtype, 1), np_finalize, bits_equal(res_ours, res_np)))

    if dtype in ("float32", "float64", "float16", "bfloat16"):
        for d in (2, 3):
            if half:
                def np_average(d: int = d) -> None:
                    np.copyto(res_np.view(half), (acc / np.float32(d)).astype(half))
            else:
                def np_average(d: int = d) -> None:
                    np.divide(acc, accd.type(d), out=res_np)
            K.finalize(res_ours, acc, dtype, d)
            np_average()
            out.append(Case(dtype, f"finalize /{d}", payload, payload + acc_bytes,
                            partial(K.finalize, res_ours, acc, dtype, d), np_average,
                            bits_equal(res_ours, res_np)))

    for k in (2, 4):
        inputs = xs[:k]
        if half:
            def np_sum(inputs: list[np.ndarray] = inputs) -> None:
                total = inputs[0].view(half).astype(np.float32)
                for x in inputs[1:]:
                    np.add(total, x.view(half).astype(np.float32), out=total)
                np.copyto(res_np.view(half), total, casting="same_kind")
        else:
            def np_sum(inputs: list[np.ndarray] = inputs) -> None:
                np.add(inputs[0], inputs[1], out=res_np)
                for x in inputs[2:]:
                    np.add(res_np, x, out=res_np)
        K.sum_into(res_ours, inputs, dtype)
        np_sum()
        out.append(Case(dtype, f"sum_into {k}", k * payload, (k + 1) * payload,
                        partial(K.sum_into, res_ours, inputs, dtype), np_sum,
                        bits_equal(res_ours, res_np)))
    return out


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(case: Case, warmup: int, reps: int) -> tuple[list[float], list[float]]:
    ours: list[float] = []
    theirs: list[float] = []
    for i in range(warmup + reps):
        a, b = timed(case.ours), timed(case.numpy)
        if i >= warmup:
            ours.append(a)
            theirs.append(b)
    return ours, theirs


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def fmt(v: float) -> str:
    return f"{v:.2f}" if v < 100 else f"{v:.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=64.0, help="tensor size in MiB (default 64)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions of each (default 7)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions of each first (default 1)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated (default {','.join(DTYPES)})")
    p.add_argument("--kernels", default=None, help="benchmark this file instead of bps_server/kernels.py "
                                                   "(e.g. an older version, from git show)")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {DEFAULT_RESULTS}")
    p.add_argument("--output", default=None, help="append the dated section to this markdown file instead "
                                                  "(implies --write-results)")
    args = p.parse_args(argv)
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if args.reps < 1 or args.warmup < 0 or args.mib <= 0:
        p.error("--reps must be at least 1, --warmup at least 0, --mib positive")
    if unknown := [d for d in names if d not in DTYPES]:
        p.error(f"unknown dtypes {unknown}; known: {', '.join(DTYPES)}")
    nbytes = int(args.mib * (1 << 20)) // 8 * 8
    if nbytes == 0:
        p.error("--mib is too small")

    command_line = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    env_vars = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("MALLOC_", "NUMBA_", "OMP_"))}
    command_line = shlex.join(f"{k}={v}" for k, v in env_vars.items()) + " " + command_line
    started = _dt.datetime.now().astimezone()
    info = machine("numpy", "numba", "llvmlite", "ml_dtypes")
    K = load_kernels(args.kernels)
    K.warm_up()
    rng = np.random.default_rng(2026)
    t0 = time.monotonic()
    results = []  # (case without its buffers, ours times, numpy times)
    gc.disable()
    try:
        for dtype in names:
            for case in cases(K, dtype, nbytes, rng):
                ours, theirs = measure(case, args.warmup, args.reps)
                case.ours = case.numpy = lambda: None  # let this dtype's buffers go
                results.append((case, ours, theirs))
            gc.collect()
    finally:
        gc.enable()
    elapsed = time.monotonic() - t0

    f32 = {case.kernel: gbs(case.payload, statistics.median(ours)) for case, ours, _ in results
           if case.dtype == "float32"}
    rows = []
    for case, ours, theirs in results:
        mo, mn = statistics.median(ours), statistics.median(theirs)
        ours_gbs = gbs(case.payload, mo)
        vs = f"{ours_gbs / f32[case.kernel]:.2f}" if case.kernel in f32 and case.dtype != "float32" else "-"
        rows.append([case.dtype, case.kernel,
                     f"{fmt(ours_gbs)} ({fmt(gbs(case.payload, max(ours)))}-{fmt(gbs(case.payload, min(ours)))})",
                     f"{fmt(gbs(case.payload, mn))} ({fmt(gbs(case.payload, max(theirs)))}-"
                     f"{fmt(gbs(case.payload, min(theirs)))})",
                     f"{mn / mo:.2f}", fmt(gbs(case.traffic, mo)), vs, "yes" if case.same else "NO"])
    ok = all(case.same for case, _, _ in results)

    machine_line = (f"nproc {info['nproc']}, CPU {info['cpu']}; Python {info['python']}, numpy {info['numpy']}, "
                    f"numba {info['numba']}, llvmlite {info['llvmlite']}, ml_dtypes {info['ml_dtypes']}, "
                    f"Linux {info['kernel']}")
    module = args.kernels or "bps_server/kernels.py"
    size = f"{args.mib:g} MiB per tensor"
    print(f"date:    {started.isoformat(timespec='seconds')}")
    print(f"command: {command_line}")
    print(f"machine: {machine_line}")
    print(f"kernels: {module}; {size}; {args.reps} reps after {args.warmup} warm-up, alternating ours, numpy; "
          f"wall time {elapsed:.0f} s")
    print()
    print(text_table(HEADER, rows))
    if not ok:
        print("\nERROR: a kernel's result differs from numpy's", file=sys.stderr)

    if args.write_results or args.output:
        target = Path(args.output) if args.output else DEFAULT_RESULTS
        text = target.read_text() if target.exists() else ""
        parts = [] if "## `kernels.py`" in text else [SECTION.rstrip("\n")]
        parts += [
            *section_head(started, "summation kernels vs numpy", command_line, machine_line),
            f"- kernels: `{module}`; {size}; {args.reps} timed repetitions after {args.warmup} warm-up, "
            f"alternating ours, numpy; wall time {elapsed:.0f} s",
            "", markdown_table(HEADER, rows, left=2), "",
        ]
        append_section(target, parts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
