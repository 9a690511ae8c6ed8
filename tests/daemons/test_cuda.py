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
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA device (and a CUDA build of torch)")
def test_cuda_tensors_are_summed_on_the_gpu(tmp_path):
    cluster = start_cluster(write_config(tmp_path, [2, 2], cluster={"partition_bytes": 256 * 1024}))
    try:
        results = run_ranks(cluster, rp.cuda_push_pulls, 300_001, timeout=150)
    finally:
        cluster.stop()
    for r in results:
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
