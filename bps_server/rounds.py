"""The Summation Service's round table: which round each partition key is in, and who waits on it.

Theory of operation. A key is ``(tensor name, partition index)``. In synchronous
mode a worker pushes round ``r + 1`` of a key only after it received the sum of
round ``r``, and the server sends that sum only once all ``n`` workers pushed
round ``r``. Hence, for one key, the server only ever sees pushes of its current
round, except when a round failed somewhere (a mismatch, a worker that gave
up): then a push of a *later* round means its sender has moved on, and the
current, incomplete round is abandoned (its waiters get an error). Rounds are
never mixed: every push carries its round and is checked against the key's.

Each push carries a descriptor (dtype, shape, partition offset/count, divisor,
kind, a broadcast's root, and the layout a framework layer gives a fused tensor:
a digest of a gradient bucket's parameters). A descriptor that differs from the
round's first one fails the round for everyone who pushed it, with a message
naming the tensor and both descriptors.

Broadcasts. A broadcast round is a copy, not a sum: the push of the worker whose
machine holds the root (``Push.holds_root``) is kept until every worker pushed,
and its bytes are the result, bit for bit (a sum with -0.0 quiets a signalling
NaN). The other workers' data is ignored. A round in which no worker, or two,
hold the root fails (the workers' cluster files disagree about the ranks).

A round that waits longer than ``lost_grace_s`` for a worker which is not even
connected fails, naming it (a worker machine that never came, or died before a
server restart): connected but slow workers are waited for.

Server restarts. A restarted server knows nothing; the workers reconnect, replay
the last finished sum of each key they got from its predecessor (``replay``) and
push again what was in flight. A replayed sum answers the workers that pushed
that round but never got its sum; a replayer's push of the next round waits
until every worker has either replayed the round or been answered. So no round
is lost or summed twice, and the bytes are those the predecessor computed.

Dropped connections. A worker whose connection to this same run broke (``worker_lost`` failed the rounds
that waited for its push) pushes again what it had not heard back of, marked ``resumed``: the push may have
reached us on the connection that broke. Its round's state answers it. Still open with the worker's push in it:
the waiter is the new push (its sum goes out on the new connection, or at once where a replay answered the
push already), nothing is added twice. Open without it: an ordinary push. Failed: its failure. The key's last
summed round (``Round.last_sum``, however many rounds failed after it): the other workers got the sum and
this worker's answer died with the connection, so it fails with code ``answer_lost`` (the worker's processes
hear a connection error, and the worker knows the peers' round succeeded). No later round can have been summed
without this worker's push, so the answer is exact. Anything else is a stale push, as ever.

A worker machine that comes back (its daemon restarted, or a new job's processes
on it while other machines' processes keep training) numbers its local rounds
from 0; before the first round of each name it asks the server holding that
name's partition 0 which round that is (:meth:`RoundTable.round_for`) and offsets
all its pushes of the name by the answer, so it joins the round the others are in.

Deterministic mode (``cluster.deterministic``): floating-point addition is not
associative, so the sum depends on the order in which pushes arrive. With it on,
each key keeps every contribution of the round until the last one arrives and
then sums them in worker-id order in one pass (``kernels.sum_into``), so repeated
runs give identical bytes. The cost is memory: up to ``n`` received partitions
per key in flight instead of one accumulator (a borrowed shared-memory
contribution costs nothing), and the sum starts only when the last push is in,
so summing no longer overlaps receiving. float16 and bfloat16 always take this
path: one pass that reads every half-precision input once, adds in float32
registers and rounds once moves 3 bytes per 2-byte element for two workers,
where a float32 accumulator moves 5 per input (and needs a rounding pass).

Failures say why twice: in words for people and logs, and as a :class:`Why` with the protocol's
failure code and facts (a mismatch's tensor and both descriptors, the worker that left, the round
that timed out), which the connection sends in the ``Failure`` so that the worker raises the typed
error without reading the text.

The table and its driver. :class:`RoundTable` makes every one of these decisions
and does nothing else: no asyncio, no locks, no threads, no clock (the caller
passes ``now``), no logging. Each event method returns a list of *actions*
(small frozen dataclasses below) that the driver (``bps_server.aggregator``)
carries out in order: answer or fail waiters, add a payload to an accumulator,
start a grace timer, push held pushes again, log a note. Waiters are opaque to
the table (``W``: the driver's reply/fail callbacks).

Summing takes time, and the driver awaits it; meanwhile the round may fail, be
answered by a replay, or be superseded. So every :class:`Add` and :class:`SumAll`
carries the round's :class:`Token`, and after any suspension the driver asks the
table once: :meth:`RoundTable.current` before it starts, :meth:`RoundTable.added`
after an addition, :meth:`RoundTable.complete` once the sum is ready. Each of
those answers "nothing to do" for a token whose round is no longer the key's
open one, so a stale sum is dropped without the driver knowing why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Generic, TypeVar, Union

import numpy as np

from bps_runtime.stalls import stalled
from protocol import dtypes, messages
from protocol.messages import KIND_BROADCAST, FailureCode, Push

from .jobs import Jobs, Spared, spare_none

Key = tuple[str, int]
W = TypeVar("W")

# How many keys of ended lane generations keep their last sum for fate queries (RoundQuery.fate): a few
# generations' fused tensors, each one key per lane, dtype and part.
ENDED_SUMS_KEPT = 4096

# A borrowed payload's lease: the payload is a view of memory a worker owns (its shared memory), and this
# raises an OSError (``bps_runtime.segments.SegmentSizeError``) unless that memory is still whole. The
# driver calls it right before every read of the view, not only when the push arrived: a round can hold
# a borrowed view while it waits for the other workers, and a segment truncated meanwhile would make
# the read a SIGBUS. ``None``: the payload is the server's own (received over TCP).
Lease = Callable[[], None]


def describe(push: Push) -> str:
    """A push's tensor as a reader knows it, in the words its worker uses for its processes' ops
    (:func:`~protocol.messages.describe_tensor`): ``float32[2,2] (average)``."""
    return messages.describe_tensor(push.dtype, push.shape, push.kind, average=push.divisor != 1, root=push.root,
                                    staleness=push.staleness, layout=push.layout)


def descriptor(push: Push) -> tuple[object, ...]:
    """What every push of one round must agree on."""
    return (push.dtype, tuple(push.shape), push.offset, push.count, push.divisor, push.kind, push.root, push.layout)


# -- why a round failed --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Why(messages.Why):
    """A server's failure (:class:`protocol.messages.Why`); ``round_failed`` unless it says otherwise."""

    code: FailureCode = "round_failed"

    @classmethod
    def pushes_disagree(cls, first: Push, other: Push) -> Why:
        detail = f"worker {first.worker} pushed {describe(first)} but worker {other.worker} pushed {describe(other)}"
        return cls.mismatch(first.name, describe(first), describe(other), detail)

    @classmethod
    def worker_gone(cls, worker: int, text: str) -> Why:
        """A worker that is needed left (disconnected, or its training processes did)."""
        return cls(text, "connection", peer=f"worker {worker}", detail=text)

    def for_push(self, push: Push) -> Why:
        """This failure as ``push``'s sender hears it (a mismatch: its side is ``ours``)."""
        return self.heard_by(describe(push))


# -- what the table holds ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Token:
    """Names one round of one key: ``gen`` is unique per round opened by this table."""

    key: Key
    round: int
    gen: int


@dataclass(frozen=True, slots=True)
class Waiter(Generic[W]):
    """A push waiting for its round's sum, with the driver's handle to answer it."""

    push: Push
    handle: W


@dataclass(frozen=True, slots=True)
class Held(Generic[W]):
    """A replayer's push of the round after a replayed one, held until that round settles."""

    push: Push
    payload: np.ndarray
    borrowed: Lease | None
    handle: W


@dataclass(slots=True)
class Restart(Generic[W]):
    """A round's state after a server restart (see "Server restarts"): the sum a worker replayed,
    who replayed it, who was answered with it, and the replayers' held next-round pushes."""

    result: np.ndarray | None = None
    replayed: Push | None = None  # the first replay: what the round's pushes must be (none may have come first)
    replayers: set[int] = field(default_factory=set)
    answered: set[int] = field(default_factory=set)
    # Rejoining workers (new processes, placed at the others' round) that had no part in the round: it does
    # not wait for them (see RoundTable.worker_hello); and those told it is theirs (round_for), which it does.
    passed: set[int] = field(default_factory=set)
    placed: set[int] = field(default_factory=set)
    held_next: list[Held[W]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Round(Generic[W]):
    """The open round of one key, as the table owns it. The accumulator is not here: it is the
    driver's, and lives as long as one :class:`Token`."""

    key: Key
    round: int
    gen: int
    opened: float = 0.0  # the caller's clock at the round's first push (or replay)
    first: Push | None = None  # the descriptor every later push must match
    waiters: dict[int, Waiter[W]] = field(default_factory=dict)  # worker -> its push of this round
    added: int = 0  # contributions the driver has summed into the accumulator
    # one-pass sums (and a broadcast's root): worker -> (data, its lease if borrowed)
    held: dict[int, tuple[np.ndarray, Lease | None]] = field(default_factory=dict)
    failed: Why | None = None
    aborted: set[int] = field(default_factory=set)  # the workers that gave this round up (Abort)
    previous_failure: tuple[int, Why] | None = None  # (round, why) of the round before, if it failed
    last_sum: int | None = None  # the key's last round summed, kept from round to round ("Dropped connections")
    restart: Restart[W] = field(default_factory=Restart)

    @property
    def token(self) -> Token:
        return Token(self.key, self.round, self.gen)

    @property
    def busy(self) -> bool:
        """Someone pushed or replayed this round and it has not failed."""
        return bool(self.waiters or self.restart.replayers) and self.failed is None


def sizes_differ(name: str, spec: messages.Spec, fused_worker: int, unfused: str, unfused_worker: int) -> Why:
    """Worker ``fused_worker`` issued ``name`` fused (``spec``), worker ``unfused_worker`` as the ordinary
    tensor ``unfused`` describes: sizes on both sides of the fusion limit, a mismatch."""
    fused = messages.describe_spec(spec)
    return Why.mismatch(name, fused, unfused, f"worker {fused_worker} issued it as {fused} (fused) but worker "
                                              f"{unfused_worker} as {unfused} (too large to fuse)")


# -- what the table asks the driver to do --------------------------------------------


@dataclass(frozen=True, slots=True)
class Fail(Generic[W]):
    """Fail one push because of ``why`` (a stale or duplicate push, or one of a failed round)."""

    push: Push
    handle: W
    why: Why

    @property
    def reason(self) -> str:
        return self.why.text


@dataclass(frozen=True, slots=True)
class FailRound(Generic[W]):
    """A round failed: count and log it, then carry out ``fails`` (its waiters and held pushes)."""

    key: Key
    round: int
    why: Why
    fails: tuple[Fail[W], ...]

    @property
    def reason(self) -> str:
        return self.why.text


@dataclass(frozen=True, slots=True)
class Answer(Generic[W]):
    """Answer these waiters with ``result`` (a sum replayed after a restart)."""

    waiters: tuple[Waiter[W], ...]
    result: np.ndarray


@dataclass(frozen=True, slots=True)
class Add:
    """Add ``payload`` to the accumulator of round ``token``, then call :meth:`RoundTable.added`."""

    token: Token
    push: Push
    payload: np.ndarray
    borrowed: Lease | None


@dataclass(frozen=True, slots=True)
class SumAll:
    """Sum ``inputs`` (in this order: worker-id order) in one pass, then call :meth:`RoundTable.complete`.
    A broadcast's one input is the root's data: its sum is a copy, bit for bit (``kernels.sum_into``)."""

    token: Token
    push: Push  # the last push: dtype, divisor and count of the round
    inputs: tuple[np.ndarray, ...]
    leases: tuple[Lease, ...] = ()  # of the borrowed inputs: each checked right before the pass


@dataclass(frozen=True, slots=True)
class Complete(Generic[W]):
    """Round ``round`` of ``key`` is summed: answer ``waiters`` with the sum (from :meth:`RoundTable.complete`)."""

    key: Key
    round: int
    opened: float
    waiters: tuple[Waiter[W], ...]


@dataclass(frozen=True, slots=True)
class Settled:
    """A round was settled with a replayed sum (every worker replayed it or was answered)."""

    key: Key
    round: int


@dataclass(frozen=True, slots=True)
class Redispatch(Generic[W]):
    """Push these held pushes again, from the event loop, after the current event."""

    held: tuple[Held[W], ...]


@dataclass(frozen=True, slots=True)
class StartGrace:
    """In ``lost_grace_s``, call :meth:`RoundTable.grace_expired` with ``(worker, gone, why)``."""

    worker: int
    gone: int
    why: str


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every worker reset: the state of ``keys`` keys was dropped (drop any accumulators too)."""

    keys: int


@dataclass(frozen=True, slots=True)
class Note:
    """Something worth a log line at ``level`` that changes no round."""

    level: int
    message: str


Action = Union[Fail[W], FailRound[W], Answer[W], Add, SumAll, Settled, Redispatch[W], StartGrace, Cleared, Note]


class RoundTable(Generic[W]):
    """Every decision about every key's rounds (see the module docstring); returns actions, does nothing.

    ``connected(worker)``: whether the worker daemon holds a connection now (a query of the server's
    state, asked only by :meth:`sweep` and when a worker's numbering restarts).
    """

    def __init__(self, n_workers: int, *, lost_grace_s: float = 30.0, deterministic: bool = False,
                 connected: Callable[[int], bool] = lambda worker: True, stall_s: float = 0.0,
                 server: str = "this server") -> None:
        self.n_workers = n_workers
        self.server = server  # how its failures name this server ("server 2")
        self.lost_grace_s = lost_grace_s
        self.stall_s = stall_s  # cluster.stall_timeout: a round waiting this long for connected workers fails
        # When each worker last pushed into a round another worker had opened here: one catching up on the others'
        # tensors (in its own order) is busy, not stalled, however long a round waits for it (a review's case:
        # every round failed). A round it opens itself does not count: a worker whose processes moved on to
        # their next step after a failure of their own is no busier for the round that waits for them.
        self.joined_at: dict[int, float] = {}
        self.jobs = Jobs(lost_grace_s)  # whose processes may be of a later job than whose (processes_ended)
        self.deterministic = deterministic
        self.connected = connected
        self.keys: dict[Key, Round[W]] = {}
        # The last sums of the keys of ended lane generations (fail_ended), oldest first, for fate queries.
        self._ended_sums: dict[Key, int] = {}
        self._gen = 0
        # Workers whose connection dropped and which did not come back within lost_grace_s:
        # rounds that need them fail at once instead of waiting.
        self.lost_workers: set[int] = set()
        self._gone: dict[int, int] = {}  # worker -> number of its latest disconnection or reset
        self._gone_count = 0
        self._reset: set[int] = set()  # workers without training processes since their last push
        # Those of them only because their connection dropped (no Reset came): the same daemon back with the
        # same numbering (Hello.epoch) is the same processes, not a worker without any (worker_hello).
        self._dropped: set[int] = set()
        # And those only because their daemon said it had none since it started (Hello.processes: worker_idle).
        self._idle: set[int] = set()
        # Dropped workers whose job then ended everywhere (_clear_if_all_reset): nothing of their processes is open.
        self._ended_dropped: set[int] = set()
        self._epochs: dict[int, str] = {}  # each worker's round numbering (Hello.epoch, Reset.epoch)
        # Workers whose numbering restarted while other workers were mid-job: they rejoin (round_for).
        self._rejoining: set[int] = set()
        # Workers whose first hello to this run said their numbering is unused (Hello.fresh) and which have
        # not pushed since; and those whose last hello said it is in use (they are mid-job, perhaps with our
        # predecessor). Together they tell a machine that came back while this server was down from a job
        # starting (worker_hello).
        self._fresh: set[int] = set()
        self._mid_job: set[int] = set()
        # Workers whose first hello to this run said fresh, pushed since or not: one is new to the job of a
        # mid-job worker whose hello comes later, whatever it pushed before that hello (its queued pushes can
        # reach the last server back before the peer's hello: a hang, benchmarks/double_fault.py).
        self._came_fresh: set[int] = set()
        # Workers that told this run their replays are in (Restored: on a first connection to a run, and after
        # a restart's replays): until every other worker did, a new worker's round is not known (query_waits).
        self._restored: set[int] = set()
        self.waited_out: set[int] = set()  # workers whose query waited its longest once: none waits again
        # Workers that pushed (or replayed) here in this run: one that never did (a daemon idle since it
        # started never says Reset) is as one without processes when the others' job ends (_clear_if_all_reset).
        self._active: set[int] = set()
        # The last push's lag: its arrival after its round's first push (or replay), on the caller's clock;
        # None where the push joined no round (refused, stale, held, a mismatch). Straggler attribution.
        self.lag: float | None = None

    # -- a round's life --------------------------------------------------------------
    def current(self, token: Token) -> bool:
        """Whether ``token``'s round is still the key's open round and still needs its sum."""
        st = self.keys.get(token.key)
        return st is not None and st.gen == token.gen and st.failed is None and st.restart.result is None

    def push(self, push: Push, payload: np.ndarray, handle: W, now: float, *,
             borrowed: Lease | None = None) -> list[Action[W]]:
        """One worker's contribution to a round. ``borrowed``: ``payload`` is the colocated worker's
        memory (it is only ever read, never kept past the round), with its :data:`Lease`. Sets :attr:`lag`."""
        self.lag = None
        key = (push.name, push.part)
        st = self.keys.get(key) or self._open(key, push.round)
        if push.resumed and (answer := self._resumed(st, push, handle)) is not None:
            return answer
        if push.round < st.round:
            return [Fail(push, handle, self._past(st, push))]
        if push.round == st.round + 1 and st.failed is None and (push.worker in st.restart.replayers
                                                                 or push.worker in st.restart.passed):
            st.restart.held_next.append(Held(push, payload, borrowed, handle))  # see "Server restarts"
            return []
        actions: list[Action[W]] = []
        if push.round > st.round:
            if st.busy:
                actions.append(self._fail_round(st, Why(f"tensor {push.name!r} round {st.round} abandoned: "
                                                        f"worker {push.worker} moved on to round {push.round}")))
            failed = (st.round, st.failed) if st.failed is not None else None
            st = self._open(key, push.round)
            st.previous_failure = failed
        if push.worker in self._gone or push.worker in self._reset or push.worker not in self._active:
            self._pushed(push.worker)
        refusal = self._refusal(st, push)
        if refusal is not None:
            return actions + [Fail(push, handle, refusal)]
        if st.first is None:
            replayed = st.restart.replayed
            if replayed is not None and descriptor(replayed) != descriptor(push):  # (not answered with its sum)
                st.waiters[push.worker] = Waiter(push, handle)
                return actions + [self._fail_round(st, Why.pushes_disagree(replayed, push))]
            st.first = push
            if not st.restart.replayers:
                st.opened = now
        elif descriptor(st.first) != descriptor(push):
            st.waiters[push.worker] = Waiter(push, handle)
            return actions + [self._fail_round(st, Why.pushes_disagree(st.first, push))]
        else:
            self.joined_at[push.worker] = now  # (see joined_at)
        waiter = st.waiters[push.worker] = Waiter(push, handle)
        self.lag = now - st.opened
        if st.restart.result is not None:  # the sum is known from a replay
            st.restart.answered.add(push.worker)
            return actions + [Answer((waiter,), st.restart.result), *self._settle(st)]
        if push.kind == KIND_BROADCAST:
            return actions + self._broadcast(st, push, payload, borrowed)
        if self.deterministic or push.dtype in dtypes.HALF_TYPES:
            # Keep every contribution, then one pass over all of them in worker-id order (see the module
            # docstring): deterministic, and for half types cheaper than a float32 accumulator.
            st.held[push.worker] = (payload, borrowed)
            if len(st.held) < self.n_workers:
                return actions
            inputs = tuple(st.held[worker][0] for worker in sorted(st.held))
            leases = tuple(lease for _, lease in st.held.values() if lease is not None)
            st.held.clear()
            return actions + [SumAll(st.token, push, inputs, leases)]
        return actions + [Add(st.token, push, payload, borrowed)]

    @staticmethod
    def _past(st: Round[W], push: Push) -> Why:
        """Why ``push``, of a round ``st``'s key is past, fails: that round's failure (a late push to a failed
        round hears why), else a stale round."""
        if st.previous_failure is not None and st.previous_failure[0] == push.round:
            return st.previous_failure[1].for_push(push)
        return Why(f"tensor {push.name!r} part {push.part}: stale round {push.round}, the server is at round "
                   f"{st.round}")

    def _resumed(self, st: Round[W], push: Push, handle: W) -> list[Action[W]] | None:
        """A push sent again after its connection broke (see "Dropped connections"): the answer its round's
        state gives, or None where it is an ordinary push."""
        if push.round == st.round and st.failed is None and push.worker in st.waiters:
            waiter = st.waiters[push.worker] = Waiter(push, handle)  # (its contribution is in already)
            if push.worker in st.restart.answered and st.restart.result is not None:
                return [Answer((waiter,), st.restart.result)]  # (a replay answered it: the answer died too)
            return []
        if push.round == st.last_sum:
            return [Fail(push, handle, Why(
                f"tensor {push.name!r} part {push.part}: round {push.round} was summed for the other workers, but "
                f"worker {push.worker}'s answer was lost with its connection", "answer_lost"))]
        return None

    def _broadcast(self, st: Round[W], push: Push, payload: np.ndarray,
                   borrowed: Lease | None) -> list[Action[W]]:
        """One worker's push of a broadcast round: keep the root's data; once every worker pushed, its copy
        is the result (see "Broadcasts")."""
        if push.holds_root:
            if st.held:
                return [self._fail_round(st, Why(f"tensor {push.name!r}: workers {min(st.held)} and {push.worker} "
                                                 f"both hold broadcast root rank {push.root}"))]
            st.held[push.worker] = (payload, borrowed)
        if len(st.waiters) < self.n_workers:
            return []
        if not st.held:
            return [self._fail_round(st, Why(f"tensor {push.name!r}: no worker holds broadcast root rank "
                                             f"{push.root}"))]
        ((data, lease),) = st.held.values()
        st.held.clear()
        return [SumAll(st.token, push, (data,), () if lease is None else (lease,))]

    def _refusal(self, st: Round[W], push: Push) -> Why | None:
        """Why a push of the key's open round cannot join it, if it cannot."""
        if st.failed is not None:
            return st.failed.for_push(push)
        if push.worker in st.waiters:
            return Why(f"tensor {push.name!r} part {push.part}: worker {push.worker} pushed round {push.round} twice")
        missing = self.lost_workers - set(st.waiters)
        if missing:
            return Why.worker_gone(min(missing), f"worker {min(missing)} is gone (disconnected, or no training "
                                                 f"processes for longer than {self.lost_grace_s:g} s); round "
                                                 f"{push.round} of {push.name!r} cannot complete")
        return None

    def added(self, token: Token) -> bool:
        """The driver summed one more contribution of ``token``'s round into its accumulator; whether
        that was the last one (False, too, when the round is no longer current: drop the sum)."""
        if not self.current(token):
            return False
        st = self.keys[token.key]
        st.added += 1
        return st.added == self.n_workers

    def complete(self, token: Token) -> Complete[W] | None:
        """The sum of ``token``'s round is ready: open the next round and say whom to answer;
        None if the round failed or was superseded while the sum was being made."""
        if not self.current(token):
            return None
        st = self.keys[token.key]
        self._open(token.key, st.round + 1).last_sum = st.round
        if self.jobs.pending:
            self.jobs.met(st.waiters.keys())
        return Complete(token.key, st.round, st.opened, tuple(st.waiters.values()))

    def round_for(self, name: str, part: int, worker: int, local: int = 0, failed: bool = False,
                  given_up: bool = False) -> int:
        """The round that ``worker``'s round ``local`` of key (name, part) is, for a worker whose round
        numbering starts afresh (see RoundQuery). ``local`` when no other worker was mid-job as the worker's
        numbering started (every worker starts a job together: the numbers are the same); for a rejoining
        worker, the round the others are in, or the next one if that one failed or already has the worker;
        -1 if ``local`` is a failed fused step's (that step's round and the next one look alike here); the
        round the others are in, failed or not, if ``local`` is a round given up beside a step's other names
        (``given_up``: the peers' step that failed by the same fault as ours is that one)."""
        if worker not in self._rejoining:
            return local
        if failed:
            return -1
        st = self.keys.get((name, part))
        if st is None:
            return 0
        mine = (worker in st.waiters or worker in st.restart.replayers or worker in st.restart.answered
                or worker in st.restart.passed)
        if given_up:
            return st.round + (1 if mine else 0)
        done = st.failed is not None or mine
        if not done:
            st.restart.placed.add(worker)  # (a replay of it that comes now no longer passes it: its push comes)
        return st.round + (1 if done else 0)

    def query_waits(self, worker: int, name: str, part: int = 0, failed: bool = False, given_up: bool = False) -> bool:
        """Whether a round query of ``worker`` for key (name, part) waits before :meth:`round_for` answers it.

        The worker is new to this run (fresh, or rejoining) while another worker has not told it its replays
        yet (Restored), or is not connected now (back, it may make the new one rejoin: a dropped connection's
        gap). Whether that one is mid-job (so the new one rejoins, worker_hello), and where (its replays and
        given-up rounds), is not known before: answered at once, a machine back while this server was down too
        took a job starting for its own and failed its first steps as stale rounds (a review's case).

        Or the worker rejoins peers that are mid-job with our predecessor, and none of them pushed the key
        here yet: the peers' round of it is not known (no state is not "a name nobody pushed yet" after a
        restart), nor is a failed round's next one (their aborts of earlier rounds come first). Answered
        with what this run had seen, the new machine's names were placed a step apart (a hang). Not for a
        failed round (answered -1 whatever the peers do).

        The caller bounds the wait: a worker that never comes leaves the rounds to the sweep, as ever."""
        if (worker in self._fresh or worker in self._rejoining) and worker not in self.waited_out and any(
                w != worker and (w not in self._restored or not self.connected(w)) for w in range(self.n_workers)):
            return True
        return (not failed and worker in self._rejoining
                and not self._peers_round_known(worker, (name, part), failed_too=given_up))

    def _peers_round_known(self, worker: int, key: Key, failed_too: bool) -> bool:
        """Whether key's round among the peers of rejoining ``worker`` is known here (see query_waits); a
        failed round is, ``failed_too``, for a round given up (RoundQuery.given_up)."""
        if not self._mid_job_peer(worker):
            return True  # (no peer numbered against our predecessor: what this run saw is all there is)
        st = self.keys.get(key)  # (a push of another rejoiner's is no peer's round: it was placed by a guess too)
        return st is not None and (st.last_sum is not None or bool(st.restart.replayers)
                                   or any(w in self._mid_job for w in st.waiters if w != worker)
                                   or (failed_too and st.failed is not None))

    def worker_restored(self, worker: int) -> None:
        """``worker`` told this run its replays are in (Restored)."""
        self._restored.add(worker)

    def summed(self, name: str, part: int, round_: int) -> bool:
        """Whether round ``round_`` of key (name, part) was summed: it is the key's last sum (a later round
        could not be summed without the worker that asks, see RoundQuery.fate)."""
        st = self.keys.get((name, part))
        last = st.last_sum if st is not None else self._ended_sums.get((name, part))
        return last is not None and last == round_

    def fail(self, token: Token, why: Why) -> list[Action[W]]:
        """The driver could not sum round ``token`` (a borrowed contribution's memory shrank): fail it
        for every worker, now and for late pushes. Nothing to do where the round is gone already."""
        if not self.current(token):
            return []
        return [self._fail_round(self.keys[token.key], why)]

    def unfused(self, name: str) -> tuple[set[int], Push] | None:
        """The workers that pushed ``name``'s open round at this anchor (partition 0) and its first push, if
        one is open and has not failed: what a fused report of the name meets (see ``bps_server.fusion``)."""
        st = self.keys.get((name, 0))
        if st is None or not st.busy or st.first is None:
            return None
        return set(st.waiters), st.first

    def fail_open(self, name: str, why: Why) -> list[Action[W]]:
        """Fail ``name``'s open round at this anchor (partition 0) for every worker, now and for late pushes:
        another worker issued the name fused (its size on the other side of the fusion limit)."""
        st = self.keys.get((name, 0))
        if st is None or not st.busy:
            return []
        return [self._fail_round(st, why)]

    def fail_ended(self, ended: Callable[[str], bool], why: Why) -> list[Action[W]]:
        """Fail the open round of every key whose name is ``ended`` (a fused tensor of a lane generation that a
        worker's reset ended, see ``bps_server.fusion``: its rounds can never complete), and forget those keys.
        Nothing can need them again: the driver refuses later pushes and aborts of those names before they reach
        the table, and no plan uses an ended generation's names. Kept, they would grow the table by a lane
        generation's keys at every reset of any worker, for as long as the job runs."""
        gone = [st for st in self.keys.values() if ended(st.key[0])]
        actions: list[Action[W]] = [self._fail_round(st, why) for st in gone if st.busy]
        for st in gone:
            del self.keys[st.key]
            if st.last_sum is not None:  # (a worker whose link gave up may still ask it: RoundQuery.fate)
                self._ended_sums[st.key] = st.last_sum
        while len(self._ended_sums) > ENDED_SUMS_KEPT:
            del self._ended_sums[next(iter(self._ended_sums))]
        return actions

    def abort(self, name: str, part: int, round_: int, worker: int, why: Why) -> list[Action[W]]:
        """A worker gave up a round (``why``: its reason, code and facts): fail it for every worker (now and for
        late pushes), each hearing the worker's reason as its side of it (a mismatch: :meth:`Why.for_push`)."""
        key = (name, part)
        st = self.keys.get(key)
        actions: list[Action[W]] = []
        if st is not None and round_ > st.round and st.busy:  # (pushed, or only replayed: its held pushes)
            actions.append(self._fail_round(st, Why(f"tensor {name!r} round {st.round} abandoned: worker "
                                                    f"{worker} aborted round {round_}")))
        if st is None or round_ > st.round:
            failed = (st.round, st.failed) if st is not None and st.failed is not None else None
            st = self._open(key, round_)
            st.previous_failure = failed  # a late push of the failed round still hears why
        if st.round == round_:
            st.aborted.add(worker)
            if st.failed is None:
                actions.append(self._fail_round(st, why.relayed(f"tensor {name!r} round {round_} aborted by "
                                                                f"worker {worker}")))
        return actions

    def past(self, name: str, workers: AbstractSet[int]) -> bool:
        """Whether ``workers`` (some) all gave up ``name``'s current round at this anchor (partition 0), which
        failed: they are past it, so what they say of the name now (a fused report) is of a later step, not of
        the step of a late push of that round."""
        st = self.keys.get((name, 0))
        return st is not None and st.failed is not None and bool(workers) and workers <= st.aborted

    # -- after a restart ---------------------------------------------------------------
    def replay(self, push: Push, data: np.ndarray, now: float) -> list[Action[W]]:
        """A worker's copy of a round's sum from this server's previous run (see "Server restarts")."""
        key = (push.name, push.part)
        self._active.add(push.worker)
        st = self.keys.get(key) or self._open(key, push.round)
        actions: list[Action[W]] = []
        if push.round > st.round and not st.waiters:
            # A later round finished on our predecessor, so every worker pushed it, so nobody can
            # still need this one (failed here or not: a worker told us it gave it up, and its peers are past
            # it too): what was held for the later round waits there now.
            held = st.restart.held_next
            st = self._open(key, push.round)
            actions.append(Redispatch(tuple(held)))  # they run once this replay is recorded
        if push.round != st.round or st.failed is not None:
            return actions + [Note(logging.INFO, f"ignoring worker {push.worker}'s replay of {push.name!r} part "
                                                 f"{push.part} round {push.round}: the server is at round "
                                                 f"{st.round}{' (failed)' if st.failed else ''}")]
        reference = st.first if st.first is not None else st.restart.replayed
        if reference is not None and descriptor(reference) != descriptor(push):
            return actions + [Note(logging.WARNING, f"ignoring worker {push.worker}'s replay of {push.name!r} "
                                                    f"part {push.part}: {describe(push)}, but the round's pushes "
                                                    f"are {describe(reference)}")]
        restart = st.restart
        if restart.result is None:
            restart.result = np.array(data, copy=True)  # `data` may be the worker's memory
            restart.replayed = push
        if not restart.replayers and st.first is None:
            st.opened = now
        restart.replayers.add(push.worker)
        restart.passed |= self._rejoining - restart.replayers - restart.placed - set(st.waiters)
        unanswered = tuple(w for worker, w in st.waiters.items() if worker not in restart.answered)
        restart.answered.update(w.push.worker for w in unanswered)
        if unanswered:
            actions.append(Answer(unanswered, restart.result))
        return actions + self._settle(st)

    def _settle(self, st: Round[W]) -> list[Action[W]]:
        """Once every worker replayed the round or got its replayed sum, move on and let the held
        next-round pushes in."""
        if (len(st.restart.replayers | st.restart.answered | st.restart.passed) < self.n_workers
                or self.keys.get(st.key) is not st):
            return []
        self._open(st.key, st.round + 1).last_sum = st.round
        return [Settled(st.key, st.round), Redispatch(tuple(st.restart.held_next))]

    def waiting_for(self, st: Round[W]) -> list[int]:
        """The workers round ``st`` still waits for: neither pushed nor replayed it, nor got its sum."""
        return sorted(set(range(self.n_workers)) - set(st.waiters) - st.restart.replayers - st.restart.answered
                      - st.restart.passed)

    # -- workers coming and going ------------------------------------------------------
    def sweep(self, now: float) -> list[Action[W]]:
        """Fail every round that has waited longer than ``lost_grace_s`` (since its first push) for a
        worker that is not connected or has no training processes (reset and not pushed since), and with
        ``stall_s`` every one that has waited that long for connected workers; the server calls this
        periodically."""
        actions: list[Action[W]] = []
        for st in list(self.keys.values()):
            if not st.busy or now - st.opened < self.lost_grace_s:
                continue
            waiting = self.waiting_for(st)
            absent = [w for w in waiting if not self.connected(w) or w in self._reset]
            what = f"round {st.round} of {st.key[0]!r}"
            if absent:
                actions.append(self._fail_round(st, Why.absent_worker(
                    absent[0], self.connected(absent[0]), self.lost_grace_s, what, self.server)))
            elif stalled(waiting, st.opened, now, self.stall_s, self.joined_at):
                actions.append(self._fail_round(st, Why.stalled_workers(waiting, self.stall_s, what)))
        return actions

    def worker_lost(self, worker: int) -> list[Action[W]]:
        """The worker daemon's connection dropped: fail every incomplete round still waiting for it.

        Rounds started later wait up to ``lost_grace_s`` for the worker to come back (a
        restarted daemon); after that they fail at once until it pushes again.
        """
        actions: list[Action[W]] = [self._mark_gone(worker, "is disconnected")]
        if worker not in self._reset:  # (a worker that reset stays one without processes)
            self._dropped.add(worker)
            self._ended_dropped.discard(worker)
        self._reset.add(worker)
        actions += self._fail_waiting_for(worker, "is disconnected")
        return actions + self._clear_if_all_reset()

    def grace_expired(self, worker: int, gone: int, why: str) -> list[Action[W]]:
        """``lost_grace_s`` passed since :class:`StartGrace` ``gone``: if the worker has not come back
        since, it is lost, and every round waiting for it fails."""
        if self._gone.get(worker) != gone:
            return []
        self.lost_workers.add(worker)
        return self._fail_waiting_for(worker, why)

    def worker_hello(self, worker: int, epoch: str, fresh: bool = False) -> list[Action[W]]:
        """A worker daemon connected, with its round numbering. A hello alone does not bring training
        processes back (a worker that reset, or a new daemon, stays one without processes until it pushes);
        the same numbering back after a dropped connection is the same processes, waited for as any
        connected worker's (a slow one fails nothing). A dropped worker back with another numbering is a
        new daemon: its processes are gone, as a Reset would have said (the job may be over everywhere now).

        ``fresh`` (Hello.fresh): the worker's processes numbered nothing against the servers yet. A worker
        this run never heard of, fresh, while another connected worker's hello said its numbering is in use
        (it is mid-job, numbered against our predecessor: this server restarted), is a machine that came back
        while this server was down (a double fault): it rejoins as one whose new numbering we saw would (else
        its first steps failed as stale rounds until its numbering caught up), whichever of the two hellos
        comes first. Where every hello says fresh, a first hello is a job starting."""
        self._gone.pop(worker, None)
        self.lost_workers.discard(worker)
        previous = self._epochs.get(worker)
        cleared: list[Action[W]] = []
        if worker in self._dropped:
            self._dropped.discard(worker)
            if epoch == previous:  # back after a dropped connection: its processes never left
                self._reset.discard(worker)
            else:
                cleared = self._clear_if_all_reset()
        if epoch:
            self._epochs[worker] = epoch
        if previous is None and epoch and not fresh:  # numbered against our predecessor: it restarted mid-job
            self._mid_job.add(worker)
        elif fresh or previous != epoch:  # (the same numbering back on a new connection: as it was)
            self._mid_job.discard(worker)
        if worker in self._mid_job:  # (back after a drop too: a new worker may have come meanwhile)
            for other in sorted(self._came_fresh - self._rejoining - {worker}):
                cleared += self._rejoin_unknown(other)
        if previous is None and fresh and epoch:
            self._fresh.add(worker)
            self._came_fresh.add(worker)
            return cleared + self._rejoin_unknown(worker)
        self._fresh.discard(worker)
        if previous != epoch:  # (a new numbering: see _numbering_restarted)
            self._came_fresh.discard(worker)
        # A first hello is a job (or this server) starting, not a worker coming back: the workers of a
        # job do not connect at the same instant, and must not line up with each other's first rounds.
        if epoch and previous is not None and previous != epoch:
            self._numbering_restarted(worker)
            if worker in self._rejoining:
                return cleared + [Note(logging.INFO, f"worker {worker} came back (a new daemon) while other "
                                                     f"workers are mid-job: it rejoins them")]
        return cleared

    def worker_idle(self, worker: int) -> None:
        """``worker``'s daemon says it has no training processes (Hello.processes: it never had since it started,
        or they left): as after its Reset, a round that waits for them fails after the timeout (sweep) until it says
        Joined or pushes. A daemon idle since it started never says Reset: a round that waited for processes of it
        that never came waited for ever (stall warnings only), where after a job's end it failed naming the worker
        (a review's case). Nothing fails now: it had no rounds here."""
        if worker not in self._reset:
            self._idle.add(worker)
        self._reset.add(worker)
        self._mid_job.discard(worker)

    def worker_reset(self, worker: int, epoch: str = "", spared: Spared = spare_none) -> list[Action[W]]:
        """The worker has no training processes any more (its job ended or died).

        Every incomplete round fails: none can complete as pushed. But those ``spared`` (by their pushers) are
        of a later job than the processes that left (bps_server.jobs): they wait for the worker's next ones.
        Later rounds that need the worker wait up to ``lost_grace_s`` for a new job's processes. Once every
        worker has reset, all key state is dropped, so the next job starts at round 0 on a clean slate instead
        of meeting the last job's leftovers.
        """
        actions: list[Action[W]] = []
        for st in list(self.keys.values()):
            if st.waiters and st.failed is None and not spared(st.waiters.keys()):
                actions.append(self._fail_round(st, Why.worker_gone(
                    worker, f"worker {worker} has no training processes left (they exited or died); round "
                            f"{st.round} of {st.key[0]!r} cannot complete")))
        actions.append(self._mark_gone(worker, "has no training processes"))
        self._mid_job.discard(worker)
        self._came_fresh.discard(worker)
        self._reset.add(worker)
        self._dropped.discard(worker)
        self._idle.discard(worker)
        if epoch:
            self._epochs[worker] = epoch
        cleared = self._clear_if_all_reset()
        if not cleared:
            self._numbering_restarted(worker)
        return actions + cleared

    def _rejoin_unknown(self, worker: int) -> list[Action[W]]:
        """``worker``, fresh and unknown to this run, rejoins if another connected worker is mid-job (see
        worker_hello): the rounds replayed from our predecessor no longer wait for it (its new processes had
        no part in them)."""
        if not self._mid_job_peer(worker):
            return []
        self._rejoining.add(worker)
        actions: list[Action[W]] = [Note(logging.INFO, f"worker {worker} came back (a new daemon, or new "
                                                       f"processes) while this server was down and other workers "
                                                       f"are mid-job: it rejoins them")]
        for st in list(self.keys.values()):
            if (st.restart.replayers and st.failed is None and worker not in st.waiters
                    and worker not in st.restart.placed):
                st.restart.passed.add(worker)
                actions += self._settle(st)
        return actions

    def _mid_job_peer(self, worker: int) -> bool:
        """Whether another worker, connected and with processes, is mid-job with our predecessor (worker_hello)."""
        return any(w != worker and w in self._mid_job and w not in self._reset and self.connected(w)
                   for w in range(self.n_workers))

    def _pushed(self, worker: int) -> None:
        """A push of ``worker``'s after it was gone or reset (its processes are back), or its first here."""
        self._fresh.discard(worker)
        if worker in self._gone or worker in self._reset:
            self.worker_joined(worker)
        self._active.add(worker)

    def processes_ended(self, worker: int, now: float) -> Spared:
        """``worker``'s processes ended (a Reset, its daemon's restart) at ``now`` (``time.monotonic()``): whether a
        round that given workers pushed is of a later job than those processes (bps_server.jobs), for
        :meth:`worker_reset` and the fused planner."""
        alive = [w for w in range(self.n_workers) if w != worker and self.connected(w) and self.had_processes(w)]
        return self.jobs.ended(worker, alive, now)

    def had_processes(self, worker: int) -> bool:
        """Whether ``worker``'s processes were there when we last heard of its daemon: it said no Reset (nor, in
        its hello, that it had none) since its last push or Joined; a dropped connection alone leaves them,
        unless the job ended everywhere since (its rounds went with it: a crashed machine's next job)."""
        return worker not in self._reset or (worker in self._dropped and worker not in self._ended_dropped)

    def worker_joined(self, worker: int) -> None:
        """The worker is back (a hello, or a push after a reset)."""
        self._gone.pop(worker, None)
        self.lost_workers.discard(worker)
        self._reset.discard(worker)
        self._dropped.discard(worker)
        self._ended_dropped.discard(worker)
        self._idle.discard(worker)

    def _numbering_restarted(self, worker: int) -> None:
        others_mid_job = any(w != worker and w not in self._reset and self.connected(w) for w in range(self.n_workers))
        if self.keys and others_mid_job:
            self._rejoining.add(worker)
        else:
            self._rejoining.discard(worker)

    def _clear_if_all_reset(self) -> list[Action[W]]:
        """No worker has training processes (or a connection), and one at least said so (a Reset, or a new
        daemon's hello): the job is over everywhere; the next one starts at round 0 on a clean slate.
        Connections that all dropped prove nothing: their daemons come back with the same processes, mid-job,
        and a round that failed meanwhile must stay failed for the worker that pushes it late (a hang
        before: it opened the round afresh and waited for peers that had given it up). A worker that never pushed
        here counts as one without processes: a daemon idle since it started never says Reset, and a failure of
        the last job that waited for it made the next job's rounds one apart (wrong sums, a review's case)."""
        gone = self._reset | (set(range(self.n_workers)) - self._active)
        # Not unless one of them said its processes left (a Reset, or a new daemon's hello): a worker only
        # disconnected may have them still, and so may a dropped one beside one idle since it started (a hang
        # otherwise: the two were taken for the job's end, the round that failed on the idle machine's drop was
        # forgotten, and its late process's push opened it afresh and waited for ever, test_dropped_links).
        if len(gone) < self.n_workers or not self._reset - self._dropped - self._idle:
            return []
        dropped = len(self.keys)
        self.keys.clear()
        self._ended_sums.clear()
        self._rejoining.clear()
        self._fresh.clear()
        self._came_fresh.clear()
        self._mid_job.clear()
        self.waited_out.clear()
        # The next job's workers are waited for afresh (a round fails only if one has still neither
        # connected nor pushed after the timeout: sweep), not failed at once for having been gone from the
        # last job. They stay in _reset until they push.
        self.lost_workers.clear()
        self._gone.clear()
        self._ended_dropped = set(self._dropped)
        return [Cleared(dropped)]

    def _mark_gone(self, worker: int, why: str) -> StartGrace:
        self._gone_count += 1
        self._gone[worker] = self._gone_count
        return StartGrace(worker, self._gone_count, why)

    def _fail_waiting_for(self, worker: int, why: str) -> list[Action[W]]:
        return [self._fail_round(st, Why.worker_gone(worker, f"worker {worker} {why}; round {st.round} of "
                                                             f"{st.key[0]!r} cannot complete"))
                for st in list(self.keys.values())
                if st.waiters and worker not in st.waiters and st.failed is None]

    # -- internals -----------------------------------------------------------------------
    def _open(self, key: Key, round_: int) -> Round[W]:
        self._gen += 1
        previous = self.keys.get(key)
        st = self.keys[key] = Round(key, round_, self._gen, last_sum=previous.last_sum if previous else None)
        return st

    def _fail_round(self, st: Round[W], why: Why) -> FailRound[W]:
        """Mark the round failed (late pushes of it get ``why``) and say whom to tell."""
        st.failed = why
        st.held.clear()
        fails = [Fail(w.push, w.handle, why.for_push(w.push)) for worker, w in st.waiters.items()
                 if worker not in st.restart.answered]
        st.waiters.clear()
        held_next, st.restart.held_next = st.restart.held_next, []
        fails += [Fail(h.push, h.handle, Why(f"tensor {h.push.name!r} round {h.push.round} cannot start: round "
                                             f"{st.round} failed: {why.text}")) for h in held_next]
        return FailRound(st.key, st.round, why, tuple(fails))
