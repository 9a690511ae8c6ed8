"""A tensor name's local rounds on one machine, and their numbers: pure decisions, no I/O.

Theory of operation. Each of a machine's ``local_size`` training processes issues an ``Op`` per tensor
name per round. The ops of one name collect in a *local round* until every local rank submitted; then
the round is ready (the daemon runs the operation, ``bps_worker.operation``). A round fails when two
processes disagree about the tensor (the error names both ranks and both tensors), when a process
leaves before the round completed, when a process it waits for is not even connected after the
timeout, or when the job resets (every process left). A failed round stays open until every local
rank has submitted to it or left, so that a late process gets the error of *its* round instead of
starting the next one with stale data; a process that submits a name while its own op of that name
is still collecting is refused (it must synchronize first), unless the rounds open are failed ones.

Every local round of a name consumes one number, whether it succeeds or fails, so all workers agree
on round numbers as long as every process issues each name once per round (the contract). Local
numbering starts at 0 with every job; the servers' number of a round is the local one plus a *base*
that the daemon learns once per name (``RoundQuery`` to the server of the name's partition 0), so that
a machine that comes back joins the round the other machines are in (``RoundNumbers``).

``LocalRounds`` only decides: each call returns the actions the daemon must carry out, in order
(``Opened``, ``Refused``, ``Failed``, ``Ready``). It never sends, waits or reads the clock; the
daemon passes in what it knows (which ranks are connected, how long it waited). A member is whatever
the daemon uses to answer a process (its session); the rounds only keep it to hand it back.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar, Union

from bps_runtime.stalls import stalled
from protocol.messages import Failure, FailureCode, Op, Why, describe_tensor

M = TypeVar("M")  # what the daemon answers a process through (its session)


def describe(op: Op) -> str:
    """The tensor as a mismatch message names it: ``float32[4,3] (average)`` (:func:`describe_tensor`)."""
    return describe_tensor(op.dtype, op.shape, op.kind, average=op.average, root=op.root, staleness=op.staleness,
                           layout=op.layout)


def agree(a: Op, b: Op) -> bool:
    """Whether two processes asked for the same operation on the same tensor (dtype, shape, kind, root, and
    the layout a framework layer gave it)."""
    return (a.kind, a.dtype, list(a.shape), a.average, a.root, bool(a.cuda), a.layout, a.staleness) == \
        (b.kind, b.dtype, list(b.shape), b.average, b.root, bool(b.cuda), b.layout, b.staleness)


def ops_disagree(first: Op, first_rank: int, other: Op, other_rank: int) -> Why:
    """Ranks ``first_rank`` and ``other_rank`` asked for different operations on one tensor."""
    detail = f"rank {first_rank} has {describe(first)} but rank {other_rank} has {describe(other)}"
    return Why.mismatch(first.name, describe(first), describe(other), detail)


def failure_for(why: Why, op: Op) -> Failure:
    """The Failure that answers ``op`` (a mismatch: the process hears its own tensor as ``ours``)."""
    return why.heard_by(describe(op)).failure(op.req)


def waited_why(name: str, ranks: list[int], worker_id: int, rank_offset: int, waited_s: float,
               connected: bool) -> Why:
    """Tensor ``name``'s round on this machine waited ``waited_s`` for local ``ranks``: not connected (the timeout),
    or connected but never submitting it (``connected``: cluster.stall_timeout). Local and fused rounds alike."""
    listed = ", ".join(str(rank_offset + r) for r in ranks)
    if connected:
        text = f"rank {listed} of worker {worker_id} did not submit it (cluster.stall_timeout)"
        return Why(f"tensor {name!r}: {text}, waited {waited_s:g} s", "timeout",
                   what=f"tensor {name!r}", timeout_s=waited_s, detail=text)
    text = f"rank {listed} of worker {worker_id} is not connected"
    return Why(f"tensor {name!r}: {text} (waited {waited_s:g} s)", "timeout", what=f"tensor {name!r}",
               timeout_s=waited_s, detail=text)


@dataclass(eq=False)
class LocalRound(Generic[M]):
    """One name's round on this machine: the local processes' contributions so far."""

    name: str
    round: int  # our local number; the servers' is this plus the name's base
    first: Op  # what every other op must agree with
    first_rank: int  # the global rank that submitted ``first``
    expected: set[int]  # local ranks that have not submitted yet
    members: dict[int, tuple[M, Op]] = field(default_factory=dict)  # by local rank
    why: Why | None = None  # why the round failed; late ranks still join it and get this error
    # The index the step took among the name's fused rounds here (FusedRounds.skip; -1: none, a fused round of
    # the step was open), and whether the anchor's planner heard of the step's failure already: peers that
    # issued the name fused in this step wait there (see WorkerDaemon._failed).
    fused_index: int = -1
    planner_told: bool = False
    # When the daemon opened it (its loop's clock; None until then): the watch for absent processes
    # (LocalRounds.overdue_rounds) counts from here.
    opened_at: float | None = None

    @property
    def failed(self) -> str | None:
        return None if self.why is None else self.why.text

    def ordered(self) -> list[tuple[M, Op]]:
        """The members in local-rank order (the order of the local sum)."""
        return [self.members[r] for r in sorted(self.members)]


@dataclass(frozen=True, eq=False)
class Opened(Generic[M]):
    """A new round: learn its name's round base from the servers and watch it for absent processes."""

    round: LocalRound[M]


class _Answered:
    """What a refusal or a failure says, read from its :class:`~protocol.messages.Why`."""

    why: Why

    @property
    def reason(self) -> str:
        return self.why.text

    @property
    def code(self) -> FailureCode:
        return self.why.code


@dataclass(frozen=True, eq=False)
class Refused(_Answered, Generic[M]):
    """Answer this one op with a failure (a late op of a failed round, or an op already in flight)."""

    member: M
    op: Op
    why: Why

    def failure(self) -> Failure:
        """The Failure that answers the op."""
        return failure_for(self.why, self.op)


@dataclass(frozen=True, eq=False)
class Failed(_Answered, Generic[M]):
    """The round failed: answer ``members`` with the failure, and abort the round at the anchor server
    (the peers on other machines wait there), as ``server_round`` if its base was known, else once learned."""

    round: LocalRound[M]
    members: tuple[tuple[M, Op], ...]
    server_round: int | None
    why: Why

    def failure(self, op: Op) -> Failure:
        """The Failure that answers member ``op`` (its own side of a mismatch)."""
        return failure_for(self.why, op)


@dataclass(frozen=True, eq=False)
class Ready(Generic[M]):
    """Every local process submitted and they agree: run the operation."""

    round: LocalRound[M]


Action = Union[Opened[M], Refused[M], Failed[M], Ready[M]]


class RoundNumbers:
    """Per name: the next local round number, and the base that turns ours into the servers'."""

    __slots__ = ("_next", "_base", "_learned_from")

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        self._base: dict[str, int] = {}
        self._learned_from: dict[str, int] = {}  # the first local round whose servers' number was learned

    def take(self, name: str) -> int:
        """The number of a new local round of ``name`` (every round consumes one)."""
        number = self._next.get(name, 0)
        self._next[name] = number + 1
        return number

    def learn(self, name: str, local_round: int, server_round: int) -> int:
        """The servers said that our round ``local_round`` of ``name`` is their ``server_round``:
        remember and return the base (the offset from ours to theirs)."""
        base = self._base[name] = server_round - local_round
        if local_round < self._learned_from.get(name, local_round + 1):
            self._learned_from[name] = local_round
        return base

    def issued(self, name: str, local_round: int) -> bool:
        """Whether our round ``local_round`` of ``name`` was numbered (taken) in this job."""
        return self._next.get(name, 0) > local_round

    def placed_beside(self, name: str, local_round: int) -> bool:
        """Whether another name's round ``local_round`` (the same step, where every step issues every name) was
        numbered with a learned base: that step went to the servers (see WorkerDaemon.give_up_failed_round)."""
        return any(first <= local_round < self._next.get(other, 0)
                   for other, first in self._learned_from.items() if other != name)

    def base(self, name: str) -> int | None:
        """The base of ``name`` if learned in this job."""
        return self._base.get(name)

    def server_round(self, name: str, local_round: int) -> int | None:
        """The servers' number of our round ``local_round`` of ``name``, once its base is known."""
        base = self._base.get(name)
        return None if base is None else local_round + base

    def forget(self, name: str) -> None:
        """``name`` is never numbered again (a fused tensor of a lane generation that ended)."""
        self._next.pop(name, None)
        self._base.pop(name, None)
        self._learned_from.pop(name, None)

    def reset(self) -> None:
        """A new job: numbering starts at 0 again and every base must be learned again."""
        self._next.clear()
        self._base.clear()
        self._learned_from.clear()


class LocalRounds(Generic[M]):
    """Every name's open local rounds on one machine, oldest first, and their numbering."""

    def __init__(self, local_size: int, worker_id: int, rank_offset: int) -> None:
        self.local_size = local_size
        self.worker_id = worker_id
        self.rank_offset = rank_offset  # global rank of local rank 0
        self.numbers = RoundNumbers()
        # Per name, the rounds still collecting local processes (and failed ones waiting for late
        # processes), oldest first.
        self.open: dict[str, list[LocalRound[M]]] = {}

    def is_open(self, lr: LocalRound[M]) -> bool:
        return lr in self.open.get(lr.name, ())

    def submit(self, member: M, local_rank: int, op: Op) -> list[Action[M]]:
        """Local rank ``local_rank`` asks for ``op``: join the oldest round of its name that it is not in."""
        rank = self.rank_offset + local_rank
        rounds = self.open.setdefault(op.name, [])
        lr = next((r for r in rounds if local_rank not in r.members), None)
        actions: list[Action[M]] = []
        if lr is None:
            if any(r.failed is None for r in rounds):
                return [Refused(member, op, Why(f"tensor {op.name!r} is already in flight for rank {rank}; "
                                                f"synchronize it before pushing it again", "bad_request"))]
            lr = LocalRound(op.name, self.numbers.take(op.name), op, rank, set(range(self.local_size)))
            rounds.append(lr)
            actions.append(Opened(lr))
        lr.members[local_rank] = (member, op)
        lr.expected.discard(local_rank)
        if lr.why is not None:
            actions.append(Refused(member, op, lr.why))
            self.retire(lr)
        elif not agree(lr.first, op):
            actions += self.fail(lr, ops_disagree(lr.first, lr.first_rank, op, rank))
        elif not lr.expected:
            self.retire(lr)
            actions.append(Ready(lr))
        return actions

    def fail(self, lr: LocalRound[M], reason: str | Why, code: FailureCode = "error") -> list[Action[M]]:
        """Fail a round (once): its members so far get ``reason``, later ones too (see ``submit``).

        ``reason``: the text (with ``code``), or a :class:`Why` with its code and facts."""
        if lr.why is not None:
            return []
        lr.why = reason if isinstance(reason, Why) else Why(reason, code)
        self.retire(lr)
        return [Failed(lr, tuple(lr.members.values()), self.numbers.server_round(lr.name, lr.round), lr.why)]

    def fail_name(self, name: str, why: Why, answered: Collection[int] = ()) -> list[Action[M]]:
        """Fail every open round of ``name`` with ``why``. The local ranks in ``answered`` heard it already, by
        another way (their fused entries of the name): the rounds do not wait for them to submit."""
        actions: list[Action[M]] = []
        for lr in list(self.open.get(name, ())):
            lr.expected.difference_update(answered)
            actions += self.fail(lr, why)
            self.retire(lr)  # a round failed before may now expect nobody
        return actions

    def retire(self, lr: LocalRound[M]) -> None:
        """Forget a round that starts now, or that failed and has heard from every local rank."""
        if lr.expected:
            return
        rounds = self.open.get(lr.name, [])
        if lr in rounds:
            rounds.remove(lr)
        if not rounds:
            self.open.pop(lr.name, None)

    def leave(self, local_rank: int, pid: int) -> list[Action[M]]:
        """Local rank ``local_rank`` (process ``pid``) disconnected: it drops out of every open round
        (its memory is about to go), and each round it was part of or awaited by fails."""
        rank = self.rank_offset + local_rank
        actions: list[Action[M]] = []
        for rounds in list(self.open.values()):
            for lr in list(rounds):
                involved = local_rank in lr.members or local_rank in lr.expected
                lr.members.pop(local_rank, None)
                lr.expected.discard(local_rank)
                if involved and lr.failed is None:
                    text = f"tensor {lr.name!r}: rank {rank} (pid {pid}) disconnected during round {lr.round}"
                    actions += self.fail(lr, Why(text, "connection", peer=f"rank {rank} (pid {pid})",
                                                 detail=f"it disconnected during round {lr.round} of "
                                                        f"tensor {lr.name!r}"))
                else:
                    self.retire(lr)
        return actions

    def overdue_rounds(self, connected: Collection[int], now: float, timeout_s: float, stall_s: float = 0.0,
                       heard: Mapping[int, float] | None = None) -> list[Action[M]]:
        """The watch of every open round, which the daemon runs a few times per timeout: each one open for
        ``timeout_s`` or more (since its ``opened_at``) that waits for a process that is not even connected fails,
        and, with ``stall_s`` (cluster.stall_timeout; 0: never), each open that long for connected ones that did
        not catch up for as long (``heard``: when each local rank last joined a round its peers opened). One
        pass over the open rounds, and nothing kept per round in between: a timer per round held every round of
        the last timeout, with its ops, until it fired."""
        actions: list[Action[M]] = []
        for rounds in list(self.open.values()):
            for lr in list(rounds):
                if lr.opened_at is not None and now - lr.opened_at >= timeout_s:
                    late = stalled(sorted(lr.expected), lr.opened_at, now, stall_s, heard or {})
                    actions += self.overdue(lr, connected, stall_s if late else timeout_s, late=late) or []
        return actions

    def overdue(self, lr: LocalRound[M], connected: Collection[int], waited_s: float,
                late: bool = False) -> list[Action[M]] | None:
        """The watch of an open round after ``waited_s``: None when there is nothing left to watch (the
        round started, or failed), [] when every rank it waits for is connected (merely slow: look again
        later; ``late``: it stalled, see :func:`bps_runtime.stalls.stalled`, and fails all the same), else its
        failure: a process that is not connected must not make its peers hang."""
        if lr.failed is not None or not self.is_open(lr):
            return None
        absent = sorted(r for r in lr.expected if r not in connected)
        if not absent and not late:
            return []
        return self.fail(lr, waited_why(lr.name, absent or sorted(lr.expected), self.worker_id, self.rank_offset,
                                        waited_s, connected=not absent))

    def reset(self) -> list[Action[M]]:
        """Every process left: fail every open round, and start numbering at 0 again."""
        actions: list[Action[M]] = []
        for rounds in list(self.open.values()):
            for lr in list(rounds):
                actions += self.fail(lr, f"tensor {lr.name!r}: every process of worker {self.worker_id} left")
        self.open.clear()
        self.numbers.reset()
        return actions
