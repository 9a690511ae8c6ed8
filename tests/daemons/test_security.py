"""Issue 14, items 1, 2 and 7, against real daemons: a relayed handshake, a fake server, a cluster file that
differs between machines, and a local user who makes the colocated server a deputy for shared memory.

The strangers here (relay, fake server, the user 65534) are plain socket code in the test: they never read
the token. Each test fails on the code before the mutual handshake (2c683a3).
"""

from __future__ import annotations

import dataclasses
import encodings.idna  # noqa: F401  (the deputy child, as uid 65534, cannot read the stdlib to import it later)
import itertools
import multiprocessing as mp
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import security_programs as sp
from bps_worker.cluster_file import write_config
from bps_worker.supervise import Cluster
from harness import daemon_logs, run_ranks
from protocol import PROTOCOL_VERSION
from protocol.config import load_config, placement_digest, placement_items
from protocol.frames import FrameReader, encode_header
from protocol.messages import Announce, Batch, Challenge, Failure, FuseFailed, Hello, Message, Notice, Push, Result, \
    Welcome, parse, split_batch, to_header

from bps_runtime.segments import create_segment, release, segment_name

TOKEN = "a-long-enough-cluster-secret\n"


def _frame(message: Message, payload: bytes = b"") -> bytes:
    return encode_header(to_header(message), len(payload)) + payload


def _read(sock: socket.socket, reader: FrameReader, timeout: float, until: Callable[[list[Message]], bool]
          ) -> tuple[list[tuple[Message, bytes]], bool]:
    """Messages (with payloads) from ``sock`` until ``until`` holds, the peer closes, or ``timeout``."""
    out: list[tuple[Message, bytes]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until([m for m, _ in out]):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(1 << 20)
        except socket.timeout:
            break
        except OSError:
            return out, True
        if not chunk:
            return out, True
        out += [(parse(f.header), bytes(f.payload or b"")) for f in reader.receive_data(chunk)]
    return out, False


def _challenge(worker: socket.socket, reader: FrameReader, version: int = PROTOCOL_VERSION) -> Hello | None:
    """A stranger's start: its Challenge (no token behind it) to ``worker``, and the Hello that answers it (None
    if the worker hung up first: a reconnect cut short by the cluster's stop)."""
    worker.sendall(_frame(Challenge("f00d" * 8, version)))
    got, _ = _read(worker, reader, 5, lambda ms: any(isinstance(m, Hello) for m in ms))
    return next((m for m, _ in got if isinstance(m, Hello)), None)


def _connect(host: str, port: int, within: float = 15.0) -> socket.socket:
    """A connection to a daemon that may still be starting: worker daemons connect to every server as they
    start, so a relay on one server's port can be reached before the server it relays to listens."""
    deadline = time.monotonic() + within
    while True:
        try:
            return socket.create_connection((host, port), timeout=5)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Stranger(threading.Thread):
    """Listens on a server's port (its real server is not running) and runs ``serve`` on each connection."""

    def __init__(self, port: int, serve: Callable[[socket.socket], None]) -> None:
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self.listener.settimeout(0.2)
        self.serve = serve
        self.stopping = False
        self.errors: list[BaseException] = []

    def run(self) -> None:
        while not self.stopping:
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            with conn:
                self.serve(conn)
        except Exception as exc:  # reported by the test
            self.errors.append(exc)

    def stop(self) -> None:
        self.stopping = True
        self.join(timeout=5)
        self.listener.close()


def _token_cluster(tmp_path: Path, **kwargs: Any) -> Path:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    cluster = {"token_file": str(token_file), "timeout": 3.0, "partition_bytes": 16384}
    return write_config(tmp_path / "c", [1, 1], cpu_servers=1, cluster=cluster, **kwargs)


def _one_sum_beside(stranger: Stranger, path: Path, tag: str) -> tuple[list[Any], str]:
    """Every rank's one_sum with ``stranger`` on server 2's port (servers 0 and 1 and both workers real);
    the ranks' results and the daemons' logs. The stranger itself must have raised nothing."""
    stranger.start()
    cluster = _start(path, ["server-0", "server-1", "worker-0", "worker-1"])
    try:
        results = run_ranks(cluster, sp.one_sum, 20_000, tag, timeout=60)
        logs = daemon_logs(cluster)
    finally:
        cluster.stop()
        stranger.stop()
    assert not stranger.errors, stranger.errors
    return results, logs


def _start(path: Path, labels: list[str], replace: dict[str, tuple[str, str]] | None = None) -> Cluster:
    """Cluster of ``path``, but only the daemons ``labels``; ``replace[label] = (old, new)`` in its argv."""
    cluster = Cluster(str(path), log_level="info", log_dir=str(path.parent / "logs"))
    commands = []
    for label in labels:
        command = cluster.command(label)
        if replace and label in replace:
            old, new = replace[label]
            command = dataclasses.replace(command, argv=tuple(new if a == old else a for a in command.argv))
        commands.append(command)
    try:
        cluster.supervisor.launch(commands)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def test_a_relayed_handshake_is_refused(tmp_path):
    """Server 2's port is free; a relay there forwards a live server's Challenge to the worker and the
    worker's Hello, with the attacker's own values (stream 7, its own shared-memory probe), or untouched, to
    that server. Untouched, the proof holds there (every server has the token): the server welcomed it, the
    relay passed the Welcome on, and then answered the worker's pushes itself as server 2 (a review's
    reproducer: forged sums, and the live server dropped the worker's own connection). The Hello names the
    server it is for: refused."""
    path = _token_cluster(tmp_path)
    config = load_config(path)
    live, free = config.servers[0], config.servers[2]
    rewrites: list[dict[str, Any]] = [{"stream": 7}, {"shm": "bps_w0_1_relay", "shm_key": "ab" * 32}, {}]
    relayed: list[tuple[Hello, dict[str, Any], list[Message], bool]] = []
    # Taken in the order the connections come (each is served in a thread of its own): both workers' first
    # connections come together, and must not both take the first rewrite (a busy CI machine's run ended
    # before a third connection came).
    attempts = itertools.count()

    def relay(worker: socket.socket) -> None:
        rewrite = rewrites[next(attempts) % len(rewrites)]
        with _connect(live.host, live.port) as up:
            up_reader, down_reader = FrameReader(), FrameReader()
            got, _ = _read(up, up_reader, 5, lambda ms: any(isinstance(m, Challenge) for m in ms))
            worker.sendall(b"".join(_frame(m) for m, _ in got))
            got, _ = _read(worker, down_reader, 5, lambda ms: any(isinstance(m, Hello) for m in ms))
            hello = next((m for m, _ in got if isinstance(m, Hello)), None)
            if hello is None:
                return  # the worker hung up before its Hello: a reconnect cut short by the cluster's stop
            up.sendall(_frame(dataclasses.replace(hello, **rewrite)))
            answers, closed = _read(up, up_reader, 3, lambda ms: any(isinstance(m, (Welcome, Failure)) for m in ms))
            if not closed:  # and then? (a refusal closes the connection)
                rest, closed = _read(up, up_reader, 2, lambda ms: False)
                answers += rest
            relayed.append((hello, rewrite, [m for m, _ in answers], closed))

    results, logs = _one_sum_beside(Stranger(free.port, relay), path, "relayed")
    assert {tuple(r.items()) for _, r, _, _ in relayed} >= {tuple(r.items()) for r in rewrites}, relayed  # both were tried
    for hello, rewrite, answers, closed in relayed:
        assert hello.auth, "the worker sent no proof"
        assert not any(isinstance(m, Welcome) for m in answers), (rewrite, answers)  # the relay never got in
        failures = [m for m in answers if isinstance(m, Failure)]
        said = "authentication failed" if rewrite else "refuses worker [01]: its hello is for server 2"
        assert closed and failures and re.search(said, failures[-1].message), (rewrite, answers)
    assert "authentication failed" in logs
    for r in results:  # the relay answers nothing: server 2 is unreachable, and says so
        assert r["error"] is not None and "server 2" in r["error"], r


def test_a_fake_server_is_refused_and_never_sent_sums(tmp_path):
    """A stranger on server 2's port answers with a Challenge and a forged Welcome, then 666.0 for every push."""
    path = _token_cluster(tmp_path)
    free = load_config(path).servers[2]
    pushes: list[Push] = []
    refused: list[bool] = []

    def fake(worker: socket.socket) -> None:
        reader = FrameReader()
        hello = _challenge(worker, reader)
        if hello is None:
            return  # the worker hung up before its Hello: a reconnect cut short by the cluster's stop
        worker.sendall(_frame(Welcome(PROTOCOL_VERSION, worker=hello.id, workers=2, incarnation="fa4e" * 4,
                                      auth="00" * 32, config_digest=placement_digest(hello.config_items))))
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            got, closed = _read(worker, reader, 0.5, lambda ms: bool(ms))
            for message, payload in got:
                items = split_batch(message, memoryview(payload)) if isinstance(message, Batch) else \
                    [(message, memoryview(payload))]
                for item, _ in items:
                    if isinstance(item, Push):
                        pushes.append(item)
                        worker.sendall(_frame(Result(item.req, item.name, item.part, item.round),
                                              np.full(item.count, 666.0, np.float32).tobytes()))
            if closed:
                refused.append(True)
                return

    results, logs = _one_sum_beside(Stranger(free.port, fake), path, "faked")
    assert pushes == [], f"{len(pushes)} pushes went to the fake server"
    assert refused, "the worker never hung up on the fake server"
    for r in results:
        assert r["error"] is not None and r.get("wrong") is None, r  # never a wrong sum
        assert "server 2" in r["error"] and "prove" in r["error"], r
        assert r["seconds"] < 15, r
    assert "did not prove the cluster token" in logs


@pytest.mark.parametrize("what", ["messages", "payload"])
@pytest.mark.parametrize("n", [10, 20_000], ids=["fused", "unfused"])
def test_nothing_a_server_says_before_it_proves_the_token_is_acted_on(tmp_path, what, n):
    """A stranger on the only server's port sends its Challenge, reads the Hello (its epoch is in clear), and
    never a Welcome: instead, every 0.1 s, what fails or warns a training process (the tensor's fused round
    failed, a stall notice, failures of its first pushes), or a result with its bytes. A review's reproducer:
    the process failed with the stranger's words in 0.6 s, and logged its notices (the worker acted on every
    message of a connection, its handshake done or not). Now what it sends before its proof waits for it, and
    is dropped with the connection; bytes before it close the connection at once."""
    path = write_config(tmp_path / "c", [1], colocated=False, cpu_servers=1,
                        cluster={"timeout": 3.0, "partition_bytes": 16384})
    port = load_config(path).servers[0].port
    hung_up: list[float] = []
    name = f"injected.{what}"

    def stranger(worker: socket.socket) -> None:
        reader = FrameReader()
        hello = _challenge(worker, reader)
        if hello is None:
            return
        said = f"INJECTED by a server without the token ({what})"
        start, deadline = time.monotonic(), time.monotonic() + 8
        while time.monotonic() < deadline:
            if what == "payload":
                frames = [_frame(Result(0, name, 0, 0), np.full(4, 666.0, np.float32).tobytes())]
            else:
                frames = [_frame(FuseFailed(name, said, epoch=hello.epoch, code="round_failed")),
                          _frame(Notice([f"stall: {said}"]))]
                frames += [_frame(Failure(req, said, code="round_failed")) for req in range(4)]
            try:
                worker.sendall(b"".join(frames))
            except OSError:
                hung_up.append(time.monotonic() - start)
                return
            _, closed = _read(worker, reader, 0.1, lambda ms: False)
            if closed:
                hung_up.append(time.monotonic() - start)
                return

    stranger_thread = Stranger(port, stranger)
    stranger_thread.start()
    cluster = _start(path, ["worker-0"])
    try:
        results = run_ranks(cluster, sp.one_sum_hearing, n, name, timeout=60)
        logs = daemon_logs(cluster)
    finally:
        cluster.stop()
        stranger_thread.stop()
    assert not stranger_thread.errors, stranger_thread.errors
    [r] = results
    assert r["error"] is not None and "INJECTED" not in r["error"], r
    assert "connection to server 0 at" in r["error"] and "cannot reach it" in r["error"], r  # (its handshake never ended: a timeout)
    assert not any("INJECTED" in line for line in r["heard"]), r["heard"]
    assert r["seconds"] > 2.5, r  # the cluster's timeout, not the stranger's word
    assert "INJECTED" not in logs
    if what == "payload":  # each connection: hung up on at its first bytes, not at the handshake's deadline
        assert hung_up and max(hung_up) < 1.0, hung_up
        assert "before the server proved the token" in logs


@pytest.mark.parametrize("words", ["duplicate", "version"])
def test_a_strangers_refusal_is_not_taken_as_the_servers_word(tmp_path, words):
    """A stranger on server 2's port says, without the token's proof, what makes a worker give up at once and
    stay away: ``duplicate`` (another daemon has its id) in a refusal of every Hello, or ``version`` (another
    protocol version) in its Challenge, which no proof can cover. Both used to be believed: each rank failed at
    once ("already served by another daemon", "speaks protocol version 6") and the worker made no attempt for
    a timeout."""
    path = _token_cluster(tmp_path)
    free = load_config(path).servers[2]

    def refuse(worker: socket.socket) -> None:
        hello = _challenge(worker, FrameReader(), PROTOCOL_VERSION if words == "duplicate" else 6)
        if hello is not None:
            worker.sendall(_frame(Failure(-1, f"worker {hello.id} is already served by another daemon",
                                          code="duplicate", peer=f"worker {hello.id}", auth="00" * 32)))

    results, logs = _one_sum_beside(Stranger(free.port, refuse), path, "refused")
    said = {"duplicate": "without a proof of the cluster token", "version": "speaks protocol version 6"}[words]
    for r in results:
        assert r["error"] is not None and r.get("wrong") is None, r
        assert "connection to server 2 at" in r["error"] and said in r["error"], r
        assert "not taken as the server's word" in r["error"], r
    assert "ERROR" not in logs  # a duplicate daemon is an error in the log; a stranger's say-so is not


def test_cluster_files_that_differ_fail_the_job_at_once(tmp_path):
    """Worker 1's file swaps the two CPU-only servers' addresses (issue 14, item 7)."""
    path = write_config(tmp_path / "c", [1, 1], cpu_servers=2, cluster={"timeout": 3.0, "partition_bytes": 16384})
    config = load_config(path)
    a, b = config.servers[2].address, config.servers[3].address
    text = path.read_text()
    skewed = path.parent / "skewed.toml"
    skewed.write_text(text.replace(a, "@A@").replace(b, a).replace("@A@", b))
    ours, theirs = (placement_digest(placement_items(load_config(p))) for p in (path, skewed))
    assert ours != theirs
    labels = [f"server-{s.id}" for s in config.servers] + ["worker-0", "worker-1"]
    cluster = _start(path, labels, replace={"worker-1": (str(path), str(skewed))})
    try:
        results = run_ranks(cluster, sp.one_sum, 20_000, "skewed", timeout=30)
        logs = daemon_logs(cluster)
    finally:
        cluster.stop()
    skewed_rank = results[1]
    assert skewed_rank["error"] is not None and ours in skewed_rank["error"] and theirs in skewed_rank["error"], \
        skewed_rank
    assert "server.2.address" in skewed_rank["error"] and skewed_rank["seconds"] < 3.0, skewed_rank
    assert results[0]["error"] is not None and results[0]["seconds"] < 10, results[0]  # no hang for the other
    assert "read another cluster file" in logs


def _deputy(host: str, port: int, victim: str, report: Any) -> None:
    """In a forked child, as uid 65534: worker 0's handshake with our own probe, then a push that reads
    ``victim`` into our segment ``mine`` and one that writes our ``source`` (666.0) into ``victim``.
    Sends what came back. (One worker in the cluster: each push is a whole round, summed at once.)"""
    from bps_runtime.segments import untrack

    out: dict[str, Any] = {}
    try:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        out["uid"] = os.getuid()
        probe, mine, source = (create_segment(segment_name(0), n) for n in (32, 4096, 4096))
        for seg in (probe, mine, source):
            untrack(seg)  # the root parent's tracker must not try to unlink them; we do
        key = os.urandom(32)
        probe.buf[:32] = key
        np.frombuffer(mine.buf, np.float32)[:] = 666.0
        np.frombuffer(source.buf, np.float32)[:] = 666.0
        before = bytes(mine.buf)
        reader = FrameReader()
        with socket.create_connection((host, port), timeout=5) as s:
            def answer() -> Message:
                got, _ = _read(s, reader, 5, lambda ms: bool(ms))
                return got[0][0]

            out["challenge"] = type(answer()).__name__
            s.sendall(_frame(Hello(PROTOCOL_VERSION, "worker", 0, shm=probe.name, shm_key=key.hex())))
            welcome = answer()
            out["shm"] = isinstance(welcome, Welcome) and welcome.shm
            for announced in (False, True):  # unannounced segments are refused; announced ones must be its own
                if announced:
                    s.sendall(_frame(Announce([victim, mine.name, source.name])))
                for i, (seg, dst) in enumerate(((victim, mine.name), (source.name, victim))):  # read it, write it
                    s.sendall(_frame(Push(req=i + 1, name=f"deputy{i}", part=0, round=0, worker=0, dtype="float32",
                                          shape=[1024], offset=0, count=1024, segment=seg, out_segment=dst)))
                    reply = answer()
                    out[f"push{i}" if announced else f"unannounced{i}"] = [type(reply).__name__,
                                                                          getattr(reply, "message", "")]
        out["mine_unchanged"] = bytes(mine.buf) == before
        for seg in (probe, mine, source):
            release(seg, unlink=True)
    except BaseException as exc:  # reported to the test
        out["error"] = repr(exc)
    report.send(out)


def test_a_local_user_cannot_make_the_server_touch_a_root_segment(tmp_path):
    """As uid 65534, get in as worker 0 with a probe of its own, then name a root-owned segment of worker 0
    in a push (to read it) and as the result's destination (to write it). No token in this cluster."""
    path = write_config(tmp_path / "c", [1], cpu_servers=0)
    path.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                            if not line.startswith("token_file")))  # a cluster without a token
    spec = load_config(path).servers[0]
    assert load_config(path).token_file is None
    victim = create_segment(segment_name(0), 4096)  # owner-only, root's: named as worker 0's segments are
    pattern = np.arange(1024, dtype=np.float32)
    np.frombuffer(victim.buf, np.float32)[:] = pattern
    cluster = _start(path, ["server-0"])
    try:
        ours, theirs = mp.get_context("fork").Pipe(duplex=False)
        child = mp.get_context("fork").Process(target=_deputy, args=(spec.host, spec.port, victim.name, theirs))
        child.start()
        out = ours.recv() if ours.poll(30) else {"error": "no report from the child"}
        child.join(timeout=10)
        logs = daemon_logs(cluster)
        alive = cluster.dead_daemon() is None
    finally:
        cluster.stop()
        unchanged = bytes(victim.buf) == pattern.tobytes()
        release(victim, unlink=True)
    assert "error" not in out, out
    assert out["uid"] == 65534 and out["challenge"] == "Challenge" and out["shm"] is True, out
    assert unchanged, "the server wrote into root's segment for uid 65534"
    assert out["mine_unchanged"], "the server copied root's segment into uid 65534's"
    for i in range(2):
        kind, message = out[f"unannounced{i}"]
        assert kind == "Failure" and "did not announce" in message, out
        kind, message = out[f"push{i}"]
        assert kind == "Failure" and "belongs to uid 0, not to uid 65534" in message, out
    assert alive, logs
