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

import dataclasses
import hashlib
from itertools import accumulate
from math import prod
from typing import Callable

import numpy as np

from bps_runtime import kernels
from bps_runtime import segments as shm
from protocol.messages import KIND_SUM, MAX_FUSED_ENTRIES, Done, DoneBatch, Failure, Op

from .fusion import FusedRound
from .local_rounds import LocalRound
from .operation import Contribution, Operation, OperationHost, Scattered
from .session import ClientSession

__all__ = ["FusedOperation", "layout_digest"]


def layout_digest(names: list[str]) -> str:
    """What the servers compare for a fused tensor: its tensors' names, in order, and how many."""
    h = hashlib.blake2b(digest_size=12)
    h.update("\0".join(names).encode())
    h.update(b"\0")  # each name ends in a NUL (the digest workers of earlier versions computed name by name)
    return f"fused:{h.hexdigest()}:{len(names)}"


class _Runs:
    """One local rank's tensors in one of its segments (see ``FusedPath``): filled by :meth:`add`, then
    :meth:`freeze` makes the tables the kernel copies."""

    __slots__ = ("member", "rank", "segment", "end", "flat", "fused", "at", "sizes", "_columns")

    def __init__(self, member: ClientSession, rank: int, segment: str) -> None:
        self.member, self.rank, self.segment = member, rank, segment
        self.end = 0  # the segment must still hold this many bytes
        self.flat: np.ndarray = np.empty(0, np.uint8)  # the segment's bytes, mapped at the last check
        # Per tensor, in bytes: its offset in the fused tensor, its offset in the segment, its size.
        self._columns: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.fused = self.at = self.sizes = np.empty(0, np.int64)  # the same, as the kernel's tables (freeze)

    def add(self, lo: int, offset: int, nbytes: int) -> None:
        fused, at, sizes = self._columns
        fused.append(lo)
        at.append(offset)
        sizes.append(nbytes)
        self.end = max(self.end, offset + nbytes)

    def freeze(self) -> _Runs:
        self.fused, self.at, self.sizes = (np.array(c, np.int64) for c in self._columns)
        return self


class FusedOperation(Operation):
    """The fused tensor ``key`` of one plan group (see the module docstring)."""

    def __init__(self, host: OperationHost, key: str, local_round: int, rounds: list[FusedRound[ClientSession]],
                 ) -> None:
        dtype, _, average, _ = rounds[0].spec
        counts = [prod(fr.spec[1]) for fr in rounds]
        starts = [0, *accumulate(counts)]
        total = starts.pop()
        op = Op(0, key, KIND_SUM, dtype, [total], "", average=average,
                layout=layout_digest([fr.name for fr in rounds]))
        super().__init__(host, LocalRound(key, local_round, op, host.rank_offset, set()))
        self.rounds = rounds
        self.starts = starts
        self.counts = counts
        self.priority = max(e.priority for fr in rounds for e in fr.entries if e is not None)
        self.path = FusedPath()
        self.failed = False  # its processes heard a failure

    def failed_steps(self) -> list[str]:
        """The names whose fused rounds failed with this operation, in the job still running, before its sum was
        complete: the lane round failed at the server, for every worker that ran the plan, so each name's step
        takes an unfused round number on every machine (``bps_worker.fusion``, "Each round has an index"), as it
        does where the plan's group was given up (the round of the culprit failed there before the plan came).
        A failure after the sum (a segment that shrank) is this machine's alone: the peers' rounds succeeded.
        A lane push whose answer died with our connection to the server was pushed again, and the server said
        what became of its round (``bps_worker.link``): summed for the peers (``summed_elsewhere``: their rounds
        succeeded and take no number, so ours takes none), or failed for every worker. Where the link gave up
        instead (``unsettled``), the driver asks the server first (``FusedSums._steps_unless_summed``)."""
        if not self.failed or self.summed or self.summed_elsewhere or not self._job_current():
            return []
        return [fr.name for fr in self.rounds]

    def memory_of(self) -> str:
        """The names summed as this fused tensor (the processes never heard of its own name)."""
        names = [repr(fr.name) for fr in self.rounds]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return f"the fused tensor of {', '.join(names[:3])}{more} ({len(names)} small tensors summed as one)"

    def reply_done(self, scattered: Scattered) -> None:
        self.host.counters.fused_tensors += len(self.rounds)
        by_session: dict[ClientSession, list[int]] = {}
        for fr in self.rounds:
            for e in fr.entries:
                if e is not None:
                    by_session.setdefault(e.member, []).append(e.req)
        for session, reqs in by_session.items():
            for start in range(0, len(reqs), MAX_FUSED_ENTRIES):
                session.send(DoneBatch(reqs[start:start + MAX_FUSED_ENTRIES]))

    def answer_failure(self, failure_for: Callable[[int, bool], Failure]) -> None:
        self.failed = True
        for fr in self.rounds:
            for e in fr.entries:
                if e is not None:
                    e.member.send(self._as_heard(failure_for(e.req, False), fr.name))

    def _as_heard(self, failure: Failure, name: str) -> Failure:
        """``failure`` as the process of small tensor ``name`` hears it: the server's and the links' texts name
        the fused tensor, whose key (``\x00fused/...``) the process never saw; they name its tensor instead."""
        key, said = repr(self.name), f"{name!r} (summed fused with {len(self.rounds) - 1} other small tensors)"
        fields = {f: getattr(failure, f).replace(key, said).replace(self.name, name)
                  for f in ("message", "what", "detail")
                  if key in getattr(failure, f) or self.name in getattr(failure, f)}
        if failure.name == self.name:
            fields["name"] = name
        return dataclasses.replace(failure, **fields) if fields else failure


class FusedPath:
    """Where a fused tensor's parts live: the slots of many small tensors in the processes' segments.

    Its tensors are moved as *runs*: per local rank and segment, a table of (where in the fused tensor, where
    in the segment, how many bytes), made once per operation and copied by one kernel call each way."""

    def __init__(self) -> None:
        self._runs: list[_Runs] | None = None

    def runs(self, o: FusedOperation, *, departed: bool = False) -> list[_Runs]:
        """The runs of every (local rank, segment) the tensors live in, each segment checked to still hold
        them (a process may shrink its segments: issue 14, item 3); checked again on every call. With
        ``departed``, not those of processes that left meanwhile: their memory went with them, and nobody waits for
        their sums (the copy back: a process killed with a fused step in flight failed its live local peers'
        names, whose sums the other machines got, blaming a truncated segment: a review's case)."""
        if self._runs is None:
            tables: dict[tuple[int, str], _Runs] = {}
            itemsize = o.itemsize
            for fr, start, count in zip(o.rounds, o.starts, o.counts):
                lo, nbytes = start * itemsize, count * itemsize
                for rank, e in enumerate(fr.entries):
                    if e is not None:
                        runs = tables.get((rank, e.segment))
                        if runs is None:
                            runs = tables[(rank, e.segment)] = _Runs(e.member, rank, e.segment)
                        runs.add(lo, e.offset, nbytes)
            self._runs = [runs.freeze() for runs in tables.values()]
        kept = [r for r in self._runs if not r.member.closed] if departed else self._runs
        for r in kept:
            seg = r.member.arena.segments.get(r.segment)
            if seg is None or seg.buf is None:
                raise shm.SegmentSizeError(r.segment, 0, r.end, o.name, replaced=True)
            shm.check_size(seg, r.end, o.name)
            r.flat = np.frombuffer(seg.buf, np.uint8)
        return kept

    async def gather(self, o: Operation) -> Contribution:
        assert isinstance(o, FusedOperation)
        runs = self.runs(o)
        buf, segment, base = o.staging()
        raw = buf.view(np.uint8)
        size = o.host.config.local_size
        if size == 1:
            for r in runs:
                kernels.copy_runs(raw, r.fused, r.flat, r.at, r.sizes)
            return Contribution(buf, segment, base, direct=False)
        scratch = [np.empty(o.nbytes, np.uint8) for _ in range(size)]
        for r in runs:
            kernels.copy_runs(scratch[r.rank], r.fused, r.flat, r.at, r.sizes)
        storage = kernels.STORAGE[o.op.dtype]
        await o.off_loop(kernels.sum_into, buf, [s.view(storage) for s in scratch], o.op.dtype)
        return Contribution(buf, segment, base, direct=False)

    def handback_slots(self, o: Operation) -> list[np.ndarray]:
        return []  # every tensor's sum is copied back at the end (copy_back)

    def intact(self, o: Operation) -> bool:
        return True

    async def copy_back(self, o: Operation, out: np.ndarray) -> None:
        assert isinstance(o, FusedOperation)
        raw = out.view(np.uint8)
        for r in self.runs(o, departed=True):  # checked again: the processes had the network's time to shrink them
            kernels.copy_runs(r.flat, r.at, raw, r.fused, r.sizes)

    def done(self, op: Op, out_segment: str, out_base: int) -> Done:
        raise AssertionError("a fused operation answers with DoneBatch (FusedOperation.reply_done)")
