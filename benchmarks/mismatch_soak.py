"""Soak: steps of names whose sizes straddle the fusion limit, with processes that disagree now and then.

    .venv/bin/python benchmarks/mismatch_soak.py                       # 20 seeds of 20 steps
    .venv/bin/python benchmarks/mismatch_soak.py --seeds 1 --steps 4   # smoke test (seconds)

The driver writes a private cluster file shaped like configs/local.toml (2 worker daemons x 2 training
processes, one Summation Service colocated with each worker plus one CPU-only one; the default 4 MiB partitions,
so tensors of at most 64 KiB are fused; ``--local-sizes 1,2,1`` for other machines) and runs one job per seed:
one rank process per training process.

Each step, every rank draws the same plan from the seed: a few names out of a small pool (so a name comes back
in later steps, often with another size or dtype), each with a size from a list that straddles the fusion
limit (16,383 to 16,385 float32, and sizes well on either side) and a dtype. About one name in seven is a
*mismatch*: one rank of the plan's choosing pushes it with one element more, another dtype, or a size on the
other side of the fusion limit. Every rank issues its names in an order of its own, then synchronizes them all.

Every name that nobody disagreed about must come back exact (integer-valued, every rank's value known); every
mismatched name must fail with a ``BPSError`` on every process; and no step may hang: a step that takes longer
than ``--step-timeout`` is a hang. Names are reused across steps on purpose: a mismatch must leave nothing behind
that a later step of the name meets (wrong rounds, an old error, a wait for ever).

Exit status: 0 if every step of every seed was as above, 1 otherwise, 2 if a cluster could not start.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue as _queue
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Element counts around the fusion limit of 4 MiB partitions (64 KiB: 16,384 float32), and well on either side.
SIZES = (1, 4, 100, 16383, 16384, 16385, 20000, 200000)
DTYPES = ("float32", "float32", "float64", "int32")
POOL = 21  # names s0..s20
MISMATCH_P = 0.15


def plan(seed: int, step: int, size: int, *, mismatch: float = MISMATCH_P, prefix: str = "s", pool: int = POOL,
         most: int = 12, sizes: tuple[int, ...] = SIZES, weights: tuple[int, ...] | None = None,
         ) -> list[tuple[str, int, str, int, str]]:
    """The step's names, the same on every rank: (name, count, dtype, bad rank or -1, how it disagrees); 1 to
    ``most`` names ``{prefix}0`` .. of ``pool``, sizes drawn from ``sizes`` (by ``weights`` if given), about
    one name in 1/``mismatch`` disagreeing (fault_soak.py draws its steps here too)."""
    rng = random.Random(seed * 1000 + step)
    names = list(dict.fromkeys(f"{prefix}{rng.randrange(pool)}" for _ in range(rng.randint(1, most))))
    out = []
    for name in names:
        count = rng.choice(sizes) if weights is None else rng.choices(sizes, weights)[0]
        dtype = rng.choice(DTYPES)
        bad = rng.random() < mismatch
        who, how = rng.randrange(size), rng.choice(("shape", "dtype", "cross"))
        out.append((name, count, dtype, who if bad else -1, how))
    return out


def mine(rank: int, count: int, dtype: str, bad: int, how: str) -> tuple[int, str]:
    """What ``rank`` pushes of a planned name: the plan's, or the bad rank's other size or dtype."""
    if rank != bad:
        return count, dtype
    if how == "shape":
        return count + 1, dtype
    if how == "dtype":
        return count, "float64" if dtype != "float64" else "float32"
    return (20000 if count <= 16384 else 100), dtype  # the other side of the fusion limit


def rank_main(results: Any, sock: str, local_rank: int, seed: int, steps: int, step_timeout: float) -> None:
    import numpy as np

    import bps_worker.client as bps

    problems: list[str] = []
    counts = {"exact": 0, "failed_as_planned": 0}
    try:
        bps.init(socket=sock, local_rank=local_rank)
        rank, size = bps.rank(), bps.size()
        for step in range(steps):
            names = plan(seed, step, size)
            order = list(range(len(names)))
            random.Random(seed * 7919 + step * 31 + rank).shuffle(order)
            handles = {}
            for i in order:
                name, count, dtype, bad, how = names[i]
                c, d = mine(rank, count, dtype, bad, how)
                handles[i] = bps.push_pull_async(np.full(c, rank + 1, d), name, average=False)
            for i, (name, count, dtype, bad, how) in enumerate(names):
                what = f"seed {seed} step {step} {name} ({count} {dtype}, bad rank {bad} {how})"
                try:
                    got = bps.synchronize(handles[i], timeout=step_timeout)
                except bps.BPSTimeoutError:
                    problems.append(f"rank {rank}: {what}: no answer in {step_timeout:g} s (a hang)")
                    raise
                except bps.BPSError as exc:
                    if bad < 0:
                        problems.append(f"rank {rank}: {what}: {type(exc).__name__}: {exc}"[:600])
                    else:
                        counts["failed_as_planned"] += 1
                    continue
                if bad >= 0:
                    problems.append(f"rank {rank}: {what}: summed although rank {bad} disagreed")
                elif got.shape != (count,) or not (got == size * (size + 1) // 2).all():
                    problems.append(f"rank {rank}: {what}: wrong sum {got[:4].tolist()}")
                else:
                    counts["exact"] += 1
        bps.shutdown()
    except Exception as exc:  # reported, never raised: the driver must hear every rank
        problems.append(f"rank (local {local_rank}): {type(exc).__name__}: {exc}"[:600])
    results.put({"problems": problems, **counts})


def collect(results: Any, procs: list[Any], deadline: float) -> list[dict[str, Any]]:
    """The ranks' reports from ``results``, until every one reported, the ranks all died, or ``deadline``."""
    reports: list[dict[str, Any]] = []
    while len(reports) < len(procs) and time.monotonic() < deadline:
        try:
            reports.append(results.get(timeout=1.0))
        except _queue.Empty:
            if not any(p.is_alive() for p in procs) and results.empty():
                break
    return reports


def run_seed(seed: int, steps: int, step_timeout: float, local_sizes: list[int]) -> dict[str, Any]:
    """One job of ``steps`` steps on a fresh cluster (``local_sizes``: processes per machine): what its ranks
    reported."""
    from bps_worker.cluster_file import write_config
    from bps_worker.supervise import Cluster

    with tempfile.TemporaryDirectory(prefix="bps-mismatch-soak-") as tmp:
        config = write_config(Path(tmp), local_sizes, cpu_servers=1, cluster={"timeout": step_timeout})
        cluster = Cluster(str(config), log_level="warning", log_dir=str(Path(tmp) / "logs"))
        cluster.start()
        try:
            ctx = mp.get_context("spawn")
            results = ctx.Queue()
            procs = [ctx.Process(target=rank_main, args=(results, cluster.socket_path(w.id), local, seed, steps,
                                                         step_timeout), daemon=True)
                     for w in cluster.config.worker_specs for local in range(w.local_size)]
            for p in procs:
                p.start()
            reports = collect(results, procs, time.monotonic() + steps * step_timeout + 60)
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        finally:
            cluster.stop()
    problems = [x for r in reports for x in r["problems"]]
    if len(reports) < len(procs):
        problems.append(f"seed {seed}: {len(procs) - len(reports)} of {len(procs)} ranks never reported (a hang)")
    return {"seed": seed, "problems": problems, "exact": sum(r["exact"] for r in reports),
            "failed_as_planned": sum(r["failed_as_planned"] for r in reports)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=20, help="jobs, one cluster each (default 20)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=20, help="steps per job (default 20)")
    p.add_argument("--step-timeout", type=float, default=20.0,
                   help="seconds a step's name may take before it counts as a hang (default 20)")
    p.add_argument("--local-sizes", default="2,2",
                   help="training processes per machine, one number per machine (default 2,2: configs/local.toml)")
    args = p.parse_args(argv)
    local_sizes = [int(n) for n in args.local_sizes.split(",")]
    failing = 0
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        try:
            result = run_seed(seed, args.steps, args.step_timeout, local_sizes)
        except Exception as exc:
            print(f"seed {seed}: the cluster could not start: {exc}")
            return 2
        ok = not result["problems"]
        failing += not ok
        print(f"seed {seed}: {'ok' if ok else 'FAILED'}: {result['exact']} exact sums, "
              f"{result['failed_as_planned']} mismatch errors as planned", flush=True)
        for problem in result["problems"][:10]:
            print(f"  {problem}")
    print(f"{args.seeds - failing} of {args.seeds} seeds as expected")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
