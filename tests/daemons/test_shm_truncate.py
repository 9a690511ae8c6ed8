"""Issue 14, item 3: a training process that truncates its own shared-memory slot under the daemons fails that
one operation (a BPSError naming the tensor, the segment, its size now and the size needed); no daemon dies
of SIGBUS, and the next operation on a fresh name works (before, the worker daemon died)."""

from __future__ import annotations

from pathlib import Path

import pytest

import shm_programs
from harness import daemon_logs, run_ranks, start_cluster, write_config

ELEMS = 1 << 18  # 1 MiB of float32: a segment of its own


@pytest.mark.timeout(180)
def test_a_truncated_slot_fails_its_operation_and_nothing_dies(tmp_path: Path):
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"timeout": 5.0}))
    try:
        results = run_ranks(cluster, shm_programs.truncate_own_slot, ELEMS, timeout=120)
        assert cluster.dead_daemon() is None, f"daemon {cluster.dead_daemon().label} died\n{daemon_logs(cluster)}"
        for rank, r in enumerate(results):
            assert r["first"] == [3.0, 3.0], (rank, r)
            assert r["error"] is not None, f"rank {rank}: the round over a truncated slot succeeded: {r}"
            assert r["fresh"] == [3.0, 3.0], (rank, r)
        error = results[0]["error"]
        assert "'victim'" in error and results[0]["segment"] in error, error
        assert "has 0 bytes now" in error and f"{ELEMS * 4} bytes are needed" in error, error
    finally:
        cluster.stop()
