"""Cluster files for one box: a ``cluster.toml`` on free loopback ports, for the tests and the benchmarks.

The file is an ordinary cluster configuration (``configs/README.md``); only its addresses are chosen here:
every server on a free port of 127.0.0.1 (or 127.0.0.``i+1`` to look like several hosts), every worker's
socket in the directory given, which is created private (mode 700) so that no other user can squat it.
Every file names a token (``directory/token``, made mode 600 unless it is there already), so that
clusters of the tests and the benchmarks authenticate every TCP connection as a real one does.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from .token_file import make_token

__all__ = ["free_ports", "toml_value", "write_config"]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports of 127.0.0.1 that were free a moment ago (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def toml_value(value: Any) -> str:
    """``value`` (bool, number or string) as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(directory: Path, local_sizes: list[int], *, colocated: bool = True, cpu_servers: int = 1,
                 extra_servers_per_worker: int = 0, cluster: dict[str, Any] | None = None,
                 metrics: bool = False, separate_hosts: bool = False, token: bool = True) -> Path:
    """A one-box cluster file on free loopback ports, written to ``directory/cluster.toml``; its path.

    ``len(local_sizes)`` workers (sockets ``directory/w<N>.sock``), ``1 + extra_servers_per_worker``
    colocated servers each (unless not ``colocated``), plus ``cpu_servers`` CPU-only ones; ``cluster`` adds
    ``[cluster]`` keys. With ``metrics`` every daemon also serves Prometheus metrics on a free port. With
    ``separate_hosts`` server ``i`` listens on 127.0.0.``i+1``: still this box, but the config looks like
    servers on several hosts (the finer partitions and the streams of ``bps_worker.placement``).
    ``cluster.token_file`` is ``directory/token`` (made if missing) unless ``cluster`` names one, or
    ``token`` is False: a cluster without authentication, for the tests about one.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    n = len(local_sizes)
    n_servers = (n * (1 + extra_servers_per_worker) if colocated else 0) + cpu_servers
    ports = free_ports(n_servers + (n_servers + n if metrics else 0))
    metric_ports = iter(ports[n_servers:])
    lines = ["[cluster]", f"workers = {n}"]
    lines += [f"{key} = {toml_value(value)}" for key, value in (cluster or {}).items()]
    if token and "token_file" not in (cluster or {}):
        token_path = directory.absolute() / "token"
        make_token(str(token_path))  # kept when there already: a file rewritten keeps its token
        lines += [f"token_file = {toml_value(str(token_path))}"]

    def host(sid: int) -> str:
        return f"127.0.0.{sid + 1}" if separate_hosts else "127.0.0.1"

    def server(sid: int, worker: int | None) -> list[str]:
        out = ["", "[[server]]", f"id = {sid}", f'address = "{host(sid)}:{ports[sid]}"']
        out += [f"worker = {worker}"] if worker is not None else []
        return out + ([f'metrics = "127.0.0.1:{next(metric_ports)}"'] if metrics else [])

    sid = 0
    for w in range(n if colocated else 0):
        for _ in range(1 + extra_servers_per_worker):
            lines += server(sid, w)
            sid += 1
    for _ in range(cpu_servers):
        lines += server(sid, None)
        sid += 1
    for w, local in enumerate(local_sizes):
        socket = toml_value(f"{directory}/w{w}.sock")
        lines += ["", "[[worker]]", f"id = {w}", f"local_size = {local}", f"socket = {socket}"]
        lines += [f'metrics = "127.0.0.1:{next(metric_ports)}"'] if metrics else []
    path = directory / "cluster.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
