"""Fixtures that start real clusters (see harness.py) and always stop them."""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from bps_runtime.forkserver import Forkserver
from bps_worker.supervise import Cluster
from harness import start_cluster, write_config


CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def private_network_possible() -> bool:
    """Whether this process may take a network namespace of its own (root, on Linux)."""
    return sys.platform == "linux" and os.geteuid() == 0


_NETWORKS: dict[str, int] = {}  # "host" and "own": descriptors of this worker's two network namespaces


def _libc(call: str, *args: int) -> None:
    """libc's ``call`` (unshare or setns: Python 3.11 has neither), an OSError naming it where it fails."""
    if getattr(ctypes.CDLL(None, use_errno=True), call)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{call}(CLONE_NEWNET) for a test worker's own network: {os.strerror(err)}")


def _setns(fd: int) -> None:
    _libc("setns", fd, CLONE_NEWNET)


def enter_private_network() -> None:
    """Move this process (its calling thread, the one that runs the tests) into a new network namespace with
    its own loopback, up.

    With ``pytest -n`` (``make test``) each xdist worker runs one test file at a time, and its daemons, ranks
    and the ports they take are in that worker's namespace: a port that ``free_ports`` found free and released
    cannot be taken by another file's daemons before this file's daemon binds it (on one shared loopback, two
    files starting clusters at once can meet on a port: ``bind(0)`` picks ports at random). Processes it
    starts inherit the namespace; ``ip netns`` namespaces the emulator makes are named by pid and stay
    reachable."""
    _NETWORKS["host"] = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    _libc("unshare", CLONE_NEWNET)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))
    _NETWORKS["own"] = os.open("/proc/thread-self/ns/net", os.O_RDONLY)


@pytest.fixture(scope="module")
def host_network() -> Iterator[None]:
    """The machine's own network for one test module (what it starts inherits it), where the worker has a
    namespace of its own: for what needs more than loopback (Slurm's node names, apt-get). No other test file
    binds ports there while it runs. Not for rank processes of ``harness.run_ranks``: the forkserver they come
    from would stay in the host's network if it started here, and every later rank with it."""
    if "own" not in _NETWORKS:
        yield
        return
    _setns(_NETWORKS["host"])
    try:
        yield
    finally:
        _setns(_NETWORKS["own"])


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: test files side by side, one per two cores but at least 3 and at most 4, where each worker
    can have a loopback of its own (root); otherwise none (the files run one after the other in this process).

    Since the daemons are forked from a preloaded process (their start was 60% of the suite's CPU) and the
    ranks from one that loaded torch and torch._dynamo (session 51), much of a file's time is waiting (fault
    timeouts, heartbeats, a rank's sleep). Measured on this project's 2-core box: 1893 tests in 11:29 and 11:00
    with two files at a time, 17:51 one after the other (session 19); 2544 tests in 10:46 with two files at a
    time, the cores 76% busy on average and under half for minutes where both files waited, and 8:54 with three
    (session 51). The tests' timeouts are set for a busy 2-core box: three files side by side passed beside a
    busy loop too (session 51)."""
    cores = os.cpu_count() or 1
    return min(4, max(3, cores // 2)) if private_network_possible() and cores >= 2 else 0


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker's own network; then the daemons of every ``Cluster`` of this process are forked from
    one preloaded helper (``bps_runtime.forkserver``): a daemon's start was about 1.1 CPU-s, most of it numba's
    import and the kernels' load, over 600 times a suite (60% of its CPU). Started at the first cluster, so
    in the worker's network. The tests that are about the daemons' command line, signals and exit codes
    (test_cli, test_systemd_notify, test_permissions, ...) start them with ``subprocess`` themselves."""
    if hasattr(config, "workerinput"):  # an xdist worker
        enter_private_network()
    Cluster.default_forkserver = Forkserver()
    config.addinivalue_line("markers", "cuda: needs a CUDA device and a CUDA build of torch (skipped elsewhere)")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests (or parameters) marked ``cuda`` are skipped where torch sees no GPU; torch is imported only to ask,
    where some are collected."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if marked and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (and a CUDA build of torch)")
        for item in marked:
            item.add_marker(skip)


def pytest_unconfigure(config: pytest.Config) -> None:
    if Cluster.default_forkserver is not None:
        Cluster.default_forkserver.close()
        Cluster.default_forkserver = None


def pytest_sessionstart(session: pytest.Session) -> None:
    """Fill numba's on-disk cache of the summation kernels once, before any test starts daemons.

    Every daemon loads the kernels before it reports ready (``kernels.warm_up``): about 1 CPU-s from the cache,
    but 18 CPU-s to compile them where the cache is empty (a fresh clone). Five daemons compiling at once on a
    busy 2-core machine missed the cluster's 60 s start (a first test that failed only in a fresh checkout). In a
    process of its own, so that this one does not import numba. With xdist, once, in the controller."""
    if hasattr(session.config, "workerinput"):
        return
    subprocess.run([sys.executable, "-c", "from bps_runtime import kernels; kernels.warm_up()"], check=True,
                   timeout=600)


@pytest.fixture
def forked_daemons(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripts a test runs (the launcher, a benchmark) fork their clusters' daemons from one helper each
    (``BPS_FORKSERVER=1``, see ``bps_worker.supervise``): about 1.1 CPU-s less per daemon after the first. Not
    for the tests of the launcher's signals and exit codes, which start its daemons as a user's would."""
    monkeypatch.setenv("BPS_FORKSERVER", "1")


@pytest.fixture(scope="module")
def cluster_2x2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """configs/local.toml's shape (2 workers x 2 processes, 2 colocated + 1 CPU-only server) with small
    partitions so that ordinary tensors are split across servers and partitions."""
    directory = tmp_path_factory.mktemp("cluster_2x2")
    cluster = start_cluster(write_config(directory, [2, 2], cpu_servers=1, cluster={"partition_bytes": 65536}))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """Factory for clusters of any shape; every one is stopped at teardown."""
    started: list[Cluster] = []

    def make(local_sizes: list[int], **kwargs: object) -> Cluster:
        cluster = start_cluster(write_config(tmp_path / f"c{len(started)}", local_sizes, **kwargs))  # type: ignore[arg-type]
        started.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in started:
            cluster.stop()
