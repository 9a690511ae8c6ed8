"""Bad peers and dying processes: each is dropped and logged, the daemons keep serving, nothing leaks."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

import rank_programs as rp
from handshakes import hello_frame, read_message
from harness import daemon_logs, run_ranks, server_stats, shm_segments, start_cluster, wait_linked, write_config
from protocol import PROTOCOL_VERSION
from protocol.frames import PREFIX, FrameReader, encode_header
from protocol.handshake import ClientHandshake
from protocol.messages import (ROLE_CLIENT, ROLE_WORKER, Alloc, Allocated, Done, Failure, Hello, Leave, Op, Ping, Welcome,
                               parse, to_header)

CASES = [("ok.f32", "float32", (70_001,), True, 3), ("ok.bf16", "bfloat16", (5,), False, 4)]


def _frame(message) -> bytes:
    return encode_header(to_header(message))


def _exchange(sock: socket.socket, data: bytes, timeout: float = 5.0) -> tuple[list, bool]:
    """Send ``data``; read until the peer closes or ``timeout``; return (messages, closed)."""
    sock.settimeout(timeout)
    try:
        sock.sendall(data)
    except OSError:
        pass
    reader = FrameReader()
    messages, closed = [], False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            messages += [parse(f.header) for f in reader.receive_data(chunk)]
    except (socket.timeout, ConnectionResetError):
        closed = closed or False
    except OSError:
        closed = True
    return messages, closed


def _assert_dropped(messages: list, closed: bool, text: str) -> None:
    assert closed, "the daemon kept a bad connection open"
    failures = [m for m in messages if isinstance(m, Failure)]
    assert failures and text in failures[-1].message, messages


def _sums_still_exact(cluster) -> None:
    for reports in zip(*run_ranks(cluster, rp.sum_cases, CASES)):
        assert all(r["exact"] for r in reports)
        assert len({r["digest"] for r in reports}) == 1


@pytest.fixture
def cluster(tmp_path: Path):
    c = start_cluster(write_config(tmp_path, [2, 2], cpu_servers=1,
                                   cluster={"partition_bytes": 65536, "timeout": 4.0, "max_payload_bytes": 1 << 22}))
    workers = [ch for ch in c.children if ch.label.startswith("worker")]
    pids = {str(ch.proc.pid) for ch in workers}
    try:
        yield c
        deadline = time.monotonic() + 5
        while shm_segments(c) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shm_segments(c) == set(), "segments outlived the processes that used them"
    finally:
        c.stop()
    leaked = {n for n in shm_segments() if n.split("_")[2] in pids}
    assert leaked == set(), f"shared-memory segments leaked: {leaked}"


@pytest.mark.parametrize("holder_silent", [False, True], ids=["holder-heard", "holder-silent"])
def test_server_drops_bad_frames_and_keeps_serving(cluster, holder_silent):
    """holder-silent: worker 1's daemon is stopped for more than half the timeout first (as a loaded box can
    delay it), so that our hello takes worker 1's id over at once, and its reconnect meets our connection."""
    spec = cluster.config.servers[2]

    def connect() -> socket.socket:
        return socket.create_connection((spec.host, spec.port), timeout=5)

    with connect() as s:  # random garbage
        messages, closed = _exchange(s, os.urandom(4096))
        assert closed
    with connect() as s:  # a header longer than the limit: refused from the prefix alone
        _assert_dropped(*_exchange(s, PREFIX.pack(10_000_000, 0)), "exceeds the limit")
    with connect() as s:  # a payload longer than max_payload_bytes
        _assert_dropped(*_exchange(s, PREFIX.pack(10, 1 << 40)), "exceeds the limit")
    with connect() as s:  # wrong protocol version
        _assert_dropped(*_exchange(s, _frame(Hello(PROTOCOL_VERSION + 41, ROLE_WORKER, 0))), "version")
    with connect() as s:  # no handshake
        _assert_dropped(*_exchange(s, _frame(Alloc(1, "x", 4))), "expected hello")
    with connect() as s:  # a worker id the cluster does not have (proved with the token, where there is one)
        _assert_dropped(*_exchange(s, hello_frame(s, cluster.config, 7)), "only workers")
    with connect() as s:  # not msgpack at all after a valid prefix
        _assert_dropped(*_exchange(s, PREFIX.pack(4, 0) + b"\xc1\xc1\xc1\xc1"), "undecodable")
    # A valid hello as worker 1, then a push cut off in the middle of its payload. Worker 1's daemon holds its
    # id (it connects at start): a hello from another daemon is refused, naming the holder (unless the holder
    # was not heard lately: then it is taken over); a hello in the holder's name is its reconnect, and takes the
    # id over (the daemon reconnects at once, as after a blip).
    wait_linked(cluster, 2)  # (else our hello could take worker 1's id before its daemon ever connected)
    reconnects = _connections_to(cluster, worker=1, server=2)
    if holder_silent:
        cluster.kill("worker-1", signal.SIGSTOP)
        time.sleep(4.0 * 0.5 + 0.5)  # (the fixture's timeout, 4 s: the holder counts as silent after half)
    s = connect()
    try:
        s.sendall(hello_frame(s, cluster.config, 1))
        answer = read_message(s)
        if isinstance(answer, Failure):
            assert answer.code == "duplicate", answer
            holder = re.search(r"daemon (\w+), epoch (\w+)", answer.peer)
            assert holder is not None, answer.peer
            s.close()
            s = connect()
            s.sendall(hello_frame(s, cluster.config, 1, daemon=holder[1], epoch=holder[2]))
            answer = read_message(s)
        assert isinstance(answer, Welcome), answer
        if holder_silent:
            cluster.kill("worker-1", signal.SIGCONT)
        head = encode_header({"t": "push", "req": 1, "name": "cut", "part": 0, "round": 0, "worker": 1,
                              "dtype": "float32", "shape": [1 << 18], "offset": 0, "count": 1 << 18}, 1 << 20)
        try:
            s.sendall(head + b"\0" * (1 << 19))
        except OSError:
            pass  # the daemon's own reconnect took the id back first: this connection was closed under us
    finally:
        s.close()
    # Worker 1's daemon connects to server 2 again: at once, or (where its link was silent for half the
    # timeout on a loaded box, so our first hello took the id over and its reconnect met our live connection,
    # refused as a second daemon) one timeout later. Its ranks would meet that refusal otherwise.
    deadline = time.monotonic() + 30
    while _connections_to(cluster, worker=1, server=2) <= reconnects and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _connections_to(cluster, worker=1, server=2) > reconnects, daemon_logs(cluster)
    _sums_still_exact(cluster)
    log = daemon_logs(cluster)
    assert "dropping" in log and "version" in log


def _connections_to(cluster, worker: int, server: int) -> int:
    """How many times worker ``worker``'s daemon has connected to server ``server`` (its log)."""
    text = Path(cluster.log_dir, f"worker-{worker}.log").read_text(errors="replace")
    return text.count(f"connected to server {server} at ")


def test_worker_drops_bad_clients_and_keeps_serving(cluster):
    path = cluster.config.worker_specs[0].socket

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s

    with connect() as s:
        messages, closed = _exchange(s, os.urandom(4096))
        assert closed
    with connect() as s:
        _assert_dropped(*_exchange(s, PREFIX.pack(1_000_000, 0)), "exceeds the limit")
    with connect() as s:  # clients never send payloads
        _assert_dropped(*_exchange(s, PREFIX.pack(8, 16)), "exceeds the limit")
    with connect() as s:
        _assert_dropped(*_exchange(s, _frame(Hello(PROTOCOL_VERSION - 1, ROLE_CLIENT, 0))), "version")
    with connect() as s:
        _assert_dropped(*_exchange(s, _frame(Hello(PROTOCOL_VERSION, ROLE_CLIENT, 5))), "outside")
    with connect() as a, connect() as b:  # one local rank, two processes
        messages, _ = _exchange(a, _frame(Hello(PROTOCOL_VERSION, ROLE_CLIENT, 0)), timeout=1.0)
        assert isinstance(messages[0], Welcome)
        _assert_dropped(*_exchange(b, _frame(Hello(PROTOCOL_VERSION, ROLE_CLIENT, 0, pid=4242))), "already connected")
        # (the log said "dropping client local rank None (pid 0)": not who was refused, a review)
        assert "dropping client a process (pid 4242) asking for local rank 0: local rank 0 is already connected" \
            in Path(cluster.log_dir, "worker-0.log").read_text(errors="replace")
        messages, _ = _exchange(a, _frame(Leave(7)), timeout=1.0)  # (shutdown(): answered once it took effect)
        answers = [m for m in messages if not isinstance(m, Ping)]
        assert len(answers) == 1 and isinstance(answers[0], Done) and answers[0].req == 7, messages
        _assert_dropped(*_exchange(a, _frame(Alloc(8, "t", 64))), "alloc message from a client after its Leave")
    segments_before = shm_segments(cluster)
    with connect() as s:  # a client that allocates, then disconnects in the middle of an op frame
        messages, _ = _exchange(s, _frame(Hello(PROTOCOL_VERSION, ROLE_CLIENT, 1)) + _frame(Alloc(1, "t", 1 << 20)),
                                timeout=1.0)
        allocated = [m for m in messages if isinstance(m, Allocated)]
        assert allocated and allocated[0].segment in shm_segments()
        op = _frame(Op(2, "t", "sum", "float32", [1 << 18], allocated[0].segment))
        s.sendall(op[: len(op) // 2])
    deadline = time.monotonic() + 5
    while allocated[0].segment in shm_segments() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert allocated[0].segment not in shm_segments(), "the worker did not unlink a dropped client's segment"
    assert shm_segments(cluster) - segments_before == set()
    _sums_still_exact(cluster)


def test_killed_client_fails_its_peers_fast_and_is_cleaned_up(cluster):
    victim = 3
    results = run_ranks(cluster, rp.die_before_push, victim, may_die=frozenset({victim}), timeout=60)
    for rank, r in enumerate(results):
        if rank == victim:
            assert r is None
            continue
        assert r["error"] is not None, f"rank {rank} did not get an error"
        # the abort naming rank 3, or (if its machine's last process left first) the reset naming its worker
        assert "rank 3" in r["error"] or "aborted" in r["error"] or "worker 1 has no training processes" in \
            r["error"], r["error"]
        assert r["elapsed"] < 10.0
    # A new process may take the dead one's place; the cluster works as before.
    _sums_still_exact(cluster)


def test_token_cluster_works_and_refuses_strangers(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("a-long-enough-cluster-secret\n")
    token_file.chmod(0o600)
    c = start_cluster(write_config(tmp_path / "c", [1, 1], cpu_servers=1, cluster={"token_file": str(token_file)}))
    try:
        spec = c.config.servers[2]
        with socket.create_connection((spec.host, spec.port), timeout=5) as s:
            _assert_dropped(*_exchange(s, _frame(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, auth="00" * 32))),
                            "authentication failed")
        with socket.create_connection((spec.host, spec.port), timeout=5) as s:  # a payload before the hello
            _assert_dropped(*_exchange(s, PREFIX.pack(20, 1 << 20)), "exceeds the limit of 0 bytes")
        with socket.create_connection((spec.host, spec.port), timeout=5) as s:  # another token's proof
            messages, _ = _exchange(s, b"", timeout=1.0)
            stranger = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0), token=b"not-the-cluster-token")
            _assert_dropped(*_exchange(s, _frame(stranger.receive(messages[0]))), "authentication failed")
        _sums_still_exact(c)
        # an observer with the token gets in, and believes the counters only once the server proved it too
        assert set(server_stats(c)) == {s.id for s in c.config.servers}
        assert "authentication failed" in daemon_logs(c)
    finally:
        c.stop()


def test_short_token_is_a_config_error(tmp_path):
    import subprocess
    import sys

    token_file = tmp_path / "token"
    token_file.write_text("short")
    config = write_config(tmp_path, [1], cpu_servers=0, cluster={"token_file": str(token_file)})
    result = subprocess.run([sys.executable, "-m", "bps_server", "--config", str(config), "--id", "0"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "token_file" in result.stderr and "at least 16" in result.stderr
