"""Training throughput: DDP with ``bps.ddp_comm_hook`` against DDP's own gloo all-reduce, in the same processes.

    .venv/bin/python benchmarks/ddp_hook_vs_gloo.py                  # both models, 7 blocks x 20 steps
    .venv/bin/python benchmarks/ddp_hook_vs_gloo.py --quick          # tiny batches, 2 blocks x 3 steps (smoke test)
    .venv/bin/python benchmarks/ddp_hook_vs_gloo.py --write-results  # also append to benchmarks/RESULTS.md

The driver starts a private cluster shaped like configs/local.toml (2 workers x 2 processes, one colocated
server per worker plus one CPU-only server, 4 MiB partitions) and runs this file with ``--rank-program`` once
per rank; every rank is a bps client and a member of one gloo group. The models and data are
train_vs_ddp.py's (``example``: the demo's CNN, 150 KiB of gradients, batch 32; ``wide``: 4.1 MiB, batch 128).

Two DDP wrappers (default settings: 25 MiB buckets, the first one 1 MiB) of the same initial model, SGD (lr
0.01, momentum 0.9): ``hook`` with ``register_comm_hook(state=..., hook=bps.ddp_comm_hook)``, ``gloo`` with
DDP's default all-reduce hook. ``warmup`` untimed steps of each, then ``blocks`` rounds of ``barrier; S steps
hook; barrier; S steps gloo``. samples/s of a block = N x batch x S / the slowest rank's block time; reported
is the median (min-max) over blocks; ratio = median hook / median gloo (> 1: the hook is faster). The weights
of both are compared after the warm-up (they took the same steps on the same data).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import push_pull_vs_gloo as bench  # noqa: E402  (cluster file, gloo group, common options)
import train_vs_ddp as tvd  # noqa: E402  (models and data)
from report import (append_section, cluster_line, machine, machine_line, markdown_table, section_head,  # noqa: E402
                    text_table)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = REPO / "benchmarks" / "RESULTS.md"
PROG = "ddp_hook_vs_gloo"
SYSTEMS = ("hook", "gloo")
AGREE_RTOL = 1e-5  # hook vs gloo after the warm-up, relative to the largest weight

SECTION_INTRO = """
## `ddp_hook_vs_gloo.py` (issue 18: the DDP drop-in)
DDP with `bps.ddp_comm_hook` against DDP's own gloo all-reduce: two DDP wrappers (default buckets) of the same
initial model in the same 4 rank processes (each a bps client and a gloo group member) of a cluster shaped like
`configs/local.toml`; `train_vs_ddp.py`'s models and synthetic data. Blocks of `S` steps alternate hook, gloo;
samples/s of a block = N x batch x S / slowest rank's block time; median (min-max) over blocks; ratio =
hook / gloo. SGD (lr 0.01, momentum 0.9); `torch.set_num_threads(1)` in every rank.
"""


# --------------------------------------------------------------------------------------------------------------
# rank program
# --------------------------------------------------------------------------------------------------------------
def _wrappers(name: str, batch: int, rank: int) -> tuple[dict[str, Any], list[Any], int]:
    """The two DDP wrappers of one initial model with their optimizers, this rank's data pool, the parameters."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bps_worker.torch as bps

    c1, c2, hidden, _ = tvd.MODELS[name]
    torch.manual_seed(tvd.SEED)
    initial = tvd.make_model(c1, c2, hidden)
    nets = {}
    for system in SYSTEMS:
        net = DDP(copy.deepcopy(initial))
        if system == "hook":
            net.register_comm_hook(state=f"bench.{name}", hook=bps.ddp_comm_hook)
        nets[system] = (net, torch.optim.SGD(net.parameters(), lr=tvd.LR, momentum=tvd.MOMENTUM))
    gen = torch.Generator().manual_seed(tvd.SEED + 1 + rank)
    pool = [(torch.randn(batch, 1, 8, 8, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
            for _ in range(tvd.POOL)]
    return nets, pool, sum(p.numel() for p in initial.parameters())


def run_model(name: str, args: argparse.Namespace, rank: int, size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    batch = tvd.QUICK_BATCH if args.quick else tvd.MODELS[name][3]
    nets, pool, n_params = _wrappers(name, batch, rank)
    steps_done = dict.fromkeys(SYSTEMS, 0)

    def block(system: str, steps: int) -> float:
        net, opt = nets[system]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            x, y = pool[steps_done[system] % tvd.POOL]
            steps_done[system] += 1
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        return time.perf_counter() - t0

    def flat(system: str) -> Any:
        return torch.cat([p.detach().reshape(-1) for p in nets[system][0].parameters()])

    def rel_diff() -> float:
        ref = flat("gloo")
        diff = torch.tensor([float((flat("hook") - ref).abs().max()) / float(ref.abs().max())], dtype=torch.float64)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        return float(diff[0])

    for system in SYSTEMS:
        block(system, args.warmup)
    warm_diff = rel_diff()
    walls = torch.tensor([[block(s, args.steps) for s in SYSTEMS] for _ in range(args.blocks)], dtype=torch.float64)
    dist.all_reduce(walls, op=dist.ReduceOp.MAX)
    hi, lo = flat("hook").clone(), flat("hook").clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return {"model": name, "batch": batch, "params": n_params, "ranks": size, "steps": args.steps,
            "slowest": {s: walls[:, i].tolist() for i, s in enumerate(SYSTEMS)}, "warm_diff": warm_diff,
            "end_diff": rel_diff(), "identical": bool(torch.equal(hi, lo))}


def rank_program(args: argparse.Namespace) -> int:
    return tvd.run_models(args, lambda name, rank, size: run_model(name, args, rank, size))


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------
HEADER = ["model", "grad MiB", "batch/proc", "hook samples/s (min-max)", "gloo samples/s (min-max)",
          "ratio hook/gloo", "weights vs gloo (warm-up, end)"]


def table_rows(data: dict[str, Any]) -> tuple[list[list[str]], bool]:
    """The table's rows, and whether every model's hook agreed with gloo (and its replicas with each other)."""
    rows, ok = [], True
    for r in data["models"]:
        rates = {s: [r["ranks"] * r["batch"] * r["steps"] / w for w in r["slowest"][s]] for s in SYSTEMS}
        med = {s: statistics.median(v) for s, v in rates.items()}
        agree = r["warm_diff"] <= AGREE_RTOL and r["identical"]
        ok &= agree
        rows.append([r["model"], f"{r['params'] * 4 / 2**20:.3f}", str(r["batch"]),
                     *(f"{med[s]:.0f} ({min(rates[s]):.0f}-{max(rates[s]):.0f})" for s in SYSTEMS),
                     f"{med['hook'] / med['gloo']:.2f}",
                     ("yes" if agree else "NO") + f" ({r['warm_diff']:.0e}, {r['end_diff']:.0e})"])
    return rows, ok and len(data["models"]) > 0


def _run_cluster(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any] | None, Any, float, int]:
    """Start the cluster and the ranks; (the ranks' results or None, the cluster's config, seconds, status)."""
    from bps_worker.cluster_file import free_ports
    from bps_worker.launch import run_training
    from bps_worker.supervise import Cluster, LaunchError
    from protocol.errors import ConfigError

    config = Path(args.config).resolve() if args.config else bench.write_cluster_config(tmp)
    result_file = tmp / "result.json"
    rank_cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-program", "--models", args.models,
                "--blocks", str(args.blocks), "--steps", str(args.steps), "--warmup", str(args.warmup),
                "--gloo-port", str(free_ports(1)[0]), "--result-file", str(result_file)] + (["--quick"] * args.quick)
    t0 = time.monotonic()
    try:
        with Cluster(str(config), log_level=args.log_level) as cluster:
            code = run_training(cluster, rank_cmd, timeout=args.timeout, env_defaults={"OMP_NUM_THREADS": "1"},
                                prog=PROG)
    except (ConfigError, LaunchError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return None, None, 0.0, 2
    if code != 0 or not result_file.exists():
        print(f"{PROG}: the rank programs failed", file=sys.stderr)
        return None, cluster.config, 0.0, code or 1
    return json.loads(result_file.read_text()), cluster.config, time.monotonic() - t0, 0


def main(argv: list[str] | None = None) -> int:
    args = tvd.parse_training_arguments(__doc__.split("\n\n")[0], argv, timeout=600.0)
    if args.rank_program:
        return rank_program(args)
    sys.path.insert(0, str(REPO))
    command_line = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    env_vars = {k: v for k, v in sorted(os.environ.items()) if k.startswith(bench.ENV_PREFIXES)}
    if env_vars:  # the settings that change what was measured
        command_line = shlex.join(f"{k}={v}" for k, v in env_vars.items()) + " " + command_line
    started = _dt.datetime.now().astimezone()
    info = machine("numpy", "torch")
    with tempfile.TemporaryDirectory(prefix="bps-bench-") as tmp:
        data, config, elapsed, code = _run_cluster(args, Path(tmp))
    if data is None:
        return code
    if args.json:
        Path(args.json).write_text(json.dumps({"date": started.isoformat(timespec="seconds"), "command": command_line,
                                               "machine": info, **data}, indent=1) + "\n")
    rows, ok = table_rows(data)
    lines = {"cluster": cluster_line(config, data["size"]), "machine": machine_line(info),
             "blocks": f"{args.blocks} blocks x {args.steps} steps per system after {args.warmup} warm-up steps, "
                       f"alternating hook, gloo; wall time {elapsed:.0f} s"}
    print(f"date:    {started.isoformat(timespec='seconds')}\ncommand: {command_line}")
    print("\n".join(f"{k + ':':8} {v}" for k, v in lines.items()) + "\n")
    print("samples/s = N x batch x steps / slowest rank's block time; median (min-max) over blocks; "
          "ratio > 1: the hook is faster")
    print(text_table(HEADER, rows))
    if not ok:
        print(f"\nERROR: after the warm-up the hook's weights differ from gloo's by more than {AGREE_RTOL:g} "
              f"(relative), or its replicas differ between ranks", file=sys.stderr)
    if args.write_results or args.output:
        target = Path(args.output) if args.output else DEFAULT_RESULTS
        text = target.read_text() if target.exists() else ""
        parts = [] if "## `ddp_hook_vs_gloo.py`" in text else [SECTION_INTRO]
        parts += [*section_head(started, "DDP with bps.ddp_comm_hook vs DDP (gloo)", command_line, lines["machine"]),
                  f"- cluster: {lines['cluster']}" + ("" if args.config else " (generated, like `configs/local.toml`)"),
                  f"- {lines['blocks']}", "", markdown_table(HEADER, rows, left=1), ""]
        append_section(target, ([""] if text and not text.endswith("\n") else []) + parts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
