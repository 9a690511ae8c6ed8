"""``push_pull_group``: a process's whole tree of tensors in one call, its small entries packed into a few.

Theory of operation. Every process of the job names the same tensors, in any order. Sorted by name, the
group's entries are in one order everywhere; its small entries (at most ``PACK_MAX_BYTES`` each), laid end to
end per dtype in that order, make one tensor per dtype that every process builds alike. Summing those few
tensors sums every entry, and the worker daemons and servers see a handful of ordinary tensors instead of
thousands of names: the per-tensor cost left is a copy in and a copy out.

That holds only where every process's group is the same: same names, and for each name the same dtype and
shape. A difference would pack differently on two processes. The packed tensors would then disagree on
their layout (a digest of the group, carried as ``Op.layout``, which the daemons compare) or, worse, on
their dtypes, so that one process waits for a packed tensor the other never sends. So the processes first
agree, in one small sum: each pushes ``chunks`` of the group's digest and their squares (:func:`agreement`).
The sums equal ``size`` times one's own chunks and squares only where every process's chunk is the same
(``sum((c - c_own)**2) = 0``), so every process reaches the same answer, and none waits for another:

- all agree: the packed tensors are summed and cut back into the entries;
- any differs: every process takes the per-name path (:meth:`Operations.start_group`) for the small entries,
  which names the tensor that differs, on every process, and completes the others.

The large entries always go by name, started at once (a per-name sum needs no agreement). The agreement's
name and the packed tensors' are the client's own (``GROUP_PREFIX`` and a digest of the group's names), so
two calls with the same names use the same slots every step. A group smaller than ``PACK_MIN_ENTRIES`` is not
worth a round trip for the agreement and goes by name throughout (its size is the same on every process that
names the same tensors). Processes whose groups name different tensors push agreements of different names:
each waits for its own, as processes that push different names one by one wait (for ever, or
``cluster.stall_timeout``). The stall warnings and the error then name the group (a few of its names, and how
many), not the agreement's internal name. (One agreement name for every group, tried to let such groups meet
and go by name, put the agreements of one process's threads' groups in a lock cycle with the peers', and one
process's extra call a round out of step with its peers' calls for good: a review.)
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any, Final, Mapping, Sequence

import numpy as np

from protocol.messages import KIND_SUM

from ..errors import BPSError, reworded
from .arguments import GROUP_PREFIX
from .handle import Handle

if TYPE_CHECKING:
    from .operations import Operations

__all__ = ["PACK_MAX_BYTES", "PACK_MIN_ENTRIES", "GroupPlan", "agreement", "agrees", "described",
           "push_pull_group"]

# Entries of at most this many bytes are packed (a constant, not a setting: every process must pack alike).
PACK_MAX_BYTES: Final = 64 * 1024
# Groups with fewer entries go by name (the agreement's round trip would cost more than it saves).
PACK_MIN_ENTRIES: Final = 8
# The digest is compared as this many chunks of CHUNK_BITS bits: a chunk's square times the job's size stays
# far inside int64 (2**40 * 2**20 processes).
CHUNKS: Final = 4
CHUNK_BITS: Final = 20


@dataclass
class Packed:
    """The small entries of one dtype, end to end in name order: ``(index, offset, count)`` each."""

    wire: str
    dtype: np.dtype
    entries: list[tuple[int, int, int]]
    total: int


@dataclass
class GroupPlan:
    """How one call's entries go: the packed tensors, the large entries, the digests that name them."""

    names_digest: str  # of the sorted names alone: the agreement's and the packed tensors' names
    digest: bytes  # of every entry's name, dtype and shape, and of average: what the processes must agree on
    packed: list[Packed]
    large: list[int]  # indexes of the entries that go by name whatever happens

    def small(self) -> list[int]:
        return [i for p in self.packed for i, _, _ in p.entries]


def plan_group(names: list[str], dtypes: list[np.dtype], shapes: list[tuple[int, ...]], wires: list[str], *,
               average: bool) -> GroupPlan:
    """The plan of checked entries (see the module docstring). The digest covers ``average`` too: processes that
    differ in it take the per-name path, where the daemons name the tensor that differs (a packed tensor's
    mismatch named only the group's internal name)."""
    order = sorted(range(len(names)), key=names.__getitem__)
    sorted_names = "\x00".join(names[i] for i in order).encode()
    names_digest = hashlib.blake2b(sorted_names, digest_size=12).hexdigest()
    full = hashlib.blake2b(b"average" if average else b"sum", digest_size=16)
    packs: dict[str, Packed] = {}
    large: list[int] = []
    for i in order:
        count = prod(shapes[i])
        full.update(f"{names[i]}\x00{wires[i]}\x00{shapes[i]}\x00".encode())
        if count * dtypes[i].itemsize > PACK_MAX_BYTES:
            large.append(i)
            continue
        pack = packs.setdefault(wires[i], Packed(wires[i], dtypes[i], [], 0))
        pack.entries.append((i, pack.total, count))
        pack.total += count
    return GroupPlan(names_digest, full.digest(), [packs[w] for w in sorted(packs)], large)


def agreement(digest: bytes) -> np.ndarray:
    """What a process pushes to learn whether every process has this ``digest``: chunks and their squares."""
    value = int.from_bytes(digest, "big")
    chunks = [(value >> (CHUNK_BITS * k)) & ((1 << CHUNK_BITS) - 1) for k in range(CHUNKS)]
    return np.array(chunks + [c * c for c in chunks], dtype=np.int64)


def agrees(mine: np.ndarray, summed: np.ndarray, size: int) -> bool:
    """Whether the sum of every process's :func:`agreement` says they all pushed ``mine``."""
    return bool(np.array_equal(summed, mine * size))


def push_pull_group(ops: Operations, arrays: Sequence[Any], names: Sequence[Any], *, average: bool,
                    priority: int) -> list[np.ndarray]:
    """Sum (or average) every ``arrays[i]`` as ``names[i]`` (see the module docstring)."""
    if len(arrays) != len(names):
        raise BPSError(f"push_pull_group: {len(arrays)} arrays but {len(names)} names")
    arrays = [np.asarray(a) for a in arrays]
    if len(arrays) < PACK_MIN_ENTRIES:
        return ops.finish_group(ops.start_group(arrays, names, average=average, priority=priority))
    checked = [ops.checked(name, a.dtype, a.shape, average, priority) for a, name in zip(arrays, names)]
    names = [c[0] for c in checked]
    for name in names:  # packed, the daemons never see these names: the process checks their mode alone
        if ops.modes.get(name) is not False:
            ops.claim_mode(name, KIND_SUM)
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise BPSError(f"tensor {name!r} appears twice in one push_pull_group")
        seen.add(name)
    ops.check_free(names)  # (the large entries are claimed as they start; the packed ones never are)
    plan = plan_group(names, [c[1] for c in checked], [c[3] for c in checked], [c[2] for c in checked],
                      average=average)
    results: list[np.ndarray | None] = [None] * len(arrays)
    large = ops.start_group([arrays[i] for i in plan.large], [names[i] for i in plan.large], average=average,
                            priority=priority) if plan.large else []
    failure: BaseException | None = None
    try:
        mine = agreement(plan.digest)
        summed = _agree(ops, mine, f"{GROUP_PREFIX}{plan.names_digest}/agree", names, priority)
        if agrees(mine, summed, ops.size):
            _sum_packed(ops, plan, arrays, results, average, priority)
        else:  # some process's group differs: by name, so that the one that differs is named
            small = plan.small()
            summed_small = ops.finish_group(ops.start_group([arrays[i] for i in small], [names[i] for i in small],
                                                            average=average, priority=priority))
            for i, y in zip(small, summed_small):
                results[i] = y
    except BaseException as exc:
        failure = exc
    try:  # whatever happened above: no large entry stays in flight
        for i, y in zip(plan.large, ops.finish_group(large)):
            results[i] = y
    except BPSError as exc:
        failure = failure or exc
    if failure is not None:
        raise failure
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


# What an agreement's words end with, and how a notice names one this process does not wait for (repr: NUL
# escaped).
_RULE: Final = "every process's group must name the same tensors"
_OTHER_AGREEMENT: Final = re.compile(r"(tensor )?'" + re.escape(repr(GROUP_PREFIX)[1:-1]) + r"[0-9a-f]+/agree'")


def described(votes: Mapping[str, str], line: str) -> str:
    """A daemon's notice as the process logs it: each agreement of ``votes`` (in flight here: its name -> its
    words) named as its group, any other as another process's group, of other tensors."""
    for name, about in list(votes.items()):  # (the reader thread: a copy, the dict may change)
        line = line.replace(f"tensor {name!r}", about).replace(repr(name), about)
    return _OTHER_AGREEMENT.sub(f"the agreement of another process's push_pull_group, of other tensors than this "
                                f"process's ({_RULE})", line)


def _agree(ops: Operations, mine: np.ndarray, name: str, names: list[str], priority: int) -> np.ndarray:
    """The agreement's sum. While it is in flight the daemons' stall notices that name it name the group instead
    (:func:`described`), and so does its error."""
    shown = ", ".join(repr(n) for n in sorted(names)[:3])
    about = (f"the agreement of a push_pull_group of {len(names)} tensors ({shown}{', ...' if len(names) > 3 else ''}"
             f"; {_RULE})")
    ops.group_votes[name] = about
    try:
        return ops.finish(ops.start(mine, name, KIND_SUM, average=False, priority=priority, root=-1, out=None,
                                    internal=True), None)
    except BPSError as exc:
        raise reworded(exc, lambda text: text.replace(f"tensor {name!r}", about).replace(repr(name), about)) from None
    finally:
        ops.group_votes.pop(name, None)


def _sum_packed(ops: Operations, plan: GroupPlan, arrays: list[np.ndarray], results: list[np.ndarray | None],
                average: bool, priority: int) -> None:
    """Sum the packed tensors (all started, then all finished) and cut the entries' results out of them."""
    handles: list[tuple[Packed, Handle]] = []
    try:
        for pack in plan.packed:
            def fill(view: np.ndarray, pack: Packed = pack) -> None:
                for i, offset, count in pack.entries:
                    view[offset:offset + count] = arrays[i].reshape(-1)

            name = f"{GROUP_PREFIX}{plan.names_digest}/{pack.wire}"
            handles.append((pack, ops.start_filled(name, KIND_SUM, pack.dtype, (pack.total,), fill, average=average,
                                                   priority=priority, root=-1, out=None,
                                                   layout=plan.digest.hex(), internal=True)))
    finally:
        failure: BaseException | None = None
        for pack, handle in handles:
            try:
                summed = ops.finish(handle, None, view=True)
            except BPSError as exc:
                failure = failure or exc
                continue
            for i, offset, count in pack.entries:
                results[i] = summed[offset:offset + count].reshape(arrays[i].shape).copy()
        if failure is not None:
            raise failure
