"""A worker daemon's CUDA bridge (bps_runtime/cuda.py) is made once, in a thread, while its loop serves.

Importing torch and starting CUDA take seconds. Made on the loop, that stalled the daemon: its servers'
heartbeats went unread, and with a short cluster.timeout both sides dropped each other in the middle of a job
(benchmarks/RESULTS.md, session 27). A stand-in bridge that sleeps shows where it is made, without a GPU.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from bps_runtime import cuda
from bps_worker.daemon import WorkerConfig, WorkerDaemon
from bps_worker.errors import BPSError
from protocol.config import parse_config

MAKING_S = 0.5


def _daemon() -> WorkerDaemon:
    cluster = parse_config({"cluster": {"workers": 1}, "server": [{"id": 0, "address": "127.0.0.1:9000"}],
                            "worker": [{"id": 0, "local_size": 1, "socket": "/tmp/bps-test-w0.sock"}]})
    return WorkerDaemon(WorkerConfig(cluster, 0))


async def _longest_gap(awaitable):  # -> (result, the loop's longest stall in s)
    loop = asyncio.get_running_loop()
    ticks = [loop.time()]

    async def tick() -> None:
        while True:
            await asyncio.sleep(0.01)
            ticks.append(loop.time())

    ticker = asyncio.ensure_future(tick())
    try:
        result = await awaitable
    finally:
        ticker.cancel()
    ticks.append(loop.time())
    return result, max(b - a for a, b in zip(ticks, ticks[1:]))


@pytest.mark.timeout(30)
async def test_the_bridge_is_made_once_in_a_thread_while_the_loop_serves(monkeypatch):
    made: list[str] = []

    class SlowBridge:
        def __init__(self) -> None:
            made.append(threading.current_thread().name)
            time.sleep(MAKING_S)  # blocks whichever thread makes it

        def unpin(self, seg) -> None:
            pass

    monkeypatch.setattr(cuda, "CudaBridge", SlowBridge)
    daemon = _daemon()
    try:
        waiter = asyncio.ensure_future(daemon.cuda_bridge())
        await asyncio.sleep(0.05)
        waiter.cancel()  # one operation given up does not cancel the making for the others
        (a, b), gap = await _longest_gap(asyncio.gather(daemon.cuda_bridge(), daemon.cuda_bridge()))
        assert a is b and isinstance(a, SlowBridge)
        assert await daemon.cuda_bridge() is a
        assert len(made) == 1 and made[0].startswith("bps-local"), made
        assert gap < MAKING_S / 2, f"the loop stalled {gap:.3f} s while the bridge was made"
        assert daemon.staging.before_release == a.unpin and daemon.results.before_release == a.unpin
    finally:
        daemon.executor.shutdown(wait=True)


@pytest.mark.timeout(30)
async def test_a_daemon_that_cannot_do_cuda_says_so_to_every_operation(monkeypatch):
    tries: list[int] = []

    class NoBridge:
        def __init__(self) -> None:
            tries.append(1)
            raise cuda.CudaUnavailableError("a process sent a CUDA tensor, but this worker daemon sees no CUDA "
                                            "device")

    monkeypatch.setattr(cuda, "CudaBridge", NoBridge)
    daemon = _daemon()
    try:
        results = await asyncio.gather(daemon.cuda_bridge(), daemon.cuda_bridge(), return_exceptions=True)
        with pytest.raises(BPSError, match="sees no CUDA device"):
            await daemon.cuda_bridge()
        assert all(isinstance(r, BPSError) and "sees no CUDA device" in str(r) for r in results), results
        assert tries == [1]  # asked once: the answer does not change while the daemon runs
    finally:
        daemon.executor.shutdown(wait=True)


def test_a_device_cuda_cannot_start_on_is_named_as_such(monkeypatch):
    """torch sees a device but CUDA will not start (a driver that does not match): the bridge says so in a
    CudaUnavailableError, which every operation gets as a BPSError (not an internal error)."""
    import torch

    def broken_init() -> None:
        raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", broken_init)
    with pytest.raises(cuda.CudaUnavailableError, match="cannot start CUDA: CUDA driver version is insufficient"):
        cuda.CudaBridge()
