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
@pytest.mark.parametrize("how", ["extra", "rename"])
def test_groups_that_name_other_tensors_fail_naming_the_group_not_its_internal_agreement(tmp_path: Any,
                                                                                          how: str) -> None:
    """Processes whose groups name other tensors (one entry more on one, or another name) push agreements of other
    names and wait for them as for names pushed one by one. Their stall lines and (cluster.stall_timeout) errors
    named only the agreement's internal name ('\\x00group/<digest>/agree', a review); they name the group now.
    The job goes on: a group the same on every process, next, is exact."""
    # (one process a machine: each group waits at the servers alone, its error the planner's timeout)
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1,
                                         cluster={"timeout": 1.0, "stall_timeout": 2.0}))
    try:
        results = run_ranks(cluster, gp.group_names_differ, how, 10, 2.0, timeout=90, start_together=True)
    finally:
        cluster.stop()
    group = r"the agreement of a push_pull_group of 1[01] tensors \('gd\.0', 'gd\.1', 'gd\.2', \.\.\.;"
    for rank, r in enumerate(results):
        assert r["wrong"] == 0, (rank, r)
        error = r["error"]
        assert error["type"] == "BPSTimeoutError", (rank, error)
        assert re.search(group + r".*every process's group must name the same tensors\) timed out after 2 s",
                        error["text"]), (rank, error)
        # (its worker's local round, or the server's round: "round 0 of ...", whichever timed out first)
        assert "the agreement of a push_pull_group of 1" in error["what"], (rank, error)
        assert "\\x00" not in error["text"] and "agree'" not in error["text"], (rank, error)
        assert all("\\x00group" not in line for line in r["stall_lines"]), (rank, r["stall_lines"])
    lines = [line for r in results for line in r["stall_lines"]]
    assert any(re.search(group, line) for line in lines), lines


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3, 10], ids=["by name", "packed"])
def test_groups_of_two_threads_started_in_other_orders_both_sum(cluster_2x2: Any, n: int) -> None:
    """Each process's two threads call push_pull_group on their own groups, in another order on every other rank:
    each group meets its own on the peers (agreements named after the groups' names). One agreement name for
    every group, tried this session, deadlocked here (a review)."""
    for rank, r in enumerate(run_ranks(cluster_2x2, gp.group_threads, n, timeout=90)):
        assert r == {"done": {"A": True, "B": True}, "alive": [False, False]}, (rank, r)
