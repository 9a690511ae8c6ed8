"""One plan group's fused tensor: many small tensors of one dtype summed, pushed and handed back as one.

A ``FusePlan`` (``bps_worker.fusion``) names small tensors in one order for every worker. Those of one dtype
(and the same ``average``) form one fused tensor, laid out in plan order: a ``FusedOperation`` is an
:class:`~bps_worker.operation.Operation` on it, whose stages differ only where the tensors live
(``FusedPath``):

- *gather*: each local rank's tensors are copied into one scratch array per rank (plain memory), in plan
  order, and summed into the fused staging buffer in one kernel call (a single process's go straight there);
- *scatter* and *wait*: as any tensor, all partitions to the planning server (``Placement.fused_key``);
- *hand back*: each tensor's sum is copied into every process's slot;
- *reply*: one ``DoneBatch`` per process, or a ``Failure`` per request.

Its ``layout`` is a digest of the names in it, so workers that somehow ran different plans on one key fail
with a mismatch at the server instead of summing unrelated tensors.
"""

from __future__ import annotations

import hashlib
from math import prod
from typing import Callable

import numpy as np

from bps_runtime import kernels
from bps_runtime import segments as shm
from protocol import dtypes
from protocol.messages import KIND_SUM, MAX_FUSED_ENTRIES, Done, DoneBatch, Failure, Op

from .fusion import FusedRound
from .local_rounds import LocalRound
from .operation import Contribution, Operation, OperationHost, Scattered
from .session import ClientSession

__all__ = ["FusedOperation", "layout_digest"]


def layout_digest(names: list[str]) -> str:
    """What the servers compare for a fused tensor: its tensors' names, in order, and how many."""
    h = hashlib.blake2b(digest_size=12)
    for name in names:
        h.update(name.encode())
        h.update(b"\0")
    return f"fused:{h.hexdigest()}:{len(names)}"


class FusedOperation(Operation):
    """The fused tensor ``key`` of one plan group (see the module docstring)."""

    def __init__(self, host: OperationHost, key: str, local_round: int, rounds: list[FusedRound[ClientSession]],
                 ) -> None:
        dtype, _, average, _ = rounds[0].spec
        counts = [prod(fr.spec[1]) for fr in rounds]
        starts = [0] * len(counts)
        total = 0
        for i, c in enumerate(counts):
            starts[i] = total
            total += c
        op = Op(0, key, KIND_SUM, dtype, [total], "", average=average,
                layout=layout_digest([fr.name for fr in rounds]))
        super().__init__(host, LocalRound(key, local_round, op, host.rank_offset, set()))
        self.rounds = rounds
        self.starts = starts
        self.counts = counts
        self.priority = max(e.priority for fr in rounds for e in fr.members())
        self.path = FusedPath(self)

    def reply_done(self, scattered: Scattered) -> None:
        by_session: dict[ClientSession, list[int]] = {}
        for fr in self.rounds:
            for e in fr.entries:
                if e is not None:
                    by_session.setdefault(e.member, []).append(e.req)
        for session, reqs in by_session.items():
            for start in range(0, len(reqs), MAX_FUSED_ENTRIES):
                session.send(DoneBatch(reqs[start:start + MAX_FUSED_ENTRIES]))

    def answer_failure(self, failure_for: Callable[[int, bool], Failure]) -> None:
        for fr in self.rounds:
            for e in fr.entries:
                if e is not None:
                    e.member.send(failure_for(e.req, False))


class FusedPath:
    """Where a fused tensor's parts live: the slots of many small tensors in the processes' segments."""

    def __init__(self, operation: FusedOperation) -> None:
        self.operation = operation
        self.itemsize = dtypes.ITEMSIZE[operation.op.dtype]

    def _segments(self) -> dict[tuple[int, str], np.ndarray]:
        """Each process segment the tensors live in, as bytes, checked to still hold them (a process may
        shrink its segments: issue 14, item 3)."""
        o = self.operation
        ends: dict[tuple[int, str], tuple[ClientSession, int]] = {}
        for fr, count in zip(o.rounds, o.counts):
            nbytes = count * self.itemsize
            for e in fr.entries:
                if e is not None:
                    key = (id(e.member), e.segment)
                    end = e.offset + nbytes
                    seen = ends.get(key)
                    if seen is None or seen[1] < end:
                        ends[key] = (e.member, end)
        flat = {}
        for key, (session, end) in ends.items():
            seg = session.arena.segments.get(key[1])
            if seg is None or seg.buf is None:
                raise shm.SegmentSizeError(key[1], 0, end, o.name, replaced=True)
            shm.check_size(seg, end, o.name)
            flat[key] = np.frombuffer(seg.buf, np.uint8)
        return flat

    async def gather(self) -> Contribution:
        o = self.operation
        flat = self._segments()
        buf, segment, base = o.staging()
        raw = buf.view(np.uint8)
        size = o.host.config.local_size
        itemsize = self.itemsize
        if size == 1:
            for fr, start, count in zip(o.rounds, o.starts, o.counts):
                e = fr.entries[0]
                assert e is not None
                lo = start * itemsize
                raw[lo:lo + count * itemsize] = flat[(id(e.member), e.segment)][e.offset:e.offset + count * itemsize]
            return Contribution(buf, segment, base, direct=False)
        scratch = [np.empty(o.nbytes, np.uint8) for _ in range(size)]
        for fr, start, count in zip(o.rounds, o.starts, o.counts):
            lo, nbytes = start * itemsize, count * itemsize
            for rank, e in enumerate(fr.entries):
                assert e is not None  # a planned round is complete
                scratch[rank][lo:lo + nbytes] = flat[(id(e.member), e.segment)][e.offset:e.offset + nbytes]
        storage = kernels.STORAGE[o.op.dtype]
        await o.off_loop(kernels.sum_into, buf, [s.view(storage) for s in scratch], o.op.dtype)
        return Contribution(buf, segment, base, direct=False)

    def handback_slots(self) -> list[np.ndarray]:
        return []  # every tensor's sum is copied back at the end (copy_back)

    def intact(self) -> bool:
        return True

    async def copy_back(self, out: np.ndarray) -> None:
        o = self.operation
        flat = self._segments()  # checked again: the processes had the network's time to shrink them
        raw = out.view(np.uint8)
        itemsize = self.itemsize
        for fr, start, count in zip(o.rounds, o.starts, o.counts):
            lo, nbytes = start * itemsize, count * itemsize
            part = raw[lo:lo + nbytes]
            for e in fr.entries:
                if e is not None:
                    flat[(id(e.member), e.segment)][e.offset:e.offset + nbytes] = part

    def done(self, op: Op, out_segment: str, out_base: int) -> Done:
        raise AssertionError("a fused operation answers with DoneBatch (FusedOperation.reply_done)")
