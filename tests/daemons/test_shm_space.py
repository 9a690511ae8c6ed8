"""A /dev/shm too small for a tensor (Docker's default is 64 MiB): a BPSError naming the size, and every
daemon keeps serving (before, sparse segments made the server, the worker or the training process die of
SIGBUS when a page could not be backed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import shm_programs
    from harness import run_ranks, start_cluster, write_config
    cluster = start_cluster(write_config(Path(sys.argv[2]), [1, 1], cpu_servers=1, cluster={"timeout": 5.0}))
    try:
        results = run_ranks(cluster, shm_programs.big_then_small, 10 << 20, 1000, timeout=60)
        dead = cluster.dead_daemon()
        print(json.dumps({"results": results, "dead": None if dead is None else dead.label}))
    finally:
        cluster.stop()
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_tensor_larger_than_dev_shm_fails_the_call_and_nothing_dies(tmp_path: Path):
    script = (f"mount -t tmpfs -o size=32m tmpfs /dev/shm && "
              f"exec {sys.executable} -c '{CHILD}' {TESTS} {tmp_path}")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["dead"] is None, f"daemon {report['dead']} died"
    for rank, r in enumerate(report["results"]):
        assert r["error"] is not None, f"rank {rank}: a 40 MiB tensor went through a 32 MiB /dev/shm"
        assert r["error"].startswith("BPSError") or "Error" in r["error"].split(":")[0], r["error"]
        assert f"{40 << 20} bytes" in r["error"] and "/dev/shm" in r["error"], r["error"]
        assert r["small"] == [3.0] * 1000, (rank, r["small"][:4])
