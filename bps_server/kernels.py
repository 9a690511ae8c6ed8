"""Summation kernels: numba-jitted, ``nogil``, over raw byte buffers.

Both the server (summing the workers' pushes) and the worker (summing its local
processes' tensors) use these. Buffers arrive as byte views (shared memory,
socket payloads); :func:`as_array` reinterprets them without a copy.

float16 and bfloat16 are handled as uint16 bit patterns (numba has no half
type on the CPU): they are widened to float32, accumulated in float32 and
rounded to nearest-even exactly once, in :func:`finalize`. The rounding code
matches numpy's (float16) and ml_dtypes' (bfloat16) conversions bit for bit;
``tests/test_kernels.py`` checks that.

Kernels compile on first use and are cached on disk; daemons call
:func:`warm_up` before they report ready so no job pays for compilation.
"""

from __future__ import annotations

from typing import Final

import numba
import numpy as np

from protocol import dtypes

# Storage dtype of each wire dtype, as seen by the kernels.
STORAGE: Final[dict[str, np.dtype]] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float16": np.dtype(np.uint16),
    "bfloat16": np.dtype(np.uint16),
}
ACCUMULATOR: Final[dict[str, np.dtype]] = {name: np.dtype(dtypes.accumulator_dtype(name)) for name in STORAGE}

_F16_TO_F32: Final = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_jit = numba.njit(nogil=True, cache=True, fastmath=False, boundscheck=False)


@_jit
def _copy(dst, src):  # type: ignore[no-untyped-def]
    for i in range(dst.size):
        dst[i] = src[i]


@_jit
def _add(acc, x):  # type: ignore[no-untyped-def]
    for i in range(acc.size):
        acc[i] += x[i]


@_jit
def _sum2(out, a, b):  # type: ignore[no-untyped-def]
    for i in range(out.size):
        out[i] = a[i] + b[i]


@_jit
def _div(out, acc, divisor):  # type: ignore[no-untyped-def]
    d = acc.dtype.type(divisor)
    for i in range(out.size):
        out[i] = acc[i] / d


@_jit
def _widen_f16(acc, x, table):  # type: ignore[no-untyped-def]
    for i in range(acc.size):
        acc[i] = table[x[i]]


@_jit
def _add_f16(acc, x, table):  # type: ignore[no-untyped-def]
    for i in range(acc.size):
        acc[i] += table[x[i]]


@_jit
def _widen_bf16(acc, x):  # type: ignore[no-untyped-def]
    bits = acc.view(np.uint32)
    for i in range(acc.size):
        bits[i] = np.uint32(x[i]) << np.uint32(16)


@_jit
def _add_bf16(acc, x):  # type: ignore[no-untyped-def]
    tmp = np.empty(1, np.uint32)
    f = tmp.view(np.float32)
    for i in range(acc.size):
        tmp[0] = np.uint32(x[i]) << np.uint32(16)
        acc[i] += f[0]


@_jit
def _f32_bits_to_f16(f):  # type: ignore[no-untyped-def]
    # Port of numpy's npy_floatbits_to_halfbits (round to nearest even).
    h_sgn = (f & np.uint32(0x80000000)) >> np.uint32(16)
    f_exp = f & np.uint32(0x7F800000)
    if f_exp >= np.uint32(0x47800000):
        if f_exp == np.uint32(0x7F800000):
            f_sig = f & np.uint32(0x007FFFFF)
            if f_sig != 0:
                ret = np.uint32(0x7C00) + (f_sig >> np.uint32(13))
                if ret == np.uint32(0x7C00):
                    ret += np.uint32(1)
                return h_sgn + ret
            return h_sgn + np.uint32(0x7C00)
        return h_sgn + np.uint32(0x7C00)
    if f_exp <= np.uint32(0x38000000):
        if f_exp < np.uint32(0x33000000):
            return h_sgn
        e = f_exp >> np.uint32(23)
        f_sig = np.uint32(0x00800000) + (f & np.uint32(0x007FFFFF))
        f_sig = f_sig >> (np.uint32(113) - e)
        if ((f_sig & np.uint32(0x00003FFF)) != np.uint32(0x00001000)) or (f & np.uint32(0x000007FF)) != 0:
            f_sig += np.uint32(0x00001000)
        return h_sgn + (f_sig >> np.uint32(13))
    h_exp = (f_exp - np.uint32(0x38000000)) >> np.uint32(13)
    f_sig = f & np.uint32(0x007FFFFF)
    if (f_sig & np.uint32(0x00003FFF)) != np.uint32(0x00001000):
        f_sig += np.uint32(0x00001000)
    return h_sgn + (f_sig >> np.uint32(13)) + h_exp


@_jit
def _round_f16(out, acc, divisor):  # type: ignore[no-untyped-def]
    d = np.float32(divisor)
    tmp = np.empty(1, np.float32)
    bits = tmp.view(np.uint32)
    for i in range(out.size):
        tmp[0] = acc[i] / d if divisor != 1 else acc[i]
        out[i] = np.uint16(_f32_bits_to_f16(bits[0]))


@_jit
def _round_bf16(out, acc, divisor):  # type: ignore[no-untyped-def]
    # Round to nearest even; NaNs stay (quiet) NaNs, as in ml_dtypes.
    d = np.float32(divisor)
    tmp = np.empty(1, np.float32)
    bits = tmp.view(np.uint32)
    for i in range(out.size):
        tmp[0] = acc[i] / d if divisor != 1 else acc[i]
        b = bits[0]
        if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            out[i] = np.uint16((b >> np.uint32(16)) | np.uint32(0x0040))
        else:
            lsb = (b >> np.uint32(16)) & np.uint32(1)
            out[i] = np.uint16((b + np.uint32(0x7FFF) + lsb) >> np.uint32(16))


def as_array(buffer: memoryview | bytearray | np.ndarray, dtype: str) -> np.ndarray:
    """A flat kernel-view (storage dtype) of ``buffer``, without copying."""
    return np.frombuffer(buffer, dtype=STORAGE[dtype]) if not isinstance(buffer, np.ndarray) \
        else buffer.reshape(-1).view(STORAGE[dtype])


def new_accumulator(dtype: str, count: int) -> np.ndarray:
    return np.empty(count, dtype=ACCUMULATOR[dtype])


def accumulate(acc: np.ndarray, x: np.ndarray, dtype: str, first: bool) -> None:
    """``acc = x`` (first contribution) or ``acc += x``, widening half types to float32."""
    if acc.size != x.size:
        raise ValueError(f"accumulate: {acc.size} elements vs {x.size}")
    if dtype == "float16":
        (_widen_f16 if first else _add_f16)(acc, x, _F16_TO_F32)
    elif dtype == "bfloat16":
        (_widen_bf16 if first else _add_bf16)(acc, x)
    elif first:
        _copy(acc, x)
    else:
        _add(acc, x)


def finalize(out: np.ndarray, acc: np.ndarray, dtype: str, divisor: int = 1) -> None:
    """Write ``acc / divisor`` into ``out`` in the tensor's dtype, rounding once."""
    if dtype == "float16":
        _round_f16(out, acc, divisor)
    elif dtype == "bfloat16":
        _round_bf16(out, acc, divisor)
    elif divisor != 1:
        _div(out, acc, divisor)
    elif out is not acc:
        _copy(out, acc)


def sum_into(out: np.ndarray, inputs: list[np.ndarray], dtype: str, divisor: int = 1,
             scratch: np.ndarray | None = None) -> None:
    """``out = sum(inputs) / divisor`` in the tensor's dtype (storage views), rounding once.

    Half types need a float32 ``scratch`` of the same length (allocated if not given).
    """
    if not inputs:
        raise ValueError("sum_into needs at least one input")
    if dtype in dtypes.HALF_TYPES:
        acc = scratch if scratch is not None else new_accumulator(dtype, out.size)
        accumulate(acc, inputs[0], dtype, True)
        for x in inputs[1:]:
            accumulate(acc, x, dtype, False)
        finalize(out, acc, dtype, divisor)
        return
    if len(inputs) == 1:
        _copy(out, inputs[0])
    else:
        _sum2(out, inputs[0], inputs[1])
        for x in inputs[2:]:
            _add(out, x)
    if divisor != 1:
        _div(out, out, divisor)


def warm_up() -> None:
    """Compile (or load from the on-disk cache) every kernel for every dtype."""
    for name in STORAGE:
        count = 4
        xs = [np.zeros(count, dtype=STORAGE[name]) for _ in range(3)]
        out = np.zeros(count, dtype=STORAGE[name])
        acc = new_accumulator(name, count)
        accumulate(acc, xs[0], name, True)
        accumulate(acc, xs[1], name, False)
        finalize(out, acc, name, 1)
        if name in dtypes.FLOAT_TYPES:
            finalize(out, acc, name, 2)
        sum_into(out, xs[:1], name)
        sum_into(out, xs, name)
