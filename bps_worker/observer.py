"""The stats observer: every server's counters (``Stats``), asked for over TCP, for tests and benchmarks.

An observer is a peer with role ``ROLE_OBSERVER``: it answers the server's challenge like a worker (with
the cluster token where there is one, :class:`protocol.handshake.ClientHandshake`), sends one
``StatsRequest`` and reads the ``Stats`` reply, believed only once the server's Welcome proved it (with a
token: a server that cannot prove the token is a ConnectionError naming it). Servers never count it as a
worker, so asking does not disturb a running job.
"""

from __future__ import annotations

import socket
from typing import Any, Final, Protocol

from protocol import PROTOCOL_VERSION
from protocol.config import ClusterConfig, read_token
from protocol.frames import FrameReader, encode_message
from protocol.handshake import ClientHandshake, HandshakeError
from protocol.messages import ROLE_OBSERVER, Challenge, Failure, Hello, Stats, StatsRequest, Welcome, parse

__all__ = ["STATS_TIMEOUT_S", "server_stats"]

STATS_TIMEOUT_S: Final = 10.0


class HasConfig(Protocol):
    """Anything with the cluster's configuration (a :class:`bps_worker.supervise.Cluster`)."""

    @property
    def config(self) -> ClusterConfig: ...


def server_stats(cluster: HasConfig | ClusterConfig, *, timeout_s: float = STATS_TIMEOUT_S,
                 only: int | None = None) -> dict[int, dict[str, Any]]:
    """Every server's counters (its ``Stats``) by server id, asked for over TCP as an observer; with ``only``,
    that one server's."""
    config = cluster if isinstance(cluster, ClusterConfig) else cluster.config
    token = read_token(config)
    out = {}
    for spec in config.servers:
        if only is not None and spec.id != only:
            continue
        with socket.create_connection((spec.host, spec.port), timeout=timeout_s) as s:
            out[spec.id] = _ask(s, spec.id, token)
    return out


def _ask(s: socket.socket, server_id: int, token: bytes | None) -> dict[str, Any]:
    """One server's Stats on connected socket ``s``: the handshake, the request, the verified answer."""
    who = f"server {server_id}"
    greeting = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_OBSERVER, 0), token=token, server=server_id, who=who)
    reader = FrameReader()
    welcomed = False
    while True:
        data = s.recv(65536)
        if not data:
            raise ConnectionError(f"{who} closed the stats connection")
        for message in (parse(f.header) for f in reader.receive_data(data)):
            try:
                if isinstance(message, Challenge) and greeting.state == "idle":
                    s.sendall(encode_message(greeting.receive(message)) + encode_message(StatsRequest(1)))
                elif isinstance(message, (Welcome, Failure)) and not welcomed:
                    greeting.receive(message)
                    welcomed = True
            except HandshakeError as exc:
                raise ConnectionError(str(exc)) from exc
            if isinstance(message, Stats) and welcomed:
                return message.stats
