"""CUDA tensors through CUDA IPC (bps_runtime/cuda.py): run where a GPU exists, skipped elsewhere."""

from __future__ import annotations

import pytest

import rank_programs as rp
from harness import run_ranks, start_cluster, write_config


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.timeout(180)
@pytest.mark.cuda
def test_cuda_tensors_are_summed_on_the_gpu(tmp_path):
    cluster = start_cluster(write_config(tmp_path, [2, 2], cluster={"partition_bytes": 256 * 1024}))
    try:
        results = run_ranks(cluster, rp.cuda_push_pulls, 300_001, timeout=150)
    finally:
        cluster.stop()
    for r in results:
        assert r == {"sum": True, "in_place_half": True, "average": True}, r


@pytest.mark.timeout(180)
@pytest.mark.cuda
def test_views_of_one_allocation_and_a_tensor_of_many_partitions(tmp_path):
    """40 views into one CUDA allocation summed in place at once: each lands at its own offset, the elements
    between them untouched; then 16 MiB over 64 partitions of 256 KiB, exact (its median time is printed)."""
    cluster = start_cluster(write_config(tmp_path, [2, 2], cluster={"partition_bytes": 256 * 1024}))
    try:
        results = run_ranks(cluster, rp.cuda_allocations, 40, 1 << 22, 5, timeout=150)
    finally:
        cluster.stop()
    print("16 MiB CUDA push_pull, median of 5, per rank (s):", [round(r["seconds"], 4) for r in results])
    for r in results:
        assert r["views"] and r["big"], r


@pytest.mark.timeout(240)
@pytest.mark.cuda
def test_cuda_mismatch_steady_memory_and_a_dead_process(tmp_path):
    """2 machines x 2 processes on CUDA tensors. A mismatch fails its name on every process (worker 0's with
    the BPSMismatchError naming it) and the next name is exact. 120 pushes of a fresh 4 MiB tensor each leave
    a process's GPU memory where it was after the first 30 (the daemon lets go of what it opened). Rank 3
    dies with a push in flight: the others get a BPSError within the timeout; then a new job on the same
    daemons sums exactly (the worker daemon outlived a dead process's CUDA memory)."""
    cluster = start_cluster(write_config(tmp_path, [2, 2], cluster={"timeout": 3.0}))
    try:
        results = run_ranks(cluster, rp.cuda_failures, 3, 120, may_die=frozenset({3}), timeout=150)
        again = run_ranks(cluster, rp.cuda_push_pulls, 1000, timeout=60)
    finally:
        cluster.stop()
    print("reserved GPU memory after 30 and 120 pushes, per rank (MiB):",
          [[b >> 20 for b in r["reserved"]] for r in results[:3]])
    for rank, r in enumerate(results[:3]):
        assert r["mismatch"] is not None and r["mismatch"][0].startswith("BPS"), (rank, r)
        if rank < 2:
            assert r["mismatch"][0] == "BPSMismatchError" and "cuda.bad" in r["mismatch"][1], (rank, r)
        assert r["after"] == [6.0] * 5 and r["steady"], (rank, r)
        first, last = r["reserved"]
        assert last - first < 64 << 20, f"rank {rank}'s GPU memory grew from {first} to {last} bytes"
        assert r["error"] is not None and r["seconds"] < 3.0 + 10, (rank, r)
    for r in again:
        assert r == {"sum": True, "in_place_half": True, "average": True}, r


@pytest.mark.timeout(60)
def test_cuda_descriptions_are_checked_and_fail_cleanly_without_a_gpu(tmp_path):
    if _has_cuda():
        pytest.skip("this machine has a GPU: the well-formed description would be opened for real")
    cluster = start_cluster(write_config(tmp_path, [1], cpu_servers=0))
    try:
        (result,) = run_ranks(cluster, rp.cuda_description_errors, timeout=45)
    finally:
        cluster.stop()
    assert "CUDA tensor description" in result["malformed"], result
    assert "CUDA" in result["no_gpu"] and "no error" not in result["no_gpu"], result
