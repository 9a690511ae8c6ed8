"""DistributedOptimizer(asynchronous=True) with real daemons (issue 17)."""

from __future__ import annotations

import pytest

import async_programs as ap
from harness import run_ranks


def test_an_asynchronous_optimizer_initialises_again_after_its_process_init_again(make_cluster, tmp_path):
    """Rank 0 leaves and comes back (shutdown(), init()) between steps: its optimizer's steps go on, and every
    step of every rank is in the value, exactly (it failed every step after, before)."""
    cluster = make_cluster([1, 1], cpu_servers=0)
    for r in run_ranks(cluster, ap.torch_async_after_reinit, 5, str(tmp_path), timeout=90):
        assert r["weight"] == r["want"], r


@pytest.mark.parametrize("staleness,device",
                         [(None, "cpu"), (1, "cpu"), pytest.param(None, "cuda", marks=pytest.mark.cuda)])
def test_async_sgd_puts_every_process_step_in_the_servers_value(cluster_2x2, staleness, device):
    """4 processes, 30 plain SGD steps each on constant per-rank gradients, parameters in two buckets: the
    broadcast makes the value rank 0's weights, and the final parameters are those minus every step of every
    process, exactly. Compression, or a staleness without asynchronous=True, are refused. Again with the
    model on the GPU where there is one."""
    results = run_ranks(cluster_2x2, ap.torch_async_sgd, 30, staleness, device, timeout=90)
    for r in results:
        assert r["devices"] == [device if device == "cpu" else "cuda:0"], r
        assert r["same_after_broadcast"] and r["exact"], r
        assert "compression is for gradients" in r["errors"][0] and "asynchronous=True" in r["errors"][1], r
        assert r["plain"][0] in (3.0, 4.0, 5.0, 6.0) and len(set(r["plain"])) == 1  # 2 + its delta + others' so far
