"""A tensor name's local rounds: what every local process asked for, and whether they agree."""

from __future__ import annotations

from protocol.messages import KIND_BROADCAST, Op


def describe(op: Op) -> str:
    """The tensor as a mismatch message names it: ``float32[4,3] (average)``."""
    text = f"{op.dtype}[{','.join(str(d) for d in op.shape)}]"
    if op.kind == KIND_BROADCAST:
        text += f" (broadcast from rank {op.root})"
    elif op.average:
        text += " (average)"
    return text


def agree(a: Op, b: Op) -> bool:
    """Whether two processes asked for the same operation on the same tensor (dtype, shape, kind, root)."""
    return (a.kind, a.dtype, list(a.shape), a.average, a.root, bool(a.cuda)) == \
        (b.kind, b.dtype, list(b.shape), b.average, b.root, bool(b.cuda))
