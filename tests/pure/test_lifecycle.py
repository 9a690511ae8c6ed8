"""The daemons' start-up helpers that change the process itself (bps_runtime.lifecycle)."""

from __future__ import annotations

import gc

from bps_runtime.lifecycle import settle_heap


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
