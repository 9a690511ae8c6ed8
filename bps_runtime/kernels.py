"""Summation kernels: numba-jitted, ``nogil``, over raw byte buffers.

Both the server (summing the workers' pushes) and the worker (summing its local
processes' tensors) use these. Buffers arrive as byte views (shared memory,
socket payloads); :func:`as_array` reinterprets them without a copy.

float16 and bfloat16 are handled as uint16 bit patterns (numba has no half
type on the CPU): they are widened to float32, accumulated in float32 and
rounded to nearest-even exactly once, in :func:`finalize`. The conversions
match numpy's (float16, NaN payloads included) and ml_dtypes' (bfloat16) bit
for bit, but for a bfloat16 NaN: ml_dtypes makes every NaN 0x7FC0 (0xFFC0),
we keep its payload and set the quiet bit (the sign too); every process gets
the same bytes either way. ``tests/pure/test_kernels.py`` checks that.

Speed. Every kernel is a streaming loop that LLVM vectorizes (AVX2/AVX-512 on
x86); on the server's 4 MiB partitions they run at memory speed (measurements:
``benchmarks/kernels.py``, ``benchmarks/RESULTS.md``):

* The float16 <-> float32 conversions use the CPU's instructions (F16C's
  ``vcvtph2ps``/``vcvtps2ph`` on x86) where LLVM has them, else branchless bit
  arithmetic; both are written as LLVM IR (:func:`_f16_to_f32`,
  :func:`_f32_to_f16`, ...) because numba types integer arithmetic as 64-bit,
  which halves the vector lanes. (The former table lookup was a gather, which
  does not vectorize.) The instructions quiet a signalling NaN where numpy keeps
  it; a fix-up restores numpy's bits, except in the ``_arith`` variants used
  where the value is an operand or a result of arithmetic, which never leaves a
  signalling NaN anyway (every result is then the same bit for bit).
* A half-type average over a power of two multiplies by the exact reciprocal
  (the same real number as the quotient, so the same rounding); other
  divisors divide.
* Full-width types take numpy's ufuncs for single passes (``acc += x``, copies,
  divisions): its hand-vectorized loops are as fast as memory allows, and
  LLVM's in-place add measured 2-5% slower on 64 MiB.
* :func:`sum_into` (the worker's local sum of ``k`` tensors) reads each input
  once and writes ``out`` once: two inputs in one fused loop, more in blocks
  that stay in the L1 cache, instead of a read-modify-write pass per input.

Kernels compile on first use and are cached on disk; daemons call
:func:`warm_up` before they report ready, and it compiles every specialization
the daemons use, so no job pays for compilation (``tests/pure/test_kernels.py``
checks that nothing compiles after it).
"""

from __future__ import annotations

import contextlib
import platform
import sys
from functools import partial
from typing import Any, Callable, Final, Iterator, Sequence

import numba
import numpy as np
from llvmlite import ir
from numba.core import codegen, types
from numba.extending import intrinsic

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

# Elements per block of sum_into: the float32 block (16 KiB) and an output block stay in L1.
_BLOCK: Final = 4096

_jit = numba.njit(nogil=True, cache=True, fastmath=False, boundscheck=False)


# -- bit-exact conversions, as LLVM IR ------------------------------------------------------------
# Written as IR because numba types integer arithmetic as (u)int64, which would halve the vector lanes.
# Each _emit_* function takes an IR builder and a value and returns the converted value; the
# intrinsics made of them (_conversion, below) are what the kernels call.

_I16, _I32, _F16, _F32 = ir.IntType(16), ir.IntType(32), ir.HalfType(), ir.FloatType()


def _u32(value: int) -> ir.Constant:
    return ir.Constant(_I32, value)


def _emit_soft_f16_to_f32(b: ir.IRBuilder, h: ir.Value) -> ir.Value:
    """float16 bits -> float32 in integer arithmetic (plus one exact subtraction).

    ``(h & 0x7FFF) << 13`` puts the 5-bit exponent and 10-bit mantissa under float32's; adding
    ``(127 - 15) << 23`` rebiases the exponent, which is all a normal number needs. Two cases
    are selected afterwards (branchless, both computed):

    * exponent 31 (inf, NaN): add ``(128 - 16) << 23`` more, making the float32 exponent 255;
      the mantissa (the NaN payload) is kept.
    * exponent 0 (zero, subnormal ``m * 2^-24``): make the exponent that of ``2^-14`` (add
      ``1 << 23`` more), which gives the float ``2^-14 + m * 2^-24``; subtracting ``2^-14``
      leaves ``m * 2^-24``, exactly (and +0 for m = 0). No operand is a float32 subnormal.

    The sign is or-ed back in last.
    """
    h32 = b.zext(h, _I32)
    o = b.shl(b.and_(h32, _u32(0x7FFF)), _u32(13))
    exp = b.and_(o, _u32(0x0F800000))
    o = b.add(o, _u32(0x38000000))
    inf_nan = b.add(o, _u32(0x38000000))
    renormalized = b.fsub(b.bitcast(b.add(o, _u32(0x00800000)), _F32), ir.Constant(_F32, 2.0 ** -14))
    o = b.select(b.icmp_unsigned("==", exp, _u32(0x0F800000)), inf_nan, o)
    o = b.select(b.icmp_unsigned("==", exp, _u32(0)), b.bitcast(renormalized, _I32), o)
    return b.bitcast(b.or_(o, b.shl(b.and_(h32, _u32(0x8000)), _u32(16))), _F32)


def _emit_soft_f32_to_f16(b: ir.IRBuilder, f: ir.Value) -> ir.Value:
    """float32 -> float16 bits in integer arithmetic (plus one float addition), round to nearest even.

    On the magnitude ``a`` (float32 bits without the sign), three results, selected branchless:

    * normal (``2^-14 <= |f| < 2^16``): rebias the exponent (``- (127 - 15) << 23``) and add
      ``0xFFF + (bit 13 of a)`` before dropping the 13 low mantissa bits: round half to even. A
      carry out of the mantissa increments the exponent, up to infinity (0x7C00) for
      ``|f| >= 65520``, as it should.
    * small (``|f| < 2^-14``, float16 subnormal or zero): the float addition ``|f| + 0.5`` lands
      where one unit in the last place is ``2^-24``, the float16 subnormal step, so the FPU does
      the round to nearest even; the low bits of the sum minus those of 0.5 are the float16 bits.
    * ``|f| >= 2^16``: infinity, or for a NaN numpy's bits (:func:`_emit_numpy_f16_nan`).

    The sign is or-ed back in last.
    """
    u = b.bitcast(f, _I32)
    a = b.and_(u, _u32(0x7FFFFFFF))
    odd = b.and_(b.lshr(a, _u32(13)), _u32(1))
    normal = b.lshr(b.add(b.add(a, _u32((0xFFF - (112 << 23)) & 0xFFFFFFFF)), odd), _u32(13))
    small = b.sub(b.bitcast(b.fadd(b.bitcast(a, _F32), ir.Constant(_F32, 0.5)), _I32), _u32(0x3F000000))
    r = b.select(b.icmp_unsigned("<", a, _u32(0x38800000)), small, normal)
    r = b.select(b.icmp_unsigned(">=", a, _u32(0x47800000)), _u32(0x7C00), r)
    r = b.trunc(b.or_(r, b.lshr(b.and_(u, _u32(0x80000000)), _u32(16))), _I16)
    return _emit_numpy_f16_nan(b, u, r)


def _emit_numpy_f16_nan(b: ir.IRBuilder, u: ir.Value, r: ir.Value) -> ir.Value:
    """``r`` (float16 bits of float32 bits ``u``), except for a NaN ``u``: numpy's NaN.

    numpy keeps the sign and the top 10 payload bits, quiet or signalling as they are, and sets
    the lowest bit if those are all 0 (so the NaN does not become infinity).
    """
    payload = b.lshr(b.and_(u, _u32(0x007FFFFF)), _u32(13))
    nan = b.or_(b.or_(payload, _u32(0x7C00)), b.zext(b.icmp_unsigned("==", payload, _u32(0)), _I32))
    nan = b.trunc(b.or_(nan, b.lshr(b.and_(u, _u32(0x80000000)), _u32(16))), _I16)
    return b.select(b.icmp_unsigned(">", b.and_(u, _u32(0x7FFFFFFF)), _u32(0x7F800000)), nan, r)


def _emit_hard_f16_to_f32(b: ir.IRBuilder, h: ir.Value, exact_nan: bool = True) -> ir.Value:
    """float16 bits -> float32 with the CPU's conversion instruction (``vcvtph2ps`` on x86).

    It is exact, but sets the quiet bit of a signalling NaN, which numpy keeps: with
    ``exact_nan`` that bit is cleared again. Without, the result differs only in that bit, which
    is fine for an operand of arithmetic: the arithmetic quiets the NaN anyway, keeping its payload.
    """
    converted = b.fpext(b.bitcast(h, _F16), _F32)
    if not exact_nan:
        return converted
    is_nan = b.icmp_unsigned(">", b.and_(h, ir.Constant(_I16, 0x7FFF)), ir.Constant(_I16, 0x7C00))
    is_signalling = b.and_(is_nan, b.icmp_unsigned("==", b.and_(h, ir.Constant(_I16, 0x0200)), ir.Constant(_I16, 0)))
    bits = b.bitcast(converted, _I32)
    return b.bitcast(b.select(is_signalling, b.and_(bits, _u32(0xFFBFFFFF)), bits), _F32)


def _emit_hard_f32_to_f16(b: ir.IRBuilder, f: ir.Value, exact_nan: bool = True) -> ir.Value:
    """float32 -> float16 bits with the CPU's conversion instruction (``vcvtps2ph`` on x86).

    LLVM's ``fptrunc`` rounds to nearest even (the default floating-point environment, which
    numba never changes), through subnormals and to infinity exactly as numpy. A NaN keeps its
    sign and top 10 payload bits, as in numpy, but comes out quiet: for a signalling NaN, numpy
    keeps the quiet bit clear, and sets the lowest bit if the rest is 0 (a NaN, not infinity).
    ``exact_nan`` does the same; it is not needed if ``f`` is the result of arithmetic, which is
    never a signalling NaN. The fix-up works on the 16-bit result and on comparison masks: a
    version computing numpy's NaN in 32-bit lanes and narrowing them ran at half the speed.
    """
    converted = b.bitcast(b.fptrunc(f, _F16), _I16)
    if not exact_nan:
        return converted
    is_nan = b.fcmp_unordered("uno", f, f)
    quiet = b.icmp_unsigned("!=", b.and_(b.bitcast(f, _I32), _u32(0x00400000)), _u32(0))
    cleared = b.and_(converted, ir.Constant(_I16, 0xFDFF))
    empty = b.icmp_unsigned("==", b.and_(cleared, ir.Constant(_I16, 0x03FF)), ir.Constant(_I16, 0))
    signalling_nan = b.select(empty, b.or_(cleared, ir.Constant(_I16, 1)), cleared)
    return b.select(b.and_(is_nan, b.not_(quiet)), signalling_nan, converted)


def _emit_bf16_to_f32(b: ir.IRBuilder, h: ir.Value) -> ir.Value:
    """bfloat16 bits -> float32: the upper half of float32's bits (exact, NaN payloads kept)."""
    return b.bitcast(b.shl(b.zext(h, _I32), _u32(16)), _F32)


def _emit_f32_to_bf16(b: ir.IRBuilder, f: ir.Value) -> ir.Value:
    """float32 -> bfloat16 bits, round to nearest even, as ml_dtypes.

    Adding ``0x7FFF + (bit 16)`` before dropping the low 16 bits rounds half to even (a carry
    may reach infinity, correctly). A NaN is truncated with the quiet bit (0x40) set instead, so
    it stays a NaN of the same sign.
    """
    u = b.bitcast(f, _I32)
    lsb = b.and_(b.lshr(u, _u32(16)), _u32(1))
    rounded = b.lshr(b.add(b.add(u, _u32(0x7FFF)), lsb), _u32(16))
    quiet_nan = b.or_(b.lshr(u, _u32(16)), _u32(0x0040))
    is_nan = b.icmp_unsigned(">", b.and_(u, _u32(0x7FFFFFFF)), _u32(0x7F800000))
    return b.trunc(b.select(is_nan, quiet_nan, rounded), _I16)


def _cpu_converts_half() -> bool:
    """Whether LLVM turns ``fpext``/``fptrunc`` of half into instructions for numba's target CPU.

    x86 needs F16C (every x86-64 CPU since 2012-2013), aarch64 always has them; elsewhere (or
    without F16C) LLVM would call a runtime library function that numba may not link.
    """
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686", "x86"):
        features = numba.config.CPU_FEATURES or codegen.get_host_cpu_features()  # type: ignore[attr-defined]
        return "+f16c" in features.split(",")
    return machine in ("aarch64", "arm64")


_HARDWARE_HALF: Final = _cpu_converts_half()


def _conversion(name: str, arg: types.Type, result: types.Type, emit: Callable[..., ir.Value]) -> Any:
    """A numba intrinsic ``name(x: arg) -> result`` whose code is ``emit(builder, x)``."""
    def typer(typingctx, x):  # type: ignore[no-untyped-def]
        if x != arg:
            return None
        return result(x), lambda context, builder, sig, args: emit(builder, args[0])

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


# Exactly numpy's astype(np.float32) / astype(np.float16), NaN payloads included:
_f16_to_f32 = _conversion("_f16_to_f32", types.uint16, types.float32,
                          _emit_hard_f16_to_f32 if _HARDWARE_HALF else _emit_soft_f16_to_f32)
_f32_to_f16 = _conversion("_f32_to_f16", types.float32, types.uint16,
                          _emit_hard_f32_to_f16 if _HARDWARE_HALF else _emit_soft_f32_to_f16)
# The same, except that a signalling NaN may come out quiet: for operands and results of arithmetic.
_f16_to_f32_arith = _conversion("_f16_to_f32_arith", types.uint16, types.float32,
                                partial(_emit_hard_f16_to_f32, exact_nan=False) if _HARDWARE_HALF
                                else _emit_soft_f16_to_f32)
_f32_to_f16_arith = _conversion("_f32_to_f16_arith", types.float32, types.uint16,
                                partial(_emit_hard_f32_to_f16, exact_nan=False) if _HARDWARE_HALF
                                else _emit_soft_f32_to_f16)
# The portable ones, whatever the CPU (the tests check them on every machine).
_soft_f16_to_f32 = _conversion("_soft_f16_to_f32", types.uint16, types.float32, _emit_soft_f16_to_f32)
_soft_f32_to_f16 = _conversion("_soft_f32_to_f16", types.float32, types.uint16, _emit_soft_f32_to_f16)
_bf16_to_f32 = _conversion("_bf16_to_f32", types.uint16, types.float32, _emit_bf16_to_f32)
_f32_to_bf16 = _conversion("_f32_to_bf16", types.float32, types.uint16, _emit_f32_to_bf16)


@intrinsic
def _voidptr(typingctx, address):  # type: ignore[no-untyped-def]
    """An integer address as a pointer (for ``numba.carray``)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, b, sig, args):  # type: ignore[no-untyped-def]
        return b.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(address), codegen


# -- full-width types ---------------------------------------------------------------------------

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
def _is_power_of_two(n):  # type: ignore[no-untyped-def]
    return n > 0 and (n & (n - 1)) == 0


@_jit
def _div(out, acc, divisor):  # type: ignore[no-untyped-def]
    d = acc.dtype.type(divisor)
    if _is_power_of_two(divisor):
        r = acc.dtype.type(1) / d  # exact: x * (1/2^k) is the same real number as x / 2^k
        for i in range(out.size):
            out[i] = acc[i] * r
    else:
        for i in range(out.size):
            out[i] = acc[i] / d


# -- half types ---------------------------------------------------------------------------------
# float16 sums use the "_arith" conversions where a signalling NaN cannot matter (module docstring).

@_jit
def _widen_f16(acc, x):  # type: ignore[no-untyped-def]
    for i in range(acc.size):
        acc[i] = _f16_to_f32(x[i])


@_jit
def _add_f16(acc, x):  # type: ignore[no-untyped-def]
    for i in range(acc.size):
        acc[i] += _f16_to_f32_arith(x[i])


@_jit
def _sum2_f16(acc, a, b):  # type: ignore[no-untyped-def]
    for i in range(acc.size):
        acc[i] = _f16_to_f32_arith(a[i]) + _f16_to_f32_arith(b[i])


@_jit
def _sum2_round_f16(out, a, b):  # type: ignore[no-untyped-def]
    for i in range(out.size):
        out[i] = _f32_to_f16_arith(_f16_to_f32_arith(a[i]) + _f16_to_f32_arith(b[i]))


@_jit
def _round_f16(out, acc, divisor, sum_of_several):  # type: ignore[no-untyped-def]
    """``out = acc / divisor`` as float16; ``sum_of_several``: ``acc`` is a sum, so holds no signalling NaN."""
    if divisor == 1 and not sum_of_several:
        for i in range(out.size):
            out[i] = _f32_to_f16(acc[i])
    elif divisor == 1:
        for i in range(out.size):
            out[i] = _f32_to_f16_arith(acc[i])
    elif _is_power_of_two(divisor):
        r = np.float32(1) / np.float32(divisor)
        for i in range(out.size):
            out[i] = _f32_to_f16_arith(acc[i] * r)
    else:
        d = np.float32(divisor)
        for i in range(out.size):
            out[i] = _f32_to_f16_arith(acc[i] / d)


@_jit
def _widen_bf16(acc, x):  # type: ignore[no-untyped-def]
    for i in range(acc.size):
        acc[i] = _bf16_to_f32(x[i])


@_jit
def _add_bf16(acc, x):  # type: ignore[no-untyped-def]
    for i in range(acc.size):
        acc[i] += _bf16_to_f32(x[i])


@_jit
def _sum2_bf16(acc, a, b):  # type: ignore[no-untyped-def]
    for i in range(acc.size):
        acc[i] = _bf16_to_f32(a[i]) + _bf16_to_f32(b[i])


@_jit
def _sum2_round_bf16(out, a, b):  # type: ignore[no-untyped-def]
    for i in range(out.size):
        out[i] = _f32_to_bf16(_bf16_to_f32(a[i]) + _bf16_to_f32(b[i]))


@_jit
def _round_bf16(out, acc, divisor):  # type: ignore[no-untyped-def]
    if divisor == 1:
        for i in range(out.size):
            out[i] = _f32_to_bf16(acc[i])
    elif _is_power_of_two(divisor):
        r = np.float32(1) / np.float32(divisor)
        for i in range(out.size):
            out[i] = _f32_to_bf16(acc[i] * r)
    else:
        d = np.float32(divisor)
        for i in range(out.size):
            out[i] = _f32_to_bf16(acc[i] / d)


# -- blocked k-input sums (sum_into) ------------------------------------------------------------
# The inputs come as an array of addresses: one compiled kernel serves any number of inputs
# (a tuple would compile once per length, a typed List costs ~25 us to build). sum_into checks
# every input's dtype, size and contiguity before taking its address.

@_jit
def _block(address, lo, m, like):  # type: ignore[no-untyped-def]
    """Elements ``lo:lo+m`` of the contiguous array at ``address``, with ``like``'s dtype."""
    return numba.carray(_voidptr(address + lo * like.itemsize), m, like.dtype)  # type: ignore[call-arg]


@_jit
def _sum_blocks(out, addresses, divisor):  # type: ignore[no-untyped-def]
    """Three or more inputs; the last pass writes ``out``, so ``out`` may be any of them."""
    k = addresses.size
    buf = np.empty(min(out.size, _BLOCK), out.dtype)
    for lo in range(0, out.size, _BLOCK):
        m = min(_BLOCK, out.size - lo)
        acc = buf[:m]
        _sum2(acc, _block(addresses[0], lo, m, out), _block(addresses[1], lo, m, out))
        for j in range(2, k - 1):
            _add(acc, _block(addresses[j], lo, m, out))
        dst = out[lo:lo + m]
        _sum2(dst, acc, _block(addresses[k - 1], lo, m, out))
        if divisor != 1:
            _div(dst, dst, divisor)


@_jit
def _sum_blocks_f16(out, addresses, divisor, scratch):  # type: ignore[no-untyped-def]
    buf = np.empty(min(out.size, _BLOCK), np.float32)
    for lo in range(0, out.size, _BLOCK):
        m = min(_BLOCK, out.size - lo)
        acc = buf[:m]
        if addresses.size == 1:
            _widen_f16(acc, _block(addresses[0], lo, m, out))
        else:
            _sum2_f16(acc, _block(addresses[0], lo, m, out), _block(addresses[1], lo, m, out))
        for j in range(2, addresses.size):
            _add_f16(acc, _block(addresses[j], lo, m, out))
        if scratch.size:
            _copy(scratch[lo:lo + m], acc)
        _round_f16(out[lo:lo + m], acc, divisor, addresses.size > 1)


@_jit
def _sum_blocks_bf16(out, addresses, divisor, scratch):  # type: ignore[no-untyped-def]
    buf = np.empty(min(out.size, _BLOCK), np.float32)
    for lo in range(0, out.size, _BLOCK):
        m = min(_BLOCK, out.size - lo)
        acc = buf[:m]
        if addresses.size == 1:
            _widen_bf16(acc, _block(addresses[0], lo, m, out))
        else:
            _sum2_bf16(acc, _block(addresses[0], lo, m, out), _block(addresses[1], lo, m, out))
        for j in range(2, addresses.size):
            _add_bf16(acc, _block(addresses[j], lo, m, out))
        if scratch.size:
            _copy(scratch[lo:lo + m], acc)
        _round_bf16(out[lo:lo + m], acc, divisor)


_NO_SCRATCH: Final = np.empty(0, np.float32)


# -- public API ---------------------------------------------------------------------------------

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
        (_widen_f16 if first else _add_f16)(acc, x)
    elif dtype == "bfloat16":
        (_widen_bf16 if first else _add_bf16)(acc, x)
    elif first:
        np.copyto(acc, x)
    else:
        with np.errstate(all="ignore"):  # inf - inf is NaN, silently, as in the kernels
            np.add(acc, x, out=acc)


def finalize(out: np.ndarray, acc: np.ndarray, dtype: str, divisor: int = 1) -> None:
    """Write ``acc / divisor`` into ``out`` in the tensor's dtype, rounding once."""
    divisor = int(divisor)
    if dtype == "float16":
        _round_f16(out, acc, divisor, False)
    elif dtype == "bfloat16":
        _round_bf16(out, acc, divisor)
    elif divisor != 1:
        with np.errstate(all="ignore"):
            np.divide(acc, divisor, out=out, casting="unsafe")  # integers: truncated (never averaged)
    elif out is not acc:
        np.copyto(out, acc)


def _check_inputs(inputs: Sequence[np.ndarray], like: np.ndarray) -> None:
    for x in inputs:
        if x.dtype != like.dtype or x.size != like.size or not x.flags.c_contiguous:
            raise ValueError(f"sum_into: input of {x.size} {x.dtype} elements (contiguous: "
                             f"{x.flags.c_contiguous}) for an output of {like.size} {like.dtype}")


def _addresses(inputs: Sequence[np.ndarray]) -> np.ndarray:
    return np.array([x.ctypes.data for x in inputs], dtype=np.uintp)


def sum_into(out: np.ndarray, inputs: Sequence[np.ndarray], dtype: str, divisor: int = 1,
             scratch: np.ndarray | None = None) -> None:
    """``out = sum(inputs) / divisor`` in the tensor's dtype (storage views), rounding once.

    Inputs: contiguous, ``out``'s length and storage dtype, summed in their order; ``out`` may be
    one of them. For half types the float32 sum is also written to ``scratch`` if one is given
    (it is not needed: the sum is made in cache-sized blocks). The sum of one input, undivided, is a copy
    of its bytes in every dtype (a broadcast's result): a float32 round trip would quiet a signalling NaN.
    """
    if not inputs:
        raise ValueError("sum_into needs at least one input")
    if not out.flags.c_contiguous:
        raise ValueError("sum_into: the output must be contiguous")
    _check_inputs(inputs, out)
    divisor = int(divisor)
    k = len(inputs)
    if k == 1 and divisor == 1 and scratch is None:
        np.copyto(out, inputs[0])
        return
    if dtype in dtypes.HALF_TYPES:
        if scratch is not None and (scratch.size != out.size or scratch.dtype != np.float32):
            raise ValueError(f"sum_into: scratch of {scratch.size} {scratch.dtype} for {out.size} elements")
        f16 = dtype == "float16"
        if k == 2 and divisor == 1 and scratch is None:  # the worker's usual case: one fused pass
            (_sum2_round_f16 if f16 else _sum2_round_bf16)(out, inputs[0], inputs[1])
        else:
            (_sum_blocks_f16 if f16 else _sum_blocks_bf16)(out, _addresses(inputs), divisor,
                                                            _NO_SCRATCH if scratch is None else scratch)
        return
    if k >= 3:
        _sum_blocks(out, _addresses(inputs), divisor)
        return
    if k == 1:
        np.copyto(out, inputs[0])
    else:
        _sum2(out, inputs[0], inputs[1])  # ~15% faster than np.add(a, b, out=out) on 64 MiB
    if divisor != 1:
        with np.errstate(all="ignore"):
            np.divide(out, divisor, out=out, casting="unsafe")


@_jit
def _copy_runs(dst, dst_starts, src, src_starts, lengths):  # type: ignore[no-untyped-def]
    for i in range(lengths.size):  # every run checked before any is copied
        d, s, n = dst_starts[i], src_starts[i], lengths[i]
        if d < 0 or s < 0 or n < 0 or d + n > dst.size or s + n > src.size:
            return i
    for i in range(lengths.size):
        d, s, n = dst_starts[i], src_starts[i], lengths[i]
        dst[d:d + n] = src[s:s + n]
    return -1


def copy_runs(dst: np.ndarray, dst_starts: np.ndarray, src: np.ndarray, src_starts: np.ndarray,
              lengths: np.ndarray) -> None:
    """``dst[dst_starts[i]:+lengths[i]] = src[src_starts[i]:+lengths[i]]`` for every i, in one call (bytes:
    uint8 arrays, int64 run tables). A fused sum gathers and hands back thousands of small tensors this way:
    a numpy slice assignment per tensor cost a few microseconds of interpreter each. Every run is checked to
    lie inside both arrays before any is copied (the tables come from the processes' requests)."""
    bad = _copy_runs(dst, dst_starts, src, src_starts, lengths)
    if bad >= 0:
        raise ValueError(f"copy_runs: run {bad} ({lengths[bad]} bytes from {src_starts[bad]} to {dst_starts[bad]}) "
                         f"lies outside its arrays ({src.size} and {dst.size} bytes)")


def _dispatchers() -> dict[str, numba.core.registry.CPUDispatcher]:
    """Every jitted kernel of this module, by name (tests check their compiled signatures)."""
    return {name: obj for name, obj in globals().items() if isinstance(obj, numba.core.registry.CPUDispatcher)}


def warm_up(blas: bool = True) -> None:
    """Compile (or load from the on-disk cache) every kernel for every dtype.

    Covers what the daemons pass: contiguous writable arrays (received payloads, shared-memory
    views, staging buffers), every divisor path, any number of sum_into inputs. (A read-only
    input, which the daemons never pass, would compile its own specialization on first use.)

    ``blas=False``, for a process that runs no other numba code (the daemons): numba's numpy
    support, loaded with the first kernel, looks for BLAS by importing ``scipy.linalg`` where
    scipy is installed: about 0.2 of a daemon's 1.6 CPU-s start. No kernel uses BLAS, so the
    daemons skip that look. In such a process numba's ``np.dot`` still finds BLAS (it looks
    again when it compiles), but its ``np.correlate`` and ``np.convolve`` keep their loops
    without BLAS.
    """
    with contextlib.nullcontext() if blas else _no_blas_probe():
        _load_every_kernel()


@contextlib.contextmanager
def _no_blas_probe() -> Iterator[None]:
    """While numba's numpy support first loads, its look for BLAS fails at once (an entry of None
    in ``sys.modules`` makes an import raise ImportError, which numba takes for "no BLAS")."""
    probe = "scipy.linalg.cython_blas"
    if probe in sys.modules or "numba.np.arraymath" in sys.modules:
        yield  # found already, or looked for already
        return
    sys.modules[probe] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get(probe, 0) is None:
            del sys.modules[probe]


def _load_every_kernel() -> None:
    runs = np.zeros(1, np.int64)
    copy_runs(np.zeros(4, np.uint8), runs, np.zeros(4, np.uint8), runs, runs)
    for name in STORAGE:
        count = 4
        xs = [np.zeros(count, dtype=STORAGE[name]) for _ in range(3)]
        out = np.zeros(count, dtype=STORAGE[name])
        acc = new_accumulator(name, count)
        accumulate(acc, xs[0], name, True)
        accumulate(acc, xs[1], name, False)
        for divisor in (1, 2, 3):
            finalize(out, acc, name, divisor)
            for k in (1, 2, 3):
                sum_into(out, xs[:k], name, divisor)
