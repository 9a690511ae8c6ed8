"""The client's Handle: the wait of one or several threads, a timeout, an end that comes before the wait."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from bps_worker.client.handle import Handle
from bps_worker.errors import BPSError

pytestmark = pytest.mark.timeout(30)


def _handle() -> Handle:
    return Handle(1, "h", np.dtype(np.float32), (4,), None)


def test_an_end_before_the_wait_needs_no_gate() -> None:
    h = _handle()
    h.succeed(None, None)
    assert h.wait(0.0) and h.wait(None)
    assert h._gate is None


def test_a_wait_times_out_while_nothing_ends_and_passes_once_it_ends() -> None:
    h = _handle()
    started = time.monotonic()
    assert h.wait(0.2) is False
    assert 0.15 <= time.monotonic() - started < 5.0
    assert h.wait(0.0) is False  # a zero timeout: still not ended
    h.succeed(None, None)
    assert h.wait(0.0) and h.wait(None) and h.done()


@pytest.mark.parametrize("waiters", [1, 4])
def test_every_thread_waiting_on_one_handle_passes_when_it_ends(waiters: int) -> None:
    h = _handle()
    passed: list[bool] = []
    ready = threading.Barrier(waiters + 1)

    def wait() -> None:
        ready.wait()
        passed.append(h.wait(10.0))

    threads = [threading.Thread(target=wait) for _ in range(waiters)]
    for t in threads:
        t.start()
    ready.wait()
    deadline = time.monotonic() + 5.0
    while h._gate is None and time.monotonic() < deadline:  # a waiter made the gate: it waits on it
        time.sleep(0.001)
    time.sleep(0.05)
    assert passed == []
    h.fail(BPSError("gone"))
    for t in threads:
        t.join(10.0)
    assert passed == [True] * waiters
    assert isinstance(h.error, BPSError)
    assert h.wait(None)  # a later wait passes as well (the gate stays open)


def test_ends_racing_waits_never_leave_a_waiter_behind() -> None:
    """The end and the first wait run at the same moment, many times: each wait returns True in time."""
    for _ in range(300):
        h = _handle()
        result: list[bool] = []
        t = threading.Thread(target=lambda: result.append(h.wait(5.0)))
        t.start()
        h.succeed(None, None)
        t.join(10.0)
        assert result == [True]


@pytest.mark.parametrize("bad", [None, "x", 3])
def test_poll_and_synchronize_of_no_handle_are_bps_errors_without_a_connection(bad: object) -> None:
    """Every failure a user can meet is a BPSError (the contract): poll() of something that is not a handle, with
    no connection (before init, after shutdown), raised AttributeError; the torch layer's poll and synchronize
    read ``.inner`` of it (AttributeError)."""
    import bps_worker.client as bps
    import bps_worker.torch as bps_torch

    assert not bps.is_initialized()
    for call in (lambda: bps.poll(bad), lambda: bps_torch.poll(bad), lambda: bps_torch.synchronize(bad)):
        with pytest.raises(BPSError, match=f"expected a handle from push_pull_async .*got {type(bad).__name__}"):
            call()
    with pytest.raises(BPSError):  # (not initialized: said first)
        bps.synchronize(bad)
    assert bps.poll(_handle()) is False  # (a real one, never sent: not done)
