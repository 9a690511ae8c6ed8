"""What every process of a round must agree on beyond dtype and shape, and broadcasts as copies (issue 14
item 4), without sockets: the server's round table, the worker's local rounds, the messages, the kernel."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bps_runtime import kernels
from bps_server.rounds import FailRound, RoundTable, SumAll, Why, describe
from bps_worker.local_rounds import Failed, LocalRounds, agree
from bps_worker.local_rounds import describe as local_describe
from protocol.errors import LocalProtocolError
from protocol.messages import KIND_BROADCAST, Op, Push


def _push(worker: int, *, root: int = -1, holds_root: bool = False, layout: str = "", rnd: int = 0) -> Push:
    kind = KIND_BROADCAST if root >= 0 else "sum"
    return Push(req=worker, name="t", part=0, round=rnd, worker=worker, dtype="float32", shape=[4], offset=0,
                count=4, kind=kind, root=root, holds_root=holds_root, layout=layout)


def _data(value: float) -> np.ndarray:
    return np.full(4, value, np.float32)


def _mismatch(actions: list[Any]) -> dict[str, tuple[str, str]]:
    """handle -> (ours, theirs) of every push a failed round tells of a mismatch."""
    (failed,) = [a for a in actions if isinstance(a, FailRound)]
    return {f.handle: (f.why.ours, f.why.theirs) for f in failed.fails if f.why.code == "mismatch"}


# -- the server's round table ------------------------------------------------------------------------------
def test_a_broadcast_whose_root_differs_between_workers_fails_for_both_naming_both_roots():
    table: RoundTable[str] = RoundTable(2)
    assert table.push(_push(0, root=0, holds_root=True), _data(10), "w0", 0.0) == []
    actions = table.push(_push(1, root=2, holds_root=True), _data(20), "w1", 0.0)
    assert not any(isinstance(a, SumAll) for a in actions)
    assert _mismatch(actions) == {
        "w0": ("float32[4] (broadcast from rank 0)", "float32[4] (broadcast from rank 2)"),
        "w1": ("float32[4] (broadcast from rank 2)", "float32[4] (broadcast from rank 0)"),
    }


def test_a_layout_that_differs_fails_the_round_naming_both_layouts():
    table: RoundTable[str] = RoundTable(2)
    table.push(_push(0, layout="2 params aaaa"), _data(1), "w0", 0.0)
    actions = table.push(_push(1, layout="2 params bbbb"), _data(1), "w1", 0.0)
    assert _mismatch(actions)["w0"] == ("float32[4] (layout 2 params aaaa)", "float32[4] (layout 2 params bbbb)")


@pytest.mark.parametrize("root_worker", [0, 1, 2])
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_broadcast_round_is_the_roots_data_alone(root_worker: int, deterministic: bool):
    """Whichever worker holds the root and in whatever order the pushes come, the one input is the root's."""
    table: RoundTable[str] = RoundTable(3, deterministic=deterministic)
    root_data = _data(7)
    actions: list[Any] = []
    for worker in (2, 0, 1):
        data = root_data if worker == root_worker else _data(-0.0)
        actions = table.push(_push(worker, root=5, holds_root=worker == root_worker), data, f"w{worker}", 0.0)
        if worker != 1:
            assert actions == []  # nothing happens until every worker pushed
    (work,) = actions
    assert isinstance(work, SumAll) and len(work.inputs) == 1 and work.inputs[0] is root_data
    done = table.complete(work.token)
    assert done is not None and {w.handle for w in done.waiters} == {"w0", "w1", "w2"}


def test_a_broadcast_round_with_no_root_or_two_roots_fails():
    table: RoundTable[str] = RoundTable(2)
    table.push(_push(0, root=3), _data(1), "w0", 0.0)
    (failed,) = table.push(_push(1, root=3), _data(1), "w1", 0.0)
    assert isinstance(failed, FailRound) and "no worker holds broadcast root rank 3" in failed.reason
    table.push(_push(0, root=3, holds_root=True, rnd=1), _data(1), "w0", 0.0)
    (failed,) = table.push(_push(1, root=3, holds_root=True, rnd=1), _data(1), "w1", 0.0)
    assert isinstance(failed, FailRound) and "workers 0 and 1 both hold broadcast root rank 3" in failed.reason


def test_describe_names_the_root_and_the_layout():
    assert describe(_push(0, root=4)) == "float32[4] (broadcast from rank 4)"
    assert describe(_push(0, layout="3 params 0123")) == "float32[4] (layout 3 params 0123)"


@pytest.mark.parametrize("kind,fields", [
    ("sum", dict(average=True)), ("sum", dict(layout="2 params ab")), ("broadcast", dict(root=3)),
    ("async_init", dict(root=1, staleness=2)), ("async_init", dict(root=0)), ("async", dict()),
], ids=["average", "layout", "broadcast", "async-init-bound", "async-init-unbounded", "async"])
def test_a_server_describes_a_push_in_the_words_its_worker_describes_the_op(kind: str, fields: dict[str, Any]):
    """A mismatch a worker found among its processes reaches the other workers' pushes through the server, which
    tells each its own side by comparing the descriptions: they must be the same words (they said "average over
    4" on one side and "average" on the other, so no push matched its side)."""
    op = Op(1, "w", kind, "float32", [4, 2], "seg", **fields)
    push = Push(req=1, name="w", part=0, round=0, worker=0, dtype="float32", shape=[4, 2], offset=0, count=8,
                kind=kind, divisor=4 if op.average else 1, root=op.root, holds_root=op.root == 0,
                layout=op.layout, staleness=op.staleness)
    assert describe(push) == local_describe(op)


# -- the messages --------------------------------------------------------------------------------------------
def test_a_push_names_a_root_for_a_broadcast_and_only_then():
    with pytest.raises(LocalProtocolError, match="broadcast push of 't' has no root"):
        Push(req=0, name="t", part=0, round=0, worker=0, dtype="float32", shape=[4], offset=0, count=4,
             kind=KIND_BROADCAST).check()  # a Push is checked by check() (and where it is parsed)
    with pytest.raises(LocalProtocolError, match="sum push of 't' names a broadcast root"):
        Push(req=0, name="t", part=0, round=0, worker=0, dtype="float32", shape=[4], offset=0, count=4, root=1).check()
    with pytest.raises(LocalProtocolError, match="sum push of 't' names a broadcast root"):
        Push(req=0, name="t", part=0, round=0, worker=0, dtype="float32", shape=[4], offset=0, count=4,
             holds_root=True).check()


@pytest.mark.parametrize("make", [lambda layout: _push(0, layout=layout).check(),
                                  lambda layout: Op(1, "t", "sum", "float32", [4], "seg", layout=layout)],
                         ids=["push", "op"])
def test_a_layout_is_at_most_64_characters(make: Any):
    make("x" * 64)
    with pytest.raises(LocalProtocolError, match="layout of 65 characters; at most 64"):
        make("x" * 65)


# -- the worker's local rounds -----------------------------------------------------------------------------
def _op(layout: str, req: int = 1) -> Op:
    return Op(req, "grad.w", "sum", "float32", [8], "seg", average=True, layout=layout)


def test_local_ops_with_another_layout_disagree_and_the_failure_names_both():
    assert agree(_op("2 params aaaa"), _op("2 params aaaa"))
    assert not agree(_op("2 params aaaa"), _op("2 params bbbb"))
    rounds: LocalRounds[str] = LocalRounds(2, 0, 0)
    rounds.submit("s0", 0, _op("2 params aaaa", 1))
    (failed,) = rounds.submit("s1", 1, _op("2 params bbbb", 2))
    assert isinstance(failed, Failed)
    facts = failed.failure(_op("2 params bbbb", 2))
    assert (facts.code, facts.name, facts.ours, facts.theirs) == (
        "mismatch", "grad.w", "float32[8] (average) (layout 2 params bbbb)",
        "float32[8] (average) (layout 2 params aaaa)")


# -- the kernel: the sum of one input is a copy of its bytes ---------------------------------------------------
@pytest.mark.parametrize("dtype,bits", [
    ("float32", [0x7F800001, 0xFF800123, 0x80000000, 0x00000001]),
    ("float64", [0x7FF0000000000001, 0x8000000000000000, 0x0000000000000001, 0xFFF0000000000ABC]),
    ("float16", [0x7C01, 0xFC23, 0x8000, 0x0001]),
    ("bfloat16", [0x7F81, 0xFF93, 0x8000, 0x0001]),
])
def test_the_sum_of_one_input_keeps_every_bit(dtype: str, bits: list[int]):
    """Signalling NaNs (with payloads and both signs), -0.0 and the smallest subnormal, in storage form."""
    storage = kernels.STORAGE[dtype]
    src = np.array(bits, dtype=np.dtype(f"u{storage.itemsize}")).view(storage)
    out = np.empty_like(src)
    kernels.sum_into(out, [src], dtype)
    assert out.tobytes() == src.tobytes()


def test_a_late_push_of_an_aborted_round_hears_why_after_the_next_round_was_aborted_too():
    """A mismatch within one machine aborts its rounds at the anchor server, one after another: the other
    machine's late push of the first still gets the first abort's reason (it got "stale round")."""
    table: RoundTable[str] = RoundTable(2)
    table.abort("t", 0, 0, 0, Why("mismatch of step 0"))
    table.abort("t", 0, 1, 0, Why("mismatch of step 1"))
    (fail,) = table.push(_push(1), _data(1), "w1", 0.0)
    assert "aborted by worker 0: mismatch of step 0" in fail.reason
