"""The Summation Service's value store: asynchronous mode's keys, their values and who waits on them.

Theory of operation. A key is ``(tensor name, partition index)``, split by the same placement as the
sums. In asynchronous mode the server *holds* each key's value (a parameter) and has no rounds:

* ``async_init`` (one push per worker machine): the push of the machine that holds the root rank
  (``Push.holds_root``) sets the value, unless the key has one; every init is answered with the value
  (held until the root's arrived; failed after the timeout, naming the root's machine) and the key's
  *applied vector*: per worker, the last step of its deltas that the value holds. The worker numbers its
  later pushes of the key from its own entry, so a worker daemon that rejoins (counting its rounds from 0
  again) is not taken for a replay of old steps. The next init of each key by a machine that left the job
  (its processes reset, or it was declared dead) while the key was there raises its entry to the furthest
  machine's before it is answered (``_Key.behind``; a restarted server's keys owe none: lost): back in
  a job that went on without it, it would otherwise hold the others back by the staleness bound until it had
  pushed as many steps as they did meanwhile (a review's find: for as long as it was away). Its skipped steps
  are ones it never pushed, which the replay check and the bound allow. A machine that inits late at a job's
  start (it never left) keeps its entry: the bound holds it to the others' pace from its first step.
* ``async`` (a machine's delta, the sum of its local processes' deltas, step ``t``): ``t <= applied[w]``
  is a replay (the delta is in the value already: answered, not added again); a later ``t`` is added at
  once, in float32 for float16/bfloat16 (the kernels' accumulate), and ``applied[w] = t``. Steps may skip
  (a local round that failed before its push consumed one): a skipped step was never acknowledged, so
  "every acknowledged delta is in the value, once" still holds.
* The staleness bound ``s`` (set by the inits; ``None``: unbounded): the answer to step ``t`` is held while
  a *live* machine's entry is below ``t - s``. It then carries the value and vector of that moment (which
  hold the pusher's delta). ``s = 0`` is bulk-synchronous. A machine is live unless its processes all left
  (``Reset``) or it has been disconnected for the timeout; when the timeout declares it dead, the answers
  it held back fail with a connection error naming it, and it holds nobody back until it connects again.
  A connected but slow machine is waited for, with a stall note after the timeout.

Server restarts. A restarted server has no values. Every answer carries the value and the vector, and
each worker keeps its last answer per key; on its first connection to a run of the server it replays them
(``restore``; none to a run it never talked to before, or from a daemon that started anew) and then says
``Restored``. The run cannot tell whether it is a restart, nor whether a worker holds copies, before every
worker said so: from its first contact with a worker (a push, a copy, a ``Restored``) until every worker
said so (or the timeout passed; :data:`RESTORE_GRACE_S` where the workers waited for never connected to this
run) no push or init is applied to any key: they wait, in arrival order. (A worker that came first with no
copies, say a rejoining root, would otherwise set the value that a survivor's copy then replaced or
contradicted.) A restore is taken
when the key has no value or its vector dominates the key's (entry by entry at least as large): the old
server produced every copy in one order, so the freshest copy dominates the others. A delta pushed
again afterwards is added only if the vector does not cover its step. float16/bfloat16 values restored
from a copy lose the float32 accumulator's extra bits (the copy travelled in the tensor's dtype).

Job reset: when every worker reset (its processes all left), every key is dropped, as the round table's, but a
named job's (see "Jobs"): its processes may all restart at once, and its values go when another job begins.

Jobs. Daemons outlive jobs, and jobs end at different times per machine: the next job's init may come while a
machine of the last one still lingers (connected after its last step), so no job reset came between them. A
process names its job (``BPS_JOB``; empty: not known); its worker tells every server the job when its processes
join (``Joined.job``; ``Hello.job`` and how long ago they began, for a restarted server), and its asynchronous
pushes carry it (``Push.job``). A cluster runs one job at a time (every machine takes part in it), so the job
that began last is the newest and the others ended (``_Jobs``: a job begins when its processes join a machine
while no other machine's are of it, unless that machine's last processes were of it too, a rejoin). At each
join the keys of every named job but the newest are dropped (what waited on them fails, naming both jobs), and
a push of an ended job is refused at once, naming both (a process of the last job that pushed after the next
one began: nothing added). Without it, the next job's init was taken for a rejoin and answered with the
last job's value. A machine whose processes are of another job holds none of a job's keys back (the staleness
bound), and its first init of them raises its entry, as for a machine that left. A worker's ``Joined`` ends its
reset: its machine's next job is there, though it has not pushed yet. Where either side names no job, pushes
are taken as one job's. A restarted server learns the workers' jobs and their ages from their Hellos, before
their copies: a copy of any job but the newest is ignored.

Like :mod:`bps_server.rounds`, the store makes every decision and does no I/O: the caller passes ``now``
and carries out the returned actions (answer, fail, note). Unlike the round table it also adds, with the
same kernels, in the call: a delta is one pass over its partition, and the answer must be the value
right after it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar, Union

import numpy as np

from bps_runtime import kernels
from bps_runtime.stalls import stalled
from protocol.messages import KIND_ASYNC, KIND_ASYNC_INIT, Push

from .rounds import Lease, Why, describe

# How long a restore waits for workers that have not connected to this run at all (below the timeout): a
# worker daemon alive through a restart reconnects within its links' reconnect delay (a second apart at most),
# and one that starts afresh holds no copies. So a machine that is down, or starts late, holds a fresh
# cluster's asynchronous pushes back this long, not a whole timeout.
RESTORE_GRACE_S = 5.0

Key = tuple[str, int]
W = TypeVar("W")


@dataclass(frozen=True, slots=True)
class Answer(Generic[W]):
    """Answer ``push`` with ``value`` (a copy in the tensor's storage dtype) and the ``applied`` vector."""

    handle: W
    push: Push
    value: np.ndarray
    applied: list[int]


@dataclass(frozen=True, slots=True)
class Fail(Generic[W]):
    handle: W
    push: Push
    why: Why


@dataclass(frozen=True, slots=True)
class Note:
    """Something for the log."""

    level: int
    message: str


Action = Union[Answer[W], Fail[W], Note]


@dataclass(slots=True)
class _Waiter(Generic[W]):
    push: Push
    handle: W
    since: float
    data: np.ndarray | None = None  # a pending push's own copy of its delta
    warned: bool = False


@dataclass(slots=True)
class _Key(Generic[W]):
    """One key's state: its descriptor, value, vector and waiters."""

    first: Push  # the push that made the key: what every later one must agree with
    staleness: int | None
    value: np.ndarray | None  # the accumulator (float32 for half types); None until the root's init
    applied: list[int]
    inits: list[_Waiter[W]] = field(default_factory=list)  # inits waiting for the root's value
    held: list[_Waiter[W]] = field(default_factory=list)  # answers waiting for the staleness bound
    # Machines that left the job while the key was there (their processes reset, or declared dead): their next
    # init of it raises their entry to the furthest machine's (see the module docstring, _answer_init).
    behind: set[int] = field(default_factory=set)
    job: str = ""  # the job whose value it is (the first push naming one; see "Jobs")
    # An init refused as a mismatch is one side's error; the machines of the other side hear it at their next
    # delta of the key (refused: not added, as any refused push, so its machine numbers its next delta alike),
    # as a synchronous mismatch fails every pusher (the root's went on with the first shape, never told: a review
    # of the contract). Only the machines in the job then (not one away, whose next processes were not involved).
    owed: dict[int, Why] = field(default_factory=dict)


def _other_job(job: str, other: str) -> bool:
    """Whether ``job`` and ``other`` are two jobs (both named, and not alike; see "Jobs")."""
    return bool(job and other and other != job)


def _descriptor(push: Push) -> tuple[object, ...]:
    return push.dtype, tuple(push.shape), push.offset, push.count


def _staleness(push: Push) -> int | None:
    return None if push.staleness < 0 else push.staleness


def _heard(why: Why, push: Push) -> Why:
    """``why`` as the machine of ``push`` hears it: a mismatch among the root's processes, with its own tensor as
    "ours" where it is one of the two sides."""
    return why.heard_by(describe(push)) if why.sides else why


def _dominates(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) and all(x >= y for x, y in zip(a, b))


class _Jobs:
    """Which named job each worker's processes are of, and when each job began (see "Jobs").

    A job begins when its processes join a worker (Joined; a Hello says how long ago, for a restarted server) and
    no other worker's processes are of it, unless that worker's last processes were of it too (a process of the
    job restarted on its machine: a rejoin); else it began when it first did. A job is remembered while some
    worker's processes are, or its last ones were, of it (a lingering machine between two of its processes must
    not make it new again, a review): so a job taken for the newest whose processes left is forgotten once its
    machine's next processes (the running job's) join. The newest job is the remembered one that began last (not
    the last among those with processes now: the running job between two of its processes is still the newest,
    a review); the others ended."""

    def __init__(self) -> None:
        self.began: dict[str, float] = {}  # each named job's beginning, on this run's clock
        self.of_worker: dict[int, str] = {}  # the job of each worker's processes now (until its reset)
        self.last: dict[int, str] = {}  # the job of each worker's last processes

    def begins(self, worker: int, job: str, began: float) -> None:
        """``worker``'s processes are of ``job``, begun at ``began``."""
        elsewhere = any(theirs == job for w, theirs in self.of_worker.items() if w != worker)
        known = self.began.get(job)
        if known is None or not (elsewhere or self.last.get(worker) == job):
            self.began[job] = began
        else:
            self.began[job] = min(known, began)
        self.of_worker[worker] = self.last[worker] = job
        remembered = set(self.of_worker.values()) | set(self.last.values())
        for ended in [j for j in self.began if j not in remembered]:
            del self.began[ended]  # (no process of it is left, nor a machine whose last it was: used again, anew)

    def pushes(self, worker: int, job: str) -> None:
        """``worker`` pushed for ``job``, which began already: its processes are of it (where no Joined or Hello
        of theirs said so: pushes of an unnamed job's processes, say)."""
        self.of_worker[worker] = self.last[worker] = job

    def left(self, worker: int) -> None:
        self.of_worker.pop(worker, None)

    def newest(self) -> str | None:
        return max(self.began, key=self.began.__getitem__) if self.began else None

    def after(self, job: str) -> str | None:
        """The job that began after ``job`` (which ended then: every job but the newest did), or None."""
        newest = self.newest()
        return newest if newest != job else None


class ValueStore(Generic[W]):
    """Every asynchronous key of one server (see the module docstring). ``worker_of_rank`` names the
    machine of a root rank in errors; ``timeout_s`` is the cluster's timeout; ``stall_s`` its stall_timeout (an
    answer held that long for connected machines behind the staleness bound fails; 0: never)."""

    def __init__(self, n_workers: int, *, timeout_s: float, worker_of_rank: Callable[[int], int],
                 stall_s: float = 0.0) -> None:
        self.n = n_workers
        self.timeout_s = timeout_s
        self.stall_s = stall_s
        self.worker_of_rank = worker_of_rank
        self.keys: dict[Key, _Key[W]] = {}
        self.pending: list[_Waiter[W]] = []  # pushes and inits that wait for a restore or a value, in order
        self.restoring_since: float | None = None  # first contact of this run, until every worker restored
        self.restored: set[int] = set()  # workers that sent their copies (all of them once the restore is over)
        self.disconnected: dict[int, float] = {}  # since when
        # Workers that connected to this run: one that never does (a machine that died before this server
        # restarted) counts as disconnected from this run's first sweep, or it held the others back for ever.
        self.seen: set[int] = set()
        self.excluded: set[int] = set()  # declared dead, or reset: they hold nobody back
        self.reset_workers: set[int] = set()
        self.epochs: dict[int, str] = {}  # each worker's numbering (its daemon's epoch), as it last connected
        self.replays = 0  # pushes whose step the value held already (answered, not added again)
        self.pushed_at: dict[int, float] = {}  # each worker's last push here (busy, not stalled: see _watch_held)
        # Names whose root's machine failed an init before pushing it (init_failed): why, the root, and the
        # attempt (the machines' local round of the name), until the root's next init.
        self.failed_inits: dict[str, tuple[Why, int, int]] = {}
        self.jobs = _Jobs()  # which named job each worker's processes are of, and when each job began ("Jobs")

    def has(self, name: str, part: int) -> bool:
        return (name, part) in self.keys

    # -- pushes --------------------------------------------------------------------------------------
    def push(self, push: Push, payload: np.ndarray, handle: W, now: float, lease: Lease | None = None
             ) -> list[Action[W]]:
        """An ``async_init`` or ``async`` push of ``payload`` (read now, or copied if it must wait)."""
        self._contact(now)
        refusal, actions = self._job_of(push, now)
        if refusal is not None:
            return [*actions, Fail(handle, push, refusal)]
        self._joined(push.worker)
        self.pushed_at[push.worker] = now
        waiter = _Waiter(push, handle, now)
        if self.restoring_since is not None or (
                push.kind != KIND_ASYNC_INIT and self._value_of(push) is None):
            return actions + self._wait(waiter, payload, lease)
        actions += self._apply(waiter, payload, lease, now)
        if self.pending and push.kind == KIND_ASYNC_INIT:
            actions += self._retry_pending(now)  # the root's init may have given their key a value
        return actions

    def _job_of(self, push: Push, now: float) -> tuple[Why | None, list[Action[W]]]:
        """Where ``push``'s job stands (see "Jobs"): why it is refused (another job began after it), and what a job
        this run did not know yet does (a push before its worker's Joined or Hello said it: it begins now)."""
        job = push.job
        if not job:
            return None, []
        if job in self.jobs.began:
            self.jobs.pushes(push.worker, job)
            actions: list[Action[W]] = []
        else:
            actions = self._job_begins(push.worker, job, now)
        newer = self.jobs.after(job)
        if newer is None:
            return None, actions
        what = "async_init" if push.kind == KIND_ASYNC_INIT else "async push"
        return Why(f"{what} of {push.name!r} part {push.part} by worker {push.worker} is job {job!r}'s, but job "
                   f"{newer!r} began after it, which ended job {job!r} here (nothing added): stop this process, or "
                   f"run its job again under a BPS_JOB of its own", "error"), actions

    def _job_begins(self, worker: int, job: str, began: float) -> list[Action[W]]:
        """``worker``'s processes are of ``job`` (Joined, Hello), begun at ``began`` (this run's clock): the keys
        of every named job but the newest go (it became the newest, or another one's processes left since), and
        what waited on them (or waits in ``pending``) fails. (A look over the keys: once per process generation.)"""
        self.jobs.begins(worker, job, began)
        newest = self.jobs.newest()
        if newest is None:
            return []
        ended = [key for key, st in self.keys.items() if _other_job(st.job, newest)]
        actions: list[Action[W]] = []
        for key in ended:
            st = self.keys.pop(key)
            why = Why(f"the value of {key[0]!r} part {key[1]} was job {st.job!r}'s; job {newest!r} began after it",
                      "round_failed")
            actions += [Fail(w.handle, w.push, why) for w in (*st.inits, *st.held)]
        keep: list[_Waiter[W]] = []
        for w in self.pending:
            if _other_job(w.push.job, newest):
                actions.append(Fail(w.handle, w.push, Why(f"job {newest!r} began after job {w.push.job!r}",
                                                          "round_failed")))
            else:
                keep.append(w)
        self.pending = keep
        if ended:
            actions.append(Note(logging.INFO, f"job {newest!r} began: dropping {len(ended)} asynchronous values of "
                                              f"the jobs before it"))
        return actions

    def _value_of(self, push: Push) -> np.ndarray | None:
        st = self.keys.get((push.name, push.part))
        return None if st is None else st.value

    def _wait(self, waiter: _Waiter[W], payload: np.ndarray, lease: Lease | None) -> list[Action[W]]:
        """Keep ``waiter`` (with a copy of its data) until the restore ends or the key gets a value."""
        try:
            if lease is not None:
                lease()
            waiter.data = payload.copy()
        except OSError as exc:
            return [Fail(waiter.handle, waiter.push, Why(f"{exc}", "error"))]
        self.pending.append(waiter)
        return []

    def _apply(self, w: _Waiter[W], payload: np.ndarray, lease: Lease | None, now: float) -> list[Action[W]]:
        push = w.push
        key = (push.name, push.part)
        st = self.keys.get(key)
        actions: list[Action[W]] = []
        if st is None:  # (the machines away now owe a raise at their init of it too, and those in another job)
            st = self.keys[key] = _Key(push, _staleness(push), None, [0] * self.n,
                                       behind=set(self.excluded) | self._in_other_jobs(push.job), job=push.job)
        elif not st.job:
            st.job = push.job
        if st.value is None and push.kind == KIND_ASYNC_INIT and push.holds_root:
            self.failed_inits.pop(push.name, None)  # (its next attempt)
            actions += self._root_decides(st, push)
        elif push.kind == KIND_ASYNC_INIT and (failed := self._failed_attempt(st, push)) is not None:
            return [Fail(w.handle, push, failed)]
        owed = st.owed.pop(push.worker, None) if push.kind == KIND_ASYNC else None
        if owed is not None and owed.sides is not None:
            return [*actions, Fail(w.handle, push, owed.heard_by(owed.sides[0]))]
        # (an init before the root's value waits for it, and is judged by it then: judged by the first init that
        # came, one that agrees with the root was refused where a wrong one had come first, a review)
        undecided = st.value is None and push.kind == KIND_ASYNC_INIT
        refusal = None if undecided else self._refusal(st, push)
        if refusal is not None:
            return [*actions, Fail(w.handle, push, self._refused(st, push, refusal))]
        try:
            if lease is not None and (push.kind != KIND_ASYNC_INIT or push.holds_root):
                lease()
            if push.kind == KIND_ASYNC_INIT:
                return actions + self._init(st, w, payload, now)
            return actions + self._delta(st, w, payload, now)
        except OSError as exc:
            return [*actions, Fail(w.handle, push, Why(f"{exc}", "error"))]

    def _in_other_jobs(self, job: str) -> set[int]:
        """The workers whose processes are of another named job than ``job`` (see "Jobs")."""
        return {w for w, theirs in self.jobs.of_worker.items() if _other_job(theirs, job)}

    def init_failed(self, name: str, root: int, round_: int, why: Why, worker: int = -1) -> list[Action[W]]:
        """Root rank ``root``'s machine failed its ``async_init`` of ``name`` (its local round ``round_``) before
        pushing it (InitFailed): the inits from that root that wait here for its value fail with ``why`` (each side
        of a mismatch hears its own), and so do those of that attempt that come later (they waited the whole
        timeout for a value that never came, a review); until the root's next init, or any machine's reset.
        An attempt is a local round of the name, which every machine counts alike, a failed one too: a retry is
        a later round, and waits for the root's value (a machine whose own attempt failed too, or timed out
        here, retries so; failing its next init instead failed a good retry, a review of the first version).
        ``worker``: the root's machine; where its processes are of a job that ended (see "Jobs"), it is ignored (a
        lingering process of the last job must not fail the next job's inits of the name)."""
        job = self.jobs.of_worker.get(worker, "")
        if job and job in self.jobs.began and self.jobs.after(job) is not None:
            return [Note(logging.INFO, f"worker {worker}'s failed async_init of {name!r} is job {job!r}'s, which "
                                       f"ended: ignored")]
        self.failed_inits[name] = (why, root, round_)
        actions: list[Action[W]] = []
        for (key, _), st in self.keys.items():
            if key == name and st.value is None:
                # Every init from that root waiting now, whatever its round: none is answered by this attempt,
                # and a machine that reset counts its rounds from 0 again (the root's machine, restarted, failed
                # its round 0 while the others waited in their round 1: they waited the timeout, a review).
                failed = [w for w in st.inits if w.push.root == root]
                st.inits = [w for w in st.inits if w not in failed]
                actions += [Fail(w.handle, w.push, _heard(why, w.push)) for w in failed]
        return actions

    def _failed_attempt(self, st: _Key[W], push: Push) -> Why | None:
        """Why an init of a key without a value fails at once: its root's machine failed this attempt (see
        init_failed)."""
        failed = self.failed_inits.get(push.name)
        if failed is None or st.value is not None or (push.root, push.round) != failed[1:]:
            return None
        return _heard(failed[0], push)

    def _root_decides(self, st: _Key[W], root: Push) -> list[Action[W]]:
        """The root's init describes the value: the inits that waited for it and disagree fail."""
        st.first = root
        keep: list[_Waiter[W]] = []
        fails: list[Action[W]] = []
        for w in st.inits:
            why = self._refusal(st, w.push)
            if why is None:
                keep.append(w)
            else:
                fails.append(Fail(w.handle, w.push, self._refused(st, w.push, why)))
        st.inits = keep
        return fails

    def _refusal(self, st: _Key[W], push: Push) -> Why | None:
        """Why ``push`` disagrees with the key: a mismatch whose sides are the key's (first) and the push's
        (second); None if it agrees. A key restored from a copy of a delta (a server restart) knows its bound but
        not its root: an init is held to that bound, and the first one that agrees stands for the root from then
        on (``_init``)."""
        first = st.first
        if _descriptor(push) != _descriptor(first):
            return Why.pushes_disagree(first, push)
        if push.kind != KIND_ASYNC_INIT:
            return None
        if first.kind == KIND_ASYNC_INIT and (push.root != first.root or push.staleness != first.staleness):
            ours, theirs = describe(first), describe(push)  # (with their roots and bounds)
            return Why.mismatch(push.name, ours, theirs, f"worker {first.worker} initialised it as {ours} but "
                                                         f"worker {push.worker} as {theirs}")
        if first.kind != KIND_ASYNC_INIT and _staleness(push) != st.staleness:
            ours, theirs = describe(dataclasses.replace(push, staleness=first.staleness)), describe(push)
            return Why.mismatch(push.name, ours, theirs, f"the value restored from worker {first.worker}'s copy has "
                                                         f"the bound of {ours} but worker {push.worker} initialised "
                                                         f"it as {theirs}")
        return None

    def _refused(self, st: _Key[W], push: Push, why: Why) -> Why:
        """``push`` is refused (``why``, from :meth:`_refusal`): the error its sender hears. A refused init is owed
        to every other machine, which hears it at its next delta of the key (see ``_Key.owed``)."""
        assert why.sides is not None
        if push.kind == KIND_ASYNC_INIT:
            away = self.excluded | self._in_other_jobs(st.job)
            for worker in range(self.n):
                if worker != push.worker and worker not in away:
                    st.owed.setdefault(worker, why)
        return why.heard_by(why.sides[1])

    def _init(self, st: _Key[W], w: _Waiter[W], payload: np.ndarray, now: float) -> list[Action[W]]:
        push = w.push
        if st.value is None and push.holds_root:
            st.value = kernels.new_accumulator(push.dtype, push.count)
            kernels.accumulate(st.value, payload, push.dtype, first=True)
            st.first, st.staleness = push, _staleness(push)
            waiting, st.inits = st.inits, []
            return [a for x in (*waiting, w) for a in self._answer_init(st, x)]
        if st.value is None:
            st.inits.append(w)
            return []
        if st.first.kind != KIND_ASYNC_INIT:  # restored from a delta's copy: this init (it agreed) names the root
            st.first = push
        return self._answer_init(st, w)

    def _answer_init(self, st: _Key[W], w: _Waiter[W]) -> list[Action[W]]:
        """Answer init ``w``; where its machine left the job since the key was made (``behind``), its entry first
        goes up to the furthest machine's (the answers it held back by the bound go with it)."""
        worker = w.push.worker
        if worker not in st.behind:
            return [self._answer(st, w)]
        st.behind.discard(worker)
        if st.applied[worker] >= max(st.applied):
            return [self._answer(st, w)]
        st.applied[worker] = max(st.applied)
        return [self._answer(st, w), *self._release(st)]

    def _delta(self, st: _Key[W], w: _Waiter[W], payload: np.ndarray, now: float) -> list[Action[W]]:
        push, worker = w.push, w.push.worker
        assert st.value is not None
        if push.round == 0:
            return [Fail(w.handle, push, Why(f"async push of {push.name!r} part {push.part} by worker {worker} "
                                             f"has step 0; steps start at 1", "error"))]
        fresh = push.round > st.applied[worker]
        st.behind.discard(worker)  # (back without an init: its processes go on with their own numbering)
        if fresh:
            kernels.accumulate(st.value, payload, push.dtype, first=False)
            st.applied[worker] = push.round
        st.held.append(w)
        if fresh:
            return self._release(st)
        self.replays += 1
        return [Note(logging.INFO, f"worker {worker} pushed step {push.round} of {push.name!r} part {push.part} "
                                   f"again; the value holds it already (not added twice)"), *self._release(st)]

    def _answer(self, st: _Key[W], w: _Waiter[W]) -> Answer[W]:
        assert st.value is not None
        push = w.push
        out = np.empty(push.count, kernels.STORAGE[push.dtype])
        kernels.finalize(out, st.value, push.dtype)  # a copy: the value moves on while the answer is written
        return Answer(w.handle, push, out, list(st.applied))

    # -- the staleness bound -------------------------------------------------------------------------
    def _blockers(self, st: _Key[W], step: int) -> list[int]:
        """The live machines whose entries hold back an answer to ``step``."""
        if st.staleness is None:
            return []
        floor = step - st.staleness
        away = self.excluded | self._in_other_jobs(st.job)
        return [w for w in range(self.n) if w not in away and st.applied[w] < floor]

    def _release(self, st: _Key[W]) -> list[Action[W]]:
        free = [w for w in st.held if not self._blockers(st, w.push.round)]
        if not free:
            return []
        st.held = [w for w in st.held if w not in free]
        return [self._answer(st, w) for w in free]

    # -- restarts ------------------------------------------------------------------------------------
    def restore(self, push: Push, payload: np.ndarray, now: float) -> list[Action[W]]:
        """A worker's copy of a key's value and vector from this server's previous run (a replayed push)."""
        self._contact(now)
        key = (push.name, push.part)
        st = self.keys.get(key)
        applied = list(push.applied)
        if len(applied) != self.n:
            return [Note(logging.WARNING, f"worker {push.worker}'s copy of {push.name!r} part {push.part} has a "
                                          f"vector of {len(applied)} workers, not {self.n}: ignored")]
        if st is not None and _other_job(st.job, push.job):
            return [Note(logging.WARNING, f"worker {push.worker}'s copy of {push.name!r} part {push.part} is job "
                                          f"{push.job!r}'s, but the value is job {st.job!r}'s: ignored")]
        if push.job and (push.job not in self.jobs.began or self.jobs.after(push.job) is not None):
            return [Note(logging.WARNING, f"worker {push.worker}'s copy of {push.name!r} part {push.part} is job "
                                          f"{push.job!r}'s, which is not the newest job here: ignored")]
        if st is None:
            st = self.keys[key] = _Key(push, _staleness(push), None, [0] * self.n, job=push.job)
        elif not st.job:
            st.job = push.job
        if _descriptor(push) != _descriptor(st.first):
            return [Note(logging.WARNING, f"worker {push.worker}'s copy of {push.name!r} part {push.part} is "
                                          f"{describe(push)}, not {describe(st.first)}: ignored")]
        if st.value is not None and not _dominates(applied, st.applied):
            if not _dominates(st.applied, applied):
                return [Note(logging.WARNING, f"worker {push.worker}'s copy of {push.name!r} part {push.part} "
                                              f"(steps {applied}) is neither older nor newer than the value's "
                                              f"(steps {st.applied}): ignored")]
            return []
        if st.value is None:
            st.value = kernels.new_accumulator(push.dtype, push.count)
        kernels.accumulate(st.value, payload, push.dtype, first=True)
        st.applied = applied
        st.staleness = _staleness(push)  # every asynchronous push carries its name's bound
        waiting, st.inits = st.inits, []
        actions: list[Action[W]] = [a for x in waiting for a in self._answer_init(st, x)]
        if self.pending and self.restoring_since is None:
            actions += self._retry_pending(now)  # a late copy: the pushes that waited for a value
        return actions

    def worker_restored(self, worker: int, now: float) -> list[Action[W]]:
        """``worker`` sent every copy it holds for this server; the restore ends once all did."""
        self._contact(now)
        self.restored.add(worker)
        if len(self.restored) >= self.n and self.restoring_since is not None:
            return self._restore_over(now)
        return []

    def _contact(self, now: float) -> None:
        """A worker reached this run: the restore starts now, unless it did or is over (module docstring)."""
        if self.restoring_since is None and len(self.restored) < self.n:
            self.restoring_since = now

    def _restore_over(self, now: float) -> list[Action[W]]:
        self.restoring_since = None
        self.restored = set(range(self.n))  # a late copy is still taken if it dominates, but waits for nobody
        return self._retry_pending(now)

    def _retry_pending(self, now: float) -> list[Action[W]]:
        """Apply the waiting pushes that can be now (in arrival order); the others keep waiting."""
        waiting, self.pending = self.pending, []
        actions: list[Action[W]] = []
        for w in waiting:
            if w.push.kind != KIND_ASYNC_INIT and self._value_of(w.push) is None:
                self.pending.append(w)
            else:
                assert w.data is not None
                actions += self._apply(w, w.data, None, now)
        return actions

    # -- workers ---------------------------------------------------------------------------------------
    def _joined(self, worker: int) -> None:
        if worker not in self.seen:  # (a push came on a connection: the worker is there)
            self.seen.add(worker)
            self.disconnected.pop(worker, None)
        self.reset_workers.discard(worker)
        if worker not in self.disconnected:
            self.excluded.discard(worker)

    def worker_joined(self, worker: int, job: str = "", now: float = 0.0, job_age_s: float = 0.0
                      ) -> list[Action[W]]:
        """``worker`` has training processes again (its Joined), of ``job``, whose first processes came there
        ``job_age_s`` ago: its reset is over, though it has not pushed yet (its machine's restart of a process of
        the job must not drop the job's values, a review)."""
        self.reset_workers.discard(worker)
        return self._job_begins(worker, job, now - job_age_s) if job else []

    def worker_connected(self, worker: int, epoch: str = "", now: float = 0.0, job: str = "",
                         job_age_s: float = 0.0) -> list[Action[W]]:
        """See :meth:`_connected`; ``job``: its processes' job, begun ``job_age_s`` ago (Hello.job)."""
        actions = self._connected(worker, epoch)
        return actions + self._job_begins(worker, job, now - job_age_s) if job else actions

    def _connected(self, worker: int, epoch: str) -> list[Action[W]]:
        """A connection of ``worker`` (again): it holds others back again, unless its processes all left (a
        reset): then only once they are back, i.e. it pushes again (``_joined``). A worker back with another
        ``epoch`` (its numbering: a daemon that started anew, or reset while its Reset was lost with a
        connection) has none of the processes it had: that is a reset, as the round table takes it (without
        it, a machine whose daemon a supervisor restarted held the others back by the staleness bound for ever,
        and the next job found the last one's values)."""
        previous = self.epochs.get(worker)
        if epoch:
            self.epochs[worker] = epoch
        self.seen.add(worker)
        self.disconnected.pop(worker, None)
        if epoch and previous is not None and previous != epoch and worker not in self.reset_workers:
            return self.worker_reset(worker)
        if worker not in self.reset_workers:
            self.excluded.discard(worker)
        return []

    def worker_disconnected(self, worker: int, now: float) -> None:
        self.disconnected.setdefault(worker, now)

    def worker_reset(self, worker: int, epoch: str = "") -> list[Action[W]]:
        """Every process of ``worker`` left: it holds nobody back; once all did, the keys go (see
        ``_every_worker_reset``). ``epoch``:
        its new numbering (a later connection with it is the same daemon, see ``worker_connected``)."""
        if epoch:
            self.epochs[worker] = epoch
        # Its processes, new, count their rounds from 0 again: a failed attempt's record no longer names the
        # same attempt on every machine (a restarted machine's good init of its round 0 was failed, a review).
        self.failed_inits.clear()
        self.reset_workers.add(worker)
        self.excluded.add(worker)
        self.jobs.left(worker)
        for st in self.keys.values():
            st.behind.add(worker)
            st.owed.pop(worker, None)  # (its next processes were not involved)
        if len(self.reset_workers) >= self.n:
            return self._every_worker_reset()
        actions: list[Action[W]] = []
        for st in self.keys.values():
            actions += self._release(st)
        return actions

    def _every_worker_reset(self) -> list[Action[W]]:
        """No worker has processes: the job ended, or all its processes restart at once. Every key goes, but a
        named job's (the newest's, see "Jobs"): they wait for its processes' return, and go when another job
        begins (a lingering machine's process of the last job that ended while the running job's restarted made
        it every worker, and its training was lost, a review). What waited fails: its processes are gone."""
        newest = self.jobs.newest()
        kept = {key: st for key, st in self.keys.items() if newest is not None and st.job == newest}
        dropped = [st for key, st in self.keys.items() if key not in kept]
        self.keys = kept
        pending, self.pending = self.pending, []
        self.restoring_since, self.restored = None, set(range(self.n))  # no worker keeps a copy of them
        self.reset_workers.clear()
        self.excluded = {w for w in self.excluded if w in self.disconnected}  # the next job waits for all
        why = Why("every worker reset: the job ended", "round_failed")
        fails: list[Action[W]] = [Fail(w.handle, w.push, why) for st in (*dropped, *kept.values())
                                  for w in (*st.inits, *st.held)]
        fails += [Fail(w.handle, w.push, why) for w in pending]
        for st in kept.values():
            st.inits, st.held = [], []
        kept_text = f"; keeping job {newest!r}'s {len(kept)} for its processes" if kept else ""
        return [*fails, Note(logging.INFO, f"every worker reset: dropping {len(dropped)} asynchronous values"
                                           f"{kept_text}")]

    def sweep(self, now: float) -> list[Action[W]]:
        """The timeout's decisions: a restore that waited long enough ends, inits and pushes that waited for
        a value fail, machines disconnected for the timeout are declared dead, slow ones noted (and with
        ``stall_s``, answers they held that long fail)."""
        actions: list[Action[W]] = []
        if self.restoring_since is not None:
            actions += self._restore_sweep(now)
        if self.restoring_since is None:
            actions += self._expire_pending(now)
        for st in self.keys.values():
            actions += self._expire_inits(st, now)
        for worker in range(self.n):
            if worker not in self.seen:
                self.disconnected.setdefault(worker, now)
        for worker, since in self.disconnected.items():
            if now - since >= self.timeout_s and worker not in self.excluded and self.keys:
                actions += self._declare_dead(worker, now - since)
        for st in self.keys.values():
            actions += self._watch_held(st, now)
        return actions

    def restore_grace_s(self) -> float:
        """How long the restore waits for workers that never connected to this run (:data:`RESTORE_GRACE_S`)."""
        return min(RESTORE_GRACE_S, self.timeout_s)

    def _restore_sweep(self, now: float) -> list[Action[W]]:
        """End the restore where the timeout passed, or the grace did and every worker it waits for has never
        connected to this run; said in the log where asynchronous values are in use (something waits)."""
        assert self.restoring_since is not None
        waited = now - self.restoring_since
        missing = sorted(set(range(self.n)) - self.restored)
        if waited < self.timeout_s and (waited < self.restore_grace_s() or any(w in self.seen for w in missing)):
            return []
        actions: list[Action[W]] = []
        if self.pending or self.keys:  # (an init waits in its key)
            actions.append(Note(logging.WARNING, f"restore at this run's start: no word from worker "
                                                 f"{', '.join(map(str, missing))} within {waited:.3g} s; "
                                                 f"going on with the copies the others sent"))
        return actions + self._restore_over(now)

    def _expire_pending(self, now: float) -> list[Action[W]]:
        late = [w for w in self.pending if now - w.since >= self.timeout_s]
        self.pending = [w for w in self.pending if w not in late]
        return [Fail(w.handle, w.push, Why(
            f"async push of {w.push.name!r} part {w.push.part}: the server holds no value for it after "
            f"{self.timeout_s:g} s (call async_init first; or the server restarted and no worker had a copy)",
            "timeout", what=f"the value of {w.push.name!r}", timeout_s=self.timeout_s)) for w in late]

    def _expire_inits(self, st: _Key[W], now: float) -> list[Action[W]]:
        late = [w for w in st.inits if now - w.since >= self.timeout_s]
        if not late:
            return []
        st.inits = [w for w in st.inits if w not in late]
        root = late[0].push.root
        machine = self.worker_of_rank(root)
        what = f"async_init of {st.first.name!r} from root rank {root} on worker {machine}"
        # (Said in the detail, which the process's error shows: the root's machine may have failed its init
        # there, e.g. its processes disagreed about the tensor, and its peers hear so only from it.)
        detail = (f"the root's value did not arrive (worker {machine} never pushed it: its processes may have "
                  f"failed this async_init there, e.g. disagreeing about the tensor; their error says why)")
        return [Fail(w.handle, w.push, Why(f"{what}: its value did not arrive within {self.timeout_s:g} s",
                                           "timeout", what=what, timeout_s=self.timeout_s, detail=detail))
                for w in late]

    def _declare_dead(self, worker: int, silent: float) -> list[Action[W]]:
        actions: list[Action[W]] = [Note(logging.WARNING, f"worker {worker} has been disconnected for "
                                                          f"{silent:.1f} s: it holds no asynchronous push back")]
        text = (f"worker {worker} disconnected {silent:.1f} s ago (limit {self.timeout_s:g} s) and holds back "
                f"this step by the staleness bound (the delta was applied)")
        for st in self.keys.values():
            blocked = [w for w in st.held if worker in self._blockers(st, w.push.round)]
            st.held = [w for w in st.held if w not in blocked]
            actions += [Fail(w.handle, w.push, Why.worker_gone(worker, text)) for w in blocked]
            st.behind.add(worker)
        self.excluded.add(worker)
        for st in self.keys.values():
            actions += self._release(st)
        return actions

    def _watch_held(self, st: _Key[W], now: float) -> list[Action[W]]:
        """The answers held by the staleness bound: failed once held ``stall_s`` (where set) with the machines
        they wait for silent here as long, else noted once held the timeout (a stall warning)."""
        notes: list[Action[W]] = []
        if self.stall_s:
            held, st.held = st.held, []
            for w in held:
                blockers = self._blockers(st, w.push.round)
                if not stalled(blockers, w.since, now, self.stall_s, self.pushed_at):
                    st.held.append(w)
                    continue
                behind = ", ".join(map(str, blockers))
                text = (f"worker {behind} did not come within the staleness bound {st.staleness} "
                        f"(cluster.stall_timeout)")
                what = f"step {w.push.round} of {w.push.name!r}"
                notes.append(Fail(w.handle, w.push, Why(f"{what} failed: {text}, waited {self.stall_s:g} s (the "
                                                        f"delta was applied)", "timeout", what=what,
                                                        timeout_s=self.stall_s, detail=text)))
        for w in st.held:
            if not w.warned and now - w.since >= self.timeout_s:
                w.warned = True
                notes.append(Note(logging.WARNING, f"stall: step {w.push.round} of {w.push.name!r} part "
                                                   f"{w.push.part} by worker {w.push.worker} has waited "
                                                   f"{now - w.since:.1f} s for worker "
                                                   f"{', '.join(map(str, self._blockers(st, w.push.round)))} "
                                                   f"(staleness bound {st.staleness})"))
        return notes
