"""The worker daemon's side of fused small sums: carries out ``bps_worker.fusion``'s decisions (issue 16).

- Rounds complete here are reported to their anchor servers at the end of the event loop's pass, in one
  ``FuseReady`` per server (or a few, each within a frame's limits).
- A ``FusePlan`` becomes one :class:`~bps_worker.fused_operation.FusedOperation` per dtype group, on the
  plan's *lane*: ``seq % LANES``. A lane's fused tensors are ordinary tensors (one name per server, lane and
  dtype, see ``Placement.fused_key``) whose rounds every worker numbers alike, since every worker runs the
  same plans in the same order; a lane runs one operation at a time (its buffers are reused), the lanes of
  a server run side by side.
- A failure at the anchor (``FuseFailed``) fails the name here; a name that failed here after we reported
  it is given up at the anchor (``FuseAbort``), and a plan that names it fails its group on every worker
  (we abort the group's round, the peers wait for us there).
- A connection that breaks (the server's run goes on): what we reported on it fails here, as it fails at the
  server; what we told the server since the break (queued) goes on the next connection. The first message
  there, ``FuseResync``, says how many rounds of each name we told that run and which of its plans we got
  last: the server fails the rounds whose report or abort the break lost, and sends the lost plans again
  (``FusePlan.resent == "lost"``), whose groups we number and give up as the peers did. A server that
  restarted (a new run) gets the plans of it we still run (``FuseRunning``), the index of each name's
  round our processes are past (``FusePast``: told again on each connection to that run, it may be lost
  with one), and our reports of the old run again.
- A reset (every local process left; new ones start a new epoch): the servers' answers to the old processes'
  rounds may still be on their way. Each carries the epoch the server knew us by (``FusePlan.epoch``,
  ``FuseFailed.epoch``), and one of another epoch is dropped: its rounds were the old processes', failed at
  the reset, and the server fails them for the peers when our Reset reaches it. A dropped plan takes no lane
  number, though the peers ran it on its lane: so the anchor, handling our Reset, starts a new *lane
  generation* (``FusePlan.lanes``, part of every fused tensor's name) and fails every round of the old one.
  Its plans from then on go to our new epoch, and every worker numbers the new generation's fused tensors
  from 0, as fresh names: their server round is their local one (no ``RoundQuery``, see
  ``WorkerDaemon.round_base``). A plan of a later generation says the earlier ones ended (``ended_by``): their
  keys are forgotten here once none of their operations runs (a reset anywhere in the job makes new ones).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any, Final

from protocol.messages import (
    FuseAbort,
    FuseFailed,
    FusePast,
    FusePlan,
    FuseReady,
    FuseResync,
    FuseRunning,
    Message,
    Spec,
    Why,
    fused_chunks,
)

from bps_runtime.stalls import Stall, StallWatch

from .errors import BPSError
from .fused_operation import FusedOperation
from .fusion import Decisions, FusedRound, FusedRounds
from .session import ClientSession
from .stalls import local_stall, server_stall

if TYPE_CHECKING:
    from .daemon import WorkerDaemon

log = logging.getLogger("bps.worker")

# Plans of one server run on this many lanes side by side (each lane one fused operation at a time).
LANES: Final = 8
# While this many fused operations with a server run, the rounds completed here wait to be reported to it:
# they go together once one finishes (as Nagle's algorithm holds small segments while one is unacknowledged),
# so the busier the machines, the larger the plans, and the fewer operations a step costs.
REPORT_WHILE_RUNNING: Final = 1


def ended_by(generation: str, lanes: str) -> bool:
    """Whether a plan on lane generation ``lanes`` says that ``generation`` (of the same server) ended there:
    a generation is "<run>.<resets handled>" (``bps_server.fusion``), and each reset the anchor handles ends its
    run's earlier generations, the first one also those of its other runs (its previous incarnations')."""
    run, _, count = lanes.rpartition(".")
    other, _, was = generation.rpartition(".")
    if not count.isdigit():
        return False
    if other == run:
        return was.isdigit() and int(was) < int(count)
    return int(count) > 0


class FusedSums:
    """The fused rounds of one worker daemon, and the plans they run in."""

    def __init__(self, daemon: WorkerDaemon) -> None:
        self.daemon = daemon
        config = daemon.config
        self.rounds: FusedRounds[ClientSession] = FusedRounds(config.local_size, config.worker_id, daemon.rank_offset)
        self._anchors: dict[str, int] = {}  # name -> its anchor server's id
        self._reports: dict[int, list[FusedRound[ClientSession]]] = {}
        self._reports_due = False
        self._lanes: dict[str, asyncio.Future[Any]] = {}  # fused key -> its operation running (or last run)
        # server id -> lane generation -> its fused keys used here (forgotten once it ended, see _forget_ended)
        self._generations: dict[int, dict[str, set[str]]] = {sid: {} for sid in daemon.links}
        self._running: Counter[int] = Counter()  # server id -> fused operations with it not finished
        # server id -> (seq, lane generation) -> (names, their counts, their rounds' indexes (empty: not all
        # known), operations of the plan not finished): told to a server that restarted (FuseRunning), whose
        # peers may have lost it. Keyed by the generation too: a restarted server numbers its plans from 0
        # again, while plans of its previous run with those seqs may still run here.
        self._plans: dict[int, dict[tuple[int, str], tuple[list[str], list[int], list[int], int]]] = {
            sid: {} for sid in daemon.links}
        self._generation: Counter[int] = Counter()  # server id -> connections to it lost so far
        # server id -> the rounds told of each of its names before its connection broke (see _lost)
        self._told_before: dict[int, dict[str, int]] = {}
        self._next_plan: Counter[int] = Counter()  # server id -> the seq of the next plan of its run we expect
        self._told_past: set[int] = set()  # servers whose run we told what we are past (FusePast)
        self._stalls: StallWatch[FusedRound[ClientSession]] = StallWatch(warn_after_s=config.cluster.timeout)
        for sid, link in daemon.links.items():
            link.on_fused = lambda message, sid=sid: self.on_message(sid, message)
            link.on_lost = lambda reason, sid=sid: self._lost(sid)
            link.on_ready = lambda restarted, sid=sid: self.link_ready(sid, restarted)
            link.on_gave_up = lambda reason, sid=sid: self.link_lost(sid, reason)

    def anchor(self, name: str) -> int:
        sid = self._anchors.get(name)
        if sid is None:
            placement = self.daemon.placement
            sid = self._anchors[name] = placement.server_ids[placement.anchor(name)]
        return sid

    # -- from the processes --------------------------------------------------------------
    def submit(self, session: ClientSession, entries: list[tuple[int, str, Spec, str, int, int]]) -> None:
        assert session.local_rank is not None
        now = asyncio.get_running_loop().time()
        self.carry_out(self.rounds.submit(session, session.local_rank, entries, now))

    def watch(self, now: float) -> None:
        """Fail the rounds that waited the timeout for a process that is not connected (or the stall timeout for
        one that is), and say which wait longer for a connected one (every second)."""
        if self.rounds.collecting:
            daemon = self.daemon
            cluster = daemon.config.cluster
            self.carry_out(self.rounds.overdue(daemon.sessions.keys(), now, cluster.timeout, cluster.stall_timeout,
                                               daemon.submitted_at))
        self.daemon.notices.say(self.stall_warnings(now), "fused rounds have waited as long", log)

    def stall_warnings(self, now: float) -> list[Stall]:
        """The rounds that waited the timeout (and again every timeout), as the local rounds' stalls are said
        (bps_worker.stalls): for local ranks, or at their anchor for the other machines."""
        after = self._stalls.warn_after_s
        rounds = self.rounds
        waits = {fr: fr.opened for fr in rounds.collecting.values() if now - fr.opened >= after}
        waits.update({fr: fr.reported_at for fr in rounds.reported.values() if now - fr.reported_at >= after})
        texts: list[Stall] = []
        worker, offset = self.daemon.worker_id, self.daemon.rank_offset
        for fr, waited in self._stalls.due(now, waits):
            where = (f"tensor {fr.name!r} (round {rounds.counts.get(fr.name, 0)} on worker {worker}) has waited "
                     f"{waited:.1f} s")
            if fr.name in rounds.collecting:
                absent = [r for r, e in enumerate(fr.entries) if e is None]
                present = [r for r, e in enumerate(fr.entries) if e is not None]
                text = local_stall(where, absent, present, offset)
            else:
                text = server_stall(where, [fr.server])
            texts.append(Stall(text, tuple(range(len(fr.entries)))))
        return texts

    def carry_out(self, out: Decisions[ClientSession]) -> None:
        self.daemon.counters.ops_failed += out.failed
        for member, failure in out.answers:
            member.send(failure)
        for name in out.steps:
            self.daemon.unfused_step(name)
        aligned = self.rounds.aligned
        for (name, why, reported), index in zip(out.aborts, out.abort_rounds, strict=True):
            # The peers hear that the round failed here, and why: the Why whole (as an Abort of an unfused round).
            self.daemon.links[self.anchor(name)].fuse(
                FuseAbort([name], reported=reported, rounds=[index] if aligned else [], **why.carry()))
            if not reported:
                self.rounds.tell(name, 1, index)
        if out.ready:
            reports = self._reports
            for fr in out.ready:
                fr.server = sid = self.anchor(fr.name)
                reports.setdefault(sid, []).append(fr)
            if not self._reports_due:
                self._reports_due = True
                asyncio.get_running_loop().call_soon(self._send_reports)

    def _send_reports(self) -> None:
        """Every round completed in this pass, reported to its anchor (one message per server and frame)."""
        self._reports_due = False
        reports, self._reports = self._reports, {}
        for sid, rounds in reports.items():
            if self._running[sid] >= REPORT_WHILE_RUNNING:
                self._reports[sid] = rounds  # held until one of them finishes (see REPORT_WHILE_RUNNING)
                continue
            self._report(sid, [fr for fr in rounds if fr.why is None])  # not those failed since

    def _report(self, sid: int, rounds: list[FusedRound[ClientSession]]) -> None:
        names = [fr.name for fr in rounds]
        counts = self.rounds.counts
        generation = self._generation[sid]  # the connection that carries them (or the next: the link queues)
        for fr in rounds:
            fr.sent = True
            fr.generation = generation
            self.rounds.tell(fr.name, 1, fr.index)
        for start, stop in fused_chunks(names):
            index: dict[Spec, int] = {}
            specs: list[Any] = []
            which = []
            for fr in rounds[start:stop]:
                k = index.get(fr.spec)
                if k is None:
                    k = index[fr.spec] = len(specs)
                    dtype, shape, average, layout = fr.spec
                    specs.append([dtype, list(shape), average, layout])
                which.append(k)
            chunk = names[start:stop]
            indexes = [fr.index for fr in rounds[start:stop]] if self.rounds.aligned else []
            self.daemon.links[sid].fuse(FuseReady(chunk, specs, which, [counts.get(n, 0) for n in chunk], indexes))

    def _lost(self, sid: int) -> None:
        """The connection to ``sid`` broke: what we reported before this is the old connection's, and the last
        of what we told it may be lost with it. The first message of the next connection says how many rounds
        of each name we told this run of the server (FuseResync; the link queues it before anything else), and
        our counts start from 0 until we know whether the server that answers is the same run (link_ready)."""
        self._generation[sid] += 1
        told = self.rounds.told
        before = {name: count for name, count in told.items() if self.anchor(name) == sid}
        self._told_before[sid] = before
        link = self.daemon.links[sid]
        names = list(before)
        next_plan = self._next_plan[sid]
        told_index = self.rounds.told_index if self.rounds.aligned else {}
        if names or next_plan:
            for start, stop in fused_chunks(names) if names else [(0, 0)]:
                chunk = names[start:stop]
                last = [told_index.get(n, -1) for n in chunk]
                link.first_on_reconnect(FuseResync(link.incarnation or "", chunk, [before[n] for n in chunk],
                                                   next_plan if start == 0 else -1, link.epoch,
                                                   last if -1 not in last else []))
        for name in names:
            del told[name]

    def link_ready(self, sid: int, restarted: bool) -> None:
        """Connected to ``sid`` again. A server that restarted forgot what we reported and what it planned:
        report again, and say which of its plans run here (FuseRunning). One that did not failed, for every
        worker, the names we had reported on the connection that broke: so do we."""
        before = self._told_before.pop(sid, {})
        if not restarted:  # the same run: it counts on from what it heard of before
            for name, count in before.items():
                self.rounds.tell(name, count)
            self.carry_out(self.rounds.link_lost(sid, Why(
                f"the connection to server {sid} broke while fused sums waited there", "connection",
                peer=self.daemon.links[sid].peer, detail="the connection broke while fused sums waited there"),
                before=self._generation[sid]))
            if sid in self._told_past:  # (it may have been lost with the connection; it says a state: again)
                self._tell_past(sid)
            return
        self.rounds.forget_answers(sid, before=self._generation[sid])  # it forgot the reports we gave up
        self._next_plan[sid] = 0  # its plans start again
        link = self.daemon.links[sid]
        for (seq, lanes), (names, counts, indexes, _) in self._plans[sid].items():
            for start, stop in fused_chunks(names):
                link.fuse(FuseRunning(seq, names[start:stop], counts[start:stop], indexes[start:stop], lanes))
        self._tell_past(sid)
        # Those reported on a connection of the old run: not the held ones (they go when they go) nor those
        # reported while the link was down (queued, they went to the new run before this).
        generation = self._generation[sid]
        again = [fr for fr in self.rounds.reported.values()
                 if fr.server == sid and fr.why is None and fr.sent and fr.generation < generation]
        if again:
            log.info("server %d restarted: reporting %d fused sums to it again, %d plans of its run here",
                     sid, len(again), len(self._plans[sid]))
            self._report(sid, again)

    def _tell_past(self, sid: int) -> None:
        """Tell server ``sid``'s new run which rounds of its names our processes are past (FusePast): the
        index of each name's open round, or of its next one. Not said by processes begun after a reset."""
        rounds = self.rounds
        if not rounds.aligned:
            return
        self._told_past.add(sid)
        open_rounds = {**rounds.collecting, **rounds.reported}
        names = [name for name in rounds.index if self.anchor(name) == sid]
        floors = [open_rounds[n].index if n in open_rounds else rounds.index[n] for n in names]
        counts = [rounds.counts.get(n, 0) for n in names]
        link = self.daemon.links[sid]
        for start, stop in fused_chunks(names) if names else []:
            link.fuse(FusePast(names[start:stop], floors[start:stop], counts[start:stop]))

    # -- from the servers ----------------------------------------------------------------
    def on_message(self, sid: int, message: Message) -> None:
        if isinstance(message, FusePlan):
            if message.epoch != self.daemon.links[sid].epoch:
                self._old_plan(sid, message)
            else:
                self.plan(sid, message)
        elif isinstance(message, FuseFailed):
            if message.epoch == self.daemon.links[sid].epoch:  # else a failure of the old processes' round
                self.carry_out(self.rounds.failed_at_anchor(message.name, message.why()))

    def _got(self, sid: int, plan: FusePlan) -> None:
        """We got ``plan`` of server ``sid``: the next we expect of it is the one after (FuseResync.next_plan)."""
        if not plan.resent:
            self._next_plan[sid] = plan.seq + 1
        elif plan.resent == "lost":  # a second break must not have it sent (and numbered) again
            self._next_plan[sid] = max(self._next_plan[sid], plan.seq + 1)

    def _old_plan(self, sid: int, plan: FusePlan) -> None:
        """A plan sent to our processes of an earlier epoch (see the module docstring): not run, not numbered;
        we got it all the same (a connection that breaks now must not have it sent again)."""
        self._got(sid, plan)
        counts = self.rounds.counts  # the peers count it (see FusedRounds.counts): so do we
        for name in plan.names:
            counts[name] = counts.get(name, 0) + 1
        log.debug("server %d: plan %d of our previous processes (epoch %r) dropped", sid, plan.seq, plan.epoch)

    def link_lost(self, sid: int, reason: str) -> None:
        """We gave server ``sid`` up: what we reported there fails (what the link still holds, reports of
        this generation, goes when it is back, with an abort behind it)."""
        self.carry_out(self.rounds.link_lost(sid, Why(
            f"the connection to server {sid} failed while fused sums waited there: {reason}", "connection",
            peer=self.daemon.links[sid].peer, detail=reason), queued=self._generation[sid]))

    def plan(self, sid: int, plan: FusePlan) -> None:
        """Run plan ``plan.seq`` of server ``sid``: one fused operation per dtype group, on the plan's lane (of
        its lane generation)."""
        daemon = self.daemon
        self._got(sid, plan)
        self._forget_ended(sid, plan.lanes)
        # A plan lost with a connection, or one of the server's previous run whose rounds failed here since: the
        # names' rounds here are later ones (see FusedRounds.planned).
        rounds, missing = self.rounds.planned(plan.names, plan.resent in ("lost", "restart_lost"))
        groups: dict[tuple[str, bool], list[FusedRound[ClientSession]]] = {}
        for fr in rounds:
            groups.setdefault((fr.spec[0], fr.spec[2]), []).append(fr)
        broken: dict[tuple[str, bool], str] = {}
        position = {name: i for i, name in enumerate(plan.names)} if missing and plan.groups else {}
        for name, spec in missing.items():
            if spec is not None:
                group = (spec[0], spec[2])
            elif position:  # no round of it here (failed and forgotten): the plan says its group, as the peers see it
                dtype, average = plan.groups[plan.group[position[name]]]
                group = (dtype, average)
            else:  # its group unknown: every group fails (one of them would be summed without it)
                log.warning("server %d planned fused tensor %r, which this worker does not have", sid, name)
                for group in groups:
                    broken.setdefault(group, name)
                continue
            groups.setdefault(group, [])
            broken.setdefault(group, name)
        lane = plan.seq % LANES
        counts = self.rounds.counts
        used = self._generations[sid].setdefault(plan.lanes, set())
        running = [g for g in groups if g not in broken]
        if running:
            of_name = {fr.name: fr.index for fr in rounds}
            indexes = [of_name.get(n, -1) for n in plan.names] if self.rounds.aligned else []
            if -1 in indexes:
                indexes = []  # (a name failed here: its group does not run, the others' do)
            self._plans[sid][(plan.seq, plan.lanes)] = (list(plan.names), [counts.get(n, 0) for n in plan.names],
                                                        indexes, len(running))
        for (dtype, average), members in groups.items():
            key = daemon.placement.fused_key(sid, lane, dtype, average, plan.lanes)
            local_round = daemon.rounds.numbers.take(key)  # in plan order: every worker numbers alike
            used.add(key)
            culprit = broken.get((dtype, average))
            if culprit is not None:
                self._give_up(key, local_round, members, culprit)
                continue
            previous = self._lanes.get(key)
            self._running[sid] += 1
            op = FusedOperation(daemon, key, local_round, members)
            self._lanes[key] = daemon.spawn(self._run(sid, (plan.seq, plan.lanes), previous, op))

    def _forget_ended(self, sid: int, lanes: str) -> None:
        """A plan of server ``sid`` on lane generation ``lanes``: forget the fused keys (their round numbers,
        their last operations, their last sums) of the generations of ``sid`` that it says ended (``ended_by``),
        once none of their operations runs here (else at a later plan: they end, failed, since the anchor
        refuses their pushes).
        Kept, they grew by a generation's keys at every reset of any worker, for as long as the daemon ran. No
        plan of an ended generation comes after one of a later generation of its run (the anchor sends its plans,
        and those lost with a connection, in order; those of its previous runs it no longer sends at all); one
        that did would only be refused."""
        generations = self._generations[sid]
        if len(generations) < 2 and lanes in generations:
            return  # (the usual case: one generation, this one)
        for generation in [g for g in generations if g != lanes and ended_by(g, lanes)]:
            keys = generations[generation]
            if any(not self._lanes[key].done() for key in keys if key in self._lanes):
                continue
            del generations[generation]
            numbers = self.daemon.rounds.numbers
            for key in keys:
                self._lanes.pop(key, None)
                numbers.forget(key)
            self.daemon.forget_sums(keys)  # nor are their last sums kept for a restarted server

    async def _run(self, sid: int, plan: tuple[int, str], previous: asyncio.Future[Any] | None,
                   op: FusedOperation) -> None:
        """Run ``op``, a group of ``plan`` (its seq and lane generation), after the lane's previous operation."""
        try:
            if previous is not None and not previous.done():
                await asyncio.wait([previous])
            await self.daemon.run_tracked(op.name, op.run())
            steps = op.failed_steps()
            if steps and op.unsettled:  # (the lane's next operation waits: its round, summed, would hide ours)
                steps = await self._steps_unless_summed(op)
            for name in steps:  # (as the rounds of a group given up take theirs, see _give_up)
                self.daemon.unfused_step(name)
        finally:
            self._running[sid] -= 1
            plans = self._plans[sid]
            names, counts, indexes, left = plans.get(plan, ([], [], [], 0))
            if left > 1:
                plans[plan] = (names, counts, indexes, left - 1)
            else:
                plans.pop(plan, None)
            if self._reports.get(sid) and not self._reports_due:
                self._reports_due = True
                asyncio.get_running_loop().call_soon(self._send_reports)

    async def _steps_unless_summed(self, op: FusedOperation) -> list[str]:
        """``op`` failed where the link to its server gave up while some of its pieces were out: the server may
        have summed them for the peers, whose rounds then succeeded and take no unfused number. Asked once the
        link is back (the server gives up what was still open, RoundQuery.fate): the names whose steps take
        their numbers, none if every piece was summed, and as before where it cannot be asked (the link gave up
        again, or the job ended). Meanwhile a later step of a name can take its number first: then both
        machines fail that step (the peers gave its round up), never a sum of two steps."""
        links, asked = self.daemon.links, op.server_round
        assert asked is not None  # (its pieces were pushed)
        try:
            answers = await asyncio.gather(*(links[p.server].query_round(op.name, p.part, fate=asked)
                                             for p in op.unsettled))
            summed = all(answers)
        except (BPSError, asyncio.CancelledError):
            summed = False
        if summed:
            log.info("%s: its round was summed for the other workers: no step taken", op.name)
            return []
        return op.failed_steps()

    def _give_up(self, key: str, local_round: int, members: list[FusedRound[ClientSession]], culprit: str) -> None:
        """A plan group names a tensor that failed here: it fails on every worker (we never push it)."""
        reason = f"tensor {culprit!r}, fused with these in {key!r}, failed on worker {self.daemon.worker_id}"
        out: Decisions[ClientSession] = Decisions()
        for fr in members:
            out.fail(fr, Why(f"tensor {fr.name!r}: {reason}", "round_failed"))
            out.steps.append(fr.name)  # a fused round that fails takes an unfused number, here as where the plan ran
        self.carry_out(out)
        daemon = self.daemon
        daemon.spawn(daemon.abort_when_known(key, local_round, daemon.round_base(key, local_round),
                                             Why(reason, "round_failed")))

    def reset(self) -> None:
        self.carry_out(self.rounds.reset())
        self._reports.clear()
        self._told_before.clear()  # counts of the processes gone (a resync queued with them is void: epoch)
