"""Prometheus metrics for both daemons: text exposition format over a minimal HTTP endpoint.

Each daemon passes a ``collect()`` callable that returns its metric families; the endpoint
renders them on every ``GET /metrics``. Nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from dataclasses import dataclass, field
from typing import Callable, Final, Iterable

log = logging.getLogger("bps.metrics")

# Latency buckets (seconds): 100 us to 60 s.
LATENCY_BUCKETS: Final = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                          10.0, 30.0, 60.0)
MAX_REQUEST_BYTES: Final = 8192
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


@dataclass(frozen=True)
class Family:
    """One metric family: ``kind`` is counter, gauge or histogram; samples are (labels, value)."""

    name: str
    kind: str
    help: str
    samples: tuple[tuple[dict[str, str], float | Histogram], ...]


def render(families: Iterable[Family]) -> str:
    lines: list[str] = []
    for fam in families:
        lines.append(f"# HELP {fam.name} {fam.help}")
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        for labels, value in fam.samples:
            if isinstance(value, Histogram):
                cumulative = 0
                for bound, n in zip((*value.buckets, float("inf")), value.counts):
                    cumulative += n
                    le = "+Inf" if bound == float("inf") else repr(bound)
                    lines.append(f"{fam.name}_bucket{_labels({**labels, 'le': le})} {cumulative}")
                lines.append(f"{fam.name}_sum{_labels(labels)} {value.total!r}")
                lines.append(f"{fam.name}_count{_labels(labels)} {value.count}")
            else:
                lines.append(f"{fam.name}{_labels(labels)} {value!r}")
    return "\n".join(lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


async def serve(host: str, port: int, collect: Callable[[], Iterable[Family]]) -> asyncio.AbstractServer:
    """Answer ``GET /metrics`` with ``render(collect())``; anything else gets 404 or 400."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5.0)
            if len(request) > MAX_REQUEST_BYTES:
                raise ValueError("request too large")
            method, path, _ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            if method != "GET":
                status, body = "405 Method Not Allowed", "only GET\n"
            elif path.split("?", 1)[0] != "/metrics":
                status, body = "404 Not Found", "see /metrics\n"
            else:
                status, body = "200 OK", render(collect())
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ValueError):
            status, body = "400 Bad Request", "bad request\n"
        data = body.encode()
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {len(data)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + data)
        try:
            await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    server = await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_BYTES)
    log.info("metrics on http://%s:%d/metrics", host, server.sockets[0].getsockname()[1])
    return server
