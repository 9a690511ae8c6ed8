"""Rank programs of the worker-session tests (top-level, so spawn can import them): a mismatch between the
two processes of one machine, and an Alloc that would move a slot while its op is in flight."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import bps_worker.client as bps
from protocol.messages import Op


def local_mismatch() -> dict[str, Any]:
    """Ranks 0 and 1 (one machine) disagree about 'w': float32[4] against float32[5]; the others push [4]."""
    rank = bps.rank()
    n = 5 if rank == 1 else 4
    facts: dict[str, Any] = {}
    start = time.monotonic()
    try:
        bps.push_pull(np.ones(n, np.float32), "w", average=False)
    except bps.BPSError as exc:
        facts = {"type": type(exc).__name__, "name": getattr(exc, "name", None),
                 "ours": getattr(exc, "ours", None), "theirs": getattr(exc, "theirs", None), "text": str(exc)}
    elapsed = time.monotonic() - start
    after = bps.push_pull(np.ones(1, np.float32), "w.after", average=False)
    return {"facts": facts, "elapsed": elapsed, "after": float(after[0])}


def alloc_while_in_flight() -> dict[str, Any]:
    """Rank 0 starts an async push of 'x' (1 MiB: a dedicated segment) that waits for rank 1, then asks its
    daemon for a four times larger slot of 'x' before synchronizing (the client itself never does; here
    through its connection): that Alloc would free the memory the op in flight reads, and must be refused.
    Then both ranks' 'x' completes, and so does 'y'."""
    rank = bps.rank()
    n = 1 << 18
    error: dict[str, Any] = {}
    if rank == 0:
        handle = bps.push_pull_async(np.ones(n, np.float32), "x", average=False)
        try:
            bps._operations().conn.allocate("x", 4 * n * 4)
        except bps.BPSError as exc:
            error = {"type": type(exc).__name__, "text": str(exc)}
        first = bps.synchronize(handle)
    else:
        time.sleep(1.0)  # rank 0's Alloc arrives while its op waits for ours
        first = bps.push_pull(np.ones(n, np.float32), "x", average=False)
    then = bps.push_pull(np.full(10, float(rank), np.float32), "y", average=False)
    return {"error": error, "first": float(np.asarray(first).min()), "first_max": float(np.asarray(first).max()),
            "then": float(np.asarray(then)[0])}


def slab_given_up_in_flight() -> dict[str, Any]:
    """Rank 0 starts an async push of the small 's' (carved from its first slab) that waits for rank 1, then gives
    that slab up through its connection (an Alloc whose ``free`` names it; the client itself never does while
    one of its tensors is in flight). The daemon must not free memory an op in flight reads: 's' completes,
    exact, and so does a small 't' after it (carved from the same slab, which the client still maps)."""
    rank = bps.rank()
    ops = bps._operations()
    if rank == 0:
        handle = bps.push_pull_async(np.full(100, 3.0, np.float32), "s", average=False)
        bps.poll(handle)  # sends its fused batch now (not at the cycle's end): on the socket before the Alloc
        [slab] = ops.slots._slabs.values()
        ops.conn.allocate("other", 1 << 20, [slab])  # a large tensor's slot, giving the slab up first
        first = bps.synchronize(handle)
    else:
        time.sleep(1.0)  # rank 0's Alloc arrives while its op waits for ours
        first = bps.push_pull(np.full(100, 3.0, np.float32), "s", average=False)
    then = bps.push_pull(np.full(10, float(rank), np.float32), "t", average=False)
    return {"first": sorted(set(np.asarray(first).tolist())), "then": sorted(set(np.asarray(then).tolist())),
            "slabs": len(ops.slots._slabs)}


def duplicate_request_then_alloc() -> dict[str, Any]:
    """Rank 0's 'x' (1 MiB) waits for rank 1; rank 0 then sends, through its connection, an Op of 'y' that reuses
    the number of the request in flight (refused), and asks for a larger slot of 'x' (refused while 'x' runs,
    unless the refusal above made the daemon forget it: it then freed the memory the op reads). Both ranks'
    round of 'x' must complete, exact. The Op is the client's bug played here: its own never reuse a number."""
    rank = bps.rank()
    n = 1 << 18
    ops = bps._operations()
    error = ""
    if rank == 0:
        handle = bps.push_pull_async(np.ones(n, np.float32), "x", average=False)
        slot = ops.slots.slots["x"]
        ops.conn._send(Op(handle.req, "y", "sum", "float32", [4], slot.segment_name, offset=slot.offset))
        try:
            ops.conn.allocate("x", 4 * n * 4)
        except bps.BPSError as exc:
            error = str(exc)
        try:  # (the refusal of the duplicate answered this request number: the client took it for its own)
            bps.synchronize(handle)
        except bps.BPSError:
            pass
        first = np.full(n, 2.0, np.float32)
    else:
        time.sleep(1.0)  # rank 0's messages arrive while its op waits for ours
        first = bps.push_pull(np.ones(n, np.float32), "x", average=False)
    bps.push_pull(np.ones(1, np.float32), "z")  # (rank 0 stays until rank 1's round of 'x' is done)
    return {"error": error, "first": sorted(set(np.asarray(first).tolist()))}


def same_name_while_running(elems: int) -> dict[str, Any]:
    """Rank 0 sends a second Op of 'x' right behind its first, from another slot, as a client with a bug could,
    while the first waits for rank 1 (another machine): the daemon must refuse it (a running round of a name
    shares its buffers; the second was taken, and answered the first with its data). 'x' sums once, exact."""
    rank = bps.rank()
    ops = bps._operations()
    if rank == 1:
        time.sleep(1.0)
        return {"first": sorted(set(bps.push_pull(np.ones(elems, np.float32), "x", average=False).tolist()))}
    first = bps.push_pull_async(np.ones(elems, np.float32), "x", average=False)
    other = ops.slots.slot_for("x-other", elems * 4)
    np.frombuffer(other.segment.buf, np.float32, elems, other.offset)[:] = 2.0
    reply = ops.conn.rpc(Op(ops.conn.next_req(), "x", "sum", "float32", [elems], other.segment_name,  # type: ignore
                            offset=other.offset))
    result = bps.synchronize(first)
    return {"second": type(reply).__name__, "text": getattr(reply, "message", ""),
            "first": sorted(set(np.asarray(result).tolist()))}


def left_with_a_long_name(seconds: float) -> dict[str, Any]:
    """Rank 0 pushes a name whose repr is over 4096 characters (800 zero-width spaces: a valid name of 800
    characters); rank 1 (the same machine) leaves after ``seconds`` without pushing it. The daemon failed to
    build its own failure (a field over 4096 characters, raised where it failed the round): rank 0 had no answer,
    and the leaver's memory stayed. Rank 0 must get a BPSError at once."""
    if bps.rank() == 1:
        time.sleep(seconds)
        return {}
    start = time.monotonic()
    try:
        bps.push_pull(np.ones(4, np.float32), "\u200b" * 800, average=False)
        error = "none"
    except bps.BPSError as exc:
        error = type(exc).__name__
    return {"error": error, "waited": time.monotonic() - start}
