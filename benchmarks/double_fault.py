"""Soak: a worker machine that dies and comes back while the servers die too (a double fault).

    .venv/bin/python benchmarks/double_fault.py                                   # every schedule, 3 reps each
    .venv/bin/python benchmarks/double_fault.py --sched test --reps 1 --names 1   # smoke test (seconds)
    .venv/bin/python benchmarks/double_fault.py --sched early --names 3 --elems 1000

The driver writes a private cluster file: ``--workers`` machines of one training process each, a server
colocated with each plus one CPU-only one, partitions of 256 KiB, ``cluster.timeout`` of ``--timeout``. Every
rank runs steps of ``--names`` names of ``--elems`` float64 each (1000: fused; 200003: partitioned over every
server): rank ``r`` pushes a base of its own plus ``step * 1000**r``, so each sum says which step of every rank
it holds. Once the servers completed a few rounds, the last machine's worker daemon is killed (its process fails
and ends), and then, by ``--sched``:

- ``test``: every server killed and restarted, then the machine's daemon and a new training process on it (the
  order of ``tests/daemons/test_worker_rejoin.py``);
- ``early``: every server killed; the machine's daemon and its new process started; ``--delay`` seconds later
  the servers restarted, one after the other;
- ``stagger``: every server killed; the first restarted; the machine's daemon and its new process; ``--delay``
  seconds later the other servers.
- ``machine``: not a double fault but the common machine crash: only the machine's own colocated server is
  killed with its daemon; ``--delay`` seconds later the machine is back (its server, its daemon, its new
  process), while the other servers served the healthy process all along.

The healthy processes train until they have been summed with ``--steps`` steps of the new process; the new one
until ``--steps`` of its steps went through (it numbers them from 500, the victim from 0: a healthy process
tells them apart whichever of them failed). Expected: every sum exact; after the restart each process sees
every other process's steps one after the other, and the same step of it in every name of a step (a name a step
off the others is a silent drift); the new process's steps may fail while a server is down (longer than the
timeout: ``--delay``), none after its first sum; no hang.

Exit status: 0 if every rep was as expected, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

M = 1000  # rank r's step is digit r of every sum, base M
NEW_FIRST = 500  # the new process's first step: its steps are told from the victim's by value
SCHEDULES = ("test", "early", "stagger", "machine")


def bases(opts: dict[str, Any]) -> dict[tuple[int, int], Any]:
    """Each (rank, name)'s base: integers, the same in every process."""
    import numpy as np

    return {(r, j): np.random.default_rng(1000 * r + j).integers(-1000, 1000, opts["elems"]).astype(np.float64)
            for r in range(opts["workers"]) for j in range(opts["names"])}


def decode(y: Any, total: Any, workers: int) -> tuple[int, ...] | None:
    """The step of every rank that sum ``y`` holds; None for a wrong sum."""
    s = y - total
    v = s[0]
    if not (s == v).all() or v < 0 or v != int(v):
        return None
    return tuple(int(v) // M ** r % M for r in range(workers))


def run_step(bps: Any, step: int, rank: int, opts: dict[str, Any], base: Any, totals: list[Any],
             out: dict[str, Any]) -> bool:
    """One step of every name; its record in ``out``; whether it failed."""
    handles = [bps.push_pull_async(base[(rank, j)] + step * float(M ** rank), f"df.{j}", average=False)
               for j in range(opts["names"])]
    got: list[tuple[int, ...]] = []
    failed = False
    for j, handle in enumerate(handles):
        try:
            y = bps.synchronize(handle)
        except bps.BPSError as exc:
            out["errors"].append((step, j, str(exc)[:300]))
            failed = True
            continue
        steps = decode(y, totals[j], opts["workers"])
        if steps is None:
            out["bad"].append((step, j))
        else:
            got.append(steps)
    if got and not failed:
        out["seen"].append((step, got))
    return failed


def rank_main(queue: Any, sock: str, role: str, opts: dict[str, Any]) -> None:
    """A training process: ``healthy``, ``victim`` (until its daemon dies) or ``new`` (``steps`` steps)."""
    import bps_worker.client as bps

    out: dict[str, Any] = {"role": role, "seen": [], "errors": [], "bad": [], "crash": ""}
    try:
        bps.init(socket=sock, local_rank=0)
        rank = bps.rank()
        base = bases(opts)
        totals = [sum(base[(r, j)] for r in range(opts["workers"])) for j in range(opts["names"])]
        victim = opts["workers"] - 1
        deadline = time.monotonic() + opts["seconds"]
        step = NEW_FIRST if role == "new" else 0
        while time.monotonic() < deadline:
            failed = run_step(bps, step, rank, opts, base, totals, out)
            step += 1
            if role == "victim" and failed:
                break
            if role == "new" and len(out["seen"]) >= opts["steps"]:
                break
            back = [s[0][victim] for _, s in out["seen"] if s[0][victim] >= NEW_FIRST]
            if role == "healthy" and len(back) >= opts["steps"]:
                break
            if failed:
                time.sleep(0.05)
        bps.shutdown()
    except Exception as exc:  # reported, not raised: the driver judges
        out["crash"] = repr(exc)
    queue.put((rank if out["crash"] == "" else -1, out))


def problems_of(out: dict[str, Any], opts: dict[str, Any]) -> list[str]:
    """What is wrong in one process's report (besides its errors, judged by role)."""
    found = []
    if out["crash"]:
        found.append(f"{out['role']} crashed: {out['crash']}")
    if out["bad"]:
        found.append(f"{out['role']}: wrong sums at (step, name) {out['bad'][:4]}")
    drift = [(step, steps) for step, steps in out["seen"] if len(set(steps)) > 1]
    if drift:
        found.append(f"{out['role']}: names of one step hold different steps (drift) {drift[:3]}")
    if out["role"] == "new":  # (its steps may fail while a server is down, not once one went through)
        first = out["seen"][0][0] if out["seen"] else None
        late = [e for e in out["errors"] if first is None or e[0] > first]
        if late:
            found.append(f"new: {len(late)} errors after its first sum, first {late[:2]}")
        peer = [steps[0][0] for _, steps in out["seen"]]
        if len(peer) < opts["steps"] or peer != list(range(peer[0], peer[0] + len(peer))):
            found.append(f"new: the healthy process's steps {peer[:20]}")
    if out["role"] == "healthy":
        back = [steps[0][-1] for _, steps in out["seen"]]
        after = [b for b in back if b >= NEW_FIRST]  # (a victim's step after one of the new's: wrong order)
        if (len(after) < opts["steps"] or after != list(range(after[0], after[0] + len(after)))
                or back[len(back) - len(after):] != after):
            found.append(f"healthy: the restarted machine's steps {back[-opts['steps'] - 4:]}")
    return found


def chaos(cluster: Any, opts: dict[str, Any], start_new: Any) -> None:
    """Kill the last machine's daemon and the servers, bring them back by ``opts['sched']``."""
    servers = [f"server-{s.id}" for s in cluster.config.servers]
    victim = f"worker-{opts['workers'] - 1}"
    if opts["sched"] == "machine":
        own = [f"server-{s.id}" for s in cluster.config.servers if s.worker == opts["workers"] - 1]
        for label in own:
            cluster.kill(label)
        time.sleep(opts["delay"])
        for label in own:
            cluster.restart(label)
        cluster.restart(victim)
        start_new()
        return
    for label in servers:
        cluster.kill(label)
    if opts["sched"] == "test":
        for label in servers:
            cluster.restart(label)
        cluster.restart(victim)
        start_new()
        return
    if opts["sched"] == "stagger":
        cluster.restart(servers[0])
        servers = servers[1:]
    back = threading.Thread(target=cluster.restart, args=(victim,))  # (ready once every server answers)
    back.start()
    time.sleep(0.5)
    start_new()
    time.sleep(opts["delay"])
    for label in servers:
        cluster.restart(label)
    back.join()


def collect(queue: Any, count: int, until: float) -> list[dict[str, Any]]:
    """Up to ``count`` reports, until ``until`` (monotonic)."""
    reports: list[dict[str, Any]] = []
    while len(reports) < count and time.monotonic() < until:
        try:
            reports.append(queue.get(timeout=max(0.1, until - time.monotonic()))[1])
        except Exception:
            break
    return reports


def run_rep(rep: int, opts: dict[str, Any]) -> list[str]:
    """One job on a fresh cluster through one double fault: what went wrong."""
    from bps_worker.cluster_file import write_config
    from bps_worker.observer import server_stats
    from bps_worker.supervise import Cluster

    with tempfile.TemporaryDirectory(prefix="bps-double-fault-") as tmp:
        path = write_config(Path(tmp), [1] * opts["workers"],
                            cluster={"timeout": opts["timeout"], "partition_bytes": 256 * 1024})
        cluster = Cluster(str(path), log_level="info", log_dir=str(Path(tmp) / "logs"))
        cluster.start()
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs: list[Any] = []

        def start(worker: int, role: str) -> None:
            p = ctx.Process(target=rank_main, args=(queue, cluster.socket_path(worker), role, opts), daemon=True)
            p.start()
            procs.append(p)

        try:
            for w in range(opts["workers"]):
                start(w, "victim" if w == opts["workers"] - 1 else "healthy")
            deadline = time.monotonic() + 60
            while sum(st["rounds_completed"] for st in server_stats(cluster).values()) < 4 * opts["names"]:
                if time.monotonic() > deadline:
                    return ["the job did not start within 60 s"]
                time.sleep(0.05)
            cluster.kill(f"worker-{opts['workers'] - 1}")
            victim = collect(queue, 1, time.monotonic() + 30)
            chaos(cluster, opts, lambda: start(opts["workers"] - 1, "new"))
            reports = victim + collect(queue, opts["workers"], time.monotonic() + opts["seconds"] + 30)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
            cluster.stop()
        found = [f"{opts['workers'] + 1 - len(reports)} of {opts['workers'] + 1} processes never reported (a hang)"
                 ] if len(reports) < opts["workers"] + 1 else []
        found += [p for out in reports for p in problems_of(out, opts)]
        if found and opts["keep_logs"]:
            kept = Path(opts["keep_logs"]) / f"{opts['sched']}-{rep}"
            shutil.copytree(Path(tmp) / "logs", kept, dirs_exist_ok=True)
            (kept / "reports.json").write_text(json.dumps(reports, indent=1))  # every step's sums and errors
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sched", default=",".join(SCHEDULES), help="schedules (default: all of them)")
    ap.add_argument("--reps", type=int, default=3, help="jobs per schedule (default 3)")
    ap.add_argument("--workers", type=int, default=2, help="worker machines (default 2)")
    ap.add_argument("--names", type=int, default=3, help="names a step (default 3)")
    ap.add_argument("--elems", type=int, default=200_003, help="float64 elements a name (default 200003)")
    ap.add_argument("--steps", type=int, default=8, help="steps of the new process (default 8)")
    ap.add_argument("--timeout", type=float, default=4.0, help="the cluster's timeout (default 4 s)")
    ap.add_argument("--delay", type=float, default=6.0, help="seconds the servers stay down (default 6)")
    ap.add_argument("--seconds", type=float, default=90.0, help="longest a process trains (default 90)")
    ap.add_argument("--keep-logs", default="", help="copy the daemons' logs of a failed job, and every process's "
                                                     "steps (reports.json), to DIR/SCHED-REP")
    opts = vars(ap.parse_args())
    failed = 0
    total = 0
    for sched in opts.pop("sched").split(","):
        for rep in range(opts["reps"]):
            found = run_rep(rep, {**opts, "sched": sched})
            total += 1
            failed += bool(found)
            print(f"{sched} rep {rep}: " + ("ok" if not found else "FAILED: " + "; ".join(found)), flush=True)
    print(f"{total - failed} of {total} jobs as expected")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
