"""Where the CPU goes: user and system CPU-seconds (and minor page faults) per operation of every process,
bps push_pull vs gloo.

    .venv/bin/python benchmarks/cpu_split.py              # 256M, 5 operations of each
    .venv/bin/python benchmarks/cpu_split.py --size 64M --ops 3

Same cluster and rank setup as push_pull_vs_gloo.py (2 workers x 2 processes, 2 colocated + 1 CPU-only
server). After one warm-up of each, rank 0 reads utime/stime of every daemon and rank from /proc around
``ops`` back-to-back operations (each followed by a barrier) of one system, then of the other. On a box where
both systems are CPU-bound, wall time >= total CPU-seconds / nproc.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import push_pull_vs_gloo as bench  # noqa: E402
from report import machine  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float, float]:
    """(user s, system s, minor page faults) of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK, float(fields[7])


def rank_program(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    import torch.distributed as dist

    import bps_worker.client as bps

    torch.set_num_threads(1)
    rank, size = int(os.environ["BPS_RANK"]), int(os.environ["BPS_SIZE"])
    bps.init(timeout=60.0)
    dist.init_process_group("gloo", rank=rank, world_size=size, init_method=f"tcp://127.0.0.1:{args.gloo_port}")
    try:
        x = bench.pattern(args.size // 4, rank, 0)
        out = np.zeros_like(x)
        t = torch.from_numpy(x.copy())
        bps.push_pull(x, "cpu_split", average=False, out=out)
        dist.all_reduce(t)
        result = {}
        for system in ("bps", "gloo"):
            dist.barrier()
            if rank == 0:
                while not Path(args.pids_file).exists():
                    time.sleep(0.05)
                pids = json.loads(Path(args.pids_file).read_text())
                before = {label: cpu_times(pid) for label, pid in pids.items()}
            start = time.perf_counter()
            for _ in range(args.ops):
                if system == "bps":
                    bps.push_pull(x, "cpu_split", average=False, out=out)
                else:
                    dist.all_reduce(t)
                dist.barrier()
            wall = (time.perf_counter() - start) / args.ops
            if rank == 0:
                after = {label: cpu_times(pid) for label, pid in pids.items()}
                result[system] = {"wall_s": wall, "cpu": {label: [(after[label][i] - before[label][i]) / args.ops
                                                                  for i in (0, 1, 2)] for label in pids}}
        if rank == 0:
            Path(args.result_file).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
        bps.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=bench.parse_size, default=bench.parse_size("256M"), help="bytes (default 256M)")
    p.add_argument("--ops", type=int, default=5, help="operations of each system (default 5)")
    p.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--pids-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_program:
        return rank_program(args)

    sys.path.insert(0, str(bench.REPO))
    from bps_worker.cluster_file import free_ports
    from bps_worker.supervise import Child, Cluster

    with tempfile.TemporaryDirectory(prefix="bps-cpu-") as tmp:
        config = bench.write_cluster_config(Path(tmp))
        result_file, pids_file = Path(tmp) / "result.json", Path(tmp) / "pids.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-program", "--size", str(args.size),
               "--ops", str(args.ops), "--gloo-port", str(free_ports(1)[0]), "--result-file",
               str(result_file), "--pids-file", str(pids_file)]
        with Cluster(str(config)) as cluster:
            pids = {c.label: c.proc.pid for c in cluster.children}
            tmp_pids = pids_file.with_suffix(".tmp")
            code = 0
            # the ranks wait for the pid file, so it is written once they all exist
            procs = []
            for w in cluster.config.worker_specs:
                for local in range(w.local_size):
                    env = cluster.env_for(w.id, local)
                    procs.append(subprocess.Popen(cmd, env=env))
                    pids[f"rank-{env['BPS_RANK']}"] = procs[-1].pid
                    cluster.children.append(Child(f"rank {env['BPS_RANK']}", procs[-1], daemon=False))
            tmp_pids.write_text(json.dumps(pids))
            tmp_pids.rename(pids_file)
            for proc in procs:
                code = code or proc.wait(timeout=600)
        if code or not result_file.exists():
            print("cpu_split: the rank programs failed", file=sys.stderr)
            return 1
        result = json.loads(result_file.read_text())
    info = machine()
    print(f"size {bench.human(args.size)}, {args.ops} operations each; nproc {info['nproc']}, CPU {info['cpu']}")
    print(f"command: {' '.join(getattr(sys, 'orig_argv', sys.argv))}\n")
    labels = list(result["bps"]["cpu"])
    print(f"{'process':>10}  {'bps user':>9}  {'bps sys':>8}  {'bps faults':>10}  {'gloo user':>9}  {'gloo sys':>8}  "
          f"{'gloo faults':>11}   (CPU-s and minor page faults per op)")
    for label in labels:
        b, g = result["bps"]["cpu"][label], result["gloo"]["cpu"][label]
        print(f"{label:>10}  {b[0]:9.3f}  {b[1]:8.3f}  {b[2]:10.0f}  {g[0]:9.3f}  {g[1]:8.3f}  {g[2]:11.0f}")
    for system in ("bps", "gloo"):
        cpu = result[system]["cpu"]
        user, sys_ = sum(v[0] for v in cpu.values()), sum(v[1] for v in cpu.values())
        print(f"{system:>4}: total user {user:.3f} + sys {sys_:.3f} = {user + sys_:.3f} CPU-s per op; "
              f"(user+sys)/nproc = {(user + sys_) / int(info['nproc']):.3f} s; measured wall per op "
              f"(with a barrier) {result[system]['wall_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
