"""Benchmarks are scripts (timings never go into tests); here only: they run on tiny sizes and print their table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_push_pull_vs_gloo_quick_prints_its_table():
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "push_pull_vs_gloo.py"), "--quick"],
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
