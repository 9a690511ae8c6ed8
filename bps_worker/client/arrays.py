"""The numpy side of the wire's dtypes: which arrays the client can hand over, and views of shared memory.

Pure: no socket, no state. ``NUMPY_DTYPES`` maps the wire's dtype names (:mod:`protocol.dtypes`) to numpy
dtypes (bfloat16 through ``ml_dtypes``); :func:`dtype_name` goes back and refuses what the wire cannot carry.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from math import prod
from typing import Any, Final

import numpy as np

from ..errors import BPSError

__all__ = ["NUMPY_DTYPES", "bfloat16", "bytes_of", "dtype_name", "same_memory", "view_of", "wire_name"]

_WIRE_NAMES: Final = ("float32", "float64", "float16", "bfloat16", "int32", "int64")


def bfloat16() -> np.dtype:
    """numpy's bfloat16, from ``ml_dtypes``, imported on first use: the import costs more than a second of
    CPU (all its float8 and int4 types and their ufunc loops), which every training process paid at
    ``import bps_worker.client`` whether it used bfloat16 or not."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


class _Dtypes(Mapping[str, np.dtype]):
    """The wire's dtype names to numpy dtypes, read-only; bfloat16 is resolved on first access."""

    def __init__(self) -> None:
        self._known: dict[str, np.dtype] = {name: np.dtype(name) for name in _WIRE_NAMES if name != "bfloat16"}

    def __getitem__(self, name: str) -> np.dtype:
        if name == "bfloat16" and name not in self._known:
            self._known[name] = bfloat16()
        return self._known[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_WIRE_NAMES)

    def __len__(self) -> int:
        return len(_WIRE_NAMES)

    def __contains__(self, name: object) -> bool:
        return name in _WIRE_NAMES

    def __repr__(self) -> str:
        return f"NUMPY_DTYPES({', '.join(_WIRE_NAMES)})"


NUMPY_DTYPES: Final[Mapping[str, np.dtype]] = _Dtypes()
_NAME_OF: Final[dict[np.dtype, str]] = {NUMPY_DTYPES[name]: name for name in _WIRE_NAMES if name != "bfloat16"}


def dtype_name(dtype: Any) -> str:
    """The wire's name of ``dtype``; BPSError naming the supported ones if the wire cannot carry it."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        if dtype != "bfloat16":  # a name numpy knows only once ml_dtypes is imported
            raise
        dt = bfloat16()
    name = wire_name(dt)
    if name is not None:
        return name
    native = dt.newbyteorder("=")
    if native != dt and wire_name(native) is not None:  # (">f4" printed as "unsupported dtype >f4; supported:
        # float32, ...": a review; the daemons sum in the machine's order)
        raise BPSError(f"unsupported dtype {dt.str}: {native.name} in non-native byte order; pass "
                       f"array.astype({native.name!r}) (broadcast carries any byte order as it is)")
    raise BPSError(f"unsupported dtype {dt}; supported: {', '.join(NUMPY_DTYPES)}")


def wire_name(dt: np.dtype) -> str | None:
    """The wire's name of ``dt``, or None where the wire does not carry it (then only its bytes can travel)."""
    name = _NAME_OF.get(dt)
    if name is not None:
        return name
    if dt.name == "bfloat16" and dt == bfloat16():  # such an array means ml_dtypes is imported already
        return "bfloat16"
    return None


def bytes_of(words: np.ndarray, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` bytes of a byte broadcast's result (int32 words, see
    ``Operations.start_broadcast_bytes``), as uint8."""
    return words.view(np.uint8)[:nbytes]


def view_of(buf: memoryview | None, dtype: np.dtype, shape: tuple[int, ...], offset: int) -> np.ndarray:
    """``shape`` elements of ``dtype`` at ``offset`` in ``buf`` (a shared-memory segment's), as an array."""
    if buf is None:  # SharedMemory.buf after close(): only after shutdown()
        raise BPSError("the shared-memory segment was closed (bps_worker.client.shutdown() was called)")
    flat = np.frombuffer(buf, dtype=dtype, count=prod(shape), offset=offset)
    return flat if len(shape) == 1 else flat.reshape(shape)


def same_memory(view: np.ndarray, array: np.ndarray) -> bool:
    """Whether ``array`` is exactly ``view`` (same first byte, both contiguous, same size)."""
    if array.base is None:  # it owns its memory, so it is no view of shared memory: most inputs, at once
        return False
    if not np.may_share_memory(view, array):  # by their bounds: the common answer for the rest
        return False
    return (array.size == view.size and array.dtype == view.dtype and array.flags.c_contiguous
            and (array.size == 0 or array.__array_interface__["data"][0] == view.__array_interface__["data"][0]))
