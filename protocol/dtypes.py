"""Tensor element types known to the wire protocol.

Types are named by strings on the wire; every process maps the name to its own
array library (numpy + ml_dtypes, torch). Half-precision types are summed in
float32 and rounded once at the end of each summation.
"""

from typing import Final

ITEMSIZE: Final[dict[str, int]] = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "int64": 8,
}

HALF_TYPES: Final[frozenset[str]] = frozenset({"float16", "bfloat16"})
FLOAT_TYPES: Final[frozenset[str]] = frozenset({"float32", "float64", "float16", "bfloat16"})


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype``; KeyError-free: raises ValueError naming it."""
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {dtype!r}; supported: {', '.join(sorted(ITEMSIZE))}"
        ) from None


def accumulator_dtype(dtype: str) -> str:
    """The dtype a sum of ``dtype`` values is accumulated in."""
    return "float32" if dtype in HALF_TYPES else dtype
