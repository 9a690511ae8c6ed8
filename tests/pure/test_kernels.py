"""bps_runtime.kernels: bit-exact half rounding and summation against numpy/ml_dtypes references."""

from __future__ import annotations

import json
import subprocess
import sys

import ml_dtypes
import numba
import numpy as np
import pytest
from numba.core import event

from bps_runtime import kernels as K
from protocol import dtypes

ALL_DTYPES = sorted(K.STORAGE)
HALF = sorted(dtypes.HALF_TYPES)
NUMPY_DTYPE = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
# Largest integer magnitude every dtype holds exactly (half types: the contributions, not the sum).
EXACT_INT = {"float16": 2048, "bfloat16": 256, "float32": 1 << 20, "float64": 1 << 40,
             "int32": 1 << 20, "int64": 1 << 40}


def f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


@numba.njit
def _soft_round_f16(out, acc):  # type: ignore[no-untyped-def]
    for i in range(out.size):
        out[i] = K._soft_f32_to_f16(acc[i])


@numba.njit
def _soft_widen_f16(acc, x):  # type: ignore[no-untyped-def]
    for i in range(acc.size):
        acc[i] = K._soft_f16_to_f32(x[i])


def finalize_bits(values_f32: np.ndarray, dtype: str, divisor: int = 1, impl: str = "kernel") -> np.ndarray:
    """The half bits of ``values_f32 / divisor``: through finalize, or ("soft") the portable float16 rounding."""
    acc = np.ascontiguousarray(values_f32, dtype=np.float32).copy()
    out = np.empty(acc.size, dtype=np.uint16)
    if impl == "soft":
        assert dtype == "float16" and divisor == 1
        _soft_round_f16(out, acc)
    else:
        K.finalize(out, acc, dtype, divisor)
    return out


def ref_bits(values_f32: np.ndarray, dtype: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(values_f32, dtype=np.float32).astype(NUMPY_DTYPE[dtype]).view(np.uint16)


def to_storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """Real-typed values -> the kernels' storage view (uint16 bit patterns for half types)."""
    return np.ascontiguousarray(values.astype(NUMPY_DTYPE[dtype])).view(K.STORAGE[dtype])


def from_storage(stored: np.ndarray, dtype: str) -> np.ndarray:
    return stored.view(NUMPY_DTYPE[dtype])


def assert_bits_equal(got: np.ndarray, want: np.ndarray, inputs: np.ndarray) -> None:
    bad = np.nonzero(got != want)[0]
    if bad.size:
        i = bad[0]
        raise AssertionError(
            f"{bad.size} mismatches; first: input bits {inputs.view(np.uint32)[i]:#010x} "
            f"got {got[i]:#06x} want {want[i]:#06x}"
        )


# -- tables & helpers ------------------------------------------------------------------------

def test_storage_and_accumulator_tables():
    assert set(K.STORAGE) == set(dtypes.ITEMSIZE)
    for name, storage in K.STORAGE.items():
        assert storage.itemsize == dtypes.ITEMSIZE[name]
    assert K.STORAGE["float16"] == K.STORAGE["bfloat16"] == np.dtype(np.uint16)
    assert K.ACCUMULATOR["float16"] == K.ACCUMULATOR["bfloat16"] == np.dtype(np.float32)
    assert K.ACCUMULATOR["int32"] == np.dtype(np.int32)
    assert K.ACCUMULATOR["float64"] == np.dtype(np.float64)


# The float16 conversions use the CPU's instructions where LLVM has them (F16C on x86), else portable
# bit arithmetic; both are checked on every machine ("kernel" is whichever this machine uses).
F16_IMPLS = ["kernel", "soft"]


@pytest.mark.parametrize("dtype", HALF)
def test_widening_is_exact_for_every_bit_pattern(dtype):
    """First contribution: every half value (NaN payloads, signalling NaNs included) as numpy/ml_dtypes widen it."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = bits.view(NUMPY_DTYPE[dtype]).astype(np.float32)
    acc = np.full(bits.size, 7.0, np.float32)
    K.accumulate(acc, bits, dtype, first=True)
    assert_bits_equal(acc.view(np.uint32), want.view(np.uint32), want)


def test_soft_f16_widening_is_exact_for_every_bit_pattern():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    acc = np.empty(bits.size, np.float32)
    _soft_widen_f16(acc, bits)
    assert_bits_equal(acc.view(np.uint32), want.view(np.uint32), want)


@pytest.mark.parametrize("dtype", HALF)
def test_adding_every_bit_pattern(dtype):
    """acc += x for every half x (NaNs too), on accumulators that are exact, rounded, subnormal, infinite and -0."""
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    x = bits.view(NUMPY_DTYPE[dtype]).astype(np.float32)
    for start in (0.0, -0.0, 1.0, -3.25e-3, 1e-40, 7e4, np.inf, -np.inf):
        acc = np.full(bits.size, start, np.float32)
        with np.errstate(all="ignore"):
            want = acc + x
        K.accumulate(acc, bits, dtype, first=False)
        assert_bits_equal(acc.view(np.uint32), want.view(np.uint32), want)  # a NaN x: quieted, payload kept


def test_as_array_is_zero_copy():
    raw = bytearray(np.arange(4, dtype=np.float32).tobytes())
    view = K.as_array(memoryview(raw), "float32")
    np.testing.assert_array_equal(view, [0, 1, 2, 3])
    view[1] = 7.0
    assert np.frombuffer(raw, dtype=np.float32)[1] == 7.0
    arr = np.zeros((2, 2), dtype=np.uint16)
    flat = K.as_array(arr, "bfloat16")
    assert flat.shape == (4,) and flat.dtype == np.uint16 and np.shares_memory(flat, arr)
    assert K.as_array(bytearray(8), "float16").shape == (4,)


def test_new_accumulator_dtype():
    assert K.new_accumulator("bfloat16", 5).dtype == np.float32
    assert K.new_accumulator("int64", 5).dtype == np.int64
    assert K.new_accumulator("float32", 0).size == 0


# -- float16 rounding -----------------------------------------------------------------------------

@pytest.mark.parametrize("impl", F16_IMPLS)
def test_f16_finalize_matches_numpy_on_1m_random_bit_patterns(impl):
    rng = np.random.default_rng(12345)
    bits = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    x = f32(bits)
    assert np.isnan(x).sum() > 1000 and np.isinf(ref_bits(x, "float16").view(np.float16)).sum() > 1000
    assert_bits_equal(finalize_bits(x, "float16", impl=impl), ref_bits(x, "float16"), x)  # NaN payloads included


@pytest.mark.parametrize("impl", F16_IMPLS)
def test_f16_finalize_matches_numpy_on_values_in_half_range(impl):
    """Random bit patterns are mostly outside float16's range; cover its exponents densely too."""
    rng = np.random.default_rng(7)
    sign = rng.integers(0, 2, size=1 << 19, dtype=np.uint32) << 31
    exp = rng.integers(0x66 - 1, 0x90 + 1, size=1 << 19, dtype=np.uint32) << 23  # 2^-26 .. 2^17
    mant = rng.integers(0, 1 << 23, size=1 << 19, dtype=np.uint32)
    x = f32(sign | exp | mant)
    assert_bits_equal(finalize_bits(x, "float16", impl=impl), ref_bits(x, "float16"), x)


def _half_midpoints(dtype: str) -> np.ndarray:
    """Every value of the half type, the midpoints between neighbours and 1 ulp (f32) around them."""
    h = np.arange(0, 0x7C00 if dtype == "float16" else 0x7F80, dtype=np.uint16)  # positive finite
    vals = h.view(NUMPY_DTYPE[dtype]).astype(np.float32).astype(np.float64)
    mids = ((vals[:-1] + vals[1:]) / 2).astype(np.float32)  # exact: a midpoint fits float32
    assert np.all(mids.astype(np.float64) == (vals[:-1] + vals[1:]) / 2)
    top = vals[-1] + (vals[-1] - vals[-2]) / 2  # halfway from the largest finite to "the next"
    pts = np.concatenate([vals.astype(np.float32), mids, np.float32([top])])
    ups = np.nextafter(pts, np.float32(np.inf))
    downs = np.nextafter(pts, np.float32(0))
    allpts = np.concatenate([pts, ups, downs])
    return np.concatenate([allpts, -allpts])


@pytest.mark.parametrize("dtype,impl", [(d, "kernel") for d in HALF] + [("float16", "soft")])
def test_half_finalize_exhaustive_midpoints(dtype, impl):
    x = _half_midpoints(dtype)
    assert_bits_equal(finalize_bits(x, dtype, impl=impl), ref_bits(x, dtype), x)


F16_EDGES = [
    # (float32 input, float16 bits)
    (0.0, 0x0000),
    (-0.0, 0x8000),
    (np.inf, 0x7C00),
    (-np.inf, 0xFC00),
    (1.0, 0x3C00),
    (-2.0, 0xC000),
    (65504.0, 0x7BFF),  # largest finite
    (np.nextafter(np.float32(65520.0), np.float32(0)), 0x7BFF),  # just below the overflow halfway point
    (65520.0, 0x7C00),  # halfway between 65504 and 65536: rounds to even = overflow to inf
    (-65520.0, 0xFC00),
    (65536.0, 0x7C00),
    (1e30, 0x7C00),
    (np.float32(3.4028235e38), 0x7C00),
    (2.0 ** -14, 0x0400),  # smallest normal
    (2.0 ** -24, 0x0001),  # smallest subnormal
    (1023 * 2.0 ** -24, 0x03FF),  # largest subnormal
    (1023.5 * 2.0 ** -24, 0x0400),  # halfway largest subnormal / smallest normal: to even (normal)
    (2.0 ** -25, 0x0000),  # halfway between 0 and the smallest subnormal: to even (0)
    (np.nextafter(np.float32(2.0 ** -25), np.float32(1)), 0x0001),
    (-(2.0 ** -25), 0x8000),
    (1.5 * 2.0 ** -24, 0x0002),  # halfway 1/2 subnormal units: to even (2)
    (2.5 * 2.0 ** -24, 0x0002),  # halfway 2/3: to even (2)
    (3.5 * 2.0 ** -24, 0x0004),
    (2.0 ** -26, 0x0000),
    (np.float32(1e-45), 0x0000),  # float32 subnormal
    (1.0 + 2.0 ** -11, 0x3C00),  # halfway 1 / 1+2^-10: to even (1)
    (1.0 + 3 * 2.0 ** -11, 0x3C02),  # halfway: to even (1+2^-9)
    (np.nextafter(np.float32(1.0 + 2.0 ** -11), np.float32(2)), 0x3C01),
    (2049.0, 0x6800),  # 2048 + half a step: to even (2048)
    (2051.0, 0x6802),  # to even (2052)
    (0.1, 0x2E66),
]


@pytest.mark.parametrize("impl", F16_IMPLS)
@pytest.mark.parametrize("value,want", F16_EDGES)
def test_f16_edge_cases(value, want, impl):
    x = np.float32([value])
    got = finalize_bits(x, "float16", impl=impl)
    assert got[0] == want, f"{value!r}: got {got[0]:#06x} want {want:#06x}"
    assert got[0] == ref_bits(x, "float16")[0]


@pytest.mark.parametrize("impl", F16_IMPLS)
def test_f16_nan_stays_nan(impl):
    x = f32([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFF802000, 0x7F801FFF, 0xFFA00000])
    got = finalize_bits(x, "float16", impl=impl)
    assert np.isnan(got.view(np.float16)).all()
    assert_bits_equal(got, ref_bits(x, "float16"), x)


# -- bfloat16 rounding ---------------------------------------------------------------------------

def test_bf16_finalize_matches_ml_dtypes_on_1m_random_bit_patterns():
    rng = np.random.default_rng(54321)
    bits = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    x = f32(bits)
    got = finalize_bits(x, "bfloat16")
    want = ref_bits(x, "bfloat16")
    nan = np.isnan(x)
    assert nan.sum() > 1000
    assert_bits_equal(got[~nan], want[~nan], x[~nan])
    assert np.isnan(got[nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()
    # a NaN keeps its sign
    np.testing.assert_array_equal(got[nan] >> 15, bits[nan] >> 31)


BF16_EDGES = [
    (0.0, 0x0000),
    (-0.0, 0x8000),
    (np.inf, 0x7F80),
    (-np.inf, 0xFF80),
    (1.0, 0x3F80),
    (f32([0x3F808000])[0], 0x3F80),  # halfway 1 / next: to even (down)
    (f32([0x3F818000])[0], 0x3F82),  # halfway: to even (up)
    (f32([0x3F808001])[0], 0x3F81),  # above halfway
    (f32([0x3F807FFF])[0], 0x3F80),  # below halfway
    (f32([0x7F7FFFFF])[0], 0x7F80),  # float32 max rounds up to inf
    (f32([0x7F7F7FFF])[0], 0x7F7F),  # stays the largest finite bfloat16
    (f32([0x7F7F8000])[0], 0x7F80),  # halfway, odd lsb: up to inf
    (f32([0x00000001])[0], 0x0000),  # smallest float32 subnormal
    (f32([0x00008000])[0], 0x0000),  # halfway to the smallest bfloat16 subnormal: to even
    (f32([0x00018000])[0], 0x0002),
    (f32([0x80008001])[0], 0x8001),
]


@pytest.mark.parametrize("value,want", BF16_EDGES)
def test_bf16_edge_cases(value, want):
    x = np.float32([value])
    got = finalize_bits(x, "bfloat16")
    assert got[0] == want, f"{value!r}: got {got[0]:#06x} want {want:#06x}"
    assert got[0] == ref_bits(x, "bfloat16")[0]


def test_bf16_nan_stays_quiet_nan():
    x = f32([0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FFFFFFF, 0xFF800001, 0x7FBF0000])
    got = finalize_bits(x, "bfloat16")
    assert np.isnan(got.view(ml_dtypes.bfloat16).astype(np.float32)).all()
    assert ((got & 0x7FFF) > 0x7F80).all()  # never collapsed to infinity
    assert (got & 0x0040).all()  # quiet bit set
    np.testing.assert_array_equal(got >> 15, np.uint16([0, 1, 0, 0, 1, 0]))


# -- accumulate / finalize with a divisor ---------------------------------------------------

def _int_inputs(rng: np.random.Generator, dtype: str, k: int, count: int) -> list[np.ndarray]:
    lim = EXACT_INT[dtype]
    return [rng.integers(-lim, lim + 1, size=count).astype(np.float64) for _ in range(k)]


def _reference(values: list[np.ndarray], dtype: str, divisor: int) -> np.ndarray:
    """Exact sum, divided in the accumulator dtype, rounded once to the tensor's dtype."""
    total = np.sum(values, axis=0)  # float64: exact for these magnitudes
    if dtype in dtypes.HALF_TYPES:
        acc = total.astype(np.float32)
        assert np.all(acc.astype(np.float64) == total)
        with np.errstate(all="ignore"):
            return (acc / np.float32(divisor)).astype(NUMPY_DTYPE[dtype])
    if dtype in dtypes.FLOAT_TYPES:
        acc = total.astype(NUMPY_DTYPE[dtype])
        return acc / NUMPY_DTYPE[dtype].type(divisor)
    acc = total.astype(NUMPY_DTYPE[dtype])
    assert np.all(acc % divisor == 0)
    return acc // divisor


def _divisible_int_inputs(rng, dtype, k, count, divisor):
    """Integer inputs whose sum is a multiple of ``divisor`` (integer averaging is exact)."""
    values = [(rng.integers(-1000, 1001, size=count) * divisor).astype(np.float64) for _ in range(k)]
    return values


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("divisor", [1, 2, 3, 7])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_accumulate_finalize_matches_reference(dtype, divisor, k):
    rng = np.random.default_rng([ALL_DTYPES.index(dtype), divisor, k])  # not hash(): str hashes vary per run
    count = 4099
    if dtype in dtypes.FLOAT_TYPES:
        values = _int_inputs(rng, dtype, k, count)
    else:
        values = _divisible_int_inputs(rng, dtype, k, count, divisor)
    stored = [to_storage(v, dtype) for v in values]
    acc = K.new_accumulator(dtype, count)
    for i, x in enumerate(stored):
        K.accumulate(acc, x, dtype, first=(i == 0))
    out = np.empty(count, dtype=K.STORAGE[dtype])
    K.finalize(out, acc, dtype, divisor)
    want = _reference(values, dtype, divisor)
    np.testing.assert_array_equal(out, np.ascontiguousarray(want).view(K.STORAGE[dtype]))
    # inputs are untouched
    for v, s in zip(values, stored):
        np.testing.assert_array_equal(s, to_storage(v, dtype))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
def test_finalize_in_place_without_divisor(dtype):
    acc = np.arange(10, dtype=K.ACCUMULATOR[dtype])
    K.finalize(acc, acc, dtype, 1)
    np.testing.assert_array_equal(acc, np.arange(10))


@pytest.mark.parametrize("dtype", HALF)
def test_half_types_round_once_not_per_addition(dtype):
    big = {"float16": 2048.0, "bfloat16": 256.0}[dtype]  # one step above it is 2 (f16) / 2 (bf16)
    values = [np.full(3, big), np.full(3, 1.0), np.full(3, 1.0)]
    out = np.empty(3, np.uint16)
    K.sum_into(out, [to_storage(v, dtype) for v in values], dtype)
    # Rounded after every addition the result would stay at `big` (big + 1 is a tie that rounds to big).
    np.testing.assert_array_equal(from_storage(out, dtype).astype(np.float64), big + 2)


@pytest.mark.parametrize("dtype", HALF)
def test_half_types_divide_before_rounding(dtype):
    values = [np.float64([1.0, 3.0, -5.0, 1000.0 if dtype == "float16" else 100.0])]
    stored = [to_storage(v, dtype) for v in values]
    acc = K.new_accumulator(dtype, 4)
    K.accumulate(acc, stored[0], dtype, True)
    out = np.empty(4, np.uint16)
    K.finalize(out, acc, dtype, 3)
    want = (values[0].astype(np.float32) / np.float32(3)).astype(NUMPY_DTYPE[dtype])
    np.testing.assert_array_equal(out, want.view(np.uint16))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("divisor", [2, 3, 4, 7, 8, 1024])
def test_divisor_matches_numpy_division_on_random_bit_patterns(dtype, divisor):
    """Averaging: powers of two multiply by the reciprocal, others divide; both must equal numpy's division.

    Random bit patterns cover subnormal quotients, infinities and NaN payloads.
    """
    rng = np.random.default_rng(divisor)
    acc_dtype = K.ACCUMULATOR[dtype]
    bits = rng.integers(0, 1 << 64, size=1 << 18, dtype=np.uint64)
    acc = (bits.astype(np.uint32) if acc_dtype.itemsize == 4 else bits).view(acc_dtype)
    with np.errstate(all="ignore"):
        quotient = acc / acc_dtype.type(divisor)
        want = quotient.astype(NUMPY_DTYPE[dtype]) if dtype in HALF else quotient
    out = np.empty(acc.size, K.STORAGE[dtype])
    K.finalize(out, acc.copy(), dtype, divisor)
    uint = np.dtype(f"u{out.itemsize}")
    got, want = out.view(uint), np.ascontiguousarray(want).view(uint)
    nan = np.isnan(quotient)
    if dtype == "bfloat16":  # ml_dtypes makes every NaN its canonical one; ours keeps the payload (see above)
        assert np.isnan(out[nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()
        got, want, acc = got[~nan], want[~nan], acc[~nan]
    else:
        assert nan.sum() > 50  # NaN payloads included
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, (f"{bad.size} mismatches; first: acc {acc[bad[0]]!r} / {divisor}: "
                           f"got {got[bad[0]]:#x} want {want[bad[0]]:#x}")


def test_accumulate_size_mismatch():
    with pytest.raises(ValueError, match="3 elements vs 4"):
        K.accumulate(np.zeros(3, np.float32), np.zeros(4, np.float32), "float32", True)


# -- sum_into -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("n_inputs", [1, 2, 3])
@pytest.mark.parametrize("divisor", [1, 2])
def test_sum_into(dtype, n_inputs, divisor):
    rng = np.random.default_rng(1000 + n_inputs * 10 + divisor)
    count = 1031
    if dtype in dtypes.FLOAT_TYPES:
        values = _int_inputs(rng, dtype, n_inputs, count)
    else:
        values = _divisible_int_inputs(rng, dtype, n_inputs, count, divisor)
    stored = [to_storage(v, dtype) for v in values]
    out = np.full(count, 99, dtype=K.STORAGE[dtype])
    K.sum_into(out, stored, dtype, divisor)
    want = np.ascontiguousarray(_reference(values, dtype, divisor)).view(K.STORAGE[dtype])
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", HALF)
def test_sum_into_half_with_scratch(dtype):
    rng = np.random.default_rng(3)
    values = _int_inputs(rng, dtype, 3, 500)
    scratch = np.full(500, np.nan, np.float32)
    out = np.empty(500, np.uint16)
    K.sum_into(out, [to_storage(v, dtype) for v in values], dtype, 1, scratch=scratch)
    np.testing.assert_array_equal(scratch, np.sum(values, axis=0).astype(np.float32))
    np.testing.assert_array_equal(out, np.ascontiguousarray(_reference(values, dtype, 1)).view(np.uint16))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_sum_into_out_may_alias_first_input(dtype):
    rng = np.random.default_rng(4)
    values = _int_inputs(rng, dtype, 3, 300) if dtype in dtypes.FLOAT_TYPES else \
        _divisible_int_inputs(rng, dtype, 3, 300, 1)
    stored = [to_storage(v, dtype) for v in values]
    K.sum_into(stored[0], stored, dtype)
    want = np.ascontiguousarray(_reference(values, dtype, 1)).view(K.STORAGE[dtype])
    np.testing.assert_array_equal(stored[0], want)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("n_inputs", [1, 2, 4, 5])
def test_sum_into_across_block_boundaries(dtype, n_inputs):
    """Lengths around multiples of the kernels' block; the worker sums any number of local tensors."""
    rng = np.random.default_rng([ALL_DTYPES.index(dtype), n_inputs])
    for count in (K._BLOCK - 1, K._BLOCK, K._BLOCK + 1, 3 * K._BLOCK + 17):
        divisor = 2 if dtype in dtypes.FLOAT_TYPES else 1
        values = _int_inputs(rng, dtype, n_inputs, count) if dtype in dtypes.FLOAT_TYPES else \
            _divisible_int_inputs(rng, dtype, n_inputs, count, divisor)
        stored = [to_storage(v, dtype) for v in values]
        out = np.empty(count, K.STORAGE[dtype])
        K.sum_into(out, stored, dtype, divisor)
        want = np.ascontiguousarray(_reference(values, dtype, divisor)).view(K.STORAGE[dtype])
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("alias", [1, 2])
def test_sum_into_out_may_alias_any_input(dtype, alias):
    rng = np.random.default_rng(alias)
    count = 2 * K._BLOCK + 5
    values = _int_inputs(rng, dtype, 3, count) if dtype in dtypes.FLOAT_TYPES else \
        _divisible_int_inputs(rng, dtype, 3, count, 1)
    stored = [to_storage(v, dtype) for v in values]
    K.sum_into(stored[alias], stored, dtype)
    np.testing.assert_array_equal(stored[alias],
                                  np.ascontiguousarray(_reference(values, dtype, 1)).view(K.STORAGE[dtype]))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n_inputs", [2, 3])
@pytest.mark.parametrize("divisor", [1, 2, 3])
def test_sum_into_half_random_bit_patterns(dtype, n_inputs, divisor):
    """Sums of arbitrary half values (subnormals, infinities, NaNs, overflow to inf) as numpy makes them."""
    rng = np.random.default_rng([n_inputs, divisor, HALF.index(dtype)])
    count = 2 * K._BLOCK + 3
    stored = [rng.integers(0, 1 << 16, size=count, dtype=np.uint32).astype(np.uint16) for _ in range(n_inputs)]
    with np.errstate(all="ignore"):
        total = stored[0].view(NUMPY_DTYPE[dtype]).astype(np.float32)
        for x in stored[1:]:
            total = total + x.view(NUMPY_DTYPE[dtype]).astype(np.float32)
        want = (total / np.float32(divisor) if divisor != 1 else total).astype(NUMPY_DTYPE[dtype]).view(np.uint16)
    out = np.empty(count, np.uint16)
    K.sum_into(out, stored, dtype, divisor)
    nan = np.isnan(total)
    assert_bits_equal(out[~nan], want[~nan], total[~nan])
    assert np.isnan(out[nan].view(NUMPY_DTYPE[dtype]).astype(np.float32)).all()  # payload: either operand's


def test_sum_into_sums_in_input_order():
    """float32 addition is not associative: the sum is ((x0 + x1) + x2) + x3, as numpy's chain of adds."""
    x = [np.float32([1e8, 1.0]), np.float32([1.0, 1e8]), np.float32([-1e8, -1e8]), np.float32([0.5, 0.5])]
    out = np.empty(2, np.float32)
    K.sum_into(out, x, "float32")
    np.testing.assert_array_equal(out, ((x[0] + x[1]) + x[2]) + x[3])


def test_sum_into_rejects_inputs_it_cannot_read():
    out = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="input of 7 float32"):
        K.sum_into(out, [np.zeros(8, np.float32), np.zeros(7, np.float32)], "float32")
    with pytest.raises(ValueError, match="input of 8 float64"):
        K.sum_into(out, [np.zeros(8, np.float64)], "float32")
    with pytest.raises(ValueError, match="contiguous: False"):
        K.sum_into(out, [np.zeros(16, np.float32)[::2]], "float32")
    with pytest.raises(ValueError, match="output must be contiguous"):
        K.sum_into(np.zeros(16, np.float32)[::2], [np.zeros(8, np.float32)], "float32")
    with pytest.raises(ValueError, match="scratch of 7"):
        K.sum_into(np.zeros(8, np.uint16), [np.zeros(8, np.uint16)], "float16", scratch=np.zeros(7, np.float32))


def test_sum_into_needs_inputs():
    with pytest.raises(ValueError, match="at least one input"):
        K.sum_into(np.zeros(2, np.float32), [], "float32")


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_empty_tensors(dtype):
    out = np.empty(0, K.STORAGE[dtype])
    K.sum_into(out, [np.empty(0, K.STORAGE[dtype])] * 2, dtype)
    acc = K.new_accumulator(dtype, 0)
    K.accumulate(acc, out, dtype, True)
    K.finalize(out, acc, dtype, 2 if dtype in dtypes.FLOAT_TYPES else 1)
    assert out.size == 0


# -- integer wrap-around ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_int_overflow_wraps_like_numpy(dtype):
    info = np.iinfo(dtype)
    a = np.array([info.max, info.min, info.max, -1, 12345], dtype=dtype)
    b = np.array([1, -1, info.max, info.min, 1], dtype=dtype)
    c = np.array([info.max, info.max, 2, info.min, info.min], dtype=dtype)
    with np.errstate(over="ignore"):
        want2 = a + b
        want3 = a + b + c
    assert want2[0] == info.min  # numpy wraps
    out = np.empty(5, dtype)
    K.sum_into(out, [a, b], dtype)
    np.testing.assert_array_equal(out, want2)
    K.sum_into(out, [a, b, c], dtype)
    np.testing.assert_array_equal(out, want3)
    acc = K.new_accumulator(dtype, 5)
    for i, x in enumerate([a, b, c]):
        K.accumulate(acc, x, dtype, first=(i == 0))
    K.finalize(out, acc, dtype)
    np.testing.assert_array_equal(out, want3)


# -- copy_runs -------------------------------------------------------------------------------------

def test_copy_runs_moves_each_run_and_nothing_else():
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    dst = np.zeros(2048, np.uint8)
    dst_starts = np.array([0, 100, 1000, 2040], np.int64)
    src_starts = np.array([4000, 0, 17, 3000], np.int64)
    lengths = np.array([96, 900, 3, 8], np.int64)
    K.copy_runs(dst, dst_starts, src, src_starts, lengths)
    want = np.zeros(2048, np.uint8)
    for d, s_, n in zip(dst_starts, src_starts, lengths):
        want[d:d + n] = src[s_:s_ + n]
    np.testing.assert_array_equal(dst, want)
    empty = np.zeros(0, np.int64)
    K.copy_runs(dst, empty, src, empty, empty)  # no runs: nothing to do
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("dst_start, src_start, length", [(2040, 0, 9), (0, 4090, 7), (-1, 0, 1), (0, 0, -1)])
def test_copy_runs_refuses_a_run_outside_its_arrays(dst_start, src_start, length):
    src, dst = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096].copy(), np.zeros(2048, np.uint8)
    runs = [np.array([v], np.int64) for v in (dst_start, src_start, length)]
    with pytest.raises(ValueError, match="outside"):
        K.copy_runs(dst, runs[0], src, runs[1], runs[2])
    assert not dst.any()


# -- warm-up -------------------------------------------------------------------------------------

def test_nothing_compiles_after_warm_up():
    """No job's first tensor pays for compilation: warm_up() leaves nothing to compile (or load from disk)."""
    K.warm_up()
    before = {name: list(d.signatures) for name, d in K._dispatchers().items()}
    with event.install_recorder("numba:compile") as recorder:
        for dtype in ALL_DTYPES:
            storage, n = K.STORAGE[dtype], 1000
            # what the daemons hand the kernels: received payloads (bytearray or memoryview slices; adopted as
            # the accumulator for full types), shared-memory views (np.frombuffer), staging buffers (views of
            # a uint8 buffer), results from np.empty
            received = [K.as_array(memoryview(bytearray(n * storage.itemsize + 8))[8:], dtype) for _ in range(5)]
            acc = received[0] if dtype not in dtypes.HALF_TYPES else K.new_accumulator(dtype, n)
            K.accumulate(acc, received[1], dtype, first=True)
            K.accumulate(acc, received[2], dtype, first=False)
            divisors = [1, 2, 3, np.int64(4)] if dtype in dtypes.FLOAT_TYPES else [1]
            for divisor in divisors:
                K.finalize(np.empty(n, storage), acc, dtype, divisor)
            staging = np.empty(n * storage.itemsize + 64, np.uint8)[:n * storage.itemsize].view(storage)
            shm = [np.frombuffer(bytearray(n * storage.itemsize), dtype=storage, count=n) for _ in range(5)]
            runs = np.array([0, 8], np.int64)
            K.copy_runs(staging.view(np.uint8), runs, shm[0].view(np.uint8), runs, runs)  # a fused sum's gather
            K.copy_runs(shm[1].view(np.uint8), runs, np.empty(n * storage.itemsize, np.uint8), runs, runs)
            for k in (1, 2, 3, 5):
                K.sum_into(staging, shm[:k], dtype)
                K.sum_into(staging, received[:k], dtype, divisors[-1])
    assert recorder.buffer == []
    assert {name: list(d.signatures) for name, d in K._dispatchers().items()} == before


def test_warm_up_runs_and_kernels_still_correct():
    K.warm_up()
    out = np.empty(2, np.uint16)
    K.sum_into(out, [to_storage(np.float64([1.5, -2.0]), "float16")] * 2, "float16", 2)
    np.testing.assert_array_equal(out.view(np.float16), np.float16([1.5, -2.0]))


def test_a_daemons_warm_up_skips_numbas_look_for_blas_and_its_kernels_still_sum():
    """warm_up(blas=False), as the daemons call it, in a fresh interpreter: numba's numpy support loads
    without importing scipy.linalg's BLAS (an eighth of a daemon's start), every kernel is loaded as by a
    plain warm_up, and they sum; the blocking entry is gone afterwards (a later import is a real one)."""
    pytest.importorskip("scipy.linalg.cython_blas")  # scipy comes with the examples' scikit-learn
    def run(blas: bool) -> dict:
        done = subprocess.run([sys.executable, "-c", program.replace("BLAS", str(blas))], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    program = (
        "import sys, json, numpy as np\n"
        "from bps_runtime import kernels as K\n"
        "K.warm_up(blas=BLAS)\n"
        "blas = 'scipy.linalg.cython_blas' in sys.modules\n"
        "loaded = {n: len(d.signatures) for n, d in K._dispatchers().items()}\n"
        "out = np.empty(3, np.float32)\n"
        "K.sum_into(out, [np.float32([1, 2, 3]), np.float32([0.5, 0.25, 4]), np.float32([1, 1, 1])], 'float32')\n"
        "import scipy.linalg.cython_blas\n"
        "print(json.dumps({'blas': blas, 'sum': out.tolist(), 'loaded': loaded}))\n"
    )
    report, plain = run(False), run(True)
    assert report["blas"] is False and plain["blas"] is True
    assert report["sum"] == plain["sum"] == [2.5, 3.25, 8.0]
    assert report["loaded"] == plain["loaded"]
    assert report["loaded"]["_copy_runs"] == 1 and report["loaded"]["_sum_blocks"] == 4
