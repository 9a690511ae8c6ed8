"""A tensor that processes disagree about fails everywhere, fast, and nothing else is harmed."""

from __future__ import annotations

import pytest

import rank_programs as rp
from harness import run_ranks


@pytest.mark.parametrize(
    "bad_rank,kind",
    [(3, "shape"), (1, "shape"), (2, "dtype")],
    ids=["shape-other-worker-local1", "shape-same-worker", "dtype-other-worker-local0"],
)
def test_mismatch_fails_every_process_and_names_both(cluster_2x2, bad_rank, kind):
    results = run_ranks(cluster_2x2, rp.mismatch, bad_rank, kind, timeout=60)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} got no error"
        assert "'bad'" in r["error"], r["error"]
        if kind == "shape":
            assert "[4,3]" in r["error"] and "[4,5]" in r["error"], r["error"]
        else:
            assert "float32" in r["error"] and "float64" in r["error"], r["error"]
        assert r["elapsed"] < 10.0
        assert r["good"] == [6, 6, 6]  # other names keep working: 0+1+2+3
        assert r["again"] == [[4.0] * 3] * 4  # and the name itself is usable in the next round


def test_mismatch_across_workers_only(cluster_2x2):
    """Both processes of worker 1 agree with each other but not with worker 0: the server tells everyone."""
    results = run_ranks(cluster_2x2, rp.mismatch_by_worker, timeout=60)
    for rank, r in enumerate(results):
        assert r["error"] is not None and "mismatch" in r["error"] and "'w'" in r["error"], r
        assert "[8]" in r["error"] and "[9]" in r["error"], r["error"]
        # a BPSMismatchError whose facts came from the server, each side's own descriptor as ours
        ours, theirs = ("float32[8]", "float32[9]") if rank < 2 else ("float32[9]", "float32[8]")
        assert r["facts"] == {"type": "BPSMismatchError", "name": "w", "ours": ours, "theirs": theirs}, r
        assert r["elapsed"] < 10.0
        assert r["after"] == 4.0


def test_a_late_rank_gets_the_error_of_its_own_round(make_cluster):
    """local_size 3: a failed round waits for its late member instead of letting it start the next one."""
    cluster = make_cluster([3, 1], cpu_servers=1)
    results = run_ranks(cluster, rp.late_rank_after_mismatch, timeout=60)
    for rank, r in enumerate(results):
        assert str(r["step0"]).startswith("error:") and "mismatch" in r["step0"], (rank, r)
        assert r["step1"] == r["expect1"], (rank, r)


def test_a_mismatch_within_one_machine_is_a_mismatch_error_with_its_facts(cluster_2x2):
    """Ranks 0 and 1 (worker 0) disagree: the worker's local rounds catch it, and both processes get a
    BPSMismatchError whose name, ours (its own tensor) and theirs (the other's) came as the Failure's facts."""
    import session_programs as sp

    results = run_ranks(cluster_2x2, sp.local_mismatch, timeout=60)
    for rank in (0, 1):
        facts = results[rank]["facts"]
        ours, theirs = ("float32[4]", "float32[5]") if rank == 0 else ("float32[5]", "float32[4]")
        assert {k: facts.get(k) for k in ("type", "name", "ours", "theirs")} == \
            {"type": "BPSMismatchError", "name": "w", "ours": ours, "theirs": theirs}, (rank, facts)
        # the detail names both ranks, the one whose op came first first
        assert ("rank 0 has float32[4] but rank 1 has float32[5]" in facts["text"]
                or "rank 1 has float32[5] but rank 0 has float32[4]" in facts["text"]), facts
    for rank, r in enumerate(results):
        assert r["facts"], f"rank {rank} got no error"  # worker 1 hears it through the anchor server
        assert r["elapsed"] < 10.0
        assert r["after"] == 4.0


@pytest.mark.parametrize("n", [4, 40000], ids=["fused", "unfused"])
@pytest.mark.parametrize("odd", [[1], [2, 3]], ids=["within-machine-0", "between-machines"])
def test_every_process_on_every_machine_gets_the_mismatch_with_its_own_side_as_ours(cluster_2x2, odd, n):
    """Rank 1 alone (machine 0's processes disagree), or machine 1's both (each machine agrees within): on both
    paths (small tensors fused, large ones not), every process of both machines gets a BPSMismatchError naming
    the tensor, with its own tensor as ``ours`` and the other side's as ``theirs``; the text says who disagreed.
    Machine 1 hears a disagreement found on machine 0 through a server, whose message carries its facts."""
    name = f"mf.{len(odd)}.{n}"
    results = run_ranks(cluster_2x2, rp.mismatch_facts, name, odd, n, timeout=60)
    mine, other = f"float32[{n}] (average)", f"float32[{n + 1}] (average)"
    for rank, r in enumerate(results):
        ours, theirs = (other, mine) if rank in odd else (mine, other)
        facts = r["facts"]
        assert {k: facts.get(k) for k in ("type", "name", "ours", "theirs")} == \
            {"type": "BPSMismatchError", "name": name, "ours": ours, "theirs": theirs}, (rank, facts)
        who = "rank 1" if odd == [1] else "worker 1"
        assert f"{who} has {other}" in facts["text"] or f"{who} pushed {other}" in facts["text"], (rank, facts)
        assert r["after"] == 4.0
