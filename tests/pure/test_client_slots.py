"""A slot's view of itself (bps_worker.client.slots.Slot.view), kept from one operation to the next, and
same_memory's answer for arrays that own their memory (bps_worker.client.arrays): what push_pull_async no
longer pays for per call must still give the right array for every dtype and shape a name is used with."""

from __future__ import annotations

from typing import Any

import numpy as np

from bps_worker.client.arrays import same_memory, view_of
from bps_worker.client.slots import Slot


class _Segment:
    """What a Slot reads of a SharedMemory: its buffer."""

    def __init__(self, nbytes: int) -> None:
        self.name = "bps_test_segment"
        self.buf = memoryview(bytearray(nbytes))


def _slot(nbytes: int = 64, offset: int = 16) -> Slot:
    segment: Any = _Segment(offset + nbytes)
    return Slot(segment, offset, nbytes, 0)


def test_the_same_dtype_and_shape_give_the_same_view_of_the_slot() -> None:
    slot = _slot()
    first = slot.view(np.dtype(np.float32), (4,))
    assert slot.view(np.dtype("float32"), (4,)) is first
    first[:] = [1, 2, 3, 4]
    assert np.frombuffer(slot.segment.buf, np.float32, 4, slot.offset).tolist() == [1, 2, 3, 4]


def test_another_shape_or_dtype_of_the_name_gets_a_view_of_its_own() -> None:
    slot = _slot()
    flat = slot.view(np.dtype(np.float32), (4,))
    flat[:] = [1, 2, 3, 4]
    square = slot.view(np.dtype(np.float32), (2, 2))
    assert square.shape == (2, 2) and square.tolist() == [[1, 2], [3, 4]]
    ints = slot.view(np.dtype(np.int32), (2, 2))
    assert ints.dtype == np.int32 and ints.shape == (2, 2)
    longer = slot.view(np.dtype(np.float64), (8,))  # the whole capacity
    assert longer.dtype == np.float64 and longer.shape == (8,)
    again = slot.view(np.dtype(np.float32), (4,))
    assert again.shape == (4,) and again.dtype == np.float32 and again.tolist() == longer[:2].view(np.float32).tolist()


def test_a_slot_that_moved_is_a_new_slot_with_a_view_of_the_new_memory() -> None:
    old, new = _slot(offset=0), _slot(offset=32)
    old.view(np.dtype(np.float32), (4,))[:] = 7
    assert new.view(np.dtype(np.float32), (4,)).tolist() == [0, 0, 0, 0]


def test_an_array_that_owns_its_memory_is_never_the_slot_and_views_of_the_slot_are_told_apart() -> None:
    buf = memoryview(bytearray(64))
    view = view_of(buf, np.dtype(np.float32), (4,), 16)
    assert not same_memory(view, np.zeros(4, np.float32))  # owns its memory: no bounds check needed
    assert same_memory(view, view_of(buf, np.dtype(np.float32), (4,), 16))  # another array object, same bytes
    assert same_memory(view, np.frombuffer(buf, np.float32)[4:8])
    assert not same_memory(view, np.frombuffer(buf, np.float32)[5:9])  # overlaps, starts elsewhere
    assert not same_memory(view, view_of(buf, np.dtype(np.float32), (2,), 16))  # a part of it
    assert not same_memory(view, np.zeros(8, np.float32)[2:6])  # a view, of other memory
