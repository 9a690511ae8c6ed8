"""A result the worker daemon answered (a ``Done`` naming its results segment) stays there until the process has
taken it, even when the daemon's results arena needs room at its cap (``cluster.arena_bytes``).

Before, an answered result was idle memory like any other: another operation's result could take its room in the
moment between the daemon's Done and the process's reader thread mapping the segment (a process descheduled
there), and that process's call failed ("cannot map the result") although its round had succeeded everywhere."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import bps_worker.client as bps
import shm_programs
from harness import SHM_DIR, _rank_main, daemon_logs, rank_context, reap, start_cluster, write_config

MB = 1 << 20
ELEMS = MB // 2  # 2 MiB of float32: a segment of its own in each arena, and not fused


@pytest.mark.timeout(120)
def test_a_result_stays_mappable_until_a_descheduled_process_takes_it(tmp_path: Path):
    """Two machines, one process each, every arena capped at 5 MiB (two and a half of these tensors). Here,
    A's result is put in place before B's (A was issued first), but the other machine's process pushes A only
    after this one took B's result: A's Done comes last, and this process's reader thread stalls right before it
    maps A's segment. C (a shared array, its slot made before the stall: an Alloc's answer would wait for the
    reader too) is summed in place meanwhile, and its result needs the room of A's or B's: it must be B's
    (taken), not A's (answered, not yet taken; the least recently used, which is what was freed before)."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=0,
                                         cluster={"arena_bytes": 5 * MB}))
    ctx = rank_context()
    queue, b_taken = ctx.Queue(), ctx.Event()
    helper = ctx.Process(target=_rank_main, args=(queue, cluster.socket_path(1), 0, 1,
                                                  shm_programs.beside_a_stalled_reader, (ELEMS, b_taken), 20.0),
                         daemon=True)
    helper.start()
    release = threading.Event()
    try:
        bps.init(socket=cluster.socket_path(0), local_rank=0, timeout=20.0)
        conn = bps._operations().conn  # type: ignore[attr-defined]  # the process's client state, for a test
        a = np.ones(ELEMS, np.float32)
        # A first round of each: both results are in place, their rounds' bases known. A's in place, in a shared
        # array: this process has not mapped A's result segment then (it keeps the last one of a name mapped).
        shared_a = bps.shared_array("A", (ELEMS,), np.float32)
        shared_a[...] = 1.0
        np.testing.assert_array_equal(bps.push_pull(shared_a, "A", average=False, out=shared_a), 2.0)
        np.testing.assert_array_equal(bps.push_pull(a, "B", average=False), 2.0)
        segments: dict[str, str] = {}
        stalled = threading.Event()
        map_result = conn.map_result

        def descheduled(name: str, segment: str) -> Any:  # the reader thread, as a Done arrives
            segments[name] = segment
            if name == "A":
                stalled.set()
                release.wait(60)
            return map_result(name, segment)

        conn.map_result = descheduled
        handle_a = bps.push_pull_async(a, "A", average=False)
        handle_b = bps.push_pull_async(a, "B", average=False)
        np.testing.assert_array_equal(bps.synchronize(handle_b, timeout=30), 2.0)
        c = bps.shared_array("C", (ELEMS,), np.float32)  # (this process gives up B's slot for it)
        c[...] = 1.0
        b_taken.set()
        assert stalled.wait(30), "A's Done never came"
        handle_c = bps.push_pull_async(c, "C", average=False, out=c)  # its result needs A's room or B's
        deadline = time.monotonic() + 30
        while all((SHM_DIR / segments[name]).exists() for name in ("A", "B")):
            assert time.monotonic() < deadline, "C's result never took any room\n" + daemon_logs(cluster)[-4000:]
            time.sleep(0.005)
        release.set()
        np.testing.assert_array_equal(bps.synchronize(handle_a, timeout=30), 2.0)  # (was: cannot map the result)
        np.testing.assert_array_equal(bps.synchronize(handle_c, timeout=30), 2.0)
        rank, status, value = queue.get(timeout=30)
        assert (rank, status, value) == (1, "ok", [2.0] * 5), value
    finally:
        release.set()
        bps.shutdown()
        reap([helper])
        cluster.stop()
