"""The README's main job, on a private copy of the one-box cluster: it trains and prints its summary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import write_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("forked_daemons")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_digits_example_trains_on_a_one_box_cluster(tmp_path, device):
    config = write_config(tmp_path, [2, 2], cpu_servers=1)
    result = subprocess.run(
        [sys.executable, "-m", "bps_worker.launch", "--config", str(config), "--",
         sys.executable, str(ROOT / "examples" / "train_digits.py"), "--epochs", "3", "--device", device],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "summary" in out and "4 processes on 2 workers" in out
    assert ("on the CPU" if device == "cpu" else "on CUDA (") in out, out
    accuracy = float(out.split("test accuracy:")[1].split()[0])
    assert accuracy >= 0.85
    assert "samples/s" in out


@pytest.mark.timeout(240)  # processes importing and compiling JAX: slow on a busy 2-core box
def test_jax_digits_example_trains_on_a_one_box_cluster(tmp_path):
    """One process a machine: the JAX path is what this shows (the two-process machines are the PyTorch example's
    and the daemons' tests), and each process importing and compiling JAX costs 10 CPU-s."""
    pytest.importorskip("jax")
    config = write_config(tmp_path, [1, 1], cpu_servers=1)
    result = subprocess.run(
        [sys.executable, "-m", "bps_worker.launch", "--config", str(config), "--",
         sys.executable, str(ROOT / "examples" / "train_digits_jax.py"), "--epochs", "2"],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "--- train_digits_jax summary ---" in out and "2 processes on 2 workers" in out
    accuracy = float(out.split("test accuracy:")[1].split()[0])
    assert accuracy >= 0.85
    reference = float(out.split("reference:")[1].split("test accuracy")[1].split()[0].rstrip(","))
    difference = float(out.split("difference:")[1].split()[0])
    assert difference == pytest.approx(abs(accuracy - reference), abs=1e-4)
    assert difference <= 0.02


def test_digits_example_trains_asynchronously_with_a_straggler(tmp_path):
    """--async --staleness 2 --straggler 1:2: the asynchronous run reaches the example's accuracy bar, and every
    replica ends with the servers' final value (the example checks it, or fails). One process a machine: machines
    of several are the synchronous example's and the asynchronous daemon tests' (each process here imports torch
    and scikit-learn, 6 CPU-s)."""
    config = write_config(tmp_path, [1, 1], cpu_servers=1)
    result = subprocess.run(
        [sys.executable, "-m", "bps_worker.launch", "--config", str(config), "--",
         sys.executable, str(ROOT / "examples" / "train_digits.py"), "--epochs", "3", "--async", "--staleness", "2",
         "--straggler", "1:2"],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "mode:           asynchronous, staleness 2, rank 1 2x slower" in out
    assert float(out.split("test accuracy:")[1].split()[0]) >= 0.85
