"""The paper's experiment on one box: BytePS against ring all-reduce on emulated machines with shaped links.

    sudo .venv/bin/python benchmarks/paper_vs_allreduce.py                    # n = 4, k = 0,1,2,4, PS k = 2
    sudo .venv/bin/python benchmarks/paper_vs_allreduce.py --write-results    # also RESULTS.md + a PNG plot
    sudo .venv/bin/python benchmarks/paper_vs_allreduce.py --size 1M --reps 2 --ks 0,1 --ps-ks ""  # smoke
    sudo .venv/bin/python benchmarks/paper_vs_allreduce.py --write-results \
        --sweep "n=4:200mbit,500mbit,1gbit;n=8:100mbit:k=0,4,8"              # issue 15's sweep

Root only (network namespaces, veth pairs, tc). ``benchmarks/cluster`` emulates ``n`` worker machines plus
up to ``max(k)`` CPU-only machines: one network namespace each, a veth pair to a private bridge, and a tbf
shaper at ``--bandwidth`` B on both ends of every veth, so every machine has a full-duplex link of B
(addresses 10.77.0.0/24 inside the namespaces only; everything is deleted at the end, also on failure).

A sweep: ``--ns 4,8 --bandwidths 200mbit,1gbit`` runs every configuration at every (n, B), or ``--sweep``
gives each n its own bandwidths (and ks). Every (n, B) gets a network of its own, built for it and deleted
after it, as in a run of that (n, B) alone. ``--ks`` / ``--ps-ks`` take ``n``-relative tokens (``0,n/2,n``);
a k too large for an n is skipped for that n. After the per-(n, B) tables, one summary over the whole run:
measured / theory for both systems, CPU-seconds per operation by machine role (a GPU machine: its worker
daemon, colocated server and rank; a CPU-only machine: its server; a gloo rank), bytes per link against
Theorem 1; with several (n, B) the plot is measured / theory against B, one panel per n.

For each configuration a cluster file is generated, ``bps-server`` / ``bps-worker`` run inside the machines'
namespaces, and one rank process per worker machine runs inside that machine's namespace. Each rank is a
bps client (Unix socket to its machine's worker daemon) and a member of one gloo group over the shaped links
(MASTER_ADDR = worker 0's address, GLOO_SOCKET_IFNAME = the machine's veth). Configurations:

- ``k`` in ``--ks``: the unified architecture, one Summation Service colocated on every worker machine plus
  ``k`` CPU-only machines (Theorem 1 split); theory ``t_opt = 2n(n-1)M / ((n^2 + kn - 2k) B)``.
- ``PS k`` in ``--ps-ks``: a plain parameter server, servers only on ``k`` CPU-only machines (an even split);
  theory ``max(M/B, nM/(kB))`` (PAPER.md).

Per configuration: ``--warmup`` rounds of each system (the first checks that bps's sum is exact and equals
gloo's), then ``--reps`` times ``start together; bps push_pull(a, out=a); start together; gloo
all_reduce(t)``, alternating, both in place (``a`` a ``bps.shared_array``; ``--copy``: a plain array and
``out=``) (../shared/MEASURING.md). Starting together: a barrier, then every rank waits for an instant that
rank 0 broadcast (``start_together``). Time of a repetition = the last rank's end minus that instant;
reported: median (min-max). Gloo's theory is
``2(n-1)M/(nB)``; its measured/theory ratio is the soundness check (within 15%: the cores are not the
bottleneck and the links behave as B). Also measured per repetition: bytes on every machine's link (tc-side
counters, headers included), CPU-seconds of every daemon and rank (the kernel's CPU clock of each process),
and how busy the box's cores were.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.append(str(REPO))  # benchmarks.cluster; bps_* come from the environment (PYTHONPATH, then the install)

from push_pull_vs_gloo import ENV_PREFIXES, human, parse_size, pattern  # noqa: E402
from report import append_section, machine, markdown_table, section_head, text_table  # noqa: E402

DEFAULT_RESULTS = REPO / "benchmarks" / "RESULTS.md"
DEFAULT_PLOT = REPO / "benchmarks" / "paper_vs_allreduce.png"
DEFAULT_SWEEP_PLOT = REPO / "benchmarks" / "paper_vs_allreduce_sweep.png"
SOUND_TOLERANCE = 0.15
GLOO_PORT = 29500
START_AHEAD_S = 0.05  # see start_together
CLK_TCK = os.sysconf("SC_CLK_TCK")

RESULTS_HEADER = """
## `paper_vs_allreduce.py`
The paper's experiment (../shared/MEASURING.md, "The paper's experiment on one machine"): `n` worker machines
and `k` CPU-only machines emulated by `benchmarks/cluster/` (one network namespace per machine, a veth pair to a
private bridge, `tc tbf` at bandwidth `B` on both ends of every veth: full-duplex links of `B`). One rank
process per worker machine, each a bps client of its machine's worker daemon and a gloo group member over the
shaped links. Per configuration: warm-up (also checks bps's sum is exact and equals gloo's), then repetitions of
`barrier; bps push_pull (float32, average=False, in place in a shared_array since 2026-11-30 03:40, as gloo's
all_reduce is in its tensor; before, and with `--copy`: a plain array and `out=`); barrier; gloo all_reduce`,
alternating; the time of a repetition is the maximum over ranks; median (min-max). Since 2026-11-30 05:00 each
operation starts at a common instant instead of at each rank's exit from the barrier (rank 0 broadcasts an instant
50 ms ahead; the barrier released ranks up to 15 ms apart), and its time is the last rank's end minus that
instant. Theory (PAPER.md): ours `t_opt = 2n(n-1)M/((n^2+kn-2k)B)`
(Theorem 1 split, one colocated server per worker machine plus `k` CPU-only ones), a plain PS with servers on
`k` CPU-only machines only `max(M/B, nM/(kB))`, gloo (ring) `2(n-1)M/(nB)`. `B` counts whole frames, so headers
cost about `(MTU+14)/(MTU-52) - 1` of it (0.7% at MTU 9000). Soundness: gloo's measured time must be within 15%
of its theory, else `B` is too high for the cores.
"""


# --------------------------------------------------------------------------------------------------------------
# theory
# --------------------------------------------------------------------------------------------------------------
def t_opt(n: int, k: float, m: float, b: float) -> float:
    """Theorem 1's communication time (seconds) for M bytes at B bytes/s."""
    return 2 * n * (n - 1) * m / ((n * n + k * n - 2 * k) * b)


def t_ps(n: int, k: float, m: float, b: float) -> float:
    return max(m / b, n * m / (k * b))


def t_ring(n: int, m: float, b: float) -> float:
    return 2 * (n - 1) * m / (n * b)


def expected_link_bytes(n: int, k: int, m: float, ps: bool) -> dict[str, tuple[float, float]]:
    """Payload bytes each machine sends and receives per operation (tx, rx), by machine kind."""
    if ps:
        per_server = m / k
        return {"worker": (m, m), "cpu": (n * per_server, n * per_server)}
    denom = n * n + k * n - 2 * k
    m_cpu, m_gpu = 2 * (n - 1) * m / denom, (n - k) * m / denom
    gpu = (m - m_gpu) + (n - 1) * m_gpu   # pushes to the others + results of its own share to the others
    return {"worker": (gpu, gpu), "cpu": (n * m_cpu, n * m_cpu)}


# --------------------------------------------------------------------------------------------------------------
# rank program (inside a worker machine's namespace)
# --------------------------------------------------------------------------------------------------------------
def _proc_cpu(pid: int) -> float:
    """CPU-seconds (user + sys, every thread, also those that ended) process ``pid`` has used so far.

    Read from the kernel's CPU-time clock of the process (``clock_getcpuclockid(3)``: nanoseconds; the
    clock id of process ``pid`` is ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``), the same sum as
    ``/proc/<pid>/stat``'s utime + stime, which counts in clock ticks (10 ms: a small operation's daemons
    would read 0.00 or 0.01). ``/proc`` where the clock cannot be read.
    """
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return float("nan")


def _box_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


class Observer:
    """Rank 0's view of the box: link counters (from the bridge namespace) and CPU, snapshot by snapshot."""

    def __init__(self, bridge_ns: str, peers: dict[str, str], pids: dict[str, int]) -> None:
        self.bridge_ns, self.peers, self.pids = bridge_ns, peers, pids

    def snapshot(self) -> dict[str, Any]:
        out = subprocess.run(["ip", "-n", self.bridge_ns, "-s", "-j", "link", "show"], capture_output=True,
                             text=True).stdout
        stats = {link["ifname"]: link.get("stats64", {}) for link in json.loads(out or "[]")}
        links = {name: (stats.get(peer, {}).get("rx", {}).get("bytes", 0),
                        stats.get(peer, {}).get("tx", {}).get("bytes", 0)) for name, peer in self.peers.items()}
        return {"links": links, "cpu": {label: _proc_cpu(pid) for label, pid in self.pids.items()},
                "box": _box_busy(), "t": time.monotonic()}


    @staticmethod
    def delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        total = max(1, b["box"][1] - a["box"][1])
        busy = (b["box"][0] - a["box"][0]) / total
        cpu = {label: b["cpu"][label] - a["cpu"][label] for label in a["cpu"]}
        ours = sum(cpu.values()) * CLK_TCK / total  # share of all cores' time used by our processes
        return {"links": {m: (b["links"][m][0] - a["links"][m][0], b["links"][m][1] - a["links"][m][1])
                          for m in a["links"]},
                "cpu": cpu, "box_busy": busy, "ours_busy": ours, "wall": b["t"] - a["t"]}


def code_version() -> str:
    """The checkout's commit, and whether the daemons' code differs from it (read-only git commands)."""
    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", "--no-optional-locks", *argv], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    head = git("rev-parse", "--short", "HEAD")
    import importlib.util

    spec = importlib.util.find_spec("bps_server")  # where the daemons will import it from (PYTHONPATH first)
    where = Path(spec.origin).resolve().parent.parent if spec and spec.origin else None
    if where is not None and where != REPO:
        return f"bps_server, bps_worker, protocol from {where}, not from this checkout (at {head or 'unknown'})"
    if not head:
        return "unknown (no git)"
    dirty = git("status", "--porcelain", "--", "bps_server", "bps_worker", "protocol")
    changed = len(dirty.splitlines())
    return head + (f" + uncommitted changes to {changed} files of bps_server/, bps_worker/, protocol/" if changed
                   else " (clean)")


def rank_program(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    import torch.distributed as dist

    import bps_worker.client as bps

    torch.set_num_threads(1)
    rank, size = int(os.environ["BPS_RANK"]), int(os.environ["BPS_SIZE"])
    bps.init(timeout=60.0)
    dist.init_process_group("gloo", rank=rank, world_size=size, init_method=f"tcp://{args.gloo_addr}:{GLOO_PORT}",
                            timeout=_dt.timedelta(seconds=args.op_timeout))
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(gathered, torch.tensor([os.getpid()], dtype=torch.int64))
    observer = None
    if rank == 0 and args.observe:
        spec = json.loads(args.observe)
        spec["pids"].update({f"rank-{r}": int(g.item()) for r, g in enumerate(gathered)})
        observer = Observer(**spec)
    windows: list[tuple[str, float, float]] = []  # (system, unix start, unix end after the closing barrier)
    try:
        nbytes = parse_size(args.size)
        n = nbytes // 4
        name = f"paper.{human(nbytes)}"
        x = pattern(n, rank, 0)
        # In place, as gloo's all_reduce is in its tensor: a shared array is the input and the output (reset
        # before each repetition, outside the timing, like gloo's tensor); --copy: a plain array and out=.
        shared = None if args.copy else bps.shared_array(name, (n,), np.float32)
        src = x if shared is None else shared
        out = np.zeros_like(x) if shared is None else shared

        def reset() -> None:
            if shared is not None:
                shared[...] = x

        reset()
        bps.push_pull(src, name, average=False, out=out)
        xt = torch.from_numpy(x)
        t = xt.clone()
        dist.all_reduce(t)
        step = max(1, n // 4099)
        idx = np.arange(0, n, step)
        expect = np.asarray(sum(((idx + 7 * r) % 13 - 6) for r in range(size))).astype(np.float32)
        ok = torch.tensor([int(np.array_equal(out, t.numpy())), int(np.array_equal(out[idx], expect))],
                          dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        for _ in range(args.warmup - 1):
            reset()
            bps.push_pull(src, name, average=False, out=out)
            t.copy_(xt)
            dist.all_reduce(t)
        bps_s, gloo_s, obs_bps, obs_gloo, bps_late, gloo_late = [], [], [], [], [], []
        for _ in range(args.reps):
            t.copy_(xt)
            reset()
            s0 = observer.snapshot() if observer else None
            w0, late = start_together(rank)
            bps.push_pull(src, name, average=False, out=out)
            bps_s.append(time.time() - w0)
            dist.barrier()
            windows.append(("ours", w0, time.time()))
            bps_late.append(late)
            s1 = observer.snapshot() if observer else None
            w0, late = start_together(rank)
            dist.all_reduce(t)
            gloo_s.append(time.time() - w0)
            dist.barrier()
            windows.append(("gloo", w0, time.time()))
            gloo_late.append(late)
            if observer:
                assert s0 is not None and s1 is not None
                s2 = observer.snapshot()
                obs_bps.append(Observer.delta(s0, s1))
                obs_gloo.append(Observer.delta(s1, s2))
        times = torch.tensor([bps_s, gloo_s, bps_late, gloo_late], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if rank == 0:
            Path(args.result_file).write_text(json.dumps({
                "bps_s": times[0].tolist(), "gloo_s": times[1].tolist(), "bps_equals_gloo": bool(ok[0]),
                "exact": bool(ok[1]), "obs_bps": obs_bps, "obs_gloo": obs_gloo,
                "late_s": times[2:].flatten().tolist(),
                "windows": windows}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
        bps.shutdown()
    return 0


def start_together(rank: int) -> tuple[float, float]:
    """Wait with every rank for a common start instant; returns it (unix time) and how late we woke.

    ``dist.barrier`` releases the ranks up to 15 ms apart over the shaped links (measured with the
    daemons' timelines), and a rank released early would count its wait for the others as part of the
    operation. So rank 0 broadcasts an instant START_AHEAD_S ahead and every rank waits for it: all
    ranks share the box's clock. The time of an operation is then the last rank's end minus that
    instant, for both systems alike.
    """
    import torch
    import torch.distributed as dist

    dist.barrier()
    go = torch.tensor([time.time() + START_AHEAD_S if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(go, 0)
    start = float(go.item())
    while (left := start - time.time()) > 0:
        time.sleep(left)  # not a busy wait: the ranks would take the cores the daemons need at the start
    return start, time.time() - start


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------
def run_config(net: Any, layout: Any, args: argparse.Namespace, tmp: Path, label: str, tag: str = ""
               ) -> dict[str, Any]:
    """One configuration on ``net``: its daemons, one rank per worker machine; rank 0's result file.

    ``tag`` (a sweep's ``n4_200mbit``, "" for a single (n, B)) keeps the directories of the (n, B) apart.
    """
    from benchmarks.cluster import Daemons

    slug = label.replace(" ", "_")
    directory = tmp / tag / slug
    result_file = directory / "result.json"
    sampler = net.sample_links(str(directory / "links.txt")) if args.timeline else None
    trace = Path(args.trace) / tag / slug if args.trace else None
    with Daemons(net, layout, directory, log_level=args.log_level, log_dir=directory / "logs",
                 timeline_dir=trace) as cluster:
        observe = json.dumps({"bridge_ns": net.bridge_ns,
                              "peers": {m.name: m.peer for m in net.machines.values()},
                              "pids": cluster.pids()})
        for w, machine_name in enumerate(layout.workers):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-program", "--size", args.size,
                   "--reps", str(args.reps), "--warmup", str(args.warmup), "--result-file", str(result_file),
                   "--gloo-addr", net.address(layout.workers[0]), "--op-timeout", str(args.op_timeout)]
            if args.copy:
                cmd.append("--copy")
            if w == 0:
                cmd += ["--observe", observe]
            cluster.start_rank(w, 0, cmd, env={"GLOO_SOCKET_IFNAME": net.ifname(machine_name),
                                               "MASTER_ADDR": net.address(layout.workers[0]),
                                               "MASTER_PORT": str(GLOO_PORT), "OMP_NUM_THREADS": "1",
                                               "TORCH_CPP_LOG_LEVEL": "ERROR",
                                               **({"BPS_TIMELINE": str(trace)} if trace else {})})
        code = cluster.wait_ranks(args.timeout)
        if code != 0 or not result_file.exists():
            logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                           for p in sorted((directory / "logs").glob("*.log")))
            raise RuntimeError(f"{label}: the rank programs failed (status {code}){logs}")
    result = json.loads(result_file.read_text())
    if sampler is not None:
        sampler.terminate()
        sampler.wait()
        result["samples"] = [[float(v) for v in line.split()]
                             for line in (directory / "links.txt").read_text().splitlines() if line.strip()]
    return result


def summarize(configs: list[dict[str, Any]], n: int, m: float, b: float) -> list[dict[str, Any]]:
    rows = []
    for c in configs:
        r = c["result"]
        ours, gloo = r["bps_s"], r["gloo_s"]
        om, gm = statistics.median(ours), statistics.median(gloo)
        theory = t_ps(n, c["k"], m, b) if c["ps"] else t_opt(n, c["k"], m, b)
        ring = t_ring(n, m, b)
        rows.append({"label": c["label"], "k": c["k"], "ps": c["ps"],
                     "ours": (om, min(ours), max(ours)), "ours_theory": theory, "ours_ratio": om / theory,
                     "gloo": (gm, min(gloo), max(gloo)), "gloo_theory": ring, "gloo_ratio": gm / ring,
                     "speedup": gm / om, "speedup_theory": ring / theory,
                     "ok": r["bps_equals_gloo"] and r["exact"]})
    return rows


HEADER = ["config", "k", "ours median s (min-max)", "ours theory s", "ours/theory", "gloo median s (min-max)",
          "gloo theory s", "gloo/theory", "gloo/ours", "gloo/ours theory", "exact"]


def _s(t: tuple[float, float, float]) -> str:
    return f"{t[0]:.3f} ({t[1]:.3f}-{t[2]:.3f})"


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    return [[r["label"], str(r["k"]), _s(r["ours"]), f"{r['ours_theory']:.3f}", f"{r['ours_ratio']:.2f}",
             _s(r["gloo"]), f"{r['gloo_theory']:.3f}", f"{r['gloo_ratio']:.2f}", f"{r['speedup']:.2f}",
             f"{r['speedup_theory']:.2f}", "yes" if r["ok"] else "NO"] for r in rows]


DETAIL_HEADER = ["config", "system", "worker tx/rx MB per op (expected)", "CPU-only tx/rx MB per op (expected)",
                 "servers CPU-s/op", "workers CPU-s/op", "ranks CPU-s/op", "cores busy: ours / others"]


def detail_rows(configs: list[dict[str, Any]], n: int, m: float) -> list[list[str]]:
    """Per configuration and system: link bytes per op by machine kind, daemon CPU, core utilization."""
    out = []
    for c in configs:
        r = c["result"]
        workers, cpus = c["workers"], c["cpu_machines"]
        for system, obs in (("ours", r.get("obs_bps", [])), ("gloo", r.get("obs_gloo", []))):
            if not obs:
                continue

            def mb(machines: list[str], which: int) -> str:
                if not machines:
                    return "-"
                vals = [statistics.median(o["links"][name][which] for o in obs) / 1e6 for name in machines]
                return f"{min(vals):.1f}-{max(vals):.1f}" if max(vals) - min(vals) >= 0.05 else f"{vals[0]:.1f}"

            if system == "ours":
                exp = expected_link_bytes(n, c["k"], m, c["ps"])
                ew, ec = exp["worker"][0] / 1e6, exp["cpu"][0] / 1e6
            else:
                ew, ec = t_ring(n, m, 1.0) / 1e6, 0.0
            w_cell = f"{mb(workers, 0)} / {mb(workers, 1)} ({ew:.1f})"
            c_cell = f"{mb(cpus, 0)} / {mb(cpus, 1)} ({ec:.1f})" if cpus and system == "ours" else "-"
            def cpu_s(prefix: str) -> float:
                labels = [lab for lab in obs[0]["cpu"] if lab.startswith(prefix)]
                return statistics.median(sum(o["cpu"][lab] for lab in labels) for o in obs)

            ours_busy = statistics.median(o["ours_busy"] for o in obs)
            others = statistics.median(max(0.0, o["box_busy"] - o["ours_busy"]) for o in obs)
            out.append([c["label"], system, w_cell, c_cell, f"{cpu_s('server'):.2f}" if system == "ours" else "-",
                        f"{cpu_s('worker'):.2f}" if system == "ours" else "-", f"{cpu_s('rank'):.2f}",
                        f"{ours_busy:.0%} / {others:.0%}"])
    return out


# --------------------------------------------------------------------------------------------------------------
# per machine role: CPU-seconds per operation, bytes per link against Theorem 1, the sweep's summary
# --------------------------------------------------------------------------------------------------------------
def process_machines(layout: Any) -> dict[str, str]:
    """The machine of every process label rank 0 observes (``Daemons.pids()``, and ``rank-<r>``)."""
    where = {f"server-{sid}": machine_name for sid, machine_name, _ in layout.servers()}
    where.update({f"worker-{w}": machine_name for w, machine_name in enumerate(layout.workers)})
    where.update({f"rank-{w}": machine_name for w, machine_name in enumerate(layout.workers)})  # one rank each
    return where


def machine_cpu(obs: list[dict[str, Any]], where: dict[str, str], machines: list[str],
                prefixes: tuple[str, ...]) -> list[float]:
    """CPU-seconds per operation (median over repetitions) of each of ``machines``: its processes whose
    labels start with one of ``prefixes``."""
    if not obs:
        return []
    out = []
    for name in machines:
        labels = [lab for lab in obs[0]["cpu"] if where.get(lab) == name and lab.startswith(prefixes)]
        out.append(statistics.median(sum(o["cpu"][lab] for lab in labels) for o in obs))
    return out


def role_cpu(c: dict[str, Any]) -> dict[str, list[float]]:
    """Per machine, CPU-seconds per operation: ``gpu``, a worker machine during ours (its worker daemon, its
    colocated server, its rank); ``cpu``, a CPU-only machine during ours (its server); ``rank``, a rank during
    gloo's all_reduce."""
    r, where = c["result"], c["where"]
    return {"gpu": machine_cpu(r.get("obs_bps", []), where, c["workers"], ("worker-", "server-", "rank-")),
            "cpu": machine_cpu(r.get("obs_bps", []), where, c["cpu_machines"], ("server-",)),
            "rank": machine_cpu(r.get("obs_gloo", []), where, c["workers"], ("rank-",))}


def link_ratio(obs: list[dict[str, Any]], machines: list[str], expected: float) -> str:
    """Bytes per operation on a machine's link ((tx + rx) / 2, frames), median over ``machines``, / expected."""
    if not obs or not machines:
        return "-"
    per = [statistics.median((o["links"][name][0] + o["links"][name][1]) / 2 for o in obs) for name in machines]
    return f"{statistics.median(per) / expected:.3f}"


def _median_max(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({max(values):.3f})" if values else "-"


SUMMARY_HEADER = ["n", "B", "config", "ours t/t_opt", "gloo t/t_ring", "gloo/ours (theory)",
                  "GPU machine CPU-s/op", "CPU-only machine CPU-s/op", "gloo rank CPU-s/op", "GPU machine / gloo rank",
                  "ours link bytes/expected (worker, CPU-only)", "gloo link bytes/expected", "exact"]
SUMMARY_INTRO = (
    "Summary, one row per (n, B, configuration): measured / theory (medians over repetitions; `ours t/t_opt` is "
    "against the plain PS's theory `max(M/B, nM/(kB))` on PS rows), gloo/ours measured (theoretical), CPU-seconds "
    "per operation by machine role, median over the machines (max): a GPU machine is a worker machine during ours "
    "(its worker daemon + its colocated server + its rank), a CPU-only machine its server during ours, a gloo rank "
    "one rank during gloo's all_reduce (user + sys, every thread); then a GPU machine's median over a gloo rank's, "
    "and bytes per operation on a machine's link ((tx + rx) / 2, frames incl. headers, median over the machines) "
    "over the payload Theorem 1's split (PS: the even split) and the ring send:")


def summary_rows(blocks: list[dict[str, Any]], m: float) -> list[list[str]]:
    out = []
    for blk in blocks:
        n = blk["n"]
        for c, row in zip(blk["configs"], blk["rows"]):
            r, cpu = c["result"], role_cpu(c)
            exp = expected_link_bytes(n, c["k"], m, c["ps"])
            ratio = (statistics.median(cpu["gpu"]) / statistics.median(cpu["rank"])
                     if cpu["gpu"] and cpu["rank"] and statistics.median(cpu["rank"]) > 0 else float("nan"))
            ours_links = (f"{link_ratio(r.get('obs_bps', []), c['workers'], exp['worker'][0])}, "
                          f"{link_ratio(r.get('obs_bps', []), c['cpu_machines'], exp['cpu'][0])}")
            out.append([str(n), blk["bandwidth"], c["label"], f"{row['ours_ratio']:.2f}", f"{row['gloo_ratio']:.2f}",
                        f"{row['speedup']:.2f} ({row['speedup_theory']:.2f})", _median_max(cpu["gpu"]),
                        _median_max(cpu["cpu"]), _median_max(cpu["rank"]), f"{ratio:.2f}", ours_links,
                        link_ratio(r.get("obs_gloo", []), c["workers"], t_ring(n, m, 1.0)),
                        "yes" if row["ok"] else "NO"])
    return out


# --------------------------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------------------------
NO_MATPLOTLIB = "matplotlib is not installed (pip install -e '.[bench]')"


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_sweep(blocks: list[dict[str, Any]], path: Path, title: str) -> str | None:
    """Measured / theory against B, one panel per n: ours one line per configuration, gloo's ring one line."""
    plt = _pyplot()
    if plt is None:
        return f"{NO_MATPLOTLIB}: no plot"
    ns = list(dict.fromkeys(blk["n"] for blk in blocks))
    every = sorted((row for blk in blocks for row in blk["rows"]), key=lambda row: (row["ps"], row["k"]))
    labels = list(dict.fromkeys(row["label"] for row in every))  # one colour each, in every panel
    fig, axes = plt.subplots(1, len(ns), figsize=(1 + 5 * len(ns), 4.5), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], ns):
        mine = sorted((blk for blk in blocks if blk["n"] == n), key=lambda blk: blk["rate"])
        mbit = [blk["rate"] / 1e6 for blk in mine]
        for i, label in enumerate(labels):
            pts = [(blk["rate"] / 1e6, row["ours_ratio"]) for blk in mine for row in blk["rows"] if row["label"] == label]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "--^" if label.startswith("PS") else "-o",
                        color=f"C{i}", label=f"ours, {label}" + (" (t / t_ps)" if label.startswith("PS") else ""))
        ax.plot(mbit, [blk["gloo_ratio"] for blk in mine], ":s", color="black",
                label="gloo ring all_reduce (t / t_ring, all its repetitions)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xticks(mbit, [blk["bandwidth"] for blk in mine])
        ax.minorticks_off()
        ax.set_xlabel("B, every machine's link each way")
        ax.set_title(f"n = {n}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("measured time / theory (median)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def plot(rows: list[dict[str, Any]], n: int, m: float, b: float, path: Path, title: str) -> str | None:
    plt = _pyplot()
    if plt is None:
        return f"{NO_MATPLOTLIB}: no plot"
    ks = [i / 20 for i in range(20 * n + 1)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ks, [t_opt(n, k, m, b) for k in ks], "-", color="C0", label="ours, theory $t_{opt}$ (Theorem 1)")
    uni = [r for r in rows if not r["ps"]]
    ax.errorbar([r["k"] for r in uni], [r["ours"][0] for r in uni],
                yerr=[[r["ours"][0] - r["ours"][1] for r in uni], [r["ours"][2] - r["ours"][0] for r in uni]],
                fmt="o", color="C0", capsize=3, label="ours, measured (median, min-max)")
    ax.axhline(t_ring(n, m, b), color="C1", linestyle="--", label="gloo ring all-reduce, theory")
    ax.errorbar([r["k"] for r in rows], [r["gloo"][0] for r in rows],
                yerr=[[r["gloo"][0] - r["gloo"][1] for r in rows], [r["gloo"][2] - r["gloo"][0] for r in rows]],
                fmt="s", color="C1", capsize=3, label="gloo all_reduce, measured")
    ps = [r for r in rows if r["ps"]]
    if ps:
        kps = [k for k in ks if k >= 1]
        ax.plot(kps, [t_ps(n, k, m, b) for k in kps], ":", color="C2", label="plain PS, theory max(M/B, nM/kB)")
        ax.errorbar([r["k"] for r in ps], [r["ours"][0] for r in ps],
                    yerr=[[r["ours"][0] - r["ours"][1] for r in ps], [r["ours"][2] - r["ours"][0] for r in ps]],
                    fmt="^", color="C2", capsize=3, label="plain PS (our servers), measured")
    ax.set_xlabel("k (CPU-only machines)")
    ax.set_ylabel("time of one sum (s)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _rates(samples: list[list[float]], start: float, end: float, column: int, bin_s: float = 0.02
           ) -> tuple[list[float], list[float]]:
    """(bin start relative to ``start``, MB/s) of one counter column, binned, from ``start`` to ``end``."""
    import bisect

    times = [row[0] for row in samples]

    def at(t: float) -> float:  # counter value at time t, linearly interpolated
        i = bisect.bisect_left(times, t)
        if i <= 0:
            return samples[0][column]
        if i >= len(samples):
            return samples[-1][column]
        (t0, v0), (t1, v1) = (times[i - 1], samples[i - 1][column]), (times[i], samples[i][column])
        return v0 + (v1 - v0) * (t - t0) / max(1e-9, t1 - t0)

    xs, ys = [], []
    t = start
    while t < end:
        xs.append(t - start)
        ys.append((at(t + bin_s) - at(t)) / bin_s / 1e6)
        t += bin_s
    return xs, ys


def plot_timeline(configs: list[dict[str, Any]], machines: list[str], b: float, path: Path, title: str) -> str | None:
    plt = _pyplot()
    if plt is None:
        return f"{NO_MATPLOTLIB}: no timeline"
    panels = []
    for c in configs:
        r = c["result"]
        if not r.get("samples"):
            continue
        for system in ("ours", "gloo") if c is configs[0] else ("ours",):
            times = r["bps_s"] if system == "ours" else r["gloo_s"]
            wins = [w for w in r["windows"] if w[0] == system]
            rep = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]
            label = f"{c['label']}: {'ours' if system == 'ours' else 'gloo all_reduce'}, rep {rep} ({times[rep]:.3f} s)"
            panels.append((label, r["samples"], wins[rep][1], wins[rep][2], c["workers"] + c["cpu_machines"]))
    if not panels:
        return "no samples: no timeline"
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 2.1 * len(panels)), sharex=True, squeeze=False)
    for row, (label, samples, start, end, present) in enumerate(panels):
        for col, (direction, offset) in enumerate((("uplink (sent)", 1), ("downlink (received)", 2))):
            ax = axes[row][col]
            for i, name in enumerate(machines):
                if name not in present:
                    continue
                xs, ys = _rates(samples, start - 0.02, end + 0.05, 2 * i + offset)
                style = "-" if name.startswith("w") else "--"
                ax.plot([x - 0.02 for x in xs], ys, style, lw=1, label=name)
            ax.axhline(b / 1e6, color="grey", lw=0.8, ls=":")
            ax.axvline(end - start, color="black", lw=0.8, ls=":")
            ax.set_ylim(0, b / 1e6 * 1.25)
            ax.set_title(f"{label}: {direction}", fontsize=7)
            ax.tick_params(labelsize=7)
            if col == 0:
                ax.set_ylabel("MB/s", fontsize=7)
        axes[row][1].legend(fontsize=6, loc="upper right", ncol=2)
    for ax in axes[-1]:
        ax.set_xlabel("seconds from the start of the operation (dotted: end, after the closing barrier)", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------------------------------------------
# the sweep: which (n, B), which configurations
# --------------------------------------------------------------------------------------------------------------
KS_HELP = ("comma list of integers, 'n' or 'n/D' (n // D), resolved for each n; a k too large for an n is "
           "skipped for that n")
SWEEP_HELP = ("per-n bandwidths (and optionally ks), instead of --ns x --bandwidths: items 'n=N:B1,B2[:k=LIST]"
              "[:ps=LIST]' separated by ';'; k= and ps= replace --ks and --ps-ks for that n, e.g. "
              "'n=4:200mbit,500mbit,1gbit;n=8:100mbit:k=0,4,8'")


@dataclass(frozen=True)
class Block:
    """One (n, B) of a run: one emulated network, on which every configuration of the n runs."""

    n: int
    bandwidth: str
    ks: tuple[int, ...]
    ps_ks: tuple[int, ...]

    @property
    def tag(self) -> str:
        return f"n{self.n}_{self.bandwidth}"

    def plan(self) -> list[tuple[str, int, bool]]:
        """(label, k, plain PS) of every configuration."""
        return [(f"k={k}", k, False) for k in self.ks] + [(f"PS k={k}", k, True) for k in self.ps_ks]

    def machines(self) -> tuple[list[str], list[str]]:
        """Worker machines and CPU-only machines (as many as the largest k)."""
        return [f"w{i}" for i in range(self.n)], [f"c{j}" for j in range(max((*self.ks, *self.ps_ks)))]

    def describe(self, rate: float) -> str:
        return (f"n = {self.n} worker machines x 1 process, k in {list(self.ks)} (+ plain PS k in "
                f"{list(self.ps_ks)}); B = {self.bandwidth} ({rate / 8e6:.2f} MB/s) each way")


def _items(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_ks(text: str, n: int) -> list[int]:
    """A k list for ``n`` worker machines: integers, ``n``, ``n/D`` (n // D); in order, repeats dropped."""
    out: list[int] = []
    for token in _items(text.replace(" ", "")):
        try:
            k = n if token == "n" else n // int(token[2:]) if token.startswith("n/") else int(token)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"bad k {token!r} (an integer, n or n/D)") from None
        if k not in out:
            out.append(k)
    return out


def _fitting(ks: list[int], n: int, ps: bool) -> list[int]:
    """The ks that fit n worker machines (0 <= k <= n; plain PS 1 <= k < n); larger ones skipped, saying so."""
    low, high = (1, n - 1) if ps else (0, n)
    if any(k < low for k in ks):
        raise ValueError(f"{'--ps-ks' if ps else '--ks'}: every k must be at least {low}")
    if skipped := [k for k in ks if k > high]:
        print(f"paper_vs_allreduce: n = {n}: skipping {'plain PS ' if ps else ''}k = {skipped} (more than {high})",
              file=sys.stderr)
    return [k for k in ks if k <= high]


def sweep_items(args: argparse.Namespace) -> list[tuple[int, list[str], str, str]]:
    """(n, bandwidths, ks, ps-ks) per n: --sweep's items, else every n of --ns at every B of --bandwidths."""
    if not args.sweep:
        bandwidths = _items(args.bandwidths or "200mbit")
        return [(int(n), bandwidths, args.ks, args.ps_ks) for n in _items(args.ns or "4")]
    if args.ns or args.bandwidths:
        raise ValueError("--sweep replaces --n/--ns and --bandwidth/--bandwidths")
    out = []
    for item in filter(None, (i.strip() for i in args.sweep.split(";"))):
        head, *fields = item.split(":")
        key, _, n = head.partition("=")
        if key.strip() != "n" or not fields:
            raise ValueError(f"bad --sweep item {item!r} (n=N:B1,B2[:k=LIST][:ps=LIST])")
        lists = {"k": args.ks, "ps": args.ps_ks}
        for extra in fields[1:]:
            name, eq, value = extra.partition("=")
            if name.strip() not in lists or not eq:
                raise ValueError(f"bad --sweep item {item!r}: {extra!r} is neither k=LIST nor ps=LIST")
            lists[name.strip()] = value
        out.append((int(n), _items(fields[0]), lists["k"], lists["ps"]))
    return out


def make_blocks(items: list[tuple[int, list[str], str, str]]) -> list[Block]:
    """The (n, B) to run, in order; ValueError on a bad n, k or rate, or an (n, B) twice."""
    from benchmarks.cluster import parse_rate

    blocks = []
    for n, bandwidths, ks_text, ps_text in items:
        if n < 2:
            raise ValueError(f"need n >= 2, got {n}")
        ks, ps_ks = _fitting(parse_ks(ks_text, n), n, False), _fitting(parse_ks(ps_text, n), n, True)
        if not ks and not ps_ks:
            raise ValueError(f"n = {n}: no configuration (--ks, --ps-ks)")
        for bandwidth in bandwidths:
            parse_rate(bandwidth)  # ValueError naming a bad rate
            blocks.append(Block(n, bandwidth, tuple(ks), tuple(ps_ks)))
    if not blocks:
        raise ValueError("no (n, B) to run")
    if len({blk.tag for blk in blocks}) < len(blocks):
        raise ValueError("an (n, B) appears twice")
    return blocks


def cluster_keys_of(args: argparse.Namespace, bandwidth: str) -> dict[str, Any]:
    keys: dict[str, Any] = {"timeout": 60.0}
    if args.link_rate != "none":  # the cluster file says how fast its links are, as a user's would
        keys["link_rate"] = bandwidth if args.link_rate == "auto" else args.link_rate
    if args.partition_bytes:
        keys["partition_bytes"] = args.partition_bytes
        keys["max_payload_bytes"] = max(1 << 30, args.partition_bytes)
    if args.credit_bytes:
        keys["credit_bytes"] = args.credit_bytes
    if args.window_pieces is not None:
        keys["window_pieces"] = args.window_pieces
    return keys


def run_block(block: Block, args: argparse.Namespace, tmp: Path, tag: str) -> dict[str, Any]:
    """Every configuration of ``block`` on one emulated network (deleted at the end, also on failure)."""
    from benchmarks.cluster import Layout, Network, parse_rate

    workers, cpus = block.machines()
    configs: list[dict[str, Any]] = []
    t_start = time.monotonic()
    with Network([*workers, *cpus], bandwidth=block.bandwidth, mtu=args.mtu,
                 sysctls=dict(kv.split("=", 1) for kv in args.sysctl)) as net:
        print(f"emulated: {block.n} worker + {len(cpus)} CPU-only machines, links {block.bandwidth} each way, "
              f"MTU {args.mtu}, namespaces {net.prefix}-*", file=sys.stderr)
        for label, k, ps in block.plan():
            layout = Layout(workers=workers, cpu_servers=cpus[:k], colocated=not ps, cluster=cluster_keys_of(args, block.bandwidth))
            t0 = time.monotonic()
            result = run_config(net, layout, args, tmp, label, tag)
            configs.append({"label": label, "k": k, "ps": ps, "workers": workers, "cpu_machines": cpus[:k],
                            "where": process_machines(layout), "result": result})
            print(f"[{tag + ' ' if tag else ''}{label}] ours median {statistics.median(result['bps_s']):.3f} s, "
                  f"gloo median {statistics.median(result['gloo_s']):.3f} s, exact: {result['exact']}, bps == "
                  f"gloo: {result['bps_equals_gloo']} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        drops = net.tc_drops()
    return {"n": block.n, "bandwidth": block.bandwidth, "rate": parse_rate(block.bandwidth), "block": block,
            "machines": [*workers, *cpus], "configs": configs, "drops": drops,
            "elapsed": time.monotonic() - t_start}


def analyze_block(blk: dict[str, Any], m: float, named: bool) -> None:
    """Adds ``rows`` (summarize), gloo's median over all its repetitions / t_ring, the soundness line."""
    n, b, configs = blk["n"], blk["rate"] / 8, blk["configs"]
    blk["rows"] = summarize(configs, n, m, b)
    all_gloo = [t for c in configs for t in c["result"]["gloo_s"]]
    late = [t for c in configs for t in c["result"].get("late_s", [0.0])]
    ring = t_ring(n, m, b)
    blk["gloo_ratio"] = statistics.median(all_gloo) / ring
    sound = abs(blk["gloo_ratio"] - 1) <= SOUND_TOLERANCE
    which = f" (n = {n}, B = {blk['bandwidth']})" if named else ""
    blk["sound_line"] = (
        f"soundness{which}: gloo median over all {len(all_gloo)} "
        f"repetitions {statistics.median(all_gloo):.3f} s = {blk['gloo_ratio']:.2f} x its theory {ring:.3f} s: "
        + ("PASS (within 15%)" if sound else "FAIL (not within 15%: lower --bandwidth)")
        + f"; packets dropped by the shapers: {sum(blk['drops'].values())}; ranks started at most "
        f"{1000 * max(late):.1f} ms after the common instant")


DETAIL_INTRO = ("Per operation (median over repetitions): bytes on the links by machine kind, seen from the machine "
                "(tx = its uplink / rx = its downlink, frames incl. headers; expected payload in parentheses), "
                "CPU-seconds of all daemons together, share of the box's cores busy during the operation:")


def block_tables(blk: dict[str, Any], m: float) -> tuple[list[list[str]], list[list[str]]]:
    return table_rows(blk["rows"]), detail_rows(blk["configs"], blk["n"], m)


def print_block(blk: dict[str, Any], m: float, named: bool) -> None:
    table, details = block_tables(blk, m)
    if named:
        print(f"\n== {blk['block'].describe(blk['rate'])}; wall time {blk['elapsed']:.0f} s ==\n")
    print(text_table(HEADER, table))
    print()
    print(text_table(DETAIL_HEADER, details))
    print()
    print(blk["sound_line"])


def block_markdown(blk: dict[str, Any], m: float, named: bool) -> list[str]:
    table, details = block_tables(blk, m)
    head = [f"**{blk['block'].describe(blk['rate'])}** (wall time {blk['elapsed']:.0f} s)", "",
            f"- {blk['sound_line']}", ""] if named else []
    return [*head, markdown_table(HEADER, table, left=1), "", DETAIL_INTRO, "",
            markdown_table(DETAIL_HEADER, details, left=1), ""]


def sweep_line(blocks: list[Block]) -> str:
    """The (n, B) of a run, grouped by n."""
    by_n: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for blk in blocks:
        by_n.setdefault((blk.n, blk.ks, blk.ps_ks), []).append(blk.bandwidth)
    return "; ".join(f"n = {n} at B = {', '.join(bws)}: k in {list(ks)} (+ plain PS k in {list(ps)})"
                     for (n, ks, ps), bws in by_n.items())


def tagged(path: str, tag: str) -> Path:
    """``path`` with ``_<tag>`` before its suffix (one file per (n, B) of a sweep); itself for no tag."""
    p = Path(path)
    return p.with_name(f"{p.stem}_{tag}{p.suffix}") if tag else p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="16M", help="bytes summed per operation, float32 (default 16M)")
    p.add_argument("--ns", "--n", dest="ns", default=None, metavar="N[,N...]",
                   help="worker machines; a comma list runs each (default 4)")
    p.add_argument("--ks", default="0,1,2,4", help="CPU-only machines of the unified configurations, e.g. "
                                                   f"0,n/2,n (default 0,1,2,4): {KS_HELP}")
    p.add_argument("--ps-ks", default="2", help=f"CPU-only machines of plain-PS configurations (default 2; '' for "
                                               f"none): {KS_HELP} (a plain PS needs k < n)")
    p.add_argument("--bandwidths", "--bandwidth", dest="bandwidths", default=None, metavar="B[,B...]",
                   help="every machine's link, each direction (tc rate; default 200mbit); a comma list runs each, "
                        "for every n, on a network of its own")
    p.add_argument("--sweep", default=None, metavar="SPEC", help=SWEEP_HELP)
    p.add_argument("--mtu", type=int, default=9000, help="MTU of the emulated links (default 9000)")
    p.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                   help="a net.* sysctl set on every emulated machine (repeatable), e.g. "
                        "net.ipv4.tcp_slow_start_after_idle=0")
    p.add_argument("--partition-bytes", type=parse_size, default=None,
                   help="cluster partition_bytes (default: the daemons' default, 4 MiB)")
    p.add_argument("--credit-bytes", type=parse_size, default=None,
                   help="cluster credit_bytes (default: the daemons' default, 64 MiB)")
    p.add_argument("--window-pieces", type=int, default=None,
                   help="cluster window_pieces (default: the daemons' default, 3; 0: no pacing)")
    p.add_argument("--link-rate", default="auto",
                   help="cluster link_rate: 'auto' (default) gives each network's B, as a user gives their NICs' "
                        "rate; 'none' leaves it out (pieces by count alone); or a rate, e.g. 10gbit")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per configuration (default 5)")
    p.add_argument("--copy", action="store_true", help="bps on a plain array with out= (copied into and out of "
                   "shared memory) instead of in place in a shared_array")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of each system first (default 1)")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {DEFAULT_RESULTS} "
                                                               f"and save the plot beside it")
    p.add_argument("--output", default=None, help="append to this markdown file instead (implies --write-results)")
    p.add_argument("--plot", default=None,
                   help=f"save the plot here (default with --write-results: {DEFAULT_PLOT.name} for one (n, B): "
                        f"time against k; {DEFAULT_SWEEP_PLOT.name} for several: measured / theory against B, one "
                        f"panel per n; beside the results file)")
    p.add_argument("--json", default=None, help="also write the raw per-repetition data here")
    p.add_argument("--timeline", default=None, metavar="PNG",
                   help="sample every link's byte counters every 5 ms and plot each configuration's median "
                        "repetition (per-machine uplink and downlink rate over time) to this file (one per "
                        "(n, B) of a sweep: PNG's name + _n<N>_<B>)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="every daemon and rank writes a Chrome-trace timeline of every partition's stages to "
                        "DIR/<config>/<daemon>.json and rank<r>.json (DIR/n<N>_<B>/<config>/ in a sweep; merge "
                        "with python -m bps_runtime.timeline merge, open in Perfetto)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the ranks of one configuration may take")
    p.add_argument("--log-level", default="warning", help="daemons' log level (default warning)")
    p.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--gloo-addr", help=argparse.SUPPRESS)
    p.add_argument("--observe", default=None, help=argparse.SUPPRESS)
    p.add_argument("--op-timeout", type=float, default=300.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reps < 1 or args.warmup < 1:
        p.error("--reps and --warmup must be at least 1")
    try:
        nbytes = parse_size(args.size)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if args.rank_program:
        return rank_program(args)

    from benchmarks.cluster import EmulatorError, unavailable_reason

    try:
        blocks = make_blocks(sweep_items(args))
    except ValueError as exc:
        p.error(str(exc))
    reason = unavailable_reason()
    if reason:
        print(f"paper_vs_allreduce: {reason}", file=sys.stderr)
        return 2

    m = float(nbytes)
    named = len(blocks) > 1  # a sweep: every (n, B) says which it is
    command_line = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    env_vars = {k: v for k, v in sorted(os.environ.items()) if k.startswith((*ENV_PREFIXES, "PYTHONPATH"))}
    if env_vars:
        command_line = shlex.join(f"{k}={v}" for k, v in env_vars.items()) + " " + command_line
    started = _dt.datetime.now().astimezone()
    info = machine("numpy", "torch")
    results: list[dict[str, Any]] = []
    t_start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="bps-paper-") as tmp:
            for block in blocks:
                results.append(run_block(block, args, Path(tmp), block.tag if named else ""))
    except (EmulatorError, RuntimeError) as exc:
        print(f"paper_vs_allreduce: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("paper_vs_allreduce: interrupted; the emulated machines were removed", file=sys.stderr)
        return 130
    elapsed = time.monotonic() - t_start
    for blk in results:
        analyze_block(blk, m, named)
    summary = summary_rows(results, m)
    ok = all(row["ok"] for blk in results for row in blk["rows"])

    code_line = code_version()
    machine_line = (f"nproc {info['nproc']}, CPU {info['cpu']}; Python {info['python']}, numpy {info['numpy']}, "
                    f"torch {info['torch']}, Linux {info['kernel']}")
    common = (f"M = {human(nbytes)} float32 ({nbytes} bytes); tbf shapers, MTU {args.mtu}; partition_bytes = "
              f"{args.partition_bytes or 'default (4194304)'}; credit_bytes = "
              f"{args.credit_bytes or 'default (67108864)'}; window_pieces = "
              f"{'default (3)' if args.window_pieces is None else args.window_pieces}; link_rate = "
              f"{'B' if args.link_rate == 'auto' else args.link_rate}; bps "
              f"{'on a plain array with out= (--copy)' if args.copy else 'in place in a shared_array'}")
    setup_line = (f"{common}; sweep: {sweep_line(blocks)}" if named
                  else f"{results[0]['block'].describe(results[0]['rate'])}; {common}")
    reps_line = (f"{args.reps} timed repetitions per configuration after {args.warmup} warm-up; wall time "
                 f"{elapsed:.0f} s")
    print(f"date:    {started.isoformat(timespec='seconds')}")
    print(f"command: {command_line}")
    print(f"machine: {machine_line}")
    print(f"code:    {code_line}")
    print(f"setup:   {setup_line}")
    print(f"reps:    {reps_line}")
    for blk in results:
        print()
        print_block(blk, m, named)
    print()
    print(text_table(SUMMARY_HEADER, summary, left=3))
    if not ok:
        print("\nERROR: a sum was not exact or differed from gloo's", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": started.isoformat(timespec="seconds"), "command": command_line, "machine": info,
            "bytes": nbytes, "mtu": args.mtu,
            "blocks": [{key: blk[key] for key in ("n", "bandwidth", "configs", "drops", "elapsed")}
                       for blk in results]}, indent=1) + "\n")
    default_plot = DEFAULT_SWEEP_PLOT if named else DEFAULT_PLOT
    plot_path = Path(args.plot) if args.plot else (
        (Path(args.output).parent / default_plot.name if args.output else default_plot)
        if (args.write_results or args.output) else None)
    if plot_path:
        when = started.strftime('%Y-%m-%d %H:%M')
        if named:
            problem = plot_sweep(results, plot_path, f"measured / theory, M = {human(nbytes)}, {when}")
        else:
            blk = results[0]
            problem = plot(blk["rows"], blk["n"], m, blk["rate"] / 8, plot_path,
                           f"n = {blk['n']}, M = {human(nbytes)}, B = {blk['bandwidth']}, {when}")
        print(f"\nplot: {problem or plot_path}")
    timelines = []
    for blk in results if args.timeline else []:
        path = tagged(args.timeline, blk["block"].tag if named else "")
        title = (f"link rates, 20 ms bins; n = {blk['n']}, M = {human(nbytes)}, B = {blk['bandwidth']} "
                 f"(grey: B); {started.strftime('%Y-%m-%d %H:%M')}")
        problem = plot_timeline(blk["configs"], blk["machines"], blk["rate"] / 8, path, title)
        print(f"timeline: {problem or path}")
        timelines.append(path.name)
    if args.write_results or args.output:
        target = Path(args.output) if args.output else DEFAULT_RESULTS
        text = target.read_text() if target.exists() else "# Benchmark results\n"
        if "## `paper_vs_allreduce.py`" not in text:
            text = text.rstrip("\n") + "\n" + RESULTS_HEADER
            target.write_text(text)
        section = [
            *section_head(started, "BytePS vs gloo all-reduce on emulated machines"
                          + (" (a sweep)" if named else ""), command_line, machine_line),
            f"- code: {code_line}",
            f"- setup: {setup_line}",
            f"- {reps_line}",
            *([] if named else [f"- {results[0]['sound_line']}"]),
            (f"- plot: `{plot_path.name}`" if plot_path else "- plot: none")
            + (f"; link-rate timeline: {', '.join(f'`{name}`' for name in timelines)}" if timelines else ""),
            "",
            *(line for blk in results for line in block_markdown(blk, m, named)),
            SUMMARY_INTRO, "", markdown_table(SUMMARY_HEADER, summary, left=3), "",
        ]
        append_section(target, section)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
