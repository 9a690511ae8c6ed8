"""Fused small sums end to end, without sockets or a loop: every worker's real ``FusedRounds`` and the anchor's
real ``Planner``, joined by one ordered channel each way per worker, walked through every order in which
their messages and the processes' steps can happen.

What each process does with one name, step by step (``acts[w][k]``):

- ``R``: submits its round and waits for the outcome (the sum, or a failure); the daemon sends the report
  then, or later (it holds reports while a fused operation with the anchor runs);
- ``X``: submits, and then, at any moment before the anchor's answer arrives, its machine gives the reported
  round up (``fail_name``: e.g. a process of that machine issued the name too large to fuse) and the process
  hears the failure at once;
- ``U``: its machine pushes the name unfused (a ``FuseAbort`` of a round it never reported), and the process
  hears the failure at once.

A plan runs as the daemon runs it: its sum needs every worker's round; a worker whose round of a planned name
was given up fails the plan's group, and every worker that ran it hears a failure. The walk asserts that each
step of each process ends exactly once, that a sum only ever adds the same step of every worker, that a
failure only comes for a step some machine gave up, that nothing waits for ever, and that nothing is left
in any planner or worker at the end.
"""

from __future__ import annotations

import pickle
import itertools
from dataclasses import dataclass, field

from bps_server.fusion import Planner
from bps_worker.fusion import FusedRounds
from protocol.messages import Spec, Why

F32: Spec = ("float32", (4,), False, "")
NAME = "a"


@dataclass
class World:
    acts: list[str]  # one string per worker: its process's act at each step
    hold: bool  # whether a daemon may hold its reports for a while (else they go at once)
    planner: Planner
    rounds: list[FusedRounds[str]]
    up: list[list[tuple]] = field(default_factory=list)  # worker -> server, in order
    held: list[list] = field(default_factory=list)  # rounds complete on each worker, report not sent yet
    down: list[list[tuple]] = field(default_factory=list)  # server -> worker, in order
    step: list[int] = field(default_factory=list)  # each process's current step
    waiting: list[bool] = field(default_factory=list)  # its current step waits for an outcome
    may_give_up: list[bool] = field(default_factory=list)  # an X step whose reported round can still be given up
    outcomes: dict[tuple[int, int], str] = field(default_factory=dict)  # (worker, step) -> "sum" or "failed"
    given_up: set[int] = field(default_factory=set)  # steps some machine gave up
    plans: dict[int, dict[int, int | None]] = field(default_factory=dict)  # seq -> worker -> its step (None: gone)

    def end(self, w: int, k: int, how: str) -> None:
        assert (w, k) not in self.outcomes, (self.acts, w, k, how, self.outcomes)
        assert how == "sum" or k in self.given_up, (self.acts, f"worker {w} step {k} failed, nobody gave it up")
        self.outcomes[(w, k)] = how
        if self.step[w] == k and self.waiting[w]:
            self.waiting[w] = False
            self.may_give_up[w] = False
            self.step[w] += 1

    # -- messages ----------------------------------------------------------------------
    def send_up(self, w: int, out) -> None:
        for (name, why, reported), index in zip(out.aborts, out.abort_rounds, strict=True):
            self.up[w].append(("abort", why, reported, index))
        self.held[w] += out.ready
        if not self.hold:
            self.send_reports(w)

    def send_reports(self, w: int) -> None:
        """The daemon sends the reports it held (fused_driver's ``_send_reports``: not those failed since)."""
        held, self.held[w] = self.held[w], []
        for fr in held:
            if fr.why is None:
                fr.sent = True
                self.up[w].append(("report", self.rounds[w].counts.get(NAME, 0), fr.index))

    def answer(self, w: int, out) -> None:
        for member, failure in out.answers:
            self.end(w, failure.req, "failed")

    def at_server(self, w: int) -> None:
        message = self.up[w].pop(0)
        if message[0] == "report":
            told = self.planner.report(w, [NAME], [F32], [message[1]], rounds=[message[2]])
        else:
            told = self.planner.abort(w, [NAME], message[1], reported=message[2], rounds=[message[3]])
        for f in told:
            self.down[f.worker].append(("failed", f.why))
        for seq, names in self.planner.take_plans():
            assert names == [NAME]
            self.plans[seq] = {}
            for v in range(len(self.rounds)):
                self.down[v].append(("plan", seq))

    def at_worker(self, w: int) -> None:
        message = self.down[w].pop(0)
        rounds = self.rounds[w]
        if message[0] == "failed":
            self.answer(w, rounds.failed_at_anchor(NAME, message[1]))
            return
        seq = message[1]
        gone = rounds.abandoned.get(NAME)
        step_gone = gone[0].entries[0].req if gone else None  # type: ignore[union-attr]
        run, missing = rounds.planned([NAME])
        if run:
            self.plans[seq][w] = run[0].entries[0].req  # type: ignore[union-attr]
        else:
            assert missing == {NAME: F32}, (self.acts, missing)
            self.plans[seq][w] = None
            assert step_gone is not None and step_gone in self.given_up
        if len(self.plans[seq]) == len(self.rounds):  # every worker ran its part: the group ends
            steps = self.plans.pop(seq)
            ran = {s for s in steps.values() if s is not None}
            assert len(ran) <= 1, (self.acts, f"plan {seq} adds steps {steps}")
            ok = None not in steps.values()
            for v, s in steps.items():
                if s is not None:
                    self.end(v, s, "sum" if ok else "failed")

    # -- the processes ------------------------------------------------------------------
    def act(self, w: int) -> None:
        k = self.step[w]
        rounds = self.rounds[w]
        what = self.acts[w][k]
        if what == "U":
            self.given_up.add(k)
            rounds.skip(NAME)  # as the daemon does when it opens the unfused round (the abort says no index)
            self.up[w].append(("abort", Why(f"step {k} pushed unfused", "mismatch"), False, -1))
            self.waiting[w] = True
            self.end(w, k, "failed")
            return
        out = rounds.submit(f"p{w}", 0, [(k, NAME, F32, "seg", 0, 0)])
        self.answer(w, out)
        self.send_up(w, out)
        self.waiting[w] = (w, k) not in self.outcomes
        self.may_give_up[w] = what == "X" and self.waiting[w]

    def give_up(self, w: int) -> None:
        k = self.step[w]
        self.given_up.add(k)
        out = self.rounds[w].fail_name(NAME, Why(f"step {k} given up", "mismatch"))
        self.may_give_up[w] = False
        self.answer(w, out)
        self.send_up(w, out)


def _msg(m: tuple) -> tuple:
    return tuple(x.text if isinstance(x, Why) else x for x in m)


def _round(fr) -> tuple:
    return (tuple(None if e is None else e.req for e in fr.entries), fr.count, frozenset(fr.excused),
            fr.why.text if fr.why else None, fr.sent, fr.index)


def state(world: World) -> tuple:
    """Everything the walk's future depends on (equal states are walked once)."""
    p = world.planner
    planner = (tuple((n, frozenset(w.workers), tuple(sorted(w.counts.items())), w.index) for n, w in p.waiting.items()),
               tuple((n, tuple((why.text, frozenset(left), index) for why, left, index in rounds))
                     for n, rounds in p.failed.items()),
               tuple(p.ready), p.seq, tuple((n, tuple(x > 0 for x in h)) for n, h in p.heard.items()))
    workers = tuple(
        (tuple((n, _round(fr)) for n, fr in r.collecting.items()), tuple((n, _round(fr)) for n, fr in r.reported.items()),
         tuple((n, tuple(map(_round, rs))) for n, rs in r.failed.items()),
         tuple((n, tuple(map(_round, rs))) for n, rs in r.abandoned.items()), tuple(r.counts.items()),
         tuple(r.index.items()))
        for r in world.rounds)
    return (planner, workers, tuple(tuple(map(_round, q)) for q in world.held), tuple(tuple(map(_msg, q)) for q in world.up), tuple(tuple(map(_msg, q)) for q in world.down),
            tuple(world.step), tuple(world.waiting), tuple(world.may_give_up), tuple(sorted(world.outcomes.items())),
            frozenset(world.given_up), tuple((seq, tuple(sorted(d.items()))) for seq, d in sorted(world.plans.items())))


def walk(world: World, counter: list[int], seen: set[tuple]) -> None:
    key = state(world)
    if key in seen:
        return
    seen.add(key)
    n = len(world.rounds)
    steps = len(world.acts[0])
    moves = []
    for w in range(n):
        if not world.waiting[w] and world.step[w] < steps:
            moves.append((World.act, w))
        if world.may_give_up[w] and NAME in world.rounds[w].reported:
            moves.append((World.give_up, w))
        if world.held[w]:
            moves.append((World.send_reports, w))
        if world.up[w]:
            moves.append((World.at_server, w))
        if world.down[w]:
            moves.append((World.at_worker, w))
    if not moves:
        counter[0] += 1
        acts = world.acts
        assert all(world.step[w] == steps for w in range(n)), (acts, "waits for ever", world.step, world.outcomes)
        assert len(world.outcomes) == n * steps
        p = world.planner
        assert not p.waiting and not p.failed and not p.ready, (acts, p.waiting, p.failed)
        for r in world.rounds:
            assert not (r.collecting or r.reported or r.failed or r.abandoned), (acts, r.reported, r.abandoned)
        for k in range(steps):  # a step every machine ran in full is summed
            if k not in world.given_up:
                assert all(world.outcomes[(w, k)] == "sum" for w in range(n)), (acts, k, world.outcomes)
        return
    for move, w in moves:
        nxt = pickle.loads(pickle.dumps(world, pickle.HIGHEST_PROTOCOL))
        move(nxt, w)
        walk(nxt, counter, seen)


def explore(acts: list[str], hold: bool) -> int:
    n = len(acts)
    world = World(acts, hold, Planner(n), [FusedRounds(1, w, w) for w in range(n)], [[] for _ in range(n)],
                  [[] for _ in range(n)], [[] for _ in range(n)], [0] * n, [False] * n, [False] * n)
    counter = [0]
    seen: set[tuple] = set()
    walk(world, counter, seen)
    return len(seen)


def test_every_order_of_reports_aborts_and_give_ups_gives_each_step_one_true_outcome():
    """2 workers x 2 steps, every mix of R, X and U, reports sent at once; 3 workers x 1 step likewise, with
    reports held for a while or not."""
    orders = 0
    for workers, steps, hold in ((2, 2, False), (3, 1, True)):
        for mix in itertools.product("RXU", repeat=workers * steps):
            acts = ["".join(mix[w * steps:(w + 1) * steps]) for w in range(workers)]
            orders += explore(acts, hold)
    assert orders > 5_000, orders  # the walk did explore (distinct states)
