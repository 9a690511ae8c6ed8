"""The hand-back of an operation's sums into the slots of the processes that pushed in place (``CpuPath``,
``HandBack``): a process that leaves mid-operation gets no more pieces, and its live local peers get theirs."""

from __future__ import annotations

import asyncio
import types
from functools import partial
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import pytest

from bps_worker.operation import CpuPath, HandBack

pytestmark = pytest.mark.timeout(30)


async def test_a_process_that_left_mid_operation_gets_no_pieces_and_its_local_peer_gets_every_one() -> None:
    """Two local ranks pushed one tensor in place (shared arrays); rank 1 is killed after the first piece's sum
    came. Rank 0 gets the second piece and its operation succeeds: the round was summed for every machine (it
    failed, "its memory went with the process", while the other machines got the sum: a review's case)."""
    segments = [SharedMemory(create=True, size=32) for _ in range(2)]
    for seg in segments:
        seg.buf[:] = bytes(seg.size)  # (allocated, as the client's create_segment makes them: not sparse)
    try:
        members = []
        for rank, seg in enumerate(segments):
            session = types.SimpleNamespace(closed=False, local_rank=rank, pid=100 + rank,
                                            arena=types.SimpleNamespace(segments={seg.name: seg}))
            members.append((session, types.SimpleNamespace(handback=True, segment=seg.name, offset=0)))
        op = types.SimpleNamespace(members=members, name="t", nbytes=32,
                                   host=types.SimpleNamespace(results=types.SimpleNamespace(slots={})))
        path = CpuPath()
        path.views = [np.frombuffer(seg.buf, np.float32, 8) for seg in segments]
        slots = path.handback_slots(op)  # type: ignore[arg-type]
        out = np.arange(8, dtype=np.float32) + 1
        loop = asyncio.get_running_loop()
        intact = partial(path.intact, op)
        for lo, hi in ((0, 4), (4, 8)):
            if lo:  # rank 1 left between the pieces: its segment freed, its name gone
                members[1][0].closed = True
                del members[1][0].arena.segments[segments[1].name]
                segments[1].unlink()
                await asyncio.sleep(0)  # (the next pass of the loop: slots checked again)
            done: asyncio.Future[None] = loop.create_future()
            done.set_result(None)
            HandBack(out, slots, lo, hi, intact)(done)
        await path.copy_back(op, out)  # type: ignore[arg-type]
        np.testing.assert_array_equal(path.views[0], out)
        np.testing.assert_array_equal(path.views[1][:4], out[:4])
        np.testing.assert_array_equal(path.views[1][4:], 0)  # (nothing copied into the memory of the one that left)
    finally:
        path.views = path.targets = []
        del slots
        for seg in segments:
            seg.close()
        segments[0].unlink()
