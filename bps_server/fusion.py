"""The meeting point of fused small sums on their anchor server: pure decisions, no I/O (issue 16).

Each worker reports the small tensors that all its local processes issued (``FuseReady``, see
``bps_worker.fusion``). A name is *planned* once every worker reported it with the same spec: the names
planned in one pass of the event loop go out as one ``FusePlan`` to every worker, in one order, and each
worker sums them as fused tensors pushed to this server (ordinary rounds from then on). A worker reports a
name again only after it has the sum of its planned round, so a name waits here at most once per worker.

A name fails here, for every worker, when two workers report different specs (a mismatch: each side hears
its own as ``ours``), when a worker aborts it (its processes disagreed, or one left), when a worker resets
(its processes are gone: the job is dying) or when its connection drops. The workers that reported it hear
at once (``FuseFailed``); those that did not yet hear when they report it. A reset worker's future reports
are not waited for by failures it caused; a worker whose connection dropped still reports the rounds it
had not reported (its processes live on), and hears their failure then.

Rounds. Each worker's reports and aborts of a name come in its order of rounds (one connection), one per
round. A failure still to be heard by some workers is a round of its own: a name can have several (worker 0
aborted two steps running before worker 1 reported the first), kept oldest first, and a worker's report or
abort takes the oldest one it is still in before it meets a round waiting here. An abort of a round the
worker reported already (``FuseAbort.reported``) is of that round, wherever it is now: still waiting here
(it fails, and the worker hears it too: every report gets one answer), planned (the plan answers it, and
the worker fails its group) or failed (answered already); it never touches a later round.

Lost messages. A connection that breaks can take with it what the worker wrote last (a report, an abort).
The worker failed those rounds when it lost the connection; the planner learns of them from counts: it
counts, per name and worker, the rounds it heard of (reports, and aborts of rounds not reported), and the
worker's first message on its new connection (``FuseResync``) says how many it told. Each round not heard
of fails here as an abort of it would have (``resync``). A worker whose processes are new (a reset, a new
epoch) starts its counts again, and failures no longer wait for it. A plan can be lost the same way: the
worker says which plan it got last, and gets the later ones again (``sent_since``).

Round indexes. Order alone cannot match rounds across a restart of this server: the new run heard none of
the old run's rounds, and a failure the old run had not yet told a worker leaves that worker one round
behind its peers (it reports again a round they gave up). So each round says its index (``FuseReady.rounds``,
``FuseAbort.rounds``: the rounds of its name the worker's processes made before it, planned or failed, and
the index of each round of a plan still running, ``FuseRunning.rounds``): every process issues every name
once a step, so one step's rounds have one index on every worker. Where both sides say it, a round below
another worker's (waiting here, or failed here) is one the others are past: it fails for its worker alone
(``_stale``); a failed round below a worker's report or abort no longer waits for that worker; an abort of
a reported round this run never heard of (reported to our previous run) fails the peers' round of its
index; a worker one plan behind a plan of our previous run, with a later round, gets that plan to give up
(``restart_lost``). A worker back on a restarted run says, of each name, the index its processes are past
(``FusePast``): a peer's round below it fails rather than wait for a round given up in the crash, failed
rounds below it no longer wait for it, and a lost plan of the previous run below it is sent to give up. A
FuseResync says the index of the last round told (the last of those lost). Workers whose processes were
replaced (a reset: new processes begin at the peers' step but count from 0) say no index, and their rounds
are matched by order as before (see FuseReady.rounds).

Lane generations. The workers number each fused tensor's rounds alike because every worker runs every plan,
in order. A reset breaks that: the plans sent to a worker's old processes are dropped there unnumbered, while
the peers ran them on their lanes. So every reset we handle (a Reset, or a hello with a new epoch, whichever
says the epoch first) starts a new lane generation (``lanes``, FusePlan.lanes): the plans made from then on
name fused tensors no worker has used, numbered from 0 by every worker, and the tensors of the generations it
ended fail here (``ended``: their open rounds when it ends, their later pushes at once), since the reset
worker will never push them. A generation's name says our run, so a restarted server's plans never meet the
lanes of its previous run, whose plans still running keep theirs (FuseRunning.lanes). Those end too at the
first reset we handle: the reset worker numbers every lane from 0 again, theirs included, so a plan of our
previous run that it ran after (one we sent it again, ``Resend``) would push a round its peers' are past, and
theirs would wait for ever; and the plans its old processes were in are given up with them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Final

from bps_runtime.stalls import Stall, StallWatch, stalled
from protocol.messages import PlanResent, Spec, Why, describe_spec, fused_chunks, fused_lanes

from .jobs import Spared, spare_none

__all__ = ["Failed", "Planner", "Resend"]

# Plans kept to send again to a worker whose connection broke before it got them (see Planner.sent_since),
# counted in names: at least this many, and twice the names heard of. The plans a worker can lose name only
# rounds it had reported and not seen answered, at most one of each name: never more than all the names.
PLAN_HISTORY_NAMES: Final = 65536


@dataclass(frozen=True, slots=True)
class Failed:
    """Tell ``worker`` that fused tensor ``name`` failed, as its side hears it."""

    worker: int
    name: str
    why: Why


@dataclass(frozen=True, slots=True)
class Resend:
    """``worker`` lost plan ``seq`` (of our previous run) when we died: send it again (``how``: "restart", its
    round is the plan's; "restart_lost", it failed that round since, see FusePlan.resent), on its lane
    generation ``lanes``."""

    worker: int
    seq: int
    names: list[str]
    how: PlanResent = "restart"
    lanes: str = ""


@dataclass(slots=True, eq=False)
class _Waiting:
    spec: Spec
    first: int  # the worker that reported first (what the others must agree with)
    workers: set[int] = field(default_factory=set)
    counts: dict[int, int] = field(default_factory=dict)  # each reporter's count of the name's plans so far
    opened: float = 0.0  # when the first report came (time.monotonic())
    index: int = -1  # the round's index (FuseReady.rounds), as its reporters that say one said it
    unindexed: set[int] = field(default_factory=set)  # its reporters that say none (matched by order)

    def join(self, worker: int, count: int, index: int) -> None:
        """``worker`` reported this round (its count of plans, and its index or -1)."""
        self.workers.add(worker)
        self.counts[worker] = count
        if index < 0:  # a side that does not say: matched by order (the others still compared)
            self.unindexed.add(worker)
        elif self.index < 0:
            self.index = index


class Planner:
    """The fused names this server is the anchor of, from report to plan."""

    def __init__(self, workers: int, warn_after_s: float = 30.0, run: str = "", server: str = "this server") -> None:
        self.workers, self.server = workers, server  # (server: how its failures name this server, "server 2")
        # The lane generation of the plans made now (FusePlan.lanes): ``run`` (this run of the server, so that
        # no other run's names meet ours) and a count of the resets handled (see _new_lanes).
        self.run = run
        self._resets = 0
        self.lanes = f"{run}.0"
        # Whether the lanes of other runs (our previous ones', see ``running``) are ended: at our first reset.
        self._others_ended = False
        # How many times some lane generations ended (a reset handled): the server fails their rounds then.
        self.endings = 0
        self.stalls: StallWatch[str] = StallWatch(warn_after_s=warn_after_s)
        self.waiting: dict[str, _Waiting] = {}
        self.ready: list[str] = []  # reported by every worker, not yet in a plan
        # Failed rounds of a name while some workers had not reported them, oldest first: why, the workers
        # still to hear it when they report (or to give it up themselves), and its index (-1: not said).
        self.failed: dict[str, list[tuple[Why, set[int], int]]] = {}
        self.seq = 0  # of the next plan
        # Plans of our previous runs (we restarted) that a worker still runs (FuseRunning), each known by its
        # seq and lane generation (FuseRunning.lanes: two runs number their plans alike, and a worker can run
        # plans of both): name -> (plan, count that plan brought the name to, index of its round or -1), and
        # plan -> names, for the workers that lost them (see running).
        self.running_names: dict[str, tuple[tuple[int, str], int, int]] = {}
        self.running_plans: dict[tuple[int, str], list[str]] = {}
        self.resends: list[Resend] = []
        # Per name, per worker: the rounds heard of (its reports, and its aborts of rounds it had not reported).
        self.heard: dict[str, list[int]] = {}
        # When each worker last reported a name another had reported here (see sweep's stall_s, and the round
        # table's joined_at)
        self.reported_at: dict[int, float] = {}
        # Each worker's epoch, from its last hello or Reset (new processes: a new one); the fused answers to it
        # carry it (FusePlan.epoch, FuseFailed.epoch), and its new processes ignore those of their predecessors.
        self.epochs: dict[int, str] = {}
        self.daemons: dict[int, str] = {}  # each worker's daemon at its last hello
        self.excused: set[int] = set()  # the workers whose processes were replaced in this run (_excuse)
        # The workers whose processes are gone (a reset, or a new epoch) and have reported or pushed nothing
        # here since: a name that waits for one fails after the timeout (sweep), as the round table's rounds do
        # (RoundTable.sweep). ``active``: those that reported or pushed here in this run. Once every worker is
        # without processes or was never active, the job is over and none of its failures waits for the next
        # (_excuse): a daemon idle since it started never says Reset, and a failure that waited for it shifted
        # the next job's rounds by one (wrong sums, a review's case).
        self.without_processes: set[int] = set()
        self.active: set[int] = set()
        # Per name, per worker: the index below which that worker's rounds are past (FusePast; 0: not said),
        # and its count of the name's plans then (-1: not said).
        self.floors: dict[str, list[int]] = {}
        self.floor: dict[str, int] = {}  # per name, the highest of its floors (one look-up a report)
        self.past_counts: dict[str, list[int]] = {}
        self._resent: set[tuple[int, int, str]] = set()  # (worker, seq, lanes) resent on the worker's connection
        # The seq of the first plan made for that daemon's processes (its first hello, or their epoch's start):
        # the plans before were not theirs, and are never sent to them again (sent_since).
        self.first_plan: dict[int, int] = {}
        # Per name, the spec of its last round ready (or reported behind a plan of our previous run): the plans
        # say each name's group (FusePlan.groups), for the workers that no longer have the name's round.
        self.spec_of: dict[str, Spec] = {}
        self.plans = 0
        self.planned = 0  # names, over all plans
        # The last plans, in order (PLAN_HISTORY_NAMES): seq, names, lane generation.
        self.history: deque[tuple[int, list[str], str]] = deque()
        self._history_names = 0

    def report(self, worker: int, names: list[str], specs: list[Spec], counts: list[int] | None = None,
               now: float = 0.0, rounds: list[int] | None = None) -> list[Failed]:
        """``worker``'s processes all issued ``names`` (spec ``specs[i]`` each; ``counts[i]``: how many plans
        the worker ran the name in so far; ``rounds[i]``: the round's index, see FuseReady). One plan behind
        a plan of our previous run that another worker runs: the worker lost it (``_missed``). A round below
        another worker's (waiting, or failed) is one the others are past: it fails for its worker alone."""
        out: list[Failed] = []
        self.processes_seen(worker)
        waiting, failed, ready, everyone, heard = self.waiting, self.failed, self.ready, self.workers, self.heard
        counts, indexes = counts or [0] * len(names), rounds if rounds and worker not in self.excused else [-1] * len(names)
        running = self.running_names
        lost: set[tuple[int, str]] = set()  # plans of our previous run the worker lost
        behind: set[tuple[int, str]] = set()  # (and whose round it failed since)
        for name, spec, count, index in zip(names, specs, counts, indexes):
            h = heard.get(name)
            if h is None:
                h = heard[name] = [0] * everyone
            h[worker] += 1  # (heard_of, inline: thousands of names per report)
            if running:
                run = running.get(name)
                if run is not None and count == run[1] - 1 and self._missed(name, spec, index, run, lost, behind):
                    continue
            if failed and name in failed:
                why = self._take_failed(name, worker, index)
                if why is not None:
                    out.append(Failed(worker, name, why.heard_by(describe_spec(spec))))
                    continue
            if self.floor and index >= 0 and self._below_floor(name, worker, index, out):
                continue
            w = waiting.get(name)
            if w is not None and index >= 0 and w.index >= 0 and index != w.index and worker not in w.workers:
                if index < w.index:  # the others are past this round: it never meets theirs
                    out.append(Failed(worker, name, self._stale(name, worker, index, w.index)))
                    continue
                out += self._passed(name, w, index)
                w = waiting.get(name)  # (its reporters that say no index, if any: this round is theirs too)
            if w is None:
                self.spec_of[name] = spec  # (a plan of our previous run may name it too: see groups)
                if everyone == 1:
                    ready.append(name)
                else:
                    waiting[name] = _Waiting(spec, worker, {worker}, {worker: count}, now, index,
                                             {worker} if index < 0 else set())
            elif worker in w.workers:
                continue  # reported again (a reconnect): nothing new
            elif spec != w.spec:
                out += self._mismatch(name, w, worker, spec)
            else:
                w.join(worker, count, index)
                self.reported_at[worker] = now  # (a name others reported: it catches up, see sweep's stall_s)
                if len(w.workers) == everyone:
                    del waiting[name]
                    ready.append(name)
                    self.spec_of[name] = w.spec
        self.resends += [self._resend(worker, plan, "restart" if plan in lost else "restart_lost")
                         for plan in sorted(lost | behind)]
        return out

    def _mismatch(self, name: str, w: _Waiting, worker: int, spec: Spec) -> list[Failed]:
        """``worker`` reported ``name`` with another spec than the first reporter of the round ``w``: it fails."""
        detail = f"worker {w.first} has {describe_spec(w.spec)} but worker {worker} has {describe_spec(spec)}"
        w.workers.add(worker)
        why = Why.mismatch(name, describe_spec(w.spec), describe_spec(spec), detail)
        return self._fail(name, w, why, specs={w.first: w.spec, worker: spec})

    def _missed(self, name: str, spec: Spec, index: int, run: tuple[tuple[int, str], int, int],
                lost: set[tuple[int, str]], behind: set[tuple[int, str]]) -> bool:
        """A report of ``name`` one plan behind ``run`` (a plan of our previous run that another worker still
        runs, see ``running``): the worker lost that plan. Its round is the plan's (it gets the plan again,
        to run: the report is answered so, True), or a later one (it failed the plan's round since: it gets
        the plan to give up, and this round waits as any)."""
        if index < 0 or run[2] < 0 or index == run[2]:
            lost.add(run[0])
            self.spec_of[name] = spec
            return True
        if index > run[2]:
            behind.add(run[0])
            self.spec_of.setdefault(name, spec)
        return False

    def past(self, worker: int, names: list[str], rounds: list[int], counts: list[int]) -> list[Failed]:
        """``worker`` is past the rounds of ``names[i]`` below ``rounds[i]`` (FusePast; ``counts[i]``: its
        count of the name's plans): it will never report them. Rounds of other workers below it fail (now,
        waiting here, or when they come, see ``report``); failed rounds below it no longer wait for it; a
        plan of our previous run that it lost, of a round it is past, is sent to it to give up. (Its
        FuseRunning came first: the reports of a plan it still runs were taken by ``running``.)"""
        out: list[Failed] = []
        for name, floor, count in zip(names, rounds, counts):
            if worker in self.excused:
                break  # (of its processes before a reset: gone)
            floors = self.floors.get(name)
            if floors is None:
                floors = self.floors[name] = [0] * self.workers
                self.past_counts[name] = [-1] * self.workers
            floors[worker] = max(floors[worker], floor)
            self.floor[name] = max(floors)
            self.past_counts[name][worker] = count
            run = self.running_names.get(name)
            if run is not None and 0 <= run[2] < floor and count == run[1] - 1:
                self.resends.append(self._resend(worker, run[0], "restart_lost"))
            w = self.waiting.get(name)
            if w is not None and 0 <= w.index < floor and worker not in w.workers:
                out += self._passed(name, w, floor)
            for _, left, index in self.failed.get(name, ()):
                if 0 <= index < floor:
                    left.discard(worker)
            if name in self.failed:
                self.failed[name] = [r for r in self.failed[name] if r[1]]
                if not self.failed[name]:
                    del self.failed[name]
        return out

    def _below_floor(self, name: str, worker: int, index: int, out: list[Failed]) -> bool:
        """Whether ``worker``'s round ``index`` of ``name`` is below what another worker is past (FusePast):
        it fails (``out``)."""
        floor = self.floor.get(name, 0)
        if index < floor:
            out.append(Failed(worker, name, self._stale(name, worker, index, floor)))
        return index < floor

    def _passed(self, name: str, w: _Waiting, index: int) -> list[Failed]:
        """A worker is at round ``index`` of ``name``, past the round waiting: the rounds of its reporters that
        said an index are stale; those that said none (matched by order) wait on, for round ``index``."""
        stale, was = sorted(w.workers - w.unindexed), w.index
        if w.unindexed:
            w.workers = set(w.unindexed)
            w.counts = {r: c for r, c in w.counts.items() if r in w.unindexed}
            w.first, w.index = min(w.unindexed), -1
        else:
            del self.waiting[name]
        return [Failed(r, name, self._stale(name, r, was, index)) for r in stale]

    def running(self, worker: int, seq: int, names: list[str], counts: list[int],
                rounds: list[int] | None = None, lanes: str = "") -> None:
        """``worker`` still runs plan ``seq`` of our previous run (``rounds``: the index of each name's round
        in it, where said; ``lanes``: its lane generation): the workers that reported its names one plan
        behind lost it (now or when they report them, see ``report``); those whose round is later failed the
        plan's round (they give it up)."""
        if self._others_ended:  # (a plan of another run: its lanes ended at our first reset, see _excuse)
            return  # its pushes are refused: sent again, it would only fail the round of the worker that runs it
        plan = (seq, lanes)
        self.running_plans[plan] = list(names)
        lost: set[int] = set()
        past: set[int] = set()
        for name, count, index in zip(names, counts, rounds or [-1] * len(names)):
            self.running_names[name] = (plan, count, index)
            floors = self.floors.get(name)
            if floors is not None and index >= 0:  # workers past its round (FusePast) that lost it
                past |= {r for r, floor in enumerate(floors)
                         if floor > index and self.past_counts[name][r] == count - 1}
            w = self.waiting.get(name)
            if w is None:
                continue
            behind = {r for r, c in w.counts.items() if c == count - 1}
            if index >= 0 and w.index >= 0 and w.index != index:
                if w.index > index:
                    past |= behind
                    self.spec_of.setdefault(name, w.spec)
                continue  # (a lower one: stale, see report)
            lost |= behind
            w.workers -= behind
            for r in behind:
                del w.counts[r]
            if not w.workers:
                del self.waiting[name]
        self.resends += [self._resend(r, plan, "restart") for r in sorted(lost)]
        self.resends += [self._resend(r, plan, "restart_lost") for r in sorted(past - lost)]

    def _resend(self, worker: int, plan: tuple[int, str], how: PlanResent) -> Resend:
        """``plan`` (seq, lane generation) of our previous run, to send ``worker`` again (see ``running``)."""
        return Resend(worker, plan[0], self.running_plans[plan], how, plan[1])

    def stall_warnings(self, now: float) -> list[Stall]:
        """The names that waited ``warn_after_s`` (and again every ``warn_after_s``) for workers whose processes
        have not issued them, in words (as the round table's stalls are said), told to every worker."""
        old = {name: w.opened for name, w in self.waiting.items() if now - w.opened >= self.stalls.warn_after_s}
        stalls = []
        for name, waited in self.stalls.due(now, old):
            w = self.waiting[name]
            missing = ", ".join(str(r) for r in range(self.workers) if r not in w.workers)
            stalls.append(Stall(f"stall: round {w.counts.get(w.first, 0)} of {name!r} part 0 has waited {waited:.1f} s "
                                f"for worker {missing}, whose processes have not pushed it (pushed by worker "
                                f"{', '.join(map(str, sorted(w.workers)))})", tuple(range(self.workers))))
        return stalls

    def sweep(self, now: float, connected: AbstractSet[int], grace_s: float, stall_s: float = 0.0,
              pushed: Mapping[int, float] | None = None) -> list[Failed]:
        """Fail every name that has waited ``grace_s`` for a worker that is not connected or has no training
        processes (``without_processes``), as the round table fails its rounds: its reporters hear now. A job
        run where another machine's processes were gone waited for ever (a review's case). With ``stall_s``
        (cluster.stall_timeout; 0: never) also every name that has waited that long for connected workers that
        did not catch up on the others' names since, by a report or a push (``pushed``: the round table's
        ``joined_at``)."""
        out: list[Failed] = []
        for name, w in list(self.waiting.items()):
            if now - w.opened < grace_s:
                continue
            waiting = [r for r in range(self.workers) if r not in w.workers]
            absent = [r for r in waiting if r not in connected or r in self.without_processes]
            # (the step's index where the reporters said it: the count of plans misses the failed steps, a review)
            what = f"round {w.index if w.index >= 0 else w.counts.get(w.first, 0)} of {name!r}"
            if absent:
                out += self._fail(name, w, Why.absent_worker(absent[0], absent[0] in connected, grace_s, what,
                                                                   self.server))
            elif stalled(waiting, w.opened, now, stall_s, self._heard_from(waiting, pushed or {})):
                out += self._fail(name, w, Why.stalled_workers(waiting, stall_s, what))
        return out

    def _heard_from(self, workers: list[int], pushed: Mapping[int, float]) -> dict[int, float]:
        """When each of ``workers`` last caught up here: its last report or push of what another had sent first."""
        return {r: max(self.reported_at.get(r, -math.inf), pushed.get(r, -math.inf)) for r in workers}

    def groups(self, names: list[str]) -> tuple[list[list[Any]], list[int]]:
        """The groups of a plan of ``names`` (as FusePlan says them): [dtype, average] each, and each name's
        index into them. A few distinct specs a plan: one dict look-up a name, no object a name. None said
        (empty) where a name's spec is not known here (a plan of our previous run resent, whose names were not
        all reported to us): the worker groups by its own specs then."""
        spec_of = self.spec_of
        index: dict[Spec, int] = {}
        by_group: dict[tuple[str, bool], int] = {}
        groups: list[list[Any]] = []
        which: list[int] = []
        for name in names:
            spec = spec_of.get(name)
            if spec is None:
                return [], []
            k = index.get(spec)
            if k is None:
                group = (spec[0], spec[2])
                k = by_group.get(group)
                if k is None:
                    k = by_group[group] = len(groups)
                    groups.append([spec[0], spec[2]])
                index[spec] = k
            which.append(k)
        return groups, which

    def ended(self, name: str) -> bool:
        """Whether ``name`` is a fused tensor on a lane generation that a reset ended (its rounds fail: a worker
        dropped its plans, or numbers the lanes from 0 again): one of this run before the current one, or one of
        another run (our previous run's plans still running, see ``running``) once we handled a reset."""
        lanes = fused_lanes(name)
        return (lanes is not None and lanes != self.lanes
                and (self._others_ended or lanes.rpartition(".")[0] == self.run))

    def epoch(self, worker: int) -> str:
        """``worker``'s epoch as we know it (what our fused answers to it carry)."""
        return self.epochs.get(worker, "")

    def take_resends(self) -> list[Resend]:
        resends, self.resends = self.resends, []
        sent = self._resent
        fresh = []
        for r in resends:  # once a connection (a report and a FusePast can both find it lost)
            if (r.worker, r.seq, r.lanes) not in sent:
                sent.add((r.worker, r.seq, r.lanes))
                fresh.append(r)
        return fresh

    def take_plans(self) -> list[tuple[int, list[str]]]:
        """The names ready since the last call, as plans that fit a message (``fused_chunks``): (seq, names),
        each on lane generation ``lanes`` (a reset fails every name ready before it: see worker_gone)."""
        plans = []
        ready = self.ready
        if self.running_names:  # a name planned anew is past the plans of our previous run
            for name in ready:
                self.running_names.pop(name, None)
        for start, stop in fused_chunks(ready):
            plans.append((self.seq, ready[start:stop]))
            self.seq += 1
        history = self.history
        for seq, names in plans:
            history.append((seq, names, self.lanes))
            self._history_names += len(names)
        limit = max(PLAN_HISTORY_NAMES, 2 * len(self.heard))
        while self._history_names > limit and len(history) > 1:
            self._history_names -= len(history.popleft()[1])
        self.plans += len(plans)
        self.planned += len(ready)
        self.ready = []
        return plans

    def abort(self, worker: int, names: list[str], why: Why, unfused: Callable[[str], set[int]] = lambda _: set(),
              reported: bool = False, told: bool = True, rounds: list[int] | None = None) -> list[Failed]:
        """``worker`` gave these names up (see ``FuseAbort``): fail them for every worker. ``unfused(name)``:
        the workers that pushed the name's open round unfused (they will not report it: not waited for).
        ``reported``: the rounds given up are those ``worker`` reported last, not its next ones. ``told``:
        the worker told us (it counts the round as told, see ``resync``), not a push of ours that meant it.
        ``rounds``: each round's index (see FuseReady), where said. A reported round of a name this run heard
        nothing of from ``worker`` (its report went to our previous run: a report, or one lost with a
        connection, would have been counted, see ``resync``; its processes are those it began with) is given
        up as a round not reported, uncounted."""
        out: list[Failed] = []
        # A worker excused in this run (report too) has new processes, counting from 0 at the peers' step: its
        # indexes are not the peers', and its rounds are matched by order.
        indexes = rounds if rounds and worker not in self.excused else [-1] * len(names)
        for name, index in zip(names, indexes):
            counted = told  # (per name: one reported round this run never heard of is not counted, the next may be)
            if reported:  # (an excused worker's count is 0 here: the abort is of its old processes' report)
                h = self.heard.get(name)
                if index < 0 or (h is not None and h[worker] > 0) or worker in self.excused:
                    out += self._abort_reported(worker, name, why, unfused)
                    continue
                counted = False
            if counted:
                self.heard_of(worker, name)
            if name in self.failed:
                taken = self._take_failed(name, worker, index)
                if taken is not None:
                    continue  # that round failed already (its reporters told), or a later one: not waited for
            w = self.waiting.get(name)
            if w is not None and index >= 0 and w.index >= 0 and index != w.index and worker not in w.workers:
                if index < w.index:
                    continue  # the others are past it: nobody waits for it
                out += self._passed(name, w, index)
                w = self.waiting.get(name)  # (see report)
            if w is not None:
                out += self._fail(name, w, why, skip=worker, unfused=unfused(name))
            elif name in self.ready:
                self.ready.remove(name)
                out += [Failed(other, name, why) for other in range(self.workers) if other != worker]
            else:
                self._add_failed(name, why, set(range(self.workers)) - {worker} - unfused(name), index)
        return out

    def _abort_reported(self, worker: int, name: str, why: Why, unfused: Callable[[str], set[int]]) -> list[Failed]:
        """``worker`` gave up the round of ``name`` it reported last (see ``abort``)."""
        w = self.waiting.get(name)
        if w is not None and worker in w.workers:
            return self._fail(name, w, why, unfused=unfused(name))  # its reporters hear, ``worker`` too
        if name in self.ready:  # every worker reported that round (``worker``'s report is its last one)
            self.ready.remove(name)
            return [Failed(r, name, why) for r in range(self.workers)]
        return []  # planned already (the plan answers it) or failed already (its reporters were told)

    @staticmethod
    def _stale(name: str, worker: int, index: int, others: int) -> Why:
        """Why ``worker``'s round ``index`` of ``name`` fails: another worker is at round ``others``, past it
        (it failed there, and our previous run died before telling ``worker``, or the news of it was lost)."""
        detail = (f"worker {worker} is at round {index} of it and another worker at round {others}: that round "
                  f"failed or was given up on the other side")
        return Why(f"tensor {name!r}: {detail}", "round_failed", name=name, detail=detail)

    def pushed_unfused(self, worker: int, name: str, why: Callable[[Spec], Why],
                       unfused: set[int], past: bool = False) -> list[Failed]:
        """``worker`` pushed ``name`` as an ordinary tensor (too large to fuse where it was issued). It will
        not report the name this round: a failure here no longer waits for it. Reports of the name waiting
        here meet a mismatch of sizes (one side fused, the other not): they fail (``why(their spec)``), and
        so does the round the unfused pushes are in (the caller's part); ``unfused``: every worker that
        pushed that round. ``past``: the reporters gave that round up already (their reports are of a later
        step, which the push does not meet)."""
        if name in self.failed:
            self._take_failed(name, worker)
        w = self.waiting.get(name)
        if w is None or worker in w.workers or past:
            return []
        return self._fail(name, w, why(w.spec), unfused=unfused | {worker})

    def reported_beside_unfused(self, worker: int, name: str, why: Why, unfused: set[int]) -> list[Failed]:
        """``worker``'s report of ``name`` (just made) is of the round that the workers ``unfused`` pushed as
        an ordinary tensor: a mismatch of sizes, and the report fails. (The pushers are not waited for: each
        took its part of a failed round when it pushed, see ``pushed_unfused``.)"""
        w = self.waiting.get(name)
        if w is None or worker not in w.workers or w.workers & unfused:
            return []
        return self._fail(name, w, why, unfused=unfused)

    def resync(self, worker: int, names: list[str], counts: list[int], why: Why,
               rounds: list[int] | None = None) -> list[Failed]:
        """``worker`` is back on a new connection and told us ``counts[i]`` rounds of ``names[i]`` in all: each
        we did not hear of was lost with its old connection (it failed there) and fails here, as its abort.
        ``rounds[i]``: the index of the last round told, the last of those lost (the others: not known)."""
        out: list[Failed] = []
        for name, count, last in zip(names, counts, rounds or [-1] * len(names)):
            h = self.heard.get(name)
            lost = count - (h[worker] if h is not None else 0)
            for k in range(lost):
                out += self.abort(worker, [name], why, rounds=[last] if last >= 0 and k == lost - 1 else None)
        return out

    def heard_of(self, worker: int, name: str) -> None:
        """``worker`` told us of a round of ``name`` (see ``resync``)."""
        h = self.heard.get(name)
        if h is None:
            h = self.heard[name] = [0] * self.workers
        h[worker] += 1

    def sent_since(self, seq: int, worker: int) -> list[tuple[int, list[str], str]] | None:
        """The plans from ``seq`` on (``worker`` got those before it and not the rest; none made before its
        daemon first connected, or before its processes' epoch began: those were its old processes'), to send
        it again, each with its lane generation (the peers numbered it there, ended or not); None if some are
        no longer kept."""
        seq = max(seq, self.first_plan.get(worker, 0))
        history = self.history
        if seq >= self.seq:
            return []
        if not history or history[0][0] > seq:
            return None
        return [plan for plan in history if plan[0] >= seq]

    def worker_hello(self, worker: int, epoch: str, daemon: str = "") -> None:
        """``worker`` connected with ``epoch``: a new one (its processes are new, they start at the peers'
        step) ends what failures waited for of its old processes, and its counts start again. A new
        ``daemon`` got none of the plans made before."""
        if daemon != self.daemons.get(worker):
            self.daemons[worker] = daemon
            self.first_plan[worker] = self.seq
        previous = self.epochs.get(worker)
        if epoch:
            self.epochs[worker] = epoch
        if epoch and previous is not None and previous != epoch:
            self._excuse(worker)  # (its Reset may have been lost with a connection)
            self.first_plan[worker] = self.seq

    def worker_gone(self, worker: int, why: Why, reset: bool, epoch: str = "", spared: Spared = spare_none
                    ) -> list[Failed]:
        """``worker``'s connection dropped, or its processes are gone (``reset``): every name waiting here
        fails, since it waits for that worker or for what it reported (which the worker fails itself, see
        ``bps_worker.fusion``'s ``link_lost``). After a reset the failures no longer wait for the worker (its
        processes will not report those rounds); after a drop they do, and so do the rounds failed now that it
        had not reported: its processes live on and report them when it is back. ``epoch``: the worker's new
        one (a Reset says it), so that its next hello does not excuse its new processes again (nor, where a
        hello brought it first, this Reset: see _excuse). ``spared`` (a reset's): whether the names its reporters
        reported are of a later job than the processes that left (bps_server.jobs): those wait for the worker's
        next processes."""
        out: list[Failed] = []
        self._resent = {sent for sent in self._resent if sent[0] != worker}  # (resent again if lost with it)
        for name, w in list(self.waiting.items()):
            if reset and spared(w.workers):
                continue
            out += self._fail(name, w, why, skip=worker if reset or worker in w.workers else -1)
        if self.ready:  # reported by every worker, its report too (failed there): not planned
            out += [Failed(r, name, why) for name in self.ready for r in range(self.workers) if r != worker]
            self.ready = []
        if reset:
            self._excuse(worker, new_lanes=not epoch or epoch != self.epochs.get(worker))
            if epoch:
                self.epochs[worker] = epoch
            self.first_plan[worker] = self.seq
        return out

    def _excuse(self, worker: int, new_lanes: bool = True) -> None:
        """``worker``'s processes are gone: no failure waits for them, and its counts start again. The plans
        made from now on are on a new lane generation (``new_lanes``; not where a hello brought the worker's
        new epoch before its Reset: that hello started it): the worker dropped the plans sent to its old
        processes without numbering them, so the lanes they ran on are out of step with its peers' for good.
        Our previous runs' lanes end at the first (the worker numbers them from 0 again): their plans still
        running are never sent again."""
        if new_lanes or not self._others_ended:
            self.endings += 1
        if new_lanes:
            self._resets += 1
            self.lanes = f"{self.run}.{self._resets}"
        if not self._others_ended:
            self._others_ended = True
            self.running_names.clear()
            self.running_plans.clear()
        for name in list(self.failed):
            rounds = [(why, left - {worker}, index) for why, left, index in self.failed[name]]
            rounds = [(why, left, index) for why, left, index in rounds if left]
            if rounds:
                self.failed[name] = rounds
            else:
                del self.failed[name]
        for h in self.heard.values():
            h[worker] = 0
        for name, floors in self.floors.items():
            floors[worker] = 0
            self.floor[name] = max(floors)
        for counts in self.past_counts.values():
            counts[worker] = -1
        self.excused.add(worker)
        self.without_processes.add(worker)
        if all(w in self.without_processes or w not in self.active for w in range(self.workers)):
            self.failed.clear()  # the job ended (a failure made after a worker's reset waited for its next processes)
        self._forget_names()

    def _forget_names(self) -> None:
        """A worker's processes went: the names whose counts are now what a name never heard of has (zeros: every
        worker that counted it has new processes since) go, but for names waiting, ready, failed or running.
        Names that never repeat (a step number in each) kept them for good, and the plans kept for them (a
        review: a server grew 0.3-0.45 MB a job of 6,000 such names)."""
        keep = set(self.waiting) | set(self.ready) | set(self.failed) | set(self.running_names)
        for name in [n for n, h in self.heard.items() if n not in keep and not any(h)]:
            del self.heard[name]
        for name in [n for n, f in self.floors.items() if n not in keep and not any(f)
                     and all(c == -1 for c in self.past_counts[n])]:
            del self.floors[name], self.floor[name], self.past_counts[name]
        for name in [n for n in self.spec_of if n not in keep and n not in self.heard]:
            del self.spec_of[name]

    def worker_idle(self, worker: int) -> None:
        """``worker``'s daemon says it has no training processes (Hello.processes): a name that waits for it fails
        after the timeout (sweep), as after its Reset, until it says Joined or reports (see RoundTable.worker_idle)."""
        self.without_processes.add(worker)

    def worker_joined(self, worker: int) -> None:
        """``worker`` has training processes again (its Joined): names wait for them as for any."""
        self.without_processes.discard(worker)

    def processes_seen(self, worker: int) -> None:
        """``worker`` reported, or pushed anything here (an unfused round, a fused lane): it has processes."""
        self.without_processes.discard(worker)
        self.active.add(worker)

    def _take_failed(self, name: str, worker: int, index: int = -1) -> Why | None:
        """``worker``'s report or abort of ``name`` (round ``index``, -1: not said) is of the oldest failed
        round it is still in: it is out of that round now; why the round failed (None: it is in none). Where
        indexes are said: the failed round of ``index`` is the one, wherever it is (a round before it whose
        index is not said is older: the worker is past it); else a failed round below ``index`` is one the
        worker is past (its report or abort was lost, or went to our previous run), and the first other one
        is the worker's (its index not said) or above it: the others are past the worker's round, which
        fails as stale (the worker stays in the later one)."""
        mine = [r for r in self.failed[name] if worker in r[1]]
        at = next((i for i, r in enumerate(mine) if r[2] == index), -1) if index >= 0 else -1
        if at < 0:  # in order: the rounds below are past, the first other one is the worker's or above it
            at = next((i for i, r in enumerate(mine) if index < 0 or not 0 <= r[2] < index), len(mine))
            if at < len(mine) and 0 <= index < mine[at][2]:
                self._leave(name, worker, mine[:at])
                return self._stale(name, worker, index, mine[at][2])
        self._leave(name, worker, mine[:at + 1])
        return mine[at][0] if at < len(mine) else None

    def _leave(self, name: str, worker: int, rounds: list[tuple[Why, set[int], int]]) -> None:
        """``worker`` is out of these failed rounds of ``name`` (those it is in)."""
        if not rounds:
            return
        for r in rounds:
            r[1].discard(worker)
        kept = [r for r in self.failed[name] if r[1]]
        if kept:
            self.failed[name] = kept
        else:
            del self.failed[name]

    def _add_failed(self, name: str, why: Why, left: set[int], index: int = -1) -> None:
        """A round of ``name`` (``index``) failed; ``left``: the workers still to hear it (the newest round; not
        those past it, see ``past``)."""
        floors = self.floors.get(name) if self.floors and index >= 0 else None
        if floors is not None:
            left = {r for r in left if floors[r] <= index}
        if left:
            self.failed.setdefault(name, []).append((why, left, index))

    def _fail(self, name: str, w: _Waiting, why: Why, *, skip: int = -1,
              specs: dict[int, Spec] | None = None, unfused: AbstractSet[int] = frozenset()) -> list[Failed]:
        """Fail waiting name ``name``: its reporters hear now, the other workers when they report it (but not
        those that pushed it ``unfused``: they heard through their round)."""
        del self.waiting[name]
        specs = specs or {}
        told = [Failed(r, name, why.heard_by(describe_spec(specs.get(r, w.spec))))
                for r in sorted(w.workers) if r != skip]
        self._add_failed(name, why, set(range(self.workers)) - w.workers - {skip} - unfused, w.index)
        return told
