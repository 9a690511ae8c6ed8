"""Soak: steps of names that straddle the fusion limit while servers die and connections drop.

    .venv/bin/python benchmarks/fault_soak.py                                  # 20 seeds of 20 steps, 3 faults each
    .venv/bin/python benchmarks/fault_soak.py --seeds 1 --steps 6 --faults 2   # smoke test (seconds)
    .venv/bin/python benchmarks/fault_soak.py --kinds drop --mismatch 0.1      # only dropped connections, mismatches

The driver writes a private cluster file shaped like configs/local.toml (2 worker daemons x 2 training
processes, one Summation Service colocated with each worker plus one CPU-only one; the default 4 MiB partitions,
so tensors of at most 64 KiB are fused) and runs one job per seed: one rank process per training process.

Each step, every rank draws the same plan from the seed: a few names out of a small pool (a name comes back in
later steps, often with another size or dtype), each with a size drawn mostly below the fusion limit (1 to
16,384 float32) and now and then above it (16,385 to 200,000), and a dtype. With ``--mismatch P`` about one
name in 1/P is a *mismatch* (as in mismatch_soak.py: one rank pushes it with another shape, dtype or size on
the other side of the fusion limit). Every rank issues its names in an order of its own, then synchronizes them
all. Data are integers that differ by element, name, step and rank: every sum is known exactly.

Faults (``--faults`` per seed, at steps drawn from the seed, ``--kinds`` of them), injected by the driver once
every rank has started the step (after a random delay of up to 50 ms, so mostly with rounds in flight):

- ``kill-cpu``: SIGKILL to the CPU-only server, restarted 0.3 s later (as systemd's Restart=on-failure would);
- ``kill-colocated``: the same to the server colocated with a worker (drawn);
- ``freeze-kill``: SIGSTOP to a server (drawn) so that pushes surely wait on it, SIGKILL 0.3 s later, restart;
- ``kill-drop``: ``kill-cpu`` or ``kill-colocated`` (drawn), then at once a worker's new connection to the
  restarted server reset (mid-replay);
- ``drop``: every TCP connection between one worker daemon and one server (both drawn) destroyed with
  ``ss -K`` (root only; the kernel resets them): the same server run answers the reconnect;
- ``drop-all``: the same for every worker daemon's connections to one server (drawn) at once.

Kinds that drop connections are left out when not root.

A server restart must be transparent: every sum exact, as if nothing happened. A dropped connection may fail
the names of the steps in flight when it was dropped (a BPSError, never a wrong sum); every later step must be
exact again. A mismatched name must fail with a BPSError on every process. No step may hang: a step whose names
are not all answered within ``--step-timeout`` is a hang; the driver prints the names, what every rank got in
its last two steps, the daemons' logs, and stops (``--keep-logs DIR`` keeps a failed seed's logs whole).

Exit status: 0 if every step of every seed was as above, 1 otherwise, 2 if a cluster could not start.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mismatch_soak as ms  # noqa: E402  (its plan of a step, and what the bad rank pushes)

# Mostly fused (<= 16,384 float32, 8,192 float64), now and then not.
SIZES = (1, 4, 100, 1000, 4000, 8192, 8193, 16383, 16384, 16385, 20000, 200000)
WEIGHTS = (3, 3, 3, 3, 2, 2, 1, 2, 2, 1, 1, 1)
POOL = 24  # names f0..f23
KINDS = ("kill-cpu", "kill-colocated", "freeze-kill", "kill-drop", "drop", "drop-all")
RESTART_DELAY_S = 0.3


def plan(seed: int, step: int, size: int, mismatch: float) -> list[tuple[str, int, str, int, str]]:
    """The step's names, the same on every rank (mismatch_soak.plan, with this soak's names and sizes)."""
    return ms.plan(seed, step, size, mismatch=mismatch, prefix="f", pool=POOL, most=14, sizes=SIZES, weights=WEIGHTS)


def base(seed: int, step: int, name: str, count: int) -> Any:
    """Integers in [0, 60], by element, name and step: rank r pushes base + r + 1."""
    import numpy as np

    return (np.arange(count, dtype=np.int64) * 7 + seed * 3 + step * 5 + int(name[1:]) * 11) % 61


# --------------------------------------------------------------------------------------------------------------
# rank program (a spawned process per training process)
# --------------------------------------------------------------------------------------------------------------
def run_step(bps: Any, opts: dict[str, Any], step: int, rank: int, size: int) -> list[tuple[int, str, str]]:
    """One step of this rank: (step, name, outcome) for every planned name; outcome ``exact``, ``wrong: ...``,
    ``error: ...`` or ``hang``."""
    import numpy as np

    seed = opts["seed"]
    names = plan(seed, step, size, opts["mismatch"])
    order = list(range(len(names)))
    random.Random(seed * 7919 + step * 31 + rank).shuffle(order)
    handles = {}
    for i in order:
        name, count, dtype, bad, how = names[i]
        c, d = ms.mine(rank, count, dtype, bad, how)
        handles[i] = bps.push_pull_async((base(seed, step, name, c) + rank + 1).astype(d), name, average=False)
    deadline = time.monotonic() + opts["step_timeout"]
    out = []
    for i in range(len(names)):
        name, count, dtype = names[i][:3]
        try:
            got = bps.synchronize(handles[i], timeout=max(0.01, deadline - time.monotonic()))
        except bps.BPSTimeoutError as exc:
            hung = time.monotonic() >= deadline - 0.05
            out.append((step, name, "hang" if hung else f"error: {type(exc).__name__}: {exc}"[:400]))
            continue
        except bps.BPSError as exc:
            out.append((step, name, f"error: {type(exc).__name__}: {exc}"[:400]))
            continue
        want = base(seed, step, name, count) * size + size * (size + 1) // 2
        if got.shape != (count,) or got.dtype != np.dtype(dtype) or not (got == want).all():
            where = np.flatnonzero(got != want)[:4].tolist() if got.shape == want.shape else "shape"
            out.append((step, name, f"wrong: {got.shape} {got.dtype} at {where}: {got[:4].tolist()}"))
        else:
            out.append((step, name, "exact"))
    return out


def rank_main(results: Any, progress: Any, slot: int, sock: str, local_rank: int, opts: dict[str, Any]) -> None:
    import bps_worker.client as bps

    records: list[tuple[int, str, str]] = []
    problem = ""
    rank = -1
    try:
        bps.init(socket=sock, local_rank=local_rank)
        rank, size = bps.rank(), bps.size()
        for step in range(opts["steps"]):
            progress[slot] = step
            records += run_step(bps, opts, step, rank, size)
            if any(r[2] == "hang" for r in records):
                break
        progress[slot] = opts["steps"]
        bps.shutdown()
    except Exception as exc:  # reported, never raised: the driver must hear every rank
        problem = f"rank {rank} (local {local_rank}): {type(exc).__name__}: {exc}"[:600]
    progress[slot] = opts["steps"]
    results.put({"slot": slot, "rank": rank, "records": records, "problem": problem})


# --------------------------------------------------------------------------------------------------------------
# faults
# --------------------------------------------------------------------------------------------------------------
@dataclass
class Fault:
    step: int
    kind: str
    delay: float
    target: str = ""  # what was hit: "server-2", "worker-0/server-1 (3 connections)"
    lo: int = -1      # the lowest step a rank was at when the fault hit
    hi: int = -1      # the highest step a rank was at once it was over (the server ready again)
    problem: str = ""

    def describe(self) -> str:
        where = f" steps {self.lo}-{self.hi}" if self.lo >= 0 else " (never injected)"
        return f"{self.kind} {self.target}{where}" + (f" [{self.problem}]" if self.problem else "")


def fault_plan(seed: int, steps: int, faults: int, kinds: list[str]) -> list[Fault]:
    rng = random.Random(seed * 104729 + 17)
    chosen = sorted(rng.sample(range(1, max(2, steps - 1)), min(faults, max(1, steps - 2))))
    return [Fault(step, rng.choice(kinds), rng.uniform(0.0, 0.05)) for step in chosen]


def drop_connections(cluster: Any, workers: list[int], server: int) -> int:
    """Destroy every established TCP connection of daemons ``worker-N`` (N in ``workers``) to server ``server``
    (``ss -K``, as root: the kernel resets them): how many there were."""
    pids = {cluster.supervisor.daemon(f"worker-{w}").proc.pid for w in workers}
    port = int(cluster.config.servers[server].address.rsplit(":", 1)[1])
    listing = subprocess.run(["ss", "-tnpH", "state", "established", "dport", "=", f":{port}"],
                             capture_output=True, text=True, check=True).stdout
    local_ports = [int(m.group(1)) for line in listing.splitlines() if any(f"pid={pid}," in line for pid in pids)
                   if (m := re.search(r":(\d+)\s+\S+:\d+\s", line))]
    for lport in local_ports:
        subprocess.run(["ss", "-K", "state", "established", "dport", "=", f":{port}", "sport", "=", f":{lport}"],
                       capture_output=True, check=True)
    return len(local_ports)


def kill_and_restart(cluster: Any, label: str, freeze: bool) -> None:
    if freeze:
        cluster.kill(label, signal.SIGSTOP)
        time.sleep(RESTART_DELAY_S)
    cluster.kill(label)
    time.sleep(RESTART_DELAY_S)
    cluster.restart(label)


def inject(cluster: Any, fault: Fault, rng: random.Random) -> None:
    """Do ``fault`` to the cluster; for a server, wait until it is ready again."""
    config = cluster.config
    cpu = [s.id for s in config.servers if s.worker is None]
    colocated = [s.id for s in config.servers if s.worker is not None]
    workers = [w.id for w in config.worker_specs]
    if fault.kind in ("drop", "drop-all"):
        server = rng.choice(cpu + colocated)
        hit = workers if fault.kind == "drop-all" else [rng.choice(workers)]
        fault.target = f"worker-{'+'.join(map(str, hit))}/server-{server} " \
                       f"({drop_connections(cluster, hit, server)} connections)"
        return
    sid = rng.choice(cpu if fault.kind == "kill-cpu" else colocated if fault.kind == "kill-colocated"
                     else cpu + colocated)
    fault.target = f"server-{sid}"
    kill_and_restart(cluster, f"server-{sid}", fault.kind == "freeze-kill")
    if fault.kind == "kill-drop":  # and at once drop a worker's new connection (mid-replay, mid-resync)
        worker = rng.choice(workers)
        time.sleep(rng.uniform(0.0, 0.03))
        fault.target += f", then worker-{worker}'s ({drop_connections(cluster, [worker], sid)} connections)"


def chaos(cluster: Any, progress: Any, faults: list[Fault], steps: int, seed: int, ended: threading.Event) -> None:
    """The driver's thread: each fault once every rank has started its step (or the job ended)."""
    rng = random.Random(seed * 31337 + 5)
    for fault in faults:
        while min(progress) < fault.step:
            if ended.wait(0.005):
                return
        time.sleep(fault.delay)
        if min(progress) >= steps:
            return
        fault.lo = min(progress)
        try:
            inject(cluster, fault, rng)
        except Exception as exc:
            fault.problem = f"{type(exc).__name__}: {exc}"[:300]
        fault.hi = max(progress)


# --------------------------------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    exact: int = 0
    planned: int = 0   # mismatches that failed, as planned
    excused: int = 0   # errors in a step a dropped connection hit
    problems: list[str] = field(default_factory=list)
    hang: bool = False


def judge(seed: int, opts: dict[str, Any], reports: list[dict[str, Any]], faults: list[Fault],
          size: int) -> Verdict:
    """Every rank's outcomes against the plan and the faults."""
    v = Verdict()
    drops = [(f.lo, f.hi + 1) for f in faults if "drop" in f.kind and f.lo >= 0]
    for r in reports:
        v.problems += [r["problem"]] if r["problem"] else []
        for step, name, outcome in r["records"]:
            bad = {n: b for n, _, _, b, _ in plan(seed, step, size, opts["mismatch"])}[name]
            what = f"rank {r['rank']}: seed {seed} step {step} {name}"
            if outcome == "hang":
                v.hang = True
                v.problems.append(f"{what}: no answer in {opts['step_timeout']:g} s (a hang)")
            elif outcome.startswith("wrong"):
                v.problems.append(f"{what}: {outcome}")
            elif bad >= 0:
                v.planned += outcome.startswith("error")
                v.problems += [f"{what}: summed although rank {bad} disagreed"] if outcome == "exact" else []
            elif outcome == "exact":
                v.exact += 1
            elif any(lo <= step <= hi for lo, hi in drops):
                v.excused += 1
            else:
                v.problems.append(f"{what}: {outcome}")
    return v


def last_steps(reports: list[dict[str, Any]]) -> str:
    """What every rank got in the last two steps it ran (printed with a hang)."""
    out = []
    for r in sorted(reports, key=lambda r: r["rank"]):
        last = max((step for step, _, _ in r["records"]), default=0)
        for step in (last - 1, last):
            got = [f"{name} {outcome[:60]}" for s, name, outcome in r["records"] if s == step]
            out.append(f"rank {r['rank']} step {step}: " + "; ".join(got))
    return "\n".join(out)


def daemon_logs(log_dir: Path, chars: int = 4000) -> str:
    """The tail of every daemon's log (tests/harness.py's ``daemon_logs``)."""
    return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-chars:] for p in sorted(log_dir.iterdir()))


def run_job(cluster: Any, opts: dict[str, Any], faults: list[Fault]) -> list[dict[str, Any]]:
    """The ranks of one job, with the chaos thread beside them: their reports."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    slots = [(w.id, local) for w in cluster.config.worker_specs for local in range(w.local_size)]
    progress = ctx.Array("i", [-1] * len(slots), lock=False)
    procs = [ctx.Process(target=rank_main, args=(results, progress, i, cluster.socket_path(w), local, opts),
                         daemon=True) for i, (w, local) in enumerate(slots)]
    ended = threading.Event()
    thread = threading.Thread(target=chaos, args=(cluster, progress, faults, opts["steps"], opts["seed"], ended))
    for p in procs:
        p.start()
    thread.start()
    try:
        reports = ms.collect(results, procs, time.monotonic() + opts["steps"] * opts["step_timeout"] + 60)
    finally:
        ended.set()
        thread.join()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if len(reports) < len(procs):
        reports.append({"rank": -1, "records": [], "problem":
                        f"{len(procs) - len(reports)} of {len(procs)} ranks never reported (a hang)"})
    return reports


def run_seed(seed: int, opts: dict[str, Any]) -> tuple[Verdict, list[Fault], str]:
    """One job of ``opts['steps']`` steps on a fresh cluster: the verdict, the faults, the daemons' logs (where
    something went wrong)."""
    from bps_worker.cluster_file import write_config
    from bps_worker.supervise import Cluster

    opts = dict(opts, seed=seed)
    faults = fault_plan(seed, opts["steps"], opts["faults"], opts["kinds"])
    with tempfile.TemporaryDirectory(prefix="bps-fault-soak-") as tmp:
        keys = {"timeout": opts["timeout"]}
        if opts["stall_timeout"]:
            keys["stall_timeout"] = opts["stall_timeout"]
        config = write_config(Path(tmp), [2, 2], cpu_servers=1, cluster=keys)
        log_dir = Path(tmp) / "logs"
        cluster = Cluster(str(config), log_level="info", log_dir=str(log_dir))
        cluster.start()
        try:
            reports = run_job(cluster, opts, faults)
        finally:
            cluster.stop()
        verdict = judge(seed, opts, reports, faults, cluster.config.size)
        verdict.hang = verdict.hang or any("never reported" in r["problem"] for r in reports)
        verdict.problems += [f"fault {f.describe()}" for f in faults if f.problem]
        logs = daemon_logs(log_dir) if verdict.problems else ""
        if verdict.problems and opts["keep_logs"]:
            shutil.copytree(log_dir, Path(opts["keep_logs"]) / f"seed{seed}", dirs_exist_ok=True)
        logs = (last_steps(reports) + "\n" + logs) if verdict.hang else logs
    return verdict, faults, logs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=20, help="jobs, one cluster each (default 20)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=20, help="steps per job (default 20)")
    p.add_argument("--step-timeout", type=float, default=30.0,
                   help="seconds a step's names may take before they count as a hang (default 30)")
    p.add_argument("--timeout", type=float, default=6.0, help="the cluster file's timeout (default 6 s)")
    p.add_argument("--faults", type=int, default=3, help="faults per seed (default 3)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"faults to draw from (default {','.join(KINDS)})")
    p.add_argument("--mismatch", type=float, default=0.0, help="share of mismatched names (default 0)")
    p.add_argument("--stall-timeout", type=float, default=0.0,
                   help="the cluster file's stall_timeout (default 0: none); no fault must make a round fail by it")
    p.add_argument("--keep-logs", default="", help="copy the daemons' logs of a failed seed to DIR/seed<N>")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    if any("drop" in k for k in kinds) and os.geteuid() != 0:
        print("dropping connections needs root (ss -K): left out")
        kinds = [k for k in kinds if "drop" not in k] or ["kill-cpu"]
    opts = {"steps": args.steps, "step_timeout": args.step_timeout, "timeout": args.timeout,
            "faults": args.faults, "kinds": kinds, "mismatch": args.mismatch,
            "keep_logs": args.keep_logs, "stall_timeout": args.stall_timeout}
    failing = ran = 0
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        try:
            v, faults, logs = run_seed(seed, opts)
        except Exception as exc:
            print(f"seed {seed}: the cluster could not start: {type(exc).__name__}: {exc}")
            return 2
        ran += 1
        failing += bool(v.problems)
        print(f"seed {seed}: {'FAILED' if v.problems else 'ok'}: {v.exact} exact sums, {v.planned} mismatch "
              f"errors as planned, {v.excused} errors after a dropped connection; faults: "
              + "; ".join(f.describe() for f in faults), flush=True)
        for problem in v.problems[:12]:
            print(f"  {problem}")
        if v.hang:
            print(f"seed {seed} hung: the daemons' logs\n{logs}")
            break
    print(f"{ran - failing} of {ran} seeds as expected" + (" (stopped at a hang)" if ran < args.seeds else ""))
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
