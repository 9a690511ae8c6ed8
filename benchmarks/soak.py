"""Soak: many rounds of random-sized push_pulls with a Summation Service killed (-9) and restarted mid-run.

    .venv/bin/python benchmarks/soak.py                            # 10,000 rounds, CPU-only server killed at 5,000
    .venv/bin/python benchmarks/soak.py --victim colocated         # kill the server colocated with worker 0
    .venv/bin/python benchmarks/soak.py --rounds 60 --max-elems 4096   # smoke test (seconds)
    .venv/bin/python benchmarks/soak.py --write-results            # also append a section to benchmarks/RESULTS.md

The driver writes a private cluster file shaped like configs/local.toml (2 worker daemons x 2 training
processes, one Summation Service colocated with each worker plus one CPU-only one) but with small partitions
(``--partition-bytes``, 256 KiB) so most tensors span several servers, starts the daemons with
``bps_worker.supervise.Cluster`` and one rank process per training process (multiprocessing, spawn).

Every round each rank push_pulls ``--names`` tensors (float32, ``average=False``, all started, then all
synchronized). Their sizes are drawn from one RNG seeded with ``--seed`` (the same on every rank, so the shapes
agree), log-uniform between 1 and ``--max-elems`` elements, so a name's shared-memory slot is outgrown and
reallocated now and then. A rank's data is a slice of a fixed table of integers in [-64, 64] at an offset
hashed from (seed, round, name, rank): every rank can rebuild every other rank's input and checks the result
bit for bit against the numpy sum (exact: integers). A failed push_pull (``BPSError``) is counted, never
retried: the system itself must re-push what a restarted server lost.

When every rank has finished half of the rounds (or half of ``--max-seconds`` has passed) the driver sends
SIGKILL to the victim server and starts it again (``Cluster.kill`` / ``Cluster.restart``, as systemd's
Restart=on-failure would). ``--max-seconds`` stops the run early (all ranks stop after the same round) and
still reports.

RSS (``VmRSS`` from /proc/PID/status) of every daemon is sampled after a warm-up (10% of the rounds), at the
end (after the last round, with the job still attached) and after the job left (the ranks disconnected, so the
workers reset and the servers drop their per-tensor state). Growth is end vs warm-up, for the daemons that lived
through the whole run; the restarted server is reported twice: its first life (warm-up to just before the
kill) and its second one (10% of the rounds after its restart to the end).

Exit status: 0 if every push_pull of every round succeeded with the exact sum, 1 otherwise, 2 if the cluster
could not start or the run hung.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import multiprocessing as mp
import os
import queue as _queue
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import report
from report import append_section, markdown_table, section_head, text_table

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_RESULTS = REPO / "benchmarks" / "RESULTS.md"
TABLE_SPAN = 1 << 16          # offsets into the data table
VALUE_LIMIT = 64              # data values in [-64, 64]: sums of any rank count stay exact in float32
ENV_PREFIXES = ("MALLOC_", "GLIBC_TUNABLES", "OMP_", "NUMBA_", "BPS_")

RESULTS_SECTION_HEADER = """\

## `soak.py`
Long-run correctness and memory: a cluster shaped like `configs/local.toml` (2 worker daemons x 2 training
processes, one colocated Summation Service per worker plus one CPU-only one) with small partitions, every rank
push_pulling several names per round with random sizes (log-uniform, the same on every rank, drawn from a
seeded RNG; slots get outgrown and reallocated), each result checked bit for bit against numpy (integer-valued
float32). One server is killed with SIGKILL and restarted at half of the rounds; every push_pull must still
succeed. RSS (`VmRSS`) of every daemon after a warm-up (10% of the rounds), at the end with the job attached,
and after the job left; the restarted server's second life is measured from 10% of the rounds after its restart.
"""


# --------------------------------------------------------------------------------------------------------------
# what every rank and the driver agree on
# --------------------------------------------------------------------------------------------------------------
def _mix(*values: int) -> int:
    """splitmix64 over the values: a cheap, well-spread hash of small integers."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15
        h &= 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h


def offset(seed: int, rnd: int, name: int, rank: int) -> int:
    return _mix(seed, rnd, name, rank) % TABLE_SPAN


def data_table(seed: int, max_elems: int):  # -> np.ndarray (read-only float32)
    import numpy as np

    table = np.random.default_rng([seed, 0x50AC]).integers(-VALUE_LIMIT, VALUE_LIMIT + 1,
                                                            size=max_elems + TABLE_SPAN).astype(np.float32)
    table.flags.writeable = False
    return table


def round_sizes(rng: Any, names: int, max_elems: int):  # -> list[int]
    """``names`` sizes, log-uniform in [1, max_elems]."""
    import numpy as np

    u = rng.random(names)
    sizes = np.floor(np.exp(u * math.log(max_elems + 1))).astype(np.int64)
    return [int(s) for s in np.clip(sizes, 1, max_elems)]


# --------------------------------------------------------------------------------------------------------------
# rank program (a spawned process per training process)
# --------------------------------------------------------------------------------------------------------------
def rank_main(results: Any, control: Any, release: Any, sock: str, local_rank: int, rank: int,
              opts: dict[str, Any]) -> None:
    """``control``: a locked int64 array [stop_at, started(rank 0), ..., done(rank 0), ...].

    A rank marks round ``r`` started only while holding the lock and only if ``r < stop_at``; the driver sets
    ``stop_at`` under the same lock to the highest round any rank started + 1, so every rank stops after the
    same round.
    """
    import numpy as np

    import bps_worker.client as bps

    size = opts["size"]
    started_at, done_at = 1, 1 + size
    report: dict[str, Any] = {"rank": rank, "rounds": 0, "ops": 0, "wrong": 0, "failed": 0, "failed_rounds": 0,
                              "wrong_rounds": 0, "bytes": 0, "errors": [], "wrong_examples": [], "new_max": 0,
                              "largest": 0}
    try:
        bps.init(socket=sock, local_rank=local_rank, timeout=opts["client_timeout"])
        if (bps.rank(), bps.size()) != (rank, size):
            raise RuntimeError(f"rank/size {bps.rank()}/{bps.size()}, expected {rank}/{size}")
        seed, names, max_elems = opts["seed"], opts["names"], opts["max_elems"]
        table = data_table(seed, max_elems)
        rng = np.random.default_rng(seed)
        biggest = [0] * names
        t0 = time.monotonic()
        lock = control.get_lock()
        for rnd in range(opts["rounds"]):
            with lock:
                if rnd >= control[0]:
                    break
                control[started_at + rank] = rnd + 1
            sizes = round_sizes(rng, names, max_elems)
            handles = []
            for i, n in enumerate(sizes):
                o = offset(seed, rnd, i, rank)
                handles.append(bps.push_pull_async(table[o:o + n], f"soak.{i}", average=False))
                if n > biggest[i]:
                    report["new_max"] += biggest[i] > 0
                    biggest[i] = n
            wrong = failed = 0
            for i, (n, h) in enumerate(zip(sizes, handles)):
                try:
                    y = bps.synchronize(h)
                except bps.BPSError as exc:
                    failed += 1
                    if len(report["errors"]) < 5:
                        report["errors"].append(f"round {rnd} soak.{i} ({n} elements): {type(exc).__name__}: {exc}")
                    continue
                ref = table[offset(seed, rnd, i, 0):][:n].copy()
                for r in range(1, size):
                    o = offset(seed, rnd, i, r)
                    ref += table[o:o + n]
                if y.dtype != ref.dtype or y.shape != ref.shape or not np.array_equal(y, ref):
                    wrong += 1
                    if len(report["wrong_examples"]) < 5:
                        bad = np.flatnonzero(y.reshape(-1) != ref) if y.shape == ref.shape else np.array([-1])
                        report["wrong_examples"].append(
                            f"round {rnd} soak.{i} ({n} elements): {len(bad)} elements differ, first at "
                            f"{int(bad[0]) if len(bad) else '?'}; got dtype {y.dtype} shape {y.shape}")
            report["ops"] += len(sizes)
            report["bytes"] += 4 * sum(sizes)
            report["wrong"] += wrong
            report["failed"] += failed
            report["wrong_rounds"] += wrong > 0
            report["failed_rounds"] += failed > 0
            report["rounds"] = rnd + 1
            control[done_at + rank] = rnd + 1  # one aligned int64 store: no lock needed for a progress gauge
        report["largest"] = max(biggest)
        report["seconds"] = time.monotonic() - t0
        results.put((rank, "ok", report))
        release.wait(opts["release_timeout"])  # the driver samples RSS with the job still attached
    except BaseException as exc:  # every failure goes to the driver
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        bps.shutdown()


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------
def write_cluster_config(directory: Path, partition_bytes: int, timeout: float, workers: int = 2,
                         local_size: int = 2, cpu_servers: int = 1) -> Path:
    """configs/local.toml's shape with free ports and sockets under ``directory``."""
    from bps_worker.cluster_file import write_config

    return write_config(directory, [local_size] * workers, cpu_servers=cpu_servers,
                        cluster={"partition_bytes": partition_bytes, "timeout": timeout})


def read_rss(pid: int) -> dict[str, int] | None:
    """VmRSS, RssAnon, RssShmem in KiB, or None if the process is gone."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0])
    except (OSError, ValueError):
        return None
    try:  # shared-memory segments mapped (tensor slots, slabs; a colocated server maps its worker's)
        paths = {line.split(None, 5)[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                 if "/dev/shm/" in line and len(line.split(None, 5)) == 6}
        out["shm_maps"] = len(paths)
    except OSError:
        pass
    return out


def sample(cluster: Any) -> dict[str, dict[str, Any]]:
    out = {}
    for child in cluster.children:
        if child.daemon and child.proc.poll() is None:
            rss = read_rss(child.proc.pid)
            if rss is not None:
                out[child.label] = {"pid": child.proc.pid, **rss}
    return out


def machine() -> dict[str, str]:
    """report.machine, and the code revision (with a note when the daemons' code has uncommitted changes)."""
    info = report.machine("numpy", "numba", "uvloop")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "bps_server", "bps_worker", "protocol"],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        if commit:
            info["code"] = commit + (" + uncommitted changes in bps_server/bps_worker/protocol" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def victim_label(text: str, config: Any) -> str | None:
    if text == "none":
        return None
    if text == "cpu":
        cpu = [s for s in config.servers if s.worker is None]
        if not cpu:
            raise SystemExit("soak: --victim cpu but the cluster has no CPU-only server")
        return f"server-{cpu[0].id}"
    if text == "colocated":
        co = [s for s in config.servers if s.worker is not None]
        if not co:
            raise SystemExit("soak: --victim colocated but the cluster has no colocated server")
        return f"server-{co[0].id}"
    if text.startswith("server-") and any(f"server-{s.id}" == text for s in config.servers):
        return text
    raise SystemExit(f"soak: --victim must be cpu, colocated, none or server-N of the cluster, got {text!r}")


def log_lines(log_dir: Path, needle: str) -> list[str]:
    out = []
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if needle in line:
                out.append(f"{path.stem}: {line.strip()}")
    return out


def log_tails(log_dir: Path, chars: int = 3000) -> str:
    parts = []
    for path in sorted(log_dir.glob("*.log")):
        parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
    return "\n".join(parts)


def mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f}"


def growth(before: int | None, after: int | None) -> str:
    if not before or after is None:
        return "-"
    return f"{100.0 * (after - before) / before:+.1f}%"


HEADER = ["daemon", "measured", "VmRSS MiB before", "VmRSS MiB after", "growth", "RssAnon MiB before -> after",
          "RssShmem MiB before -> after", "shm segments mapped", "VmRSS MiB after job left"]


def rss_rows(labels: list[str], victim: str | None, warm: dict[str, Any], end: dict[str, Any],
             left: dict[str, Any], pre_kill: dict[str, Any] | None, warm2: dict[str, Any] | None,
             warm_round: int, warm2_round: int | None, kill_round: int | None, rounds: int) -> list[list[str]]:
    def row(label: str, what: str, a: dict[str, Any] | None, b: dict[str, Any] | None,
            after_left: dict[str, Any] | None) -> list[str]:
        a, b = a or {}, b or {}
        return [label, what, mib(a.get("VmRSS")), mib(b.get("VmRSS")), growth(a.get("VmRSS"), b.get("VmRSS")),
                f"{mib(a.get('RssAnon'))} -> {mib(b.get('RssAnon'))}",
                f"{mib(a.get('RssShmem'))} -> {mib(b.get('RssShmem'))}",
                f"{a.get('shm_maps', '-')} -> {b.get('shm_maps', '-')}",
                mib((after_left or {}).get("VmRSS")) if after_left is not None else "-"]

    out = []
    for label in labels:
        if label == victim and kill_round is not None:
            out.append(row(label, f"1st life: round {warm_round} -> {kill_round} (killed)", warm.get(label),
                           (pre_kill or {}).get(label), None))
            what = (f"2nd life: round {warm2_round} -> {rounds}" if warm2_round is not None
                    else "2nd life: no sample after its warm-up (run too short)")
            out.append(row(label, what, (warm2 or {}).get(label), end.get(label), left.get(label)))
        else:
            out.append(row(label, f"round {warm_round} -> {rounds}", warm.get(label), end.get(label),
                           left.get(label)))
    return out


def series_rows(labels: list[str], series: list[tuple[int, dict[str, Any]]], kill_at: int | None,
                victim: str | None) -> tuple[list[str], list[list[str]]]:
    """VmRSS and RssAnon (MiB) of every daemon at every checkpoint: a leak grows steadily, a high-water mark
    in steps."""
    header = ["daemon", "MiB"] + [f"@{r}" + ("*" if kill_at is not None and r > kill_at and victim else "")
                                  for r, _ in series]
    rows = []
    for label in labels:
        for key in ("VmRSS", "RssAnon"):
            rows.append([label, key] + [mib(s.get(label, {}).get(key)) for _, s in series])
    return header, rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10_000, help="rounds per rank (default 10000)")
    p.add_argument("--max-seconds", type=float, default=1800.0,
                   help="stop after this many seconds of rounds, report what ran (default 1800; 0: no limit)")
    p.add_argument("--victim", default="cpu", help="server to kill -9 and restart mid-run: cpu (the CPU-only one, "
                                                   "default), colocated (worker 0's), server-N, or none")
    p.add_argument("--seed", type=int, default=1, help="seed of the sizes and the data (default 1)")
    p.add_argument("--names", type=int, default=6, help="tensors per round (default 6)")
    p.add_argument("--max-elems", type=int, default=1 << 20, help="largest tensor, elements (default 1048576)")
    p.add_argument("--partition-bytes", type=int, default=256 << 10, help="cluster partition_bytes (default 256 KiB)")
    p.add_argument("--cluster-timeout", type=float, default=30.0, help="cluster timeout, seconds (default 30)")
    p.add_argument("--restart-delay", type=float, default=0.3,
                   help="seconds between the kill and the restart (default 0.3, a short RestartSec)")
    p.add_argument("--warmup-fraction", type=float, default=0.1,
                   help="share of the rounds after which the first RSS sample is taken (default 0.1)")
    p.add_argument("--log-dir", default=None, help="keep the daemons' logs (level info) here")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {DEFAULT_RESULTS}")
    p.add_argument("--output", default=None, help="append the section to this markdown file instead "
                                                  "(implies --write-results)")
    args = p.parse_args(argv)
    if args.rounds < 2 or args.names < 1 or args.max_elems < 1:
        p.error("--rounds must be at least 2, --names and --max-elems at least 1")
    if not 0 < args.warmup_fraction < 0.5:
        p.error("--warmup-fraction must be in (0, 0.5)")

    from bps_worker.supervise import Cluster, LaunchError
    from protocol.errors import ConfigError

    command_line = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    env_vars = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    if env_vars:
        command_line = shlex.join(f"{k}={v}" for k, v in env_vars.items()) + " " + command_line
    started = _dt.datetime.now().astimezone()
    info = machine()
    max_seconds = args.max_seconds if args.max_seconds > 0 else math.inf
    warm_round = max(1, int(args.rounds * args.warmup_fraction))
    kill_round_plan = args.rounds // 2

    with tempfile.TemporaryDirectory(prefix="bps-soak-") as tmp:
        log_dir = Path(args.log_dir).resolve() if args.log_dir else Path(tmp) / "logs"
        config_path = write_cluster_config(Path(tmp), args.partition_bytes, args.cluster_timeout)
        cluster = Cluster(str(config_path), log_level="info", log_dir=str(log_dir))
        try:
            cluster.start()
        except (ConfigError, LaunchError) as exc:
            print(f"soak: {exc}\n{log_tails(log_dir)}", file=sys.stderr)
            cluster.stop()
            return 2
        try:
            victim = victim_label(args.victim, cluster.config)
            outcome = drive(args, cluster, victim, warm_round, kill_round_plan, max_seconds, log_dir)
        finally:
            cluster.stop()
        outcome["restart_log"] = log_lines(log_dir, "restarted (its state is lost)")
        tails = log_tails(log_dir) if outcome["problem"] or outcome["wrong"] or outcome["failed"] else ""

    n = cluster.config.size
    labels = ([f"server-{s.id}" for s in cluster.config.servers]
              + [f"worker-{w.id}" for w in cluster.config.worker_specs])
    rounds_run = outcome["rounds"]
    rows = rss_rows(labels, victim, outcome["warm"], outcome["end"], outcome["left"], outcome["pre_kill"],
                    outcome["warm2"], outcome["warm_at"], outcome["warm2_at"], outcome["kill_at"], rounds_run)
    survivors = [r for r in rows if not r[1].startswith(("1st", "2nd"))]
    second = [r for r in rows if r[1].startswith("2nd")]

    def pct(text: str) -> float | None:
        return float(text.rstrip("%")) if text.endswith("%") else None

    worst = max([p for p in map(pct, (r[4] for r in survivors)) if p is not None], default=None)
    worst2 = max([p for p in map(pct, (r[4] for r in second)) if p is not None], default=None)
    reports = outcome["reports"]
    ops = sum(r["ops"] for r in reports.values())
    gbytes = sum(r["bytes"] for r in reports.values()) / 1e9
    ok = not outcome["problem"] and outcome["wrong"] == 0 and outcome["failed"] == 0 and len(reports) == n
    kill_text = (f"{victim} killed (SIGKILL) after round {outcome['kill_at']}, ready again after "
                 f"{outcome['restart_s']:.2f} s (restart delay {args.restart_delay:g} s)"
                 if outcome["kill_at"] is not None else
                 "no server killed" if victim is None else f"{victim} NOT killed (the run ended first)")
    stop_text = (f"stopped by --max-seconds {args.max_seconds:g} after round {rounds_run}"
                 if outcome["stopped_early"] else f"all {args.rounds} rounds")
    cluster_line = (f"N = {n} ranks (2 workers x 2 processes); 3 servers (2 colocated, 1 CPU-only); "
                    f"partition_bytes = {cluster.config.partition_bytes}; timeout = {cluster.config.timeout:g} s")
    workload_line = (f"{args.names} names per round, sizes log-uniform in [1, {args.max_elems}] float32 elements "
                     f"(seed {args.seed}; largest drawn {max((r['largest'] for r in reports.values()), default=0)}, "
                     f"{reports[0]['new_max'] if 0 in reports else 0} slot growths per rank), "
                     f"{ops} push_pulls in all, "
                     + (f"{gbytes:.1f} GB" if gbytes >= 1 else f"{gbytes * 1e3:.1f} MB") + " pushed by the ranks")
    machine_line = (f"nproc {info['nproc']}, CPU {info['cpu']}; Python {info['python']}, numpy {info['numpy']}"
                    + (f", numba {info['numba']}" if "numba" in info else "")
                    + (f", uvloop {info['uvloop']}" if "uvloop" in info else "") + f", Linux {info['kernel']}")
    per_round_ms = 1e3 * outcome["rounds_s"] / rounds_run if rounds_run else float("nan")
    summary = (f"summary: rounds {rounds_run}, wrong {outcome['wrong']}, failed {outcome['failed']} "
               f"(rounds with a wrong sum {outcome['wrong_rounds']}, with a failure {outcome['failed_rounds']}), "
               f"restart {'yes' if outcome['kill_at'] is not None else 'no'}, "
               f"max RSS growth {'-' if worst is None else f'{worst:+.1f}%'} (restarted server after its restart: "
               f"{'-' if worst2 is None else f'{worst2:+.1f}%'}), wall {outcome['wall_s']:.1f} s: "
               f"{'PASS' if ok else 'FAIL'}")

    print(f"date:     {started.isoformat(timespec='seconds')}")
    print(f"command:  {command_line}")
    print(f"machine:  {machine_line}")
    if "code" in info:
        print(f"code:     {info['code']}")
    print(f"cluster:  {cluster_line}")
    print(f"workload: {workload_line}")
    print(f"run:      {stop_text}; {kill_text}; rounds {outcome['rounds_s']:.1f} s ({per_round_ms:.1f} ms per round), "
          f"wall {outcome['wall_s']:.1f} s")
    for line in outcome["restart_log"]:
        print(f"log:      {line}")
    print()
    print(text_table(HEADER, rows, left=2))
    s_header, s_rows = series_rows(labels, outcome["series"], outcome["kill_at"], victim)
    if outcome["series"]:
        print(f"\nRSS every {max(1, int(args.rounds * args.warmup_fraction))} rounds (MiB; * = after {victim}'s "
              f"restart, a new process):" if victim else "\nRSS over the run (MiB):")
        print(text_table(s_header, s_rows, left=2))
    print()
    for rank, r in sorted(reports.items()):
        for e in r["errors"] + r["wrong_examples"]:
            print(f"rank {rank}: {e}")
    for problem in outcome["problem"]:
        print(f"problem: {problem}")
    if tails:
        print(f"\ndaemon logs (tails):\n{tails}", file=sys.stderr)
    print(summary)

    if args.write_results or args.output:
        target = Path(args.output) if args.output else DEFAULT_RESULTS
        text = target.read_text() if target.exists() else ""
        section = []
        if "## `soak.py`" not in text:
            section.append(RESULTS_SECTION_HEADER.rstrip("\n"))
        section += [
            *section_head(started, f"soak, {rounds_run} rounds, {args.victim} server killed mid-run", command_line,
                          machine_line),
        ]
        if "code" in info:
            section.append(f"- code: {info['code']}")
        section += [
            f"- cluster: {cluster_line} (generated, like `configs/local.toml`)",
            f"- workload: {workload_line}",
            f"- run: {stop_text}; {kill_text}; wall time {outcome['wall_s']:.0f} s "
            f"({per_round_ms:.1f} ms per round)",
            f"- result: **{outcome['wrong']} wrong sums, {outcome['failed']} failed push_pulls** "
            f"(of {ops}); " + ("PASS" if ok else "FAIL: " + "; ".join(outcome["problem"] or ["see above"])),
        ]
        section += [f"- log: `{line}`" for line in outcome["restart_log"]]
        section += ["", markdown_table(HEADER, rows, left=2), ""]
        if outcome["series"]:
            section += ["RSS over the run (MiB, sampled after the round shown" + (f"; * = {victim} after its restart, "
                        "a new process)" if victim else ")") + ":", "", markdown_table(s_header, s_rows, left=2), ""]
        append_section(target, section)
    return 0 if ok else 1 if not outcome["hung"] else 2


def drive(args: argparse.Namespace, cluster: Any, victim: str | None, warm_round: int, kill_round_plan: int,
          max_seconds: float, log_dir: Path) -> dict[str, Any]:
    """Run the ranks, kill and restart the victim mid-run, sample RSS; the numbers of the run."""
    ctx = mp.get_context("spawn")
    n = cluster.config.size
    control = ctx.Array("q", 1 + 2 * n)          # stop_at, started[n], done[n]
    control[0] = args.rounds
    results = ctx.Queue()
    release = ctx.Event()
    opts = {"size": n, "rounds": args.rounds, "seed": args.seed, "names": args.names, "max_elems": args.max_elems,
            "client_timeout": max(60.0, 2 * args.cluster_timeout), "release_timeout": 120.0}
    out: dict[str, Any] = {"warm": {}, "end": {}, "left": {}, "pre_kill": None, "warm2": None, "warm_at": warm_round,
                           "warm2_at": None, "kill_at": None, "restart_s": 0.0, "problem": [], "hung": False,
                           "stopped_early": False, "reports": {}, "series": []}
    procs = []
    for w in cluster.config.worker_specs:
        for local in range(w.local_size):
            rank = cluster.config.rank_offset(w.id) + local
            proc = ctx.Process(target=rank_main, args=(results, control, release, w.socket, local, rank, opts),
                               daemon=True, name=f"soak-rank-{rank}")
            proc.start()
            procs.append(proc)

    def done() -> int:
        return min(control[1 + n + r] for r in range(n))

    def stop_now() -> None:
        with control.get_lock():
            control[0] = min(control[0], max(control[1 + r] for r in range(n)))

    t0 = time.monotonic()
    hard_deadline = t0 + max_seconds + 3 * args.cluster_timeout + 120
    warm_time = t0 + args.warmup_fraction * max_seconds
    kill_time = t0 + max_seconds / 2
    warm2_due: tuple[int, float] | None = None
    last_print = t0
    every = max(1, int(args.rounds * args.warmup_fraction))
    next_checkpoint = every
    try:
        while len(out["reports"]) < n:
            now = time.monotonic()
            progress = done()
            if now > hard_deadline:
                out["problem"].append(f"the ranks hung: round {progress} after {now - t0:.0f} s "
                                      f"(progress per rank {[control[1 + n + r] for r in range(n)]})")
                out["hung"] = True
                break
            if now - t0 > max_seconds and not out["stopped_early"]:
                stop_now()
                out["stopped_early"] = True
            if progress >= next_checkpoint:
                out["series"].append((progress, sample(cluster)))
                next_checkpoint = (progress // every + 1) * every
            if not out["warm"] and (progress >= warm_round or now >= warm_time):
                out["warm"], out["warm_at"] = sample(cluster), progress
            if (victim is not None and out["kill_at"] is None and not out["stopped_early"]
                    and (progress >= kill_round_plan or now >= kill_time)):
                if not out["warm"]:
                    out["warm"], out["warm_at"] = sample(cluster), progress
                out["pre_kill"] = sample(cluster)
                out["kill_at"] = done()
                print(f"[soak] {now - t0:6.1f} s: round {out['kill_at']}: kill -9 {victim}", file=sys.stderr,
                      flush=True)
                t_kill = time.monotonic()
                cluster.kill(victim, signal.SIGKILL)
                time.sleep(args.restart_delay)
                try:
                    cluster.restart(victim)
                except Exception as exc:  # LaunchError: the daemon did not come back
                    out["problem"].append(f"restarting {victim} failed: {exc}")
                    stop_now()
                out["restart_s"] = time.monotonic() - t_kill
                print(f"[soak] {time.monotonic() - t0:6.1f} s: {victim} ready again", file=sys.stderr, flush=True)
                warm2_due = (done() + warm_round, time.monotonic() + args.warmup_fraction * max_seconds)
            if (warm2_due is not None and out["warm2"] is None
                    and (progress >= warm2_due[0] or now >= warm2_due[1]) and progress < control[0]):
                out["warm2"], out["warm2_at"] = sample(cluster), progress
            dead = cluster.dead_daemon()
            if dead is not None:
                out["problem"].append(f"{dead.label} exited with status {dead.proc.returncode}")
                stop_now()
                cluster.children.remove(dead)
            if now - last_print >= 30:
                print(f"[soak] {now - t0:6.1f} s: round {progress}", file=sys.stderr, flush=True)
                last_print = now
            try:
                rank, status, value = results.get(timeout=0.02)
            except _queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    out["problem"].append("rank processes died without reporting")
                    break
                continue
            if status == "ok":
                out["reports"][rank] = value
            else:
                out["problem"].append(f"rank {rank} crashed: {value}")
                out["reports"][rank] = {"rounds": 0, "ops": 0, "bytes": 0, "wrong": 0, "failed": 0,
                                        "wrong_rounds": 0, "failed_rounds": 0, "errors": [], "wrong_examples": [],
                                        "new_max": 0, "largest": 0}
                stop_now()
        out["rounds_s"] = time.monotonic() - t0
        out["end"] = sample(cluster)          # after the last round, the job still attached
        release.set()
        for proc in procs:
            proc.join(timeout=30)
        time.sleep(1.0)                        # let the workers' reset reach the servers
        out["left"] = sample(cluster)
    finally:
        release.set()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    out["wall_s"] = time.monotonic() - t0
    reports = out["reports"]
    rounds = {r["rounds"] for r in reports.values()}
    out["rounds"] = min(rounds) if rounds else 0
    if len(rounds) > 1:
        out["problem"].append(f"ranks ran different numbers of rounds: {sorted(rounds)}")
    expected = min(args.rounds, control[0])
    if out["rounds"] < expected and not out["hung"]:
        out["problem"].append(f"only {out['rounds']} of {expected} rounds ran")
    # wrong/failed are counted per push_pull on every rank; a round counts once if any rank saw it go wrong
    out["wrong"] = sum(r["wrong"] for r in reports.values())
    out["failed"] = sum(r["failed"] for r in reports.values())
    out["wrong_rounds"] = max((r["wrong_rounds"] for r in reports.values()), default=0)
    out["failed_rounds"] = max((r["failed_rounds"] for r in reports.values()), default=0)
    if victim is not None and out["kill_at"] is None and not out["problem"]:
        out["problem"].append(f"{victim} was never killed")
    return out


if __name__ == "__main__":
    sys.exit(main())
