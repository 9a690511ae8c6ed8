"""The test run's own isolation (tests/conftest.py): under ``pytest -n`` each xdist worker has a loopback of its
own, so that two test files' daemons never meet on a port; ``host_network`` gives a module the machine's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

UNDER_XDIST = pytest.mark.skipif("PYTEST_XDIST_WORKER" not in os.environ, reason="only under pytest -n")


def networks() -> tuple[str, str]:
    """This thread's network namespace, and the parent process's (the xdist controller's)."""
    return os.readlink("/proc/thread-self/ns/net"), os.readlink(f"/proc/{os.getppid()}/ns/net")


@UNDER_XDIST
def test_an_xdist_worker_runs_in_a_network_namespace_of_its_own_with_loopback_up() -> None:
    mine, parents = networks()
    assert mine != parents, "the worker shares the controller's network namespace"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname(), timeout=5) as conn:
            accepted, _ = listener.accept()
            conn.sendall(b"ok")
            assert accepted.recv(2) == b"ok"
            accepted.close()


@UNDER_XDIST
def test_host_network_gives_a_module_the_machines_network(host_network: None) -> None:
    mine, parents = networks()
    assert mine == parents


@pytest.mark.skipif(os.geteuid() != 0 or sys.platform != "linux", reason="a network namespace needs root")
def test_two_workers_each_have_their_own_loopback() -> None:
    """What ``make test`` does where there are 4 cores or more (``-n auto`` is 0 workers below that): this
    file's tests above, in 2 workers."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", "-k",
                           "network", __file__], capture_output=True, text=True, timeout=100,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
