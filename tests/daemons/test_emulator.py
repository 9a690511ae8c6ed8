"""The cluster emulator (benchmarks/cluster): machines as network namespaces, shaped links, our daemons inside.

Root only (it creates network namespaces, veth pairs and tc qdiscs); skipped elsewhere. Timings are never
checked here (see ../shared/MEASURING.md): only that a sum crosses the emulated links exactly and that
nothing the emulator created survives it, also on an exception or SIGTERM.
"""

from __future__ import annotations

import itertools
import math
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from benchmarks.cluster import Daemons, Layout, Network, our_namespaces, unavailable_reason  # noqa: E402

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"cluster emulator unavailable: {REASON}")

RANK = r"""
import os, sys
import numpy as np
import bps_worker.client as bps

bps.init(timeout=30.0)
rank, size = bps.rank(), bps.size()
n = 300_001                                   # 1.2 MB: split over all three servers, in several partitions
x = (np.arange(n) % 13 + rank).astype(np.float32)
out = np.zeros_like(x)
bps.push_pull(x, "emulated.grad", average=False, out=out)
expect = (size * (np.arange(n) % 13) + sum(range(size))).astype(np.float32)
small = bps.push_pull(np.full(3, rank + 1.0, dtype=np.float32), "emulated.bias", average=False)
bps.shutdown()
ok = np.array_equal(out, expect) and np.array_equal(small, np.full(3, size * (size + 1) / 2, dtype=np.float32))
os.write(1, f"rank {rank}: exact={ok}\n".encode())  # one write: ranks share a pipe
sys.exit(0 if ok else 3)
"""


def _leftovers(net_prefix: str, token_prefix: str) -> list[str]:
    """Anything of one Network still visible from the host: namespaces, links, qdiscs."""
    found = [ns for ns in our_namespaces(net_prefix)]
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [line for line in listing.splitlines() if net_prefix in line]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found += [line for line in links.splitlines() if token_prefix in line]
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    found += [line for line in qdiscs.splitlines() if token_prefix in line]
    return found


@pytest.mark.timeout(90)
def test_push_pull_across_namespaces_and_clean_teardown(tmp_path: Path) -> None:
    with Network(["w0", "w1", "c0"], bandwidth="200mbit") as net:
        prefix, token_prefix = net.prefix, f"bpe{net.token}"
        assert sorted(our_namespaces(prefix)) == sorted(f"{prefix}-{x}" for x in ("br", "w0", "w1", "c0"))
        shaped = "\n".join(net.qdiscs().values())
        for m in net.machines.values():  # both directions of every link
            assert "tbf" in shaped and f"dev {m.ifname} root" in shaped and f"dev {m.peer} root" in shaped, shaped
        # the host's own namespace never sees our links
        assert token_prefix not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout

        layout = Layout(workers=["w0", "w1"], cpu_servers=["c0"], cluster={"partition_bytes": 262144, "timeout": 20.0})
        before = net.link_counters()
        with Daemons(net, layout, tmp_path / "cluster", log_level="info", log_dir=tmp_path / "logs") as cluster:
            config = cluster.config_path.read_text()
            assert f'address = "{net.address("c0")}:' in config and "worker = 1" in config
            for w in range(2):
                cluster.start_rank(w, 0, [sys.executable, "-c", RANK],
                                   stdout=open(tmp_path / f"rank{w}.out", "w"), stderr=subprocess.STDOUT)
            code = cluster.wait_ranks(timeout=60)
        outputs = "\n".join((tmp_path / f"rank{w}.out").read_text() for w in range(2))
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((tmp_path / "logs").glob("*.log")))
        assert code == 0, outputs + "\n" + logs
        assert outputs.count("exact=True") == 2, outputs
        after = net.link_counters()
        # the sum crossed the emulated links: every worker sent about its pushes, the CPU-only machine got its share
        for name in ("w0", "w1", "c0"):
            assert after[name]["tx_bytes"] - before[name]["tx_bytes"] > 100_000, (name, before, after)
            assert after[name]["rx_bytes"] - before[name]["rx_bytes"] > 100_000, (name, before, after)
    assert _leftovers(prefix, token_prefix) == []


@pytest.mark.timeout(30)
def test_sysctls_apply_to_every_machine_only() -> None:
    key = "net.ipv4.tcp_slow_start_after_idle"
    host = Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle").read_text().strip()
    with pytest.raises(ValueError, match="only net"):
        Network(["a"], sysctls={"kernel.pid_max": "1"})
    with Network(["a", "b"], sysctls={key: "0" if host == "1" else "1"}) as net:
        for name in ("a", "b"):
            out = subprocess.run([*net.exec_prefix(name), "sysctl", "-n", key], capture_output=True, text=True,
                                 check=True).stdout.strip()
            assert out == ("0" if host == "1" else "1")
    assert Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle").read_text().strip() == host  # not the host's


@pytest.mark.timeout(30)
def test_teardown_on_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with Network(["a", "b"]) as net:
            prefix, token_prefix = net.prefix, f"bpe{net.token}"
            sleeper = net.popen("a", [sys.executable, "-c", "import time; time.sleep(60)"])
            assert len(our_namespaces(prefix)) == 3
            raise RuntimeError("boom")
    assert sleeper.poll() is not None  # the processes inside were stopped
    assert _leftovers(prefix, token_prefix) == []


@pytest.mark.timeout(30)
def test_teardown_on_sigterm(tmp_path: Path) -> None:
    program = (f"import sys, time; sys.path.append({str(REPO)!r})\n"
               "from benchmarks.cluster import Network\n"
               "with Network(['a', 'b']) as net:\n"
               "    print(net.prefix, net.token, flush=True)\n"
               "    net.popen('b', [sys.executable, '-c', 'import time; time.sleep(60)'])\n"
               "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    try:
        prefix, token = proc.stdout.readline().split()  # type: ignore[union-attr]
        assert len(our_namespaces(prefix)) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _leftovers(prefix, f"bpe{token}") == []


def _run_paper(args: list[str], timeout: float) -> str:
    """benchmarks/paper_vs_allreduce.py with ``args``: its stdout, after checking it succeeded and left nothing."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "paper_vs_allreduce.py"), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the benchmark tears its namespaces down on SIGTERM
            proc.communicate(timeout=20)
    assert proc.returncode == 0, stdout + stderr
    assert [ns for ns in our_namespaces() if ns.startswith(f"bpe-{proc.pid}-")] == []
    return stdout


def _summary(stdout: str) -> list[dict[str, str]]:
    """The rows of the run's summary table, by column name (columns are two or more spaces apart)."""
    lines = stdout.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("n ") and "GPU machine / gloo rank" in line]
    assert len(heads) == 1, stdout
    names = re.split(r"\s{2,}", lines[heads[0]].strip())
    rows = itertools.takewhile(str.strip, lines[heads[0] + 2:])
    return [dict(zip(names, re.split(r"\s{2,}", row.strip()), strict=True)) for row in rows]


def _positive(cell: str) -> bool:
    """A CPU figure, ``median (max)`` or a ratio, is a positive number."""
    value = float(cell.split()[0])
    return math.isfinite(value) and value > 0


@pytest.mark.timeout(150)
def test_paper_vs_allreduce_smoke_prints_its_table() -> None:
    stdout = _run_paper(["--ns", "2", "--size", "256K", "--reps", "2", "--ks", "1", "--ps-ks", "", "--timeout", "100"],
                        timeout=140)  # k=1: both kinds of machine, one configuration; 2 machines: 12 s, 4: 20 s
    lines = stdout.splitlines()
    header = [line for line in lines if line.lstrip().startswith("config") and "gloo/ours theory" in line]
    assert len(header) == 1, stdout
    rows = lines[lines.index(header[0]) + 2:][:1]
    assert [row.split()[0] for row in rows] == ["k=1"], stdout
    for row in rows:
        assert row.rstrip().endswith("yes"), row  # exact, and equal to gloo's sum
    assert any(line.startswith("soundness:") for line in lines), stdout
    [summary] = _summary(stdout)
    for role in ("GPU machine CPU-s/op", "CPU-only machine CPU-s/op", "gloo rank CPU-s/op", "GPU machine / gloo rank"):
        assert _positive(summary[role]), (role, summary)


@pytest.mark.timeout(150)
def test_paper_vs_allreduce_sweep_summarizes_every_bandwidth() -> None:
    # Two emulated clusters of 2 machines, each of 4 daemons started with exec inside their namespaces: 13 s on
    # a quiet 2-core box (n = 4 took 25-40 s, 57 s with another test file and a busy loop beside it).
    stdout = _run_paper(["--ns", "2", "--size", "1M", "--reps", "1", "--warmup", "1", "--ks", "0", "--ps-ks", "",
                         "--bandwidths", "200mbit,500mbit", "--timeout", "40"], timeout=140)
    rows = _summary(stdout)
    assert [(row["n"], row["B"], row["config"]) for row in rows] == [("2", "200mbit", "k=0"),
                                                                    ("2", "500mbit", "k=0")], stdout
    for row in rows:
        assert row["exact"] == "yes", row
        for role in ("GPU machine CPU-s/op", "gloo rank CPU-s/op", "GPU machine / gloo rank"):
            assert _positive(row[role]), (role, row)
        assert row["CPU-only machine CPU-s/op"] == "-", row  # k = 0: no CPU-only machine
    assert sum(line.startswith("soundness (n = 2, B = ") for line in stdout.splitlines()) == 2, stdout


@pytest.mark.timeout(150)
def test_cpu_model_fits_every_role_and_leaves_nothing() -> None:
    # Two points of 2 emulated machines each (about 12 s a point on a quiet 2-core box).
    cmd = [sys.executable, str(REPO / "benchmarks" / "cpu_model.py"), "--n", "2", "--sizes", "256K,1M",
           "--partition-bytes", "64K", "--reps", "1", "--timeout", "60"]
    before = set(our_namespaces())
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=140)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    grid = lines.index(next(line for line in lines if line.startswith("M ") and "GPU machine / gloo rank" in line))
    rows = [line.split() for line in itertools.takewhile(str.strip, lines[grid + 2:])]
    assert [row[:2] for row in rows] == [["256K", "64K"], ["1M", "64K"]], proc.stdout
    for row in rows:
        assert int(row[2]) > 0 and all(float(cell) > 0 for cell in row[4:9]), row
    fitted = lines.index(next(line for line in lines if line.startswith("role ") and "per piece us" in line))
    assert [line.split()[0] for line in lines[fitted + 2:fitted + 6]] == ["worker", "server", "rank", "gloo"]
    assert any(line.startswith("predicted at M = 1M") for line in lines), proc.stdout
    assert set(our_namespaces()) <= before  # its runs' namespaces are gone
