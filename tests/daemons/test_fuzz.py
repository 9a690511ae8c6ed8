"""Seeded fuzzing of the live daemons' sockets: random and mutated frames never take a daemon down."""

from __future__ import annotations

import os
import random
import socket
import time
from typing import Callable

import msgpack

import rank_programs as rp
from handshakes import hello_frame
from harness import run_ranks, start_cluster, wait_linked, write_config
from protocol import PROTOCOL_VERSION
from protocol.frames import PREFIX, encode_header
from protocol.messages import ROLE_CLIENT, ROLE_WORKER, Alloc, Hello, Op, Push, to_header

# Each frame costs a connection (so that the daemon really parses it): 6,000 here; set
# BPS_FUZZ_FRAMES=100000 for the full run recorded in benchmarks/RESULTS.md.
FRAMES = int(os.environ.get("BPS_FUZZ_FRAMES", "6000"))


def _valid_frames(role: str) -> list[bytes]:
    push = Push(req=1, name="f", part=0, round=0, worker=0, dtype="float32", shape=[4], offset=0, count=4)
    if role == ROLE_WORKER:
        return [encode_header(to_header(push), 16) + b"\0" * 16,
                encode_header({"t": "abort", "name": "f", "part": 0, "round": 0, "worker": 0, "message": "x"}),
                encode_header({"t": "ping", "seq": 3}), encode_header({"t": "stats_request", "req": 2})]
    return [encode_header(to_header(Alloc(1, "f", 64))),
            encode_header(to_header(Op(2, "f", "sum", "float32", [4], "bps_nonexistent")))]


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame)
    choice = rng.randrange(6)
    if choice == 0 and data:  # flip bytes
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif choice == 1:  # truncate
        data = data[: rng.randrange(len(data) + 1)]
    elif choice == 2:  # random header map
        body = msgpack.packb({rng.choice(["t", "req", "name", "shape", "x"]): rng.choice(
            [None, 1, -1, 2**40, "push", "op", "hello", [1, -2], {"a": 1}, b"\xff", 1.5, True]) for _ in range(4)})
        data = bytearray(PREFIX.pack(len(body), 0) + body)
    elif choice == 3:  # random bytes
        data = bytearray(os.urandom(rng.randrange(1, 200)))
    elif choice == 4:  # lie about the payload length
        data = bytearray(PREFIX.pack(len(frame), rng.randrange(0, 1 << 20))) + data[PREFIX.size:]
    return bytes(data)


def _blast(connect, role: str, hello: Callable[[socket.socket], bytes], frames: int, seed: int) -> int:
    """``frames`` connections, each a valid hello (``hello(sock)``: a server's is this connection's answer to
    its challenge, with the token's proof where the cluster has one) then one fuzzed frame; each is read to
    the daemon's close, so every frame was really parsed (a daemon drops the rest of a stream after a bad
    frame)."""
    rng = random.Random(seed)
    valid = _valid_frames(role)
    for _ in range(frames):
        with connect() as s:
            s.settimeout(5)
            try:
                s.sendall(hello(s) + _mutate(rng, rng.choice(valid)))
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
            except OSError:
                pass  # reset by the daemon: it dropped us, as it should
    return frames


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


def test_fuzzed_frames_never_take_a_daemon_down(tmp_path):
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"max_payload_bytes": 1 << 22}))
    try:
        server = cluster.config.servers[2]
        worker = cluster.config.worker_specs[1]
        daemons = {c.label: c.proc for c in cluster.children}
        wait_linked(cluster, 2)  # (a fuzzed hello must not take worker 1's id before its daemon connected)

        def worker_hello(s: socket.socket) -> bytes:
            return hello_frame(s, cluster.config, 1)

        _blast(lambda: socket.create_connection((server.host, server.port)), ROLE_WORKER, worker_hello, 500,
               seed=0)  # warm up
        rss_before = {label: _rss_kib(p.pid) for label, p in daemons.items()}
        start = time.monotonic()
        half = FRAMES // 2
        sent = _blast(lambda: socket.create_connection((server.host, server.port)), ROLE_WORKER, worker_hello,
                      half, seed=1)

        def unix() -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(worker.socket)
            return s

        client_hello = encode_header(to_header(Hello(PROTOCOL_VERSION, ROLE_CLIENT, 0)))
        sent += _blast(unix, ROLE_CLIENT, lambda s: client_hello, FRAMES - half, seed=2)
        assert sent >= FRAMES
        assert all(p.poll() is None for p in daemons.values()), "a daemon died"
        time.sleep(0.5)
        for label, p in daemons.items():  # memory stays flat (allowing allocator noise)
            assert _rss_kib(p.pid) < rss_before[label] * 1.2 + 8192, (label, rss_before[label], _rss_kib(p.pid))
        for reports in zip(*run_ranks(cluster, rp.sum_cases, [("after.fuzz", "float32", (1000,), True, 1)])):
            assert all(r["exact"] for r in reports)
        print(f"{sent} fuzzed frames in {time.monotonic() - start:.1f} s")
    finally:
        cluster.stop()
