"""A sum on the event loop against the same sum sent to a summation thread and back, per size.

    .venv/bin/python benchmarks/offload.py                       # 64 KiB .. 4 MiB, 3 reps
    .venv/bin/python benchmarks/offload.py --kib 256 --calls 50 --reps 1   # smoke test

What ``bps_server.aggregator.INLINE_SUM_MAX_BYTES`` weighs: below it the server runs a kernel on its uvloop
event loop, above it ``run_in_executor`` sends it to the summation threads (the pool's queue, a thread's
wake-up, ``call_soon_threadsafe`` waking the loop). For each size, ``kernels.accumulate`` over a float32 pair
(``acc += x``, the server's addition of one push; it reads twice the size) is awaited ``--calls`` times in a
row, offloaded to a one-thread pool, then as many times inline; ``--reps`` such pairs alternate. Reported per
call (median over repetitions): wall microseconds, and CPU microseconds of the whole process (both threads,
``time.process_time``). ``hop`` is offloaded minus inline: what the trip costs beyond the sum.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np
import uvloop
from report import machine, text_table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bps_runtime import kernels  # noqa: E402

HEADER = ["KiB summed into", "offloaded us wall", "offloaded us CPU", "inline us wall", "inline us CPU",
          "hop us CPU"]


async def _per_call(run: Callable[[], Awaitable[None]], calls: int) -> tuple[float, float]:
    """Wall and CPU microseconds per call of ``run`` (an async callable), over ``calls`` calls."""
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await run()
    return 1e6 * (time.perf_counter() - t0) / calls, 1e6 * (time.process_time() - c0) / calls


async def measure(kib: int, calls: int, reps: int, pool: ThreadPoolExecutor) -> list[float]:
    """Medians over ``reps`` of (offloaded wall, offloaded CPU, inline wall, inline CPU) per call."""
    acc, x = np.ones(kib * 256, np.float32), np.ones(kib * 256, np.float32)
    loop = asyncio.get_running_loop()

    async def offloaded() -> None:
        await loop.run_in_executor(pool, kernels.accumulate, acc, x, "float32", False)

    async def inline() -> None:
        kernels.accumulate(acc, x, "float32", False)

    await _per_call(offloaded, calls)  # warm-up: the pool's thread, the kernel, the caches
    samples = []
    for _ in range(reps):
        samples.append((*await _per_call(offloaded, calls), *await _per_call(inline, calls)))
    return [statistics.median(column) for column in zip(*samples)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kib", default="64,256,1024,2048,4096", help="sizes in KiB, comma-separated")
    p.add_argument("--calls", type=int, default=500, help="calls per size and repetition (default 500)")
    p.add_argument("--reps", type=int, default=3, help="alternating repetitions (default 3)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.kib.split(",") if s.strip()]
    if args.calls < 1 or args.reps < 1 or not sizes or min(sizes) < 1:
        p.error("--calls and --reps must be at least 1, and every size at least 1 KiB")
    kernels.warm_up(blas=False)

    async def run() -> list[list[str]]:
        with ThreadPoolExecutor(1, thread_name_prefix="bps-sum") as pool:
            rows = []
            for kib in sizes:
                ow, oc, iw, ic = await measure(kib, args.calls, args.reps, pool)
                rows.append([str(kib), f"{ow:.1f}", f"{oc:.1f}", f"{iw:.1f}", f"{ic:.1f}", f"{oc - ic:.1f}"])
            return rows

    info = machine("numpy", "numba", "uvloop")
    print(f"machine: nproc {info['nproc']}, CPU {info['cpu']}; Python {info['python']}, numpy {info['numpy']}, "
          f"numba {info['numba']}, uvloop {info['uvloop']}")
    print(f"{args.calls} calls per size and repetition, median of {args.reps} alternating repetitions\n")
    print(text_table(HEADER, uvloop.run(run())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
