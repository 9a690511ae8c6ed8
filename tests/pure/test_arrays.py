"""The client's numpy dtypes (bps_worker.client.arrays): the wire's six, bfloat16 through ml_dtypes only
when it is used (its import costs a training process more than a second of CPU)."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import bps_worker.client as bps


def test_importing_the_client_leaves_ml_dtypes_unimported_until_bfloat16_is_asked_for():
    code = ("import sys, bps_worker.client as bps; a = 'ml_dtypes' in sys.modules; "
            "list(bps.NUMPY_DTYPES); 'bfloat16' in bps.NUMPY_DTYPES; bps.dtype_name('float32'); "
            "b = 'ml_dtypes' in sys.modules; d = bps.NUMPY_DTYPES['bfloat16']; "
            "print(a, b, 'ml_dtypes' in sys.modules, d)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False", "True", "bfloat16"], out


def test_the_table_maps_the_six_wire_names_in_order():
    assert list(bps.NUMPY_DTYPES) == ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
    assert len(bps.NUMPY_DTYPES) == 6 and "complex64" not in bps.NUMPY_DTYPES
    assert bps.NUMPY_DTYPES["bfloat16"] == np.dtype(ml_dtypes.bfloat16)
    assert dict(bps.NUMPY_DTYPES)["int64"] == np.dtype(np.int64)
    with pytest.raises(KeyError):
        bps.NUMPY_DTYPES["complex64"]


@pytest.mark.parametrize("given, wire", [
    (np.float32, "float32"), ("float64", "float64"), (np.dtype(np.float16), "float16"),
    (ml_dtypes.bfloat16, "bfloat16"), ("bfloat16", "bfloat16"), (np.int32, "int32"), ("int64", "int64"),
])
def test_dtype_name_goes_back_to_the_wire_name(given, wire):
    assert bps.dtype_name(given) == wire


def test_dtype_name_refuses_what_the_wire_cannot_carry_naming_the_six():
    with pytest.raises(bps.BPSError, match="unsupported dtype complex64; supported: float32, float64, float16, "
                                           "bfloat16, int32, int64"):
        bps.dtype_name(np.complex64)
    with pytest.raises(bps.BPSError, match="unsupported dtype float8_e4m3fn"):
        bps.dtype_name(ml_dtypes.float8_e4m3fn)  # another ml_dtypes type: not ours


@pytest.mark.parametrize("given, native", [(">f4", "float32"), (">i8", "int64"), (">f2", "float16")])
def test_a_wire_dtype_in_the_other_byte_order_is_refused_saying_so(given, native):
    """">f4" was "unsupported dtype >f4; supported: float32, ...": the very dtype it had just refused (a review)."""
    with pytest.raises(bps.BPSError) as info:
        bps.dtype_name(np.dtype(given))
    assert str(info.value) == (f"unsupported dtype {given}: {native} in non-native byte order; pass "
                               f"array.astype({native!r}) (broadcast carries any byte order as it is)")
