"""A token by default (issue 14, item 2): the tests' generated clusters authenticate every TCP connection.

The stranger is plain socket code: it answers the server's Challenge with a Hello that carries no proof,
or one made with another token, and is refused; a peer holding the file's token gets a Welcome that proves
the server holds it too. The cluster still sums exactly.
"""

from __future__ import annotations

import socket
import stat
import time
from pathlib import Path

import rank_programs as rp
from handshakes import read_challenge
from harness import daemon_logs, run_ranks, start_cluster, write_config
from protocol import PROTOCOL_VERSION
from protocol.config import placement_items, read_token
from protocol.frames import FrameReader, encode_message
from protocol.handshake import ClientHandshake
from protocol.messages import ROLE_WORKER, Failure, Hello, Message, Welcome, parse


def _replies(sock: socket.socket, reader: FrameReader, timeout: float = 5.0) -> tuple[list[Message], bool]:
    """Messages until the peer closes (True), a Welcome or ``timeout``."""
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            return out, False
        except OSError:
            return out, True
        if not chunk:
            return out, True
        out += [parse(f.header) for f in reader.receive_data(chunk)]
        if any(isinstance(m, Welcome) for m in out):
            return out, False
    return out, False


def _handshake(host: str, port: int, client: ClientHandshake | None, hello: Hello) -> tuple[list[Message], bool]:
    """Read the Challenge; answer with ``client``'s Hello (or ``hello`` as it is); what came back."""
    with socket.create_connection((host, port), timeout=5) as s:
        challenge = read_challenge(s)
        s.sendall(encode_message(client.receive(challenge) if client is not None else hello))
        return _replies(s, FrameReader())


def test_a_generated_cluster_has_a_private_token_and_its_servers_refuse_hellos_without_it(tmp_path: Path):
    path = write_config(tmp_path / "c", [1, 1], cpu_servers=1)
    cluster = start_cluster(path)
    try:
        config = cluster.config
        assert config.token_file is not None
        assert stat.S_IMODE(Path(config.token_file).stat().st_mode) == 0o600
        token = read_token(config)
        assert token is not None
        items = list(placement_items(config))
        hello = Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, config_items=items)
        for spec in config.servers:
            for client in (None, ClientHandshake(hello, token=b"not-the-cluster-token-0123456789")):
                messages, closed = _handshake(spec.host, spec.port, client, hello)
                failures = [m for m in messages if isinstance(m, Failure)]
                assert closed and failures and "authentication failed" in failures[-1].message, (spec, messages)
                assert not any(isinstance(m, Welcome) for m in messages)
        # The token's holder is let in, and the server proves it holds the token too (receive checks it).
        observer = ClientHandshake(Hello(PROTOCOL_VERSION, "observer", 0), token=token)
        messages, _ = _handshake(config.servers[2].host, config.servers[2].port, observer, hello)
        assert observer.receive(messages[-1]).authenticated
        for reports in zip(*run_ranks(cluster, rp.sum_cases, [("t.f32", "float32", (70_001,), True, 3)])):
            assert all(r["exact"] for r in reports)
        assert "authentication failed" in daemon_logs(cluster)
    finally:
        cluster.stop()
