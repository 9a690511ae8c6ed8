"""Real daemons, real rank processes: sums equal a numpy reference bit for bit."""

from __future__ import annotations

import pytest

import rank_programs as rp
from harness import run_ranks

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
# 0-d, empty, one element, not a multiple of the 64 KiB partition, several partitions, 2-D.
SHAPES = [(), (0,), (0, 3), (1,), (16411,), (3, 40001), (7, 5)]


def _cases(average: bool) -> list[tuple[str, str, tuple[int, ...], bool, int]]:
    cases = []
    for d in DTYPES:
        if average and d.startswith("int"):
            continue
        for i, shape in enumerate(SHAPES):
            cases.append((f"{d}.{i}.{average}", d, shape, average, hash((d, i)) % 1000))
    return cases


def _check_identical(results: list[list[dict]]) -> None:
    for case_reports in zip(*results):
        names = {r["name"] for r in case_reports}
        assert len(names) == 1
        for r in case_reports:
            assert r["exact"], f"{r['name']}: result differs from the numpy reference"
            assert r["input_unchanged"], f"{r['name']}: the input array was modified"
            assert r["is_out"], f"{r['name']}: out= was not returned"
        assert len({r["digest"] for r in case_reports}) == 1, f"{case_reports[0]['name']}: ranks got different bytes"


@pytest.mark.parametrize("average", [False, True], ids=["sum", "average"])
def test_every_dtype_and_shape_matches_numpy(cluster_2x2, average):
    results = run_ranks(cluster_2x2, rp.sum_cases, _cases(average))
    _check_identical(results)
    assert len(results) == 4 and len(results[0]) == len(_cases(average))


def test_out_argument_receives_the_result(cluster_2x2):
    cases = [("out.f32", "float32", (1000, 3), True, 5), ("out.i32", "int32", (77,), False, 6)]
    _check_identical(run_ranks(cluster_2x2, rp.sum_cases, cases, True))


def test_64_mib_tensors(cluster_2x2):
    cases = [("big.f32", "float32", (16 * 1024 * 1024,), True, 1), ("big.bf16", "bfloat16", (32 * 1024 * 1024 + 3,), False, 2)]
    _check_identical(run_ranks(cluster_2x2, rp.sum_cases, cases, timeout=110))


def test_random_floats_are_close_and_identical_everywhere(cluster_2x2):
    results = run_ranks(cluster_2x2, rp.float_noise, "noise", 100_003)
    assert all(r["close"] for r in results)
    assert len({r["digest"] for r in results}) == 1


def test_ranks_and_sizes(cluster_2x2):
    info = run_ranks(cluster_2x2, rp.ranks_info)
    assert info == [{"rank": r, "size": 4, "local_rank": r % 2, "local_size": 2} for r in range(4)]


def test_200_rounds_never_mix(cluster_2x2):
    results = run_ranks(cluster_2x2, rp.many_rounds, 200, 3, timeout=110)
    assert [r["wrong"] for r in results] == [0, 0, 0, 0]


def test_50_names_in_different_orders(cluster_2x2):
    results = run_ranks(cluster_2x2, rp.out_of_order, 50, 20000, timeout=60)
    assert [r["wrong"] for r in results] == [0, 0, 0, 0]
    assert len({tuple(r["order"]) for r in results}) > 1, "ranks should have used different orders"


@pytest.mark.parametrize("root", [0, 3])
def test_broadcast(cluster_2x2, root):
    results = run_ranks(cluster_2x2, rp.broadcast_check, root)
    for key in ("f32", "i64", "bf16", "scalar"):
        assert len({r[key] for r in results}) == 1, key
        assert results[root][key + ".root_exact"], key


def test_uneven_cluster_with_several_servers(make_cluster):
    """3 workers with 1, 2 and 3 processes (size 6, averages not powers of two), 2 CPU-only servers."""
    cluster = make_cluster([1, 2, 3], cpu_servers=2, cluster={"partition_bytes": 32768})
    cases = [(f"u.{d}", d, (50_001,), d.startswith("float") or d == "bfloat16", 9) for d in DTYPES]
    _check_identical(run_ranks(cluster, rp.sum_cases, cases))
