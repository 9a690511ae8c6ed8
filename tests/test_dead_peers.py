"""A worker daemon killed mid-training: every process gets BPSError within the timeout, never a hang."""

from __future__ import annotations

import signal
import threading
import time

import rank_programs as rp
from harness import run_ranks, start_cluster, write_config

TIMEOUT_S = 3.0


def test_kill_9_of_a_worker_daemon_fails_every_process_fast(tmp_path):
    cluster = start_cluster(write_config(tmp_path, [2, 2], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    try:
        victim = next(c for c in cluster.children if c.label == "worker-1")
        killed_at: list[float] = []

        def kill() -> None:
            time.sleep(2.5)  # let the ranks connect and run some rounds
            killed_at.append(time.time())
            victim.proc.send_signal(signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
        results = run_ranks(cluster, rp.push_until_error, 30.0, timeout=60)
        assert killed_at
        for rank, r in enumerate(results):
            assert r["error"] is not None, f"rank {rank} never noticed the dead worker"
            assert r["rounds"] > 0
            assert r["at"] - killed_at[0] < TIMEOUT_S + 5, (rank, r["at"] - killed_at[0], r["error"])
        assert "worker 1" in results[0]["error"] or "disconnected" in results[0]["error"], results[0]["error"]
        assert "worker daemon" in results[2]["error"], results[2]["error"]
    finally:
        cluster.stop()
