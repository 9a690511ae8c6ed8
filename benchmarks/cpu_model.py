"""Where a machine's CPU per operation goes: a fixed cost, a cost per piece and a cost per byte, per role.

    .venv/bin/python benchmarks/cpu_model.py                      # n = 4, k = 0, 1 Gbit/s; 2 sizes x 4 partitions
    .venv/bin/python benchmarks/cpu_model.py --sizes 256K,1M --partition-bytes 64K,128K --reps 1   # smoke test

Issue 15 asks what a machine's CPU per operation is made of. This script runs ``paper_vs_allreduce.py`` (one
emulated machine per network namespace, shaped links, one rank per worker machine, gloo's ring in the same
run) once per point of a grid: tensor sizes ``--sizes`` x ``partition_bytes`` ``--partition-bytes`` (which
caps the pieces' size, so at one size the pieces' count changes and the bytes do not). At every point it reads
each process's CPU-seconds per operation (user + sys from /proc, median over repetitions) and counts, from
``bps_worker.placement`` with the same cluster file, the pieces each worker daemon pushes and each server sums.
Then, per role, a least-squares fit over the grid:

    CPU-s per op = fixed + per_piece x pieces + per_byte x M

``worker`` is a worker daemon, ``server`` a colocated server, ``rank`` a training process (bps), ``gloo`` a
rank during gloo's all_reduce (these two hand over one tensor per operation: their fits have no pieces). A worker's pieces are every piece of the tensor (each
is one push and one result, by TCP or, to its colocated server, by shared-memory reference); a server's are
its pieces times the workers that push each. Every term is the whole process's: the kernel's TCP copies and
the shaping's softirqs are in ``per_byte``, a message's Python and system calls in ``per_piece``.
The last table predicts a GPU machine's CPU per operation against a gloo rank's for pieces of a given size
at the largest ``--sizes``: what piece size a ratio needs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import paper_vs_allreduce as paper  # noqa: E402
from push_pull_vs_gloo import human, parse_size  # noqa: E402
from report import append_section, machine, machine_line, markdown_table, section_head, text_table  # noqa: E402

from bps_worker.placement import Placement, theorem1_shares  # noqa: E402
from protocol.config import parse_config, parse_rate  # noqa: E402

HERE = Path(__file__).resolve().parent
ROLES = ("worker", "server", "rank", "gloo")
PIECE_ROLES = ("worker", "server")  # the others hand over one tensor per operation: fixed + per byte
PREDICT_PIECES = (64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20)


def placement_of(n: int, k: int, partition_bytes: int, bandwidth: str) -> Placement:
    """The placement the benchmark's daemons use: n worker machines with colocated servers, k CPU-only ones,
    every server at its own address, the cluster file giving the links' rate (``link_rate``, as the benchmark's
    default ``--link-rate auto``)."""
    servers = [{"id": w, "address": f"10.77.0.{w + 1}:7000", "worker": w} for w in range(n)]
    servers += [{"id": n + j, "address": f"10.77.0.{n + j + 1}:7000"} for j in range(k)]
    workers = [{"id": w, "local_size": 1, "socket": f"/tmp/worker-{w}.sock"} for w in range(n)]
    cluster = {"workers": n, "partition_bytes": partition_bytes, "max_payload_bytes": max(1 << 30, partition_bytes),
               "link_rate": bandwidth}
    return Placement(parse_config({"cluster": cluster, "server": servers, "worker": workers}))


def piece_counts(n: int, k: int, size: int, partition_bytes: int, bandwidth: str) -> dict[str, float]:
    """Pieces per operation a worker daemon handles (all of the tensor's) and a colocated server sums (its
    pieces x n pushes each, the mean over colocated servers), for the benchmark's tensor name."""
    placement = placement_of(n, k, partition_bytes, bandwidth)
    pieces = placement.split(f"paper.{human(size)}", size // 4, 4)
    colocated = [sum(1 for p in pieces if p.server == w) * n for w in range(n)]
    return {"worker": float(len(pieces)), "server": statistics.mean(colocated)}


def role_cpu(config: dict[str, Any]) -> dict[str, float]:
    """CPU-seconds per operation of each role: the mean over the worker machines of each one's median over
    repetitions (``paper_vs_allreduce.machine_cpu``) of its ``worker-*``, colocated ``server-*`` or ``rank-*``
    process during bps, and of its ``rank-*`` during gloo."""
    result, where, workers = config["result"], config["where"], config["workers"]

    def mean(obs: list[dict[str, Any]], prefix: str) -> float:
        return statistics.mean(paper.machine_cpu(obs, where, workers, (prefix,)))

    bps, gloo = result["obs_bps"], result["obs_gloo"]
    return {"worker": mean(bps, "worker-"), "server": mean(bps, "server-"), "rank": mean(bps, "rank-"),
            "gloo": mean(gloo, "rank-")}


def run_point(args: argparse.Namespace, size: int, partition_bytes: int, tmp: Path) -> dict[str, Any]:
    """One ``paper_vs_allreduce.py`` run: its per-role CPU per operation, pieces and times."""
    out = tmp / f"{size}_{partition_bytes}.json"
    cmd = [sys.executable, paper.__file__, "--ns", str(args.n), "--ks", str(args.k),
           "--ps-ks", "", "--bandwidths", args.bandwidth, "--size", str(size), "--partition-bytes",
           str(partition_bytes), "--reps", str(args.reps), "--json", str(out), "--timeout", str(args.timeout)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout * 3 + 120)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed (status {proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-2000:]}")
    config = json.loads(out.read_text())["blocks"][0]["configs"][0]
    result = config["result"]
    if not result.get("exact"):
        raise RuntimeError(f"size {size}, partition_bytes {partition_bytes}: bps's sums were not exact")
    point = {"size": size, "partition_bytes": partition_bytes, "cpu": role_cpu(config),
             "pieces": piece_counts(args.n, args.k, size, partition_bytes, args.bandwidth),
             "bps_s": statistics.median(result["bps_s"]), "gloo_s": statistics.median(result["gloo_s"])}
    print(f"  M = {human(size)}, partition_bytes = {human(partition_bytes)}: {point['pieces']['worker']:.0f} pieces, "
          f"CPU-ms/op " + ", ".join(f"{r} {1e3 * point['cpu'][r]:.1f}" for r in ROLES), flush=True)
    return point


def fit(points: list[dict[str, Any]], role: str) -> dict[str, float]:
    """Least squares of the role's CPU per op on (1, pieces, M) (a rank's and gloo's: on (1, M)); the
    coefficients and the largest relative residual."""
    y = np.array([p["cpu"][role] for p in points])
    cols = [np.ones(len(points)), np.array([float(p["size"]) for p in points])]
    if role in PIECE_ROLES:
        cols.insert(1, np.array([p["pieces"][role] for p in points]))
    a = np.stack(cols, axis=1)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    residual = float(np.max(np.abs(a @ coef - y) / y))
    fixed, *rest = (float(c) for c in coef)
    per_piece = rest[0] if role in PIECE_ROLES else 0.0
    return {"fixed": fixed, "per_piece": per_piece, "per_byte": rest[-1], "residual": residual}


def predict(fits: dict[str, dict[str, float]], size: int, n: int, k: int) -> list[list[str]]:
    """A GPU machine (worker daemon + colocated server + rank) against a gloo rank, for pieces of each size
    of ``PREDICT_PIECES`` at tensor size ``size``: the worker handles size / piece pieces, its colocated server
    n pushes of each piece of its Theorem-1 share (the same count at k = 0). An extrapolation past the grid's
    largest pieces (placement makes pieces of at most 4 ms of the link, about 500 KB at 1 Gbit/s)."""
    rows = []
    gloo = fits["gloo"]["fixed"] + fits["gloo"]["per_byte"] * size
    m_gpu = float(theorem1_shares(n, k)[1])
    for piece in PREDICT_PIECES:
        pieces = {"worker": max(1.0, size / piece), "server": n * max(1.0, m_gpu * size / piece), "rank": 0.0}
        gpu = sum(fits[r]["fixed"] + fits[r]["per_piece"] * pieces[r] + fits[r]["per_byte"] * size
                  for r in ("worker", "server", "rank"))
        rows.append([human(piece), f"{pieces['worker']:.0f}", f"{1e3 * gpu:.1f}", f"{1e3 * gloo:.1f}",
                     f"{gpu / gloo:.2f}"])
    return rows


def tables(points: list[dict[str, Any]], fits: dict[str, dict[str, float]], args: argparse.Namespace
           ) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of the three tables: the grid, the fits, the prediction."""
    grid = [[human(p["size"]), human(p["partition_bytes"]), f"{p['pieces']['worker']:.0f}",
             f"{p['pieces']['server']:.0f}", *(f"{1e3 * p['cpu'][r]:.2f}" for r in ROLES),
             f"{sum(p['cpu'][r] for r in ('worker', 'server', 'rank')) / p['cpu']['gloo']:.2f}",
             f"{p['bps_s']:.3f}", f"{p['gloo_s']:.3f}"] for p in points]
    fit_rows = [[r, f"{1e3 * f['fixed']:.2f}", f"{1e6 * f['per_piece']:.0f}" if r in PIECE_ROLES else "-",
                 f"{1e9 * f['per_byte']:.3f}", f"{100 * f['residual']:.0f}%"] for r, f in fits.items()]
    return [("measured (CPU-ms per operation, median over repetitions, mean over a role's processes)",
             ["M", "partition_bytes", "pieces (worker)", "pieces (server)", *ROLES, "GPU machine / gloo rank",
              "bps s", "gloo s"], grid),
            ("fitted: CPU-s per op = fixed + per_piece x pieces + per_byte x M",
             ["role", "fixed ms", "per piece us", "per byte of M, ns", "largest residual"], fit_rows),
            (f"predicted at M = {human(max(args.sizes))}: a GPU machine (worker + colocated server + rank) "
             "against a gloo rank, by piece size",
             ["piece", "pieces", "GPU machine ms", "gloo rank ms", "ratio"], predict(fits, max(args.sizes), args.n, args.k))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4, help="worker machines (default 4)")
    p.add_argument("--k", type=int, default=0, help="CPU-only machines (default 0)")
    p.add_argument("--bandwidth", default="1gbit", help="every link, each way (default 1gbit)")
    p.add_argument("--sizes", default="8M,32M", help="tensor sizes, bytes of float32 (default 8M,32M)")
    p.add_argument("--partition-bytes", default="64K,128K,256K,512K",
                   help="cluster partition_bytes values, the pieces' largest size (default 64K,128K,256K,512K)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per point (default 5)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one point's ranks may take")
    p.add_argument("--write-results", action="store_true", help="append a dated section to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.partition_bytes = [parse_size(s) for s in args.partition_bytes.split(",")]
    parse_rate(args.bandwidth, "--bandwidth", "the command line")
    started = datetime.now(timezone.utc)
    print(f"n = {args.n}, k = {args.k}, B = {args.bandwidth}; {len(args.sizes) * len(args.partition_bytes)} points, "
          f"{args.reps} repetitions each", flush=True)
    with tempfile.TemporaryDirectory(prefix="bps-cpu-model-") as tmp:
        points = [run_point(args, size, pb, Path(tmp)) for size in args.sizes for pb in args.partition_bytes]
    fits = {role: fit(points, role) for role in ROLES}
    info = machine("numpy", "torch")
    lines = [f"machine: {machine_line(info)}"]
    for title, header, rows in tables(points, fits, args):
        print(f"\n{title}\n{text_table(header, rows, left=1)}")
        lines += ["", f"{title}:", "", markdown_table(header, rows, left=1)]
    if args.write_results:
        command = " ".join(["benchmarks/cpu_model.py", *(argv if argv is not None else sys.argv[1:])])
        head = section_head(started, f"the CPU per operation by role, fitted (n = {args.n}, k = {args.k}, "
                                     f"{args.bandwidth})", f".venv/bin/python {command}", machine_line(info))
        append_section(HERE / "RESULTS.md", head + lines[1:] + [""])
    return 0


if __name__ == "__main__":
    sys.exit(main())
