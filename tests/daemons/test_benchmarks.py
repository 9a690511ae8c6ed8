"""Benchmarks are scripts (timings never go into tests); here only: they run on tiny sizes and print their table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import write_config

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("forked_daemons")


def _two_machines(tmp_path: Path) -> list[str]:
    """``--config`` of a cluster of two machines of one process each (the scripts' own is configs/local.toml's
    shape, 2 x 2): each rank process imports torch, 3-4 CPU-s, and a smoke needs only two to show its table."""
    return ["--config", str(write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"partition_bytes": 4 << 20}))]


def test_push_pull_vs_gloo_quick_prints_its_table(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "push_pull_vs_gloo.py"), "--quick",
                             *_two_machines(tmp_path)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = [line for line in lines if line.lstrip().startswith("size") and "ratio gloo/bps" in line]
    assert len(header) == 1, result.stdout
    rows = lines[lines.index(header[0]) + 2:]
    sizes = [row.split()[0] for row in rows if row.strip()]
    assert sizes[:2] == ["4K", "64K"], result.stdout
    for row in rows[:2]:
        assert row.rstrip().endswith("yes"), row  # bps and gloo agree bit for bit


def test_train_vs_ddp_quick_prints_its_tables(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "train_vs_ddp.py"), "--quick",
                             *_two_machines(tmp_path)],
                            capture_output=True, text=True, timeout=90, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = [line for line in lines if line.lstrip().startswith("model") and "ratio bps/ddp" in line]
    assert len(header) == 1, result.stdout
    rows = lines[lines.index(header[0]) + 2:]
    models = [row.split()[0] for row in rows[:2]]
    assert models == ["example", "wide"], result.stdout
    for row in rows[:2]:
        assert " yes (" in row, row  # weights agree with DDP's after the warm-up; bps replicas identical
    assert any("hidden" in line and "exposed comm" in line for line in lines), result.stdout


def test_ddp_hook_vs_gloo_quick_prints_its_table(tmp_path):
    """Two rank processes import torch, then build DDP twice."""
    command = [sys.executable, str(REPO / "benchmarks" / "ddp_hook_vs_gloo.py"), "--quick", "--models", "example",
               "--blocks", "1", *_two_machines(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=90, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr  # 0: the hook's weights agree with gloo's
    lines = result.stdout.splitlines()
    header = [line for line in lines if line.lstrip().startswith("model") and "ratio hook/gloo" in line]
    assert len(header) == 1, result.stdout
    row = lines[lines.index(header[0]) + 2].split()
    assert row[:3] == ["example", "0.146", "8"] and row[-3] == "yes", result.stdout
    assert float(row[-4]) > 0, result.stdout  # the ratio of two measured rates


def test_kernels_benchmark_tiny_prints_its_table():
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernels.py"), "--mib", "1", "--reps", "1"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = [line for line in lines if line.lstrip().startswith("dtype") and "ours/numpy" in line]
    assert len(header) == 1, result.stdout
    rows = [line.split() for line in lines[lines.index(header[0]) + 2:] if line.strip()]
    kernels = {(row[0], " ".join(row[1:3]) if row[2] in ("/2", "/3", "2", "4") else row[1]) for row in rows}
    for dtype in ("float32", "float64", "float16", "bfloat16", "int32", "int64"):
        for kernel in ("accumulate", "first-push", "finalize", "sum_into 2", "sum_into 4"):
            assert (dtype, kernel) in kernels, result.stdout
    assert ("float16", "finalize /3") in kernels and ("int32", "finalize /2") not in kernels, result.stdout
    for row in rows:
        assert row[-1] == "yes", row  # ours equals numpy's result bit for bit


def test_offload_benchmark_tiny_prints_one_row_per_size():
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "offload.py"), "--kib", "4,256",
                             "--calls", "20", "--reps", "1"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = [i for i, line in enumerate(lines) if line.startswith("KiB summed into")]
    assert len(header) == 1, result.stdout
    rows = [line.split() for line in lines[header[0] + 2:] if line.strip()]
    assert [row[0] for row in rows] == ["4", "256"], result.stdout
    for row in rows:
        offloaded_cpu, inline_cpu, hop = float(row[2]), float(row[4]), float(row[5])
        assert offloaded_cpu > 0 and inline_cpu > 0, row
        assert abs(hop - (offloaded_cpu - inline_cpu)) <= 0.15, row  # each figure rounded to 0.1


def test_async_keys_benchmark_tiny_prints_one_row_per_key_count():
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "async_keys.py"), "--keys", "10,50",
                             "--reps", "1"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = [i for i, line in enumerate(lines) if line.strip().startswith("keys")]
    assert len(header) == 1, result.stdout
    rows = [line.split() for line in lines[header[0] + 2:] if line.strip()]
    assert [row[0] for row in rows] == ["10", "50"] and rows[0][3] == "1.00", result.stdout
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows), result.stdout


def test_soak_tiny_restarts_a_server_and_reports_no_wrong_or_failed_round():
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "soak.py"), "--rounds", "60", "--max-elems",
                             "70000", "--max-seconds", "40"],
                            capture_output=True, text=True, timeout=90, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = [line for line in result.stdout.splitlines() if line.startswith("summary:")]
    assert len(summary) == 1, result.stdout
    assert "rounds 60, wrong 0, failed 0 " in summary[0] and "restart yes" in summary[0], result.stdout
    assert summary[0].endswith("PASS"), result.stdout
    # the CPU-only server was killed and restarted, and its new process has its own RSS row
    assert any(line.split()[:3] == ["server-2", "2nd", "life:"] for line in result.stdout.splitlines()), result.stdout


def test_mismatch_soak_tiny_gets_every_sum_and_every_planned_mismatch():
    """Seed 1's first 9 steps: name s14 goes fused on one machine and unfused on the other in a step with a
    mismatch, then unfused everywhere in step 8 (an old error on one machine and a hang on the other before
    8afc329)."""
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "mismatch_soak.py"), "--seeds", "1",
                             "--first-seed", "1", "--steps", "9", "--step-timeout", "10"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "seed 1: ok: 148 exact sums, 40 mismatch errors as planned" in result.stdout, result.stdout
    assert result.stdout.splitlines()[-1] == "1 of 1 seeds as expected", result.stdout


def test_fault_soak_tiny_restarts_servers_and_gets_every_sum():
    """Seed 0's first 6 steps with two faults (both freeze-kill: a server frozen, killed and restarted mid-step):
    every sum exact, none failed, also none by the cluster's stall_timeout (12 s: the restarts are no stall)."""
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fault_soak.py"), "--seeds", "1",
                             "--steps", "6", "--faults", "2", "--step-timeout", "15", "--stall-timeout", "12",
                             "--kinds", "kill-cpu,freeze-kill"],
                            capture_output=True, text=True, timeout=90, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "seed 0: ok: 168 exact sums, 0 mismatch errors as planned, 0 errors after a dropped connection; " \
           "faults: freeze-kill server-1 steps 2-" in result.stdout and "; freeze-kill server-0 steps 4-" in \
        result.stdout, result.stdout
    assert result.stdout.splitlines()[-1] == "1 of 1 seeds as expected", result.stdout


def test_shm_vs_tcp_tiny_prints_its_table_and_each_cluster_takes_its_path():
    import re

    command = [sys.executable, str(REPO / "benchmarks" / "shm_vs_tcp.py"), "--sizes", "1M", "--reps", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=90, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = [line for line in lines if line.startswith("size") and "ratio tcp/shm" in line]
    assert len(header) == 1, result.stdout
    rows = [line.split() for line in lines[lines.index(header[0]) + 2:][:2]]
    assert [row[:2] for row in rows] == [["1M", "shared"], ["1M", "plain"]], result.stdout
    assert all(row[-1] == "yes" for row in rows), result.stdout  # every sum exact
    # the servers' own counters: the shm cluster read pushes from shared memory, the tcp one never did
    m = re.search(r"shm cluster (\d+) of (\d+) received; tcp cluster (\d+) of (\d+) received", result.stdout)
    assert m, result.stdout
    shm_via, shm_in, tcp_via, tcp_in = map(int, m.groups())
    assert 0 < shm_via <= shm_in and tcp_via == 0 and tcp_in > 0, m.group(0)


def test_many_tensors_quick_prints_its_tables_and_every_sum_is_exact(tmp_path):
    command = [sys.executable, str(REPO / "benchmarks" / "many_tensors.py"), "--quick", "--tensors", "1,50", "--reps",
               "1", "--single-reps", "5", "--group", *_two_machines(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr  # 0: the warm-up found every sum exact
    lines = result.stdout.splitlines()
    header = [line for line in lines if line.lstrip().startswith("tensors") and "bps/gloo fused" in line]
    assert len(header) == 1, result.stdout
    rows = [row.split() for row in lines[lines.index(header[0]) + 2:][:2]]
    assert [row[:2] for row in rows] == [["1", "256"], ["50", "256"]], result.stdout
    for row in rows:
        assert row[-1] == "yes" and "skipped" not in row, row  # all three exact; 50 <= --max-gloo-per-tensor
    single = [line for line in lines if line.lstrip().startswith("bytes") and "p50 bps/gloo" in line]
    assert len(single) == 1, result.stdout
    row = lines[lines.index(single[0]) + 2].split()
    assert row[:2] == ["4K", "5"] and row[-1] == "yes" and len(row) == 10, result.stdout  # 2 columns back to back


def test_lone_floor_tiny_prints_every_process():
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "lone_floor.py"), "--calls", "50",
                             "--warmup", "5"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr  # (a rank asserts its sum: 4 x its array)
    rows = dict(line.rsplit(None, 1) for line in result.stdout.splitlines())
    assert sorted(key.strip() for key in rows) == sorted(
        ["p50 ms", "server CPU us", "worker0 CPU us", "worker1 CPU us"] + [f"rank{r} CPU us" for r in range(4)])
    assert all(float(value) > 0 for value in rows.values()), result.stdout


@pytest.mark.timeout(120)
def test_double_fault_tiny_rejoins_a_machine_back_from_a_double_fault():
    """One job of the test's order (every server and a worker machine restarted, then the machine's new process):
    every sum exact, the new process summed with the healthy one's steps in order, no error on it."""
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "double_fault.py"), "--sched", "test",
                             "--reps", "1", "--names", "2", "--elems", "1000", "--steps", "4"],
                            capture_output=True, text=True, timeout=100, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-2:] == ["test rep 0: ok", "1 of 1 jobs as expected"], result.stdout
