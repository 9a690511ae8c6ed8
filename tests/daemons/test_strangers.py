"""Real daemons against strangers that never finish a handshake and a client that never reads (issue 14,
item 5): the server and the worker daemon close them, bound what they hold, and keep serving."""

from __future__ import annotations

import os
import re
import select
import socket
import time
from pathlib import Path

import pytest

import rank_programs as rp
from handshakes import hello_frame, read_message
from harness import daemon_logs, run_ranks, start_cluster, wait_linked, write_config
from protocol import PROTOCOL_VERSION
from protocol.frames import FrameReader, encode_message
from protocol.messages import ROLE_CLIENT, ROLE_OBSERVER, Failure, Hello, Op, Ping, StatsRequest, Welcome, parse

TIMEOUT_S = 10.0  # the cluster's (generous: the ranks of a busy machine start slowly)
DEADLINE_S = 10.0  # a connection must finish its handshake within this (bps_runtime.admission)
FLOOD = 1500  # idle TCP connections; before the bounds each took 256 KiB of the server's memory for ever


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


def _pid(cluster, label: str) -> int:
    return next(c.proc.pid for c in cluster.children if c.label == label)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` (EOF or reset); what it sent before is read and dropped."""
    try:
        while True:
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _wait_closed(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    """Those of ``socks`` still open after ``timeout`` (polled)."""
    for s in socks:
        s.setblocking(False)
    deadline = time.monotonic() + timeout
    open_ = list(socks)
    while open_ and time.monotonic() < deadline:
        open_ = [s for s in open_ if not _closed_by_peer(s)]
        time.sleep(0.2)
    return open_


@pytest.fixture
def cluster(tmp_path: Path):
    c = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    try:
        yield c
    finally:
        c.stop()


def _sum_still_exact(cluster, tag: str) -> None:
    for reports in zip(*run_ranks(cluster, rp.sum_cases, [(tag, "float32", (1000,), True, 1)])):
        assert all(r["exact"] for r in reports)


@pytest.mark.timeout(180)
def test_idle_strangers_are_refused_and_dropped_by_the_server_and_the_worker_socket(cluster):
    """A flood of idle TCP connections to a server, and a few Unix connections to a worker daemon that never
    say hello: both daemons close them (the server most at once, over its bounds), within the handshake
    deadline (one wait serves both), and keep serving."""
    spec = cluster.config.servers[2]  # the CPU-only server
    pid = _pid(cluster, "server-2")
    rss_before = _rss_mib(pid)
    socks, unix_socks = [], []
    try:
        for _ in range(5):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix_socks.append(s)
            s.connect(cluster.socket_path(0))
        for _ in range(FLOOD):
            s = socket.create_connection((spec.host, spec.port), timeout=10)
            try:
                s.send(b"\0")  # a byte, so that the server reads (and, before the bounds, buffered) something
            except OSError:
                pass  # refused at once: it may already be reset
            socks.append(s)
        time.sleep(1.0)
        grown = _rss_mib(pid) - rss_before
        assert grown < 40, f"{FLOOD} idle connections took {grown:.0f} MiB of the server's memory"
        # All are closed: most at once (over the bounds), the rest at the handshake deadline.
        still_open = _wait_closed(socks, DEADLINE_S + 30)
        assert not still_open, f"{len(still_open)} of {FLOOD} idle connections are still open"
        assert not _wait_closed(unix_socks, 10), "the worker daemon keeps connections that never said hello"
    finally:
        for s in socks + unix_socks:
            s.close()
    log = Path(cluster.log_dir, "server-2.log").read_text(errors="replace")
    assert re.search(r"server 2 closes the connection from 127\.0\.0\.1:\d+, pending for [\d.]+ s, for a new one "
                     r"from 127\.0\.0\.1:\d+: 64 connections from 127\.0\.0\.1 have not finished their handshake "
                     r"\(at most 64 per peer\)", log), log[-3000:]
    assert re.search(r"server 2 closes the connection from 127\.0\.0\.1:\d+: no handshake within 10 s", log)
    lines = [line for line in log.splitlines() if "finished their handshake" in line or "no handshake" in line]
    assert len(lines) < 60, f"{len(lines)} log lines for {FLOOD} connections: the flood flooded the log"
    log = Path(cluster.log_dir, "worker-0.log").read_text(errors="replace")
    assert re.search(rf"worker 0's socket closes the connection from pid {os.getpid()} \(uid {os.getuid()}\): no "
                     rf"handshake within 10 s", log), log[-3000:]
    _sum_still_exact(cluster, "after.flood")


@pytest.mark.timeout(120)
def test_idle_strangers_from_a_workers_address_do_not_keep_its_handshake_out(cluster):
    """64 idle connections from 127.0.0.1 (anyone on a worker's machine, or behind its NAT, without a token)
    made the server refuse every new connection from there until they went: a worker that lost its connection
    could not reconnect (a review's reproducer). The oldest of them now makes room for the new one."""
    spec = cluster.config.servers[2]
    wait_linked(cluster, 2)  # else the handshake below could take worker 1's place, and leave
    idle = [socket.create_connection((spec.host, spec.port), timeout=10) for _ in range(64)]
    try:
        time.sleep(0.5)  # (each is pending at the server by now)
        with socket.create_connection((spec.host, spec.port), timeout=10) as s:
            s.sendall(hello_frame(s, cluster.config, 1))  # an honest handshake (worker 1's id is taken: refused
            answer = read_message(s)                      # as a duplicate, but answered)
            assert isinstance(answer, Failure) and answer.code == "duplicate", answer
        assert _wait_closed(idle[:1], 5) == [], "the oldest idle connection was not closed for the new one"
    finally:
        for s in idle:
            s.close()
    _sum_still_exact(cluster, "after.idle")


def _send_until_blocked(sock: socket.socket, chunk: bytes, cap: int, stuck_s: float) -> int:
    """Send ``chunk`` again and again (non-blocking) until ``cap`` bytes went, or the socket stayed
    unwritable for ``stuck_s`` (the daemon stopped reading); the bytes sent."""
    sock.setblocking(False)
    sent = 0
    while sent < cap:
        view = memoryview(chunk)[sent % len(chunk):]
        try:
            sent += sock.send(view)
        except BlockingIOError:
            _, writable, _ = select.select([], [sock], [], stuck_s)
            if not writable:
                return sent
    return sent


@pytest.mark.timeout(240)
def test_a_client_that_never_reads_cannot_grow_the_daemon(cluster):
    """A process that sends ops which fail at once and never reads the failures: the daemon stops reading
    it once its answers pile up, instead of buffering them without limit; reading resumes it."""
    pid = _pid(cluster, "worker-0")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(cluster.socket_path(0))
    sock.settimeout(10)
    sock.sendall(encode_message(Hello(PROTOCOL_VERSION, ROLE_CLIENT, 0, os.getpid())))
    reader = FrameReader()
    welcome = parse(reader.receive_data(sock.recv(65536))[0].header)
    assert isinstance(welcome, Welcome)
    op = encode_message(Op(7, "never.read", "sum", "float32", [4], "bps_w0_1_nonexistent"))
    rss_before = _rss_mib(pid)
    cap = 24 << 20
    sent = _send_until_blocked(sock, op * 4096, cap, stuck_s=3.0)
    grown = _rss_mib(pid) - rss_before
    assert sent < cap, "the daemon read every op of a client that reads nothing"
    assert grown < 16, f"a client that never reads took {grown:.0f} MiB of the worker daemon's memory"
    # Reading again: the daemon resumes and answers every whole op it was sent.
    sock.setblocking(True)
    sock.settimeout(10)
    want, failures = sent // len(op), 0
    deadline = time.monotonic() + 90
    while failures < want and time.monotonic() < deadline:
        for frame in reader.receive_data(sock.recv(1 << 20)):
            message = parse(frame.header)
            if isinstance(message, Failure):
                assert message.req == 7 and "was not allocated" in message.message, message
                failures += 1
            else:
                assert isinstance(message, Ping), message
    sock.close()
    assert failures == want, f"{failures} answers for {want} ops"
    logs = daemon_logs(cluster)
    assert "Traceback" not in logs
    # The process is gone: worker 0 resets with every server (its links connect for that now, having
    # carried nothing) before the next job starts, or that reset would fail the next job's first round.
    _wait_for_log_lines(cluster, [f"server-{s.id}" for s in cluster.config.servers],
                        "worker 0 has no training processes", within_s=60)
    _sum_still_exact(cluster, "after.never.read")


def _wait_for_log_lines(cluster, labels: list[str], text: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    missing = labels
    while missing and time.monotonic() < deadline:
        missing = [label for label in labels
                   if text not in Path(cluster.log_dir, f"{label}.log").read_text(errors="replace")]
        time.sleep(0.2)
    assert not missing, f"no {text!r} in the logs of {missing}"


@pytest.mark.timeout(120)
def test_observers_that_ask_nothing_for_the_timeout_are_closed_and_one_that_asks_stays(tmp_path):
    """An observer asks for the counters and leaves (bps_worker.observer). Idle ones were kept for ever: a
    stranger of a token-less cluster could hold every descriptor of the server. Now one that asks nothing
    for the timeout is closed, as a silent worker is; one that keeps asking is served."""
    timeout = 2.0
    cluster = start_cluster(write_config(tmp_path, [1], cluster={"timeout": timeout}))
    spec = cluster.config.servers[0]
    socks = []
    try:
        for _ in range(20):
            s = socket.create_connection((spec.host, spec.port), timeout=10)
            socks.append(s)
            s.sendall(hello_frame(s, cluster.config, 0, role=ROLE_OBSERVER))
            assert isinstance(read_message(s), Welcome)
        asking = socks.pop()
        deadline = time.monotonic() + 3 * timeout
        req = 0
        while time.monotonic() < deadline:  # one that asks twice a timeout
            req += 1
            asking.sendall(encode_message(StatsRequest(req)))
            assert read_message(asking).req == req
            time.sleep(timeout / 2)
        assert not _wait_closed(socks, timeout), "observers silent for 2 timeouts are still open"
        asking.sendall(encode_message(StatsRequest(req + 1)))
        assert read_message(asking).req == req + 1  # still served
        socks.append(asking)
    finally:
        for s in socks:
            s.close()
        cluster.stop()
    log = Path(cluster.log_dir, "server-0.log").read_text(errors="replace")
    assert re.search(r"observer 127\.0\.0\.1:\d+ asked nothing for [\d.]+ s \(limit 2 s\): closing it", log), log[-2000:]
