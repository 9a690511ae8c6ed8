"""bps_worker.client.arguments: every argument error is a BPSError naming the argument and its limit, raised
before anything is sent (issue 14 item 9: they were UnicodeEncodeError, LocalProtocolError, OverflowError, or
a name the daemon refused by dropping the whole connection)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bps_worker.client import BPSError
from bps_worker.client.arguments import (
    WIRE_INT_MAX,
    WIRE_INT_MIN,
    check_average,
    check_dtype,
    check_name,
    check_out,
    check_priority,
    check_shape,
    check_staleness,
)
from protocol.messages import MAX_DIMS, MAX_NAME_CHARS

F32 = np.dtype(np.float32)


@pytest.mark.parametrize("name", ["w", "layer.1/weight", "é∑😀", "x" * MAX_NAME_CHARS])
def test_names_the_wire_carries_pass(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name, words", [
    ("", ["tensor name must be a non-empty string"]),
    (None, ["tensor name must be a non-empty string", "None"]),
    (b"w", ["tensor name must be a non-empty string", "b'w'"]),
    ("x" * (MAX_NAME_CHARS + 1), [f"{MAX_NAME_CHARS + 1} characters", f"at most {MAX_NAME_CHARS}"]),
    ("x" * 16_000, ["16000 characters", f"at most {MAX_NAME_CHARS}"]),  # the daemon dropped the connection
    ("y" * 70_000, ["70000 characters", f"at most {MAX_NAME_CHARS}"]),  # was LocalProtocolError (header)
    ("bad\ud800name", ["cannot be encoded as UTF-8", "surrogates not allowed", "character 3"]),  # UnicodeEncodeError
    ("\x00fused/0/1/float32", ["names starting", "are the worker daemon's own"]),  # its fused tensors' names
])
def test_bad_names_are_bps_errors_naming_the_limit(name: object, words: list[str]) -> None:
    with pytest.raises(BPSError) as info:
        check_name(name)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("priority", [0, -5, 7, np.int64(3), WIRE_INT_MIN, WIRE_INT_MAX])
def test_priorities_msgpack_carries_pass(priority: object) -> None:
    value = check_priority("w", priority)
    assert type(value) is int and value == int(priority)  # type: ignore[call-overload]


@pytest.mark.parametrize("priority, words", [
    (2 ** 70, ["tensor 'w'", f"priority {2 ** 70} is out of range", f"{WIRE_INT_MIN}..{WIRE_INT_MAX}"]),  # OverflowError
    (WIRE_INT_MIN - 1, ["tensor 'w'", "out of range"]),
    (1.5, ["tensor 'w': priority must be an integer, got 1.5"]),
    ("1", ["priority must be an integer, got '1'"]),
    (True, ["tensor 'w': priority must be an integer, got True"]),  # (a review: taken as 1)
    (np.False_, ["tensor 'w': priority must be an integer, got "]),
])
def test_bad_priorities_are_bps_errors(priority: object, words: list[str]) -> None:
    with pytest.raises(BPSError) as info:
        check_priority("w", priority)
    for word in words:
        assert word in str(info.value)


def test_average_is_a_bool_and_needs_a_float() -> None:
    assert check_average("w", np.True_, "float32") is True
    assert check_average("w", 0, "int64") is False
    with pytest.raises(BPSError, match="tensor 'w': average=True needs a floating dtype, got int32"):
        check_average("w", True, "int32")


def test_shapes() -> None:
    assert check_shape("w", (np.int64(2), 3), F32) == (2, 3)
    assert check_shape("w", (), F32) == ()
    assert check_shape("w", (1,) * MAX_DIMS, F32) == (1,) * MAX_DIMS
    with pytest.raises(BPSError, match=f"tensor 'w': {MAX_DIMS + 1} dimensions; at most {MAX_DIMS}"):
        check_shape("w", (1,) * (MAX_DIMS + 1), F32)
    with pytest.raises(BPSError, match=r"tensor 'w': negative dimension in shape \(2, -1\)"):
        check_shape("w", (2, -1), F32)
    with pytest.raises(BPSError, match="tensor 'w': shape must hold integers"):
        check_shape("w", (2.5,), F32)  # type: ignore[arg-type]
    assert check_shape("w", 5, F32) == check_shape("w", np.int64(5), F32) == (5,)  # as numpy takes one (a review)
    with pytest.raises(BPSError, match="tensor .w.: shape must hold integers"):
        check_shape("w", 5.0, F32)  # type: ignore[arg-type]
    with pytest.raises(BPSError, match="tensor .w.: shape must hold integers"):
        check_shape("w", True, F32)  # type: ignore[arg-type]
    with pytest.raises(BPSError, match=r"tensor 'w': negative dimension in shape \(-3,\)"):
        check_shape("w", -3, F32)  # type: ignore[arg-type]
    with pytest.raises(BPSError, match=f"bytes; at most {WIRE_INT_MAX}"):
        check_shape("w", (1 << 40, 1 << 40), F32)


def test_dtypes_and_out() -> None:
    assert check_dtype(np.float16) == (np.dtype(np.float16), "float16")
    with pytest.raises(BPSError, match="unsupported dtype complex64; supported: float32"):
        check_dtype(np.complex64)
    out = np.zeros((2, 3), np.float32)
    assert check_out("w", out, (2, 3), F32) is out and check_out("w", None, (2, 3), F32) is None
    with pytest.raises(BPSError, match=r"tensor 'w': out must be a numpy array of shape \(2, 4\)"):
        check_out("w", out, (2, 4), F32)
    out.flags.writeable = False
    with pytest.raises(BPSError, match="tensor 'w': out is read-only"):
        check_out("w", out, (2, 3), F32)


def test_a_dtype_that_is_no_dtype_is_a_bps_error():
    """An array passed as the dtype (shared_array's third argument) met a comparison with "bfloat16", element
    by element: a ValueError instead of the client's error."""
    import numpy as np

    from bps_worker.client.arguments import check_dtype
    from bps_worker.errors import BPSError

    with pytest.raises(BPSError, match="unsupported dtype"):
        check_dtype(np.zeros(3))


@pytest.mark.parametrize("bound, wire", [(None, -1), (0, 0), (3, 3), (np.int64(1), 1), (np.uint8(2), 2)])
def test_a_staleness_bound_of_any_integer_type_passes(bound, wire) -> None:
    """numpy's integers too, as for a root rank (a review's case: np.int64(1) was refused, np.int64(0) as a root
    taken)."""
    got = check_staleness(bound)
    assert got == wire and type(got) is int


@pytest.mark.parametrize("bound", [-1, True, np.True_, 1.0, "1", np.float32(1)])
def test_a_staleness_bound_that_is_no_integer_at_least_0_is_refused(bound) -> None:
    with pytest.raises(BPSError, match="staleness must be None or an integer >= 0"):
        check_staleness(bound)


def test_a_process_forgets_the_modes_it_fixed_first_and_the_daemon_then_judges_a_delta() -> None:
    """Past MAX_MODES names, the quarter fixed first are forgotten, asynchronous ones too (a review: keeping those
    left them unbounded, and a table of them was copied at every new name). A delta of a name never initialised is
    refused here while nothing was forgotten; after, it goes to the daemon, which refuses it there if it has no
    init (a forgotten name's may have had one)."""
    from types import SimpleNamespace

    from bps_worker.client import operations
    from protocol.messages import KIND_ASYNC, KIND_ASYNC_INIT, KIND_SUM

    ops: Any = SimpleNamespace(modes={}, _modes_forgotten=False)
    ops._forget_modes = lambda: operations.Operations._forget_modes(ops)
    claim = operations.Operations.claim_mode
    with pytest.raises(BPSError, match="tensor 'never': async_push_pull before async_init"):
        claim(ops, "never", KIND_ASYNC)
    limit = operations.MAX_MODES
    try:
        operations.MAX_MODES = 100
        for i in range(1000):
            claim(ops, f"a{i}", KIND_ASYNC_INIT if i % 2 else KIND_SUM)
            assert len(ops.modes) <= 100, i
    finally:
        operations.MAX_MODES = limit
    assert "a999" in ops.modes and "a1" not in ops.modes
    claim(ops, "a1", KIND_ASYNC)  # forgotten: the daemon judges it, and nothing is fixed here (it may refuse)
    assert "a1" not in ops.modes
    claim(ops, "a1", KIND_SUM)  # (had the daemon refused that delta, the name is still usable synchronously)
    assert ops.modes["a1"] is False
    with pytest.raises(BPSError, match="was used asynchronously in this process and now synchronously"):
        claim(ops, "a999", KIND_SUM)
