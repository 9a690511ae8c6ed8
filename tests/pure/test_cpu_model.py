"""benchmarks/cpu_model.py's arithmetic: the pieces it counts and the fit it makes (no daemons, no emulator)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cpu_model  # noqa: E402

from bps_worker.placement import Placement  # noqa: E402


def _point(size: int, pieces: float, cpu: dict[str, float]) -> dict[str, object]:
    return {"size": size, "partition_bytes": 0, "pieces": {"worker": pieces, "server": pieces}, "cpu": cpu}


def test_fit_recovers_a_fixed_a_per_piece_and_a_per_byte_cost() -> None:
    fixed, per_piece, per_byte = 2e-3, 150e-6, 0.4e-9
    points = [_point(size, pieces, {"worker": fixed + per_piece * pieces + per_byte * size,
                                    "gloo": 1e-3 + 0.3e-9 * size})
              for size, pieces in ((8 << 20, 20), (8 << 20, 130), (32 << 20, 70), (32 << 20, 520))]
    got = cpu_model.fit(points, "worker")
    assert got["fixed"] == pytest.approx(fixed, rel=1e-6)
    assert got["per_piece"] == pytest.approx(per_piece, rel=1e-6)
    assert got["per_byte"] == pytest.approx(per_byte, rel=1e-6)
    assert got["residual"] < 1e-9
    gloo = cpu_model.fit(points, "gloo")  # no pieces in a gloo rank's model
    assert (gloo["fixed"], gloo["per_piece"]) == (pytest.approx(1e-3, rel=1e-6), 0.0)
    assert gloo["per_byte"] == pytest.approx(0.3e-9, rel=1e-6)


def test_fit_reports_how_far_the_worst_point_is_from_the_model() -> None:
    points = [_point(size, pieces, {"worker": 1e-3 + 1e-4 * pieces}) for size, pieces in ((1, 1), (2, 3), (3, 2))]
    points.append(_point(4, 5, {"worker": 2 * (1e-3 + 1e-4 * 5)}))  # twice what the others' line says
    assert cpu_model.fit(points, "worker")["residual"] > 0.2


def test_piece_counts_are_the_placements_and_follow_partition_bytes() -> None:
    n, size = 4, 8 << 20
    small = cpu_model.piece_counts(n, 0, size, 64 << 10, "1gbit")
    large = cpu_model.piece_counts(n, 0, size, 256 << 10, "1gbit")
    placement = cpu_model.placement_of(n, 0, 64 << 10, "1gbit")
    assert isinstance(placement, Placement) and placement.partition_bytes == 64 << 10
    pieces = placement.split("paper.8M", size // 4, 4)
    assert small["worker"] == len(pieces)
    assert max(p.count for p in pieces) * 4 <= 64 << 10
    # A colocated server sums n pushes of each of its pieces: at k = 0 the servers' shares are equal, so that is
    # as many as the worker's; with CPU-only servers a colocated server's share (so its count) is smaller.
    assert small["server"] == pytest.approx(small["worker"])
    with_cpu = cpu_model.piece_counts(n, 2, size, 64 << 10, "1gbit")
    assert with_cpu["server"] < with_cpu["worker"] / 2
    assert large["worker"] < small["worker"] / 2  # the cap binds: larger partitions, fewer pieces


def test_prediction_falls_with_the_piece_size() -> None:
    fits = {"worker": {"fixed": 1e-3, "per_piece": 2e-4, "per_byte": 5e-10},
            "server": {"fixed": 1e-3, "per_piece": 2e-4, "per_byte": 5e-10},
            "rank": {"fixed": 1e-3, "per_piece": 0.0, "per_byte": 1e-10},
            "gloo": {"fixed": 1e-3, "per_piece": 0.0, "per_byte": 1e-9}}
    rows = cpu_model.predict(fits, 16 << 20, 4, 0)
    ratios = [float(row[-1]) for row in rows]
    assert ratios == sorted(ratios, reverse=True) and len(ratios) == len(cpu_model.PREDICT_PIECES)
    # 4 MiB pieces: 4 of them; the GPU machine 3 ms fixed + 1.6 ms pieces + 18.5 ms bytes against 17.8 ms.
    assert rows[-1][1] == "4" and float(rows[-1][2]) == pytest.approx(3 + 4 * 0.4 + (16 << 20) * 1.1e-6, abs=0.05)
    # With CPU-only servers a colocated server sums n pushes of each piece of its smaller share (n = 4, k = 2:
    # 2/20 of the tensor): 4 x 0.4 pieces, at least one each, against the worker's 4.
    k2 = cpu_model.predict(fits, 16 << 20, 4, 2)
    assert float(k2[-1][2]) == pytest.approx(3 + 4 * 0.2 + 4 * 0.2 + (16 << 20) * 1.1e-6, abs=0.05)
