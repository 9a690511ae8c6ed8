"""The cluster configuration (TOML), shared by both daemons, the launcher and the tests.

Every daemon builds one frozen :class:`ClusterConfig` at start-up; every error
names the offending key and the file. Defaults are documented in
``configs/README.md``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import os
import re
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Sequence

from .errors import ConfigError
from .messages import MAX_CONFIG_CHARS, MAX_CONFIG_ITEMS


DEFAULT_PARTITION_BYTES: Final = 4 * 1024 * 1024
DEFAULT_TIMEOUT_S: Final = 30.0
DEFAULT_CREDIT_BYTES: Final = 64 * 1024 * 1024
DEFAULT_MAX_PAYLOAD_BYTES: Final = 1 << 30
DEFAULT_WINDOW_PIECES: Final = 3
# cluster.credit_bytes: the event loop's write-buffer limits are C ints (uvloop), so a larger credit could not
# be set on any connection (every server refused every worker).
MAX_CREDIT_BYTES: Final = 2**31 - 1
# cluster.timeout: both daemons check their peers every timeout / 4, so a tiny one is a busy loop; an
# infinite (or huge) one means a dead peer is never reported, which the contract forbids.
MIN_TIMEOUT_S: Final = 0.5
MAX_TIMEOUT_S: Final = 24 * 3600.0
# cluster.arena_bytes: every arena of a worker daemon (and each process's slots) carves small tensors from
# slabs of this size (bps_runtime.segments.SLAB_BYTES is this; a sixteenth of a cap under 64 MiB, at least
# 256 KiB: segments.slab_bytes); a smaller cap is refused, as below it every small tensor once failed at run time.
MIN_ARENA_BYTES: Final = 4 << 20
# The largest tensor a process may allocate, in units of the cluster's max_payload_bytes: no more pieces than
# that where the frame limit, not partition_bytes, cuts them.
MAX_TENSOR_PAYLOADS: Final = 64
# cluster.max_payload_bytes: at least this, so that a slab of small tensors (MIN_ARENA_BYTES, always allocated
# whatever the limit) is MAX_TENSOR_PAYLOADS frames at most. 8 bytes was taken: a 1 MiB tensor went as 131,072
# pieces of 8 bytes, 28 s with a 3 s timeout and stall warnings meanwhile, and tensors of 4 MiB passed the
# "64 times" limit (a review's case).
MIN_MAX_PAYLOAD_BYTES: Final = MIN_ARENA_BYTES // MAX_TENSOR_PAYLOADS
# A Unix socket's path: at most 107 bytes (sun_path's 108, less the NUL). A longer [[worker]] socket failed
# only at bind, with "AF_UNIX path too long" (exit status 1, not naming the key).
MAX_SOCKET_PATH_BYTES: Final = 107
MAX_HOST_CHARS: Final = 253  # a DNS name's limit
# RFC 1123 labels (plus "_", which container runtimes use in names): letters, digits, "-" not at an end.
_HOST_LABEL: Final = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")

_CLUSTER_KEYS: Final = {
    "workers": (int, True),
    "partition_bytes": (int, False),
    "token_file": (str, False),
    "token_group_readable": (bool, False),
    "timeout": ((int, float), False),
    "stall_timeout": ((int, float), False),
    "credit_bytes": (int, False),
    "max_payload_bytes": (int, False),
    "colocated_shm": (bool, False),
    "deterministic": (bool, False),
    "window_pieces": (int, False),
    "arena_bytes": (int, False),
    "link_rate": ((int, str), False),
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
    token_group_readable: bool = False  # the token file may be readable (never writable) by its group
    timeout: float = DEFAULT_TIMEOUT_S
    # A round that waits this long (seconds) for a process or a machine that is connected but never submits it
    # fails, naming them (Horovod's stall shutdown time); 0: never, it is only warned about (stall: lines).
    stall_timeout: float = 0.0
    credit_bytes: int = DEFAULT_CREDIT_BYTES
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    colocated_shm: bool = True  # a worker and the server on its host exchange partitions in shared memory
    deterministic: bool = False  # servers add contributions in worker-id order (bitwise-repeatable sums)
    window_pieces: int = DEFAULT_WINDOW_PIECES  # pacing of TCP pushes (Placement.stream_window); 0: off
    # The most shared memory (bytes) of each arena of a worker daemon: each training process's slots, the
    # staging and the results buffers; least recently used idle tensors are freed for room. 0: half of /dev/shm.
    arena_bytes: int = 0
    # The slowest machine's network link, bits per second each way (cluster.link_rate); 0: not given. Where
    # links are fast, pieces grow so that each carries at least a fixed time of it (bps_worker.placement).
    link_bits_per_s: int = 0
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
    except UnicodeDecodeError as exc:  # (a ValueError, not a TOMLDecodeError: a traceback, or another key's message)
        line = exc.object[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{source}: not valid TOML: not UTF-8 (byte 0x{exc.object[exc.start]:02x} on line "
                          f"{line})") from None
    return parse_config(data, source)


def parse_config(data: dict[str, Any], source: str = "<memory>") -> ClusterConfig:
    """Validate an already-parsed TOML document."""
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(f"{source}: unknown top-level key {key!r} (allowed: cluster, server, worker)")
    cluster = data.get("cluster")
    if not isinstance(cluster, dict):
        raise ConfigError(f"{source}: missing required table [cluster]")
    c = _parse_cluster_table(cluster, source)
    worker_specs = _parse_workers(data, c["workers"], source)
    servers = _parse_servers(data, [w.id for w in worker_specs], source)
    _no_shared_listeners(servers, worker_specs, source)
    config = ClusterConfig(
        workers=c["workers"],
        servers=tuple(sorted(servers, key=lambda s: s.id)),
        worker_specs=tuple(sorted(worker_specs, key=lambda w: w.id)),
        partition_bytes=c["partition_bytes"],
        token_file=c.get("token_file"),
        token_group_readable=c.get("token_group_readable", False),
        timeout=c["timeout"],
        stall_timeout=c["stall_timeout"],
        credit_bytes=c["credit_bytes"],
        max_payload_bytes=c["max_payload_bytes"],
        colocated_shm=c.get("colocated_shm", True),
        deterministic=c.get("deterministic", False),
        window_pieces=c["window_pieces"],
        arena_bytes=c["arena_bytes"],
        link_bits_per_s=c["link_bits_per_s"],
        source=source,
    )
    _check_describable(config)
    return config


def _check_describable(config: ClusterConfig) -> None:
    """Every daemon's Hello describes the cluster to its peer (placement_items): refuse, here, a cluster file
    that no handshake could carry (it was a refusal at every connection, far from its cause)."""
    items = placement_items(config)
    chars = sum(map(len, items))
    if len(items) > MAX_CONFIG_ITEMS or chars > MAX_CONFIG_CHARS:
        raise ConfigError(f"{config.source}: {len(config.worker_specs)} workers and {len(config.servers)} servers "
                          f"take {len(items)} entries ({chars} characters) to describe to each peer in the "
                          f"handshake; at most {MAX_CONFIG_ITEMS} entries and {MAX_CONFIG_CHARS} characters "
                          f"(shorter host names help)")


def _parse_cluster_table(cluster: dict[str, Any], source: str) -> dict[str, Any]:
    """The [cluster] table's keys, checked, with every default filled in."""
    c = dict(_check_table(cluster, _CLUSTER_KEYS, "cluster", source))  # a copy: defaults go in, not the caller's
    _positive(c["workers"], "cluster.workers", source)
    partition_bytes = c.setdefault("partition_bytes", DEFAULT_PARTITION_BYTES)
    _positive(partition_bytes, "cluster.partition_bytes", source)
    timeout = c["timeout"] = float(c.get("timeout", DEFAULT_TIMEOUT_S))
    if not (math.isfinite(timeout) and MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S):
        raise ConfigError(f"{source}: cluster.timeout must be between {MIN_TIMEOUT_S:g} and {MAX_TIMEOUT_S:g} "
                          f"seconds, got {timeout}")
    stall = c["stall_timeout"] = float(c.get("stall_timeout", 0.0))
    if not (stall == 0.0 or (math.isfinite(stall) and timeout <= stall <= MAX_TIMEOUT_S)):
        raise ConfigError(f"{source}: cluster.stall_timeout must be 0 (never) or between cluster.timeout "
                          f"({timeout:g}) and {MAX_TIMEOUT_S:g} seconds, got {stall}")
    credit = c.setdefault("credit_bytes", DEFAULT_CREDIT_BYTES)
    _positive(credit, "cluster.credit_bytes", source)
    if credit > MAX_CREDIT_BYTES:
        raise ConfigError(f"{source}: cluster.credit_bytes must be at most {MAX_CREDIT_BYTES} (the event loop's "
                          f"write-buffer limit), got {credit}")
    max_payload = c.setdefault("max_payload_bytes", DEFAULT_MAX_PAYLOAD_BYTES)
    _positive(max_payload, "cluster.max_payload_bytes", source)
    _non_negative(c.setdefault("window_pieces", DEFAULT_WINDOW_PIECES), "cluster.window_pieces", source)
    arena = c.setdefault("arena_bytes", 0)  # 0: half of /dev/shm
    if arena != 0 and arena < MIN_ARENA_BYTES:
        raise ConfigError(f"{source}: cluster.arena_bytes must be at least {MIN_ARENA_BYTES} (4 MiB: the slabs "
                          f"small tensors share), got {arena}")
    c["link_bits_per_s"] = parse_rate(c.get("link_rate", 0), "cluster.link_rate", source)
    if max_payload < max(partition_bytes, MIN_MAX_PAYLOAD_BYTES):
        raise ConfigError(
            f"{source}: cluster.max_payload_bytes ({max_payload}) is smaller than cluster.partition_bytes "
            f"({partition_bytes})" if max_payload < partition_bytes else
            f"{source}: cluster.max_payload_bytes must be at least {MIN_MAX_PAYLOAD_BYTES} (64 KiB: a tensor may be "
            f"{MAX_TENSOR_PAYLOADS} times as large, and a slab of small tensors is {MIN_ARENA_BYTES}), got "
            f"{max_payload}"
        )
    return c


_RATE_UNITS: Final = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE: Final = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*")


def parse_rate(value: int | str, key: str, source: str) -> int:
    """A link rate in bits per second: an integer, or a number with tc's units (``"10gbit"``, ``"800mbit"``,
    decimal); 0 (or absent) for not given."""
    if isinstance(value, int):
        _non_negative(value, key, source)
        return value
    match = _RATE.fullmatch(value.lower())
    if match is None or match.group(2) not in _RATE_UNITS:
        raise ConfigError(f"{source}: {key} must be bits per second, as an integer or with a unit "
                          f"({', '.join(_RATE_UNITS)}: e.g. \"25gbit\"), got {value!r}")
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2)]
    if not math.isfinite(bits):
        raise ConfigError(f"{source}: {key} is too large, got {value[:40]!r}")
    return round(bits)


def _parse_workers(data: dict[str, Any], workers: int, source: str) -> list[WorkerSpec]:
    worker_specs = []
    for i, table in enumerate(_array_of_tables(data, "worker", source)):
        w = _check_table(table, _WORKER_KEYS, f"worker[{i}]", source)
        _non_negative(w["id"], f"worker[{i}].id", source)
        _positive(w["local_size"], f"worker[{i}].local_size", source)
        if not w["socket"] or "\0" in w["socket"]:
            raise ConfigError(f"{source}: worker[{i}].socket must be a path (not empty, no NUL character)")
        if (too_long := socket_path_too_long(w["socket"])) is not None:
            raise ConfigError(f"{source}: worker[{i}].socket (the [[worker]] with id = {w['id']}) {too_long}")
        metrics = _parse_address(w["metrics"], f"worker[{i}].metrics", source) if "metrics" in w else None
        worker_specs.append(WorkerSpec(w["id"], w["local_size"], w["socket"], metrics))
    ids = [w.id for w in worker_specs]
    _no_duplicates(ids, "worker id", source)
    _no_duplicates([w.socket for w in worker_specs], "worker socket", source)
    if len(ids) != workers or sorted(ids) != list(range(workers)):  # (the count first: never a list of a huge one)
        raise ConfigError(
            f"{source}: cluster.workers = {workers} needs [[worker]] tables with ids 0..{workers - 1}, "
            f"found ids {sorted(ids)}"
        )
    return worker_specs


def socket_path_too_long(path: str) -> str | None:
    """None if ``path`` fits a Unix socket's address; else how long it is and the limit, as the end of a sentence
    that starts with its name."""
    size = len(os.fsencode(path))
    if size <= MAX_SOCKET_PATH_BYTES:
        return None
    return f"is {size} bytes long; a Unix socket's path may have at most {MAX_SOCKET_PATH_BYTES} bytes"


def _parse_servers(data: dict[str, Any], worker_ids: list[int], source: str) -> list[ServerSpec]:
    servers = []
    for i, table in enumerate(_array_of_tables(data, "server", source)):
        s = _check_table(table, _SERVER_KEYS, f"server[{i}]", source)
        _non_negative(s["id"], f"server[{i}].id", source)
        host, port = _parse_address(s["address"], f"server[{i}].address", source)
        link = s.get("worker")
        if link is not None and link not in worker_ids:
            raise ConfigError(f"{source}: server[{i}].worker = {link} names no [[worker]] id "
                              f"(ids: {sorted(worker_ids)})")
        metrics = _parse_address(s["metrics"], f"server[{i}].metrics", source) if "metrics" in s else None
        servers.append(ServerSpec(s["id"], host, port, link, metrics))
    if not servers:
        raise ConfigError(f"{source}: at least one [[server]] table is required")
    _no_duplicates([s.id for s in servers], "server id", source)
    _no_duplicates([(s.host, s.port) for s in servers], "server address", source)
    return servers


_ANY_HOST: Final = frozenset({"0.0.0.0", "::"})  # an unspecified address: the machine's every address


def _loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8, ``::1``: every machine's own."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _no_shared_listeners(servers: list[ServerSpec], workers: list[WorkerSpec], source: str) -> None:
    """Two daemons cannot listen on one address: a ``metrics`` equal to another daemon's ``metrics`` or server
    ``address`` failed only when the second daemon started, after the first (two lines, exit status 1: a review).
    Refused here where the file says it, on one port: the same host, where it names one machine (an address or a
    name of the network's); or one machine's listeners (a worker and its colocated servers; every daemon of a
    one-box cluster, whose servers are all at loopback addresses) where both are its loopback or either listens on
    every address. An unspecified or loopback host on different machines is each machine's own: allowed (a
    review of the first version refused 127.0.0.1:9300 on two machines)."""
    one_box = all(_loopback(s.host) for s in servers)
    listeners: list[tuple[str, int | None, tuple[str, int], int | None]] = [
        (f"server {s.id}'s address", s.worker, (s.host, s.port), s.id) for s in servers]
    listeners += [(f"server {s.id}'s metrics", s.worker, s.metrics, s.id) for s in servers if s.metrics is not None]
    listeners += [(f"worker {w.id}'s metrics", w.id, w.metrics, None) for w in workers if w.metrics is not None]
    by_port: dict[int, list[tuple[str, object, str]]] = {}  # (a port's listeners are few: not every pair)
    for what, worker, (host, port), server in listeners:
        machine: object = "box" if one_box else ("worker", worker) if worker is not None else ("server", server)
        local = host in _ANY_HOST or _loopback(host)
        for other, other_machine, other_host in by_port.setdefault(port, []):
            other_local = other_host in _ANY_HOST or _loopback(other_host)
            one_host = host == other_host and not local
            one_machine = machine == other_machine and (
                host == other_host or host in _ANY_HOST or other_host in _ANY_HOST or (local and other_local))
            if one_host or one_machine:
                raise ConfigError(f"{source}: {what} {_hostport(host, port)} is also {other} "
                                  f"({_hostport(other_host, port)}): two daemons cannot listen on one address")
        by_port[port].append((what, machine, host))


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
    """``HOST:PORT``, ``[IPV6]:PORT``: the host a DNS name or an IP address, the port 1..65535.

    Port 0 would bind a random port that no peer can know; a bare IPv6 address (``a:b:c:9000``) is
    ambiguous and used to fail only at connect time, with the resolver's "Unknown error -2".
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
        raise ConfigError(f"{source}: {key} must be HOST:PORT, got {address!r}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ConfigError(f"{source}: {key} has port {port} outside 1..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{source}: {key} has {host!r} in brackets, which is not an IPv6 address "
                              f"(got {address!r})") from None
        return host, port
    if ":" in host:
        raise ConfigError(f"{source}: {key} must be HOST:PORT with an IPv6 host in brackets "
                          f"([fe80::1]:9000), got {address!r}")
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    numeric = all(x.isascii() and x.isdigit() for x in labels)
    if len(host) > MAX_HOST_CHARS or not host.isascii() or not all(_HOST_LABEL.fullmatch(x) for x in labels) \
            or (numeric and not _is_ipv4(host)):
        raise ConfigError(f"{source}: {key} has host {host!r}, which is neither a DNS name nor an IP address "
                          f"(got {address!r})")
    return host, port


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


MIN_TOKEN_BYTES: Final = 16
ROOT_UID: Final = 0


# -- the token file ---------------------------------------------------------------------------------
# The token is the whole of the cluster's authentication (protocol.handshake): whoever reads it may join
# as any worker or pose as any server. So a token file that another user could read or replace is refused,
# as ssh refuses a private key with loose modes: owned by us (or root), a regular file, no access for
# others, and none for its group unless ``cluster.token_group_readable`` says a group shares it (read
# only: a group that may write it could replace the secret).

def token_path(config: ClusterConfig) -> str | None:
    """Where the cluster's token lives (``cluster.token_file`` with a leading ``~`` expanded), or None."""
    return None if config.token_file is None else os.path.expanduser(config.token_file)


def token_file_problem(mode: int, owner: int, *, uid: int, group_readable: bool = False) -> str | None:
    """None if a token file of ``mode`` (``st_mode``) owned by ``owner`` may be trusted by user ``uid``;
    else what is wrong, as the end of a sentence that starts with the file's name."""
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    if owner not in (uid, ROOT_UID):
        return f"is owned by uid {owner}, not by this user (uid {uid}) or root: that user could change it"
    allowed = stat.S_IRGRP if group_readable else 0
    loose = stat.S_IMODE(mode) & (stat.S_IRWXG | stat.S_IRWXO) & ~allowed
    if not loose:
        return None
    who = "others" if loose & stat.S_IRWXO else "its group"
    if group_readable:
        return (f"is open to {who} (mode {stat.S_IMODE(mode):03o}); run `chmod 640` on it "
                f"(cluster.token_group_readable = true: its group may read it, no more)")
    return f"is open to {who} (mode {stat.S_IMODE(mode):03o}); run `chmod 600` on it"


def read_token(config: ClusterConfig) -> bytes | None:
    """The cluster's shared secret (``cluster.token_file``), or None when the cluster has none.

    ConfigError (one line naming the cluster file and the token file) when it cannot be read, holds fewer
    than :data:`MIN_TOKEN_BYTES`, or fails :func:`token_file_problem` (checked on the opened file, so the
    checked file is the one read).
    """
    path = token_path(config)
    if path is None:
        return None
    where = f"{config.source}: cluster.token_file {path!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)  # a FIFO must not hang us
    except OSError as exc:
        hint = " (make one with `bps-launch --make-token PATH`)" if isinstance(exc, FileNotFoundError) else ""
        raise ConfigError(f"{where} cannot be read: {exc.strerror}{hint}") from None
    try:  # (open() refuses a directory's descriptor: read a regular file only, and let the check name the rest)
        st = os.fstat(fd)
        token = b""
        if stat.S_ISREG(st.st_mode):
            with open(fd, "rb", closefd=False) as fh:
                token = fh.read().strip()
    finally:
        os.close(fd)
    if stat.S_ISREG(st.st_mode) and len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(f"{where} holds {len(token)} bytes; at least {MIN_TOKEN_BYTES} are required")
    problem = token_file_problem(st.st_mode, st.st_uid, uid=os.geteuid(), group_readable=config.token_group_readable)
    if problem is not None:
        raise ConfigError(f"{where} {problem}")
    return token


# -- the placement digest -------------------------------------------------------------------------
# Every machine must read the same cluster: which server sums which bytes (bps_worker.placement uses
# the worker count, every server's id, host and colocated worker, partition_bytes and the link rate), how
# ranks are numbered (each worker's local_size: ranks, sizes and averages' divisors) and which address is which
# server. A file that differs on one machine used to hang the job; the handshake now compares the
# description below (Hello.config_items) and refuses a peer whose description differs, naming the
# entries. Keys that only tune one machine (timeouts, credit, sockets, metrics, the token's path) are
# left out: they may differ.

def placement_items(config: ClusterConfig) -> tuple[str, ...]:
    """The canonical description of what must agree across machines: ``key=value`` entries, in order."""
    items = [f"workers={config.workers}", f"partition_bytes={config.partition_bytes}"]
    if config.link_bits_per_s:  # it sizes the pieces (absent from files without it: their digests stay)
        items.append(f"link_bits_per_s={config.link_bits_per_s}")
    if config.max_payload_bytes != DEFAULT_MAX_PAYLOAD_BYTES:  # it caps the pieces, and a server refuses a larger
        items.append(f"max_payload_bytes={config.max_payload_bytes}")  # one: a worker pushed it again for ever
    items += [f"worker.{w.id}.local_size={w.local_size}" for w in config.worker_specs]
    for s in config.servers:
        items.append(f"server.{s.id}.address={s.address}")
        items.append(f"server.{s.id}.worker={'none' if s.worker is None else s.worker}")
    return tuple(items)


def placement_digest(items: Sequence[str]) -> str:
    """A short hash of a placement description (64 bits of SHA-256, hex): equal files, equal digests."""
    return hashlib.sha256("\n".join(sorted(items)).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def placement_differences(ours: Sequence[str], theirs: Sequence[str], *, here: str = "here",
                          there: str = "there") -> list[str]:
    """What differs between two descriptions, one readable line per key (in our order, then theirs)."""
    mine, other = _as_map(ours), _as_map(theirs)
    keys = list(mine) + [k for k in other if k not in mine]
    out = []
    for key in keys:
        a, b = mine.get(key), other.get(key)
        if a != b:
            out.append(f"{key} is {'absent' if a is None else a} {here}, {'absent' if b is None else b} {there}")
    return out


def _as_map(items: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = value
    return out
