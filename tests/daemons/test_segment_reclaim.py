"""Issue 14, item 12: a worker daemon killed together with its resource tracker leaves its segments in
/dev/shm; the next daemon of that worker reclaims the ones of dead pids at start-up, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import rank_programs as rp
from harness import daemon_logs, run_ranks, start_cluster, write_config

SHM = Path("/dev/shm")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_starting_worker_reclaims_the_segments_of_its_dead_daemons(tmp_path: Path):
    dead = _dead_pid()
    # Worker 3 of a 4-machine cluster: rarer than worker 0 among the clusters other tests may be starting.
    leaked = SHM / f"bps_w3_{dead}_ab12"  # worker 3's, of a daemon that died: reclaimed
    live = SHM / f"bps_w3_{os.getpid()}_ab12"  # worker 3's name, but its pid is alive: kept
    other = SHM / f"bps_w57_{dead}_ab12"  # another worker's: not ours to reclaim
    for path in (leaked, live, other):
        path.write_bytes(b"\0" * 4096)
    try:
        cluster = start_cluster(write_config(tmp_path, [1, 1, 1, 1], cpu_servers=0))
        try:
            assert not leaked.exists(), "the dead daemon's segment outlived the restart"
            assert live.exists() and other.exists()
            log = Path(cluster.log_dir or "", "worker-3.log").read_text()
            assert f"reclaimed 1 shared-memory segments of dead daemons of worker 3: bps_w3_{dead}_ab12" in log, \
                daemon_logs(cluster)
            assert run_ranks(cluster, rp.ranks_info, timeout=60)[3]["size"] == 4  # and it serves as usual
        finally:
            cluster.stop()
    finally:
        for path in (leaked, live, other):
            path.unlink(missing_ok=True)
