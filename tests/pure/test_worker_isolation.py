"""The test run's own isolation (tests/conftest.py): under ``pytest -n`` each xdist worker has a loopback of its
own, so that two test files' daemons never meet on a port."""

from __future__ import annotations

import os
import socket

import pytest


@pytest.mark.skipif("PYTEST_XDIST_WORKER" not in os.environ, reason="only under pytest -n (make test)")
def test_an_xdist_worker_runs_in_a_network_namespace_of_its_own_with_loopback_up() -> None:
    mine, parents = (os.readlink(f"/proc/{pid}/ns/net") for pid in ("thread-self", str(os.getppid())))
    assert mine != parents, "the worker shares the controller's network namespace"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname(), timeout=5) as conn:
            accepted, _ = listener.accept()
            conn.sendall(b"ok")
            assert accepted.recv(2) == b"ok"
            accepted.close()
