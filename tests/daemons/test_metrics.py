"""Prometheus metrics through prometheus_client: our families' conversion, and live values from both daemons."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

import async_programs as ap
import fusion_programs as fp
import rank_programs as rp
from bps_runtime.metrics import Family, Histogram, to_prometheus
from harness import run_ranks, start_cluster, write_config

# Every metric the daemons served before prometheus_client, with its type (names without a counter's _total).
SERVER_METRICS = {"bps_server_bytes_received": "counter", "bps_server_bytes_shared_memory": "counter",
                  "bps_server_bytes_sent": "counter", "bps_server_pushes": "counter",
                  "bps_server_rounds_completed": "counter", "bps_server_rounds_failed": "counter",
                  "bps_server_workers_connected": "gauge", "bps_server_keys": "gauge",
                  "bps_server_round_seconds": "histogram", "bps_server_push_lag_seconds": "histogram",
                  "bps_server_fused_plans": "counter", "bps_server_fused_tensors": "counter",
                  "bps_server_fused_waiting": "gauge", "bps_server_async_keys": "gauge",
                  "bps_server_async_pushes": "counter", "bps_server_async_replays": "counter"}
WORKER_METRICS = {"bps_worker_ops": "counter", "bps_worker_ops_failed": "counter", "bps_worker_bytes_pushed": "counter",
                  "bps_worker_bytes_pulled": "counter", "bps_worker_processes_connected": "gauge",
                  "bps_worker_send_backlog_bytes": "gauge", "bps_worker_op_seconds": "histogram",
                  "bps_worker_fused_tensors": "counter"}
PROCESS_METRICS = ("process_resident_memory_bytes", "process_cpu_seconds", "process_open_fds", "process_max_fds")


def _types(text: str) -> dict[str, str]:
    return {fam.name: fam.type for fam in text_string_to_metric_families(text)}


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` with exactly ``labels``; KeyError if there is none."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise KeyError(f"{name}{labels} not in the scrape")


def test_families_become_prometheus_metrics_with_their_values():
    h = Histogram(buckets=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)

    class Fixed(Collector):
        def collect(self):
            yield to_prometheus(Family("x_total", "counter", "X", (({"a": 'q"\\'}, 2.0), ({"a": "b"}, 5.0))))
            yield to_prometheus(Family("g", "gauge", "G", (({}, 7.0),)))
            yield to_prometheus(Family("lat", "histogram", "L", (({"w": "1"}, h),)))

    registry = CollectorRegistry()
    registry.register(Fixed())
    text = generate_latest(registry).decode()
    assert _types(text) == {"x": "counter", "g": "gauge", "lat": "histogram"}
    assert _sample(text, "x_total", a='q"\\') == 2.0 and _sample(text, "x_total", a="b") == 5.0
    assert _sample(text, "g") == 7.0
    assert _sample(text, "lat_bucket", w="1", le="0.1") == 2  # 0.1 itself is in the le="0.1" bucket
    assert _sample(text, "lat_bucket", w="1", le="1.0") == 3
    assert _sample(text, "lat_bucket", w="1", le="+Inf") == 4
    assert _sample(text, "lat_count", w="1") == 4 and _sample(text, "lat_sum", w="1") == pytest.approx(3.65)
    with pytest.raises(ValueError, match="metric y: kind must be counter, gauge or histogram, got 'summary'"):
        to_prometheus(Family("y", "summary", "Y", (({}, 1.0),)))


def _scrape(address: tuple[str, int], path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}{path}", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return response.read().decode()


def _bytes(text: str, name: str, server: int) -> float:
    """A server's ``bps_server_bytes_*_total`` (received: over its workers' series)."""
    if name.endswith("received_total"):
        return sum(_sample(text, name, server=str(server), worker=w) for w in ("0", "1"))
    return _sample(text, name, server=str(server))


def _lag(text: str, server: str, worker: str) -> tuple[float, float, float]:
    """(pushes, pushes later than 0.25 s after their round's first, seconds in all) of ``worker`` at ``server``."""
    labels = {"server": server, "worker": worker}
    count = _sample(text, "bps_server_push_lag_seconds_count", **labels)
    on_time = _sample(text, "bps_server_push_lag_seconds_bucket", le="0.25", **labels)
    return count, count - on_time, _sample(text, "bps_server_push_lag_seconds_sum", **labels)


def test_daemons_serve_live_metrics(tmp_path):
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, metrics=True,
                                         cluster={"partition_bytes": 65536}))
    try:
        cases = [("m.f32", "float32", (100_000,), True, 1), ("m.i64", "int64", (7,), False, 2)]
        run_ranks(cluster, rp.sum_cases, cases)
        worker = _scrape(cluster.config.worker_specs[0].metrics)
        assert {k: v for k, v in _types(worker).items() if k.startswith("bps_")} == WORKER_METRICS
        assert _sample(worker, "bps_worker_ops_total", worker="0") == 2  # m.i64 in a fused operation of its own
        assert _sample(worker, "bps_worker_fused_tensors_total", worker="0") == 1
        assert _sample(worker, "bps_worker_bytes_pushed_total", worker="0") == 400_000 + 56
        assert _sample(worker, "bps_worker_bytes_pulled_total", worker="0") == 400_000 + 56
        assert _sample(worker, "bps_worker_op_seconds_count", worker="0") == 2
        assert _sample(worker, "bps_worker_ops_failed_total", worker="0") == 0
        assert _sample(worker, "bps_worker_processes_connected", worker="0") == 0  # the ranks have exited
        assert _sample(worker, "process_resident_memory_bytes") > 20e6  # numpy and numba alone are more
        assert _sample(worker, "process_open_fds") > 3 and _sample(worker, "process_cpu_seconds_total") > 0

        # Worker 1 pushes "lag" half a second after worker 0, three rounds running (after one round of "sync",
        # the same size, where the ranks line up). Compared with the lags of the first job, per server.
        before = {spec.id: _scrape(spec.metrics) for spec in cluster.config.servers}
        # m.i64 (56 bytes) was fused: planned once, by its anchor; nothing waits, nothing is asynchronous yet
        fused = {name: [_sample(before[spec.id], name, server=str(spec.id)) for spec in cluster.config.servers]
                 for name in ("bps_server_fused_plans_total", "bps_server_fused_tensors_total",
                              "bps_server_fused_waiting", "bps_server_async_keys", "bps_server_async_pushes_total")}
        assert sorted(fused["bps_server_fused_plans_total"]) == [0, 0, 1], fused
        assert fused["bps_server_fused_tensors_total"] == fused["bps_server_fused_plans_total"], fused
        assert fused["bps_server_fused_waiting"] == fused["bps_server_async_keys"] == [0, 0, 0], fused
        assert fused["bps_server_async_pushes_total"] == [0, 0, 0], fused
        rounds, delay = 3, 0.5
        assert all(r["ok"] for r in run_ranks(cluster, rp.late_rounds, 100_000, rounds, 1, delay))
        total = 0.0
        late_servers = 0
        for spec in cluster.config.servers:
            text = _scrape(spec.metrics)
            assert {k: v for k, v in _types(text).items() if k.startswith("bps_")} == SERVER_METRICS
            assert all(name in _types(text) for name in PROCESS_METRICS)
            sid = str(spec.id)
            total += _sample(text, "bps_server_bytes_received_total", server=sid, worker="0")
            total += _sample(text, "bps_server_bytes_received_total", server=sid, worker="1")
            assert _sample(text, "bps_server_workers_connected", server=sid) == 2
            assert _sample(text, "bps_server_rounds_failed_total", server=sid) == 0
            completed = _sample(text, "bps_server_rounds_completed_total", server=sid)
            assert _sample(text, "bps_server_round_seconds_count", server=sid) == completed > 0
            assert _sample(text, "bps_server_pushes_total", server=sid) == 2 * completed
            (n0, late0, _), (n1, late1, seconds1) = _lag(text, sid, "0"), _lag(text, sid, "1")
            assert n0 == n1 == completed  # every accepted push is observed once, under its worker
            (m0, early_late0, _), (m1, early_late1, early_seconds1) = _lag(before[spec.id], sid, "0"), \
                _lag(before[spec.id], sid, "1")
            parts = (n1 - m1) / (1 + rounds)  # the partitions of "sync" (and of "lag") on this server
            assert parts == int(parts)
            lag_rounds = rounds * parts
            # worker 1 was late in every "lag" round (and maybe in "sync"); worker 0 at most in "sync"
            assert late1 - early_late1 >= lag_rounds, text
            assert seconds1 - early_seconds1 >= 0.5 * delay * lag_rounds, text  # worker 0 may be slow to push too
            assert late0 - early_late0 <= parts, text
            late_servers += lag_rounds > 0
        assert late_servers >= 2  # "lag" has partitions on several servers
        assert total == 2 * (400_000 + 56) + 2 * (1 + rounds) * 400_000  # both workers' pushes, all servers

        # An asynchronous name of several partitions (a key each, on several servers), read while its job runs:
        # each worker pushed its init and 4 deltas into every key, none of them again. The keys outlive nothing:
        # the job's end (every worker reset) drops them, the counts stay.
        steps = 4
        urls = [f"http://{spec.metrics[0]}:{spec.metrics[1]}/metrics" for spec in cluster.config.servers]
        pre = [_scrape(spec.metrics) for spec in cluster.config.servers]
        live = run_ranks(cluster, ap.scraped_while_live, "m.async", steps, urls)[0]
        # Its bytes are the servers' too (they counted the synchronous rounds' alone: a review's case): each
        # worker's init and deltas of 60,000 bytes in, each answered with the value, beside two 4-byte barriers.
        moved = {name: sum(_bytes(after, name, spec.id) - _bytes(old, name, spec.id)
                           for spec, old, after in zip(cluster.config.servers, pre, live["texts"]))
                 for name in ("bps_server_bytes_received_total", "bps_server_bytes_sent_total")}
        assert all(2 * (1 + steps) * 60_000 <= v <= 2 * (1 + steps) * 60_000 + 64 for v in moved.values()), moved
        assert live["first"] == 1.0
        keys, deltas = {}, {}
        for spec, text in zip(cluster.config.servers, live["texts"]):
            sid = str(spec.id)
            keys[sid] = _sample(text, "bps_server_async_keys", server=sid)
            deltas[sid] = _sample(text, "bps_server_async_pushes_total", server=sid)
            assert _sample(text, "bps_server_async_replays_total", server=sid) == 0
        assert sum(1 for k in keys.values() if k) >= 2, keys
        assert deltas == {sid: 2 * (1 + steps) * k for sid, k in keys.items()}, (deltas, keys)
        deadline = time.monotonic() + 15  # the ranks' exit reaches the servers through the worker daemons
        while any(_sample(_scrape(spec.metrics), "bps_server_async_keys", server=str(spec.id))
                  for spec in cluster.config.servers):
            assert time.monotonic() < deadline, "the job ended, but its asynchronous keys stayed"
            time.sleep(0.1)
        # A scrape of some names only (prometheus_client's name[] filter) has them (an empty 200 before: our
        # collectors say their names only when collected, a review's case).
        only = _scrape(cluster.config.worker_specs[0].metrics,
                       "/metrics?name[]=bps_worker_ops_total&name[]=process_open_fds")
        assert set(_types(only)) == {"bps_worker_ops", "process_open_fds"}, only
        assert _sample(only, "bps_worker_ops_total", worker="0") >= 2
        with pytest.raises(urllib.error.HTTPError) as info:
            _scrape(cluster.config.worker_specs[0].metrics, "/other")
        assert info.value.code == 404
    finally:
        cluster.stop()


def _collected(text: str) -> float:
    """Objects the cyclic garbage collector found unreachable, all generations."""
    return sum(_sample(text, "python_gc_objects_collected_total", generation=str(g)) for g in range(3))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [[2], [1, 1]], ids=["local processes", "machines"])
def test_every_failed_operation_is_counted_fused_or_not(tmp_path, layout):
    """A mismatch of a small (fused) tensor, of a large one, and of one on both sides of the fusion limit (40 kB
    as float32, 80 kB as float64) counts one failed operation on every worker whose processes heard it:
    between the processes of one machine (its local round, fused or not, or both: once), or between machines
    (the anchor's planner, or the server's round). Failures of small tensors were not counted at all (a
    review: an alert on the counter missed every tensor up to the fusion limit), nor those of a machine's own
    local rounds; then a tensor on both sides counted twice (a second review)."""
    cluster = start_cluster(write_config(tmp_path, layout, cpu_servers=1, metrics=True))
    try:
        results = run_ranks(cluster, rp.mismatches, [3, 100_000, 10_000], 1)
        texts = [_scrape(spec.metrics) for spec in cluster.config.worker_specs]
    finally:
        cluster.stop()
    assert all(r == {"errors": ["BPSMismatchError"] * 3, "after": 2.0} for r in results), results
    for worker, text in enumerate(texts):
        assert _sample(text, "bps_worker_ops_failed_total", worker=str(worker)) == 3, (layout, worker)
        assert _sample(text, "bps_worker_ops_total", worker=str(worker)) == 1  # mm.after, fused


def test_sums_leave_no_cyclic_garbage_in_the_daemons(tmp_path):
    """What an operation builds is freed by reference counting when it ends: an operation and its path that
    referred to each other left every fused operation, with its rounds, entries and tables, to the cyclic
    collector (about six objects per tensor a step in each worker daemon). Read from each daemon's /metrics
    (prometheus_client's GC collector)."""
    cluster = start_cluster(write_config(tmp_path, [2, 2], cpu_servers=1, metrics=True,
                                         cluster={"partition_bytes": 65536}))
    try:
        specs = [*cluster.config.worker_specs, *cluster.config.servers]
        before = [_scrape(spec.metrics) for spec in specs]
        steps, n = 8, 1000
        fused = run_ranks(cluster, fp.steady_fused, steps, n, timeout=120)
        assert all(r["exact"] == r["expected"] == steps * n for r in fused), fused
        large = run_ranks(cluster, rp.shared_rounds, 10, (100_000,), "float32")  # in place, many partitions
        assert all(r["exact"] and r["copy_exact"] for r in large), large
        after = [_scrape(spec.metrics) for spec in specs]
        for spec, old, new in zip(specs, before, after):
            runs = _sample(new, "python_gc_collections_total", generation="0") \
                - _sample(old, "python_gc_collections_total", generation="0")
            assert runs >= 1, (spec, runs)  # the collector ran meanwhile (44k objects found before the fix)
            garbage = _collected(new) - _collected(old)
            assert garbage < 0.1 * steps * n, (spec, garbage)

        # A closed connection, even one dropped for a bad frame, is freed at once too: each session with its
        # 256 KiB read buffer was cyclic garbage (its handlers' bound methods, the reader's stored error).
        worker = cluster.config.worker_specs[0]
        before_text = _scrape(worker.metrics)
        connections = 300
        for i in range(connections):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(worker.socket)
                if i % 2:
                    s.sendall(b"\xff" * 64)  # not a frame: the worker drops us
                    s.settimeout(10)
                    while s.recv(65536):
                        pass
        # A job after them allocates enough for the collector to run (and find what the connections left).
        fused = run_ranks(cluster, fp.steady_fused, 2, n, timeout=120)
        assert all(r["exact"] == r["expected"] == 2 * n for r in fused), fused
        runs_text = _scrape(worker.metrics)
        assert _sample(runs_text, "python_gc_collections_total", generation="0") \
            > _sample(before_text, "python_gc_collections_total", generation="0")
        garbage = _collected(runs_text) - _collected(before_text)
        assert garbage < connections, garbage  # about 28 objects a connection before
    finally:
        cluster.stop()


def test_every_worker_has_its_series_from_the_start(tmp_path):
    """bps_server_bytes_received_total and the push lag used to have one series without a worker label until
    the first push, then only the workers that had pushed: a series that first appears at its first bytes loses
    them to rate() and increase()."""
    from bps_server.server import ServerConfig, SummationServer
    from protocol.config import load_config

    server = SummationServer(ServerConfig(load_config(str(write_config(tmp_path, [1, 1, 1]))), 0))

    def series(name: str) -> dict[str, float]:
        family = next(f for f in server.metric_families() if f.name == name)
        return {labels["worker"]: value if isinstance(value, float) else value.count for labels, value in family.samples}

    assert series("bps_server_bytes_received_total") == {"0": 0.0, "1": 0.0, "2": 0.0}
    assert series("bps_server_push_lag_seconds") == {"0": 0, "1": 0, "2": 0}
    server.aggregator.counters.bytes_by_worker[1] = 4096
    server.aggregator.counters.push_lag[1] = Histogram()
    server.aggregator.counters.push_lag[1].observe(0.5)
    assert series("bps_server_bytes_received_total") == {"0": 0.0, "1": 4096.0, "2": 0.0}
    assert series("bps_server_push_lag_seconds") == {"0": 0, "1": 1, "2": 0}
