"""Scale-out: every server sums its Theorem-1 share of the bytes; priorities; thousands of tiny tensors."""

from __future__ import annotations

from fractions import Fraction

import pytest

import rank_programs as rp
from bps_worker.placement import server_shares
from harness import run_ranks, server_stats

ROUNDS = 2


@pytest.mark.parametrize("n,k", [(2, 0), (2, 1), (3, 1), (4, 2), (4, 4), (2, 3)])
def test_each_server_receives_its_theorem1_share(make_cluster, n, k):
    partition = 65536
    cluster = make_cluster([1] * n, cpu_servers=k, cluster={"partition_bytes": partition})
    results = run_ranks(cluster, rp.model_mix, 11, ROUNDS, timeout=100)
    assert [r["wrong"] for r in results] == [0] * n
    m = results[0]["bytes_per_round"]
    shares = server_shares(cluster.config)
    if k <= n:  # Theorem 1 proper
        denom = n * n + k * n - 2 * k
        for s in cluster.config.servers:
            assert shares[s.id] == (Fraction(2 * (n - 1), denom) if s.worker is None else Fraction(n - k, denom))
    stats = server_stats(cluster)
    assert sum(st["bytes_received"] for st in stats.values()) == n * ROUNDS * m
    for sid, st in stats.items():
        per_worker_round = st["bytes_received"] / (n * ROUNDS)
        target = float(shares[sid]) * m
        assert abs(per_worker_round - target) <= partition, (sid, per_worker_round, target)
        for w in range(n):  # every worker sends each server the same bytes
            assert st["bytes_by_worker"].get(str(w), 0) == st["bytes_received"] // n
        assert st["rounds_failed"] == 0


def test_exact_sums_with_4_workers_and_6_servers(make_cluster):
    cluster = make_cluster([2, 1, 1, 2], cpu_servers=2, cluster={"partition_bytes": 32768})
    cases = [(f"six.{d}", d, (123_457,), avg, 17) for d in ("float32", "float64", "float16", "bfloat16")
             for avg in (False, True)] + [("six.int64", "int64", (99_999,), False, 18)]
    for reports in zip(*run_ranks(cluster, rp.sum_cases, cases, timeout=100)):
        assert all(r["exact"] for r in reports), reports[0]["name"]
        assert len({r["digest"] for r in reports}) == 1
    stats = server_stats(cluster)
    assert len(stats) == 6 and all(st["bytes_received"] > 0 for st in stats.values())


def test_small_high_priority_tensor_overtakes_a_large_one(make_cluster):
    """Over TCP, where the credit holds the large tensor's pushes in the worker's priority queue. (Over shared
    memory a push is a few header bytes, all of the large tensor's are with the server at once, and the small
    one is summed in its turn: the race is then decided by timing, not by priorities.)"""
    cluster = make_cluster([1, 1], cpu_servers=1,
                           cluster={"partition_bytes": 65536, "credit_bytes": 131072, "colocated_shm": False})
    for r in run_ranks(cluster, rp.priority_race, 24 * 1024 * 1024, timeout=100):
        assert r["ok"]
        assert r["done"]["small"] < r["done"]["big"], r["done"]


def test_paced_pushes_never_deadlock_on_names_in_opposite_orders(make_cluster):
    """Over TCP (pushes paced by the window), 8 MiB tensors waited for in opposite orders complete, exact."""
    cluster = make_cluster([1, 1], cpu_servers=1, cluster={"colocated_shm": False, "window_pieces": 1})
    results = run_ranks(cluster, rp.crossed_large, 2 * 1024 * 1024, timeout=60)
    assert all(r["ok"] for r in results), results
    assert max(r["seconds"] for r in results) < 20, results


@pytest.mark.parametrize("shm,rate", [(False, None), (True, None), (False, "40gbit")],
                         ids=["tcp", "shm-stream-0", "tcp-fast-links"])
def test_servers_on_several_hosts_use_streams_and_stay_exact(make_cluster, shm, rate):
    """Servers at 127.0.0.1/2/3 look like three hosts: finer partitions, paced pushes, and two connections
    from each worker to the CPU-only server (its share is twice a colocated one's for n=2, k=1). Sums stay
    exact, also for names issued in different orders; the CPU-only server saw one extra stream per worker.
    With a fast link rate in the cluster file the pieces are a few large ones instead (bps_worker.placement)."""
    cluster = make_cluster([2, 1], cpu_servers=1, separate_hosts=True,
                           cluster={"colocated_shm": shm} | ({"link_rate": rate} if rate else {}))
    cases = [(f"hosts.{d}", d, (3, 700_001), d == "float32", 5) for d in ("float32", "float16", "int64")]
    for reports in zip(*run_ranks(cluster, rp.sum_cases, cases, timeout=100)):
        assert all(r["exact"] for r in reports), reports
    assert [r["wrong"] for r in run_ranks(cluster, rp.out_of_order, 12, 300_000, timeout=100)] == [0, 0, 0]
    assert [r["ok"] for r in run_ranks(cluster, rp.crossed_large, 2 * 1024 * 1024, timeout=60)] == [True] * 3
    stats = server_stats(cluster)
    assert {sid: st["streams"] for sid, st in stats.items()} == {0: 0, 1: 0, 2: 2}, stats
    assert all(st["bytes_received"] > 0 for st in stats.values())


def test_5000_tiny_tensors_per_round(cluster_2x2):
    results = run_ranks(cluster_2x2, rp.tiny_tensors, 5000, 2, timeout=110)
    assert [r["wrong"] for r in results] == [0, 0, 0, 0]


def test_batches_respect_a_small_payload_limit(make_cluster):
    """max_payload_bytes = partition_bytes: batched pushes and replies must stay within it."""
    cluster = make_cluster([1, 1], cpu_servers=1,
                           cluster={"partition_bytes": 65536, "max_payload_bytes": 65536})
    results = run_ranks(cluster, rp.out_of_order, 50, 8000, timeout=60)  # 50 x 32 KiB at once: batches
    assert [r["wrong"] for r in results] == [0, 0]
    cases = [("limit.big", "float32", (1 << 20,), False, 3)]
    for reports in zip(*run_ranks(cluster, rp.sum_cases, cases, timeout=60)):
        assert all(r["exact"] for r in reports)


@pytest.mark.timeout(180)
def test_a_tiny_partition_sums_a_million_elements_in_a_bounded_number_of_pieces(make_cluster):
    """partition_bytes = 4 cut a float32 tensor of a million elements into a million pieces: the worker daemons'
    event loops stalled cutting and pushing them, and the ranks failed at the timeout. The pieces now grow to a
    MAX_PIECES-th of the tensor: the sum is exact, and every server sums its Theorem-1 share of the bytes."""
    cluster = make_cluster([1, 1], cpu_servers=1, cluster={"partition_bytes": 4})
    cases = [("tiny.partitions", "float32", (1_000_000,), False, 7)]
    reports = run_ranks(cluster, rp.sum_cases, cases, timeout=60)
    assert [r[0]["exact"] for r in reports] == [True, True]
    stats = server_stats(cluster)
    # shares 1/4, 1/4 (colocated) and 1/2 (CPU-only) of 4,000,000 bytes from each worker
    assert {sid: st["bytes_by_worker"] for sid, st in stats.items()} == {
        0: {"0": 1_000_000, "1": 1_000_000}, 1: {"0": 1_000_000, "1": 1_000_000}, 2: {"0": 2_000_000, "1": 2_000_000}}
    # one round a piece: ranges of 250,000, 250,000 and 500,000 elements in pieces of 245 (it was 1,000,000)
    assert [stats[sid]["rounds_completed"] for sid in (0, 1, 2)] == [1021, 1021, 2041]
