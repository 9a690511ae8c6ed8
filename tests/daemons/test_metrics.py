"""Prometheus metrics: the text format, and live values from both daemons."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

import rank_programs as rp
from bps_runtime.metrics import Family, Histogram, render
from harness import run_ranks, start_cluster, write_config


def test_render_counters_gauges_and_histograms():
    h = Histogram(buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 3.0):
        h.observe(v)
    text = render([Family("x_total", "counter", "X", (({"a": 'q"\\'}, 2.0),)),
                   Family("lat", "histogram", "L", (({}, h),))])
    assert "# TYPE x_total counter" in text
    assert 'x_total{a="q\\"\\\\"} 2.0' in text
    assert 'lat_bucket{le="0.1"} 1' in text and 'lat_bucket{le="1.0"} 3' in text
    assert 'lat_bucket{le="+Inf"} 4' in text and "lat_count 4" in text and "lat_sum 4.05" in text


def _scrape(address: tuple[str, int], path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}{path}", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return response.read().decode()


def _value(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_daemons_serve_live_metrics(tmp_path):
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, metrics=True,
                                         cluster={"partition_bytes": 65536}))
    try:
        cases = [("m.f32", "float32", (100_000,), True, 1), ("m.i64", "int64", (7,), False, 2)]
        run_ranks(cluster, rp.sum_cases, cases)
        worker = _scrape(cluster.config.worker_specs[0].metrics)
        assert _value(worker, 'bps_worker_ops_total{worker="0"}') == 2
        assert _value(worker, "bps_worker_bytes_pushed_total") == 400_000 + 56
        assert _value(worker, "bps_worker_op_seconds_count") == 2
        assert _value(worker, "bps_worker_ops_failed_total") == 0
        total = 0.0
        for spec in cluster.config.servers:
            text = _scrape(spec.metrics)
            total += _value(text, "bps_server_bytes_received_total")
            assert "# TYPE bps_server_round_seconds histogram" in text
        assert total == 2 * (400_000 + 56)  # both workers' pushes, over all servers
        with pytest.raises(urllib.error.HTTPError) as info:
            _scrape(cluster.config.worker_specs[0].metrics, "/other")
        assert info.value.code == 404
    finally:
        cluster.stop()
