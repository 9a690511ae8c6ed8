"""The cluster configuration (TOML), shared by both daemons, the launcher and the tests.

Every daemon builds one frozen :class:`ClusterConfig` at start-up; every error
names the offending key and the file. Defaults are documented in
``configs/README.md``.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .errors import ConfigError

DEFAULT_PARTITION_BYTES: Final = 4 * 1024 * 1024
DEFAULT_TIMEOUT_S: Final = 30.0
DEFAULT_CREDIT_BYTES: Final = 64 * 1024 * 1024
DEFAULT_MAX_PAYLOAD_BYTES: Final = 1 << 30
DEFAULT_WINDOW_PIECES: Final = 3

_CLUSTER_KEYS: Final = {
    "workers": (int, True),
    "partition_bytes": (int, False),
    "token_file": (str, False),
    "timeout": ((int, float), False),
    "credit_bytes": (int, False),
    "max_payload_bytes": (int, False),
    "colocated_shm": (bool, False),
    "deterministic": (bool, False),
    "window_pieces": (int, False),
}
_SERVER_KEYS: Final = {"id": (int, True), "address": (str, True), "worker": (int, False), "metrics": (str, False)}
_WORKER_KEYS: Final = {"id": (int, True), "local_size": (int, True), "socket": (str, True), "metrics": (str, False)}
_TOP_KEYS: Final = {"cluster", "server", "worker"}


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One Summation Service."""

    id: int
    host: str
    port: int
    worker: int | None  # the worker machine it shares a host with; None for a CPU-only machine
    metrics: tuple[str, int] | None = None  # where it serves Prometheus metrics

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker machine (Communication Service) and its training processes."""

    id: int
    local_size: int
    socket: str
    metrics: tuple[str, int] | None = None  # where it serves Prometheus metrics


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    workers: int
    servers: tuple[ServerSpec, ...]
    worker_specs: tuple[WorkerSpec, ...]
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    token_file: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    credit_bytes: int = DEFAULT_CREDIT_BYTES
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    colocated_shm: bool = True  # a worker and the server on its host exchange partitions in shared memory
    deterministic: bool = False  # servers add contributions in worker-id order (bitwise-repeatable sums)
    window_pieces: int = DEFAULT_WINDOW_PIECES  # pacing of TCP pushes (bps_worker.links.ServerLink.pump); 0: off
    source: str = "<memory>"

    @property
    def one_host(self) -> bool:
        """Every server has the same host address: the whole cluster is one machine (a demo or a test)."""
        return len({s.host for s in self.servers}) == 1

    @property
    def size(self) -> int:
        """Training processes in the whole cluster."""
        return sum(w.local_size for w in self.worker_specs)

    def worker(self, worker_id: int) -> WorkerSpec:
        for spec in self.worker_specs:
            if spec.id == worker_id:
                return spec
        raise ConfigError(f"{self.source}: no [[worker]] with id = {worker_id}")

    def server(self, server_id: int) -> ServerSpec:
        for spec in self.servers:
            if spec.id == server_id:
                return spec
        raise ConfigError(f"{self.source}: no [[server]] with id = {server_id}")

    def rank_offset(self, worker_id: int) -> int:
        """Global rank of local rank 0 on ``worker_id`` (ranks are numbered by worker id)."""
        return sum(w.local_size for w in self.worker_specs if w.id < worker_id)

    def worker_of_rank(self, rank: int) -> int:
        for spec in self.worker_specs:
            offset = self.rank_offset(spec.id)
            if offset <= rank < offset + spec.local_size:
                return spec.id
        raise ValueError(f"rank {rank} is outside 0..{self.size - 1}")


def load_config(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster file; ConfigError names the key and the file."""
    source = str(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    return parse_config(data, source)


def parse_config(data: dict[str, Any], source: str = "<memory>") -> ClusterConfig:
    """Validate an already-parsed TOML document."""
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(f"{source}: unknown top-level key {key!r} (allowed: cluster, server, worker)")
    cluster = data.get("cluster")
    if not isinstance(cluster, dict):
        raise ConfigError(f"{source}: missing required table [cluster]")
    c = _check_table(cluster, _CLUSTER_KEYS, "cluster", source)
    workers = c["workers"]
    _positive(workers, "cluster.workers", source)
    partition_bytes = c.get("partition_bytes", DEFAULT_PARTITION_BYTES)
    _positive(partition_bytes, "cluster.partition_bytes", source)
    timeout = float(c.get("timeout", DEFAULT_TIMEOUT_S))
    if not timeout > 0:
        raise ConfigError(f"{source}: cluster.timeout must be > 0, got {timeout}")
    credit_bytes = c.get("credit_bytes", DEFAULT_CREDIT_BYTES)
    _positive(credit_bytes, "cluster.credit_bytes", source)
    max_payload = c.get("max_payload_bytes", DEFAULT_MAX_PAYLOAD_BYTES)
    _positive(max_payload, "cluster.max_payload_bytes", source)
    window_pieces = c.get("window_pieces", DEFAULT_WINDOW_PIECES)
    _non_negative(window_pieces, "cluster.window_pieces", source)
    if max_payload < partition_bytes:
        raise ConfigError(
            f"{source}: cluster.max_payload_bytes ({max_payload}) is smaller than cluster.partition_bytes "
            f"({partition_bytes})"
        )

    worker_specs = []
    for i, table in enumerate(_array_of_tables(data, "worker", source)):
        w = _check_table(table, _WORKER_KEYS, f"worker[{i}]", source)
        _non_negative(w["id"], f"worker[{i}].id", source)
        _positive(w["local_size"], f"worker[{i}].local_size", source)
        if not w["socket"]:
            raise ConfigError(f"{source}: worker[{i}].socket must not be empty")
        metrics = _parse_address(w["metrics"], f"worker[{i}].metrics", source) if "metrics" in w else None
        worker_specs.append(WorkerSpec(w["id"], w["local_size"], w["socket"], metrics))
    ids = [w.id for w in worker_specs]
    _no_duplicates(ids, "worker id", source)
    _no_duplicates([w.socket for w in worker_specs], "worker socket", source)
    if sorted(ids) != list(range(workers)):
        raise ConfigError(
            f"{source}: cluster.workers = {workers} needs [[worker]] tables with ids 0..{workers - 1}, "
            f"found ids {sorted(ids)}"
        )

    servers = []
    for i, table in enumerate(_array_of_tables(data, "server", source)):
        s = _check_table(table, _SERVER_KEYS, f"server[{i}]", source)
        _non_negative(s["id"], f"server[{i}].id", source)
        host, port = _parse_address(s["address"], f"server[{i}].address", source)
        link = s.get("worker")
        if link is not None and link not in ids:
            raise ConfigError(f"{source}: server[{i}].worker = {link} names no [[worker]] id (ids: {sorted(ids)})")
        metrics = _parse_address(s["metrics"], f"server[{i}].metrics", source) if "metrics" in s else None
        servers.append(ServerSpec(s["id"], host, port, link, metrics))
    if not servers:
        raise ConfigError(f"{source}: at least one [[server]] table is required")
    _no_duplicates([s.id for s in servers], "server id", source)
    _no_duplicates([(s.host, s.port) for s in servers if s.port != 0], "server address", source)

    return ClusterConfig(
        workers=workers,
        servers=tuple(sorted(servers, key=lambda s: s.id)),
        worker_specs=tuple(sorted(worker_specs, key=lambda w: w.id)),
        partition_bytes=partition_bytes,
        token_file=c.get("token_file"),
        timeout=timeout,
        credit_bytes=credit_bytes,
        max_payload_bytes=max_payload,
        colocated_shm=c.get("colocated_shm", True),
        deterministic=c.get("deterministic", False),
        window_pieces=window_pieces,
        source=source,
    )


def _check_table(table: Any, keys: dict[str, tuple[Any, bool]], where: str, source: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: {where} must be a table")
    for key, value in table.items():
        if key not in keys:
            raise ConfigError(f"{source}: unknown key {where}.{key} (allowed: {', '.join(keys)})")
        kind = keys[key][0]
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            names = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
            raise ConfigError(f"{source}: {where}.{key} must be {names}, got {value!r}")
    for key, (_, required) in keys.items():
        if required and key not in table:
            raise ConfigError(f"{source}: missing required key {where}.{key}")
    return table


def _array_of_tables(data: dict[str, Any], key: str, source: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise ConfigError(f"{source}: {key} must be an array of tables ([[{key}]])")
    return value


def _positive(value: int, key: str, source: str) -> None:
    if value <= 0:
        raise ConfigError(f"{source}: {key} must be > 0, got {value}")


def _non_negative(value: int, key: str, source: str) -> None:
    if value < 0:
        raise ConfigError(f"{source}: {key} must be >= 0, got {value}")


def _no_duplicates(values: list[Any], what: str, source: str) -> None:
    seen = set()
    for value in values:
        if value in seen:
            raise ConfigError(f"{source}: duplicate {what} {value!r}")
        seen.add(value)


def _parse_address(address: str, key: str, source: str) -> tuple[str, int]:
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
        raise ConfigError(f"{source}: {key} must be HOST:PORT, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_text)
    if port > 65535:
        raise ConfigError(f"{source}: {key} has port {port} outside 0..65535")
    return host, port


MIN_TOKEN_BYTES: Final = 16


def read_token(config: ClusterConfig) -> bytes | None:
    """The cluster's shared secret (``cluster.token_file``), or None when the cluster has none."""
    if config.token_file is None:
        return None
    try:
        with open(config.token_file, "rb") as fh:
            token = fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"{config.source}: cluster.token_file {config.token_file!r} cannot be read: "
                          f"{exc.strerror}") from None
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(f"{config.source}: cluster.token_file {config.token_file!r} holds {len(token)} bytes; "
                          f"at least {MIN_TOKEN_BYTES} are required")
    return token
