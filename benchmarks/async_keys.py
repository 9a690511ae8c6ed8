"""What one asynchronous push costs a server, against how many asynchronous keys it holds.

    .venv/bin/python benchmarks/async_keys.py                      # 100, 1,000 and 10,000 keys, 3 reps
    .venv/bin/python benchmarks/async_keys.py --keys 10,100 --reps 1   # smoke test

A model trained asynchronously pushes every one of its tensors every step, each a key of the servers'
value store (``bps_server.values``) driven by ``bps_server.async_values``. A push must cost the same
whatever the number of keys, or a step over K tensors costs O(K^2). For each K, two workers initialise K
keys of 4 float32 each, then push two steps of deltas into every key through ``AsyncValues.push`` (on a
uvloop loop, answers to a no-op connection); reported per push: wall and CPU microseconds (median over
``--reps``), and their ratio to the smallest K.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import uvloop
from report import machine, text_table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bps_server.async_values import AsyncValues  # noqa: E402
from protocol.messages import KIND_ASYNC, KIND_ASYNC_INIT, Push  # noqa: E402

HEADER = ["keys", "push us wall", "push us CPU", "CPU / smallest"]


class _Nobody:
    """A connection that takes every answer and never fails (the store decides; nothing is sent)."""

    def reply(self, push: Push, out: np.ndarray, applied: list[int] | None = None) -> None:
        pass

    def fail(self, push: Push, why: object) -> None:
        raise AssertionError(f"a push failed: {why}")


def _push(name: str, kind: str, worker: int, step: int) -> Push:
    return Push(req=1, name=name, part=0, round=step, worker=worker, dtype="float32", shape=[4], offset=0, count=4,
                kind=kind, root=0, holds_root=worker == 0)


async def per_push(keys: int) -> tuple[float, float]:
    """Wall and CPU microseconds per delta pushed into ``keys`` keys (two workers, two steps each)."""
    values = AsyncValues(2, 30.0, lambda rank: 0)
    for worker in (0, 1):
        values.connected(worker, f"e{worker}")
        values.restored(worker)
    data, nobody = np.ones(4, np.float32), _Nobody()
    for i in range(keys):
        for worker in (0, 1):
            values.push(_push(f"n{i}", KIND_ASYNC_INIT, worker, 0), data, nobody, None)
    c0, t0 = time.process_time(), time.perf_counter()
    for step in (1, 2):
        for i in range(keys):
            for worker in (0, 1):
                values.push(_push(f"n{i}", KIND_ASYNC, worker, step), data, nobody, None)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    values.stop()
    return 1e6 * wall / (4 * keys), 1e6 * cpu / (4 * keys)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", default="100,1000,10000", help="key counts, comma-separated")
    p.add_argument("--reps", type=int, default=3, help="repetitions per key count (default 3)")
    args = p.parse_args(argv)
    counts = [int(k) for k in args.keys.split(",") if k.strip()]
    if args.reps < 1 or not counts or min(counts) < 1:
        p.error("--reps must be at least 1, and every key count at least 1")
    rows, base = [], None
    for keys in counts:
        samples = [uvloop.run(per_push(keys)) for _ in range(args.reps)]
        wall, cpu = (statistics.median(column) for column in zip(*samples))
        base = cpu if base is None else base
        rows.append([str(keys), f"{wall:.1f}", f"{cpu:.1f}", f"{cpu / base:.2f}"])
    info = machine("numpy", "uvloop")
    print(f"machine: nproc {info['nproc']}, CPU {info['cpu']}; Python {info['python']}, numpy {info['numpy']}, "
          f"uvloop {info['uvloop']}")
    print(f"per delta pushed (2 workers x 2 steps into every key), median of {args.reps} repetitions\n")
    print(text_table(HEADER, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
