"""Colocated shared memory against loopback TCP for one push_pull: two identical clusters, alternating per operation.

    .venv/bin/python benchmarks/shm_vs_tcp.py                          # 4M, 16M, 64M; 5 reps; print the tables
    .venv/bin/python benchmarks/shm_vs_tcp.py --sizes 1M --reps 2      # smoke test (seconds)
    .venv/bin/python benchmarks/shm_vs_tcp.py --local-size 2 --cpu-servers 1
    .venv/bin/python benchmarks/shm_vs_tcp.py --count-copies           # also count np.copyto bytes (instrumented)
    .venv/bin/python benchmarks/shm_vs_tcp.py --write-results          # also append a dated section to RESULTS.md

Two one-box clusters of the same shape run at the same time, written by ``bps_worker.cluster_file.write_config`` and
identical except ``[cluster] colocated_shm``: ``true`` in cluster "shm" (a worker pushes the partitions of a
server on its host as shared-memory references, and that server writes their sums back in place) and ``false`` in
cluster "tcp" (the same partitions travel over loopback TCP). Which servers count as "on its host" is the worker
daemon's decision: its own (``worker = id``) and, since the daemons also treat any server whose address is one of
the host's own as local, every server of a one-box cluster; the servers' counters below show the share that took
shared memory. (A multi-machine cluster, where only the own server's share can, needs separate hosts or network
namespaces, ``benchmarks/cluster/``.) Default shape: 2 workers x 1 process, one colocated server each and no
CPU-only server (k = 0: each server sums half of every tensor); ``--workers``, ``--local-size`` and
``--cpu-servers`` change it. Partitions of 4 MiB (the default ``partition_bytes``).

Each cluster keeps one long-lived process per rank (multiprocessing, spawn): it calls ``bps.init`` against its
cluster's worker and then waits for commands on a pipe. The driver alternates between the clusters at the level
of single operations (A B A B): it tells every rank of one cluster "do one push_pull" and collects each rank's
duration; the time of an operation is the maximum over its ranks. Two variants, alternated the same way:

- ``shared``: the zero-copy client path: the input lives in ``bps.shared_array`` and the result is written over
  it (``push_pull(a, name, out=a)``); the array gets its input again before every operation, untimed.
- ``plain``: a plain numpy array with a preallocated ``out=`` (the client copies in and out).

Per size: ``--warmup`` untimed operations of each variant on each cluster, then ``--reps`` timed ones; every
result is checked against the exact sum (integer-valued float32, sampled elements). Reported: median (min-max)
over repetitions, ``algbw = bytes / median`` and ``ratio = tcp / shm`` (> 1: shared memory is faster).

Evidence of the path each cluster took, sampled around every timed operation (untimed, from /proc):
- the servers' own counters (asked as an observer over TCP, like ``tests/harness.py``): bytes received in
  pushes and, of those, bytes read from the colocated worker's shared memory (must be > 0 for "shm", 0 for "tcp");
- socket copies: ``rchar + wchar`` of every daemon (/proc/PID/io). The daemons' uvloop reads and writes sockets
  with read()/write()/writev(), which these counters count, so each byte is one copy between user and kernel
  memory (a loopback byte costs two: written by one daemon, read by another);
- CPU time of ranks, worker daemons and servers (/proc/PID/task/*/schedstat, ns).

``--count-copies`` also counts every ``numpy.copyto`` (the only pure data-moving pass on the float32 path at these
sizes: client copy in/out, the worker's hand-back, the server's first-push copy and its in-place reply) in every
process, through a ``sitecustomize`` hook on ``PYTHONPATH`` that wraps ``numpy.copyto`` and keeps per-process
totals in a small memory-mapped file. It changes no project file, but its timings are instrumented.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import mmap
import multiprocessing as mp
import os
import shlex
import statistics
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (str(REPO), str(Path(__file__).resolve().parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import push_pull_vs_gloo as ppg  # noqa: E402  (sizes, the exact-sum pattern)
from report import append_section, markdown_table, section_head, text_table  # noqa: E402
from soak import machine  # noqa: E402  (nproc, CPU model, versions, code revision)

DEFAULT_RESULTS = REPO / "benchmarks" / "RESULTS.md"
DEFAULT_SIZES = "4M,16M,64M"
SIDES = ("shm", "tcp")  # A and B: [cluster] colocated_shm = true / false
VARIANTS = ("shared", "plain")
ROLES = ("ranks", "workers", "servers")
ENV_PREFIXES = ("MALLOC_", "GLIBC_TUNABLES", "OMP_", "NUMBA_", "BPS_")
COUNT_DIR_ENV = "SHM_VS_TCP_COUNT_DIR"
COUNTER = struct.Struct("<qq")  # bytes copied, calls

# Imported by every Python process started with the hook directory on PYTHONPATH (--count-copies only).
SITECUSTOMIZE = f'''\
"""shm_vs_tcp.py --count-copies: count the bytes every numpy.copyto of this process writes."""
import os as _os

if _os.environ.get("{COUNT_DIR_ENV}"):
    import mmap as _mmap
    import struct as _struct
    import threading as _threading

    import numpy as _np

    _path = _os.path.join(_os.environ["{COUNT_DIR_ENV}"], f"{{_os.getpid()}}.count")
    with open(_path, "wb") as _f:
        _f.write(bytes(16))
    with open(_path, "r+b") as _f:
        _map = _mmap.mmap(_f.fileno(), 16)
    _lock = _threading.Lock()
    _totals = [0, 0]
    _copyto = _np.copyto

    def copyto(dst, src, *args, **kwargs):
        _copyto(dst, src, *args, **kwargs)
        with _lock:
            _totals[0] += int(getattr(dst, "nbytes", 0))
            _totals[1] += 1
            _struct.pack_into("<qq", _map, 0, *_totals)

    copyto.__doc__ = _copyto.__doc__
    _np.copyto = copyto
'''

RESULTS_SECTION_HEADER = """\

## `shm_vs_tcp.py`
Colocated shared memory against loopback TCP for one `push_pull`: two one-box clusters of the same shape, started
at the same time and identical except `[cluster] colocated_shm` (`true` / `false`), with one long-lived process per
rank each (multiprocessing, spawn; `bps.init`, then commands over a pipe). The driver alternates between them per
operation (A B A B) and takes the maximum over ranks as an operation's time; median (min-max) over repetitions
after a warm-up; `ratio = tcp / shm` (> 1: shared memory is faster). Variants: `shared` (the input is a
`bps.shared_array`, `push_pull(a, name, out=a)`: no client copies) and `plain` (a numpy array, preallocated
`out=`). Evidence of the path: the servers' counters of bytes received and of bytes read from shared memory, the
daemons' socket bytes (`rchar + wchar` from /proc/PID/io, one user/kernel copy each) and CPU time
(/proc/PID/task/*/schedstat), all per operation; with `--count-copies`, the bytes every `numpy.copyto` wrote.
"""


# --------------------------------------------------------------------------------------------------------------
# rank process (spawned, one per training process of each cluster)
# --------------------------------------------------------------------------------------------------------------
def rank_main(conn: Any, sock: str, local_rank: int, rank: int, size: int, client_timeout: float) -> None:
    """Serve commands from the driver until "stop": prepare a size, fill the shared array, do one push_pull."""
    import numpy as np

    import bps_worker.client as bps

    state: dict[str, Any] = {}
    try:
        bps.init(socket=sock, local_rank=local_rank, timeout=client_timeout)
        if (bps.rank(), bps.size()) != (rank, size):
            raise RuntimeError(f"rank/size {bps.rank()}/{bps.size()}, expected {rank}/{size}")
        conn.send(("ready", os.getpid()))
        while True:
            command, *args = conn.recv()
            if command == "stop":
                break
            if command == "prepare":
                nbytes, index = args
                state.clear()
                gc.collect()
                n = nbytes // 4
                src = ppg.pattern(n, rank, index)
                step = max(1, n // 4099)
                idx = np.unique(np.r_[np.arange(0, n, step), n - 1])
                expect = sum(((idx + 7 * r + 3 * index) % 13 - 6) for r in range(size)).astype(np.float32)
                shared = bps.shared_array(f"shared.{ppg.human(nbytes)}", (n,), np.float32)
                shared[...] = src
                state.update(src=src, idx=idx, expect=expect, shared=shared, out=np.zeros_like(src),
                             names={"shared": f"shared.{ppg.human(nbytes)}", "plain": f"plain.{ppg.human(nbytes)}"})
                conn.send(("ok",))
            elif command == "fill":  # the shared array's input again (the last result overwrote it); untimed
                state["shared"][...] = state["src"]
                conn.send(("ok",))
            elif command == "op":
                variant = args[0]
                if variant == "shared":
                    a = state["shared"]
                    t0 = time.perf_counter()
                    bps.push_pull(a, state["names"]["shared"], average=False, out=a)
                    seconds = time.perf_counter() - t0
                    result = a
                else:
                    t0 = time.perf_counter()
                    bps.push_pull(state["src"], state["names"]["plain"], average=False, out=state["out"])
                    seconds = time.perf_counter() - t0
                    result = state["out"]
                conn.send(("op", seconds, bool(np.array_equal(result[state["idx"]], state["expect"]))))
            else:
                raise RuntimeError(f"unknown command {command!r}")
    except BaseException as exc:  # every failure goes to the driver
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        state.clear()  # views of the shared slots go before the client unmaps them
        gc.collect()
        bps.shutdown()


# --------------------------------------------------------------------------------------------------------------
# what the driver reads from outside the processes
# --------------------------------------------------------------------------------------------------------------
def received(cluster: Any) -> tuple[int, int]:
    """(bytes received in pushes, of which read from shared memory), summed over the cluster's servers."""
    from bps_worker.observer import server_stats

    stats = server_stats(cluster)
    return sum(int(s["bytes_received"]) for s in stats.values()), sum(int(s["bytes_shm"]) for s in stats.values())


def cpu_ns(pid: int) -> int:
    """CPU time of every live thread of ``pid`` (ns); the daemons' thread pools live as long as they do."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return total


def io_chars(pid: int) -> int:
    """rchar + wchar: bytes this process passed to read()/write()-family system calls."""
    values = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            key, _, value = line.partition(":")
            values[key] = int(value)
    return values.get("rchar", 0) + values.get("wchar", 0)


def copied(count_dir: Path | None, pid: int) -> int:
    """Bytes this process wrote with numpy.copyto so far (--count-copies), else 0."""
    if count_dir is None:
        return 0
    try:
        with open(count_dir / f"{pid}.count", "rb") as f, mmap.mmap(f.fileno(), 16, access=mmap.ACCESS_READ) as m:
            return COUNTER.unpack_from(m, 0)[0]
    except (OSError, ValueError):
        return 0


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------
@dataclass
class Rank:
    rank: int
    proc: Any  # multiprocessing Process
    conn: Any  # our end of its pipe
    pid: int = 0


@dataclass
class Side:
    """One of the two clusters, with its rank processes."""

    label: str  # "shm" or "tcp"
    config: Path
    cluster: Any = None
    ranks: list[Rank] = field(default_factory=list)

    def pids(self) -> dict[str, list[int]]:
        daemons = [c for c in self.cluster.children if c.daemon]
        return {"ranks": [r.pid for r in self.ranks],
                "workers": [c.proc.pid for c in daemons if c.label.startswith("worker")],
                "servers": [c.proc.pid for c in daemons if c.label.startswith("server")]}


@dataclass
class Totals:
    """What one (size, variant, cluster) accumulated over its timed operations."""

    seconds: list[float] = field(default_factory=list)
    exact: bool = True
    cpu_ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    socket_bytes: int = 0  # daemons' rchar + wchar
    copy_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))


class RankError(Exception):
    pass


def snapshot(side: Side, count_dir: Path | None) -> dict[str, Any]:
    pids = side.pids()
    return {"cpu": {role: sum(cpu_ns(p) for p in pids[role]) for role in ROLES},
            "io": sum(io_chars(p) for role in ("workers", "servers") for p in pids[role]),
            "copy": {role: sum(copied(count_dir, p) for p in pids[role]) for role in ROLES}}


def ask(side: Side, message: tuple[Any, ...], timeout: float) -> list[tuple[Any, ...]]:
    """Send ``message`` to every rank of ``side``; their answers in rank order (a failure raises RankError)."""
    for r in side.ranks:
        r.conn.send(message)
    answers = []
    deadline = time.monotonic() + timeout
    for r in side.ranks:
        while not r.conn.poll(0.2):
            if not r.proc.is_alive():
                raise RankError(f"{side.label} rank {r.rank} died (exit code {r.proc.exitcode})")
            if time.monotonic() > deadline:
                raise RankError(f"{side.label} rank {r.rank} did not answer {message[0]!r} within {timeout:g} s")
        answer = r.conn.recv()
        if answer[0] == "error":
            raise RankError(f"{side.label} rank {r.rank}: {answer[1]}")
        answers.append(answer)
    return answers


def start_ranks(ctx: Any, side: Side, client_timeout: float, timeout: float) -> None:
    config = side.cluster.config
    for w in config.worker_specs:
        for local in range(w.local_size):
            rank = config.rank_offset(w.id) + local
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(theirs, w.socket, local, rank, config.size, client_timeout),
                               name=f"{side.label}-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            side.ranks.append(Rank(rank, proc, ours))
    deadline = time.monotonic() + timeout
    for r in side.ranks:
        while not r.conn.poll(0.2):
            if not r.proc.is_alive() or time.monotonic() > deadline:
                raise RankError(f"{side.label} rank {r.rank} did not start (exit code {r.proc.exitcode})")
        answer = r.conn.recv()
        if answer[0] != "ready":
            raise RankError(f"{side.label} rank {r.rank}: {answer[1] if len(answer) > 1 else answer}")
        r.pid = answer[1]


def stop_ranks(side: Side) -> None:
    for r in side.ranks:
        with contextlib.suppress(OSError, ValueError):
            r.conn.send(("stop",))
    for r in side.ranks:
        r.proc.join(timeout=10)
        if r.proc.is_alive():
            r.proc.kill()
            r.proc.join(timeout=5)


def write_configs(directory: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The two cluster files: same shape, ``colocated_shm`` true / false, no port in common."""
    from bps_worker.cluster_file import write_config

    from protocol.config import load_config

    for _ in range(10):
        paths = {side: write_config(directory / side, [args.local_size] * args.workers, cpu_servers=args.cpu_servers,
                                    cluster={"colocated_shm": side == "shm"})
                 for side in SIDES}
        ports = [{s.port for s in load_config(str(p)).servers} for p in paths.values()]
        if not ports[0] & ports[1]:
            return paths
    raise RuntimeError("could not find free ports for two clusters")


def run(args: argparse.Namespace, sizes: list[int], sides: dict[str, Side], count_dir: Path | None
        ) -> dict[str, Any]:
    """Warm-up and timed operations of every size and variant, alternating the clusters per operation."""
    totals: dict[tuple[int, str, str], Totals] = {}
    paths: dict[tuple[int, str], tuple[int, int]] = {}  # (size, side) -> (bytes received, via shm) at the servers
    for index, nbytes in enumerate(sizes):
        for side in sides.values():
            ask(side, ("prepare", nbytes, index), args.op_timeout)
        before = {label: received(side.cluster) for label, side in sides.items()}
        warm_ok = True
        for _ in range(args.warmup):
            for variant in VARIANTS:
                for side in sides.values():
                    if variant == "shared":
                        ask(side, ("fill",), args.op_timeout)
                    warm_ok &= all(a[2] for a in ask(side, ("op", variant), args.op_timeout))
        for rep in range(args.reps):
            for variant in VARIANTS:
                for label, side in sides.items():
                    t = totals.setdefault((nbytes, variant, label), Totals(exact=warm_ok))
                    if variant == "shared":
                        ask(side, ("fill",), args.op_timeout)
                    s0 = snapshot(side, count_dir)
                    answers = ask(side, ("op", variant), args.op_timeout)
                    s1 = snapshot(side, count_dir)
                    t.seconds.append(max(a[1] for a in answers))
                    t.exact &= all(a[2] for a in answers)
                    for role in ROLES:
                        t.cpu_ns[role] += s1["cpu"][role] - s0["cpu"][role]
                        t.copy_bytes[role] += s1["copy"][role] - s0["copy"][role]
                    t.socket_bytes += s1["io"] - s0["io"]
            if rep == 0 or rep == args.reps - 1:
                t_shared = totals[(nbytes, "shared", "shm")].seconds[-1], totals[(nbytes, "shared", "tcp")].seconds[-1]
                print(f"[shm_vs_tcp] {ppg.human(nbytes):>4} rep {rep + 1}/{args.reps}: shared shm "
                      f"{t_shared[0] * 1e3:.1f} ms, tcp {t_shared[1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
        after = {label: received(side.cluster) for label, side in sides.items()}
        for label in sides:
            paths[(nbytes, label)] = (after[label][0] - before[label][0], after[label][1] - before[label][1])
    return {"totals": totals, "paths": paths}


def _ms(values: list[float]) -> str:
    def f(v: float) -> str:
        return f"{v * 1e3:.2f}" if v < 0.01 else f"{v * 1e3:.1f}"
    return f"{f(statistics.median(values))} ({f(min(values))}-{f(max(values))})"


TIME_HEADER = ["size", "variant", "shm median ms (min-max)", "tcp median ms (min-max)", "ratio tcp/shm",
               "shm algbw GB/s", "tcp algbw GB/s", "exact"]
EVIDENCE_HEADER = ["size", "variant", "cluster", "server MiB in/op", "via shm MiB/op", "socket copies/B",
                   "copyto copies/B r+w+s", "CPU ms/op ranks", "workers", "servers", "total"]


def tables(sizes: list[int], outcome: dict[str, Any], n_ranks: int, ops_per_size: int, count: bool
           ) -> tuple[list[list[str]], list[list[str]]]:
    totals, paths = outcome["totals"], outcome["paths"]
    time_rows, evidence_rows = [], []
    for nbytes in sizes:
        for variant in VARIANTS:
            a, b = totals[(nbytes, variant, "shm")], totals[(nbytes, variant, "tcp")]
            ma, mb = statistics.median(a.seconds), statistics.median(b.seconds)
            time_rows.append([ppg.human(nbytes), variant, _ms(a.seconds), _ms(b.seconds), f"{mb / ma:.2f}",
                              f"{nbytes / ma / 1e9:.2f}", f"{nbytes / mb / 1e9:.2f}",
                              "yes" if a.exact and b.exact else "NO"])
            for label, t in (("shm", a), ("tcp", b)):
                ops = len(t.seconds)
                tensor_bytes = ops * n_ranks * nbytes  # every rank's tensor, every operation
                got, via_shm = paths[(nbytes, label)]
                copies = ("+".join(f"{t.copy_bytes[r] / tensor_bytes:.2f}" for r in ROLES) + " = "
                          f"{sum(t.copy_bytes.values()) / tensor_bytes:.2f}") if count else "-"
                evidence_rows.append([ppg.human(nbytes), variant, label, f"{got / ops_per_size / 2**20:.1f}",
                                      f"{via_shm / ops_per_size / 2**20:.1f}", f"{t.socket_bytes / tensor_bytes:.2f}",
                                      copies]
                                     + [f"{t.cpu_ns[r] / ops / 1e6:.1f}" for r in ROLES]
                                     + [f"{sum(t.cpu_ns.values()) / ops / 1e6:.1f}"])
    return time_rows, evidence_rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated tensor sizes (default {DEFAULT_SIZES})")
    p.add_argument("--reps", type=int, default=5, help="timed operations per size, variant and cluster (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed operations of each before them (default 1)")
    p.add_argument("--workers", type=int, default=2, help="worker machines per cluster (default 2)")
    p.add_argument("--local-size", type=int, default=1, help="training processes per worker (default 1)")
    p.add_argument("--cpu-servers", type=int, default=0, help="CPU-only servers per cluster (default 0)")
    p.add_argument("--count-copies", action="store_true",
                   help="also count the bytes of every numpy.copyto in every process (instrumented timings)")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {DEFAULT_RESULTS}")
    p.add_argument("--output", default=None, help="append the section to this markdown file instead "
                                                  "(implies --write-results)")
    p.add_argument("--json", default=None, help="also write the raw per-operation times here")
    p.add_argument("--op-timeout", type=float, default=120.0, help="seconds one command to the ranks may take")
    p.add_argument("--log-level", default="warning", help="daemons' log level (default warning)")
    args = p.parse_args(argv)
    if args.reps < 1 or args.warmup < 1:
        p.error("--reps and --warmup must be at least 1")
    if args.workers < 1 or args.local_size < 1 or args.cpu_servers < 0:
        p.error("--workers and --local-size must be at least 1, --cpu-servers at least 0")
    try:
        sizes = ppg.parse_sizes(args.sizes)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if not sizes:
        p.error("--sizes is empty")

    from bps_worker.supervise import Cluster, LaunchError
    from protocol.errors import ConfigError

    command_line = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    env_vars = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    if env_vars:  # settings that change what is measured belong to the command
        command_line = shlex.join(f"{k}={v}" for k, v in env_vars.items()) + " " + command_line
    started = _dt.datetime.now().astimezone()
    info = machine()
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bps-shm-vs-tcp-") as tmp, contextlib.ExitStack() as stack:
        count_dir = None
        if args.count_copies:
            count_dir = Path(tmp) / "counts"
            count_dir.mkdir()
            hook = Path(tmp) / "hook"
            hook.mkdir()
            (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
            # Set before any daemon or rank starts: they all inherit it (and only they and their children run it).
            os.environ[COUNT_DIR_ENV] = str(count_dir)
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
        paths = write_configs(Path(tmp), args)
        sides = {label: Side(label, path) for label, path in paths.items()}
        try:
            for side in sides.values():
                side.cluster = stack.enter_context(Cluster(str(side.config), log_level=args.log_level))
            for side in sides.values():
                stack.callback(stop_ranks, side)
                start_ranks(ctx, side, client_timeout=args.op_timeout, timeout=120.0)
            outcome = run(args, sizes, sides, count_dir)
        except (ConfigError, LaunchError) as exc:
            print(f"shm_vs_tcp: {exc}", file=sys.stderr)
            return 2
        except RankError as exc:
            print(f"shm_vs_tcp: {exc}", file=sys.stderr)
            return 2
        config = sides["shm"].cluster.config
    elapsed = time.monotonic() - t0
    load_after = os.getloadavg()[0]

    n_ranks = config.size
    ops_per_size = (args.warmup + args.reps) * len(VARIANTS)
    time_rows, evidence_rows = tables(sizes, outcome, n_ranks, ops_per_size, args.count_copies)
    got = {label: tuple(sum(outcome["paths"][(s, label)][i] for s in sizes) for i in (0, 1)) for label in SIDES}
    exact = all(t.exact for t in outcome["totals"].values())
    paths_ok = got["shm"][1] > 0 and got["tcp"][1] == 0
    colocated = sum(1 for s in config.servers if s.worker is not None)
    shape = (f"N = {n_ranks} ranks ({config.workers} workers x {args.local_size} process"
             f"{'es' if args.local_size > 1 else ''}); {len(config.servers)} servers ({colocated} colocated, "
             f"{len(config.servers) - colocated} CPU-only); partition_bytes = {config.partition_bytes}; "
             f"two such clusters at once, colocated_shm = true (shm) / false (tcp)")
    machine_line = (f"nproc {info['nproc']}, CPU {info['cpu']}; Python {info['python']}, numpy {info['numpy']}"
                    + (f", numba {info['numba']}" if "numba" in info else "")
                    + (f", uvloop {info['uvloop']}" if "uvloop" in info else "") + f", Linux {info['kernel']}")
    path_line = (f"shared-memory bytes at the servers: shm cluster {got['shm'][1]} of {got['shm'][0]} received; "
                 f"tcp cluster {got['tcp'][1]} of {got['tcp'][0]} received")
    runs_line = (f"{args.reps} timed operations per size, variant and cluster after {args.warmup} warm-up; time of "
                 f"an operation = max over ranks; wall time {elapsed:.0f} s; 1-minute load average {load_before:.1f} "
                 f"before, {load_after:.1f} after (others share the machine)"
                 + ("; INSTRUMENTED (--count-copies)" if args.count_copies else ""))
    notes = [
        "server MiB in/op: bytes the cluster's servers received in pushes per operation (all ranks), via shm: of "
        "those, read from a worker's shared memory (servers' counters; per size, both variants)",
        "socket copies/B: daemons' rchar + wchar (each a user/kernel copy) per byte of tensor (every rank's)",
        "copyto copies/B: bytes written by numpy.copyto in ranks + workers + servers per byte of tensor"
        + ("" if args.count_copies else " (only with --count-copies)"),
        "CPU ms/op: CPU time per operation, summed over the cluster's processes of each kind",
    ]

    print(f"date:    {started.isoformat(timespec='seconds')}")
    print(f"command: {command_line}")
    print(f"machine: {machine_line}")
    if "code" in info:
        print(f"code:    {info['code']}")
    print(f"cluster: {shape}")
    print(f"reps:    {runs_line}")
    print()
    print(text_table(TIME_HEADER, time_rows, left=2))
    print()
    print(text_table(EVIDENCE_HEADER, evidence_rows, left=3))
    for note in notes:
        print(f"  {note}")
    print()
    print(path_line)
    if not exact:
        print("ERROR: a push_pull returned a wrong sum", file=sys.stderr)
    if not paths_ok:
        print("ERROR: a cluster did not take the path it claims (shm bytes must be > 0 for shm, 0 for tcp)",
              file=sys.stderr)

    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": started.isoformat(timespec="seconds"), "command": command_line, "machine": info,
            "ranks": n_ranks, "rows": [{"bytes": s, "variant": v, "cluster": c, "seconds": t.seconds,
                                        "exact": t.exact, "cpu_ns": t.cpu_ns, "socket_bytes": t.socket_bytes,
                                        "copy_bytes": t.copy_bytes}
                                       for (s, v, c), t in outcome["totals"].items()],
            "servers": {f"{ppg.human(s)} {c}": list(v) for (s, c), v in outcome["paths"].items()}}, indent=1) + "\n")

    if args.write_results or args.output:
        target = Path(args.output) if args.output else DEFAULT_RESULTS
        text = target.read_text() if target.exists() else ""
        section = [] if "## `shm_vs_tcp.py`" in text else [RESULTS_SECTION_HEADER.rstrip("\n")]
        section += [
            *section_head(started, "colocated shared memory vs loopback TCP (`shm_vs_tcp.py`)", command_line,
                          machine_line),
        ]
        if "code" in info:
            section.append(f"- code: {info['code']}")
        section += [f"- cluster: {shape}", f"- {runs_line}", f"- {path_line}", "",
                    markdown_table(TIME_HEADER, time_rows, left=2), "",
                    markdown_table(EVIDENCE_HEADER, evidence_rows, left=3), ""]
        section += [f"- {note}" for note in notes] + [""]
        append_section(target, section)
    return 0 if exact and paths_ok else 1


if __name__ == "__main__":
    sys.exit(main())
