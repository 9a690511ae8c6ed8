"""``push_pull_group`` on real daemons: a whole tree in one call, exact in any order, with mixed dtypes and
sizes; a mismatch fails its name alone; bad groups start nothing."""

from __future__ import annotations

import re
from typing import Any

import pytest

import group_programs as gp
from harness import run_ranks, server_stats, start_cluster, write_config


@pytest.mark.timeout(120)
def test_a_tree_of_mixed_dtypes_and_sizes_in_any_order_is_exact(cluster_2x2: Any) -> None:
    for r in run_ranks(cluster_2x2, gp.group_steps, 3, 20, timeout=100, client_timeout=60):
        assert r["wrong"] == [], r["wrong"][:5]


@pytest.mark.timeout(120)
def test_5000_names_go_packed_into_a_few_tensors_exact_in_any_order(cluster_2x2: Any) -> None:
    before = sum(st["rounds_completed"] for st in server_stats(cluster_2x2).values())
    for r in run_ranks(cluster_2x2, gp.group_many, 5000, 3, timeout=100, client_timeout=60):
        assert r["wrong"] == 0
    # per step: the agreement and one packed tensor (a few pieces each), not 5000 names
    rounds = sum(st["rounds_completed"] for st in server_stats(cluster_2x2).values()) - before
    assert rounds <= 3 * 20, rounds


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, words", [("shape", ("[4]", "[5]")), ("dtype", ("float32", "float64")),
                                        ("size", ("[4]", "[40000]"))])
def test_a_mismatch_in_a_group_names_it_and_the_others_complete(cluster_2x2: Any, how: str,
                                                                 words: tuple[str, str]) -> None:
    """Whatever differs, no process waits for a packed tensor another never sends: the agreement sends them
    all by name, where the differing one fails alone (a dtype, or a size that packs on one process only)."""
    results = run_ranks(cluster_2x2, gp.group_mismatch, 3, 200, how, timeout=100)
    for rank, r in enumerate(results):
        error = r["error"]
        assert "'gm.bad'" in error["text"] and all(w in error["text"] for w in words), (rank, error)
        if rank >= 2:  # the machine where the two sides met: the typed error with its facts
            assert error["type"] == "BPSMismatchError" and error["name"] == "gm.bad", (rank, error)
        assert r["wrong"] == 0


@pytest.mark.timeout(120)
def test_a_group_that_one_process_averages_and_the_others_sum_names_a_tensor_of_it(cluster_2x2: Any) -> None:
    for rank, r in enumerate(run_ranks(cluster_2x2, gp.group_average_mismatch, 3, 20, timeout=100)):
        error = r["error"]
        assert error and "\x00" not in error["text"] and "'ga." in error["text"], (rank, error)
        if error["type"] == "BPSMismatchError":
            assert error["name"].startswith("ga."), (rank, error)
        assert r["wrong"] == 0


@pytest.mark.timeout(120)
def test_bad_groups_are_refused_naming_why_and_start_nothing(cluster_2x2: Any) -> None:
    for r in run_ranks(cluster_2x2, gp.group_bad_calls, timeout=100):
        refused = r["refused"]
        assert refused["lengths"] == "push_pull_group: 2 arrays but 1 names"
        assert refused["twice"] == "tensor 'gb.0' appears twice in one push_pull_group"
        assert "complex64" in refused["dtype"]
        assert refused["in flight"].startswith("tensor 'gb.1' is already in flight")
        assert r["held"] == [4.0, 4.0]
        assert r["ok"] == [[4.0] * 3, [4.0] * 2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, n", [("extra", 10), ("rename", 10), ("straddle", 7)])
def test_groups_that_name_other_tensors_sum_what_they_share_and_fail_naming_the_rest(tmp_path: Any, how: str,
                                                                                       n: int) -> None:
    """The vote is one name for every group. Named after the group's names, processes whose groups named other
    tensors (one entry more on one, or another name) each waited for ever for a vote of their own, every shared
    entry with it, the stall warnings naming only the vote; and a group of 7 met one of 8 the same way. Now they go
    by name: the shared names complete, each differing one fails naming itself (cluster.stall_timeout)."""
    cluster = start_cluster(write_config(tmp_path, [2, 2], cpu_servers=1,
                                         cluster={"timeout": 1.0, "stall_timeout": 2.0}))
    try:
        results = run_ranks(cluster, gp.group_names_differ, how, n, 2.0, timeout=90, start_together=True)
    finally:
        cluster.stop()
    for rank, r in enumerate(results):
        assert r["wrong"] == 0, (rank, r)
        error = r["error"]
        if how != "rename" and rank > 0:  # every name of theirs is every process's: summed, no error
            assert error == {}, (rank, error)
            continue
        differs = {"extra": "gd.extra", "straddle": "gd.extra", "rename": "gd.mine" if rank == 0 else f"gd.{n - 1}"}
        assert error["type"] == "BPSTimeoutError", (rank, error)
        assert re.search(rf"'{differs[how]}'.* timed out after 2 s", error["text"]), (rank, error)
        assert "\x00" not in error["text"] and "vote" not in error["text"], (rank, error)
