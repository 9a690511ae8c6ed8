"""The worker's client session with real daemons: what one process may ask of its daemon while it has an
operation in flight."""

from __future__ import annotations

import pytest

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


@pytest.mark.timeout(120)
def test_a_refused_duplicate_request_number_leaves_the_op_holding_it_in_flight(make_cluster):
    """The refusal went through the answers' bookkeeping and ended the hold of the op in flight under that number:
    an Alloc then moved that op's slot, and both ranks' round of 'x' failed ("freed while the operation ran")."""
    cluster = make_cluster([2], cpu_servers=1)
    results = run_ranks(cluster, sp.duplicate_request_then_alloc, timeout=90)
    assert "'x'" in results[0]["error"] and "in flight" in results[0]["error"], results[0]
    assert results[1]["first"] == [2.0], results[1]


@pytest.mark.timeout(120)
def test_a_second_op_of_a_running_name_from_one_process_is_refused(make_cluster):
    cluster = make_cluster([1, 1], cpu_servers=1)
    mine, peer = run_ranks(cluster, sp.same_name_while_running, 1 << 16, timeout=90)
    assert mine["second"] == "Failure" and "'x' is already in flight from this process" in mine["text"], mine
    assert mine["first"] == [2.0] and peer["first"] == [2.0], (mine, peer)


@pytest.mark.timeout(120)
def test_a_round_of_a_name_with_a_long_repr_fails_when_a_process_leaves(make_cluster):
    cluster = make_cluster([2], cpu_servers=0, cluster={"timeout": 5.0})
    mine, _ = run_ranks(cluster, sp.left_with_a_long_name, 1.0, timeout=90)
    assert mine["error"] == "BPSConnectionError" and mine["waited"] < 4.0, mine
