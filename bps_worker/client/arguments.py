"""Checks of the user's arguments, before anything is sent (nats-core raises ``MaxPayloadError`` the same way).

Pure: no socket, no state. A bad argument fails only its own call, with a :class:`BPSError` that names the
argument and the limit. Let through, it would fail later and worse: a name the daemon's message checks refuse
(more than ``MAX_NAME_CHARS`` characters) makes it drop the whole connection, so every later call fails; a
name that UTF-8 cannot encode, or an integer msgpack cannot carry, raises a non-BPSError in the middle of a
start. The limits are the protocol's (:mod:`protocol.messages`) and msgpack's integers.
"""

from __future__ import annotations

import operator
from math import prod
from typing import Final, Iterable, SupportsIndex

import numpy as np

from protocol import dtypes
from protocol.messages import FUSED_PREFIX, MAX_DIMS, MAX_LAYOUT_CHARS, MAX_NAME_CHARS

from ..errors import BPSError
from .arrays import bfloat16, dtype_name

__all__ = ["GROUP_PREFIX", "INPUT_PREFIX", "SLAB_PREFIX", "WIRE_INT_MAX", "WIRE_INT_MIN", "check_average",
           "check_dtype", "check_layout", "check_name", "check_out", "check_priority", "check_shape"]

# The integers a control message carries are msgpack's signed 64-bit ones (a larger one cannot be encoded).
WIRE_INT_MIN: Final = -(1 << 63)
WIRE_INT_MAX: Final = (1 << 63) - 1
# The prefix of the names push_pull_group gives the tensors it packs a group's small entries into
# (bps_worker.client.group); a user's name may not start with it.
GROUP_PREFIX: Final = "\x00group/"
SLAB_PREFIX: Final = "\x00slab/"  # the slabs this process carves its small tensors from (client.slots)
# The slots of our own that a shared array's fused sum reads from and comes back to (client.operations: _fill).
INPUT_PREFIX: Final = "\x00input/"


def check_name(name: object, *, internal: bool = False) -> str:
    """``name`` if it can name a tensor on the wire: a non-empty str of at most ``MAX_NAME_CHARS`` characters
    that UTF-8 can encode, not one of the client's slabs (``SLAB_PREFIX``), and not one of its packed
    tensors (``GROUP_PREFIX``) unless ``internal``."""
    if not isinstance(name, str) or not name:
        raise BPSError(f"tensor name must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_CHARS:
        raise BPSError(f"tensor name of {len(name)} characters is too long: at most {MAX_NAME_CHARS} "
                       f"(it starts {name[:40]!r})")
    if name.startswith(FUSED_PREFIX):
        raise BPSError(f"tensor name {name[:40]!r}: names starting {FUSED_PREFIX!r} are the worker daemon's own "
                       f"(its fused tensors)")
    for prefix, what in ((SLAB_PREFIX, "its shared-memory slabs"), (INPUT_PREFIX, "its copies of shared arrays")):
        if name.startswith(prefix):
            raise BPSError(f"tensor name {name[:40]!r}: names starting {prefix!r} are the client's own ({what})")
    if not internal and name.startswith(GROUP_PREFIX):
        raise BPSError(f"tensor name {name[:40]!r}: names starting {GROUP_PREFIX!r} are the client's own "
                       f"(push_pull_group's packed tensors)")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BPSError(f"tensor name {name!r} cannot be encoded as UTF-8 ({exc.reason} at character "
                       f"{exc.start}); use characters UTF-8 can encode") from None
    return name


def check_layout(name: str, layout: object) -> str:
    """A framework layer's ``layout`` (see ``protocol.messages.Op.layout``): a str of at most
    ``MAX_LAYOUT_CHARS`` characters."""
    if not isinstance(layout, str) or len(layout) > MAX_LAYOUT_CHARS:
        raise BPSError(f"tensor {name!r}: layout must be a string of at most {MAX_LAYOUT_CHARS} characters, "
                       f"got {layout!r:.80}")
    return layout


def check_priority(name: str, priority: object) -> int:
    """``priority`` as an int, if it is an integer msgpack can carry (not a bool: ``priority=True`` is a slip for
    another argument, e.g. ``average``, not priority 1)."""
    if isinstance(priority, (bool, np.bool_)):
        raise BPSError(f"tensor {name!r}: priority must be an integer, got {priority!r}")
    try:
        value = operator.index(priority)  # type: ignore[arg-type]
    except TypeError:
        raise BPSError(f"tensor {name!r}: priority must be an integer, got {priority!r}") from None
    if not WIRE_INT_MIN <= value <= WIRE_INT_MAX:
        raise BPSError(f"tensor {name!r}: priority {value} is out of range: {WIRE_INT_MIN}..{WIRE_INT_MAX}")
    return value


def check_staleness(staleness: object) -> int:
    """An async_init's staleness bound on the wire: -1 for None, else the bound (an integer >= 0 of any integer
    type, as numpy's; not a bool)."""
    if staleness is None:
        return -1
    try:
        bound = operator.index(staleness)  # type: ignore[arg-type]
    except TypeError:
        bound = -1
    if isinstance(staleness, (bool, np.bool_)) or bound < 0:
        raise BPSError(f"staleness must be None or an integer >= 0, got {staleness!r}")
    return bound


def check_average(name: str, average: object, wire: str) -> bool:
    """``average`` as a bool; averaging needs a floating dtype (an integer mean would be rounded)."""
    flag = bool(average)
    if flag and wire not in dtypes.FLOAT_TYPES:
        raise BPSError(f"tensor {name!r}: average=True needs a floating dtype, got {wire}; pass average=False")
    return flag


def check_shape(name: str, shape: Iterable[SupportsIndex] | SupportsIndex, dtype: np.dtype) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, if it has at most ``MAX_DIMS`` non-negative dimensions and its bytes fit
    a wire integer; one integer is a 1-d shape, as numpy takes it (``shared_array("x", 4)``)."""
    if type(shape) is tuple and all(type(d) is int for d in shape):  # an array's shape: as it is
        dims: tuple[int, ...] = shape
    elif isinstance(shape, Iterable):
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:  # a float dimension
            raise BPSError(f"tensor {name!r}: shape must hold integers, got {shape!r}") from None
    elif hasattr(type(shape), "__index__") and not isinstance(shape, (bool, np.bool_)):  # (a bool: a slip)
        dims = (operator.index(shape),)
    else:
        raise BPSError(f"tensor {name!r}: shape must hold integers, got {shape!r}")
    if any(d < 0 for d in dims):
        raise BPSError(f"tensor {name!r}: negative dimension in shape {dims}")
    if len(dims) > MAX_DIMS:
        raise BPSError(f"tensor {name!r}: {len(dims)} dimensions; at most {MAX_DIMS}")
    nbytes = prod(dims) * np.dtype(dtype).itemsize
    if nbytes > WIRE_INT_MAX:
        raise BPSError(f"tensor {name!r}: {nbytes} bytes; at most {WIRE_INT_MAX}")
    return dims


def check_out(name: str, out: object, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
    """``out`` if it is None or a writable numpy array of ``shape`` and ``dtype``."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != dtype:
        raise BPSError(f"tensor {name!r}: out must be a numpy array of shape {shape} and dtype {dtype}")
    if not out.flags.writeable:
        raise BPSError(f"tensor {name!r}: out is read-only")
    return out


def check_dtype(dtype: object) -> tuple[np.dtype, str]:
    """The numpy dtype and its wire name, if the wire can carry it."""
    try:
        numpy_dtype = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        if not (isinstance(dtype, str) and dtype == "bfloat16"):  # (a name numpy knows once ml_dtypes is imported)
            raise BPSError(f"unsupported dtype {dtype!r}") from None
        numpy_dtype = bfloat16()
    return numpy_dtype, dtype_name(numpy_dtype)
