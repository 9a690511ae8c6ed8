"""Fused small sums on one machine: which local processes issued which small tensors, pure decisions, no I/O.

Theory of operation (issue 16). A training process issues thousands of small sums per step; one message,
one local round and one push per tensor would cost far more than the bytes. So small sums (at most
``Welcome.fusion_bytes``) travel fused at every hop:

1. the client packs the ones issued close together into one ``OpBatch`` (its fusion buffer and cycle time);
2. this room collects each tensor's entries from the ``local_size`` processes, like a local round
   (``bps_worker.local_rounds``) but in bulk: a :class:`FusedRound` per name, no message per entry;
3. a round complete here is *reported* to the name's anchor server (``FuseReady``, one message per server
   and pass of the event loop), which plans the names every worker reported (``bps_server.fusion``);
4. a ``FusePlan`` names tensors in one order for every worker: the daemon sums each tensor's processes into
   one fused tensor per dtype, pushes it to that server as an ordinary tensor (``bps_worker.operation``'s
   ``FusedOperation``), copies each sum back into the processes' slots and answers with one ``DoneBatch``
   per process.

Failures keep the local rounds' rules: a process that submits a name it has in flight is refused; processes
that disagree about a name fail that name (only), for every process here and, through the anchor server
(``FuseAbort``), on every machine; a failed round stays until every local rank has submitted to it or
left, so a late process gets its round's error; a process that leaves fails every round it is part of or
awaited by; a reset fails everything.

Rounds of one name. A name has at most one round collecting or reported; behind it, any number of failed
rounds that local ranks have still to submit to (a slow rank can be several steps behind its peers), kept
oldest first: a rank's entry joins the oldest one it is not yet part of. A round that failed here after we
reported it is *abandoned*: the anchor answers every report exactly once, with a plan or a failure
(``FuseFailed``), and that answer belongs to the oldest abandoned round of the name before the round
reported now. So abandoned rounds are kept in order too, until their answer comes (or the connection they
were reported on is gone).

Each round has an index: the rounds of its name made here before it in this epoch (unfused ones too, see
``skip``). The other way round, a fused round that fails takes a number of the name's unfused rounds
(``Decisions.steps``): a step of a name is one unfused round number on every machine whichever path each
took, so that an unfused round of a later step lines up with the peers'. A failure is everywhere (the anchor
fails the name for every worker), and where some processes pushed it unfused (sizes on both sides of the
fusion limit) one machine may have an unfused round of that step and another none; without the number, the
first machine's later unfused rounds of the name were one ahead of the second's for good (a hang). A fused
round that fails beside an unfused round of its step here (``fail_name``'s ``unfused``) takes no second one.
A planned round fails with its plan's group: the group's lane round failed at the anchor, for every worker
that ran the plan (``FusedOperation.failed_steps``, which asks the anchor where our connection lost the
answer), or a name of it failed here before the plan came and we give the group up (``FusedSums._give_up``);
each of its names takes a number then too, on every machine. Before,
only the round that failed before its plan came took one (``_fail``), its peers' rounds and its group's other
rounds none (a plan lost with a connection, or a round abandoned after its report: fault_soak seed 311 hung).
The daemon gives the number's round up at the anchor (``WorkerDaemon.unfused_step``), so that its round table
counts the step too: a machine that rejoins mid-job is placed at the peers' round by it. Reports and aborts say it while our processes are those the job began with (``aligned``), so that
the anchor tells a stale round from a current one after it restarted (see ``bps_server.fusion``).

``FusedRounds`` only decides: its calls return what the daemon must send. A member is whatever the daemon
answers a process through (its session).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from bps_runtime.stalls import stalled
from protocol.messages import Failure, Spec, Why, describe_spec

from .local_rounds import waited_why

M = TypeVar("M")


@dataclass(slots=True, eq=False)
class Entry(Generic[M]):
    """One process's part of a fused round: its request and where its tensor is."""

    member: M
    req: int
    spec: Spec
    segment: str
    offset: int
    priority: int


@dataclass(slots=True, eq=False)
class FusedRound(Generic[M]):
    """One small tensor's round on this machine."""

    name: str
    spec: Spec
    first_rank: int  # the global rank whose entry came first (what the others must agree with)
    entries: list[Entry[M] | None]  # by local rank
    count: int = 1  # local ranks that submitted (or left a failed round)
    why: Why | None = None  # the round failed: late ranks still join it and get this
    server: int = -1  # the anchor server it was reported to
    opened: float = 0.0  # when its first entry came (the daemon's clock)
    generation: int = 0  # of the connection to its anchor it was reported on (bps_worker.fused_driver)
    sent: bool = False  # its report went to the anchor (complete here, a report can wait: see fused_driver)
    reported_at: float = 0.0  # when every local rank had submitted it
    excused: set[int] = field(default_factory=set)  # local ranks that left or heard its failure another way
    index: int = 0  # the rounds of its name made here before it, in this epoch (FuseReady.rounds)

    def awaits(self, local_rank: int) -> bool:
        """Whether ``local_rank`` has still to take part (submit, or leave)."""
        return self.entries[local_rank] is None and local_rank not in self.excused

    def excuse(self, local_rank: int) -> None:
        """``local_rank`` will not submit to this round (it left, or heard its failure another way)."""
        if self.awaits(local_rank):
            self.excused.add(local_rank)
            self.count += 1

    def members(self) -> list[Entry[M]]:
        """The entries in local-rank order (the order of the local sum)."""
        return [e for e in self.entries if e is not None]


@dataclass
class Decisions(Generic[M]):
    """What one call decided: answers to send, rounds ready to report, names to abort at their anchors
    ((name, why, reported): whether the round given up is the one we reported last, see ``FuseAbort``)."""

    answers: list[tuple[M, Failure]] = field(default_factory=list)
    ready: list[FusedRound[M]] = field(default_factory=list)
    aborts: list[tuple[str, Why, bool]] = field(default_factory=list)
    abort_rounds: list[int] = field(default_factory=list)  # the index of each abort's round (FuseAbort.rounds)
    steps: list[str] = field(default_factory=list)  # names whose step takes an unfused round number (see module)
    failed: int = 0  # rounds failed (each once; its processes hear it): operations that failed, for the metrics

    def abort(self, name: str, why: Why, reported: bool, index: int) -> None:
        """Give up round ``index`` of ``name`` at its anchor (see ``aborts``)."""
        self.aborts.append((name, why, reported))
        self.abort_rounds.append(index)

    def fail(self, fr: FusedRound[M], why: Why) -> None:
        """Answer every entry of ``fr`` so far with ``why`` (each side of a mismatch hears its own tensor)."""
        self.failed += 1
        for e in fr.entries:
            if e is not None:
                self.answers.append((e.member, why.heard_by(describe_spec(e.spec)).about(fr.name).failure(e.req)))


def spec_mismatch(name: str, first: Spec, first_rank: int, other: Spec, other_rank: int) -> Why:
    detail = f"rank {first_rank} has {describe_spec(first)} but rank {other_rank} has {describe_spec(other)}"
    return Why.mismatch(name, describe_spec(first), describe_spec(other), detail)


class FusedRounds(Generic[M]):
    """Every small tensor's fused round on one machine: collecting, reported (awaiting a plan), failed."""

    def __init__(self, local_size: int, worker_id: int, rank_offset: int) -> None:
        self.local_size = local_size
        self.worker_id = worker_id
        self.rank_offset = rank_offset
        self.collecting: dict[str, FusedRound[M]] = {}  # not every local rank submitted yet
        self.reported: dict[str, FusedRound[M]] = {}  # complete here, told to the anchor, awaiting its plan
        # Failed rounds still waiting for local ranks that did not submit to them, per name, oldest first.
        self.failed: dict[str, list[FusedRound[M]]] = {}
        # Reported rounds that failed here, per name, oldest first: the anchor's answer to each (a plan or a
        # failure) is still to come (see ``planned`` and ``failed_at_anchor``).
        self.abandoned: dict[str, list[FusedRound[M]]] = {}
        # Per name, the rounds we told its anchor's run of (reports, and aborts of rounds not reported): a
        # connection that breaks may lose the last ones, which the anchor learns from these (FuseResync).
        self.told: dict[str, int] = {}
        self.told_index: dict[str, int] = {}  # per name, the index of the last round told (FuseResync.rounds)
        # The spec of each round failed because its connection broke: a plan of it that the connection lost
        # comes again (FusePlan.resent), and its group must fail as the peers' did.
        self.lost_specs: dict[str, Spec] = {}
        # Per name, how many plans named it (its fused rounds in this daemon's life): reported with it, so that
        # a server that restarted tells a worker that lost a plan from one that ran it (FuseRunning).
        self.counts: dict[str, int] = {}
        # Per name, the rounds made here in this epoch (planned or failed): each round's index. Every process
        # issues every name once a step, so the peers' rounds of one step have the same index, as long as our
        # processes started with theirs (``aligned``): new processes after a reset start at the peers' step
        # but count from 0, and say no index (the anchor matches their rounds by order, see FuseReady.rounds).
        self.index: dict[str, int] = {}
        self.aligned = True

    def busy(self, name: str) -> bool:
        """Whether ``name`` has a fused round open here (an unfused op of it now would be a mismatch)."""
        return name in self.collecting or name in self.reported

    def submit(self, member: M, local_rank: int, entries: list[tuple[int, str, Spec, str, int, int]],
               now: float = 0.0) -> Decisions[M]:
        """Local rank ``local_rank`` issued ``entries``: (req, name, spec, segment, offset, priority) each, at
        ``now`` (the daemon's clock)."""
        out: Decisions[M] = Decisions()
        rank = self.rank_offset + local_rank
        collecting, size = self.collecting, self.local_size
        failed = self.failed
        for req, name, spec, segment, offset, priority in entries:
            entry = Entry(member, req, spec, segment, offset, priority)
            if failed and self._late(name, local_rank, entry, out):
                continue  # its oldest round, a failed one, is the one it joins
            fr = collecting.get(name)
            if fr is None:
                if name in self.reported:
                    out.answers.append((member, Why(
                        f"tensor {name!r} is already in flight for rank {rank}; synchronize it before pushing it "
                        f"again", "bad_request").failure(req)))
                    continue
                index = self.index.get(name, 0)
                self.index[name] = index + 1
                fr = FusedRound(name, spec, rank, [None] * size, opened=now, reported_at=now, index=index)
                fr.entries[local_rank] = entry
                if size == 1:
                    self.reported[name] = fr
                    out.ready.append(fr)
                else:
                    collecting[name] = fr
                continue
            if fr.entries[local_rank] is not None:
                out.answers.append((member, Why(f"tensor {name!r} is already in flight for rank {rank}; synchronize "
                                                f"it before pushing it again", "bad_request").failure(req)))
                continue
            fr.entries[local_rank] = entry
            fr.count += 1
            if spec != fr.spec:
                self._fail(fr, spec_mismatch(name, fr.spec, fr.first_rank, spec, rank), out)
            elif fr.count == size:
                fr.reported_at = now
                del collecting[name]
                self.reported[name] = fr
                out.ready.append(fr)
        return out

    def _awaiting(self, name: str, local_rank: int) -> FusedRound[M] | None:
        """The oldest failed round of ``name`` that ``local_rank`` has still to submit to, if any."""
        rounds = self.failed.get(name)
        return next((fr for fr in rounds if fr.awaits(local_rank)), None) if rounds else None

    def _late(self, name: str, local_rank: int, entry: Entry[M], out: Decisions[M]) -> bool:
        """An entry for a name whose round failed before this rank submitted to it: it joins the oldest such
        round and gets its error (and not the next round's data); False where there is no such round."""
        failed = self._awaiting(name, local_rank)
        if failed is None:
            return False
        assert failed.why is not None
        failed.entries[local_rank] = entry
        failed.count += 1
        heard = failed.why.heard_by(describe_spec(entry.spec)).about(name)
        out.answers.append((entry.member, heard.failure(entry.req)))
        self._settle(failed)
        return True

    def late_unfused(self, name: str, local_rank: int) -> Why | None:
        """``local_rank`` issued ``name`` unfused (an ordinary op) while a fused round of it that failed before
        the rank submitted still waits for it: that op is the rank's part of the failed round (its step), as a
        fused entry would be (``_late``). The round stops waiting for it; returns why it failed, for the op's
        answer (None: no failed round waits for the rank). Were the op a round of its own, it would take an
        index of its own (``skip``: this step's twice, and the name's indexes here one ahead of the peers' for
        good), and wait to be summed with the other ranks' next step."""
        fr = self._awaiting(name, local_rank)
        if fr is None:
            return None
        fr.excuse(local_rank)
        self._settle(fr)
        return fr.why

    def _settle(self, fr: FusedRound[M]) -> None:
        """A failed round that no local rank is still to submit to is done with."""
        if fr.count < self.local_size:
            return
        rounds = self.failed.get(fr.name)
        if rounds is not None and fr in rounds:
            rounds.remove(fr)
            if not rounds:
                del self.failed[fr.name]

    def _fail(self, fr: FusedRound[M], why: Why, out: Decisions[M], *, abort: bool = True,
              step: bool = True) -> None:
        """Fail ``fr`` once: its entries hear why; local ranks still to submit will (see ``_late``); the peers
        hear it through the anchor unless the anchor told us (``abort`` False). Its step takes an unfused round
        number unless ``step`` is False (see the module's "Each round has an index")."""
        if fr.why is not None:
            return
        fr.why = why
        out.fail(fr, why)
        if step:
            out.steps.append(fr.name)
        name = fr.name
        if self.collecting.get(name) is fr:
            del self.collecting[name]
        reported = False
        if self.reported.get(name) is fr:
            del self.reported[name]
            reported = fr.sent  # a report not sent yet never will be (fused_driver drops failed rounds)
            if reported and abort:  # the anchor still answers the report, and our abort: that answer is this round's
                self.abandoned.setdefault(name, []).append(fr)
        if fr.count < self.local_size:
            self.failed.setdefault(name, []).append(fr)
        if abort:
            out.abort(name, why, reported, fr.index)

    def planned(self, names: list[str], lost: bool = False
                ) -> tuple[list[FusedRound[M]], dict[str, Spec | None]]:
        """The anchor planned ``names``: their rounds in plan order (no longer ours to decide), and the names
        we have no reported round of, with their spec where we know it (failed here after we reported them:
        the plan cannot run here as the peers run it). ``lost``: a plan we lost with a connection, sent
        again (its rounds failed here when the connection broke; the round reported now is a later one)."""
        reported, counts = self.reported, self.counts
        rounds: list[FusedRound[M]] = []
        missing: dict[str, Spec | None] = {}
        for name in names:
            counts[name] = counts.get(name, 0) + 1
            gone = self._answered(name) if not lost else None
            if gone is not None:  # the plan is of a round we reported and gave up since (the oldest)
                missing[name] = gone.spec
                continue
            fr = reported.pop(name, None) if not lost else None
            if fr is None:
                missing[name] = self.lost_specs.pop(name, None) if lost else None
            else:
                rounds.append(fr)
        return rounds, missing

    def skip(self, name: str) -> int:
        """A round of ``name`` went another way here (an ordinary, unfused op of it): it takes an index all the
        same, as the peers' fused round of that step does (see ``index``); that index."""
        index = self.index.get(name, 0)
        self.index[name] = index + 1
        return index

    def tell(self, name: str, rounds: int = 1, index: int = -1) -> None:
        """We told the anchor's run of ``rounds`` more rounds of ``name`` (see ``told``), the last one round
        ``index`` (-1: the count of rounds told before a break, restored)."""
        self.told[name] = self.told.get(name, 0) + rounds
        if index >= 0:
            self.told_index[name] = index

    def _answered(self, name: str) -> FusedRound[M] | None:
        """The anchor answered our oldest report of ``name`` still unanswered: that round, if we abandoned it
        (None: the answer is the reported round's)."""
        abandoned = self.abandoned.get(name)
        if not abandoned:
            return None
        fr = abandoned.pop(0)
        if not abandoned:
            del self.abandoned[name]
        return fr

    def link_lost(self, server: int, why: Why, before: int | None = None, queued: int | None = None
                  ) -> Decisions[M]:
        """What we reported to ``server`` is lost there (our connection broke and the server, which did not
        restart, failed those names for the peers itself): those rounds fail here too, those reported on a
        connection older than generation ``before`` (the reports not sent yet go on the new one). Without
        ``before``, we gave the server up: every round reported there fails; a report still held here, or
        waiting in the link's queue (generation ``queued`` on), goes when the link is back, so its round is
        given up there too (an abort behind it), and its answer awaited."""
        out: Decisions[M] = Decisions()
        for fr in [fr for fr in self.reported.values()
                   if fr.server == server and (before is None or (fr.sent and fr.generation < before))]:
            on_its_way = not fr.sent or (before is None and queued is not None and fr.generation >= queued)
            self._fail(fr, why, out, abort=on_its_way)
            if not on_its_way:
                self.lost_specs[fr.name] = fr.spec
        self.forget_answers(server, before if before is not None else queued)
        return out

    def forget_answers(self, server: int, before: int | None = None) -> None:
        """The answers to the rounds we abandoned after reporting them to ``server`` (on a connection older
        than generation ``before``) will not come: that connection is gone, or the server restarted."""
        for name, rounds in list(self.abandoned.items()):
            kept = [fr for fr in rounds if fr.server != server or (before is not None and fr.generation >= before)]
            for fr in rounds:
                if fr not in kept:
                    self.lost_specs[name] = fr.spec  # its answer may have been a plan, lost: sent again (lost)
            rounds[:] = kept
            if not rounds:
                del self.abandoned[name]

    def fail_name(self, name: str, why: Why, answered: Collection[int] = (), unfused: bool = False
                  ) -> Decisions[M]:
        """Fail ``name``'s open round here, and (through its anchor) on every machine. The local ranks in
        ``answered`` heard it already, by another way (their unfused ops of the name): the failed round does
        not wait for them to submit. ``unfused``: the step has an unfused round here (it took the number)."""
        out: Decisions[M] = Decisions()
        fr = self.collecting.get(name) or self.reported.get(name)
        if fr is not None:
            for r in answered:
                fr.excuse(r)
            self._fail(fr, why, out, step=not unfused)
        return out

    def failed_at_anchor(self, name: str, why: Why) -> Decisions[M]:
        """The anchor failed our oldest unanswered report of ``name`` (a peer disagreed, failed or left): if
        that round is the one reported now, it fails here too; one we abandoned already needs nothing. (A
        round still collecting here was never reported: the failure is not its.)"""
        out: Decisions[M] = Decisions()
        if self._answered(name) is None:
            fr = self.reported.get(name)
            if fr is not None:
                self._fail(fr, why, out, abort=False)
        return out

    def leave(self, local_rank: int, pid: int) -> Decisions[M]:
        """Local rank ``local_rank`` (process ``pid``) disconnected: every round it is part of or awaited by
        fails (its memory is about to go), and a failed round stops waiting for it."""
        out: Decisions[M] = Decisions()
        rank = self.rank_offset + local_rank
        for fr in [*self.collecting.values(), *self.reported.values()]:
            if fr.entries[local_rank] is None:
                fr.excuse(local_rank)  # it will never submit: the failed round does not wait for it
            else:
                fr.entries[local_rank] = None  # nobody to answer
                fr.excused.add(local_rank)  # (counted already)
            self._fail(fr, Why(f"tensor {fr.name!r}: rank {rank} (pid {pid}) disconnected during its fused round",
                               "connection", peer=f"rank {rank} (pid {pid})",
                               detail=f"it disconnected during the fused round of tensor {fr.name!r}"), out)
        for rounds in list(self.failed.values()):
            for fr in list(rounds):
                fr.excuse(local_rank)
                self._settle(fr)
        return out

    def overdue(self, connected: Collection[int], now: float, timeout: float, stall_s: float = 0.0,
                heard: Mapping[int, float] | None = None) -> Decisions[M]:
        """The rounds that waited ``timeout`` for a local rank that is not even connected fail (a process that
        died, or never came, must not make its peers wait for ever); slow ones wait on, unless they waited
        ``stall_s`` (cluster.stall_timeout; 0: never) for ranks that did not catch up for as long (``heard``), as
        the local rounds' (``LocalRounds.overdue_rounds``)."""
        out: Decisions[M] = Decisions()
        for fr in [fr for fr in self.collecting.values() if now - fr.opened >= timeout]:
            missing = [r for r, e in enumerate(fr.entries) if e is None]
            absent = [r for r in missing if r not in connected]
            if absent:
                self._fail(fr, waited_why(fr.name, absent, self.worker_id, self.rank_offset, timeout, False), out)
            elif stalled(missing, fr.opened, now, stall_s, heard or {}):
                self._fail(fr, waited_why(fr.name, missing, self.worker_id, self.rank_offset, stall_s, True), out)
        return out

    def reset(self) -> Decisions[M]:
        """Every process left: every open round fails, and nothing is kept for late ones."""
        out: Decisions[M] = Decisions()
        for fr in [*self.collecting.values(), *self.reported.values()]:
            self._fail(fr, Why(f"tensor {fr.name!r}: every process of worker {self.worker_id} left"), out,
                       abort=False, step=False)  # the Reset tells the servers; numbering starts again
        self.collecting.clear()
        self.reported.clear()
        self.failed.clear()
        self.abandoned.clear()
        self.told.clear()  # the anchors start our counts again (the Reset)
        self.told_index.clear()
        self.lost_specs.clear()
        self.index.clear()
        self.aligned = False  # the next processes start at the peers' step: our indexes are not theirs
        return out
