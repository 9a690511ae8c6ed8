"""Many small tensors per step through the numpy client: BytePS push_pull_async against gloo, in the same processes.

    .venv/bin/python benchmarks/many_tensors.py                  # T = 1, 100, 1000, 10000 tensors of 256 float32
    .venv/bin/python benchmarks/many_tensors.py --quick          # T = 1, 100; 2 reps (smoke test)
    .venv/bin/python benchmarks/many_tensors.py --shuffle        # every rank issues its tensors in its own order
    .venv/bin/python benchmarks/many_tensors.py --group          # one push_pull_group a step instead
    .venv/bin/python benchmarks/many_tensors.py --write-results  # also append to benchmarks/RESULTS.md
    .venv/bin/python benchmarks/many_tensors.py --cpu-per-call   # also the client's CPU per tensor and call

The cluster and the ranks are push_pull_vs_gloo.py's: a private cluster file shaped like configs/local.toml
(2 workers x 2 processes, one colocated server per worker plus one CPU-only server, 4 MiB partitions) on free
ports in a temporary directory, its daemons started with ``bps_worker.supervise.Cluster``, and this file run
with ``--rank-program`` once per rank; every rank is a bps client and a member of one gloo group.

One step, for each configuration of T tensors of E float32 elements (every combination of ``--tensors`` and
``--elements``):

- bps: ``h[i] = bps.push_pull_async(arrays[i], f"many.{E}.{i}", average=False)`` for every i (in a
  rank-dependent order, a fixed permutation per rank, with ``--shuffle``), then ``bps.synchronize`` on every
  handle;
- gloo fused: the T arrays concatenated into one tensor, one ``dist.all_reduce``, split back into T arrays
  (concatenation and split inside the timed region: bps does that work too);
- gloo per tensor: one synchronous ``dist.all_reduce`` per tensor (skipped above ``--max-gloo-per-tensor``).

The inputs are integer-valued (``rank * 7 + (i + j) % 13``), so every sum is exact in float32: the warm-up step
checks every element of every result of all three against the exact sum over ranks, and the run fails if one
differs. Then ``reps`` times ``barrier; bps; barrier; gloo fused; barrier; gloo per tensor``; the time of a
repetition is the maximum over ranks of the local durations; reported are the median (min-max), bps's
microseconds per tensor (median / T), ``bps / gloo fused`` (the goal: <= 10) and ``gloo per tensor / bps``.
Each configuration's names are new (``many.<T>x<E>.<i>``), and its first bps step, between barriers, is
reported too (``bps first step ms``, the maximum over ranks): what a model's first step costs, where every
name gets its slot and its first rounds.

Separately, the latency of one small sum issued alone: ``--single-reps`` synchronous ``bps.push_pull`` calls of
``--single-bytes`` on one name, one at a time (``barrier; bps; barrier; gloo all_reduce`` of the same size);
p50 and p90 over calls of the maximum over ranks. Then as many calls of each back to back, without barriers (a
barrier's exit wakes the ranks at different times, which the call between barriers pays for): p50 per call.

``--cpu-per-call`` also prints the client's CPU per tensor of the timed bps steps: ``time.thread_time`` of the
calling thread around the T ``push_pull_async`` and around the T ``synchronize``, and ``time.process_time`` of
the rank around both (its reader and fusion threads too); each rank's median over the steps, then the mean
(min-max) over ranks. CPU time, unlike wall time, hardly changes with the load of the machine.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import push_pull_vs_gloo as ppg  # noqa: E402
from report import (append_section, cluster_line, machine, machine_line, markdown_table, section_head,  # noqa: E402
                    text_table)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = REPO / "benchmarks" / "RESULTS.md"
DEFAULT_TENSORS = "1,100,1000,10000"
DEFAULT_ELEMENTS = "256"
QUICK_TENSORS = "1,100"
QUICK_ELEMENTS = "256"
GOAL = 10.0  # bps / gloo fused, per step

RESULTS_SECTION_HEADER = """\

## `many_tensors.py`
Many small tensors per step through the numpy client: T tensors of E float32 elements, each rank issuing
`bps.push_pull_async(arrays[i], name_i, average=False)` for every i (with `--shuffle` in its own fixed
order) and then `bps.synchronize` on every handle, against gloo in the same processes: `fused` (the T
arrays concatenated into one tensor, one `dist.all_reduce`, split back; concatenation and split timed) and
`per tensor` (T synchronous `dist.all_reduce`, skipped above `--max-gloo-per-tensor`). Cluster of
`push_pull_vs_gloo.py` (2 workers x 2 processes, 2 colocated + 1 CPU-only server, loopback). Inputs are
integer-valued, so the warm-up step checks every element of all three against the exact sum. Then `reps`
times `barrier; bps; barrier; gloo fused; barrier; gloo per tensor`; the time of a repetition is the maximum
over ranks; median (min-max) over repetitions; `us/tensor = bps median / T`; the goal is
`bps / gloo fused <= 10`; `bps first step` is the warm-up step of new names (max over ranks). Separately,
one small `push_pull` issued alone (synchronous, one name), against one gloo `all_reduce` of the same size:
p50 / p90 over calls of the maximum over ranks.
`torch.set_num_threads(1)` in every rank; the daemons run with their default settings.
"""


# --------------------------------------------------------------------------------------------------------------
# helpers shared by driver and ranks
# --------------------------------------------------------------------------------------------------------------
def parse_counts(text: str, what: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--{what} must be a comma list of integers, not {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--{what} must be a non-empty comma list of positive integers")
    return values


def configurations(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(T, E) for every combination of --tensors and --elements, in that order."""
    return [(t, e) for t in parse_counts(args.tensors, "tensors") for e in parse_counts(args.elements, "elements")]


def inputs(t: int, e: int, rank: int):  # -> np.ndarray of shape (t, e)
    """Row i, element j: rank * 7 + (i + j) % 13, integer-valued float32 (every partial sum is exact)."""
    import numpy as np

    base = np.arange(t, dtype=np.int64)[:, None] + np.arange(e, dtype=np.int64)[None, :]
    base %= 13
    base += 7 * rank
    return base.astype(np.float32)


def expected(t: int, e: int, size: int):  # -> np.ndarray of shape (t, e)
    """The exact sum over ranks of :func:`inputs`."""
    import numpy as np

    base = np.arange(t, dtype=np.int64)[:, None] + np.arange(e, dtype=np.int64)[None, :]
    base %= 13
    return (size * base + 7 * size * (size - 1) // 2).astype(np.float32)


def first_difference(results: list[Any], want: Any) -> str:
    """Where ``results`` (T arrays) first differ from ``want`` (T x E), for the error message."""
    import numpy as np

    for i, got in enumerate(results):
        got = np.asarray(got).reshape(-1)
        if got.shape != want[i].shape:
            return f"tensor {i}: shape {got.shape}, expected {want[i].shape}"
        bad = np.flatnonzero(got != want[i])
        if bad.size:
            j = int(bad[0])
            return f"tensor {i}, element {j}: {got[j]!r}, expected {want[i][j]!r} ({bad.size} elements differ)"
    return "no difference"


def percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


# --------------------------------------------------------------------------------------------------------------
# rank program
# --------------------------------------------------------------------------------------------------------------
def rank_program(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    import torch.distributed as dist

    import bps_worker.client as bps

    rank, size = ppg.join_both(args, bps, args.client_timeout)
    rows: list[dict[str, Any]] = []
    single: dict[str, Any] | None = None
    failed = False

    def save() -> None:
        if rank == 0:
            Path(args.result_file).write_text(json.dumps({"size": size, "rows": rows, "single": single}))

    try:
        for t_count, e in configurations(args):
            matrix = inputs(t_count, e, rank)
            arrays = [matrix[i].copy() for i in range(t_count)]  # T separate arrays, as a model's gradients
            del matrix
            names = [f"many.{t_count}x{e}.{i}" for i in range(t_count)]  # new names: the first step is a first
            order = (np.random.default_rng(1000 + rank).permutation(t_count).tolist() if args.shuffle
                     else list(range(t_count)))
            per_tensor = t_count <= args.max_gloo_per_tensor
            gloo_tensors = [torch.from_numpy(a.copy()) for a in arrays] if per_tensor else []

            cpu: list[tuple[float, float, float]] = []  # per bps step: issue, synchronize (thread), process

            def bps_step() -> list[Any]:
                p0, t0 = time.process_time(), time.thread_time()
                if args.group:  # the whole tree in one call
                    got = bps.push_pull_group([arrays[i] for i in order], [names[i] for i in order], average=False)
                    in_order: list[Any] = [None] * t_count
                    for i, y in zip(order, got):
                        in_order[i] = y
                    t1 = time.thread_time()
                    cpu.append((t1 - t0, 0.0, time.process_time() - p0))
                    return in_order
                handles: list[Any] = [None] * t_count
                for i in order:
                    handles[i] = bps.push_pull_async(arrays[i], names[i], average=False)
                t1 = time.thread_time()
                results: list[Any] = [None] * t_count
                for i in order:
                    results[i] = bps.synchronize(handles[i])
                cpu.append((t1 - t0, time.thread_time() - t1, time.process_time() - p0))
                return results

            def fused_step() -> list[Any]:
                flat = torch.cat([torch.from_numpy(a) for a in arrays])
                dist.all_reduce(flat)
                return [p.numpy() for p in torch.split(flat, e)]

            def restore() -> None:  # gloo's per-tensor all_reduce is in place: its inputs back, untimed
                for a, g in zip(arrays, gloo_tensors):
                    g.copy_(torch.from_numpy(a))

            def per_tensor_step() -> list[Any]:
                for g in gloo_tensors:
                    dist.all_reduce(g)
                return gloo_tensors

            # warm-up, which is also the exactness check of every element of every result
            want = expected(t_count, e, size)
            checks = []
            first = torch.zeros(1, dtype=torch.float64)  # bps's first step of these names (slots, rounds made)
            for step in (bps_step, fused_step) + ((per_tensor_step,) if per_tensor else ()):
                if step is per_tensor_step:
                    restore()
                dist.barrier()
                t0 = time.perf_counter()
                got = step()
                if step is bps_step:
                    first[0] = time.perf_counter() - t0
                ok = len(got) == t_count and bool(np.array_equal(np.stack([np.asarray(g).reshape(-1) for g in got]),
                                                                 want))
                if not ok:
                    print(f"[many_tensors] rank {rank}: {step.__name__} T={t_count} E={e} is NOT the exact sum: "
                          f"{first_difference(got, want)}", file=sys.stderr, flush=True)
                checks.append(int(ok))
                del got
            checks += [1] * (3 - len(checks))
            flags = torch.tensor(checks, dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            dist.all_reduce(first, op=dist.ReduceOp.MAX)
            for _ in range(args.warmup - 1):
                bps_step()
                fused_step()
                if per_tensor:
                    restore()
                    per_tensor_step()

            bps_s, fused_s, per_s = [], [], []
            cpu.clear()  # the timed steps' only
            for _ in range(args.reps):
                dist.barrier()
                t0 = time.perf_counter()
                results = bps_step()
                bps_s.append(time.perf_counter() - t0)
                del results
                dist.barrier()
                t0 = time.perf_counter()
                results = fused_step()
                fused_s.append(time.perf_counter() - t0)
                del results
                if per_tensor:
                    restore()
                    dist.barrier()
                    t0 = time.perf_counter()
                    per_tensor_step()
                    per_s.append(time.perf_counter() - t0)
                else:
                    per_s.append(0.0)
            times = torch.tensor([bps_s, fused_s, per_s], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            cpu_us = torch.zeros((size, 3), dtype=torch.float64)  # this rank's row: median us per tensor
            cpu_us[rank] = torch.tensor([statistics.median(c) / t_count * 1e6 for c in zip(*cpu)])
            dist.all_reduce(cpu_us)
            row: dict[str, Any] = {
                "cpu_us_per_tensor": cpu_us.tolist(),
                "tensors": t_count, "elements": e, "bps_s": times[0].tolist(), "gloo_fused_s": times[1].tolist(),
                "bps_first_s": float(first[0]),
                "gloo_per_tensor_s": times[2].tolist() if per_tensor else None,
                "bps_exact": bool(flags[0]), "gloo_fused_exact": bool(flags[1]),
                "gloo_per_tensor_exact": bool(flags[2]) if per_tensor else None}
            rows.append(row)
            if rank == 0:
                per_text = (f"{statistics.median(row['gloo_per_tensor_s']) * 1e3:9.3f} ms" if per_tensor
                            else "  skipped")
                print(f"[many_tensors] T={t_count:>6} E={e:>6}: bps median {statistics.median(row['bps_s']) * 1e3:9.3f}"
                      f" ms, gloo fused {statistics.median(row['gloo_fused_s']) * 1e3:9.3f} ms, gloo per tensor "
                      f"{per_text}, exact: {bool(flags.min())}", file=sys.stderr, flush=True)
            save()
            if not bool(flags.min()):
                failed = True  # every rank saw the same flags: all stop here together
                break
            del arrays, gloo_tensors, want
            gc.collect()

        if not failed:
            n = args.single_bytes // 4
            name = f"many.single.{n}"
            x = inputs(1, n, rank)[0]
            xt = torch.from_numpy(x)
            t = xt.clone()
            want = expected(1, n, size)[0]
            alone = bps.push_pull(x, name, average=False)
            dist.all_reduce(t)
            flags = torch.tensor([int(np.array_equal(alone, want)), int(np.array_equal(t.numpy(), want))],
                                 dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            bps_l, gloo_l = [], []
            for _ in range(args.single_reps):
                t.copy_(xt)
                dist.barrier()
                t0 = time.perf_counter()
                bps.push_pull(x, name, average=False)
                bps_l.append(time.perf_counter() - t0)
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                gloo_l.append(time.perf_counter() - t0)
            # Back to back: the same calls without barriers between them (each still waits for its sum), as a
            # training loop issues them; the calls keep the ranks in step by themselves.
            bps_b2b: list[float] = []
            gloo_b2b: list[float] = []
            for durations, call in ((bps_b2b, lambda: bps.push_pull(x, name, average=False)),
                                    (gloo_b2b, lambda: dist.all_reduce(t))):
                dist.barrier()
                for _ in range(args.single_reps):
                    t0 = time.perf_counter()
                    call()
                    durations.append(time.perf_counter() - t0)
            times = torch.tensor([bps_l, gloo_l, bps_b2b, gloo_b2b], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            single = {"bytes": n * 4, "bps_s": times[0].tolist(), "gloo_s": times[1].tolist(),
                      "bps_b2b_s": times[2].tolist(), "gloo_b2b_s": times[3].tolist(),
                      "bps_exact": bool(flags[0]), "gloo_exact": bool(flags[1])}
            if rank == 0:
                print(f"[many_tensors] single {ppg.human(n * 4)}: bps p50 {percentile(single['bps_s'], 50) * 1e3:.3f}"
                      f" ms, gloo p50 {percentile(single['gloo_s'], 50) * 1e3:.3f} ms, exact: {bool(flags.min())}",
                      file=sys.stderr, flush=True)
            save()
            failed = not bool(flags.min())
        dist.barrier()
    finally:
        dist.destroy_process_group()
        bps.shutdown()
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------
def run_ranks(cluster: Any, command: list[str], timeout: float) -> int:
    """One rank process per training process, with a deadline (bps_worker.launch.run_training)."""
    from bps_worker.launch import run_training

    return run_training(cluster, command, timeout=timeout, env_defaults={"OMP_NUM_THREADS": "1"}, prog="many_tensors")


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values) * 1e3, min(values) * 1e3, max(values) * 1e3


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        bm, fm = statistics.median(row["bps_s"]), statistics.median(row["gloo_fused_s"])
        per = row["gloo_per_tensor_s"]
        pm = statistics.median(per) if per is not None else None
        ok = row["bps_exact"] and row["gloo_fused_exact"] and row["gloo_per_tensor_exact"] is not False
        out.append({"tensors": row["tensors"], "elements": row["elements"], "bps_ms": _spread(row["bps_s"]),
                    "bps_us_per_tensor": bm / row["tensors"] * 1e6, "fused_ms": _spread(row["gloo_fused_s"]),
                    "first_ms": row.get("bps_first_s", math.nan) * 1e3,
                    "per_ms": _spread(per) if per is not None else None, "bps_over_fused": bm / fm,
                    "per_over_bps": pm / bm if pm is not None else None, "ok": ok})
    return out


CPU_HEADER = ["tensors", "elements", "push_pull_async us", "synchronize us", "process us (all threads)"]


def cpu_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Per configuration, the client's CPU per tensor: the mean over ranks (min-max) of each rank's median over
    the timed steps; push_pull_async and synchronize in the calling thread, the process in all its threads."""
    out = []
    for row in rows:
        per_rank = row["cpu_us_per_tensor"]
        cells = []
        for k in range(3):
            values = [r[k] for r in per_rank]
            cells.append(f"{statistics.fmean(values):.1f} ({min(values):.1f}-{max(values):.1f})")
        out.append([str(row["tensors"]), str(row["elements"]), *cells])
    return out


HEADER = ["tensors", "elements", "bps ms (min-max)", "bps us/tensor", "bps first step ms", "gloo fused ms (min-max)",
          "gloo per-tensor ms (min-max)", "bps/gloo fused", "gloo per-tensor/bps", "exact"]
SINGLE_HEADER = ["bytes", "calls", "bps p50 ms", "bps p90 ms", "gloo p50 ms", "gloo p90 ms", "p50 bps/gloo",
                 "back to back: bps p50 ms", "gloo p50 ms", "exact"]


def _us(v: float) -> str:
    return f"{v:.2f}" if v < 10 else f"{v:.1f}"


def table_rows(summary: list[dict[str, Any]]) -> list[list[str]]:
    return [[str(s["tensors"]), str(s["elements"]), ppg._ms(s["bps_ms"]), _us(s["bps_us_per_tensor"]),
             f"{s['first_ms']:.1f}", ppg._ms(s["fused_ms"]),
             ppg._ms(s["per_ms"]) if s["per_ms"] is not None else "skipped",
             f"{s['bps_over_fused']:.2f}", f"{s['per_over_bps']:.2f}" if s["per_over_bps"] is not None else "skipped",
             "yes" if s["ok"] else "NO"]
            for s in summary]


def single_row(single: dict[str, Any]) -> list[str]:
    b, g = single["bps_s"], single["gloo_s"]
    return [ppg.human(single["bytes"]), str(len(b)), f"{percentile(b, 50) * 1e3:.3f}", f"{percentile(b, 90) * 1e3:.3f}",
            f"{percentile(g, 50) * 1e3:.3f}", f"{percentile(g, 90) * 1e3:.3f}",
            f"{percentile(b, 50) / percentile(g, 50):.2f}", f"{percentile(single['bps_b2b_s'], 50) * 1e3:.3f}",
            f"{percentile(single['gloo_b2b_s'], 50) * 1e3:.3f}",
            "yes" if single["bps_exact"] and single["gloo_exact"] else "NO"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default=None, help=f"comma list of tensor counts T per step (default {DEFAULT_TENSORS})")
    p.add_argument("--elements", default=None,
                   help=f"comma list of float32 elements E per tensor (default {DEFAULT_ELEMENTS})")
    p.add_argument("--reps", type=int, default=None, help="timed steps per configuration after the warm-up (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each system per configuration (default 1; "
                                                      "the first also checks every sum)")
    p.add_argument("--shuffle", action="store_true", help="every rank issues its tensors in its own fixed random order")
    p.add_argument("--group", action="store_true",
                   help="ours with one push_pull_group a step instead of push_pull_async on each, then synchronize")
    p.add_argument("--max-gloo-per-tensor", type=int, default=2000,
                   help="skip gloo's one all_reduce per tensor above this many tensors (default 2000)")
    p.add_argument("--single-bytes", type=ppg.parse_size, default=4096,
                   help="size of the one small push_pull issued alone (default 4096)")
    p.add_argument("--single-reps", type=int, default=None, help="calls of the small push_pull alone (default 200)")
    p.add_argument("--cpu-per-call", action="store_true",
                   help="also print the client's CPU time per tensor (push_pull_async, synchronize, the process)")
    p.add_argument("--client-timeout", type=float, default=120.0, help="bps.init(timeout=...) (default 120 s)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: tensors {QUICK_TENSORS}, elements {QUICK_ELEMENTS}, 2 reps, 20 single calls")
    ppg.add_common_arguments(p, json_help="also write the raw per-repetition times (max over ranks) here",
                             timeout=3600.0, op_timeout=600.0)
    args = p.parse_args(argv)
    args.tensors = args.tensors or (QUICK_TENSORS if args.quick else DEFAULT_TENSORS)
    args.elements = args.elements or (QUICK_ELEMENTS if args.quick else DEFAULT_ELEMENTS)
    args.reps = args.reps if args.reps is not None else (2 if args.quick else 5)
    args.single_reps = args.single_reps if args.single_reps is not None else (20 if args.quick else 200)
    if args.reps < 1 or args.warmup < 1 or args.single_reps < 1:
        p.error("--reps, --warmup and --single-reps must be at least 1")
    try:
        configs = configurations(args)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))

    if args.rank_program:
        return rank_program(args)

    sys.path.insert(0, str(REPO))
    from bps_worker.cluster_file import free_ports
    from bps_worker.supervise import Cluster, LaunchError
    from protocol.errors import ConfigError

    command_line = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    env_vars = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ppg.ENV_PREFIXES)}
    if env_vars:  # settings that change what is measured belong to the command
        command_line = shlex.join(f"{k}={v}" for k, v in env_vars.items()) + " " + command_line
    started = _dt.datetime.now().astimezone()
    info = machine("numpy", "torch")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bps-many-") as tmp:
        config = Path(args.config).resolve() if args.config else ppg.write_cluster_config(Path(tmp))
        result_file = Path(tmp) / "result.json"
        rank_cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-program", "--tensors", args.tensors,
                    "--elements", args.elements, "--reps", str(args.reps), "--warmup", str(args.warmup),
                    "--max-gloo-per-tensor", str(args.max_gloo_per_tensor), "--single-bytes", str(args.single_bytes),
                    "--single-reps", str(args.single_reps), "--client-timeout", str(args.client_timeout),
                    "--op-timeout", str(args.op_timeout), "--gloo-port", str(free_ports(1)[0]),
                    "--result-file", str(result_file)] + (["--shuffle"] if args.shuffle else []) \
            + (["--group"] if args.group else [])
        t0 = time.monotonic()
        try:
            with Cluster(str(config), log_level=args.log_level) as cluster:
                n = cluster.config.size
                code = run_ranks(cluster, rank_cmd, args.timeout)
        except (ConfigError, LaunchError) as exc:
            print(f"many_tensors: {exc}", file=sys.stderr)
            return 2
        elapsed = time.monotonic() - t0
        data = json.loads(result_file.read_text()) if result_file.exists() else None
    load_after = os.getloadavg()[0]
    if data is None:
        print("many_tensors: the rank programs failed", file=sys.stderr)
        return code or 1
    if args.json:
        Path(args.json).write_text(json.dumps({"date": started.isoformat(timespec="seconds"), "command": command_line,
                                               "machine": info, "ranks": n, "rows": data["rows"],
                                               "single": data["single"]}, indent=1) + "\n")
    summary = summarize(data["rows"])
    rows = table_rows(summary)
    single = data["single"]
    srows = [single_row(single)] if single is not None else []
    ok = (code == 0 and all(s["ok"] for s in summary) and len(summary) == len(configs) and single is not None
          and srows[0][-1] == "yes")
    cluster_text = cluster_line(cluster.config, n)
    machine_text = machine_line(info)
    runs_line = (f"{args.reps} timed steps per configuration after {args.warmup} warm-up; issue order "
                 f"{'shuffled per rank' if args.shuffle else 'the same on every rank'}; ours "
                 f"{'with one push_pull_group a step' if args.group else 'push_pull_async on each, then synchronize'}; "
                 f"gloo per tensor up to "
                 f"{args.max_gloo_per_tensor} tensors; time of a step = max over ranks; wall time {elapsed:.0f} s; "
                 f"1-minute load average {load_before:.1f} before, {load_after:.1f} after")
    single_line = (f"one push_pull alone: {args.single_reps} synchronous calls of {ppg.human(args.single_bytes)} on one "
                   f"name, each between barriers, against one gloo all_reduce of the same size; then as many of each "
                   f"back to back (no barriers)")
    goal = [s for s in summary if s["bps_over_fused"] > GOAL]
    goal_line = (f"goal bps / gloo fused <= {GOAL:g}: " + ("met in every configuration" if not goal else
                 "NOT met at " + ", ".join(f"T={s['tensors']} E={s['elements']} ({s['bps_over_fused']:.1f})"
                                           for s in goal)))
    print(f"date:    {started.isoformat(timespec='seconds')}")
    print(f"command: {command_line}")
    print(f"machine: {machine_text}")
    print(f"cluster: {cluster_text}")
    print(f"reps:    {runs_line}")
    print()
    print(text_table(HEADER, rows))
    print()
    print(goal_line)
    print()
    if single is None:
        single_line = "one push_pull alone: not measured (an earlier configuration failed)"
    print(single_line)
    if srows:
        print(text_table(SINGLE_HEADER, srows))
    if args.cpu_per_call:
        print()
        print("client CPU per tensor (thread_time of the calling thread; process_time of the whole rank), median over "
              "the timed steps, mean over ranks (min-max)" + (": with --group, push_pull_group's" if args.group else ""))
        print(text_table(CPU_HEADER, cpu_rows(data["rows"])))
    if not ok:
        print("\nERROR: a sum was not exact, or a configuration is missing (see above)", file=sys.stderr)

    if args.write_results or args.output:
        target = Path(args.output) if args.output else DEFAULT_RESULTS
        text = target.read_text() if target.exists() else ""
        if not text.strip():
            target.write_text(ppg.RESULTS_HEADER)
            text = ppg.RESULTS_HEADER
        section = [] if "## `many_tensors.py`" in text else [RESULTS_SECTION_HEADER.rstrip("\n")]
        section += [
            *section_head(started, "many small tensors per step, bps vs gloo (`many_tensors.py`)", command_line,
                          machine_text),
            f"- cluster: {cluster_text}" + ("" if args.config else " (generated, like `configs/local.toml`)"),
            f"- {runs_line}", f"- {goal_line}", "", markdown_table(HEADER, rows, left=2), "",
            f"- {single_line}", "", *([markdown_table(SINGLE_HEADER, srows, left=1), ""] if srows else []),
        ]
        append_section(target, section)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
