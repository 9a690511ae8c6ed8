"""The worker daemon's fused-sum driver (``bps_worker.fused_driver.FusedSums``) and the anchor's ``Planner``
across broken connections: the real classes, a fake daemon and link (no sockets), the server's side played by
hand as ``bps_server.connection`` plays it."""

from __future__ import annotations

import asyncio
import types
from collections import Counter
from typing import Any

import numpy as np
import pytest

import bps_worker.fused_driver as fd
from bps_worker.daemon import WorkerCounters
from bps_server.fusion import Planner
from bps_server.rounds import Add, Fail, FailRound, RoundTable
from bps_server.rounds import Why as RoundWhy
from bps_worker.fused_driver import FusedSums
from bps_worker.fused_operation import FusedOperation, layout_digest
from bps_worker.fusion import Entry, FusedRound
from protocol.messages import (Failure, FuseAbort, FuseFailed, FusePast, FusePlan, FuseReady, FuseResync, FuseRunning,
                               Push, Spec, Why, fused_name)

F32: Spec = ("float32", (4,), False, "")
DROP = Why("worker 0 disconnected", "connection")
LOST_LANE = fused_name(0, 0, "float32", False, ".0")  # lane 0 of a test planner's first lane generation


class Numbers:
    """The daemon's round numbers per key (``LocalRounds.numbers``), with a log of what was taken."""

    def __init__(self) -> None:
        self.next: Counter[str] = Counter()
        self.taken: list[tuple[str, int]] = []

    def take(self, key: str) -> int:
        n = self.next[key]
        self.next[key] += 1
        self.taken.append((key, n))
        return n

    def forget(self, key: str) -> None:
        del self.next[key]


class Link:
    """What the driver sees of ``ServerLink``: messages go on the wire when up, else wait in its queue; a
    break calls ``on_lost``, a reconnect sends the queue and then calls ``on_ready`` (as ``_open`` does)."""

    def __init__(self) -> None:
        self.up = True
        self.queue: list[Any] = []
        self.wire: list[Any] = []
        self.incarnation = "run-1"
        self.epoch = "e1"
        self.peer = "server 0 at 127.0.0.1:9100"

    def fuse(self, message: Any) -> None:
        (self.wire if self.up else self.queue).append(message)

    def first_on_reconnect(self, message: Any) -> None:
        self.queue.append(message)

    def drop(self) -> None:
        self.up = False
        self.on_lost("broke")

    def reconnect(self, incarnation: str = "run-1") -> None:
        restarted, self.incarnation = incarnation != self.incarnation, incarnation
        self.up = True
        self.wire += self.queue
        self.queue = []
        self.on_ready(restarted)


class Session:
    local_rank = 0

    def __init__(self) -> None:
        self.got: list[Any] = []

    def send(self, message: Any) -> None:
        self.got.append(message)


def worker(wid: int, local_size: int = 1) -> Any:
    link, numbers, aborted, forgotten, steps = Link(), Numbers(), [], [], []

    def spawn(coro: Any) -> asyncio.Future[Any]:
        coro.close()  # a fused operation: not run here
        return asyncio.get_running_loop().create_future()

    async def abort_when_known(key: str, local_round: int, base: Any, reason: str) -> None:
        aborted.append((key, local_round))

    daemon = types.SimpleNamespace(
        config=types.SimpleNamespace(local_size=local_size, worker_id=wid, cluster=types.SimpleNamespace(timeout=10.0)),
        rank_offset=wid, worker_id=wid, links={0: link}, sessions={}, counters=WorkerCounters(),
        placement=types.SimpleNamespace(server_ids=[0], anchor=lambda n: 0,
                                        fused_key=lambda sid, lane, dtype, avg, lanes: fused_name(sid, lane, dtype, avg, lanes)
                                        if lanes else f"fused/{sid}/{lane}/{dtype}"),
        rounds=types.SimpleNamespace(numbers=numbers), spawn=spawn, round_base=lambda key, r: 0,
        abort_when_known=lambda *args: (aborted.append(args[:2]), asyncio.sleep(0))[1],
        forget_sums=lambda keys: forgotten.extend(keys), unfused_step=lambda name: steps.append(name))
    fs = FusedSums(daemon)  # type: ignore[arg-type]
    fs.session, fs.link, fs.numbers, fs.aborted, fs.forgotten = Session(), link, numbers, aborted, forgotten
    fs.steps = steps  # the names whose failed fused round took an unfused round number
    return fs


async def submit(fs: Any, name: str, req: int) -> None:
    fs.submit(fs.session, [(req, name, F32, "seg", 0, 0)])
    await asyncio.sleep(0)  # the reports go at the end of the pass


def deliver(p: Planner, w: int, fs: Any, epoch: str = "e1", run: str = "run-1") -> list[Any]:
    """The server reads what worker ``w`` wrote, as ``ServerConnection``'s handlers do; the lost plans it
    sends again (``on_fuse_resync``) are handed to the worker."""
    out: list[Any] = []
    messages, fs.link.wire = fs.link.wire, []
    for m in messages:
        if isinstance(m, FuseReady):
            out += p.report(w, m.names, [F32] * len(m.names), m.counts, rounds=m.rounds)
        elif isinstance(m, FuseAbort):
            why = Why.carried(m).relayed(f"worker {w} gave the fused sum up")
            out += p.abort(w, m.names, why, reported=m.reported, rounds=m.rounds)
        elif isinstance(m, FuseRunning):
            p.running(w, m.seq, m.names, m.counts, m.rounds, m.lanes)
        elif isinstance(m, FuseResync) and m.incarnation == run and m.epoch == epoch:
            for seq, names, lanes in p.sent_since(m.next_plan, w) or [] if m.next_plan >= 0 else []:
                groups, group = p.groups(names)
                fs.on_message(0, FusePlan(seq, names, "lost", groups, group, epoch, lanes))
            out += p.resync(w, m.names, m.counts, Why("lost with the connection", "connection"), m.rounds)
        elif isinstance(m, FusePast):
            out += p.past(w, m.names, m.rounds, m.counts)
    return out


def drop_and_reconnect(p: Planner, fs: Any, epoch: str = "e1") -> list[Any]:
    fs.link.drop()
    p.worker_gone(0, DROP, reset=False)
    fs.link.reconnect()
    return deliver(p, 0, fs, epoch)


async def test_a_plan_sent_again_is_numbered_once_however_many_times_the_connection_breaks():
    p, w0 = Planner(2), worker(0)
    await submit(w0, "a", 1)
    deliver(p, 0, w0)
    p.report(1, ["a"], [F32])
    assert p.take_plans() == [(0, ["a"])]  # written to worker 0, lost with its connection
    drop_and_reconnect(p, w0)
    assert w0.numbers.taken == [(LOST_LANE, 0)] and w0.aborted == [(LOST_LANE, 0)]
    await submit(w0, "a", 2)  # round 2 reported; then a second break, before any new plan
    deliver(p, 0, w0)
    drop_and_reconnect(p, w0)
    assert w0.numbers.taken == [(LOST_LANE, 0)] and w0.rounds.counts["a"] == 1  # as the peer


async def test_a_resync_queued_before_the_processes_left_is_void():
    """Every process of worker 0 leaves while its link is down: its counts are of processes gone. Read after
    the new epoch's hello, they must not fail rounds of the peers, now or at the next break."""
    p, w0 = Planner(2), worker(0)
    p.worker_hello(0, "e1")
    for step in range(3):
        await submit(w0, "a", step)
        deliver(p, 0, w0)
        p.report(1, ["a"], [F32])
        for seq, names in p.take_plans():  # run, as plan() runs them (no operations here)
            w0._next_plan[0] = seq + 1
            w0.rounds.planned(names)
    w0.link.drop()
    p.worker_gone(0, DROP, reset=False)
    w0.reset()
    w0.link.epoch = "e2"  # daemon._new_epoch
    p.worker_hello(0, "e2")
    w0.link.reconnect()
    assert deliver(p, 0, w0, epoch="e2") == [] and not p.failed
    assert w0.rounds.told == {} and p.heard["a"] == [0, 3]
    drop_and_reconnect(p, w0, epoch="e2")
    assert not p.failed and p.report(1, ["a"], [F32]) == []


async def test_a_report_held_when_the_link_gives_up_is_told_as_given_up_when_it_is_back():
    p, w0 = Planner(2), worker(0)
    w0._running[0] = 1  # a fused operation with server 0 runs: reports wait
    p.report(1, ["a"], [F32])  # the peer's step 1
    await submit(w0, "a", 1)
    assert not w0.rounds.reported["a"].sent
    w0.link.drop()
    w0.link.on_gave_up("gave up")
    assert [m.code for m in w0.session.got] == ["connection"]  # step 1 failed here
    p.worker_gone(0, DROP, reset=False)
    w0._running[0] = 0
    w0.link.reconnect()
    deliver(p, 0, w0)  # the abort of step 1: the peer's step 1 failure is worker 0's too
    assert not p.failed
    await submit(w0, "a", 2)
    assert deliver(p, 0, w0) == []
    p.report(1, ["a"], [F32])
    assert p.take_plans() == [(0, ["a"])]  # step 2 with step 2


async def test_a_lost_plan_of_a_round_given_up_after_its_report_takes_its_number_as_the_peers_did():
    p, w0 = Planner(2), worker(0)
    await submit(w0, "a", 1)
    deliver(p, 0, w0)
    p.report(1, ["a"], [F32])
    assert p.take_plans() == [(0, ["a"])]  # lost with the connection
    w0.carry_out(w0.rounds.fail_name("a", Why("a process disagreed", "mismatch")))  # abandoned here
    drop_and_reconnect(p, w0)
    assert w0.numbers.taken == [(LOST_LANE, 0)] and w0.aborted == [(LOST_LANE, 0)]
    assert not w0.rounds.abandoned


async def test_a_report_written_while_the_link_was_down_goes_once_to_a_restarted_server():
    p, w0 = Planner(2), worker(0)  # p: the server's new run
    p.report(1, ["a"], [F32])
    w0.link.drop()
    await submit(w0, "a", 1)  # queued
    w0.link.reconnect("run-2")
    reports = [m for m in w0.link.wire if isinstance(m, FuseReady)]
    assert [m.names for m in reports] == [["a"]]
    for m in reports:
        p.report(0, m.names, [F32], m.counts)
    assert p.take_plans() == [(0, ["a"])] and not p.waiting


async def test_a_report_queued_in_the_link_when_it_gives_up_is_given_up_behind_it():
    """Found by a randomized run of this harness: the report went into the link's queue (the link was down),
    the link gave up and the round failed here; the link kept the report and sent it when it came back. With
    no abort behind it, the planner paired it with the peer's step, and this worker's next step with the
    peer's next: every sum one step apart from then on."""
    p, w0 = Planner(2), worker(0)
    w0.link.drop()
    p.worker_gone(0, DROP, reset=False)
    await submit(w0, "b", 0)  # reported while down: in the link's queue
    assert [type(m).__name__ for m in w0.link.queue] == ["FuseReady"]
    w0.link.on_gave_up("gave up")
    assert [m.code for m in w0.session.got] == ["connection"]
    w0.link.reconnect()
    for f in deliver(p, 0, w0):  # the report, then its abort: step 0 fails for the peer too
        assert f.worker == 0  # the answer to the report (nobody else reported it yet)
        w0.carry_out(w0.rounds.failed_at_anchor(f.name, f.why))
    assert [(f.worker, f.name) for f in p.report(1, ["b"], [F32])] == [(1, "b")]
    await submit(w0, "b", 1)
    deliver(p, 0, w0)
    assert p.report(1, ["b"], [F32]) == [] and p.take_plans() == [(0, ["b"])]  # step 1 with step 1
    assert not w0.rounds.abandoned and not p.failed


async def test_an_answer_to_the_processes_before_a_reset_does_not_touch_their_successors_rounds():
    """Every process of worker 0 left (a reset, a new epoch) and the new ones reported "a" again before the
    server's plan and failure of the old round came: both carry the old epoch, and are dropped. Before they
    carried it, the plan ran the new processes' round with the peers' old one, and took a lane number the
    peers' numbering of the new epoch did not have."""
    p, w0 = Planner(2), worker(0)
    p.worker_hello(0, "e1")
    await submit(w0, "a", 1)
    deliver(p, 0, w0)
    p.report(1, ["a"], [F32])
    ((seq, names),) = p.take_plans()
    groups, group = p.groups(names)
    plan = FusePlan(seq, names, groups=groups, group=group, epoch=p.epoch(0))  # on its way to worker 0
    w0.reset()  # the old round fails here (its process hears, if it is still there)
    w0.link.epoch = "e2"  # daemon._new_epoch
    w0.session.got.clear()
    await submit(w0, "a", 2)  # the new processes' round
    w0.on_message(0, plan)
    w0.on_message(0, FuseFailed("a", "worker 1 gave up", epoch="e1"))
    assert w0.numbers.taken == [] and "a" in w0.rounds.reported and w0.rounds.reported["a"].why is None
    assert w0._next_plan[0] == seq + 1 and w0.rounds.counts["a"] == 1  # got (and counted), as the peer did
    w0.on_message(0, FuseFailed("a", "worker 1 gave up", epoch="e2"))  # one of the new epoch is theirs
    assert "a" not in w0.rounds.reported and [m.code for m in w0.session.got] == ["round_failed"]


async def test_a_plan_of_a_tensor_this_worker_does_not_have_is_numbered_and_given_up_as_the_plan_groups_it():
    """A plan can name a tensor whose round this worker no longer has (failed and forgotten here): the plan says
    its group, so the worker numbers that group's lane round as the peers do, and gives it up there. Without
    the groups it was skipped: no number, no abort, the peers' round waited and the lane numbers drifted."""
    w0 = worker(0)
    w0.link.epoch = ""
    w0.on_message(0, FusePlan(3, ["x", "y"], groups=[["float16", False], ["float32", True]], group=[1, 0]))
    assert w0.numbers.taken == [("fused/0/3/float32", 0), ("fused/0/3/float16", 0)]
    await asyncio.sleep(0)
    assert sorted(w0.aborted) == [("fused/0/3/float16", 0), ("fused/0/3/float32", 0)]
    w0.on_message(0, FusePlan(11, ["z"]))  # a plan that does not say its groups: as before, skipped
    assert len(w0.numbers.taken) == 2


def answer(fs: Any, failures: list[Any], w: int) -> None:
    """The planner's failures for worker ``w``, delivered to it (as ``FuseFailed``)."""
    for f in failures:
        if f.worker == w:
            fs.carry_out(fs.rounds.failed_at_anchor(f.name, f.why))


async def test_a_mismatch_among_one_machines_processes_reaches_the_other_machine_as_a_mismatch_of_its_own_side():
    """Worker 1 reported "a"; worker 0's two processes disagree about it (float32[4] against float32[5]). Worker 0's
    FuseAbort carries the mismatch whole, the anchor fails worker 1's report with it (FuseFailed), and worker 1's
    process hears a mismatch naming the tensor with its own as ``ours`` (it heard a round_failed, the mismatch
    only in words), and who disagreed."""
    q, w0, w1 = Planner(2), worker(0, local_size=2), worker(1)
    await submit(w1, "a", 0)
    assert deliver(q, 1, w1) == []  # waits for worker 0
    rank1 = Session()
    rank1.local_rank = 1
    w0.submit(w0.session, [(0, "a", F32, "seg", 0, 0)])
    w0.submit(rank1, [(0, "a", ("float32", (5,), False, ""), "seg", 0, 0)])
    assert [(m.ours, m.theirs) for m in w0.session.got + rank1.got] == [("float32[4]", "float32[5]"),
                                                                        ("float32[5]", "float32[4]")]
    for f in deliver(q, 0, w0):  # as the server tells each worker (bps_server.server.fused), in its epoch
        w1.on_message(0, FuseFailed(f.name, epoch="e1", **f.why.carry()))
    (failure,) = w1.session.got
    assert (failure.code, failure.name, failure.ours, failure.theirs) == ("mismatch", "a", "float32[4]", "float32[5]")
    assert failure.detail == "worker 0 gave the fused sum up: rank 0 has float32[4] but rank 1 has float32[5]"


async def test_a_round_that_failed_before_a_restart_is_not_summed_with_the_peers_next_one():
    """The server's old run failed worker 0's step 0 of "a" (worker 1 gave it up) and died before its
    FuseFailed reached worker 0, which reports step 0 again to the new run; worker 1 reports its step 1.
    Matched by order, the new run summed step 0 with step 1. The rounds' indexes tell the stale one."""
    q, w0, w1 = Planner(2), worker(0), worker(1)  # q: the server's new run
    await submit(w0, "a", 0)
    w0.link.wire.clear()  # reported to the old run
    await submit(w1, "a", 0)
    w1.carry_out(w1.rounds.fail_name("a", Why("a process disagreed", "mismatch")))  # (to the old run)
    w1.link.wire.clear()
    assert [m.code for m in w1.session.got] == ["mismatch"]
    w0.link.drop()
    w0.link.reconnect("run-2")
    assert [m.rounds for m in w0.link.wire if isinstance(m, FuseReady)] == [[0]]
    assert deliver(q, 0, w0, run="run-2") == []  # step 0 waits
    await submit(w1, "a", 1)
    failures = deliver(q, 1, w1, run="run-2")
    assert [(f.worker, f.name) for f in failures] == [(0, "a")] and q.take_plans() == []
    answer(w0, failures, 0)
    assert [m.code for m in w0.session.got] == ["round_failed"]  # step 0 fails, with why
    await submit(w0, "a", 1)
    assert deliver(q, 0, w0, run="run-2") == [] and q.take_plans() == [(0, ["a"])]  # step 1 with step 1
    assert w0.rounds.reported["a"].entries[0].req == 1 and w1.rounds.reported["a"].entries[0].req == 1


async def test_a_report_the_new_run_never_heard_of_given_up_fails_the_peers_round_of_that_step():
    """Worker 0 reported step 0 to the old run and gave it up while the link was down (FuseAbort, reported):
    the new run never heard the report. Worker 1's step 0 must fail, not wait for worker 0's step 1."""
    q, w0, w1 = Planner(2), worker(0), worker(1)
    await submit(w0, "a", 0)
    w0.link.wire.clear()  # reported to the old run
    w0.link.drop()
    w0.carry_out(w0.rounds.fail_name("a", Why("a process disagreed", "mismatch")))  # queued
    w0.link.reconnect("run-2")
    await submit(w1, "a", 0)
    assert deliver(q, 1, w1, run="run-2") == []
    failures = deliver(q, 0, w0, run="run-2")
    assert [(f.worker, f.name) for f in failures] == [(1, "a")] and not q.waiting and not q.failed
    answer(w1, failures, 1)
    assert [m.code for m in w1.session.got] == ["mismatch"]  # worker 0's why, whole
    await submit(w0, "a", 1)
    await submit(w1, "a", 1)
    deliver(q, 0, w0, run="run-2")
    deliver(q, 1, w1, run="run-2")
    assert q.take_plans() == [(0, ["a"])] and w1.rounds.reported["a"].entries[0].req == 1


async def test_a_plan_of_the_old_run_whose_round_failed_here_since_is_given_up_as_the_peers_number_it():
    """Worker 0 still runs plan 0 of the old run (step 0 of "a"); worker 1 lost it with the crash and has
    failed that step since: its report of step 1 is one plan behind, but not the plan's round. It gets the
    plan as "restart_lost": it numbers its lane round and gives it up; step 1 waits for worker 0's."""
    q, w1 = Planner(2), worker(1)
    await submit(w1, "a", 0)
    w1.carry_out(w1.rounds.fail_name("a", Why("a process disagreed", "mismatch")))
    w1.link.wire.clear()  # (to the old run)
    await submit(w1, "a", 1)
    q.running(0, 0, ["a"], [1], [0])
    assert deliver(q, 1, w1, run="run-2") == []
    (resend,) = q.take_resends()
    assert (resend.worker, resend.seq, resend.how) == (1, 0, "restart_lost")
    groups, group = q.groups(resend.names)
    w1.on_message(0, FusePlan(0, resend.names, resend.how, groups, group, "e1"))
    await asyncio.sleep(0)
    assert w1.numbers.taken == [("fused/0/0/float32", 0)] and w1.aborted == [("fused/0/0/float32", 0)]
    assert w1.rounds.reported["a"].entries[0].req == 1 and q.waiting["a"].workers == {1}


async def test_new_processes_after_a_reset_say_no_round_index():
    w0 = worker(0)
    await submit(w0, "a", 0)
    assert [m.rounds for m in w0.link.wire] == [[0]]
    w0.reset()
    w0.link.wire.clear()
    await submit(w0, "a", 1)
    assert [m.rounds for m in w0.link.wire] == [[]]  # matched by order (their count is not the peers')


async def test_a_restarted_server_hears_which_rounds_each_name_is_past():
    """After the plans of the old run still running here (FuseRunning), the new run hears of each name the
    index of its open round, or of its next one (FusePast), then the reports again."""
    w0 = worker(0)
    await submit(w0, "a", 0)
    w0.carry_out(w0.rounds.fail_name("a", Why("a process disagreed", "mismatch")))  # round 0 closed
    await submit(w0, "b", 1)  # round 0 of b, reported
    w0.link.wire.clear()
    w0.link.drop()
    w0.link.reconnect("run-2")
    past = [m for m in w0.link.wire if isinstance(m, FusePast)]
    assert [(m.names, m.rounds) for m in past] == [(["a", "b"], [1, 0])]
    kinds = [type(m).__name__ for m in w0.link.wire if not isinstance(m, FuseResync)]
    assert kinds == ["FusePast", "FuseReady"]


async def test_a_resync_says_the_index_of_the_last_round_told():
    w0 = worker(0)
    await submit(w0, "a", 0)
    w0.link.drop()
    (resync,) = [m for m in w0.link.queue if isinstance(m, FuseResync)]
    assert (resync.names, resync.counts, resync.rounds) == (["a"], [1], [0])


class LaneOp:
    """A plan group's fused operation (``FusedOperation``, faked): it pushes when the test says, with the real
    one's layout, and ends with its round."""

    def __init__(self, worker: int, plan: int, key: str, local_round: int, names: list[str]) -> None:
        self.w, self.plan, self.name, self.round, self.names = worker, plan, key, local_round, names
        self.layout = layout_digest(names)
        self.done = asyncio.get_running_loop().create_future()
        self.failed = False
        self.unsettled: list = []  # (no link gives up here: every piece's fate is known)

    async def run(self) -> None:
        await self.done

    def end(self, failed: bool = False) -> None:
        """Its round was summed, or failed (a push refused, the round failed at the anchor)."""
        self.failed = failed
        self.done.set_result(None)

    def failed_steps(self) -> list[str]:
        """As ``FusedOperation.failed_steps``: a round failed at the anchor fails for every worker that ran the
        plan, and each name's step takes an unfused round number."""
        return list(self.names) if self.failed else []


class LaneRounds:
    """The anchor's round table, which the lanes' fused operations push to; the operations the plans start."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.table: RoundTable[LaneOp] = RoundTable(2)
        self.ops: list[LaneOp] = []
        self.plan = 0  # the plan being handed out
        self.summed: list[set[int]] = []  # each completed round: the plans its pushes were of
        self.failed: list[str] = []  # each failed round: why (its code), or "ended" for a push refused so

    def operation(self, daemon: Any, key: str, local_round: int, members: list[Any]) -> LaneOp:
        """What ``FusedSums.plan`` starts (patched in for ``FusedOperation``)."""
        op = LaneOp(daemon.worker_id, self.plan, key, local_round, [fr.name for fr in members])
        self.ops.append(op)
        return op

    def push(self, op: LaneOp) -> None:
        """``op``'s push, as the worker makes it (a fused tensor's server round is its local one, see
        ``WorkerDaemon.round_base``) and the anchor takes it (one of lanes a reset ended is refused, see
        ``ServerConnection.on_push``)."""
        if self.planner.ended(op.name):
            self.failed.append("ended")
            op.end(failed=True)
            return
        p = Push(req=0, name=op.name, part=0, round=op.round, worker=op.w, dtype="float32", shape=[4], offset=0,
                 count=4, layout=op.layout)
        self.carry(self.table.push(p, np.zeros(4, np.float32), op, 0.0))

    def reset(self, w: int, epoch: str) -> None:
        """The anchor handles worker ``w``'s Reset, as ``ServerConnection.on_reset`` does."""
        self.carry(self.table.worker_reset(w, epoch))
        endings = self.planner.endings
        self.planner.worker_gone(w, Why(f"every training process of worker {w} left", "round_failed"), reset=True,
                                 epoch=epoch)
        if self.planner.endings != endings:
            self.carry(self.table.fail_ended(self.planner.ended, RoundWhy("lanes ended")))

    def carry(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Add) and self.table.added(a.token):
                done = self.table.complete(a.token)
                assert done is not None
                self.summed.append({wt.handle.plan for wt in done.waiters})
                for wt in done.waiters:
                    wt.handle.end()
            elif isinstance(a, FailRound):
                self.failed.append(a.why.code)
                for f in a.fails:
                    f.handle.end(failed=True)
            elif isinstance(a, Fail):  # a push refused by the table (a stale round): its operation fails
                self.failed.append("refused")
                a.handle.end(failed=True)

    def hand_out(self, workers: list[Any], seq: int, names: list[str], epochs: tuple[str, str], lanes: str) -> None:
        """Plan ``seq`` reaches the workers, stamped with the epoch the anchor knew each by as it sent it, on the
        lane generation it was made in."""
        self.plan = seq
        for fs, epoch in zip(workers, epochs):
            fs.on_message(0, FusePlan(seq, names, "", [["float32", False]], [0] * len(names), epoch, lanes))


def lane_workers(monkeypatch: pytest.MonkeyPatch) -> tuple[LaneRounds, Planner, list[Any]]:
    """Two workers whose plans run on one lane (a plan's next one on it is the next plan, seq + LANES), their
    anchor's planner and round table."""
    monkeypatch.setattr(fd, "LANES", 1)
    planner, workers = Planner(2), [worker(0), worker(1)]
    lanes = LaneRounds(planner)
    monkeypatch.setattr(fd, "FusedOperation", lanes.operation)
    for w, fs in enumerate(workers):
        fs.daemon.spawn = lambda coro: asyncio.get_running_loop().create_task(coro)
        fs.daemon.run_tracked = lambda name, coro: coro
        planner.worker_hello(w, "e1", f"d{w}")
        lanes.table.worker_hello(w, "e1")
    return lanes, planner, workers


@pytest.mark.parametrize("how", ["lost", "abandoned"])
async def test_a_plan_group_given_up_by_one_worker_takes_one_unfused_number_a_name_on_every_worker(
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """fault_soak seed 311 (a hang). Plan 0 (``a``, ``b``) reaches worker 1, which runs it; worker 0 failed ``a``
    before it came: its connection broke and the plan was lost with it (``lost``: both rounds fail there, the
    plan comes again), or ``a`` failed after its report (``abandoned``). Worker 0 gives the group up, and worker
    1's lane round fails. Each failed fused round must take an unfused round number on both workers: before,
    only those that failed on worker 0 before the plan came did (``FusedRounds._fail``), not worker 0's other
    members of the group (``_give_up``) nor worker 1's (its operation failed): from then on the names' unfused
    rounds were numbered one apart, and a step pushed unfused waited for ever."""
    lanes, planner, (w0, w1) = lane_workers(monkeypatch)
    for w, fs in enumerate((w0, w1)):
        await submit(fs, "a", 0)
        await submit(fs, "b", 1)
        deliver(planner, w, fs)
    ((seq, names),) = planner.take_plans()
    plan = FusePlan(seq, names, "", [["float32", False]], [0, 0], "e1", planner.lanes)
    w1.on_message(0, plan)
    (op,) = lanes.ops
    lanes.push(op)  # worker 1's lane round waits for worker 0
    if how == "lost":
        drop_and_reconnect(planner, w0)  # both rounds fail here; the lost plan comes again
    else:
        w0.carry_out(w0.rounds.fail_name("a", Why("a process disagreed", "mismatch")))
        w0.on_message(0, plan)
    key = fused_name(0, 0, "float32", False, planner.lanes)
    assert w0.aborted == [(key, 0)] and len(lanes.ops) == 1  # given up, never pushed
    lanes.carry(lanes.table.abort(key, 0, 0, 0, RoundWhy("worker 0 gave the group up")))  # the anchor takes it
    for _ in range(3):
        await asyncio.sleep(0)  # (worker 1's operation ends)
    assert sorted(w0.steps) == sorted(w1.steps) == ["a", "b"]


async def test_a_rejoined_worker_never_sums_its_new_plan_into_a_lane_round_of_a_plan_made_before_its_reset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review item 3 of session 16 (suspected wrong sum). Plan 1 (``a``) is made, and worker 0's report of
    ``b`` crosses it on the wire (a report sent while a fused operation with the anchor runs is held until it
    ends, REPORT_WHILE_RUNNING: only a crossing one lets a later plan be made while plan 1's round is open).
    Every process of worker 1 leaves; its Reset reaches the anchor before worker 0's push of plan 1; plan 1
    reaches worker 1 in its old epoch: dropped, unnumbered. The Reset began a new lane generation: worker 0's
    push of plan 1 is refused (its lanes ended), and plan 2 (``b``), made after the Reset, runs on the new
    lanes, round 0 on both workers, and is summed. (Before lane generations, the anchor's ``round_for`` placed
    worker 1's plan 2 in plan 1's round, still open; only the fused layouts, a digest of the names, told them
    apart, and the lane stayed one round out of step for good.)"""
    lanes, planner, workers = lane_workers(monkeypatch)
    w0, w1 = workers
    for step in (0, 1):  # plan 0 of a is summed; plan 1 is made
        for w, fs in enumerate(workers):
            await submit(fs, "a", step)
            deliver(planner, w, fs)
        assert planner.take_plans() == [(step, ["a"])]
        if step == 0:
            lanes.hand_out(workers, 0, ["a"], ("e1", "e1"), planner.lanes)
            lanes.push(lanes.ops[0])
            lanes.push(lanes.ops[1])
            for _ in range(3):
                await asyncio.sleep(0)  # (their operations end)
    old = planner.lanes
    await submit(w0, "b", 2)  # its report crosses plan 1 on the wire (no operation runs there now)
    w1.reset()  # as WorkerDaemon._reset: numbering from 0, a new epoch
    w1.numbers.next.clear()
    w1.link.epoch = "e2"
    lanes.reset(1, "e2")  # the anchor handles the Reset
    assert planner.lanes != old
    deliver(planner, 0, w0)  # b waits for worker 1
    lanes.hand_out(workers, 1, ["a"], ("e1", "e1"), old)  # sent before the Reset: worker 1 drops it, worker 0 runs it
    assert [(op.w, op.plan) for op in lanes.ops] == [(0, 0), (1, 0), (0, 1)]
    lanes.push(lanes.ops[2])  # refused: its lanes ended
    await submit(w1, "a", 12)  # the new processes, at worker 0's step
    await submit(w1, "b", 13)
    deliver(planner, 1, w1)
    assert planner.take_plans() == [(2, ["b"])]
    lanes.hand_out(workers, 2, ["b"], (planner.epoch(0), planner.epoch(1)), planner.lanes)
    assert [(op.w, op.plan, op.round) for op in lanes.ops[3:]] == [(0, 2, 0), (1, 2, 0)]  # new lanes, from 0
    lanes.push(lanes.ops[4])
    lanes.push(lanes.ops[3])
    assert lanes.summed == [{0}, {2}] and lanes.failed == ["ended"]


@pytest.mark.parametrize("order", ["reset_first", "push_first"])
async def test_after_a_worker_resets_with_a_plan_half_run_the_next_steps_are_planned_and_summed_exactly(
        monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    """Lane generations (FusePlan.lanes). Plan 1 (``a``) is made; worker 0 runs it, and every process of worker
    1 leaves before the plan arrives there: worker 1 drops it (its old epoch) and never numbers it. The anchor
    handles worker 1's Reset before worker 0's push of plan 1 (``reset_first``: the push is refused, its lanes
    ended) or after it (``push_first``: the round fails with the reset). Then worker 1's new processes and
    worker 0 go on: every later step is planned, run on the new lanes and summed, each round with one plan on
    both workers. Before lane generations, with ``reset_first`` worker 0's push of plan 1 opened a round that
    waited for worker 1, which never pushes it: worker 0 held its later reports behind that operation
    (REPORT_WHILE_RUNNING), and no later step was planned (in a daemon: until the anchor's ``lost_grace_s``
    ran out, if worker 1 pushed nothing else meanwhile; here, for ever)."""
    lanes, planner, workers = lane_workers(monkeypatch)
    w0, w1 = workers

    async def step(k: int, to: tuple[Any, ...] = (w0, w1), push: bool = True) -> None:
        """Both workers' processes issue ``a`` at step ``k``; the plan goes to ``to``, which push its sum."""
        for w, fs in enumerate(workers):
            await submit(fs, "a", 100 * w + k)
            deliver(planner, w, fs)
        assert planner.take_plans() == [(k, ["a"])]
        lanes.plan = k
        ops = len(lanes.ops)
        for fs in to:
            fs.on_message(0, FusePlan(k, ["a"], "", [["float32", False]], [0], planner.epoch(fs.daemon.worker_id),
                                      planner.lanes))
        for op in lanes.ops[ops:] if push else []:
            lanes.push(op)
        for _ in range(3):
            await asyncio.sleep(0)  # (the operations end)

    await step(0)
    await step(1, to=(w0,), push=False)  # worker 0 runs plan 1
    old, (half,) = planner.lanes, [op for op in lanes.ops if op.plan == 1]
    if order == "push_first":
        lanes.push(half)  # it waits for worker 1
    w1.reset()  # every process of worker 1 left (WorkerDaemon._reset): numbering from 0, a new epoch
    w1.numbers.next.clear()
    w1.link.epoch = "e2"
    lanes.reset(1, "e2")
    if order == "reset_first":
        lanes.push(half)
    w1.on_message(0, FusePlan(1, ["a"], "", [["float32", False]], [0], "e1", old))  # plan 1, late: dropped
    assert w1.numbers.taken == [(half.name, 0)]  # plan 0 only
    for k in range(2, 6):
        await step(k)
    assert [op.plan for op in lanes.ops] == [0, 0, 1] + [k for k in range(2, 6) for _ in (0, 1)]
    assert lanes.summed == [{k} for k in range(6) if k != 1]  # each round one plan's, on both workers
    assert lanes.failed == (["ended"] if order == "reset_first" else ["connection"])


async def test_neither_the_anchor_nor_a_worker_keeps_a_key_of_an_ended_lane_generation_however_many_resets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reset the anchor handles starts a lane generation (see ``bps_server.fusion``), whose fused tensors
    are new keys of its round table, and of every worker's lanes and round numbers. Worker 1's processes leave
    and come back 20 times while worker 0 trains on; each step in between is summed on the current generation's
    lane. The keys of the generations ended are forgotten as they end (``RoundTable.fail_ended``), and by each
    worker at the first plan of a later generation (``FusedSums._forget_ended``): the table, and each worker's
    lanes and numbers, hold the current generation's key alone, where they kept one more key at every reset
    before (21 at the end; worker 0's numbers too, whose own processes never left)."""
    lanes, planner, workers = lane_workers(monkeypatch)
    w0, w1 = workers
    sizes = []
    for k in range(21):
        for w, fs in enumerate(workers):
            await submit(fs, "a", 100 * w + k)
            deliver(planner, w, fs)
        assert planner.take_plans() == [(k, ["a"])]
        ops = len(lanes.ops)
        lanes.hand_out(workers, k, ["a"], (planner.epoch(0), planner.epoch(1)), planner.lanes)
        for op in lanes.ops[ops:]:
            lanes.push(op)
        for _ in range(3):
            await asyncio.sleep(0)  # (the operations end)
        sizes.append((len(lanes.table.keys), len(w0._lanes), len(w0.numbers.next), len(w1._lanes)))
        if k < 20:
            w1.reset()  # as WorkerDaemon._reset: numbering from 0, a new epoch
            w1.numbers.next.clear()
            w1.link.epoch = f"e2.{k}"
            lanes.reset(1, w1.link.epoch)
    assert lanes.summed == [{k} for k in range(21)] and not lanes.failed  # every step, on fresh lanes
    key = fused_name(0, 0, "float32", False, planner.lanes)
    assert sizes == [(1, 1, 1, 1)] * 21 and list(lanes.table.keys) == [(key, 0)]
    assert list(w0._lanes) == list(w0.numbers.next) == list(w1._lanes) == [key]
    # Nor do their links keep the ended keys' last sums (for a restarted server): each ended key, once.
    ended = sorted({k for fs in workers for k in fs.forgotten})
    assert len(ended) == 20 and key not in ended and sorted(w0.forgotten) == ended == sorted(w1.forgotten)


async def test_a_plan_of_the_anchors_previous_run_never_leaves_a_peer_waiting_after_a_reset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The anchor restarted (``planner`` is its new run) while worker 0 ran plan 1 of the previous run (``a``,
    on lane 0 of generation ``run-1.0``, its round 1 there); worker 1 lost that plan in the crash, and worker 0
    tells the new run it runs it (FuseRunning). Then every process of worker 1 leaves: its daemon numbers every
    lane from 0 again. Before, the previous run's lanes lived on: worker 0's push of round 1 waited for worker 1,
    and worker 1's new processes, reporting ``a`` one plan behind, got plan 1 sent again and pushed it as round
    0 of the lane, refused as stale: worker 0's round waited for ever (and held its later reports, see
    REPORT_WHILE_RUNNING), nothing else was planned. Now the reset ends the previous run's lanes too: worker
    0's push is refused, no plan of the previous run is sent again, and the next step is planned and summed."""
    lanes, planner, workers = lane_workers(monkeypatch)
    w0, w1 = workers
    old = "run-1.0"
    for fs in workers:  # both ran plan 0 of the previous run on that lane
        fs.numbers.next[fused_name(0, 0, "float32", False, old)] = 1
        await submit(fs, "a", 1 + 100 * fs.daemon.worker_id)
        fs.link.wire.clear()  # (reported to the previous run)
    lanes.plan = 1
    w0.on_message(0, FusePlan(1, ["a"], "", [["float32", False]], [0], "e1", old))
    (running,) = lanes.ops
    assert running.round == 1
    w0.link.drop()
    w0.link.reconnect("run-2")  # worker 0 tells the new run of plan 1 (FuseRunning)
    deliver(planner, 0, w0, run="run-2")
    w1.reset()  # as WorkerDaemon._reset: numbering from 0, a new epoch
    w1.numbers.next.clear()
    w1.link.epoch = "e2"
    lanes.reset(1, "e2")
    lanes.push(running)
    await submit(w1, "a", 201)  # the new processes, at worker 0's step
    deliver(planner, 1, w1)
    for r in planner.take_resends():  # as SummationServer.fused does
        lanes.plan = r.seq
        workers[r.worker].on_message(0, FusePlan(r.seq, r.names, r.how, [["float32", False]], [0] * len(r.names),
                                                 planner.epoch(r.worker), r.lanes))
        lanes.push(lanes.ops[-1])
    await asyncio.sleep(0)
    await submit(w0, "a", 2)  # worker 0's next step
    deliver(planner, 0, w0)
    assert planner.take_plans() == [(0, ["a"])]
    lanes.hand_out(workers, 0, ["a"], (planner.epoch(0), planner.epoch(1)), planner.lanes)
    for op in lanes.ops[1:]:
        lanes.push(op)
    assert all(op.done.done() for op in lanes.ops)
    assert not [key for key, st in lanes.table.keys.items() if st.busy]  # no round waits
    assert lanes.summed == [{0}] and lanes.failed == ["ended"]


async def test_a_plan_of_the_anchors_new_run_is_told_to_its_next_run_after_an_older_plan_of_its_seq_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The anchor restarted while worker 0 ran its plan 0 (``a``, generation ``run-1.0``); the new run numbers
    its plans from 0 again, and its plan 0 (``b``, ``run-2.0``) comes while the old plan 0 still runs. The old
    one ends, then the anchor restarts again: its third run must hear that plan 0 of ``run-2.0`` still runs
    here (FuseRunning), for the peers that lost it get it again (else worker 0's round of it waits for them for
    ever). Before, the plans running were keyed by seq alone: the new plan replaced the old one's entry, and
    the old one, ending, removed it; the third run heard of no plan."""
    lanes, _, (w0, _w1) = lane_workers(monkeypatch)
    await submit(w0, "a", 0)
    await submit(w0, "b", 1)
    w0.link.wire.clear()  # reported to run-1
    w0.on_message(0, FusePlan(0, ["a"], "", [["float32", False]], [0], "e1", "run-1.0"))
    (old,) = lanes.ops
    w0.link.drop()
    w0.link.reconnect("run-2")
    assert [(m.seq, m.names, m.lanes) for m in w0.link.wire if isinstance(m, FuseRunning)] == [(0, ["a"], "run-1.0")]
    w0.link.wire.clear()
    w0.on_message(0, FusePlan(0, ["b"], "", [["float32", False]], [0], "e1", "run-2.0"))  # run-2's plan 0
    old.done.set_result(None)
    for _ in range(3):
        await asyncio.sleep(0)  # (the old plan's operation ends)
    w0.link.drop()
    w0.link.reconnect("run-3")
    assert [(m.seq, m.names, m.lanes) for m in w0.link.wire if isinstance(m, FuseRunning)] == [(0, ["b"], "run-2.0")]


def test_a_plan_says_which_lane_generations_of_its_server_ended():
    """A generation is "<run>.<resets handled>": a plan on one ends its run's earlier generations, and, once its
    run handled a reset, every generation of the server's other runs (``Planner._excuse``)."""
    assert fd.ended_by("r2.0", "r2.1") and fd.ended_by("r2.3", "r2.10") and fd.ended_by("r1.7", "r2.1")
    assert not fd.ended_by("r2.1", "r2.1") and not fd.ended_by("r2.2", "r2.1") and not fd.ended_by("r1.7", "r2.0")
    assert not fd.ended_by("r1.0", "") and fd.ended_by("x.y.0", "x.y.1") and not fd.ended_by("x.0", "x.y.0")


async def test_a_worker_keeps_the_keys_of_an_ended_lane_generation_while_an_operation_of_it_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker 0 runs plan 0 on generation r.0 when plan 1, on r.1, says r.0 ended: r.0's key is kept while its
    operation runs (its round number and its operation: a later one on the key would wait for it), and forgotten
    at the next plan once it ended."""
    lanes, _, (w0, _w1) = lane_workers(monkeypatch)
    for k, name in enumerate("abc"):
        await submit(w0, name, k)
    old, new = (fused_name(0, 0, "float32", False, f"r.{g}") for g in (0, 1))
    w0.on_message(0, FusePlan(0, ["a"], "", [["float32", False]], [0], "e1", "r.0"))
    w0.on_message(0, FusePlan(1, ["b"], "", [["float32", False]], [0], "e1", "r.1"))
    assert set(w0.numbers.next) == set(w0._lanes) == {old, new}
    lanes.ops[0].done.set_result(None)
    lanes.ops[1].done.set_result(None)
    for _ in range(3):
        await asyncio.sleep(0)  # (the operations end)
    w0.on_message(0, FusePlan(2, ["c"], "", [["float32", False]], [0], "e1", "r.1"))
    assert set(w0.numbers.next) == set(w0._lanes) == {new} and w0.numbers.next[new] == 2


def test_a_fused_operation_that_failed_before_its_sum_says_its_names_steps_take_unfused_numbers():
    """``FusedOperation.failed_steps``: the names of a failed operation of the job still running, before its sum
    was complete (the lane round failed at the anchor, for every worker); none after (this machine's alone)."""
    host = types.SimpleNamespace(rank_offset=0, config=types.SimpleNamespace(local_size=1), epoch="e1")
    session = Session()
    rounds = [FusedRound(n, F32, 0, [Entry(session, i, F32, "seg", 16 * i, 0)]) for i, n in enumerate("ab")]
    ops = [FusedOperation(host, "fused/0/0/float32", 0, rounds) for _ in range(4)]  # type: ignore[arg-type]
    assert ops[0].failed_steps() == []  # (not failed)
    ops[1].summed = True  # every piece's sum arrived, then the hand-back failed
    ops[2].epoch = "e0"  # of the processes before a reset
    for op in ops[1:]:
        op.answer_failure(lambda req, _: Failure(req, "lane round failed", code="round_failed"))
    assert [op.failed_steps() for op in ops] == [[], [], [], ["a", "b"]]


async def test_the_lanes_next_operation_waits_for_the_fate_of_the_one_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan 0's lane round 0 holds worker 0's push; worker 0's link gives up (its fate unknown) and worker 1's push
    sums the round. Worker 0 asks its server whether round 0 was summed (RoundQuery.fate), and its lane waits for
    the answer (its next report too): were a later round of the lane summed first, round 0 would no longer be the
    key's last sum, and the answer would say "not summed": worker 0 would take unfused numbers that worker 1 does
    not. Found by a review."""
    from bps_worker.placement import Piece

    lanes, planner, (w0, w1) = lane_workers(monkeypatch)
    loop = asyncio.get_running_loop()
    queries: list[tuple[str, int, int, asyncio.Future[int]]] = []

    def query_round(name: str, part: int = 0, local: int = 0, failed: bool = False, fate: int = -1) -> Any:
        future = loop.create_future()
        queries.append((name, part, fate, future))
        return future

    w0.link.query_round = query_round
    for w, fs in enumerate((w0, w1)):
        await submit(fs, "a", w)
        deliver(planner, w, fs)
    assert planner.take_plans() == [(0, ["a"])]
    lanes.hand_out([w0, w1], 0, ["a"], ("e1", "e1"), planner.lanes)
    await asyncio.sleep(0)
    mine, theirs = lanes.ops[0], lanes.ops[1]
    ghost = type("Lost", (), {"plan": 0, "w": 0, "name": mine.name, "round": mine.round,
                              "layout": mine.layout, "end": lambda self, failed=False: None})()
    lanes.push(ghost)  # it reached the anchor (its answer goes nowhere: the link gave up)
    mine.unsettled, mine.server_round = [Piece(0, 0, 0, 4)], mine.round
    mine.end(failed=True)
    for _ in range(3):
        await asyncio.sleep(0)
    lanes.push(theirs)  # summed: worker 1's step succeeded
    for w, fs in enumerate((w0, w1)):
        await submit(fs, "a", 10 + w)
        deliver(planner, w, fs)
    assert planner.take_plans() == []  # (worker 0's next report waits with its lane: no round 1 meanwhile)
    ((name, part, fate, future),) = queries
    future.set_result(int(lanes.table.summed(name, part, fate)))
    for _ in range(6):
        await asyncio.sleep(0)
    assert w0.steps == w1.steps == [], f"worker 0 took {w0.steps}, worker 1 {w1.steps}"
    deliver(planner, 0, w0)
    assert planner.take_plans() == [(1, ["a"])]


def test_a_fused_tensors_failure_names_each_small_tensor_not_the_fused_key() -> None:
    """A failure the servers or the links say about the fused tensor (its key starts with a NUL byte) reached
    each process naming that key, which it never saw (a review's find: "round 3 of '\\x00fused/0/5/float64@...'
    cannot complete"). Each process hears its own tensor's name, the rest of the story unchanged."""
    host = types.SimpleNamespace(rank_offset=0, config=types.SimpleNamespace(local_size=1), epoch="e1")
    member = Session()
    key = fused_name(0, 5, "float64", False, "run.0")
    rounds = [FusedRound(n, F32, 0, [Entry(member, i, F32, "seg", 16 * i, 0)]) for i, n in enumerate(["a", "b"])]
    op = FusedOperation(host, key, 3, rounds)  # type: ignore[arg-type]
    said = f"server 0: worker 1 is disconnected; round 3 of {key!r} cannot complete"
    op.answer_failure(lambda req, _: Failure(req, said, code="connection", name=key, what=f"round 3 of {key!r}",
                                             peer="worker 1"))
    first, second = member.got
    assert first.message == ("server 0: worker 1 is disconnected; round 3 of 'a' (summed fused with 1 other small "
                             "tensors) cannot complete")
    assert (first.name, first.what, first.peer, first.code) == ("a", "round 3 of 'a' (summed fused with 1 other "
                                                                "small tensors)", "worker 1", "connection")
    assert second.req == 1 and second.name == "b" and "\x00" not in second.message and key not in second.message


async def test_a_fused_copy_back_leaves_out_a_process_that_left() -> None:
    """A process killed with a fused step in flight: its memory went with it, but its live local peer gets the sums
    of the names (they failed for it, blaming a truncated segment, while the other machines got them: a review's
    case, 7 runs in 10)."""
    from multiprocessing.shared_memory import SharedMemory

    host = types.SimpleNamespace(rank_offset=0, config=types.SimpleNamespace(local_size=2), epoch="e1")
    segments = [SharedMemory(create=True, size=64) for _ in range(2)]
    for seg in segments:
        seg.buf[:] = bytes(seg.size)  # (allocated, as the client's create_segment makes them: not sparse)
    try:
        members = [Session(), Session()]
        for member, seg in zip(members, segments):
            member.arena = types.SimpleNamespace(segments={seg.name: seg})  # type: ignore[attr-defined]
            member.closed = False  # type: ignore[attr-defined]
        rounds = [FusedRound(n, F32, 0, [Entry(m, i, F32, seg.name, 16 * i, 0) for m, seg in zip(members, segments)])
                  for i, n in enumerate("ab")]
        op = FusedOperation(host, "fused/0/0/float32", 0, rounds)  # type: ignore[arg-type]
        op.path.runs(op)  # (made while both are there, as gather does)
        members[1].closed = True  # type: ignore[attr-defined]  # it left: its segment is freed
        del members[1].arena.segments[segments[1].name]  # type: ignore[attr-defined]
        out = np.arange(8, dtype=np.float32)
        await op.path.copy_back(op, out)
        got = np.frombuffer(segments[0].buf, np.float32, 8).copy()
        np.testing.assert_array_equal(got, out)
    finally:
        del op  # (its runs map the segments)
        for seg in segments:
            seg.close()
            seg.unlink()
