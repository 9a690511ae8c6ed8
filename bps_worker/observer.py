"""The stats observer: every server's counters (``Stats``), asked for over TCP, for tests and benchmarks.

An observer is a peer with role ``ROLE_OBSERVER``: it answers the server's challenge like a worker (with
the cluster token where there is one), sends one ``StatsRequest`` and reads the ``Stats`` reply. Servers
never count it as a worker, so asking does not disturb a running job.
"""

from __future__ import annotations

import socket
from typing import Any, Final, Protocol

from protocol import PROTOCOL_VERSION
from protocol.config import ClusterConfig, read_token
from protocol.frames import FrameReader, encode_header
from protocol.messages import ROLE_OBSERVER, Challenge, Hello, Stats, StatsRequest, auth_digest, parse, to_header

__all__ = ["STATS_TIMEOUT_S", "server_stats"]

STATS_TIMEOUT_S: Final = 10.0


class HasConfig(Protocol):
    """Anything with the cluster's configuration (a :class:`bps_worker.supervise.Cluster`)."""

    @property
    def config(self) -> ClusterConfig: ...


def server_stats(cluster: HasConfig | ClusterConfig, *, timeout_s: float = STATS_TIMEOUT_S) -> dict[int, dict[str, Any]]:
    """Every server's counters (its ``Stats``) by server id, asked for over TCP as an observer."""
    config = cluster if isinstance(cluster, ClusterConfig) else cluster.config
    token = read_token(config)
    out = {}
    for spec in config.servers:
        with socket.create_connection((spec.host, spec.port), timeout=timeout_s) as s:
            reader = FrameReader()
            sent = False
            while spec.id not in out:
                data = s.recv(65536)
                if not data:
                    raise ConnectionError(f"server {spec.id} closed the stats connection")
                for message in (parse(f.header) for f in reader.receive_data(data)):
                    if isinstance(message, Challenge) and not sent:
                        auth = auth_digest(token, message.nonce, ROLE_OBSERVER, 0) if token else ""
                        s.sendall(encode_header(to_header(Hello(PROTOCOL_VERSION, ROLE_OBSERVER, 0, auth=auth)))
                                  + encode_header(to_header(StatsRequest(1))))
                        sent = True
                    elif isinstance(message, Stats):
                        out[spec.id] = message.stats
    return out
