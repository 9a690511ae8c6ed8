"""Zero-copy paths: the colocated server over shared memory, shared arrays, deterministic sums."""

from __future__ import annotations

import time

import pytest

import rank_programs as rp
from harness import run_ranks, server_stats, shm_segments, start_cluster, write_config

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
# Several 256 KiB partitions per big tensor (placed on every server), slab-sized ones, 0-d and empty.
SHAPES = [(), (0,), (5,), (70001,), (3, 100003)]


def _cases() -> list[tuple[str, str, tuple[int, ...], bool, int]]:
    return [(f"{d}.{i}", d, shape, d.startswith("float") and i % 2 == 1, 7 * i + len(d))
            for d in DTYPES for i, shape in enumerate(SHAPES)]


def _run(tmp_path, shm: bool) -> tuple[list, dict]:
    path = write_config(tmp_path / ("shm" if shm else "tcp"), [2, 2],
                        cluster={"partition_bytes": 256 * 1024, "colocated_shm": shm})
    cluster = start_cluster(path)
    try:
        results = run_ranks(cluster, rp.sum_cases, _cases(), timeout=120)
        stats = server_stats(cluster)
        deadline = time.monotonic() + 10
        while shm_segments(cluster) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shm_segments(cluster) == set(), "staging or client segments outlived the job"
        pids = {str(c.proc.pid) for c in cluster.children if c.daemon}
    finally:
        cluster.stop()
    assert not {n for n in shm_segments() if n.split("_")[2] in pids}, "segments outlived the daemons"
    return results, stats


@pytest.mark.timeout(300)
def test_colocated_shared_memory_gives_the_tcp_results(tmp_path):
    by_shm, stats_shm = _run(tmp_path, shm=True)
    by_tcp, stats_tcp = _run(tmp_path, shm=False)
    for reports in (by_shm, by_tcp):
        for case_reports in zip(*reports):
            for r in case_reports:
                assert r["exact"], f"{r['name']}: differs from the numpy reference"
                assert r["input_unchanged"]
            assert len({r["digest"] for r in case_reports}) == 1
    assert [[r["digest"] for r in rank] for rank in by_shm] == [[r["digest"] for r in rank] for rank in by_tcp]
    # One box: every server shares the host with every worker (the colocated ones by the config, the
    # CPU-only one by its address), so every byte came through shared memory; none in the TCP run.
    for sid, s in stats_shm.items():
        assert s["bytes_received"] > 0 and s["bytes_shm"] == s["bytes_received"], (sid, s)
    assert all(s["bytes_shm"] == 0 for s in stats_tcp.values())
    # Placement does not depend on the transport.
    assert {k: s["bytes_received"] for k, s in stats_shm.items()} == \
        {k: s["bytes_received"] for k, s in stats_tcp.items()}


def test_local_addresses_are_told_from_remote_ones():
    from bps_worker.daemon import is_local_address

    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert not is_local_address("192.0.2.77")  # TEST-NET-1: never an address of this machine
    assert not is_local_address("no-such-host.invalid")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype,shape", [("float32", (300, 301)), ("bfloat16", (300, 301)), ("int64", (300, 301)),
                                         ("float32", (4, 5)), ("bfloat16", (7,))])
def test_shared_arrays_sum_in_place_without_moving(tmp_path, dtype, shape):
    """In place with ``out=``; without it the shared array is an input like any other, left unchanged: the small
    ones (fused: at most 1 KiB here) used to get their sums written into it, as push_pull_group's did at any size."""
    path = write_config(tmp_path, [2, 1], cluster={"partition_bytes": 64 * 1024})
    cluster = start_cluster(path)
    try:
        results = run_ranks(cluster, rp.shared_rounds, 5, shape, dtype)
    finally:
        cluster.stop()
    for r in results:
        assert r == {"exact": True, "same_memory": True, "returned_itself": True, "copy_exact": True,
                     "input_unchanged": [True, True, True]}


@pytest.mark.timeout(120)
def test_results_are_read_from_the_workers_segment_and_released_when_it_moves(tmp_path):
    """A plain array's sum is read where the server wrote it (the worker's results segment), not handed back
    into the process's slot first. Sizes: in a slab, then segments of their own that grow (the worker moves the
    results, unlinking the old segment: the process must unmap it, or the memory stays allocated). Partitions of
    1 MiB: the slab's tensor (32 KiB) is above the fusion limit (16 KiB), whose sums are handed back instead."""
    path = write_config(tmp_path, [2, 1], cluster={"partition_bytes": 1 << 20})
    cluster = start_cluster(path)
    sizes = [8000, 2_000_000, 3_000_000, 3_000_000, 5_000_000]
    try:
        results = run_ranks(cluster, rp.results_in_place, sizes)
    finally:
        cluster.stop()
    for r in results:
        assert all(r["exact"]), r["exact"]
        segs = r["segments"]
        assert all(segs), "no result was read from a worker's results segment"
        assert len({segs[0], segs[1], segs[2], segs[4]}) == 4 and segs[3] == segs[2], segs
        for i, attached in enumerate(r["attached"]):
            assert segs[i] in attached
            assert not set(segs[:i]) - {segs[i]} & set(attached), (i, attached)  # old results unmapped


@pytest.mark.timeout(120)
def test_shared_torch_tensors_sum_in_place(tmp_path):
    pytest.importorskip("torch")
    path = write_config(tmp_path, [1, 2])
    cluster = start_cluster(path)
    try:
        results = run_ranks(cluster, rp.shared_torch, 4, 200_003)
    finally:
        cluster.stop()
    assert all(r["ok"] for r in results)


def _ordered(tmp_path, deterministic: bool, colocated: bool, delays: list[float]) -> list[dict]:
    path = write_config(tmp_path / f"d{int(deterministic)}c{int(colocated)}{delays[0]}", [1, 1, 1],
                        colocated=colocated, cpu_servers=0 if colocated else 1,
                        cluster={"deterministic": deterministic, "partition_bytes": 1 << 20})
    cluster = start_cluster(path)
    try:
        return run_ranks(cluster, rp.ordered_sum, per_rank_args=lambda r: (300_000, delays[r], 5))
    finally:
        cluster.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("colocated", [False, True], ids=["cpu-server", "colocated-shm"])
def test_deterministic_sums_ignore_arrival_order(tmp_path, colocated):
    first = _ordered(tmp_path, True, colocated, [0.0, 0.4, 0.8])
    second = _ordered(tmp_path, True, colocated, [0.8, 0.4, 0.0])
    assert len({r["digest"] for r in first + second}) == 1, "deterministic sums differ between arrival orders"
    assert all(r["rank_order"] for r in first), "the sum is not the worker-id-order sum"


@pytest.mark.timeout(300)
def test_without_deterministic_the_order_shows(tmp_path):
    """The control for the test above: its inputs and delays really do change the bytes."""
    first = _ordered(tmp_path, False, False, [0.0, 0.4, 0.8])
    second = _ordered(tmp_path, False, False, [0.8, 0.4, 0.0])
    assert first[0]["digest"] != second[0]["digest"]
