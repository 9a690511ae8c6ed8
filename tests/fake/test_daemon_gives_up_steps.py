"""A fused step that failed gives its unfused round number up at the anchor (WorkerDaemon.unfused_step,
_give_up_step): never into the next job, and every step, also where two steps' base queries overlap.
(Found by a review; an in-process daemon whose anchor link is a fake.)"""

from __future__ import annotations

import asyncio
import types

from bps_worker.daemon import WorkerDaemon
from bps_worker.errors import BPSConnectionError
from fake_transport import FakeSession, worker_daemon
from protocol.messages import Op

F32 = ("float32", (4,), False, "")


class Anchor:
    """The anchor's link: a round query is answered at once with ``local`` (the server does not take us for a
    rejoining worker: round_for's first case) while connected, and fails (the link gave up) while not."""

    def __init__(self, daemon: WorkerDaemon, connected: bool) -> None:
        self.daemon, self.connected = daemon, connected
        self.rtt = False
        self.spec = types.SimpleNamespace(id=1)
        self.queries: list[tuple[str, int, bool]] = []
        self.aborts: list[tuple[str, str, int]] = []  # (the daemon's epoch as it was sent, name, round)

    def query_round(self, name: str, part: int = 0, local: int = 0, failed: bool = False,
                    given_up: bool = False) -> asyncio.Future[int]:
        self.queries.append((name, local, failed))
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if self.connected and self.rtt:
            asyncio.get_running_loop().call_soon(future.set_result, local)  # (answered after a round trip)
        elif self.connected:
            future.set_result(local)
        else:
            future.set_exception(BPSConnectionError("cannot reach server 1"))
        return future

    def abort(self, name: str, part: int, round_: int, why: object) -> None:
        self.aborts.append((self.daemon.epoch, name, round_))


def _daemon(local_size: int = 1, connected: bool = True) -> tuple[WorkerDaemon, Anchor]:
    daemon: WorkerDaemon = worker_daemon(local_size)
    for link in daemon.all_links:  # no sockets: what a link must send waits in it
        link._ensure_connecting = lambda *a, **k: None  # type: ignore[method-assign]
    anchor = Anchor(daemon, connected)
    daemon._anchor_link = lambda name: anchor  # type: ignore[method-assign,assignment,return-value]
    return daemon, anchor


async def _settle(daemon: WorkerDaemon) -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_step_given_up_as_the_last_process_leaves_sends_no_abort_into_the_next_job():
    """The last process leaves with a fused round of "a" open: FusedRounds.leave fails it (a step: unfused_step
    spawns _give_up_step with an old-job number), and session_lost resets at once. _give_up_step reads
    self.epoch when it first runs, after the reset: the new job's epoch. Its query (not one of round_queries:
    not cancelled) is answered, the epoch check passes, a base is learned for the new job from an old-job
    number, and the old job's round is aborted at the anchor in the new job."""
    daemon, anchor = _daemon()
    session = FakeSession(0)
    daemon.sessions[0] = session  # type: ignore[assignment]
    daemon.submit_batch(session, [(1, "a", F32, "seg", 0, 0)])  # complete here (one process): reported
    daemon.rounds.numbers.take("a")
    daemon.rounds.numbers.take("a")  # (two earlier steps of "a" took numbers: its next is 2)
    old = daemon.epoch
    daemon.session_lost(session)  # leave -> _fail (a step, number 2) -> unfused_step; then _reset()
    assert daemon.epoch != old
    await _settle(daemon)
    assert anchor.aborts == [], f"an abort of the old job's round sent in the new job: {anchor.aborts}"
    assert daemon.rounds.numbers.base("a") is None, "a base learned in the new job from an old-job number"



async def test_two_steps_given_up_while_their_base_queries_overlap_are_both_aborted():
    """Two fused steps of "a" fail before its base is known: each takes an unfused number (0, 1) and asks the
    anchor. The first answer learns the base; the second found it learned and returned without its abort (round
    1 never given up at the anchor, whose round table missed the step)."""
    daemon, anchor = _daemon()
    anchor.rtt = True
    daemon.unfused_step("a")
    daemon.unfused_step("a")
    await _settle(daemon)
    assert sorted(r for _, _, r in anchor.aborts) == [0, 1], f"aborts sent: {anchor.aborts}"


async def test_a_round_aborted_once_its_base_is_known_is_not_aborted_into_the_next_job():
    """Local rank 0 leaves during its round of "g" (unfused) while the base query is out: its abort waits for the
    answer (abort_when_known). The answer comes, and before the abort's task runs, rank 1 leaves too (under uvloop
    the socket's end is read before the callbacks the answer scheduled): the daemon resets. The abort then went
    out in the next job and failed its round 0 of "g" (shutdown() with a sum in flight, then init() on every
    process: the next job's first step failed with the old one's error, a review's case)."""
    daemon, anchor = _daemon(local_size=2)
    answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    anchor.query_round = lambda *args, **kwargs: answer  # type: ignore[method-assign,assignment]
    sessions = [FakeSession(0), FakeSession(1)]
    for s in sessions:
        daemon.sessions[s.local_rank] = s  # type: ignore[assignment]
    daemon.submit(sessions[0], Op(req=1, name="g", kind="sum", segment="seg", offset=0, dtype="float32",
                                  shape=[4]))  # type: ignore[arg-type]
    await _settle(daemon)
    daemon.session_lost(sessions[0])  # its round fails: the abort waits for the base
    await _settle(daemon)
    assert anchor.aborts == []
    answer.set_result(0)
    await asyncio.sleep(0)  # the query's task learns the base and ends; the abort's task is woken next
    old = daemon.epoch
    daemon.session_lost(sessions[1])  # the last process leaves first: reset
    assert daemon.epoch != old
    await _settle(daemon)
    assert anchor.aborts == [], f"an abort of the old job's round sent in the new job: {anchor.aborts}"


class RejoinAnchor(Anchor):
    """The anchor of a machine that rejoins peers at their round ``peers`` (RoundTable.round_for): a failed
    round's query is answered -1, any other is placed at the peers' round. While a name is in ``down`` (its
    server is down), its queries wait in the link: :meth:`time_out` fails those asked so far (the timeout),
    :meth:`up` answers the rest."""

    def __init__(self, daemon: WorkerDaemon, peers: int, down: set[str]) -> None:
        super().__init__(daemon, True)
        self.peers, self.down = peers, set(down)
        self.held: list[tuple[asyncio.Future[int], bool]] = []
        self.given_up: list[tuple[str, int]] = []

    def query_round(self, name: str, part: int = 0, local: int = 0, failed: bool = False,
                    given_up: bool = False) -> asyncio.Future[int]:
        self.queries.append((name, local, failed))
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if given_up:
            self.given_up.append((name, local))
        if name in self.down:
            self.held.append((future, failed))
        else:
            future.set_result(-1 if failed else self.peers)
        return future

    async def time_out(self, daemon: WorkerDaemon, session: FakeSession) -> None:
        """Fail the queries asked so far, until the process heard its round failed (a query asked again after a
        failed one is asked in the same timeout); those asked after it wait."""
        while self.held and not session.answers:
            held, self.held = self.held, []
            for future, _ in held:
                future.set_exception(BPSConnectionError("cannot reach server 1 within 4 s"))
            await _settle(daemon)

    def up(self) -> None:
        self.down.clear()
        for future, failed in self.held:
            future.set_result(-1 if failed else self.peers)


def _rejoining(down: set[str]) -> tuple[WorkerDaemon, RejoinAnchor, FakeSession]:
    daemon, _ = _daemon()
    anchor = RejoinAnchor(daemon, 7, down)
    daemon._anchor_link = lambda name: anchor  # type: ignore[method-assign,assignment,return-value]
    session = FakeSession(0)
    daemon.sessions[0] = session  # type: ignore[assignment]
    return daemon, anchor, session


def _op(req: int, name: str) -> Op:
    return Op(req=req, name=name, kind="sum", segment="seg", offset=0, dtype="float32", shape=[4])  # type: ignore[arg-type]


async def test_a_rejoiners_step_that_could_not_learn_its_round_gives_up_nothing_of_the_peers():
    """A machine back while the servers were down: its first step of "a" fails ("cannot learn its round"). It
    gives the round up as a failed round's (answered -1: it rejoins): nothing is aborted and no base learned, so
    its next round is placed at the peers' round. Before, the round was placed as one to join (the peers' round
    7) and aborted there: the peers' step failed in this name, and where another name's anchor answered
    differently, the names went a step apart for the rest of the job (benchmarks/double_fault.py)."""
    daemon, anchor, session = _rejoining({"a"})
    daemon.submit(session, _op(1, "a"))  # type: ignore[arg-type]
    await _settle(daemon)
    await anchor.time_out(daemon, session)
    assert [a.message for a in session.answers if "cannot learn its round" in getattr(a, "message", "")]
    anchor.up()
    await _settle(daemon)
    assert ("a", 0, True) in anchor.queries and anchor.aborts == []
    assert daemon.rounds.numbers.base("a") is None
    session.answers.clear()
    daemon.submit(session, _op(2, "a"))  # type: ignore[arg-type]  # its next step: at the peers' round 7
    await _settle(daemon)
    assert anchor.queries[-1] == ("a", 1, False) and daemon.rounds.numbers.server_round("a", 1) == 7


async def test_a_rejoiners_round_that_failed_beside_a_placed_name_of_its_step_is_aborted_at_the_peers_round():
    """The step's "b" learned its round (its anchor answered: the peers' round 7) and went to the servers; "a"
    could not (its anchor was down longer than the timeout). The step is the peers' current one: "a"'s round of
    it is given up at the peers' round (RoundQuery.given_up), so that the peers' step fails in "a" as here (left
    alone, the peers' round 7 of "a" waited and took this machine's next step: "a" a step off "b")."""
    daemon, anchor, session = _rejoining({"a"})
    daemon.submit(session, _op(1, "b"))  # type: ignore[arg-type]
    await _settle(daemon)
    assert daemon.rounds.numbers.base("b") == 7
    session.answers.clear()  # ("b" failed in the gather: this fake process has no shared memory)
    daemon.submit(session, _op(2, "a"))  # type: ignore[arg-type]
    await _settle(daemon)
    await anchor.time_out(daemon, session)
    anchor.up()
    await _settle(daemon)
    assert anchor.given_up == [("a", 0)]
    assert [(name, round_) for _, name, round_ in anchor.aborts if name == "a"] == [("a", 7)]
    assert daemon.rounds.numbers.base("a") == 7


class OrderedAnchor(RejoinAnchor):
    """A rejoining machine's anchor whose answers the test gives, name by name (:meth:`answer`, :meth:`fail`)."""

    def __init__(self, daemon: WorkerDaemon, peers: int) -> None:
        super().__init__(daemon, peers, set())
        self.pending: dict[str, list[tuple[asyncio.Future[int], bool]]] = {}

    def query_round(self, name: str, part: int = 0, local: int = 0, failed: bool = False,
                    given_up: bool = False) -> asyncio.Future[int]:
        self.queries.append((name, local, failed))
        if given_up:
            self.given_up.append((name, local))
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.pending.setdefault(name, []).append((future, failed))
        return future

    def answer(self, name: str) -> None:
        for future, failed in self.pending.pop(name, []):
            future.set_result(-1 if failed else self.peers)

    def fail(self, name: str) -> None:
        for future, _ in self.pending.pop(name, []):
            future.set_exception(BPSConnectionError("cannot reach server 1 within 4 s"))


async def test_a_round_that_failed_just_before_its_steps_other_name_was_placed_is_still_given_up_there():
    """The step's "a" could not learn its round a moment before "b"'s answer came (the peers' round 7): decided
    at "a"'s failure, it was void (-1), "b" went to the servers at 7, and the peers' round 7 of "a" took this
    machine's next step ("a" a step off "b" for the rest of the job: a review's case, seen under load in
    benchmarks/double_fault.py). The decision waits for the step's other names' queries: "a" is given up at 7."""
    daemon, _ = _daemon()
    anchor = OrderedAnchor(daemon, 7)
    daemon._anchor_link = lambda name: anchor  # type: ignore[method-assign,assignment,return-value]
    session = FakeSession(0)
    daemon.sessions[0] = session  # type: ignore[assignment]
    daemon.submit(session, _op(1, "b"))  # type: ignore[arg-type]
    daemon.submit(session, _op(2, "a"))  # type: ignore[arg-type]
    await _settle(daemon)
    anchor.fail("a")  # "a"'s anchor timed out first ...
    await _settle(daemon)
    anchor.answer("b")  # ... "b"'s answer came a moment later
    await _settle(daemon)
    anchor.answer("a")  # (the give-up's query, once "a"'s server is back)
    await _settle(daemon)
    assert anchor.given_up == [("a", 0)] and ("a", 7) in [(name, round_) for _, name, round_ in anchor.aborts]
    assert daemon.rounds.numbers.base("a") == daemon.rounds.numbers.base("b") == 7

