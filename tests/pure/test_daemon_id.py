"""Hello.daemon, the worker daemon's id for its run (issue 14, item 6): one per process, bound by the
handshake's proof, bounded in size, and a refusal for a second daemon the worker recognises."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp

import pytest

from bps_worker.errors import BPSConnectionError, error_from_failure
from bps_worker.link import _cannot_change, _held_elsewhere, daemon_id
from protocol import PROTOCOL_VERSION
from protocol.errors import LocalProtocolError
from protocol.handshake import AuthenticationError, ClientHandshake, HandshakeRefused, ServerHandshake
from protocol.messages import MAX_NONCE_CHARS, ROLE_WORKER, Failure, Hello, parse, to_header

TOKEN = b"a-token-of-enough-length-0123456789"


def _child_id(queue) -> None:
    queue.put(daemon_id())


def test_one_daemon_id_per_process():
    first = daemon_id()
    assert first == daemon_id() and len(first) == 16 and int(first, 16) >= 0
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_id, args=(queue,))
    child.start()
    theirs = queue.get(timeout=30)
    child.join(timeout=30)
    assert theirs != first and len(theirs) == 16  # a forked daemon is another daemon


def test_the_proof_binds_the_daemon_id():
    server = ServerHandshake(peers={ROLE_WORKER: 2}, token=TOKEN, who="server 0")
    hello = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, daemon="aaaa"), token=TOKEN).receive(
        parse(to_header(server.start())))
    assert isinstance(hello, Hello) and hello.daemon == "aaaa"
    with pytest.raises(AuthenticationError, match="a wrong proof"):
        server.receive(parse(to_header(dataclasses.replace(hello, daemon="bbbb"))))


def test_a_daemon_id_or_epoch_is_bounded():
    for field in ("daemon", "epoch"):
        with pytest.raises(LocalProtocolError, match=f"hello: {'daemon id' if field == 'daemon' else field} of"):
            Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, **{field: "x" * (MAX_NONCE_CHARS + 1)})


def test_the_worker_recognises_a_refusal_for_a_second_daemon():
    failure = Failure(-1, "worker 0 is already served by another daemon, connected from 10.0.0.5:50000 (daemon "
                          "aaaa, epoch e1) ...", code="duplicate", peer="worker 0 from 10.0.0.5:50000 (daemon aaaa, "
                                                                       "epoch e1)")
    client = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0), challenge=False, who="server 0 at h:1")
    client.start()
    with pytest.raises(HandshakeRefused) as info:
        client.receive(failure)
    assert info.value.code == "duplicate" and _held_elsewhere(info.value) and not _cannot_change(info.value)
    exc = error_from_failure(failure)
    assert isinstance(exc, BPSConnectionError) and exc.peer == failure.peer
