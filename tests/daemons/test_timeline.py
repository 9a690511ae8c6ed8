"""Chrome-trace timelines from the daemons (--timeline) and the ranks (BPS_TIMELINE)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bps_runtime.timeline import Timeline, load, merge
from harness import write_config

REPO = Path(__file__).resolve().parents[2]
PROGRAM = """
import numpy as np, bps_worker.client as bps
bps.init()
for step in range(3):
    bps.push_pull(np.full(300_000, float(bps.rank()), np.float32), "w", average=False)
    bps.push_pull(np.ones(3, np.float32), "b")
bps.shutdown()
"""


def test_a_trace_is_valid_json_even_if_its_writer_died(tmp_path):
    t = Timeline(str(tmp_path / "t.json"), "test")
    t.span("lane a", "work", 10, 30, bytes=4)
    t.flush()  # no close(): as if the process died here
    events = load(str(tmp_path / "t.json"))
    assert [e["name"] for e in events if e["ph"] == "X"] == ["work"]
    t.close()
    assert json.loads((tmp_path / "t.json").read_text())[-1] == {}


@pytest.mark.timeout(120)
def test_launch_timeline_records_every_stage(tmp_path):
    config = write_config(tmp_path, [2, 1], cluster={"partition_bytes": 256 * 1024})
    out = tmp_path / "trace"
    result = subprocess.run([sys.executable, "-m", "bps_worker.launch", "--config", str(config), "--timeline",
                             str(out), "--", sys.executable, "-c", PROGRAM], cwd=REPO, capture_output=True, text=True,
                            timeout=100)
    assert result.returncode == 0, result.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["rank0.json", "rank1.json", "rank2.json", "server-0.json", "server-1.json", "server-2.json",
                     "worker-0.json", "worker-1.json"]
    merged = tmp_path / "all.json"
    count = merge(str(merged), [str(p) for p in sorted(out.iterdir())])
    events = json.loads(merged.read_text())["traceEvents"]
    assert count == len(events)
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    # client: copy in / waiting / copy out; worker: local sum, per-partition queue/server/pull, hand-back;
    # server: each worker's add and the round.
    for stage in ("push_pull", "copy in", "worker daemon", "copy out", "local sum", "queued", "push, server sum",
                  "hand-back", "add worker 0", "add worker 1", "round 2"):
        assert stage in names, (stage, sorted(names))
    # one box: every server shares the host, so sums come back through shared memory (no "pull" over TCP)
    assert all(e["args"]["shm"] for e in spans if e["name"] == "push, server sum")
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in spans)
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "w" in lanes and any(lane.startswith("w p") and "server" in lane for lane in lanes)
