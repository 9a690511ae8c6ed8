"""The worker's client session with real daemons: what one process may ask of its daemon while it has an
operation in flight."""

from __future__ import annotations

import session_programs as sp
from harness import run_ranks


def test_an_alloc_that_would_move_a_slot_in_flight_is_refused(make_cluster):
    """Issue 14, item 13: it used to free the op's memory, and both ranks got an internal KeyError."""
    cluster = make_cluster([2], cpu_servers=1)
    results = run_ranks(cluster, sp.alloc_while_in_flight, timeout=60)
    error = results[0]["error"]
    assert error.get("type") == "BPSError" and "'x'" in error["text"] and "in flight" in error["text"], error
    for rank, r in enumerate(results):
        assert (r["first"], r["first_max"]) == (2.0, 2.0), (rank, r)  # both ranks' round of 'x' completed
        assert r["then"] == 1.0, (rank, r)  # 0 + 1


def test_a_slab_given_up_while_a_tensor_carved_from_it_is_in_flight_is_kept(make_cluster):
    """A process carves its small tensors from slabs (bps_worker.client.slots); giving one up names the slab,
    not its tensors, so the daemon checks the ops in flight against the slab's segment, not their names."""
    cluster = make_cluster([2], cpu_servers=1)
    results = run_ranks(cluster, sp.slab_given_up_in_flight, timeout=60)
    for rank, r in enumerate(results):
        assert (r["first"], r["then"], r["slabs"]) == ([6.0], [1.0], 1), (rank, r)
