"""The tests' side of a TCP handshake with a real server: a worker's (or observer's) Hello answering the
server's Challenge, with the cluster token's proof where the cluster has one, so that what a test sends
after it reaches the server's later checks (not its authentication)."""

from __future__ import annotations

import socket
from typing import Any

from protocol import PROTOCOL_VERSION
from protocol.config import ClusterConfig, read_token
from protocol.frames import FrameReader, encode_message
from protocol.handshake import ClientHandshake
from protocol.messages import ROLE_WORKER, Challenge, Hello, parse


def read_message(sock: socket.socket, timeout: float = 5.0) -> Any:
    """The next message the peer sends on ``sock`` (nothing after it is read)."""
    reader = FrameReader()
    sock.settimeout(timeout)
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        frames = reader.receive_data(chunk)
        if frames:
            return parse(frames[0].header)


def read_challenge(sock: socket.socket, timeout: float = 5.0) -> Challenge:
    """The server's first frame on ``sock`` (nothing after it is read)."""
    message = read_message(sock, timeout)
    if not isinstance(message, Challenge):
        raise AssertionError(f"expected the server's challenge, got {message}")
    return message


def hello_frame(sock: socket.socket, config: ClusterConfig, ident: int, role: str = ROLE_WORKER,
                **fields: Any) -> bytes:
    """The frame of a Hello from ``role`` ``ident`` that answers this connection's Challenge."""
    greeting = ClientHandshake(Hello(PROTOCOL_VERSION, role, ident, **fields), token=read_token(config))
    return encode_message(greeting.receive(read_challenge(sock)))
