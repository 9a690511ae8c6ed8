"""Fused sums through random connection breaks, lost messages and give-ups: the real ``FusedSums`` of two
workers and the real ``Planner``, the server's side played as ``bps_server.connection`` and ``server.py`` play
it, the links and the fused operations faked (no sockets, no sums: a data round pairs the two workers'
operations by lane number and compares which step of which name each brought).

Each seed draws an order of events: a process submitting its next step (after its previous one ended),
a daemon sending its held reports, a message delivered (in order, each way), a connection breaking (losing
a random tail of what was not yet delivered, each way), the server noticing it (or the worker's reconnect
replacing it), the link reconnecting (the same run of the server) or giving up first, a process of a
machine giving a round up (``fail_name``), plans going out, a data round completing. Checked: no data round
pairs two steps, every step of every process ends exactly once, nothing waits for ever, nothing is left in
the planner or the workers at the end, and both workers took the same lane numbers. Found the queued-report
give-up of 45fbf5e (126 of 2,000 seeds). Outside the reset modes, both workers also took as many unfused round
numbers of each name for their failed fused rounds (``unfused_step``): before a plan group's failure took them
(``FusedOperation.failed_steps``, ``FakeOp`` here), 127 of seeds 0-249 of base differed (fault_soak seed 311). Modes: ``base`` (one process a worker), ``local2`` (two processes
on worker 0, one of which may leave; rounds waiting for it then fail as overdue), ``restart`` (the anchor
server dies and a new run of it starts: a plan a worker gave up in full is not told to the new run in
FuseRunning, so a peer that lost it in the crash numbers that lane one round less; each run plans on lanes
of its own (FusePlan.lanes), so only the last run's lanes are compared at the end, see STRICT_LANES; not in
the suite yet), ``reset`` and ``resetonly`` (every process of a worker
leaves, its daemon resets as ``bps_worker/daemon.py`` does, and new processes rejoin at the peer's step; the
data rounds then go through the real ``bps_server.rounds.RoundTable``, the anchor refusing fused tensors of
lane generations a reset ended; a few seeds of reset in the suite). The reset link drops what
the old processes queued of fused sums (``ServerLink.reset``), as the real one does since session 29: before,
seeds 271, 275 and 344 of reset delivered an old report after the new epoch's hello, and it was taken for the
new processes' (a step off: wrong sums, then a wait). A rejoined worker's rounds are matched by order, name by
name, so one worker can end a step or more ahead of the other in a name: its peer's last rounds of it pair none
(``trails``). Such a trailing round waits, or fails and is left in the planner for the finished worker, until
that worker's processes exit at the job's end; so where one is left, the finished processes exit as the real
daemons see it (``exit_finished``: a reset and its Reset) and then nothing may wait or be left. Before, the
trailing round was excused by the epoch's first data round's offset alone and only while it waited: reset
failed 13 of seeds 400-799 (10 "planner failed left": the trailing round had failed; 448, 606 and 691 "wait
for ever": the waiting name was a step off while the other name's data round was in step).
Run more seeds with ``python tests/pure/test_fusion_sim.py MODE A B [trace]``. Environment switches emulate
a candidate fix (in the reset modes): SWEEP_LAST=1 (the sweep only when nothing else can happen).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import types
from collections import Counter
from typing import Any

import numpy as np
import pytest

from bps_worker.link import _FUSED_TOLD
from bps_worker.daemon import WorkerCounters
import bps_worker.fused_driver as fd
from bps_server import rounds as srounds
from bps_server.fusion import Planner
from protocol.messages import (Abort, Failure, FuseAbort, FuseFailed, FusePast, FusePlan, FuseReady, FuseResync,
                               FuseRunning, Push, Reset, Why, fused_lanes, fused_name)

F32 = ("float32", (4,), False, "")
NAMES = ["a", "b"]
PARAMS = [dict(), dict(p_break=0.15, nsteps=10), dict(p_break=0.03, p_failname=0.1, nsteps=12),
          dict(p_break=0.3, p_giveup=1.0, p_lose=0.9, nsteps=6)]
SWEEP_LAST = bool(os.environ.get("SWEEP_LAST"))  # the round table's sweep only when nothing else can happen
# The anchor's sweep of names that wait for a worker without processes or a connection (Planner.sweep) as an
# event of its own (FSWEEP=1 on the command line; a test below): it changes every seed's draws, so it is off in
# the seeds the other tests pin.
FSWEEP = bool(os.environ.get("FSWEEP"))
FSWEEP_W = float(os.environ.get("FSWEEP_W", "0.05"))
STRICT_LANES = bool(os.environ.get("STRICT_LANES"))  # the end check compares the lanes of every run, not the last's


class Violation(Exception):
    pass

class Conn:
    n = 0
    def __init__(self, w):
        Conn.n += 1; self.id = Conn.n; self.w = w
        self.w2s, self.s2w = [], []
        self.worker_closed = self.server_closed = False

class LoopProxy:
    def __init__(self, sim): self.sim = sim
    def call_soon(self, cb, *a):
        self.sim.pending.append(cb)
    def time(self): return 0.0
    def create_future(self): return asyncio.get_running_loop().create_future()

class FakeOp:
    def __init__(self, daemon, key, local_round, members):
        self.daemon, self.key, self.round, self.members = daemon, key, local_round, members
        self.name = key
        self.sim = daemon.sim; self.w = daemon.worker_id
        self.unsettled = []  # (no link gives up here: every piece's fate is known)
    async def run(self):
        sim = self.sim; fs = sim.W[self.w]
        self.epoch = fs.wepoch
        self.fut = asyncio.get_running_loop().create_future()
        sim.log(f"w{self.w} op {self.key}#{self.round} (epoch {self.epoch}) {[(fr.name, e.req) for fr in self.members for e in fr.members()]}")
        try:
            base = await self.daemon.round_base(self.key, self.round)
        except asyncio.CancelledError:
            sim.log(f"w{self.w} op {self.key}#{self.round} cannot learn its round (job reset)")
            base = None
        if base is not None and self.epoch != fs.wepoch:
            sim.log(f"w{self.w} op {self.key}#{self.round} of epoch {self.epoch} learned base {base} in epoch {fs.wepoch}; "
                    f"gather fails (segments of its processes released), no abort (job not current)")
            base = None
        if base is None:
            ok = False
        else:
            self.server_round = self.round + base
            sim.log(f"w{self.w} PUSH {self.key} local {self.round} -> server round {self.server_round}")
            if sim.p.ended(self.key):  # as connection.on_push
                sim.log(f"  refused: its lanes ended"); self.fut.set_result(False)
            push = Push(req=0, name=self.key, part=0, round=self.server_round, worker=self.w, dtype="float32",
                        shape=[4], offset=0, count=4)
            if not self.fut.done(): sim.t_do(sim.table.push(push, np.zeros(4, np.float32), self, 0.0))
            ok = await self.fut
        self.ok = ok
        for fr in self.members:
            for e in fr.members():
                sim.answer(self.w, e.req, "ok" if ok else "opfail")
    def failed_steps(self):  # as FusedOperation's: failed (at the server) in the job still running
        return [fr.name for fr in self.members] if not self.ok and self.epoch == self.sim.W[self.w].wepoch else []

def raise_v(sim, text):
    sim.violations.append(text)
    raise Violation(text)

class Link:
    def __init__(self, sim, w):
        self.sim, self.w = sim, w
        self.up = False; self.conn = None; self.queue = []
        self.incarnation = "run-1"; self.epoch = "e1"; self.gave_up = False; self.peer = "server 0 at sim"
    def fuse(self, m):
        if self.up: self.conn.w2s.append(m)
        else: self.queue.append(m)
    def first_on_reconnect(self, m): self.queue.append(m)

class Session:
    def __init__(self, sim, w, rank=0):
        self.sim, self.w, self.local_rank = sim, w, rank
        self.pid = 100 * w + rank; self.step = 0; self.outstanding = set(); self.gone = False; self.epoch = 0
    def send(self, m):
        assert isinstance(m, Failure), m
        self.sim.answer(self.w, m.req, "fail:" + m.code)

class Sim:
    def __init__(self, seed, nsteps=8, p_break=0.06, p_giveup=0.3, p_failname=0.03, p_lose=0.5, mode="base"):
        self.mode = mode
        self.p_restart = 0.04 if mode == "restart" else 0.0
        self.p_reset = 0.03 if mode in ("reset", "resetonly") else 0.0
        self.p_leave = 0.03 if mode == "local2" else 0.0
        self.local = [2 if mode == "local2" else 1, 1]
        self.inc = 1; self.counts = Counter()
        self.rng = random.Random(seed); self.seed = seed
        self.nsteps = nsteps; self.p_break = p_break; self.p_giveup = p_giveup
        self.p_failname = p_failname; self.p_lose = p_lose
        self.trace = []; self.violations = []; self.artefacts = []
        self.pending = []
        self.table = srounds.RoundTable(2, connected=lambda w: w in self.links)
        self.srv_epoch = {}
        self.offsets = {}
        self.resets = 0; self.max_resets = 3
        self.p = Planner(2, run="run-1")
        self.links = {}  # server: worker -> conn
        self.plans_due = False
        self.steps = [self.rng.choice([["a"], ["b"], ["a", "b"], ["b", "a"]]) for _ in range(nsteps)]
        if mode in ("reset", "resetonly"):  # steps of one name set: a rejoined process may pair at any offset
            self.steps = [self.rng.choice([["a", "b"], ["b", "a"]]) for _ in range(nsteps)]
        self.W = []
        for w in range(2):
            self.W.append(self.make_worker(w))
        self.events = 0

    def log(self, s): self.trace.append(s)

    def make_worker(self, w):
        sim = self
        link = Link(self, w)
        async def abort_when_known(key, local_round, base, reason):
            try:
                offset = await base
            except asyncio.CancelledError:
                sim.log(f"w{w} abort data {key}#{local_round}: base query cancelled (reset)"); return
            if sim.p.ended(key):  # as connection.on_abort
                sim.log(f"w{w} abort data {key}#{local_round}: lanes ended, ignored"); return
            sim.log(f"w{w} abort data {key}#{local_round} -> server round {local_round + offset}")
            abort = Abort(key, 0, local_round + offset, w, **reason.carry())  # as the link sends it; the server:
            sim.t_do(sim.table.abort(key, 0, abort.round, w, srounds.Why.carried(abort, key)))
        numbers = types.SimpleNamespace(next=Counter(), total=Counter())
        def take(key):
            n = numbers.next[key]; numbers.next[key] += 1; numbers.total[key] += 1; return n
        numbers.take = take
        def nreset():
            numbers.next.clear()
        numbers.reset = nreset
        numbers.forget = lambda key: numbers.next.pop(key, None)  # (total: kept, for the end's comparison)
        unfused: Counter[str] = Counter()  # per name, the unfused round numbers its failed fused rounds took
        daemon = types.SimpleNamespace(
            sim=self,
            config=types.SimpleNamespace(local_size=self.local[w], worker_id=w, cluster=types.SimpleNamespace(timeout=10.0)),
            rank_offset=w, worker_id=w, links={0: link}, sessions={}, counters=WorkerCounters(),
            placement=types.SimpleNamespace(server_ids=[0], anchor=lambda n: 0,
                                            fused_key=fused_name),
            rounds=types.SimpleNamespace(numbers=numbers),
            spawn=lambda coro: asyncio.get_running_loop().create_task(coro),
            round_base=lambda key, r: sim.round_base(w, key, r), round_queries={}, run_tracked=lambda name, coro: coro,
            abort_when_known=abort_when_known, forget_sums=lambda keys: None,
            unfused_step=lambda name: unfused.update([name]))  # (the unfused rounds themselves are not simulated)
        fs = fd.FusedSums(daemon)
        fs.sim_w = w; fs.link = link; fs.numbers = numbers; fs.unfused = unfused
        fs.procs = [Session(self, w, r) for r in range(self.local[w])]
        fs.answered = Counter(); fs.reset_pending = False; fs.wepoch = 0; fs.round_queries = daemon.round_queries
        orig_plan = fs.plan
        def plan(sid, m):
            info = {n: (fs.rounds.reported[n].entries[0].req // 10 if n in fs.rounds.reported else None) for n in m.names}
            sim.log(f"w{w} plan {m.seq} {m.names} resent={m.resent!r} rounds={info}")
            orig_plan(sid, m)
        fs.plan = plan
        return fs

    def answer(self, w, req, how):
        fs = self.W[w]
        fs.answered[req] += 1
        self.log(f"w{w} answer req {req} {how}")
        if fs.answered[req] > 1: raise_v(self, f"w{w} req {req} answered twice")
        pr = fs.procs[(req // 1000) % 10]
        if (req // 10000) != pr.epoch or pr.gone:
            self.log(f"  (to a process gone: ignored)"); return
        if req not in pr.outstanding: raise_v(self, f"w{w} req {req} answered but not outstanding")
        pr.outstanding.discard(req)

    def round_base(self, w, key, local_round):
        known = asyncio.get_running_loop().create_future()  # a fused tensor's: 0 (as WorkerDaemon.round_base)
        known.set_result(0)
        return known

    def deliver(self, w, m):
        fs = self.W[w]
        if m.epoch != fs.link.epoch:
            self.log(f"w{w}<-S (epoch {m.epoch}, ours {fs.link.epoch}: dropped) {m!r:.100}")
        else:
            self.log(f"w{w}<-S {m!r:.120}")
        fs.on_message(0, m)

    def t_do(self, actions):
        for a in actions:
            if isinstance(a, srounds.Fail):
                self.log(f"  T fail w{a.push.worker} {a.push.name} r{a.push.round}: {a.why.text[:90]}")
                if not a.handle.fut.done(): a.handle.fut.set_result(False)
            elif isinstance(a, srounds.FailRound):
                self.log(f"  T round {a.key[0]} r{a.round} failed: {a.why.text[:90]}")
                self.t_do(a.fails)
            elif isinstance(a, srounds.Add):
                if self.table.added(a.token):
                    c = self.table.complete(a.token)
                    if c is not None:
                        self.complete(c.key, c.round, [wt.handle for wt in c.waiters])
            elif isinstance(a, (srounds.Answer, srounds.SumAll)):
                raise AssertionError(a)

    def complete(self, key, rnd, ops):
        ops = sorted(ops, key=lambda o: o.w)
        steps = []
        for o in ops:
            st = {e.req % 1000 // 10 for fr in o.members for e in fr.members()}
            if len(st) != 1:
                raise_v(self, f"one op of w{o.w} holds several steps: {[(e.req) for fr in o.members for e in fr.members()]}")
            steps.append(st.pop())
        names = [sorted(fr.name for fr in o.members) for o in ops]
        ep = (ops[0].epoch, ops[1].epoch)
        d = steps[0] - steps[1]
        self.log(f"DATA {key} server round {rnd} sum w0 {names[0]} step {steps[0]} (epoch {ep[0]}) + w1 {names[1]} step {steps[1]} (epoch {ep[1]})")
        if names[0] != names[1]:
            raise_v(self, f"data round {key}#{rnd} pairs names {names[0]} with {names[1]}")
        self.offsets.setdefault(ep, d)
        for n in names[0]:
            want = self.offsets.setdefault((ep, n), 0 if ep == (0, 0) else d)
            if d != want:
                raise_v(self, f"data round {key}#{rnd} pairs w0 step {steps[0]} with w1 step {steps[1]} of {n!r} (epochs {ep}; earlier offset {want})")
        for o in ops: o.fut.set_result(True)

    # ---- server side (as bps_server.connection / server.py) ----
    def s_send(self, w, m):
        conn = self.links.get(w)
        if conn is None: return
        if conn.worker_closed: self.log(f"  s->w{w} LOST {m!r:.90}"); return
        conn.s2w.append(m)

    def plan_msg(self, w, seq, names, resent="", lanes=None):  # as server.py and connection.py build it
        groups, group = self.p.groups(names)
        return FusePlan(seq, names, resent, groups, group, self.p.epoch(w), self.p.lanes if lanes is None else lanes)

    def lanes_ended(self, before):  # as server.lanes_ended, where a hello or a Reset ended lane generations
        if self.p.endings != before:
            self.log(f"S lanes ended, now {self.p.lanes}")
            self.t_do(self.table.fail_ended(self.p.ended, srounds.Why("lanes ended")))

    def fused(self, failures):
        for f in failures:
            self.s_send(f.worker, FuseFailed(f.name, epoch=self.p.epoch(f.worker), **f.why.carry()))
        for r in self.p.take_resends():
            self.log(f"S resend plan {r.seq} {r.names} to w{r.worker}")
            if r.worker in self.links:
                self.s_send(r.worker, self.plan_msg(r.worker, r.seq, r.names, r.how, r.lanes))
        if self.p.ready and not self.plans_due:
            self.plans_due = True

    def send_plans(self):
        self.plans_due = False
        for seq, names in self.p.take_plans():
            self.log(f"S plan {seq} {names} to {sorted(self.links)}")
            for w in list(self.links):
                self.s_send(w, self.plan_msg(w, seq, names))

    def fused_drop(self, w):
        self.fused(self.p.worker_gone(w, Why(f"worker {w} disconnected", "connection"), reset=False))

    def s_handle(self, w, conn, m):
        p = self.p
        self.log(f"S<-w{w} {m!r:.160}")
        if isinstance(m, FuseReady):
            self.fused(p.report(w, m.names, [F32] * len(m.names), m.counts, rounds=m.rounds))
        elif isinstance(m, FuseAbort):
            why = Why.carried(m).relayed(f"worker {w} gave the fused sum up")
            self.fused(p.abort(w, m.names, why, lambda n: set(), m.reported, rounds=m.rounds))
        elif isinstance(m, FuseResync):
            if m.incarnation != f"run-{self.inc}" or m.epoch != conn.epoch: return
            if m.next_plan >= 0:
                plans = p.sent_since(m.next_plan, w)
                if plans is None: raise_v(self, "plans no longer kept")
                for seq, names, lanes in plans or ():
                    self.s_send(w, self.plan_msg(w, seq, names, "lost", lanes))
            self.fused(p.resync(w, m.names, m.counts, Why("lost with the connection", "connection"), m.rounds))
        elif isinstance(m, FuseRunning):
            p.running(w, m.seq, m.names, m.counts, m.rounds, m.lanes)
            self.fused([])
        elif isinstance(m, FusePast):
            self.fused(p.past(w, m.names, m.rounds, m.counts))
        elif isinstance(m, Reset):
            self.t_do(self.table.worker_reset(m.worker, m.epoch))
            self.srv_epoch[w] = m.epoch
            before = p.endings
            self.fused(p.worker_gone(w, Why(f"every training process of worker {w} left", "round_failed"), reset=True,
                                     epoch=m.epoch))  # as connection.on_reset
            self.lanes_ended(before)
        else:
            raise AssertionError(m)

    # ---- events ----
    def connect(self, w, first=False):
        fs = self.W[w]; link = fs.link
        old = self.links.get(w)
        conn = Conn(w)
        self.links[w] = conn
        self.log(f"RECONNECT w{w} (conn {conn.id}; old {'open' if old and not old.server_closed else '-'})")
        if old is not None and not old.server_closed:
            old.server_closed = True
            if old.w2s: self.log(f"  lost at server close: {old.w2s!r:.160}")
            old.w2s = []
            self.fused_drop(w)
        before = self.p.endings
        self.p.worker_hello(w, link.epoch, f"d{w}")
        for a in self.table.worker_hello(w, link.epoch):
            self.log(f"  T {a}")
        self.lanes_ended(before)
        self.srv_epoch[w] = link.epoch
        conn.epoch = link.epoch
        cur = f"run-{self.inc}"
        restarted = link.incarnation != cur
        link.incarnation = cur
        link.up = True; link.conn = conn; link.gave_up = False
        conn.w2s += link.queue; link.queue = []
        if restarted: self.log(f"  w{w} sees a restarted server ({cur})")
        if not first:
            link.on_ready(restarted)

    def brk(self, w, crash=False):
        fs = self.W[w]; link = fs.link; conn = link.conn
        k = len(conn.s2w) - (self.rng.randint(0, len(conn.s2w)) if self.rng.random() < self.p_lose else 0)
        lost = conn.s2w[k:]; keep = conn.s2w[:k]
        conn.s2w = []
        self.log(f"BREAK w{w} conn {conn.id}: s->w delivered first {len(keep)}, lost {lost!r:.200}")
        for m in keep:
            self.deliver(w, m)
        k = len(conn.w2s) - (self.rng.randint(0, len(conn.w2s)) if self.rng.random() < self.p_lose else 0)
        if crash: k = 0
        if conn.w2s[k:]: self.log(f"  w->s lost {conn.w2s[k:]!r:.200}")
        conn.w2s = conn.w2s[:k]
        conn.worker_closed = True
        link.up = False; link.conn = None
        link.on_lost("broke")

    def crash(self):
        self.log(f"SERVER CRASH run-{self.inc} -> run-{self.inc + 1}")
        for w, conn in list(self.links.items()):
            conn.server_closed = True
            link = self.W[w].link
            if link.conn is conn:
                self.brk(w, crash=True)
            conn.w2s = []
        self.links = {}
        self.inc += 1
        self.p = Planner(2, run=f"run-{self.inc}")
        self.plans_due = False

    def proc_active(self, pr):
        return not pr.gone and pr.epoch == self.W[pr.w].wepoch

    def enabled(self, final=False):
        ev = []
        for w, fs in enumerate(self.W):
            link = fs.link
            for pr in fs.procs:
                if self.proc_active(pr) and pr.step < self.nsteps and not pr.outstanding:
                    ev.append(("submit", (w, pr.local_rank)))
                if self.p_leave and not final and self.proc_active(pr) and sum(self.proc_active(q) for q in fs.procs) > 1:
                    ev.append(("leave", (w, pr.local_rank)))
            if self.p_leave and any(pr.gone for pr in fs.procs) and any(
                    any(fs.procs[r].gone for r, e in enumerate(fr.entries) if e is None) for fr in fs.rounds.collecting.values()):
                ev.append(("overdue", w))
            if link.up and link.conn.s2w:
                ev.append(("s2w", w))
            if any(cb.__self__ is fs for cb in self.pending):
                ev.append(("reports", w))
            if not final and link.up:
                ev += [("break", w)] * 1
            if not link.up:
                ev.append(("reconnect", w))
                if not link.gave_up and not final:
                    ev.append(("giveup", w))
            if not final and (fs.rounds.collecting or fs.rounds.reported):
                ev.append(("failname", w))
        for w, conn in list(self.links.items()):
            if conn.w2s and not conn.server_closed:
                ev.append(("w2s", w))
            if conn.worker_closed and not conn.server_closed:
                ev.append(("notice", w))
        if self.plans_due:
            ev.append(("plans", None))
        if self.p_restart and not final:
            ev.append(("crash", None))
        if self.p_reset and any(st.busy and any(x not in self.links or x in self.table._reset for x in self.table.waiting_for(st))
                                for st in self.table.keys.values()):
            ev.append(("sweep", None))
        if FSWEEP and any(any(r not in w.workers and (r not in self.links or r in self.p.without_processes) for r in range(2))
                          for w in self.p.waiting.values()):
            ev.append(("fsweep", None))
        for w, fs in enumerate(self.W):
            if self.p_reset and not final and self.resets < self.max_resets and all(self.proc_active(pr) for pr in fs.procs):
                ev.append(("reset", w))
            if any(pr.epoch != fs.wepoch for pr in fs.procs):
                ev.append(("rejoin", w))
        return ev

    def weight(self, e):
        return {"break": self.p_break, "giveup": self.p_giveup * 0.3, "failname": self.p_failname,
                "crash": self.p_restart, "leave": self.p_leave, "reset": self.p_reset, "sweep": 0.05, "fsweep": FSWEEP_W}.get(e[0], 1.0)

    def do(self, e):
        kind, x = e
        self.events += 1
        if kind == "submit":
            w, r = x; fs = self.W[w]; pr = fs.procs[r]; k = pr.step; pr.step += 1
            entries = [(pr.epoch * 10000 + r * 1000 + k * 10 + i, n, F32, "seg", 0, 0) for i, n in enumerate(self.steps[k])]
            pr.outstanding = {q for q, *_ in entries}
            self.log(f"w{w}r{r} SUBMIT step {k} {self.steps[k]}")
            fs.submit(pr, entries)
        elif kind == "leave":
            w, r = x; fs = self.W[w]; pr = fs.procs[r]
            self.log(f"w{w}r{r} LEAVES at step {pr.step} (outstanding {sorted(pr.outstanding)})")
            pr.gone = True; pr.outstanding = set()
            fs.carry_out(fs.rounds.leave(r, pr.pid))
        elif kind == "overdue":
            fs = self.W[x]
            self.log(f"w{x} OVERDUE")
            fs.carry_out(fs.rounds.overdue([pr.local_rank for pr in fs.procs if not pr.gone], 1e9, 1.0))
        elif kind == "crash":
            self.crash()
        elif kind == "s2w":
            fs = self.W[x]; m = fs.link.conn.s2w.pop(0)
            self.deliver(x, m)
        elif kind == "reports":
            fs = self.W[x]
            cb = next(cb for cb in self.pending if cb.__self__ is fs)
            self.pending.remove(cb)
            self.log(f"w{x} send reports")
            cb()
        elif kind == "break":
            self.brk(x)
        elif kind == "reconnect":
            self.connect(x)
        elif kind == "giveup":
            self.log(f"GIVEUP w{x}")
            self.W[x].link.gave_up = True
            self.W[x].link.on_gave_up("gave up")
        elif kind == "failname":
            fs = self.W[x]
            names = sorted(set(fs.rounds.collecting) | set(fs.rounds.reported))
            n = self.rng.choice(names)
            self.log(f"w{x} FAILNAME {n}")
            fs.carry_out(fs.rounds.fail_name(n, Why("a process disagreed", "mismatch")))
        elif kind == "w2s":
            conn = self.links[x]; m = conn.w2s.pop(0)
            self.s_handle(x, conn, m)
        elif kind == "notice":
            conn = self.links[x]
            self.log(f"S notices drop of w{x} conn {conn.id}" + (f"; lost {conn.w2s!r:.150}" if conn.w2s else ""))
            conn.server_closed = True; conn.w2s = []
            del self.links[x]
            self.fused_drop(x)
        elif kind == "plans":
            self.send_plans()
        elif kind == "fsweep":
            self.log(f"S FSWEEP (planner sweep, without_processes={sorted(self.p.without_processes)} links={sorted(self.links)})")
            self.counts["fsweep"] += 1
            self.fused(self.p.sweep(1e9, set(self.links), 1.0))
        elif kind == "sweep":
            self.log(f"S SWEEP (lost_grace_s passed)")
            self.counts["sweep"] += 1
            self.t_do(self.table.sweep(1e9))
        elif kind == "reset":
            fs = self.W[x]; link = fs.link
            self.resets += 1
            self.log(f"RESET w{x}: every process leaves (steps {[pr.step for pr in fs.procs]}, outstanding {[sorted(pr.outstanding) for pr in fs.procs]})")
            for pr in fs.procs:  # session_lost of each, then _reset
                fs.carry_out(fs.rounds.leave(pr.local_rank, pr.pid))
            fs.wepoch += 1  # (before fs.reset: the answers it makes go to processes gone)
            fs.reset()
            for q in fs.round_queries.values(): q.cancel()
            fs.round_queries.clear()
            fs.numbers.reset()
            link.epoch = f"e{x}.{fs.wepoch}"
            m = Reset(x, link.epoch)
            link.queue = [q for q in link.queue if not isinstance(q, _FUSED_TOLD)]  # (ServerLink.reset)
            if link.up: link.conn.w2s.append(m)
            else: link.queue.append(m)
            self.log(f"  w{x} new epoch {link.epoch}; Reset {'sent' if link.up else 'queued'}")
        elif kind == "rejoin":
            fs = self.W[x]; peer = self.W[1 - x].procs[0]
            for pr in fs.procs:
                start = (peer.step - (1 if peer.outstanding else 0)) if self.proc_active(peer) else pr.step
                pr.epoch = fs.wepoch; pr.outstanding = set(); pr.step = start
                self.log(f"w{x}r{pr.local_rank} REJOIN at step {start} (peer at {peer.step}, outstanding {sorted(peer.outstanding)})")

    async def drain(self):
        for _ in range(6):
            await asyncio.sleep(0)

    async def run(self, max_events=3000):
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: self.violations.append('task error: %r' % (ctx.get('exception'),)) if not isinstance(ctx.get('exception'), Violation) else None)
        for w in range(2):
            self.connect(w, first=True)
        await self.drain()
        try:
            n = 0
            while n < max_events:
                done = all(pr.step >= self.nsteps or not self.proc_active(pr) for fs in self.W for pr in fs.procs)
                ev = self.enabled(final=done)
                if not ev: break
                ev = [e for e in ev if self.weight(e) > 0]
                if SWEEP_LAST and any(e[0] == "sweep" for e in ev) and any(e[0] not in ("sweep", "break", "giveup", "reset", "failname", "crash", "leave") for e in ev):
                    ev = [e for e in ev if e[0] != "sweep"]  # 30 s is long: only once nothing else moves
                if not ev: break
                ws = [self.weight(e) for e in ev]
                e = self.rng.choices(ev, ws)[0]
                self.do(e); n += 1
                await self.drain()
            else:
                raise_v(self, "no quiescence within max events")
            self.check()
            if self.artefacts and not self.violations:
                await self.exit_finished()
        except Violation:
            pass
        return self.violations

    def finished(self, w):
        """Every active process of worker ``w`` ran its last step and waits for nothing."""
        return all(q.step >= self.nsteps and not q.outstanding for q in self.W[w].procs if self.proc_active(q))

    def trails(self, ahead, name):
        """Whether worker ``ahead``'s rounds of ``name`` pair the peer's earlier steps since the last rejoin, so
        that the peer's last rounds of it pair none (a trailing round: it waits, or fails and is left for
        ``ahead`` in the planner, until ``ahead``'s processes issue it or leave, see the module docstring).
        Per name, as the workers pair them: a rejoined worker's rounds of each name are matched by order from
        where the peer's of that name were, and one step's messages of two names can come either side of a
        reset (448: the old processes' abort of 'a' before, their report of 'b' after). Unknown (no data
        round of the name since) counts as ahead; no reset yet: in step (0)."""
        ep = tuple(self.W[x].wepoch for x in range(2))
        d = self.offsets.get((ep, name), 0 if ep == (0, 0) else None)  # w0's step minus w1's, as complete()
        return d is None or (d > 0 if ahead == 0 else d < 0)

    def req_name(self, req):
        return self.steps[req % 1000 // 10][req % 10]

    def leftovers(self, trailing_ok):
        """Nothing is left in the workers, the planner or the round table (``trailing_ok``: but a trailing round
        that failed, left in the planner for a finished worker, see ``trails``)."""
        p = self.p
        for w, fs in enumerate(self.W):
            r = fs.rounds
            gone = {pr.local_rank for pr in fs.procs if pr.gone}
            for attr in ("collecting", "reported", "abandoned", "failed"):
                left = getattr(r, attr)
                if attr == "failed" and gone:  # rounds failed after a rank left wait for its successor (none here)
                    left = {n: [fr for fr in frs if not all(fr.entries[q] is not None or q in fr.excused or q in gone
                                                            for q in range(r.local_size))] for n, frs in left.items()}
                    left = {n: v for n, v in left.items() if v}
                if left: self.violations.append(f"w{w} rounds.{attr} left: {left}")
            if fs._reports: self.violations.append(f"w{w} held reports left")
            if any(fs._running.values()): self.violations.append(f"w{w} running left {fs._running}")
        if p.waiting: self.violations.append(f"planner waiting left {list(p.waiting)}")
        if p.ready: self.violations.append(f"planner ready left {p.ready}")
        def trailing(n, left): return trailing_ok and all(self.finished(x) and self.trails(x, n) for x in left)
        failed = {n: [r for r in rounds if not trailing(n, r[1])]  # (a trailing round that failed: left for a
                  for n, rounds in p.failed.items()}              # finished worker)
        if failed != p.failed: self.artefacts.append(f"ARTEFACT trailing rounds failed, left {p.failed}")
        failed = {n: rounds for n, rounds in failed.items() if rounds}
        if failed: self.violations.append(f"planner failed left {failed}")
        busy = [(k, st.round, sorted(st.waiters)) for k, st in self.table.keys.items() if st.waiters and st.failed is None]
        if busy: self.violations.append(f"data rounds left waiting {busy}")

    async def exit_finished(self):
        """The job's end as the real daemons see it: a machine whose processes ran their last step sees them exit,
        resets (``WorkerDaemon.session_lost``, ``_reset``) and tells the anchor (``Reset``), which fails what
        waited for them; then every message is delivered (no process starts a step: its job ended with an error,
        and a step after a peer's processes all left waits for their successors). A trailing round (``trails``)
        must end this way: an error, never a wait for ever."""
        exited = set()
        while (w := next((x for x in range(2) if x not in exited and self.finished(x)), None)) is not None:
            exited.add(w); self.counts["exits"] += 1
            self.do(("reset", w))  # (no rejoin: the job is over)
            await self.drain()
            for _ in range(1000):
                ev = [e for e in self.enabled(final=True) if e[0] not in ("rejoin", "submit")]
                if not ev: break
                self.do(self.rng.choice(ev))
                await self.drain()
            else:
                raise_v(self, "no quiescence after the processes exited")
        for w, fs in enumerate(self.W):
            for pr in fs.procs:
                if self.proc_active(pr) and pr.outstanding:
                    self.violations.append(f"w{w}r{pr.local_rank} step {pr.step-1} reqs {sorted(pr.outstanding)} wait "
                                           f"for ever (the peer's processes exited)")
        self.leftovers(trailing_ok=False)

    def check(self):
        p = self.p
        for w, fs in enumerate(self.W):
            for pr in fs.procs:
                if not self.proc_active(pr): continue
                if (pr.outstanding and self.finished(1 - w)
                        and all(self.trails(1 - w, self.req_name(q)) for q in pr.outstanding)):
                    self.artefacts.append(f"ARTEFACT w{w}r{pr.local_rank} last step {pr.step-1} waits: peer finished "
                                          f"(rejoin offsets {self.offsets})")
                    continue
                if (not pr.outstanding and pr.step < self.nsteps and self.artefacts): continue
                if pr.outstanding: self.violations.append(f"w{w}r{pr.local_rank} step {pr.step-1} reqs {sorted(pr.outstanding)} wait for ever")
                if pr.step < self.nsteps: self.violations.append(f"w{w}r{pr.local_rank} stuck at step {pr.step}")
        if self.artefacts: return  # what the trailing step left: checked once the finished processes exit
        self.leftovers(trailing_ok=True)
        if not self.p_reset:
            # The lanes of the anchor's current run: no later plan uses a previous run's (nothing runs now,
            # so none is told in FuseRunning), whose numbers may differ where a plan given up in full was lost
            # in a crash (see the module docstring). STRICT_LANES=1: every run's.
            run = f"run-{self.inc}"
            def live(numbers): return Counter({k: v for k, v in numbers.items() if STRICT_LANES or fused_lanes(k).rpartition(".")[0] == run})
            n0, n1 = (+live(self.W[0].numbers.total), +live(self.W[1].numbers.total))
            if n0 != n1: self.violations.append(f"lane numbers differ {dict(n0)} vs {dict(n1)}")
            u0, u1 = self.W[0].unfused, self.W[1].unfused
            if +u0 != +u1: self.violations.append(f"unfused round numbers taken differ {dict(u0)} vs {dict(u1)}")

def run_seed(seed: int, patch: Any, mode: str = "base") -> Sim:
    """One seed's run; ``patch(module, name, value)`` swaps the driver's loop and operations for fakes."""
    params = dict(PARAMS[seed % len(PARAMS)])
    if mode == "resetonly":
        params.update(p_break=0.0, p_giveup=0.0, p_failname=0.0)
    sim = Sim(seed, mode=mode, **params)
    proxy = LoopProxy(sim)
    patch(fd, "asyncio", types.SimpleNamespace(get_running_loop=lambda: proxy, wait=asyncio.wait))
    patch(fd, "FusedOperation", FakeOp)
    asyncio.run(sim.run())
    return sim


@pytest.mark.parametrize("mode", ["base", "local2"])
def test_random_breaks_losses_and_give_ups_never_pair_two_steps_nor_hang(monkeypatch: pytest.MonkeyPatch,
                                                                         mode: str):
    events = 0
    for seed in range(250):
        sim = run_seed(seed, monkeypatch.setattr, mode)
        events += sim.events
        assert not sim.violations, f"seed {seed}: {sim.violations}\n" + "\n".join(sim.trace[-60:])
    assert events > 10_000, events  # the runs did happen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [43, 421, 501, 606, 691, 729])
def test_after_resets_a_trailing_round_fails_when_the_finished_processes_exit(monkeypatch: pytest.MonkeyPatch,
                                                                              seed: int):
    """Reset mode: 43, 421 and 501 end with a trailing round failed and left for the finished worker, 606, 691
    and 729 with one waiting in a name a step off while the other name is in step (seeds 0-399, and 729). (448
    did too until the planner forgot a job's failures once every worker's processes were gone: both workers
    reset at once there, and the old job's failure no longer waits for the new processes.)"""
    sim = run_seed(seed, monkeypatch.setattr, "reset")
    assert not sim.violations, f"seed {seed}: {sim.violations}\n" + "\n".join(sim.trace[-60:])
    assert sim.artefacts and sim.counts["exits"], "the finished processes never exited"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["reset", "resetonly", "base"])
def test_the_planners_sweep_keeps_every_step_paired(monkeypatch: pytest.MonkeyPatch, mode: str):
    """Planner.sweep fails names that wait for a worker without processes (or not connected) at random moments:
    no violation (steps paired, lanes in step, nothing left waiting) in 120 seeds of each mode."""
    monkeypatch.setattr(sys.modules[__name__], "FSWEEP", True)
    monkeypatch.setattr(sys.modules[__name__], "FSWEEP_W", 5.0)  # (a sweep wherever one can fail a name)
    failing = {}
    for seed in range(120):
        sim = run_seed(seed, monkeypatch.setattr, mode)
        if sim.violations:
            failing[seed] = sim.violations[0]
    assert not failing, failing


if __name__ == "__main__":
    import logging; logging.disable(logging.WARNING)
    mode, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    failing = {}; events = Counter()
    with pytest.MonkeyPatch.context() as mp:
        for s in range(first, last):
            sim = run_seed(s, mp.setattr, mode)
            events["all"] += sim.events
            for line in sim.trace:
                for tag in ("FSWEEP", "SWEEP", "SERVER CRASH", "LEAVES", "RESET", "REJOIN", "OVERDUE", "resend plan", "restarted server"):
                    if tag in line: events[tag] += 1
            if sim.artefacts and not sim.violations: events["seeds with trailing artefact only"] += 1
            if sim.violations:
                failing[s] = sim.violations[0]
            if len(sys.argv) > 4 and s == first:
                print("\n".join(sim.trace)); print(sim.violations)
    print(f"{mode}: {last - first} seeds, {len(failing)} failing; events {dict(events)}")
    import re
    def klass(t): return re.sub(r"\d+|\[.*|\{.*|\(.*", "#", t)[:60]
    cls = Counter(klass(t) for t in failing.values())
    for c, n in cls.most_common():
        ex = [s for s, t in failing.items() if klass(t) == c][:3]
        print(f"  class {n:4d}  {c}  e.g. seeds {ex}")
    for s, text in list(failing.items())[:20]:
        print(s, text)
