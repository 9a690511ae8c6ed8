"""Training throughput: bps.DistributedOptimizer against torch DDP (gloo), in the same processes, alternating.

    .venv/bin/python benchmarks/train_vs_ddp.py                  # both models, 7 blocks x 20 steps, print tables
    .venv/bin/python benchmarks/train_vs_ddp.py --quick          # tiny batches, 2 blocks x 3 steps (smoke test)
    .venv/bin/python benchmarks/train_vs_ddp.py --write-results  # also append to benchmarks/RESULTS.md

The driver starts a private cluster shaped like configs/local.toml (2 workers x 2 processes, one colocated
server per worker plus one CPU-only server, 4 MiB partitions; see push_pull_vs_gloo.py) and runs this file
with ``--rank-program`` once per rank. Every rank is a bps client *and* a member of one gloo group.

Models: the CNN of examples/train_digits.py (conv 1->c1, conv c1->c2, 2x2 max-pool, fc c2*16->hidden,
fc hidden->10; ReLUs) on synthetic 8x8 inputs (random normal, random labels; a pool of 4 batches per rank,
step k uses batch k mod 4, so every system sees the same data in the same order):

- ``example``: the example's own widths (16, 32, 64): 38,282 parameters (150 KiB of gradients), batch 32 per
  process, as in the demo. Its gradients are small: this is the latency-bound case.
- ``wide``: widths (32, 64, 1024): 1,078,666 parameters (4.1 MiB of gradients, 97% in fc1), batch 128 per
  process, so that communication is a sizeable part of a step.

Four systems, each with its own copy of the model (same initial weights, SGD lr 0.01 momentum 0.9):

- ``bps``: ``bps.DistributedOptimizer`` (push_pull of each gradient started from its post-accumulate-grad hook
  during backward, front layers first); the loop calls ``synchronize()`` and then ``step()`` inside
  ``skip_synchronize()`` so the wait can be timed ("step sync"), which is what ``step()`` does by itself.
- ``ddp``: ``DistributedDataParallel`` with the gloo backend, default settings (25 MiB buckets, 1 MiB first
  bucket); its all-reduces overlap backward and ``backward()`` returns when they are done.
- ``bps after bwd``: a plain model; after backward, a blocking push_pull of all gradients (all started with
  the DistributedOptimizer's priorities, then all waited for); no overlap.
- ``gloo after bwd``: a plain model; after backward, one blocking gloo all_reduce of all gradients flattened
  into one buffer (then / N and copied back); no overlap.

Per model: ``warmup`` untimed steps of each system, then ``blocks`` rounds of ``barrier; S steps bps;
barrier; S steps ddp; barrier; S steps bps-after; barrier; S steps gloo-after`` (A B C D A B C D ...).
samples/s of a block = N * batch * S / (the slowest rank's wall time of the block); reported is the median
(min-max) over blocks; ratio = median bps / median ddp (> 1: bps is faster).

Hidden communication (per block, from the per-step means averaged over ranks, then median (min-max) over
blocks)::

    total_comm   = time of the blocking all-gradients collective after backward (bps after bwd / gloo after bwd)
    exposed_comm = (backward + step sync) of the overlapping system - backward of the plain model
    hidden       = 1 - exposed_comm / total_comm

For bps, "backward" includes starting the pushes from the hooks (copies into shared memory, sends; timed
separately by wrapping the client connection's start methods in the rank processes). For DDP the whole wait is
inside ``backward()``. Every synchronization (bps step sync, both "after bwd" collectives) is also split at the
moment the last rank finished its backward (one CLOCK_MONOTONIC per box): before it, waiting for the slowest
rank; after it, "(after last bwd)".
A negative ``hidden`` means the overlapping system spends more time on communication than the blocking one.
Correctness: after the warm-up every system's weights must agree with DDP's (max |difference| / max |weight|
<= 1e-4: the sums are only rounded differently) and at the end the bps replicas must be identical across
ranks; else exit status 1. The difference at the end is reported too: rounding differences grow with every
step (SGD with momentum on random labels), to about 3e-4 after 150 steps of the wide model.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import push_pull_vs_gloo as bench  # noqa: E402  (cluster file, free ports)
from report import (append_section, cluster_line, machine, machine_line, markdown_table, section_head,  # noqa: E402
                    text_table)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = REPO / "benchmarks" / "RESULTS.md"
PROG = "train_vs_ddp"

# name: (conv1 channels, conv2 channels, fc1 width, batch per process)
MODELS: dict[str, tuple[int, int, int, int]] = {"example": (16, 32, 64, 32), "wide": (32, 64, 1024, 128)}
QUICK_BATCH = 8
SYSTEMS = ("bps", "ddp", "bps_after", "gloo_after")
SYSTEM_LABEL = {"bps": "bps DistributedOptimizer", "ddp": "DDP (gloo)", "bps_after": "bps after bwd",
                "gloo_after": "gloo after bwd"}
# per-step quantities measured in every block (seconds, summed over the block's steps, then / steps)
FIELDS = ("wall", "forward", "backward", "push_start", "sync", "tail", "update", "comm")
POOL = 4
SEED = 1234
LR, MOMENTUM = 0.01, 0.9
AGREE_RTOL = 1e-4  # after the warm-up; later, rounding differences grow with every step

SECTION_INTRO = """
## `train_vs_ddp.py`
Training steps of the CNN of `examples/train_digits.py` with `bps.DistributedOptimizer` against
`torch.nn.parallel.DistributedDataParallel` (gloo backend, default buckets), both in the same 4 rank processes
(each a bps client and a gloo group member) of a cluster shaped like `configs/local.toml`. Synthetic 8x8
inputs; models `example` (the demo's widths, 150 KiB of gradients, batch 32 per process) and `wide` (widths
32/64/1024, 4.1 MiB of gradients, batch 128 per process). Besides the two overlapping systems, two plain
models synchronize after backward (blocking bps push_pull / one flat gloo all_reduce of all gradients); blocks
of `S` steps alternate bps, ddp, bps after bwd, gloo after bwd. samples/s of a block = N x batch x S / slowest
rank's block time; median (min-max) over blocks. `hidden = 1 - exposed_comm / total_comm` with `total_comm` =
the blocking collective after backward and `exposed_comm` = (backward + step sync) of the overlapping system -
backward of the plain model; per block, median (min-max) over blocks. Phase times: per step, mean over ranks,
median over blocks. SGD (lr 0.01, momentum 0.9); `torch.set_num_threads(1)` in every rank.
"""


# --------------------------------------------------------------------------------------------------------------
# rank program
# --------------------------------------------------------------------------------------------------------------
def make_model(c1: int, c2: int, hidden: int):  # -> torch.nn.Module
    """examples/train_digits.py's DigitsCNN with configurable widths ((16, 32, 64) is the example's)."""
    import torch.nn.functional as F
    from torch import nn

    class CNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, c1, kernel_size=3, padding=1)
            self.conv2 = nn.Conv2d(c1, c2, kernel_size=3, padding=1)
            self.fc1 = nn.Linear(c2 * 4 * 4, hidden)
            self.fc2 = nn.Linear(hidden, 10)

        def forward(self, x):
            x = F.relu(self.conv1(x))
            x = F.max_pool2d(F.relu(self.conv2(x)), 2)
            x = F.relu(self.fc1(x.flatten(1)))
            return self.fc2(x)

    return CNN()


class Probe:
    """Times, in this process, the starts of bps operations (copy into shared memory, send of the request).

    It wraps the start methods of ``bps_worker.client.operations.Operations`` (``start`` and ``start_filled``),
    so it sees the pushes of the DistributedOptimizer's hooks whichever one they use.
    """

    def __init__(self) -> None:
        from bps_worker.client.operations import Operations

        self.start = 0.0
        self._depth = 0  # one may call the other (start -> start_filled): time the outermost call only
        for method in ("start", "start_filled"):
            original = getattr(Operations, method, None)
            if original is not None:
                setattr(Operations, method, self._timed(original))

    def _timed(self, original):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.start += time.perf_counter() - t0
        return timed


def run_model(name: str, args: argparse.Namespace, probe: Probe, rank: int, size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bps_worker.torch as bps

    c1, c2, hidden, batch = MODELS[name]
    if args.quick:
        batch = QUICK_BATCH
    torch.manual_seed(SEED)
    models = {s: make_model(c1, c2, hidden) for s in SYSTEMS}
    bps.broadcast_parameters(models["bps"].state_dict(), root_rank=0)
    for s in SYSTEMS[1:]:
        models[s].load_state_dict(models["bps"].state_dict())
    ddp = DDP(models["ddp"])
    opts: dict[str, Any] = {s: torch.optim.SGD(models[s].parameters(), lr=LR, momentum=MOMENTUM) for s in SYSTEMS}
    opts["bps"] = bps.DistributedOptimizer(opts["bps"], named_parameters=models["bps"].named_parameters())
    bps.broadcast_optimizer_state(opts["bps"], 0)
    n_params = sum(p.numel() for p in models["bps"].parameters())

    gen = torch.Generator().manual_seed(SEED + 1 + rank)
    pool = [(torch.randn(batch, 1, 8, 8, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
            for _ in range(POOL)]
    after_params = {s: list(models[s].named_parameters()) for s in ("bps_after", "gloo_after")}
    counters = {s: 0 for s in SYSTEMS}
    pc = time.perf_counter

    def one_step(system: str, acc: dict[str, float]) -> None:
        x, y = pool[counters[system] % POOL]
        counters[system] += 1
        opt = opts[system]
        net = ddp if system == "ddp" else models[system]
        t0 = pc()
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        t1 = pc()
        start0 = probe.start
        loss.backward()
        t2 = pc()
        acc["push_start"] += probe.start - start0
        if system == "bps":
            opt.synchronize()
            t3 = pc()
            acc["sync"] += t3 - t2
            with opt.skip_synchronize():
                opt.step()
        elif system == "bps_after":
            handles = [bps.push_pull_async(p.grad, f"after.{n}", average=True, priority=-i, out=p.grad)
                       for i, (n, p) in enumerate(after_params[system])]
            for h in handles:
                bps.synchronize(h)
            t3 = pc()
            acc["comm"] += t3 - t2
            opt.step()
        elif system == "gloo_after":
            grads = [p.grad for _, p in after_params[system]]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= size
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
            t3 = pc()
            acc["comm"] += t3 - t2
            opt.step()
        else:  # ddp: the all-reduces finished inside backward()
            t3 = t2
            opt.step()
        t4 = pc()
        marks.append((t2, t3))
        acc["forward"] += t1 - t0
        acc["backward"] += t2 - t1
        acc["update"] += t4 - t3

    marks: list[tuple[float, float]] = []  # (end of backward, end of the synchronization) of every step

    def block(system: str, steps: int) -> list[float]:
        acc = dict.fromkeys(FIELDS, 0.0)
        marks.clear()
        dist.barrier()
        t0 = pc()
        for _ in range(steps):
            one_step(system, acc)
        acc["wall"] = pc() - t0
        # tail: from the end of the last rank's backward to the end of this rank's synchronization (the rest of
        # the synchronization is waiting for the slowest rank); perf_counter is CLOCK_MONOTONIC, one clock per box
        times = torch.tensor(marks, dtype=torch.float64).reshape(-1, 2)
        last = times[:, 0].clone()
        dist.all_reduce(last, op=dist.ReduceOp.MAX)
        acc["tail"] = float((times[:, 1] - last).sum())
        return [acc[f] / steps for f in FIELDS]

    # correctness: every system's weights against DDP's (relative to the largest weight), max over ranks
    def flat(system: str):
        return torch.cat([p.detach().reshape(-1) for p in models[system].parameters()])

    def diffs_vs_ddp() -> dict[str, float]:
        ref = flat("ddp")
        scale = float(ref.abs().max())
        diffs = torch.tensor([float((flat(s) - ref).abs().max()) / scale for s in SYSTEMS], dtype=torch.float64)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        return {s: float(diffs[i]) for i, s in enumerate(SYSTEMS)}

    for system in SYSTEMS:
        block(system, args.warmup)
    warm_diff = diffs_vs_ddp()
    gc.collect()
    measured = torch.zeros(len(SYSTEMS), args.blocks, len(FIELDS), dtype=torch.float64)
    for b in range(args.blocks):
        for i, system in enumerate(SYSTEMS):
            measured[i, b] = torch.tensor(block(system, args.steps), dtype=torch.float64)
    slowest = measured.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    mean = measured.clone()
    dist.all_reduce(mean, op=dist.ReduceOp.SUM)
    mean /= size

    end_diff = diffs_vs_ddp()
    hi, lo = flat("bps").clone(), flat("bps").clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    identical = bool(torch.equal(hi, lo))
    return {"model": name, "widths": [c1, c2, hidden], "batch": batch, "params": n_params, "ranks": size,
            "steps": args.steps, "blocks": args.blocks, "warmup": args.warmup,
            "slowest": {s: slowest[i].tolist() for i, s in enumerate(SYSTEMS)},
            "mean": {s: mean[i].tolist() for i, s in enumerate(SYSTEMS)},
            "rel_diff_vs_ddp_after_warmup": warm_diff, "rel_diff_vs_ddp_at_end": end_diff,
            "bps_replicas_identical": identical}


def run_models(args: argparse.Namespace, run_one: Callable[[str, int, int], dict[str, Any]],
               report: Callable[[dict[str, Any]], None] | None = None) -> int:
    """A training benchmark's rank program (this one's and ddp_hook_vs_gloo.py's): join bps and the gloo group,
    ``run_one(model, rank, size)`` for each model; rank 0 reports each and writes the results so far."""
    import torch.distributed as dist

    import bps_worker.torch as bps

    rank, size = bench.join_both(args, bps)
    results = []
    try:
        for name in args.models.split(","):
            results.append(run_one(name, rank, size))
            if rank == 0:
                if report is not None:
                    report(results[-1])
                Path(args.result_file).write_text(json.dumps({"size": size, "models": results}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
        bps.shutdown()
    return 0


def _report_step_ms(r: dict[str, Any]) -> None:
    med = {s: statistics.median(r["slowest"][s][b][0] for b in range(r["blocks"])) for s in SYSTEMS}
    print(f"[bench] {r['model']}: step ms " + ", ".join(f"{s} {med[s] * 1e3:.2f}" for s in SYSTEMS),
          file=sys.stderr, flush=True)


def rank_program(args: argparse.Namespace) -> int:
    probe = Probe()
    return run_models(args, lambda name, rank, size: run_model(name, args, probe, rank, size), _report_step_ms)


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------
def run_ranks(cluster: Any, command: list[str], timeout: float) -> int:
    """One rank process per training process, with a deadline (bps_worker.launch.run_training)."""
    from bps_worker.launch import run_training

    return run_training(cluster, command, timeout=timeout, env_defaults={"OMP_NUM_THREADS": "1"}, prog=PROG)


def _stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    """Per model: samples/s per system, phase medians, hidden fractions (all from the per-block numbers)."""
    n, blocks = r["ranks"], r["blocks"]
    f = {name: i for i, name in enumerate(FIELDS)}

    def slow(system: str, field: str) -> list[float]:
        return [r["slowest"][system][b][f[field]] for b in range(blocks)]

    def mean(system: str, field: str) -> list[float]:
        return [r["mean"][system][b][f[field]] for b in range(blocks)]

    out: dict[str, Any] = {"model": r["model"], "params": r["params"], "batch": r["batch"],
                           "grad_mib": r["params"] * 4 / 2**20}
    out["samples"] = {s: _stats([n * r["batch"] / w for w in slow(s, "wall")]) for s in SYSTEMS}
    out["ratio"] = out["samples"]["bps"][0] / out["samples"]["ddp"][0]
    out["phases"] = {s: {field: statistics.median(mean(s, field)) for field in FIELDS} for s in SYSTEMS}
    for s in SYSTEMS:
        out["phases"][s]["wall"] = statistics.median(slow(s, "wall"))  # a step of the slowest rank
    hidden = {}
    for system, plain in (("bps", "bps_after"), ("ddp", "gloo_after")):
        values = []
        for b in range(blocks):
            exposed = mean(system, "backward")[b] + mean(system, "sync")[b] - mean(plain, "backward")[b]
            total = mean(plain, "comm")[b]
            values.append(1 - exposed / total if total > 0 else float("nan"))
        hidden[system] = _stats(values)
        ph = out["phases"]
        out.setdefault("exposed", {})[system] = (ph[system]["backward"] + ph[system]["sync"]
                                                 - ph[plain]["backward"])
    out["hidden"] = hidden
    out["warm_diff"] = max(r["rel_diff_vs_ddp_after_warmup"].values())
    out["end_diff"] = max(r["rel_diff_vs_ddp_at_end"].values())
    out["ok"] = out["warm_diff"] <= AGREE_RTOL and r["bps_replicas_identical"]
    out["identical"] = r["bps_replicas_identical"]
    return out


HEADER = ["model", "grad MiB", "batch/proc", "bps samples/s (min-max)", "ddp samples/s (min-max)",
          "ratio bps/ddp", "bps after bwd samples/s", "gloo after bwd samples/s", "weights vs ddp (warm-up, end)"]
PHASE_HEADER = ["model", "system", "forward", "backward", "(push starts)", "step sync", "(after last bwd)",
                "update", "step (slowest)", "plain backward", "comm after bwd", "(after last bwd)", "exposed comm",
                "hidden (min-max)"]


def _rate(t: tuple[float, float, float]) -> str:
    return f"{t[0]:.0f} ({t[1]:.0f}-{t[2]:.0f})"


def _ms(v: float) -> str:
    return f"{v * 1e3:.2f}"


def table_rows(summaries: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for s in summaries:
        sm = s["samples"]
        rows.append([s["model"], f"{s['grad_mib']:.3f}", str(s["batch"]), _rate(sm["bps"]), _rate(sm["ddp"]),
                     f"{s['ratio']:.2f}", _rate(sm["bps_after"]), _rate(sm["gloo_after"]),
                     ("yes" if s["ok"] else "NO") + f" ({s['warm_diff']:.0e}, {s['end_diff']:.0e})"])
    return rows


def phase_rows(summaries: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for s in summaries:
        ph = s["phases"]
        for system, plain in (("bps", "bps_after"), ("ddp", "gloo_after")):
            p = ph[system]
            h = s["hidden"][system]
            only_bps = [_ms(p[f]) if system == "bps" else "-" for f in ("push_start", "sync", "tail")]
            rows.append([s["model"], system, _ms(p["forward"]), _ms(p["backward"]), *only_bps,
                         _ms(p["update"]), _ms(p["wall"]), _ms(ph[plain]["backward"]), _ms(ph[plain]["comm"]),
                         _ms(ph[plain]["tail"]), _ms(s["exposed"][system]),
                         f"{h[0]:.0%} ({h[1]:.0%} to {h[2]:.0%})"])
    return rows


PHASE_NOTE = (
    "ms per step (mean over ranks, median over blocks). step (slowest) = slowest rank's block time / S. "
    "(push starts) = time in the hooks' starts of push_pulls during backward (copy into shared memory, send). "
    "(after last bwd) = from the end of the last rank's backward to the end of this rank's synchronization (the "
    "rest of the synchronization is waiting for the slowest rank). plain backward, comm after bwd: from the "
    "bps after bwd / gloo after bwd blocks. exposed comm = backward + step sync - plain backward; "
    "hidden = 1 - exposed comm / comm after bwd, per block, median (min-max).")


def parse_training_arguments(description: str, argv: list[str] | None, timeout: float) -> argparse.Namespace:
    """The command line of the training benchmarks (this one and ddp_hook_vs_gloo.py), checked."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)} "
                                                                f"(default: all)")
    p.add_argument("--blocks", type=int, default=None, help="timed blocks per system (default 7; --quick 2)")
    p.add_argument("--steps", type=int, default=None, help="steps per block (default 20; --quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per system first (default 10; --quick 2)")
    p.add_argument("--quick", action="store_true", help=f"smoke test: batch {QUICK_BATCH}, 2 blocks of 3 steps")
    bench.add_common_arguments(p, json_help="also write the raw per-block numbers here", timeout=timeout,
                               op_timeout=300.0)
    args = p.parse_args(argv)
    args.blocks = args.blocks if args.blocks is not None else (2 if args.quick else 7)
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    if args.blocks < 1 or args.steps < 1 or args.warmup < 1:
        p.error("--blocks, --steps and --warmup must be at least 1")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if not models or unknown:
        p.error(f"--models: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(MODELS)}")
    args.models = ",".join(models)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_training_arguments(__doc__.split("\n\n")[0], argv, timeout=900.0)
    models = args.models.split(",")
    if args.rank_program:
        return rank_program(args)

    sys.path.insert(0, str(REPO))
    from bps_worker.cluster_file import free_ports
    from bps_worker.supervise import Cluster, LaunchError
    from protocol.errors import ConfigError

    command_line = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    env_vars = {k: v for k, v in sorted(os.environ.items()) if k.startswith(bench.ENV_PREFIXES)}
    if env_vars:
        command_line = shlex.join(f"{k}={v}" for k, v in env_vars.items()) + " " + command_line
    started = _dt.datetime.now().astimezone()
    info = machine("numpy", "torch")
    with tempfile.TemporaryDirectory(prefix="bps-bench-") as tmp:
        config = Path(args.config).resolve() if args.config else bench.write_cluster_config(Path(tmp))
        result_file = Path(tmp) / "result.json"
        rank_cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-program", "--models", args.models,
                    "--blocks", str(args.blocks), "--steps", str(args.steps), "--warmup", str(args.warmup),
                    "--gloo-port", str(free_ports(1)[0]), "--result-file", str(result_file)]
        if args.quick:
            rank_cmd.append("--quick")
        t0 = time.monotonic()
        try:
            with Cluster(str(config), log_level=args.log_level) as cluster:
                code = run_ranks(cluster, rank_cmd, args.timeout)
        except (ConfigError, LaunchError) as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
        elapsed = time.monotonic() - t0
        if code != 0 or not result_file.exists():
            print(f"{PROG}: the rank programs failed", file=sys.stderr)
            return code or 1
        data = json.loads(result_file.read_text())
    if args.json:
        Path(args.json).write_text(json.dumps({"date": started.isoformat(timespec="seconds"), "command": command_line,
                                               "machine": info, **data}, indent=1) + "\n")
    summaries = [summarize(r) for r in data["models"]]
    rows, prows = table_rows(summaries), phase_rows(summaries)
    ok = all(s["ok"] for s in summaries) and len(summaries) == len(models)
    n = data["size"]
    cluster_text = cluster_line(cluster.config, n)
    machine_text = machine_line(info)
    model_line = "; ".join(f"{m}: widths {MODELS[m][:3]}, {s['params']:,} parameters, batch {s['batch']}/process"
                           for m, s in zip(models, summaries))
    blocks_line = (f"{args.blocks} blocks x {args.steps} steps per system after {args.warmup} warm-up steps, "
                   f"alternating bps, ddp, bps after bwd, gloo after bwd; wall time {elapsed:.0f} s")
    print(f"date:    {started.isoformat(timespec='seconds')}")
    print(f"command: {command_line}")
    print(f"machine: {machine_text}")
    print(f"cluster: {cluster_text}")
    print(f"models:  {model_line}")
    print(f"blocks:  {blocks_line}")
    print()
    print("samples/s = N x batch x steps / slowest rank's block time; median (min-max) over blocks; "
          "ratio > 1: bps is faster")
    print(text_table(HEADER, rows))
    print()
    print(PHASE_NOTE)
    print(text_table(PHASE_HEADER, prows))
    if not ok:
        print(f"\nERROR: after the warm-up the weights differ from DDP's by more than {AGREE_RTOL:g} (relative) "
              f"or the bps replicas are not identical across ranks", file=sys.stderr)

    if args.write_results or args.output:
        target = Path(args.output) if args.output else DEFAULT_RESULTS
        if not target.exists() or not target.read_text().strip():
            target.write_text(bench.RESULTS_HEADER)
        text = target.read_text()
        parts = []
        if "## `train_vs_ddp.py`" not in text:
            parts.append(SECTION_INTRO)
        parts += [
            *section_head(started, "training, bps DistributedOptimizer vs DDP (gloo)", command_line, machine_text),
            f"- cluster: {cluster_text}" + ("" if args.config else " (generated, like `configs/local.toml`)"),
            f"- models: {model_line}",
            f"- {blocks_line}",
            "", markdown_table(HEADER, rows, left=1), "",
            PHASE_NOTE.rstrip(".") + ":", "", markdown_table(PHASE_HEADER, prows, left=1), "",
        ]
        append_section(target, ([""] if not text.endswith("\n") else []) + parts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
