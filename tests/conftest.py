"""Fixtures that start real clusters (see harness.py) and always stop them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from bps_worker.supervise import Cluster
from harness import start_cluster, write_config


def pytest_sessionstart(session: pytest.Session) -> None:
    """Fill numba's on-disk cache of the summation kernels once, before any test starts daemons.

    Every daemon loads the kernels before it reports ready (``kernels.warm_up``): about 1 CPU-s from the cache,
    but 18 CPU-s to compile them where the cache is empty (a fresh clone). Five daemons compiling at once on a
    busy 2-core machine missed the cluster's 60 s start (a first test that failed only in a fresh checkout). In a
    process of its own, so that this one does not import numba."""
    subprocess.run([sys.executable, "-c", "from bps_runtime import kernels; kernels.warm_up()"], check=True,
                   timeout=600)


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
