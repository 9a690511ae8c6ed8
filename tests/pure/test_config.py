"""protocol.config: load_config/parse_config, defaults, helpers and every error."""

from __future__ import annotations

import re

import textwrap
from pathlib import Path

import pytest

from protocol.config import (
    DEFAULT_CREDIT_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_PARTITION_BYTES,
    DEFAULT_TIMEOUT_S,
    MAX_TIMEOUT_S,
    MIN_TIMEOUT_S,
    ClusterConfig,
    ServerSpec,
    WorkerSpec,
    load_config,
    parse_config,
    placement_differences,
    placement_digest,
    placement_items,
)
from protocol.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

CLUSTER = """
[cluster]
workers = 2
"""
SERVERS = """
[[server]]
id = 0
address = "127.0.0.1:9100"
worker = 0

[[server]]
id = 1
address = "127.0.0.1:9101"
worker = 1
"""
WORKERS = """
[[worker]]
id = 0
local_size = 2
socket = "/tmp/w0.sock"

[[worker]]
id = 1
local_size = 3
socket = "/tmp/w1.sock"
"""


def write(tmp_path: Path, text: str, name: str = "cluster.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def config_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message, message
    return message


# -- valid files ---------------------------------------------------------------------------

def test_full_valid_file(tmp_path):
    path = write(tmp_path, """
        [cluster]
        workers = 2
        partition_bytes = 1048576
        token_file = "/etc/bps/token"
        timeout = 7.5
        credit_bytes = 2097152
        max_payload_bytes = 8388608
        window_pieces = 5

        [[server]]
        id = 1
        address = "10.0.0.2:9000"
        worker = 1

        [[server]]
        id = 0
        address = "[::1]:9001"
        worker = 0

        [[server]]
        id = 2
        address = "cpu-box.example:9002"

        [[worker]]
        id = 1
        local_size = 4
        socket = "/run/bps/w1.sock"

        [[worker]]
        id = 0
        local_size = 8
        socket = "/run/bps/w0.sock"
    """)
    cfg = load_config(path)
    assert cfg.source == str(path)
    assert cfg.workers == 2
    assert cfg.partition_bytes == 1048576
    assert cfg.token_file == "/etc/bps/token"
    assert cfg.timeout == 7.5
    assert cfg.credit_bytes == 2097152
    assert cfg.max_payload_bytes == 8388608
    assert cfg.window_pieces == 5
    assert not cfg.one_host  # servers on three hosts
    # sorted by id whatever the file order
    assert cfg.servers == (
        ServerSpec(0, "::1", 9001, 0),
        ServerSpec(1, "10.0.0.2", 9000, 1),
        ServerSpec(2, "cpu-box.example", 9002, None),
    )
    assert cfg.worker_specs == (WorkerSpec(0, 8, "/run/bps/w0.sock"), WorkerSpec(1, 4, "/run/bps/w1.sock"))
    assert cfg.servers[0].address == "[::1]:9001"
    assert cfg.servers[1].address == "10.0.0.2:9000"
    assert cfg.server(2).host == "cpu-box.example"
    assert cfg.worker(1).local_size == 4


def test_load_config_accepts_str_path(tmp_path):
    path = write(tmp_path, CLUSTER + SERVERS + WORKERS)
    assert load_config(str(path)) == load_config(path)


def test_defaults(tmp_path):
    cfg = load_config(write(tmp_path, CLUSTER + SERVERS + WORKERS))
    assert cfg.partition_bytes == DEFAULT_PARTITION_BYTES == 4 * 1024 * 1024
    assert cfg.timeout == DEFAULT_TIMEOUT_S == 30.0
    assert isinstance(cfg.timeout, float)
    assert cfg.credit_bytes == DEFAULT_CREDIT_BYTES == 64 * 1024 * 1024
    assert cfg.max_payload_bytes == DEFAULT_MAX_PAYLOAD_BYTES == 1 << 30
    assert cfg.window_pieces == 3
    assert cfg.token_file is None
    assert cfg.one_host  # both servers at 127.0.0.1


def test_stall_timeout_is_off_by_default_and_at_least_the_timeout(tmp_path):
    assert load_config(write(tmp_path, CLUSTER + SERVERS + WORKERS)).stall_timeout == 0.0
    cfg = load_config(write(tmp_path, CLUSTER + "timeout = 5\nstall_timeout = 300\n" + SERVERS + WORKERS))
    assert cfg.stall_timeout == 300.0 and isinstance(cfg.stall_timeout, float)
    assert load_config(write(tmp_path, CLUSTER + "timeout = 5\nstall_timeout = 5\n" + SERVERS + WORKERS)
                       ).stall_timeout == 5.0
    assert "cluster.stall_timeout must be 0 (never) or between cluster.timeout (30) and 86400 seconds, got 10.0" in \
        config_error(tmp_path, CLUSTER + "stall_timeout = 10\n" + SERVERS + WORKERS)


def test_integer_timeout_becomes_float(tmp_path):
    cfg = load_config(write(tmp_path, CLUSTER + "timeout = 5\n" + SERVERS + WORKERS))
    assert cfg.timeout == 5.0 and isinstance(cfg.timeout, float)


def test_size_rank_offset_worker_of_rank(tmp_path):
    cfg = load_config(write(tmp_path, CLUSTER + SERVERS + WORKERS))  # local sizes 2 and 3
    assert cfg.size == 5
    assert cfg.rank_offset(0) == 0
    assert cfg.rank_offset(1) == 2
    assert [cfg.worker_of_rank(r) for r in range(5)] == [0, 0, 1, 1, 1]
    for rank in (-1, 5, 100):
        with pytest.raises(ValueError, match=f"rank {rank} is outside 0..4"):
            cfg.worker_of_rank(rank)


def test_lookup_of_missing_ids_names_file(tmp_path):
    path = write(tmp_path, CLUSTER + SERVERS + WORKERS)
    cfg = load_config(path)
    with pytest.raises(ConfigError, match=r"no \[\[worker\]\] with id = 7") as info:
        cfg.worker(7)
    assert str(path) in str(info.value)
    with pytest.raises(ConfigError, match=r"no \[\[server\]\] with id = 9") as info:
        cfg.server(9)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("address,key", [("127.0.0.1:0", "server[0].address"), ("127.0.0.1:0", "worker[0].metrics")])
def test_port_zero_is_refused(tmp_path, address, key):
    """Port 0 binds a random port that no peer can know."""
    if key.startswith("server"):
        text = CLUSTER + SERVERS.replace("127.0.0.1:9100", address) + WORKERS
    else:
        text = CLUSTER + SERVERS + WORKERS.replace('socket = "/tmp/w0.sock"',
                                                   f'socket = "/tmp/w0.sock"\nmetrics = "{address}"')
    assert f"{key} has port 0 outside 1..65535" in config_error(tmp_path, text)


def _with_metrics(server0: str = "", server1: str = "", worker0: str = "", worker1: str = "") -> str:
    """The test cluster with these ``metrics`` addresses (an empty one: none)."""
    servers = SERVERS.replace('worker = 0\n', 'worker = 0\n' + (f'metrics = "{server0}"\n' if server0 else ""))
    servers = servers.replace('worker = 1\n', 'worker = 1\n' + (f'metrics = "{server1}"\n' if server1 else ""))
    workers = WORKERS.replace('socket = "/tmp/w0.sock"\n', 'socket = "/tmp/w0.sock"\n' +
                              (f'metrics = "{worker0}"\n' if worker0 else ""))
    workers = workers.replace('socket = "/tmp/w1.sock"\n', 'socket = "/tmp/w1.sock"\n' +
                              (f'metrics = "{worker1}"\n' if worker1 else ""))
    return CLUSTER + servers + workers


@pytest.mark.parametrize("metrics,said", [
    (dict(worker0="127.0.0.1:9200", worker1="127.0.0.1:9200"),  # (a one-box cluster: its servers' addresses)
     "worker 1's metrics 127.0.0.1:9200 is also worker 0's metrics (127.0.0.1:9200)"),
    (dict(worker0="localhost:9200", worker1="[::1]:9200"), "worker 1's metrics [::1]:9200 is also worker 0's"),
    (dict(server1="127.0.0.1:9100"), "server 1's metrics 127.0.0.1:9100 is also server 0's address"),
    (dict(server0="0.0.0.0:9300", worker0="127.0.0.1:9300"),  # (one machine: every address there)
     "worker 0's metrics 127.0.0.1:9300 is also server 0's metrics (0.0.0.0:9300)"),
])
def test_two_daemons_listening_on_one_address_are_refused(tmp_path, metrics, said):
    """They failed only when the second daemon started (a review); an unspecified host is each machine's own."""
    assert said in config_error(tmp_path, _with_metrics(**metrics))


def test_every_machines_metrics_on_one_port_of_any_address_loads(tmp_path):
    text = _with_metrics(server0="0.0.0.0:9300", server1="0.0.0.0:9300", worker0="0.0.0.0:9301",
                         worker1="[::]:9301")  # (machines at the network's addresses: not one box)
    config = load_config(write(tmp_path, text.replace('"127.0.0.1:9100"', '"10.0.0.1:9100"').replace(
        '"127.0.0.1:9101"', '"10.0.0.2:9101"')))
    assert [w.metrics for w in config.worker_specs] == [("0.0.0.0", 9301), ("::", 9301)]


@pytest.mark.parametrize("hosts,refused", [
    (("127.0.0.1", "localhost"), False),  # a node-local scraper on each machine (a review of the first version)
    (("[::1]", "[::1]"), False),
    (("10.0.0.1", "10.0.0.1"), True),  # one address is one machine
])
def test_loopback_metrics_on_different_machines_load(tmp_path, hosts, refused):
    """Machines at the network's addresses, each worker's metrics at a loopback (or one) address on one port."""
    text = _with_metrics(worker0=f"{hosts[0]}:9300", worker1=f"{hosts[1]}:9300").replace(
        '"127.0.0.1:9100"', '"10.0.0.1:9100"').replace('"127.0.0.1:9101"', '"10.0.0.2:9101"')
    if refused:
        assert "worker 1's metrics 10.0.0.1:9300 is also worker 0's metrics" in config_error(tmp_path, text)
    else:
        assert load_config(write(tmp_path, text)).worker_specs[1].metrics[1] == 9300


def test_repo_local_toml_loads():
    path = REPO / "configs" / "local.toml"
    cfg = load_config(path)
    assert cfg.workers == 2
    assert [w.local_size for w in cfg.worker_specs] == [2, 2]
    assert cfg.size == 4
    assert [s.id for s in cfg.servers] == [0, 1, 2]
    assert [s.worker for s in cfg.servers] == [0, 1, None]  # server 2 is CPU-only
    assert cfg.partition_bytes == 4 * 1024 * 1024
    assert [cfg.worker_of_rank(r) for r in range(4)] == [0, 0, 1, 1]


def test_parse_config_from_dict():
    cfg = parse_config({
        "cluster": {"workers": 1},
        "server": [{"id": 0, "address": "h:1"}],
        "worker": [{"id": 0, "local_size": 1, "socket": "s"}],
    })
    assert cfg.source == "<memory>"
    assert cfg == ClusterConfig(1, (ServerSpec(0, "h", 1, None),), (WorkerSpec(0, 1, "s"),))


# -- errors: each names the key and the file ---------------------------------------------------

def test_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="no such file") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read") as info:
        load_config(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_invalid_toml(tmp_path):
    assert "not valid TOML" in config_error(tmp_path, "[cluster\nworkers = 2\n")
    assert "not valid TOML" in config_error(tmp_path, CLUSTER + "workers = 3\n")  # duplicate key


def test_unknown_top_level_key(tmp_path):
    msg = config_error(tmp_path, CLUSTER + SERVERS + WORKERS + "\n[servers]\nx = 1\n")
    assert "unknown top-level key 'servers'" in msg


def test_missing_cluster_table(tmp_path):
    assert "missing required table [cluster]" in config_error(tmp_path, SERVERS + WORKERS)
    assert "[cluster]" in config_error(tmp_path, "cluster = 3\n" + SERVERS + WORKERS)


@pytest.mark.parametrize("where,extra", [
    ("cluster", "partitions = 4\n"),
    ("server[1]", None),
    ("worker[0]", None),
])
def test_unknown_keys(tmp_path, where, extra):
    if where == "cluster":
        text = CLUSTER + extra + SERVERS + WORKERS
        key = "cluster.partitions"
    elif where.startswith("server"):
        text = CLUSTER + SERVERS + "port = 9\n" + WORKERS
        key = "server[1].port"
    else:
        text = CLUSTER + SERVERS + WORKERS.replace('socket = "/tmp/w0.sock"', 'socket = "/tmp/w0.sock"\nrank = 0')
        key = "worker[0].rank"
    msg = config_error(tmp_path, text)
    assert f"unknown key {key}" in msg


def test_missing_cluster_workers(tmp_path):
    msg = config_error(tmp_path, "[cluster]\npartition_bytes = 1024\n" + SERVERS + WORKERS)
    assert "missing required key cluster.workers" in msg


@pytest.mark.parametrize("key", ["id", "address"])
def test_missing_server_keys(tmp_path, key):
    lines = [line for line in SERVERS.splitlines() if not line.startswith(f"{key} =")]
    msg = config_error(tmp_path, CLUSTER + "\n".join(lines) + WORKERS)
    assert f"missing required key server[0].{key}" in msg


@pytest.mark.parametrize("key", ["id", "local_size", "socket"])
def test_missing_worker_keys(tmp_path, key):
    lines = [line for line in WORKERS.splitlines() if not line.startswith(f"{key} =")]
    msg = config_error(tmp_path, CLUSTER + SERVERS + "\n".join(lines))
    assert f"missing required key worker[0].{key}" in msg


@pytest.mark.parametrize("old,new,key", [
    ("workers = 2", 'workers = "2"', "cluster.workers"),
    ("workers = 2", "workers = true", "cluster.workers"),
    ("workers = 2", "workers = 2.0", "cluster.workers"),
    ("workers = 2", "workers = 2\npartition_bytes = 1.5", "cluster.partition_bytes"),
    ("workers = 2", 'workers = 2\ntimeout = "30s"', "cluster.timeout"),
    ("workers = 2", "workers = 2\ntimeout = false", "cluster.timeout"),
    ("workers = 2", "workers = 2\nstall_timeout = true", "cluster.stall_timeout"),
    ("workers = 2", "workers = 2\ntoken_file = 5", "cluster.token_file"),
    ("workers = 2", "workers = 2\ncredit_bytes = [1]", "cluster.credit_bytes"),
    ("workers = 2", "workers = 2\nmax_payload_bytes = true", "cluster.max_payload_bytes"),
])
def test_wrong_cluster_types(tmp_path, old, new, key):
    msg = config_error(tmp_path, CLUSTER.replace(old, new) + SERVERS + WORKERS)
    assert f"{key} must be" in msg


@pytest.mark.parametrize("old,new,key", [
    ("id = 0", 'id = "0"', "server[0].id"),
    ('address = "127.0.0.1:9100"', "address = 9100", "server[0].address"),
    ("worker = 0", 'worker = "0"', "server[0].worker"),
    ("worker = 0", "worker = false", "server[0].worker"),
])
def test_wrong_server_types(tmp_path, old, new, key):
    msg = config_error(tmp_path, CLUSTER + SERVERS.replace(old, new, 1) + WORKERS)
    assert f"{key} must be" in msg


@pytest.mark.parametrize("old,new,key", [
    ("id = 0", "id = 0.0", "worker[0].id"),
    ("local_size = 2", 'local_size = "2"', "worker[0].local_size"),
    ("local_size = 2", "local_size = true", "worker[0].local_size"),
    ('socket = "/tmp/w0.sock"', "socket = 1", "worker[0].socket"),
])
def test_wrong_worker_types(tmp_path, old, new, key):
    msg = config_error(tmp_path, CLUSTER + SERVERS + WORKERS.replace(old, new, 1))
    assert f"{key} must be" in msg


@pytest.mark.parametrize("old,new,key", [
    ("workers = 2", "workers = 0", "cluster.workers"),
    ("workers = 2", "workers = 2\npartition_bytes = 0", "cluster.partition_bytes"),
    ("workers = 2", "workers = 2\ntimeout = 0", "cluster.timeout"),
    ("workers = 2", "workers = 2\ntimeout = -1.5", "cluster.timeout"),
    ("workers = 2", "workers = 2\ntimeout = nan", "cluster.timeout"),
    ("workers = 2", "workers = 2\ntimeout = 10\nstall_timeout = 5", "cluster.stall_timeout"),
    ("workers = 2", "workers = 2\nstall_timeout = -1", "cluster.stall_timeout"),
    ("workers = 2", "workers = 2\nstall_timeout = inf", "cluster.stall_timeout"),
    ("workers = 2", "workers = 2\ncredit_bytes = -5", "cluster.credit_bytes"),
    ("workers = 2", "workers = 2\nwindow_pieces = -1", "cluster.window_pieces"),
    ("workers = 2", "workers = 2\nmax_payload_bytes = 0", "cluster.max_payload_bytes"),
    ("workers = 2", "workers = 2\npartition_bytes = 2048\nmax_payload_bytes = 1024", "cluster.max_payload_bytes"),
    ("workers = 2", "workers = 2\npartition_bytes = 8\nmax_payload_bytes = 65535",  # (8 was taken: a review)
     "cluster.max_payload_bytes must be at least 65536"),
])
def test_out_of_range_cluster_values(tmp_path, old, new, key):
    msg = config_error(tmp_path, CLUSTER.replace(old, new) + SERVERS + WORKERS)
    assert key in msg


def test_bad_worker_values(tmp_path):
    assert "worker[0].local_size must be > 0" in config_error(
        tmp_path, CLUSTER + SERVERS + WORKERS.replace("local_size = 2", "local_size = 0"))
    assert "worker[0].id must be >= 0" in config_error(
        tmp_path, CLUSTER + SERVERS + WORKERS.replace("id = 0", "id = -1", 1))
    assert "worker[0].socket must be a path (not empty, no NUL character)" in config_error(
        tmp_path, CLUSTER + SERVERS + WORKERS.replace('"/tmp/w0.sock"', '""'))
    assert "duplicate worker socket '/tmp/w0.sock'" in config_error(
        tmp_path, CLUSTER + SERVERS + WORKERS.replace('"/tmp/w1.sock"', '"/tmp/w0.sock"'))


def test_negative_server_id(tmp_path):
    assert "server[0].id must be >= 0" in config_error(
        tmp_path, CLUSTER + SERVERS.replace("id = 0", "id = -1", 1) + WORKERS)


def test_duplicate_worker_id(tmp_path):
    msg = config_error(tmp_path, CLUSTER + SERVERS + WORKERS.replace("id = 1", "id = 0"))
    assert "duplicate worker id 0" in msg


def test_duplicate_server_id(tmp_path):
    msg = config_error(tmp_path, CLUSTER + SERVERS.replace("id = 1", "id = 0") + WORKERS)
    assert "duplicate server id 0" in msg


def test_duplicate_server_address(tmp_path):
    msg = config_error(tmp_path, CLUSTER + SERVERS.replace("9101", "9100") + WORKERS)
    assert "duplicate server address" in msg and "9100" in msg


def test_server_worker_names_no_worker(tmp_path):
    msg = config_error(tmp_path, CLUSTER + SERVERS.replace("worker = 1", "worker = 5") + WORKERS)
    assert "server[1].worker = 5 names no [[worker]] id" in msg


@pytest.mark.parametrize("workers,ids", [(2, [0, 2]), (2, [1, 2]), (3, [0, 1])])
def test_worker_ids_must_be_0_to_n_minus_1(tmp_path, workers, ids):
    text = CLUSTER.replace("workers = 2", f"workers = {workers}") + "\n".join(
        f'[[server]]\nid = {i}\naddress = "h:{9000 + i}"\n' for i in range(2))
    text += "\n".join(f'[[worker]]\nid = {i}\nlocal_size = 1\nsocket = "/s{i}"\n' for i in ids)
    msg = config_error(tmp_path, text)
    assert f"cluster.workers = {workers} needs [[worker]] tables with ids 0..{workers - 1}" in msg
    assert str(sorted(ids)) in msg


def test_no_workers_at_all(tmp_path):
    assert "cluster.workers = 2 needs [[worker]]" in config_error(tmp_path, CLUSTER + SERVERS)


def test_no_servers(tmp_path):
    assert "at least one [[server]] table is required" in config_error(tmp_path, CLUSTER + WORKERS)


def test_server_not_an_array_of_tables(tmp_path):
    msg = config_error(tmp_path, CLUSTER + WORKERS + '\n[server]\nid = 0\naddress = "h:1"\n')
    assert "server must be an array of tables" in msg
    msg = config_error(tmp_path, "server = [1, 2]\n" + CLUSTER + WORKERS)
    assert "server[0] must be a table" in msg


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.0.0.1:", ":9100", "host:port", "host:-1", "host:9.5", "host:+80", "", "host: 80",
])
def test_bad_address_format(tmp_path, address):
    msg = config_error(tmp_path, CLUSTER + SERVERS.replace("127.0.0.1:9100", address) + WORKERS)
    assert "server[0].address must be HOST:PORT" in msg
    assert repr(address) in msg


@pytest.mark.parametrize("address", ["host:1\u00b2", "host:\u0663\u0660"])
def test_non_ascii_digit_ports_are_config_errors(tmp_path, address):
    """str.isdigit() accepts superscripts and other scripts' digits; they must not crash or pass."""
    msg = config_error(tmp_path, CLUSTER + SERVERS.replace("127.0.0.1:9100", address) + WORKERS)
    assert "server[0].address" in msg


@pytest.mark.parametrize("port", [65536, 70000, 99999999])
def test_port_out_of_range(tmp_path, port):
    msg = config_error(tmp_path, CLUSTER + SERVERS.replace("9101", str(port)) + WORKERS)
    assert f"server[1].address has port {port} outside 1..65535" in msg


def test_port_65535_is_fine(tmp_path):
    cfg = load_config(write(tmp_path, CLUSTER + SERVERS.replace("9101", "65535") + WORKERS))
    assert cfg.server(1).port == 65535


def test_ipv6_addresses(tmp_path):
    cfg = load_config(write(tmp_path, CLUSTER + SERVERS.replace("127.0.0.1:9100", "[fe80::1]:80") + WORKERS))
    assert (cfg.server(0).host, cfg.server(0).port) == ("fe80::1", 80)
    assert cfg.server(0).address == "[fe80::1]:80"


@pytest.mark.parametrize("address,reason", [
    ("a:b:c:9000", "with an IPv6 host in brackets"),
    ("::1:9000", "with an IPv6 host in brackets"),
    ("[a:b:c]:9000", "not an IPv6 address"),
    ("[cpu-box]:9000", "not an IPv6 address"),
    ("999.1.1.1:9000", "neither a DNS name nor an IP address"),
    ("bad host:9000", "neither a DNS name nor an IP address"),
    ("-box:9000", "neither a DNS name nor an IP address"),
    ("box..example:9000", "neither a DNS name nor an IP address"),
    ("b\u00f6x:9000", "neither a DNS name nor an IP address"),
    (("x" * 254) + ":9000", "neither a DNS name nor an IP address"),
])
def test_bad_hosts(tmp_path, address, reason):
    """These used to pass and fail only at connect time ("Unknown error -2")."""
    msg = config_error(tmp_path, CLUSTER + SERVERS.replace("127.0.0.1:9100", address) + WORKERS)
    assert "server[0].address" in msg and reason in msg and repr(address) in msg


@pytest.mark.parametrize("address,host", [
    ("localhost:1", "localhost"), ("cpu_box-2.example.org.:9000", "cpu_box-2.example.org."),
    ("192.168.0.10:9000", "192.168.0.10"), ("[::ffff:10.0.0.1]:9000", "::ffff:10.0.0.1"),
    ("10gbe-node:9000", "10gbe-node"),
])
def test_good_hosts(tmp_path, address, host):
    cfg = load_config(write(tmp_path, CLUSTER + SERVERS.replace("127.0.0.1:9100", address) + WORKERS))
    assert cfg.server(0).host == host


# -- timeout bounds --------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0.001", "0.49", "inf", "-inf", "86401", "1e300"])
def test_timeout_out_of_bounds(tmp_path, value):
    """0.001 made both idle daemons spin (they check every timeout / 4); inf never reports a dead peer."""
    msg = config_error(tmp_path, CLUSTER + f"timeout = {value}\n" + SERVERS + WORKERS)
    assert f"cluster.timeout must be between {MIN_TIMEOUT_S:g} and {MAX_TIMEOUT_S:g} seconds" in msg


@pytest.mark.parametrize("value,expected", [("0.5", 0.5), ("86400", 86400.0), ("3", 3.0)])
def test_timeout_bounds_are_inclusive(tmp_path, value, expected):
    cfg = load_config(write(tmp_path, CLUSTER + f"timeout = {value}\n" + SERVERS + WORKERS))
    assert cfg.timeout == expected and MIN_TIMEOUT_S == 0.5 and MAX_TIMEOUT_S == 86400.0


# -- the placement digest --------------------------------------------------------------------------

LAYOUT = CLUSTER + """
partition_bytes = 1048576
timeout = 4.0

[[server]]
id = 0
address = "10.0.0.1:9000"
worker = 0

[[server]]
id = 1
address = "10.0.0.2:9000"
worker = 1

[[server]]
id = 2
address = "10.0.0.3:9000"

[[server]]
id = 3
address = "10.0.0.4:9000"
""" + WORKERS


def layout(tmp_path, text: str = LAYOUT, name: str = "a.toml") -> ClusterConfig:
    return load_config(write(tmp_path, text, name))


def test_placement_items_describe_what_decides_placement(tmp_path):
    assert placement_items(layout(tmp_path)) == (
        "workers=2", "partition_bytes=1048576",
        "worker.0.local_size=2", "worker.1.local_size=3",
        "server.0.address=10.0.0.1:9000", "server.0.worker=0",
        "server.1.address=10.0.0.2:9000", "server.1.worker=1",
        "server.2.address=10.0.0.3:9000", "server.2.worker=none",
        "server.3.address=10.0.0.4:9000", "server.3.worker=none",
    )


def test_same_config_same_digest_whatever_the_order_and_the_local_keys(tmp_path):
    a = layout(tmp_path)
    # Tables in another order, and keys that only tune one machine changed: the same placement.
    reordered = CLUSTER + "partition_bytes = 1048576\ntimeout = 9.0\ncredit_bytes = 1024\nwindow_pieces = 0\n" \
        + LAYOUT[LAYOUT.index("[[server]]\nid = 2"):LAYOUT.index("[[worker]]")] \
        + LAYOUT[LAYOUT.index("[[server]]\nid = 0"):LAYOUT.index("[[server]]\nid = 2")] \
        + WORKERS.replace("/tmp/w0.sock", "/run/other.sock")
    b = layout(tmp_path, reordered, "b.toml")
    assert placement_items(a) == placement_items(b)
    digest = placement_digest(placement_items(a))
    assert digest == placement_digest(placement_items(b)) and len(digest) == 16
    assert int(digest, 16) >= 0
    assert placement_differences(placement_items(a), placement_items(b)) == []


def test_swapped_addresses_give_another_digest_and_name_what_differs(tmp_path):
    """Issue 14 item 7: two CPU-only servers' addresses swapped on one machine."""
    ours = placement_items(layout(tmp_path))
    swapped = LAYOUT.replace("10.0.0.3:9000", "TMP").replace("10.0.0.4:9000", "10.0.0.3:9000") \
        .replace("TMP", "10.0.0.4:9000")
    theirs = placement_items(layout(tmp_path, swapped, "b.toml"))
    assert placement_digest(ours) != placement_digest(theirs)
    assert placement_differences(ours, theirs, here="at server 2", there="at worker 1") == [
        "server.2.address is 10.0.0.3:9000 at server 2, 10.0.0.4:9000 at worker 1",
        "server.3.address is 10.0.0.4:9000 at server 2, 10.0.0.3:9000 at worker 1",
    ]


@pytest.mark.parametrize("old,new,difference", [
    ("partition_bytes = 1048576", "partition_bytes = 2097152", "partition_bytes is 1048576 here, 2097152 there"),
    ("local_size = 3", "local_size = 4", "worker.1.local_size is 3 here, 4 there"),
    ("worker = 1\n", "\n", "server.1.worker is 1 here, none there"),
    ('address = "10.0.0.2:9000"', 'address = "10.0.0.2:9001"',
     "server.1.address is 10.0.0.2:9000 here, 10.0.0.2:9001 there"),
])
def test_each_placement_entry_counts(tmp_path, old, new, difference):
    ours = placement_items(layout(tmp_path))
    theirs = placement_items(layout(tmp_path, LAYOUT.replace(old, new, 1), "b.toml"))
    assert placement_digest(ours) != placement_digest(theirs)
    assert placement_differences(ours, theirs) == [difference]


def test_the_link_rate_sizes_pieces_so_it_counts_where_given(tmp_path):
    ours = placement_items(layout(tmp_path))
    rated = LAYOUT.replace("partition_bytes = 1048576", 'partition_bytes = 1048576\nlink_rate = "25gbit"', 1)
    assert rated != LAYOUT
    theirs = placement_items(layout(tmp_path, rated, "b.toml"))
    assert placement_differences(ours, theirs) == ["link_bits_per_s is absent here, 25000000000 there"]


@pytest.mark.parametrize("value,bits", [("25gbit", 25 * 10**9), ("800mbit", 8 * 10**8), ("2.5Gbit", 25 * 10**8),
                                        ("100 kbit", 10**5), ("7bit", 7), (10_000_000_000, 10**10), (0, 0)])
def test_link_rate_in_bits_per_second_or_with_tcs_units(tmp_path, value, bits):
    text = CLUSTER + f"link_rate = {value!r}\n".replace("'", '"') + SERVERS + WORKERS
    assert layout(tmp_path, text).link_bits_per_s == bits
    assert layout(tmp_path).link_bits_per_s == 0  # not given


@pytest.mark.parametrize("value,message", [
    ('"10gbps"', "cluster.link_rate must be bits per second"), ('"fast"', "got 'fast'"), ("-5", "must be >= 0"),
    ("1.5", "cluster.link_rate must be int or str"), ('"gbit"', "e.g. \"25gbit\""),
])
def test_a_bad_link_rate_is_refused_naming_it(tmp_path, value, message):
    with pytest.raises(ConfigError, match="a.toml") as info:
        layout(tmp_path, CLUSTER + f"link_rate = {value}\n" + SERVERS + WORKERS)
    assert message in str(info.value)


def test_an_extra_server_is_named(tmp_path):
    ours = placement_items(layout(tmp_path))
    theirs = placement_items(layout(tmp_path, LAYOUT + '\n[[server]]\nid = 4\naddress = "10.0.0.5:9000"\n', "b.toml"))
    assert placement_differences(ours, theirs) == ["server.4.address is absent here, 10.0.0.5:9000 there",
                                                   "server.4.worker is absent here, none there"]
    assert placement_differences(theirs, ours)[0] == "server.4.address is 10.0.0.5:9000 here, absent there"


# -- the token file (issue 14, item 2): refused when others could read or change it -------------------

def _token_config(tmp_path: Path, mode: int, *, group_readable: bool = False, text: str = "s" * 32) -> ClusterConfig:
    token = tmp_path / "token"
    token.write_text(text)
    token.chmod(mode)
    extra = "\ntoken_group_readable = true" if group_readable else ""
    return load_config(write(tmp_path, CLUSTER + f'token_file = "{token}"{extra}\n' + SERVERS + WORKERS))


def test_a_private_token_is_read(tmp_path):
    from protocol.config import read_token

    assert read_token(_token_config(tmp_path, 0o600, text="  " + "s" * 32 + "\n")) == b"s" * 32
    assert read_token(_token_config(tmp_path, 0o400)) == b"s" * 32


@pytest.mark.parametrize("mode,who", [(0o644, "others"), (0o604, "others"), (0o640, "its group"),
                                      (0o620, "its group"), (0o606, "others")])
def test_a_token_open_to_group_or_others_is_refused_naming_file_mode_and_fix(tmp_path, mode, who):
    from protocol.config import read_token

    config = _token_config(tmp_path, mode)
    with pytest.raises(ConfigError) as info:
        read_token(config)
    message = str(info.value)
    assert str(tmp_path / "token") in message and str(tmp_path / "cluster.toml") in message
    assert f"open to {who} (mode {mode:03o})" in message and "chmod 600" in message


def test_token_group_readable_allows_group_read_only(tmp_path):
    from protocol.config import read_token

    assert read_token(_token_config(tmp_path, 0o640, group_readable=True)) == b"s" * 32
    for mode in (0o660, 0o644):
        with pytest.raises(ConfigError, match=f"mode {mode:03o}.*chmod 640"):
            read_token(_token_config(tmp_path, mode, group_readable=True))
    # The command in backquotes runs as written (a review: it held the setting's name in parentheses).
    with pytest.raises(ConfigError, match=re.escape("run `chmod 640` on it (cluster.token_group_readable = true")):
        read_token(_token_config(tmp_path, 0o660, group_readable=True))


def test_token_file_problem_decisions():
    import stat

    from protocol.config import token_file_problem

    reg = stat.S_IFREG
    assert token_file_problem(reg | 0o600, 1000, uid=1000) is None
    assert token_file_problem(reg | 0o600, 0, uid=1000) is None  # root's: root could read it anyway
    assert "owned by uid 1001, not by this user (uid 1000)" in token_file_problem(reg | 0o600, 1001, uid=1000)
    assert token_file_problem(stat.S_IFDIR | 0o700, 1000, uid=1000) == "is not a regular file"
    assert token_file_problem(stat.S_IFIFO | 0o600, 1000, uid=1000) == "is not a regular file"
    assert token_file_problem(reg | 0o640, 1000, uid=1000, group_readable=True) is None
    assert "open to its group" in token_file_problem(reg | 0o650, 1000, uid=1000, group_readable=True)


def test_a_token_owned_by_another_user_is_refused(tmp_path):
    import os

    from protocol.config import read_token

    config = _token_config(tmp_path, 0o600)
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file away")
    os.chown(tmp_path / "token", 65534, 65534)
    with pytest.raises(ConfigError, match=r"token'? is owned by uid 65534, not by this user \(uid 0\) or root"):
        read_token(config)


def test_a_missing_token_says_how_to_make_one(tmp_path):
    from protocol.config import read_token

    config = load_config(write(tmp_path, CLUSTER + f'token_file = "{tmp_path}/nothing"\n' + SERVERS + WORKERS))
    with pytest.raises(ConfigError, match="cannot be read: No such file or directory.*bps-launch --make-token"):
        read_token(config)


def test_token_path_expands_home(tmp_path, monkeypatch):
    from protocol.config import token_path

    monkeypatch.setenv("HOME", str(tmp_path))
    assert token_path(load_config(write(tmp_path, CLUSTER + 'token_file = "~/.config/bps/token"\n' + SERVERS
                                        + WORKERS))) == f"{tmp_path}/.config/bps/token"
    assert token_path(load_config(write(tmp_path, CLUSTER + SERVERS + WORKERS))) is None


def test_repo_local_toml_names_a_private_token():
    cfg = load_config(REPO / "configs" / "local.toml")
    assert cfg.token_file == "~/.config/bps/token" and not cfg.token_group_readable


# -- values that parsed but broke the daemons (a review of cluster files, session 31) -------------------------

@pytest.mark.parametrize("line,message", [
    ("credit_bytes = 2147483648", "cluster.credit_bytes must be at most 2147483647 (the event loop's write-buffer "
                                  "limit), got 2147483648"),
    (f'link_rate = "{"9" * 320}.0gbit"', "cluster.link_rate is too large"),
])
def test_values_the_daemons_cannot_run_with_are_refused_naming_the_key(tmp_path, line, message):
    """Each used to load: the credit made every server refuse every worker (an OverflowError a connection), and
    the rate raised an OverflowError (a traceback)."""
    with pytest.raises(ConfigError, match="a.toml") as info:
        layout(tmp_path, CLUSTER + line + "\n" + SERVERS + WORKERS)
    assert message in str(info.value)
    for fine in ("credit_bytes = 2147483647", "link_rate = \"400gbit\""):
        layout(tmp_path, CLUSTER + fine + "\n" + SERVERS + WORKERS)


def test_a_socket_path_with_a_nul_is_refused_naming_the_worker(tmp_path):
    with pytest.raises(ConfigError, match=r"worker\[0\]\.socket must be a path \(not empty, no NUL character\)"):
        layout(tmp_path, CLUSTER + SERVERS + WORKERS.replace('"/tmp/w0.sock"', '"/tmp/a\\u0000b.sock"'))


def test_a_token_file_that_is_a_directory_is_one_line(tmp_path):
    """open() of a directory's descriptor raised IsADirectoryError: a traceback from every daemon."""
    from protocol.config import read_token

    (tmp_path / "tokens").mkdir(mode=0o700)
    config = load_config(write(tmp_path, CLUSTER + f'token_file = "{tmp_path}/tokens"\n' + SERVERS + WORKERS))
    with pytest.raises(ConfigError, match="tokens' is not a regular file"):
        read_token(config)


# -- limits the daemons cannot run under (a review of limits, session 32) ------------------------------------

@pytest.mark.parametrize("arena", [1, 2 << 20, (4 << 20) - 1])
def test_an_arena_below_one_slab_is_refused_naming_the_least_value(tmp_path, arena):
    """Small tensors are carved from 4 MiB slabs in every arena: a smaller cap loaded, and then every small
    tensor failed at run time."""
    message = config_error(tmp_path, CLUSTER + f"arena_bytes = {arena}\n" + SERVERS + WORKERS)
    assert f"cluster.arena_bytes must be at least 4194304 (4 MiB: the slabs small tensors share), got {arena}" \
        in message
    for fine, cap in ((4 << 20, 4 << 20), (0, 0), (5 << 30, 5 << 30)):
        assert layout(tmp_path, CLUSTER + f"arena_bytes = {fine}\n" + SERVERS + WORKERS).arena_bytes == cap


def test_a_socket_path_too_long_for_a_unix_socket_is_refused_naming_the_worker_the_length_and_the_limit(tmp_path):
    """A Unix socket's path holds at most 107 bytes: a longer one loaded, and the worker daemon failed at bind
    with "AF_UNIX path too long" (exit status 1), naming neither the key nor the limit."""
    fits = "/tmp/" + "s" * 97 + ".sock"  # 107 bytes
    long = "/tmp/" + "é" * 49 + ".sock"  # 108 bytes in UTF-8 (59 characters)
    assert layout(tmp_path, CLUSTER + SERVERS + WORKERS.replace("/tmp/w1.sock", fits)).worker(1).socket == fits
    with pytest.raises(ConfigError) as info:
        layout(tmp_path, CLUSTER + SERVERS + WORKERS.replace("/tmp/w1.sock", long))
    assert str(info.value) == (f"{tmp_path}/a.toml: worker[1].socket (the [[worker]] with id = 1) is 108 bytes "
                               "long; a Unix socket's path may have at most 107 bytes")


def test_the_payload_limit_caps_pieces_so_it_counts_where_given(tmp_path):
    """A worker whose file allowed larger frames than its server's cut pieces the server refused: the server
    dropped it at every push, and it pushed the piece again on its next connection, for ever. Given, the limit
    is part of the placement (refused at the handshake, naming it); the default leaves the digests as they were."""
    ours = placement_items(layout(tmp_path))
    limited = LAYOUT.replace("partition_bytes = 1048576", "partition_bytes = 1048576\nmax_payload_bytes = 2097152", 1)
    theirs = placement_items(layout(tmp_path, limited, "b.toml"))
    assert placement_differences(ours, theirs) == ["max_payload_bytes is absent here, 2097152 there"]
