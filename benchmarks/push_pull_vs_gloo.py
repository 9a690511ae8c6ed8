"""BytePS push_pull against torch.distributed gloo all_reduce, in the same processes, alternating.

    .venv/bin/python benchmarks/push_pull_vs_gloo.py                 # 4K .. 256M, 5 reps, print the table
    .venv/bin/python benchmarks/push_pull_vs_gloo.py --quick         # 4K and 64K, 2 reps (smoke test)
    .venv/bin/python benchmarks/push_pull_vs_gloo.py --write-results # also append to benchmarks/RESULTS.md

The driver writes a private cluster file shaped like configs/local.toml (2 workers x 2 processes, one
colocated server per worker plus one CPU-only server, 4 MiB partitions) with free ports and sockets in a
temporary directory, starts its daemons with ``bps_worker.supervise.Cluster`` and runs this file with
``--rank-program`` once per rank (the launcher's environment: BPS_SOCKET, BPS_RANK, ...).

Every rank is both a bps client and a member of one gloo group, so the two systems run alternately in the
same processes (see ../shared/MEASURING.md). For each size: one warm-up of each, which also checks that
bps and gloo give the same bytes (and the exact integer sum); then ``reps`` times: barrier, time
``bps.push_pull(x, name, average=False, out=out)``, barrier, time ``dist.all_reduce(t)``. The time of a
repetition is the maximum over ranks of the local durations. Reported: median (min-max) over repetitions,
``algbw = bytes / median`` and ``busbw = algbw * 2(N-1)/N``, and ratio = gloo median / bps median
(> 1: bps is faster).
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
from typing import Any

from report import append_section, machine, markdown_table, section_head, text_table

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = REPO / "benchmarks" / "RESULTS.md"
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"
QUICK_SIZES = "4K,64K"
ENV_PREFIXES = ("MALLOC_", "GLIBC_TUNABLES", "OMP_", "MKL_", "OPENBLAS_", "NUMBA_", "GLOO_", "TORCH_", "BPS_")
UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
         "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}

RESULTS_HEADER = """\
# Benchmark results

Measured as described in `../shared/MEASURING.md`: every number is a ratio against a peer measured in the
same run, on the same machine, in the same processes.

## `push_pull_vs_gloo.py`
BytePS `push_pull` (float32, `average=False`; by default in place in a `bps.shared_array`, the zero-copy API,
as gloo's `all_reduce` is in place in its tensor; with `--copy` from a plain array into a preallocated `out=`
array; both restore their input outside the timed region) against
`torch.distributed.all_reduce` with the gloo backend. One cluster shaped like `configs/local.toml`:
2 worker daemons x 2 training processes (N = 4 ranks), one Summation Service colocated with each worker
plus one CPU-only Summation Service, 4 MiB partitions, all on loopback. Each rank process is a bps client and
a member of the gloo group; per size: one warm-up of each (which also checks that bps and gloo return the
same bytes, and the exact sum), then `reps` times `barrier; bps; barrier; gloo`. The time of one repetition
is the maximum over ranks; reported is the median (min-max) over repetitions. `algbw = bytes / median time`,
`busbw = algbw * 2(N-1)/N` (nccl-tests), `ratio = gloo time / bps time` (> 1: bps is faster).
`torch.set_num_threads(1)` in every rank; the daemons run with their default settings.
"""


# --------------------------------------------------------------------------------------------------------------
# helpers shared by driver and ranks
# --------------------------------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    unit = t[len(digits):]
    try:
        n = int(float(digits) * UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"bad size {text!r} (examples: 4K, 64M, 1G, 4096)") from None
    if n <= 0 or n % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes (float32)")
    return n


def parse_sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def human(n: int) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return f"{n}B"


def write_cluster_config(directory: Path, workers: int = 2, local_size: int = 2, cpu_servers: int = 1,
                         partition_bytes: int = 4 << 20) -> Path:
    """configs/local.toml's shape with free ports and sockets under ``directory``."""
    from bps_worker.cluster_file import write_config

    return write_config(directory, [local_size] * workers, cpu_servers=cpu_servers,
                        cluster={"partition_bytes": partition_bytes})


# --------------------------------------------------------------------------------------------------------------
# rank program
# --------------------------------------------------------------------------------------------------------------
def pattern(n: int, rank: int, salt: int):  # -> np.ndarray
    """Integer-valued float32 in [-6, 6]: every partial sum is exact, so any summation order gives the same bytes."""
    import numpy as np

    base: np.ndarray = np.arange(n, dtype=np.int32 if n < 1 << 30 else np.int64)
    base += 7 * rank + 3 * salt
    base %= 13
    x = base.astype(np.float32)
    x -= 6
    return x


def join_both(args: argparse.Namespace, bps: Any, client_timeout: float = 60.0) -> tuple[int, int]:
    """In a rank process: connect to the worker daemon (``client_timeout``) and join the gloo group; (rank, size)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, size = int(os.environ["BPS_RANK"]), int(os.environ["BPS_SIZE"])
    bps.init(timeout=client_timeout)
    assert (bps.rank(), bps.size()) == (rank, size), (bps.rank(), bps.size(), rank, size)
    dist.init_process_group("gloo", rank=rank, world_size=size, init_method=f"tcp://127.0.0.1:{args.gloo_port}",
                            timeout=_dt.timedelta(seconds=args.op_timeout))
    return rank, size


class _Operands:
    """One size's buffers in a rank: bps's input and output and gloo's tensor, on the host or on the GPU."""

    def __init__(self, args: argparse.Namespace, bps: Any, name: str, x: Any) -> None:
        import numpy as np
        import torch
        import torch.distributed as dist

        self.name, self.x, self.cuda = name, x, args.device == "cuda"
        self.src: Any
        self.out: Any
        self.xt = torch.from_numpy(x)
        self._push_pull: Any = bps.push_pull
        self._sync: Any = lambda: None  # gloo's CUDA all_reduce returns before the GPU is done: wait for it
        self._all_reduce = dist.all_reduce
        if self.cuda:  # torch tensors on this rank's GPU: bps through CUDA IPC, gloo through its CUDA path
            import bps_worker.torch as bpt

            self._push_pull, self._sync = bpt.push_pull, torch.cuda.synchronize  # bps returns once the GPU has it
            self.xt = self.xt.cuda()
            self.src, self.out = self.xt.clone(), torch.empty_like(self.xt)
        elif args.copy:  # a plain array in, a preallocated array out: the client copies both ways
            self.src, self.out = x, np.zeros_like(x)  # touched: no page faults in the timed region
        else:  # in place in the tensor's shared-memory slot, as gloo's all_reduce is in place in its tensor
            self.src = self.out = bps.shared_array(name, x.shape, np.float32)
        self.t = self.xt.clone()

    def restore(self) -> None:
        """Both inputs back to ``x``, outside the timed region."""
        self.t.copy_(self.xt)
        if self.cuda:
            self.src.copy_(self.xt)
        else:
            self.src[...] = self.x
        self._sync()

    def push_pull(self) -> None:
        self._push_pull(self.src, self.name, average=False, out=self.out)

    def all_reduce(self) -> None:
        self._all_reduce(self.t)
        self._sync()

    def results(self) -> tuple[Any, Any]:
        """bps's and gloo's sums, as host arrays."""
        if self.cuda:
            return self.out.cpu().numpy(), self.t.cpu().numpy()
        return self.out, self.t.numpy()


def _check_one_size(ops: _Operands, index: int, size: int) -> Any:  # -> torch.Tensor (the flags, min over ranks)
    """The warm-up: bps == gloo, and bps's sum exact on a sample of elements."""
    import numpy as np
    import torch
    import torch.distributed as dist

    ops.restore()
    ops.push_pull()
    ops.all_reduce()
    out, theirs = ops.results()
    same = bool(np.array_equal(out, theirs))
    idx = np.arange(0, out.size, max(1, out.size // 4099))
    expect = np.asarray(sum(((idx + 7 * r + 3 * index) % 13 - 6) for r in range(size))).astype(np.float32)
    flags = torch.tensor([int(same), int(np.array_equal(out[idx], expect))], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return flags


def _time_one_size(ops: _Operands, reps: int) -> Any:  # -> torch.Tensor [2, reps], max over ranks
    import torch
    import torch.distributed as dist

    bps_s, gloo_s = [], []
    for _ in range(reps):
        ops.restore()  # both restore their input outside the timed region
        dist.barrier()
        t0 = time.perf_counter()
        ops.push_pull()
        bps_s.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        ops.all_reduce()
        gloo_s.append(time.perf_counter() - t0)
    times = torch.tensor([bps_s, gloo_s], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times


def rank_program(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import bps_worker.client as bps

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("BPS_LOCAL_RANK", "0")) % torch.cuda.device_count())
    rank, size = join_both(args, bps)
    results: list[dict[str, Any]] = []
    try:
        for index, nbytes in enumerate(parse_sizes(args.sizes)):
            ops = _Operands(args, bps, f"bench.{human(nbytes)}", pattern(nbytes // 4, rank, index))
            flags = _check_one_size(ops, index, size)
            for _ in range(args.warmup - 1):
                ops.restore()
                ops.push_pull()
                ops.all_reduce()
            times = _time_one_size(ops, args.reps)
            row: dict[str, Any] = {"bytes": nbytes, "bps_s": times[0].tolist(), "gloo_s": times[1].tolist(),
                                   "bps_equals_gloo": bool(flags[0]), "exact": bool(flags[1])}
            results.append(row)
            if rank == 0:
                print(f"[bench] {human(nbytes):>5}: bps median {statistics.median(row['bps_s']) * 1e3:9.3f} ms, "
                      f"gloo median {statistics.median(row['gloo_s']) * 1e3:9.3f} ms, "
                      f"bps == gloo: {row['bps_equals_gloo']}, exact: {row['exact']}", file=sys.stderr, flush=True)
                Path(args.result_file).write_text(json.dumps({"size": size, "rows": results}))
            del ops
            gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
        bps.shutdown()
    return 0


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------
def run_ranks(cluster: Any, command: list[str], timeout: float) -> int:
    """One rank process per training process, with a deadline (bps_worker.launch.run_training)."""
    from bps_worker.launch import run_training

    return run_training(cluster, command, timeout=timeout, env_defaults={"OMP_NUM_THREADS": "1"}, prog="push_pull_vs_gloo")


def summarize(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        b, g = row["bps_s"], row["gloo_s"]
        bm, gm = statistics.median(b), statistics.median(g)
        ab, ag = row["bytes"] / bm / 1e9, row["bytes"] / gm / 1e9
        factor = 2 * (n - 1) / n
        out.append({"size": human(row["bytes"]), "bps_ms": (bm * 1e3, min(b) * 1e3, max(b) * 1e3),
                    "gloo_ms": (gm * 1e3, min(g) * 1e3, max(g) * 1e3), "bps_algbw": ab, "gloo_algbw": ag,
                    "bps_busbw": ab * factor, "gloo_busbw": ag * factor, "ratio": gm / bm,
                    "ok": row["bps_equals_gloo"] and row["exact"]})
    return out


HEADER = ["size", "bps median ms (min-max)", "gloo median ms (min-max)", "bps algbw GB/s", "gloo algbw GB/s",
          "bps busbw GB/s", "gloo busbw GB/s", "ratio gloo/bps", "bps == gloo"]


def _ms(t: tuple[float, float, float]) -> str:
    def f(v: float) -> str:
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return f"{f(t[0])} ({f(t[1])}-{f(t[2])})"


def _gb(v: float) -> str:
    return f"{v:.3f}" if v >= 0.1 else f"{v:.3g}"


def table_rows(summary: list[dict[str, Any]]) -> list[list[str]]:
    return [[s["size"], _ms(s["bps_ms"]), _ms(s["gloo_ms"]), _gb(s['bps_algbw']), _gb(s['gloo_algbw']),
             _gb(s['bps_busbw']), _gb(s['gloo_busbw']), f"{s['ratio']:.2f}", "yes" if s["ok"] else "NO"]
            for s in summary]


def add_common_arguments(p: argparse.ArgumentParser, *, json_help: str, timeout: float, op_timeout: float) -> None:
    """The options every benchmark driver shares, and the hidden ones of its rank processes."""
    p.add_argument("--config", default=None, help="use this cluster file instead of a generated one")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {DEFAULT_RESULTS}")
    p.add_argument("--output", default=None, help="append the dated section to this markdown file instead "
                                                  "(implies --write-results)")
    p.add_argument("--json", default=None, help=json_help)
    p.add_argument("--timeout", type=float, default=timeout,
                   help=f"seconds the ranks may take in all (default {timeout:g})")
    p.add_argument("--log-level", default="warning", help="daemons' log level (default warning)")
    # internal: what each rank process runs
    p.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--op-timeout", type=float, default=op_timeout, help=argparse.SUPPRESS)


def _operands_label(args: argparse.Namespace) -> str:
    if args.device == "cuda":
        return "torch CUDA tensors, out of place"
    return "plain arrays, copied in and out" if args.copy else "in place in a shared_array"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=None, help=f"comma-separated byte counts (default {DEFAULT_SIZES})")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per size after one warm-up (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of each system per size (default 1; "
                                                      "the first also checks correctness)")
    p.add_argument("--quick", action="store_true", help=f"smoke test: sizes {QUICK_SIZES}, 2 reps")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: torch tensors on the GPU (local rank modulo the GPUs), bps through CUDA IPC and "
                        "gloo through its CUDA path (default cpu)")
    p.add_argument("--copy", action="store_true",
                   help="push a plain array into a preallocated out= array (the client copies in and out) "
                        "instead of summing in place in a bps.shared_array (the default, like gloo's in-place "
                        "all_reduce)")
    add_common_arguments(p, json_help="also write the raw per-repetition times (max over ranks) here",
                         timeout=1800.0, op_timeout=600.0)
    args = p.parse_args(argv)
    args.sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    args.reps = args.reps if args.reps is not None else (2 if args.quick else 5)
    if args.reps < 1 or args.warmup < 1:
        p.error("--reps and --warmup must be at least 1")
    try:
        sizes = parse_sizes(args.sizes)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if not sizes:
        p.error("--sizes is empty")

    if args.rank_program:
        return rank_program(args)

    sys.path.insert(0, str(REPO))
    from bps_worker.cluster_file import free_ports
    from bps_worker.supervise import Cluster, LaunchError
    from protocol.errors import ConfigError

    command_line = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    env_vars = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    if env_vars:  # settings that change what is measured belong to the command
        command_line = shlex.join(f"{k}={v}" for k, v in env_vars.items()) + " " + command_line
    started = _dt.datetime.now().astimezone()
    info = machine("numpy", "torch")
    with tempfile.TemporaryDirectory(prefix="bps-bench-") as tmp:
        config = Path(args.config).resolve() if args.config else write_cluster_config(Path(tmp))
        result_file = Path(tmp) / "result.json"
        rank_cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-program", "--sizes", args.sizes,
                    "--reps", str(args.reps), "--warmup", str(args.warmup), "--gloo-port", str(free_ports(1)[0]),
                    "--result-file", str(result_file), "--device", args.device]
        rank_cmd += ["--copy"] if args.copy else []
        t0 = time.monotonic()
        try:
            with Cluster(str(config), log_level=args.log_level) as cluster:
                n = cluster.config.size
                code = run_ranks(cluster, rank_cmd, args.timeout)
        except (ConfigError, LaunchError) as exc:
            print(f"push_pull_vs_gloo: {exc}", file=sys.stderr)
            return 2
        elapsed = time.monotonic() - t0
        if code != 0 or not result_file.exists():
            print("push_pull_vs_gloo: the rank programs failed", file=sys.stderr)
            return code or 1
        data = json.loads(result_file.read_text())
    if args.json:
        Path(args.json).write_text(json.dumps({"date": started.isoformat(timespec="seconds"), "command": command_line,
                                               "machine": info, "ranks": n, "rows": data["rows"]}, indent=1) + "\n")
    summary = summarize(data["rows"], n)
    rows = table_rows(summary)
    ok = all(s["ok"] for s in summary) and len(summary) == len(sizes)
    shape = ", ".join(f"worker {w.id}: {w.local_size} processes" for w in cluster.config.worker_specs)
    colocated = sum(1 for s in cluster.config.servers if s.worker is not None)
    cluster_line = (f"N = {n} ranks ({shape}); {len(cluster.config.servers)} servers ({colocated} colocated, "
                    f"{len(cluster.config.servers) - colocated} CPU-only); partition_bytes = "
                    f"{cluster.config.partition_bytes}")
    machine_line = (f"nproc {info['nproc']}, CPU {info['cpu']}; Python {info['python']}, numpy {info['numpy']}, "
                    f"torch {info['torch']}, Linux {info['kernel']}")
    print(f"date:    {started.isoformat(timespec='seconds')}")
    print(f"command: {command_line}")
    print(f"machine: {machine_line}")
    print(f"cluster: {cluster_line}")
    print(f"reps:    {args.reps} after {args.warmup} warm-up; time of a rep = max over ranks; wall time {elapsed:.0f} s")
    print()
    print(text_table(HEADER, rows))
    if not ok:
        print("\nERROR: bps and gloo results differ (or a size is missing)", file=sys.stderr)

    if args.write_results or args.output:
        target = Path(args.output) if args.output else DEFAULT_RESULTS
        if not target.exists() or not target.read_text().strip():
            target.write_text(RESULTS_HEADER)
        section = [
            *section_head(started, "push_pull vs gloo all_reduce"
                          f" ({_operands_label(args)})",
                          command_line, machine_line),
            f"- cluster: {cluster_line}" + ("" if args.config else " (generated, like `configs/local.toml`)"),
            f"- {args.reps} timed repetitions per size after {args.warmup} warm-up; wall time of the run {elapsed:.0f} s",
            "", markdown_table(HEADER, rows, left=1), "",
        ]
        append_section(target, section)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
