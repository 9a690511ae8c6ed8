"""bps-launch --stragglers: the servers' push lag histograms merged per worker, and the straggler marked."""

from __future__ import annotations

import pytest

from bps_worker.stragglers import merge, report

BOUNDS = [0.001, 0.01, 0.1, 1.0]


def _server(**workers: tuple[list[int], float]) -> dict:
    return {"push_lag_buckets": BOUNDS,
            "push_lag": {w.lstrip("w"): {"count": sum(c), "seconds": s, "counts": c} for w, (c, s) in workers.items()}}


def test_histograms_merge_per_worker_over_servers():
    lags = merge({0: _server(w0=([4, 0, 0, 0, 0], 0.0), w1=([0, 0, 3, 1, 0], 0.5)),
                  2: _server(w0=([2, 0, 0, 0, 0], 0.0), w1=([0, 0, 2, 0, 0], 0.2))})
    assert sorted(lags) == [0, 1]
    assert lags[1].counts == [0, 0, 5, 1, 0] and lags[1].count == 6 and lags[1].mean == pytest.approx(0.7 / 6)
    assert lags[1].quantile_bound(0.5) == 0.1 and lags[1].quantile_bound(0.9) == 1.0
    assert lags[0].quantile_bound(0.9) == 0.001 and lags[0].mean == 0.0


def test_the_late_worker_is_marked_and_only_it():
    lines = report({0: _server(w0=([9, 1, 0, 0, 0], 0.002), w1=([0, 0, 0, 10, 0], 3.0), w2=([10, 0, 0, 0, 0], 0.001))})
    assert lines[0].startswith("push lag per worker")
    rows = {int(line.split()[0]): line for line in lines[2:]}
    assert "straggler" in rows[1] and "straggler" not in rows[0] + rows[2]
    assert rows[1].split()[1:6] == ["10", "300", "ms", "1", "s"]  # 10 pushes, mean 0.3 s, p90 <= 1 s


def test_no_mark_when_every_worker_is_about_as_late_or_all_are_quick():
    even = report({0: _server(w0=([0, 0, 10, 0, 0], 0.5), w1=([0, 0, 10, 0, 0], 0.4))})
    quick = report({0: _server(w0=([10, 0, 0, 0, 0], 0.0005), w1=([10, 0, 0, 0, 0], 0.0))})
    assert not any("straggler" in line for line in even + quick)
    assert report({0: {"push_lag": {}, "push_lag_buckets": BOUNDS}}) == ["push lag: no pushes reached the servers"]


def test_servers_with_other_buckets_are_named():
    other = {"push_lag_buckets": [0.5], "push_lag": {"0": {"count": 1, "seconds": 0.1, "counts": [1, 0]}}}
    with pytest.raises(ValueError, match="server 3's push lag buckets differ from the other servers'"):
        merge({0: _server(w0=([1, 0, 0, 0, 0], 0.0)), 3: other})
