"""A daemon's HTTP endpoint on its ``metrics`` address: ``/metrics`` (prometheus_client), ``/livez``, ``/readyz``.

Theory of operation. Each daemon keeps its counters as plain numbers and :class:`Histogram` objects
that only its event loop touches: the hot path stays an increment and a bisect, with no lock
(prometheus_client's own Histogram takes a lock on every observe: several times the cost). On a
scrape a :class:`LoopCollector` asks the loop for a snapshot (``call_soon_threadsafe``; the daemon's
``metric_families()`` runs there and copies what it reports as :class:`Family` objects) and turns it into
prometheus_client's metric families. Each :class:`Endpoint` has its own ``CollectorRegistry`` with that
collector, a ``ProcessCollector`` (RSS, CPU seconds, open fds) and a ``GCCollector`` (the cyclic garbage
collector's runs and what they found): nothing is registered in prometheus_client's global registry.

Why a thread (prometheus_client's WSGI server, a thread per request) rather than a server on the loop:
``/livez`` must answer 503 when the loop stalls, and a server on the loop would then answer nothing
(indistinguishable from a dead host, and no reason given). Why the snapshot is taken on the loop rather
than read from the thread: the loop changes the daemon's dicts while a thread iterating them would fail
("dictionary changed size during iteration") or see half an update. A loop that does not answer within
``COLLECT_TIMEOUT_S`` gets a scrape of the process metrics alone and a warning (the probes say why).
The probes read the loop's latest :class:`~bps_runtime.health.Health` and never wait for the loop.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Final, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from . import health as health_
from .health import Health
from .lifecycle import ListenError

log = logging.getLogger("bps.metrics")

# Latency buckets (seconds): 100 us to 60 s.
LATENCY_BUCKETS: Final = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                          10.0, 30.0, 60.0)
# How long a scrape waits for the event loop's snapshot of the daemon's metrics.
COLLECT_TIMEOUT_S: Final = 2.0
PROBE_CONTENT_TYPE: Final = "text/plain; charset=utf-8"
# A client that sends its request slower than this loses its connection (and the thread serving it).
REQUEST_TIMEOUT_S: Final = 5.0


@dataclass
class Histogram:
    """A histogram the event loop observes into without a lock; :meth:`copy` for a scrape's snapshot."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1  # le: a value on a bound counts in it
        self.total += value
        self.count += 1

    def copy(self) -> "Histogram":
        return Histogram(self.buckets, list(self.counts), self.total, self.count)


@dataclass(frozen=True)
class Family:
    """One metric family: ``kind`` is counter, gauge or histogram; samples are (labels, value), every
    sample with the same label names."""

    name: str
    kind: str
    help: str
    samples: tuple[tuple[dict[str, str], float | Histogram], ...]


def to_prometheus(family: Family) -> Metric:
    """``family`` as prometheus_client's metric family (a counter's name keeps its ``_total``)."""
    names = list(family.samples[0][0]) if family.samples else []
    metric: Metric
    if family.kind == "histogram":
        hist = HistogramMetricFamily(family.name, family.help, labels=names)
        for labels, value in family.samples:
            if not isinstance(value, Histogram):
                raise TypeError(f"metric {family.name}: a histogram's sample must be a Histogram, got {value!r}")
            cumulative, buckets = 0, []
            for bound, n in zip((*value.buckets, float("inf")), value.counts):
                cumulative += n
                buckets.append((floatToGoString(bound), float(cumulative)))
            hist.add_metric([labels[k] for k in names], buckets, value.total)
        return hist
    if family.kind == "counter":
        metric = CounterMetricFamily(family.name, family.help, labels=names)
    elif family.kind == "gauge":
        metric = GaugeMetricFamily(family.name, family.help, labels=names)
    else:
        raise ValueError(f"metric {family.name}: kind must be counter, gauge or histogram, got {family.kind!r}")
    for labels, value in family.samples:
        if isinstance(value, Histogram):
            raise TypeError(f"metric {family.name}: a {family.kind}'s sample must be a number, got a Histogram")
        metric.add_metric([labels[k] for k in names], float(value))
    return metric


class LoopCollector(Collector):
    """Collects ``families()`` on ``loop`` (see the module docstring) from the HTTP thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, families: Callable[[], list[Family]],
                 timeout_s: float = COLLECT_TIMEOUT_S) -> None:
        self.loop = loop
        self.families = families
        self.timeout_s = timeout_s

    def collect(self) -> Iterator[Metric]:
        result: concurrent.futures.Future[list[Family]] = concurrent.futures.Future()

        def snapshot() -> None:
            if result.set_running_or_notify_cancel():
                try:
                    result.set_result(self.families())
                except BaseException as exc:
                    result.set_exception(exc)

        try:
            self.loop.call_soon_threadsafe(snapshot)
            families = result.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            result.cancel()
            log.warning("the event loop did not answer a scrape within %g s: process metrics only", self.timeout_s)
            return
        except RuntimeError:  # the loop is closed: the daemon is stopping
            return
        for family in families:
            yield to_prometheus(family)


class _Registry(CollectorRegistry):
    """A registry whose ``name[]`` filter (``/metrics?name[]=...``) works for collectors that cannot say their
    names ahead: prometheus_client maps names to collectors when they register, from their ``describe()``, and
    ours say none (the loop's families are known only when collected, on the loop), so every filtered scrape was
    an empty 200 (a review's case). The filter takes what a full scrape collects, restricted to the names."""

    def restricted_registry(self, names: Iterable[str]) -> Any:
        return _Restricted(self, set(names))


class _Restricted:
    def __init__(self, registry: CollectorRegistry, names: set[str]) -> None:
        self.registry, self.names = registry, names

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            restricted = metric._restricted_metric(self.names)
            if restricted is not None:
                yield restricted


class _Quiet(WSGIRequestHandler):
    """No line per request on stderr (probes come every few seconds); a deadline on each read."""

    timeout = REQUEST_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingWSGIServer):
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class Endpoint:
    """``/metrics``, ``/livez`` and ``/readyz`` on ``host:port``, from a thread (module docstring).

    ``families``: the daemon's metrics, called on ``loop``; ``health``: the latest beat (e.g. a
    :class:`~bps_runtime.health.Pulse`'s ``latest``), read from the HTTP thread.
    """

    def __init__(self, host: str, port: int, *, loop: asyncio.AbstractEventLoop,
                 families: Callable[[], list[Family]], health: Callable[[], Health | None],
                 stall_limit_s: float = health_.STALL_LIMIT_S, collect_timeout_s: float = COLLECT_TIMEOUT_S,
                 request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.registry = _Registry(auto_describe=False)
        self.registry.register(LoopCollector(loop, families, collect_timeout_s))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)  # python_gc_*: the cyclic collector's runs, what they found
        self.health = health
        self.stall_limit_s = stall_limit_s
        self._metrics_app = make_wsgi_app(self.registry)
        server_class = _Server6 if ":" in host else _Server
        try:
            handler = type("Handler", (_Quiet,), {"timeout": request_timeout_s})
            self._httpd = make_server(host, port, self._app, server_class=server_class, handler_class=handler)
        except OSError as exc:
            raise ListenError(f"metrics address {host}:{port}", exc) from exc
        self.address: tuple[str, int] = self._httpd.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="bps-metrics", daemon=True)
        self._thread.start()
        log.info("metrics and probes on http://%s:%d/ (metrics, livez, readyz)", host, self.address[1])

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path in ("/livez", "/readyz"):
            if environ["REQUEST_METHOD"] not in ("GET", "HEAD"):
                return _answer(start_response, 405, "only GET")
            judge = health_.livez if path == "/livez" else health_.readyz
            code, text = judge(self.health(), time.monotonic(), self.stall_limit_s)
            return _answer(start_response, code, text)
        return _answer(start_response, 404, "see /metrics, /livez, /readyz")

    def close(self) -> None:
        """Stop serving (blocks up to half a second: the server's poll interval)."""
        self._httpd.shutdown()
        self._httpd.server_close()


_REASONS: Final = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


def _answer(start_response: Callable[..., Any], code: int, text: str) -> list[bytes]:
    body = (text + "\n").encode()
    start_response(f"{code} {_REASONS[code]}", [("Content-Type", PROBE_CONTENT_TYPE),
                                                 ("Content-Length", str(len(body)))])
    return [body]
