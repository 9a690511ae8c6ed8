"""The daemons' start-up helpers that change the process itself (bps_runtime.lifecycle)."""

from __future__ import annotations

import asyncio
import gc
import weakref

from bps_runtime.lifecycle import ClockedCollection, settle_heap


def test_settle_heap_takes_what_start_up_built_out_of_the_collectors_walks():
    gc.unfreeze()
    start_up = [[i] for i in range(10_000)]  # long-lived containers, as numba's import leaves
    try:
        settle_heap()
        assert gc.get_freeze_count() >= len(start_up)
        tracked = {id(o) for o in gc.get_objects()}
        assert id(start_up) not in tracked and id(start_up[0]) not in tracked  # no generation holds them now
        later = [1]
        assert id(later) in {id(o) for o in gc.get_objects()}  # what the daemon allocates after is collected
        assert gc.isenabled()
    finally:
        gc.unfreeze()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_clocked_collection_collects_on_the_loops_clock_youngest_middle_and_full():
    thresholds = gc.get_threshold()
    generations: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            generations.append(info["generation"])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        collection = ClockedCollection(loop, 0.01, middle_every=3, full_every=6)
        try:
            assert gc.get_threshold() == (ClockedCollection.VALVE, *thresholds[1:])
            garbage = weakref.ref(_Cycle())  # only the cyclic collector can free it
            assert garbage() is not None
            gc.callbacks.append(seen)
            while collection.ticks < 6:
                await asyncio.sleep(0.005)
            gc.callbacks.remove(seen)
            assert garbage() is None
            assert generations == [0, 0, 1, 0, 0, 2]
        finally:
            collection.stop()
        assert gc.get_threshold() == thresholds
        ticks = collection.ticks
        await asyncio.sleep(0.05)
        assert collection.ticks == ticks  # stopped: no more ticks
        collection.stop()  # a second stop does nothing

    asyncio.run(main())


def test_clocked_collection_still_collects_a_burst_between_ticks():
    async def main() -> None:
        collection = ClockedCollection(asyncio.get_running_loop(), 3600)
        try:
            first = weakref.ref(_Cycle())
            burst = [[i] for i in range(ClockedCollection.VALVE + 1000)]  # alive: the valve's count
            assert first() is None  # collected without a tick
            del burst
        finally:
            collection.stop()

    asyncio.run(main())
