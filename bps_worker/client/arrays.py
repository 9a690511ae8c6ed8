"""The numpy side of the wire's dtypes: which arrays the client can hand over, and views of shared memory.

Pure: no socket, no state. ``NUMPY_DTYPES`` maps the wire's dtype names (:mod:`protocol.dtypes`) to numpy
dtypes (bfloat16 through ``ml_dtypes``); :func:`dtype_name` goes back and refuses what the wire cannot carry.
"""

from __future__ import annotations

from math import prod
from typing import Final

import ml_dtypes
import numpy as np

from ..errors import BPSError

__all__ = ["NUMPY_DTYPES", "dtype_name", "same_memory", "view_of"]

NUMPY_DTYPES: Final[dict[str, np.dtype]] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
}
_NAME_OF: Final[dict[np.dtype, str]] = {v: k for k, v in NUMPY_DTYPES.items()}


def dtype_name(dtype: np.dtype) -> str:
    """The wire's name of ``dtype``; BPSError naming the supported ones if the wire cannot carry it."""
    try:
        return _NAME_OF[np.dtype(dtype)]
    except KeyError:
        raise BPSError(f"unsupported dtype {np.dtype(dtype)}; supported: {', '.join(NUMPY_DTYPES)}") from None


def view_of(buf: memoryview | None, dtype: np.dtype, shape: tuple[int, ...], offset: int) -> np.ndarray:
    """``shape`` elements of ``dtype`` at ``offset`` in ``buf`` (a shared-memory segment's), as an array."""
    if buf is None:  # SharedMemory.buf after close(): only after shutdown()
        raise BPSError("the shared-memory segment was closed (bps_worker.client.shutdown() was called)")
    return np.frombuffer(buf, dtype=dtype, count=prod(shape), offset=offset).reshape(shape)


def same_memory(view: np.ndarray, array: np.ndarray) -> bool:
    """Whether ``array`` is exactly ``view`` (same first byte, both contiguous, same size)."""
    return (array.size == view.size and array.dtype == view.dtype and array.flags.c_contiguous
            and (array.size == 0 or array.__array_interface__["data"][0] == view.__array_interface__["data"][0]))
