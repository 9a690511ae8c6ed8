"""The process's fusion buffer (``bps_worker.client.fusion``), with a recording sender instead of a socket."""

from __future__ import annotations

import threading
import time

import numpy as np

from bps_worker.client.fusion import FusionBuffer
from bps_worker.client.handle import Handle
from bps_worker.errors import BPSConnectionError
from protocol.messages import FUSED_NAMES_BUDGET, MAX_FUSED_ENTRIES, OpBatch

SPEC = ("float32", (4,), False, "")


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[list[Handle], OpBatch]] = []
        self.fail = fail
        self.event = threading.Event()

    def __call__(self, handles: list[Handle], batch: OpBatch) -> None:
        if self.fail:
            raise BPSConnectionError("lost the connection", peer="the worker daemon")
        self.sent.append((handles, batch))
        self.event.set()


def handle(i: int) -> Handle:
    return Handle(i, f"t{i}", np.dtype(np.float32), (4,), None)


def test_entries_wait_until_the_bytes_are_reached_then_go_in_one_batch():
    rec = Recorder()
    buf = FusionBuffer(rec, limit_bytes=48, cycle_s=60.0)
    hs = [handle(i) for i in range(3)]
    for i, h in enumerate(hs[:2]):
        buf.add(h, SPEC, "segA", 16 * i, 0, 16)
    assert rec.sent == []
    buf.add(hs[2], ("float16", (2, 2), True, "x"), "segB", 0, 5, 16)
    [(handles, batch)] = rec.sent
    assert handles == hs and batch.reqs == [0, 1, 2] and batch.names == ["t0", "t1", "t2"]
    assert batch.specs == [["float32", [4], False, ""], ["float16", [2, 2], True, "x"]] and batch.spec == [0, 0, 1]
    assert (batch.segments, batch.seg, batch.offsets, batch.priority) == (["segA", "segB"], [0, 0, 1], [0, 16, 0],
                                                                          [0, 0, 5])
    assert not any(h.queued for h in hs)
    buf.close()


def test_a_flush_sends_what_waits_and_the_cycle_sends_it_too():
    rec = Recorder()
    buf = FusionBuffer(rec, limit_bytes=1 << 20, cycle_s=60.0)
    buf.add(handle(1), SPEC, "s", 0, 0, 16)
    buf.flush()
    assert [b.reqs for _, b in rec.sent] == [[1]]
    buf.flush()  # nothing waits: nothing sent
    assert len(rec.sent) == 1
    buf.close()
    rec = Recorder()
    buf = FusionBuffer(rec, limit_bytes=1 << 20, cycle_s=0.02)
    start = time.monotonic()
    buf.add(handle(2), SPEC, "s", 0, 0, 16)
    assert rec.event.wait(5.0)
    assert time.monotonic() - start >= 0.015 and [b.reqs for _, b in rec.sent] == [[2]]
    buf.close()


def test_a_large_flush_is_cut_into_messages_that_fit():
    rec = Recorder()
    buf = FusionBuffer(rec, limit_bytes=1 << 30, cycle_s=60.0)
    n = MAX_FUSED_ENTRIES + 10
    for i in range(n):
        buf.add(handle(i), SPEC, "s", 16 * i, 0, 16)
    buf.flush()
    assert len(rec.sent) > 1
    assert all(len(b.reqs) <= MAX_FUSED_ENTRIES and sum(len(x) + 16 for x in b.names) <= FUSED_NAMES_BUDGET
               for _, b in rec.sent)
    assert [r for _, b in rec.sent for r in b.reqs] == list(range(n))
    buf.close()


def test_a_send_that_fails_fails_every_handle_it_carried():
    buf = FusionBuffer(Recorder(fail=True), limit_bytes=1 << 20, cycle_s=60.0)
    hs = [handle(i) for i in range(3)]
    for h in hs:
        buf.add(h, SPEC, "s", 0, 0, 16)
    buf.flush()
    assert all(h.done() and isinstance(h.error, BPSConnectionError) for h in hs)
    buf.close()


def test_an_entry_waited_for_at_once_goes_now_with_what_waits_and_wakes_no_flusher():
    """A synchronous push_pull (``now``): its entry and those waiting before it go in one batch at once, in
    the calling thread; the flusher thread is not started for it."""
    rec = Recorder()
    buf = FusionBuffer(rec, limit_bytes=1 << 20, cycle_s=60.0)
    buf.add(handle(1), SPEC, "s", 0, 0, 16, now=True)
    assert [b.reqs for _, b in rec.sent] == [[1]] and buf._thread is None
    buf.add(handle(2), SPEC, "s", 16, 0, 16)  # waits for the cycle (the flusher starts)
    assert len(rec.sent) == 1 and buf._thread is not None
    buf.add(handle(3), SPEC, "s", 32, 0, 16, now=True)
    assert [b.reqs for _, b in rec.sent] == [[1], [2, 3]]
    buf.close()
