"""Typed control messages carried in frame headers.

Each message is a small frozen dataclass; ``TYPE`` is its tag (the header's ``t``
field). A message checks itself when it is *built* (``__post_init__``: each field's
type, then :meth:`Message.validate`), so a bad value is refused where it is made,
with a :class:`LocalProtocolError` naming the field, before anything is sent.
:func:`parse` turns a decoded header into its message and re-raises the same checks
as :class:`RemoteProtocolError` (the peer's fault), so a daemon never touches an
unvalidated value. :func:`to_header` turns a message back into a map.

Connections (who sends what):

* every connection starts with ``Hello`` from the connecting side, answered by
  ``Welcome`` (or ``Failure`` and a close);
* worker -> server: ``Push`` (+ payload, or a shared-memory reference to the server on
  the worker's host), ``Abort``, ``Reset``, ``Announce``, ``Release``, ``RoundQuery`` and ``Restored``; server -> worker:
  ``Result`` (+ payload, or written in place), ``RoundInfo`` or ``Failure``; ``StatsRequest``/``Stats`` on both links;
* client -> worker (Unix socket, never a payload): ``Alloc``/``Allocated``,
  ``Op``/``Done``/``Failure``, ``OpBatch``/``DoneBatch``, ``Taken`` (results a ``Done`` named, mapped), and
  ``Leave``/``Done`` (shutdown: answered once the leave took effect).
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from dataclasses import dataclass, field
from typing import (Any, ClassVar, Final, Literal, NamedTuple, Self, Sequence, cast, get_args, get_origin,
                    get_type_hints)

from . import dtypes
from .errors import LocalProtocolError, ProtocolError, RemoteProtocolError

MAX_NAME_CHARS: Final = 1024
MAX_DIMS: Final = 32
MAX_MESSAGE_CHARS: Final = 4096
MAX_SEGMENT_CHARS: Final = 200
MAX_STREAMS: Final = 16  # TCP connections a worker may open to one server (Hello.stream)
MAX_LAYOUT_CHARS: Final = 64  # Op.layout, Push.layout: a digest and a count, not a list
MAX_JOB_CHARS: Final = 128  # Hello.job, Joined.job, Push.job: a job's name (BPS_JOB)

ROLE_WORKER: Final = "worker"
ROLE_CLIENT: Final = "client"
ROLE_OBSERVER: Final = "observer"  # may only ask a server for its statistics (tests, monitoring)
KIND_SUM: Final = "sum"
KIND_BROADCAST: Final = "broadcast"
# Asynchronous mode (bps_server.values): a name's value lives on the servers. ``async_init`` sets it from a
# root rank's tensor (once per job) and answers the value; ``async`` adds a machine's delta to it at once and
# answers the value after it. A name is of one mode for the life of a job.
KIND_ASYNC_INIT: Final = "async_init"
KIND_ASYNC: Final = "async"
KINDS: Final = (KIND_SUM, KIND_BROADCAST, KIND_ASYNC_INIT, KIND_ASYNC)
ASYNC_KINDS: Final = frozenset((KIND_ASYNC_INIT, KIND_ASYNC))
ROOTED_KINDS: Final = frozenset((KIND_BROADCAST, KIND_ASYNC_INIT))  # the kinds that name a root rank
MAX_WORKERS: Final = 1 << 16  # entries of an applied vector (Push.applied, Result.applied)

# Why an operation or a connection failed (Failure.code): a closed set, so that the receiving side picks a typed
# error from the code (bps_worker.errors.error_from_failure), never from the message text.
PlanResent = Literal["", "restart", "restart_lost", "lost"]  # see FusePlan
FailureCode = Literal[
    "error",           # anything else; the message says what
    "mismatch",        # processes disagree about a name (Failure.name, .ours, .theirs)
    "round_failed",    # a server failed the round for every worker (aborted, a worker lost, ...)
    "protocol_error",  # the peer broke the protocol; the connection closes after this Failure
    "bad_request",     # a client asked for something not allowed (the name is already in flight, ...)
    "timeout",         # something did not happen in time (Failure.what, .timeout_s)
    "connection",      # a peer is unreachable or went away (Failure.peer)
    "duplicate",       # refused: another daemon holds this worker id (Failure.peer: where it connects from)
    "answer_lost",     # a resumed push's round was summed for the other workers; its answer died with a connection
]
FAILURE_CODES: Final[frozenset[str]] = frozenset(get_args(FailureCode))


# A peer's value as an error names it: bounded in depth and length, whatever the peer sent (a value nested a
# thousand deep made repr() itself fail; a long one made the error longer than a frame may carry).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 2, 60, 60, 40
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 34  # (a whole shape one too long: 33)


def shown(value: object) -> str:
    """``repr(value)``, bounded (see _SHOWN)."""
    return _SHOWN.repr(value)


# -- checks shared by several messages' validate (each raises LocalProtocolError; parse re-raises it as remote) --
def _check_shape(shape: list[Any]) -> None:
    if len(shape) > MAX_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise LocalProtocolError(f"invalid shape {shown(shape)}: at most {MAX_DIMS} non-negative integers",
                                 what="shape", size=len(shape), limit=MAX_DIMS, unit="dimensions")


def _check_name(name: str) -> None:
    if not name or len(name) > MAX_NAME_CHARS:
        raise LocalProtocolError(f"tensor name must have 1 to {MAX_NAME_CHARS} characters, got {len(name)}",
                                 what="tensor name", size=len(name), limit=MAX_NAME_CHARS, unit="characters")


def _check_dtype(dtype: str) -> None:
    if dtype not in dtypes.ITEMSIZE:
        raise LocalProtocolError(f"unsupported dtype {shown(dtype)}")


def _check_tensor(name: str, dtype: str, shape: list[Any], kind: str) -> None:
    """What Push and Op both say about a tensor: its name, dtype, shape and operation kind."""
    _check_name(name)
    _check_dtype(dtype)
    _check_shape(shape)
    if kind not in KINDS:
        raise LocalProtocolError(f"unknown operation kind {shown(kind)}")


def _check_layout(tag: str, layout: str) -> None:
    if len(layout) > MAX_LAYOUT_CHARS:
        raise LocalProtocolError(f"{tag} layout of {len(layout)} characters; at most {MAX_LAYOUT_CHARS}",
                                 what=f"{tag} layout", size=len(layout), limit=MAX_LAYOUT_CHARS, unit="characters")


def _check_segment(segment: str, *, required: bool = False, who: str = "segment name") -> None:
    """A shared-memory segment's name: at most MAX_SEGMENT_CHARS, and not empty where ``required``."""
    if len(segment) > MAX_SEGMENT_CHARS or (required and not segment):
        least = 1 if required else 0
        raise LocalProtocolError(f"{who} of {len(segment)} characters; {least} to {MAX_SEGMENT_CHARS} allowed",
                                 what=who, size=len(segment), limit=MAX_SEGMENT_CHARS, unit="characters")


def _check_offset(offset: int) -> None:
    """Where a tensor or a result starts in a segment (Op, Done)."""
    if offset < 0:
        raise LocalProtocolError(f"negative segment offset {offset}")


def _check_non_negative(tag: str, **values: int) -> None:
    """Counters and indexes (part, round, worker, ...): the first negative one is named."""
    for name, value in values.items():
        if value < 0:
            raise LocalProtocolError(f"{tag} has a negative {name}: {value}")


def _check_vector(tag: str, applied: list[Any]) -> None:
    """An applied vector (Push.applied, Result.applied): at most MAX_WORKERS steps, none negative."""
    if len(applied) > MAX_WORKERS:
        raise LocalProtocolError(f"{tag} applied vector of {len(applied)} entries; at most {MAX_WORKERS}",
                                 what=f"{tag} applied vector", size=len(applied), limit=MAX_WORKERS, unit="entries")
    if not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in applied):
        raise LocalProtocolError(f"{tag} applied vector must hold non-negative integers: {shown(applied)}")


def _check_job_age(tag: str, age_s: float) -> None:
    """How long ago a job's processes came (Hello, Joined): finite, >= 0."""
    if not (math.isfinite(age_s) and age_s >= 0):
        raise LocalProtocolError(f"{tag}: job_age_s must be finite and >= 0, got {shown(age_s)}")


def _check_text(tag: str, name: str, text: str, limit: int = MAX_MESSAGE_CHARS) -> None:
    """A free-text field (a reason, a description) of at most ``limit`` characters."""
    if len(text) > limit:
        raise LocalProtocolError(f"{tag} {name} of {len(text)} characters; at most {limit}",
                                 what=f"{tag} {name}", size=len(text), limit=limit, unit="characters")


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every message: built means checked (field types, then :meth:`validate`); parsed means checked.

    The messages of the hot path (``CHECKED_WHEN_PARSED``: pieces, their answers, fused batches' answers and
    plans) are checked only where they come in (:func:`parse`) and by :meth:`check`: the daemons build them
    from state checked where it came in (a peer's frame, a process's request), a few per piece or tensor, and
    building them checked cost about a sixth of a worker daemon's interpreter time per operation. A bug that
    built a bad one still fails loudly, at the receiver (a protocol error). What a process builds from its
    user's arguments (Op, OpBatch, Alloc) is checked when built, as are the rare messages with free text."""

    TYPE: ClassVar[str] = ""
    CHECKED_WHEN_PARSED: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not self.CHECKED_WHEN_PARSED:
            self.check()

    def check(self) -> None:
        """Field types, then :meth:`validate`; LocalProtocolError names what is wrong."""
        _check_types(self)
        self.validate()

    def validate(self) -> None:
        """Semantic checks beyond field types; raise LocalProtocolError."""


# The handshake's fields (see protocol.handshake for the flow and what each proof covers).
MAX_NONCE_CHARS: Final = 128
MAX_PROOF_CHARS: Final = 128
MAX_SHM_KEY_CHARS: Final = 128
MAX_CONFIG_ITEMS: Final = 2048  # Hello.config_items: 2 per server, 1 per worker, 3 more (protocol.config)
MAX_CONFIG_ITEM_CHARS: Final = 300  # a key and a host name of up to 253 characters
# All of a Hello's config items together (a cluster file is refused at start-up past this or MAX_CONFIG_ITEMS,
# protocol.config): about 600 machines, each with a worker and a colocated server at 40-character addresses.
MAX_CONFIG_CHARS: Final = 96 * 1024


@dataclass(frozen=True, slots=True)
class Challenge(Message):
    """An accepting side's first frame on TCP: its fresh nonce, which the connecting side's proof covers."""

    TYPE: ClassVar[str] = "challenge"
    nonce: str
    version: int

    def validate(self) -> None:
        if not 1 <= len(self.nonce) <= MAX_NONCE_CHARS:
            raise LocalProtocolError(f"challenge nonce of {len(self.nonce)} characters; 1 to {MAX_NONCE_CHARS} "
                                     f"allowed", what="challenge nonce", size=len(self.nonce),
                                     limit=MAX_NONCE_CHARS, unit="characters")


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """The connecting side's first message (its answer to a Challenge on TCP)."""

    TYPE: ClassVar[str] = "hello"
    version: int
    role: str
    id: int
    pid: int = 0
    # With a cluster token: HMAC-SHA256 over the challenge and every other field of this Hello
    # (protocol.handshake.hello_proof), so it holds for this connection and these values only.
    auth: str = ""
    # A worker offering shared memory to the server on its host: a segment it created holding ``shm_key``
    # (hex). A server that can map it and read the key shares the host and the worker's user or group.
    shm: str = ""
    shm_key: str = ""
    # A worker's round numbering: a new epoch (its daemon restarted) means its rounds start again at 0.
    epoch: str = ""
    # A worker whose processes numbered no round of this epoch against this server yet (none learned, told
    # or pushed): a server that restarted while the worker's machine was down too places it at the others'
    # round (bps_server.rounds.RoundTable.worker_hello).
    fresh: bool = False
    # Whether a worker has training processes now. A daemon idle since it started never says Reset: one that
    # says none here is as one that did (a round that waits for it fails after the timeout, naming it), until it
    # says Joined or pushes.
    processes: bool = True
    # Which of a worker's connections to this server (0: the one for control messages; others carry pushes
    # only, see bps_worker.placement: a server with a larger share gets more, so TCP's fair sharing of a
    # link gives it a proportionally larger part).
    stream: int = 0
    # The connecting side's fresh nonce: the accepting side's proof in Welcome.auth covers it.
    nonce: str = ""
    # A worker's description of the placement-relevant cluster file (protocol.config.placement_items); a
    # server whose own differs refuses it, naming what differs.
    config_items: list[str] = field(default_factory=list)
    # A worker daemon's random id for this run of it (kept across its epochs): a server tells a reconnect
    # of the daemon that holds a worker id from a second daemon with the same id (bps_server.connection).
    daemon: str = ""
    # The server this Hello is for (a worker's or an observer's connection; -1: none named). The proof covers
    # it, and a server refuses a Hello for another: a handshake relayed unchanged to another server's address
    # is refused there (see protocol.handshake).
    server: int = -1
    # A training process's job (a client's Hello; empty: not known), as its launcher names it (BPS_JOB): a worker
    # daemon's processes are of one job at a time (bps_worker.session), and its asynchronous pushes carry it
    # (Push.job). A worker's Hello: the job of its processes now, and how long ago they began (seconds, its own
    # clock: a server compares jobs by when they began, see bps_server.values, "Jobs").
    job: str = ""
    job_age_s: float = 0.0

    def validate(self) -> None:
        if self.role not in (ROLE_WORKER, ROLE_CLIENT, ROLE_OBSERVER):
            raise LocalProtocolError(f"unknown role {shown(self.role)}")
        if self.server < -1:
            raise LocalProtocolError(f"hello: server {self.server}; a server id is at least 0 (-1: none named)")
        if not 0 <= self.stream < MAX_STREAMS:
            raise LocalProtocolError(f"hello: stream {self.stream} outside 0..{MAX_STREAMS - 1}")
        _check_job_age("hello", self.job_age_s)
        for what, text, limit in (("shared-memory probe name", self.shm, MAX_SEGMENT_CHARS),
                                  ("shared-memory key", self.shm_key, MAX_SHM_KEY_CHARS),
                                  ("proof", self.auth, MAX_PROOF_CHARS), ("nonce", self.nonce, MAX_NONCE_CHARS),
                                  ("daemon id", self.daemon, MAX_NONCE_CHARS), ("epoch", self.epoch, MAX_NONCE_CHARS),
                                  ("job", self.job, MAX_JOB_CHARS)):
            if len(text) > limit:
                raise LocalProtocolError(f"hello: {what} of {len(text)} characters; at most {limit}",
                                         what=f"hello {what}", size=len(text), limit=limit, unit="characters")
        if len(self.config_items) > MAX_CONFIG_ITEMS:
            raise LocalProtocolError(f"hello: {len(self.config_items)} config items; at most {MAX_CONFIG_ITEMS}",
                                     what="hello config_items", size=len(self.config_items),
                                     limit=MAX_CONFIG_ITEMS, unit="items")
        for item in self.config_items:
            if not isinstance(item, str) or "=" not in item or len(item) > MAX_CONFIG_ITEM_CHARS:
                raise LocalProtocolError(f"hello: config item {shown(item)} is not a 'key=value' string of at most "
                                         f"{MAX_CONFIG_ITEM_CHARS} characters")
        chars = sum(map(len, self.config_items))
        if chars > MAX_CONFIG_CHARS:
            raise LocalProtocolError(f"hello: config items of {chars} characters; at most {MAX_CONFIG_CHARS}",
                                     what="hello config_items", size=chars, limit=MAX_CONFIG_CHARS, unit="characters")


@dataclass(frozen=True, slots=True)
class Welcome(Message):
    """The accepting side's answer to a Hello it accepts (a refusal is a Failure with ``req == -1``)."""

    TYPE: ClassVar[str] = "welcome"
    version: int
    rank: int = -1
    size: int = 0
    local_rank: int = -1
    local_size: int = 0
    worker: int = -1
    workers: int = 0
    shm: bool = False  # the server accepted the worker's shared-memory offer: pushes may name segments
    incarnation: str = ""  # a server's random id for this run of it: a new one means it restarted, state lost
    # With a cluster token: HMAC-SHA256 over both nonces, the whole Hello and every other field of this
    # Welcome (protocol.handshake.welcome_proof): the server holds the token, and answers this very Hello.
    auth: str = ""
    # The server's placement digest (protocol.config.placement_digest), when the Hello carried a description.
    config_digest: str = ""
    # To a training process: the most bytes of shared-memory slots it may hold (cluster.arena_bytes); it frees
    # its least recently used idle slots (Alloc.free) to stay under it.
    arena_bytes: int = 0
    # To a training process: sums of at most this many bytes may go in an OpBatch (0: none; issue 16).
    fusion_bytes: int = 0
    # The server that answers (-1: not a server): its proof covers it, and a worker takes a Welcome only from
    # the server it meant to reach (see Hello.server).
    server: int = -1

    def validate(self) -> None:
        if self.server < -1:
            raise LocalProtocolError(f"welcome: server {self.server}; a server id is at least 0 (-1: not a server)")
        for what, text, limit in (("proof", self.auth, MAX_PROOF_CHARS),
                                  ("config digest", self.config_digest, MAX_PROOF_CHARS),
                                  ("incarnation", self.incarnation, MAX_NONCE_CHARS)):
            if len(text) > limit:
                raise LocalProtocolError(f"welcome: {what} of {len(text)} characters; at most {limit}",
                                         what=f"welcome {what}", size=len(text), limit=limit, unit="characters")


@dataclass(frozen=True, slots=True)
class Failure(Message):
    """An operation (``req``), or the connection itself (``req == -1``), failed.

    ``message`` is the whole story for a person (logs). ``code`` says what kind of failure it is, and the
    structured fields below carry the facts for that code, so that the receiver builds a typed error from
    them (``bps_worker.errors.error_from_failure``) without reading the text: ``name``/``ours``/``theirs``
    for ``"mismatch"``, ``peer`` for ``"connection"``, ``what``/``timeout_s`` for ``"timeout"``; ``detail``
    is what the typed error adds after the facts (e.g. how many partitions of an in-place array hold sums).
    A frame from before these fields parses with their defaults.
    """

    TYPE: ClassVar[str] = "failure"
    req: int
    message: str
    code: FailureCode = "error"
    name: str = ""  # the tensor the processes disagree about
    ours: str = ""  # this side's description of it (dtype, shape, kind, root, ...)
    theirs: str = ""  # the other side's
    peer: str = ""  # who is unreachable, e.g. "server 2 at 10.0.0.5:9100"
    what: str = ""  # what did not happen in time
    timeout_s: float = 0.0  # and how long it was given
    detail: str = ""
    # A refusal at the handshake, with a cluster token: HMAC-SHA256 over both nonces, the refused Hello and every
    # other field of this Failure (protocol.handshake.refusal_proof). A refusal without it is not trusted.
    auth: str = ""

    def __post_init__(self) -> None:
        # Free text built from a tensor's name is clipped, never refused: a name of 1024 characters may have a
        # repr four times as long, and a failure that could not be built would leave its waiters hanging.
        for name in _FAILURE_TEXTS:
            text = getattr(self, name)
            if isinstance(text, str) and len(text) > MAX_MESSAGE_CHARS:
                object.__setattr__(self, name, text[:MAX_MESSAGE_CHARS])
        Message.__post_init__(self)

    def validate(self) -> None:
        for name in _FAILURE_TEXTS:
            _check_text("failure", name, getattr(self, name))
        if len(self.auth) > MAX_PROOF_CHARS:
            raise LocalProtocolError(f"failure: proof of {len(self.auth)} characters; at most {MAX_PROOF_CHARS}",
                                     what="failure proof", size=len(self.auth), limit=MAX_PROOF_CHARS,
                                     unit="characters")
        if not (math.isfinite(self.timeout_s) and self.timeout_s >= 0):
            raise LocalProtocolError(f"failure timeout_s must be finite and >= 0, got {shown(self.timeout_s)}")


_FAILURE_TEXTS: Final = ("message", "name", "ours", "theirs", "peer", "what", "detail")


def describe_tensor(dtype: str, shape: Sequence[int], kind: str = KIND_SUM, *, average: bool = False,
                    root: int = -1, staleness: int = -1, layout: str = "") -> str:
    """A tensor as a mismatch names it (``float32[4,3] (average)``), in the same words wherever it is described:
    a worker's ops, a server's pushes, fused specs. A mismatch found on one machine reaches the processes of
    the others through a server, and each hears its own side by these words (:meth:`Why.heard_by`)."""
    text = f"{dtype}[{','.join(str(d) for d in shape)}]"
    if kind == KIND_BROADCAST:
        text += f" (broadcast from rank {root})"
    elif kind == KIND_ASYNC_INIT:
        text += f" (async_init from rank {root}, {'unbounded' if staleness < 0 else f'staleness {staleness}'})"
    elif kind == KIND_ASYNC:
        text += " (async)"
    elif average:
        text += " (average)"
    if layout:
        text += f" (layout {layout})"
    return text


@dataclass(frozen=True, slots=True)
class Why:
    """Why an operation failed, said twice: ``text`` for people and logs, and the ``code`` and facts of the
    :class:`Failure` that tells the other side (which builds its typed error from them, never from the text).

    The server's round table and the worker's local rounds both decide failures as a Why. A mismatch keeps
    the two sides' descriptions (``sides``) until it is addressed to one of them (:meth:`heard_by`): each
    side hears its own description as ``ours`` and the other as ``theirs``. Between the daemons a Why travels
    whole (:meth:`carry`, :meth:`carried`): a worker that gives a round up tells the server why, with its
    code and facts, and the server tells the other workers the same, so a mismatch found on one machine is a
    mismatch, each side its own, on every machine.
    """

    text: str
    code: FailureCode = "error"
    name: str = ""
    ours: str = ""
    theirs: str = ""
    peer: str = ""
    what: str = ""
    timeout_s: float = 0.0
    detail: str = ""
    sides: tuple[str, str] | None = None

    @classmethod
    def mismatch(cls, name: str, first: str, other: str, detail: str) -> Self:
        """Two sides disagree about tensor ``name``: ``first`` and ``other`` describe what each asked for."""
        return cls(f"tensor {name!r} mismatch: {detail}", "mismatch", name=name, detail=detail,
                   sides=(first, other))

    @classmethod
    def absent_worker(cls, worker: int, connected: bool, waited_s: float, what: str, server: str = "this server"
                      ) -> Self:
        """``what`` (a round, said as "round R of 'name'") waited ``waited_s`` for ``worker``, which is not
        connected to ``server`` (the server that says it: "server 2") or (``connected``) has no training
        processes: the sweeps' timeout. A peer that is unreachable or went away, as when its processes' leaving
        or its disconnection is heard while the round waits: a connection failure naming it either way (it was
        a timeout here and a connection failure there, so that one death gave either class by its timing: a
        review of the contract)."""
        gone = ("had no training processes: none had started yet, or they had left" if connected
                else f"was not connected to {server}")
        text = f"worker {worker} {gone} (waited {waited_s:g} s); {what} cannot complete"
        return cls(text, "connection", peer=f"worker {worker}", what=what, timeout_s=waited_s, detail=text)

    @classmethod
    def stalled_workers(cls, workers: list[int], waited_s: float, what: str) -> Self:
        """``what`` waited ``waited_s`` (cluster.stall_timeout) for ``workers``, connected, whose processes never
        pushed it (one of them stuck, or skipping it)."""
        s = "s" if len(workers) > 1 else ""
        text = f"worker{s} {', '.join(map(str, workers))} did not push it (cluster.stall_timeout)"
        return cls(f"{what} failed: {text}, waited {waited_s:g} s", "timeout",
                   what=what, timeout_s=waited_s, detail=text)

    def about(self, name: str) -> Self:
        """This failure as tensor ``name``'s processes hear it: the tensor said before its text and its detail
        (a process builds its error's text from the facts and the detail), unless they say it already
        (:func:`detail_about`)."""
        detail = detail_about(name, self.code, self.what, self.detail)
        if detail is None:
            return self
        said = f"tensor {name!r}"
        return dataclasses.replace(self, text=self.text if repr(name) in self.text else f"{said}: {self.text}",
                                   detail=detail)

    def heard_by(self, own: str) -> Self:
        """This failure as the side whose tensor ``own`` describes hears it."""
        if self.sides is None:
            return self
        first, other = self.sides
        return dataclasses.replace(self, ours=own, theirs=other if own == first else first, sides=None)

    def failure(self, req: int) -> Failure:
        """The Failure that answers request ``req``."""
        return Failure(req, self.text, code=self.code, name=self.name, ours=self.ours, theirs=self.theirs,
                       peer=self.peer, what=self.what, timeout_s=self.timeout_s, detail=self.detail)

    def relayed(self, context: str) -> Self:
        """This failure as a daemon tells it on to others: ``context`` (who gave the round up) before its text
        and its detail (the end of the typed error's message)."""
        return dataclasses.replace(self, text=f"{context}: {self.text}",
                                   detail=f"{context}: {self.detail}" if self.detail else context)

    def carry(self) -> dict[str, Any]:
        """This failure as the fields of a message that carries it between the daemons (:class:`CarriesWhy`;
        the tensor's name is the message's own), each text clipped as a Failure clips it."""
        clip = MAX_MESSAGE_CHARS
        return {"message": self.text[:clip], "code": self.code, "ours": self.ours[:clip],
                "theirs": self.theirs[:clip], "peer": self.peer[:clip], "what": self.what[:clip],
                "timeout_s": self.timeout_s, "detail": self.detail[:clip],
                "sides": [side[:clip] for side in self.sides] if self.sides else []}

    @classmethod
    def carried(cls, message: Abort | FuseAbort | FuseFailed | InitFailed, name: str = "") -> Self:
        """The failure ``message`` carries (:class:`CarriesWhy`), about tensor ``name``."""
        sides = message.sides
        return cls(message.message, message.code, name=name, ours=message.ours, theirs=message.theirs,
                   peer=message.peer, what=message.what, timeout_s=message.timeout_s, detail=message.detail,
                   sides=(sides[0], sides[1]) if sides else None)


def detail_about(name: str, code: str, what: str, detail: str, said: str = "") -> str | None:
    """A failure's ``detail`` with what it is about (``said``; by default the tensor, "tensor 'name'") before it,
    for the processes of tensor ``name``, which build their error's text from the facts and the detail; None
    where these name the tensor already (a mismatch's name, a timeout's ``what``, the detail itself)."""
    if code == "mismatch" or repr(name) in what or repr(name) in detail:
        return None
    said = said or f"tensor {name!r}"
    return f"{said}: {detail}" if detail else said


@dataclass(frozen=True, slots=True, kw_only=True)
class CarriesWhy(Message):
    """Base of the messages that carry a :class:`Why` between the daemons (``Abort``, ``FuseAbort``,
    ``FuseFailed``), whole: its text as the message's own ``message``, its code and facts as in
    :class:`Failure`, and a mismatch not yet addressed to one side as its two ``sides`` (:meth:`Why.carry`
    fills these, :meth:`Why.carried` reads them). A frame from before these fields parses as a
    ``round_failed`` without facts."""

    code: FailureCode = "round_failed"
    ours: str = ""
    theirs: str = ""
    peer: str = ""
    what: str = ""
    timeout_s: float = 0.0
    detail: str = ""
    sides: list[str] = field(default_factory=list)

    def _check_why(self, tag: str, message: str) -> None:
        """The carried fields: texts of at most MAX_MESSAGE_CHARS, no sides or two, a timeout_s >= 0."""
        for name, text in (("message", message), ("ours", self.ours), ("theirs", self.theirs), ("peer", self.peer),
                           ("what", self.what), ("detail", self.detail)):
            _check_text(tag, name, text)
        sides = self.sides
        if sides and (len(sides) != 2 or not all(isinstance(s, str) and len(s) <= MAX_MESSAGE_CHARS for s in sides)):
            raise LocalProtocolError(f"{tag} sides must be none or two descriptions of at most {MAX_MESSAGE_CHARS} "
                                     f"characters, got {shown(sides)}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s >= 0):
            raise LocalProtocolError(f"{tag} timeout_s must be finite and >= 0, got {shown(self.timeout_s)}")


@dataclass(frozen=True, slots=True)
class Push(Message):
    """One partition of a worker's (locally summed) tensor; payload: ``count`` elements."""

    TYPE: ClassVar[str] = "push"
    CHECKED_WHEN_PARSED: ClassVar[bool] = True
    req: int
    name: str
    part: int
    round: int
    worker: int
    dtype: str
    shape: list[int]
    offset: int  # first element of this partition within the flattened tensor
    count: int
    divisor: int = 1  # the server divides the final sum by this (average) before rounding
    kind: str = KIND_SUM
    # Shared memory (colocated server only): the partition lies at byte ``seg_offset`` of the worker's
    # segment ``segment`` instead of in the payload, and the server writes the sum to byte
    # ``out_offset`` of segment ``out_segment``.
    segment: str = ""
    seg_offset: int = 0
    out_segment: str = ""
    out_offset: int = 0
    # After a server restart: not a contribution but the finished sum of ``round``, which this worker
    # received from the server's previous run; it answers the workers that did not (no reply to it).
    replay: bool = False
    # A broadcast's root (a global rank; -1 for a sum): every push of a round must name the same one.
    root: int = -1
    # This worker's machine holds the broadcast's root: its data is the round's result, copied bit for bit;
    # the other workers' data is ignored.
    holds_root: bool = False
    # What the tensor holds beyond its dtype and shape, as Op.layout: every push of a round must agree.
    layout: str = ""
    # Asynchronous mode: the staleness bound an ``async_init`` sets (-1: none), and, on a replayed async
    # push (a worker's copy of the value, see bps_server.values), the vector of steps that value holds.
    staleness: int = -1
    applied: list[int] = field(default_factory=list)
    # Pushed again after this worker's connection to the same server run broke with the push unanswered: it may
    # have reached the server on the connection that broke, which answers it from the round's state
    # (``bps_server.rounds``, "Dropped connections"): never summed twice.
    resumed: bool = False
    # Asynchronous pushes: the job of the pushing machine's processes (Hello.job; empty: not known). A server
    # holds each asynchronous value for one job, the newest; a push of an ended job is refused (bps_server.values,
    # "Jobs").
    job: str = ""

    def validate(self) -> None:
        _check_tensor(self.name, self.dtype, self.shape, self.kind)
        if self.job and (self.kind not in ASYNC_KINDS or len(self.job) > MAX_JOB_CHARS):
            raise LocalProtocolError(f"{self.kind} push of {self.name!r} names job {shown(self.job)}; only an "
                                     f"asynchronous push names one, of at most {MAX_JOB_CHARS} characters")
        if self.kind in ROOTED_KINDS and self.root < 0:
            raise LocalProtocolError(f"{self.kind} push of {self.name!r} has no root (root {self.root})")
        if self.kind not in ROOTED_KINDS and (self.root != -1 or self.holds_root):
            raise LocalProtocolError(f"{self.kind} push of {self.name!r} names a broadcast root")
        if self.staleness < -1 or (self.staleness != -1 and self.kind not in ASYNC_KINDS):
            raise LocalProtocolError(f"{self.kind} push of {self.name!r} has staleness {self.staleness}; only "
                                     f"asynchronous pushes have one, -1 (none) or at least 0")
        _check_vector("push", self.applied)
        _check_layout("push", self.layout)
        if self.resumed and (self.replay or self.kind in ASYNC_KINDS):
            raise LocalProtocolError(f"{self.kind} push of {self.name!r} is resumed, but only a synchronous "
                                     f"contribution can be (not a replay, nor an asynchronous push)")
        if min(self.part, self.round, self.offset, self.count, self.worker, self.seg_offset, self.out_offset) < 0:
            _check_non_negative("push", part=self.part, round=self.round, offset=self.offset, count=self.count,
                                worker=self.worker, seg_offset=self.seg_offset, out_offset=self.out_offset)
        if self.divisor < 1:
            raise LocalProtocolError(f"push has divisor < 1: {self.divisor}")
        _check_segment(self.segment)
        _check_segment(self.out_segment)
        if bool(self.segment) != bool(self.out_segment):
            raise LocalProtocolError("push names a shared-memory segment for its data or its result but not both")
        if self.divisor != 1 and self.dtype not in dtypes.FLOAT_TYPES:
            raise LocalProtocolError(f"divisor {self.divisor} given for integer dtype {self.dtype}; "
                                     f"averages need floats")

    @property
    def payload_nbytes(self) -> int:
        return self.count * dtypes.ITEMSIZE[self.dtype]

    def check_extent(self) -> None:
        """A received push's partition lies inside its tensor: ``offset + count`` at most the product of
        ``shape``; RemoteProtocolError otherwise. The server's one check for both its push paths (payload and
        shared memory). Not part of :meth:`validate`, which relates no field to another's product: pushes
        built with a shape that only describes (tests, tools) stay buildable; the server that sums must check."""
        total = math.prod(self.shape)
        if self.offset + self.count > total:
            raise RemoteProtocolError(f"push of {self.name!r} part {self.part} exceeds its tensor's {total} "
                                      f"elements", what=f"push of {self.name!r}", size=self.offset + self.count,
                                      limit=total, unit="elements")


@dataclass(frozen=True, slots=True)
class Result(Message):
    """The finished sum of one partition; payload: the sum in the tensor's dtype, or none when
    ``inplace``: the server wrote it into the shared memory the push named."""

    TYPE: ClassVar[str] = "result"
    CHECKED_WHEN_PARSED: ClassVar[bool] = True
    req: int
    name: str
    part: int
    round: int
    inplace: bool = False
    # An asynchronous push's answer (the payload is the key's value): per worker, the last step of its
    # deltas that the value holds. The worker keeps both as its copy for a restarted server.
    applied: list[int] = field(default_factory=list)

    def validate(self) -> None:
        _check_vector("result", self.applied)


@dataclass(frozen=True, slots=True)
class Abort(CarriesWhy):
    """A worker gave up ``round`` of ``name``'s partition ``part``; the server fails it for all, and tells
    them the worker's why (``message`` and the rest, see :class:`CarriesWhy`)."""

    TYPE: ClassVar[str] = "abort"
    name: str
    part: int
    round: int
    worker: int
    message: str

    def validate(self) -> None:
        _check_name(self.name)
        _check_non_negative("abort", part=self.part, round=self.round, worker=self.worker)
        self._check_why("abort", self.message)


@dataclass(frozen=True, slots=True)
class InitFailed(CarriesWhy):
    """The machine of root rank ``root`` (``worker``) failed its ``async_init`` of ``name`` before pushing it
    (its processes disagreed about the tensor, or one failed): every server fails the inits of that attempt from
    root ``root`` (``round``: each machine's count of its local rounds of the name, which a failed one takes too,
    so a retry's is a later one) that wait for its value or come later, with its why (``message`` and the rest,
    see :class:`CarriesWhy`). Sent to every server: each holds the parts it holds."""

    TYPE: ClassVar[str] = "init_failed"
    name: str
    worker: int
    root: int
    round: int
    message: str

    def validate(self) -> None:
        _check_name(self.name)
        _check_non_negative("init failed", worker=self.worker, root=self.root, round=self.round)
        self._check_why("init failed", self.message)


@dataclass(frozen=True, slots=True)
class Reset(Message):
    """A worker lost all its training processes: its pending rounds are void, its rounds restart at 0. Sent on every
    connection of the worker to the server: the first (stream 0) resets the worker's state there; each other one says
    that the ended job's pushes on it are all in (the server refuses what comes there between the two)."""

    TYPE: ClassVar[str] = "reset"
    worker: int
    epoch: str = ""  # the worker's new round numbering (see Hello.epoch)


@dataclass(frozen=True, slots=True)
class Joined(Message):
    """A worker that had no training processes (it said so: a Reset, or Hello.processes) has some now, of job
    ``job`` (their Hello.job; empty: not named), whose first processes came there ``job_age_s`` ago (a rejoin of
    the job keeps that: a restarted server must not take a rejoin for a job begun now, a review)."""

    TYPE: ClassVar[str] = "joined"
    worker: int
    job: str = ""
    job_age_s: float = 0.0  # how long ago the worker's first processes of ``job`` came (see Hello.job_age_s)

    def validate(self) -> None:
        _check_text("joined", "job", self.job, MAX_JOB_CHARS)
        _check_job_age("joined", self.job_age_s)


@dataclass(frozen=True, slots=True)
class Release(Message):
    """A worker freed shared-memory ``segment``: the server on its host unmaps it."""

    TYPE: ClassVar[str] = "release"
    segment: str

    def validate(self) -> None:
        _check_segment(self.segment, required=True, who="released segment name")


MAX_ANNOUNCED_SEGMENTS: Final = 64  # segment names in one Announce


@dataclass(frozen=True, slots=True)
class Announce(Message):
    """A worker will name shared-memory ``segments`` in pushes on this connection: the server on its host
    maps only segments this connection announced (issue 14, item 2), and forgets one at its ``Release``.
    Sent on the connection, before the first push that names them."""

    TYPE: ClassVar[str] = "announce"
    segments: list[str]

    def validate(self) -> None:
        if not 1 <= len(self.segments) <= MAX_ANNOUNCED_SEGMENTS:
            raise LocalProtocolError(f"announce of {len(self.segments)} segments; 1 to {MAX_ANNOUNCED_SEGMENTS}",
                                     what="announced segments", size=len(self.segments),
                                     limit=MAX_ANNOUNCED_SEGMENTS, unit="names")
        for name in self.segments:
            if not isinstance(name, str):
                raise LocalProtocolError(f"announce holds a {type(name).__name__}, not a segment name")
            _check_segment(name, required=True, who="announced segment name")


@dataclass(frozen=True, slots=True)
class RoundQuery(Message):
    """Worker -> the server holding partition 0 of ``name``: which round should my next push of it be?

    Asked once per name whenever a worker's round numbering starts (daemon start, new job), so that
    a worker machine that comes back joins the round the others are in. ``local``: the worker's own number
    of the round it asks for (a worker that did not rejoin is answered with it: its numbers are the
    servers'). ``failed``: that number is a failed fused step's (``bps_worker.fusion``: a step takes an
    unfused round number whichever path it took, or a round that failed before its number was known); a
    rejoining worker is answered -1 then, "ask again at a round of yours", since the servers cannot tell that
    step's round from the next one. ``given_up``: that number is a round that failed here before its push, of a
    step whose other names went to the servers (``WorkerDaemon.give_up_failed_round``); a rejoining worker is
    answered the peers' current round, open or failed (not the next one after a failed round), to give it up
    there.

    ``fate`` (at least 0): not a round to join, but whether the server summed round ``fate`` of (name, part):
    RoundInfo.round 1 if so, 0 if not; a round not summed is given up first, as this worker's Abort of it would
    (still open, it could be summed later). Asked by a worker whose link gave up while that push of it was out
    (its answer is unknown)."""

    TYPE: ClassVar[str] = "round_query"
    req: int
    name: str
    part: int = 0
    local: int = 0
    failed: bool = False
    fate: int = -1
    given_up: bool = False

    def validate(self) -> None:
        _check_name(self.name)
        _check_non_negative("round query", part=self.part, local=self.local)
        if self.fate < -1:
            raise LocalProtocolError(f"round query asks the fate of round {self.fate}")


@dataclass(frozen=True, slots=True)
class RoundInfo(Message):
    TYPE: ClassVar[str] = "round_info"
    req: int
    round: int


@dataclass(frozen=True, slots=True)
class Restored(Message):
    """Worker -> a server, on its first connection to that run of it: every copy of an asynchronous value it
    holds for that server went before this (replayed pushes; none to a run it never talked to before). The
    server applies no push to a key until every worker said so, or the timeout passed (bps_server.values,
    "Server restarts")."""

    TYPE: ClassVar[str] = "restored"
    worker: int

    def validate(self) -> None:
        _check_non_negative("restored", worker=self.worker)


@dataclass(frozen=True, slots=True)
class Ping(Message):
    """Liveness, both ways between a worker and a server: a silent peer is a dead (or stalled) one."""

    TYPE: ClassVar[str] = "ping"
    seq: int


@dataclass(frozen=True, slots=True)
class StatsRequest(Message):
    TYPE: ClassVar[str] = "stats_request"
    req: int


@dataclass(frozen=True, slots=True)
class Stats(Message):
    TYPE: ClassVar[str] = "stats"
    req: int
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Alloc(Message):
    """Client asks the worker for a shared-memory segment of ``nbytes`` for tensor ``name``."""

    TYPE: ClassVar[str] = "alloc"
    req: int
    name: str
    nbytes: int
    # Tensors whose slots the client gives up first (idle ones, to stay under Welcome.arena_bytes).
    free: list[str] = field(default_factory=list)

    def validate(self) -> None:
        _check_name(self.name)
        if self.nbytes < 0:
            raise LocalProtocolError(f"alloc of a negative size: {self.nbytes}")
        if len(self.free) > MAX_BATCH_ITEMS:
            raise LocalProtocolError(f"alloc frees {len(self.free)} slots; at most {MAX_BATCH_ITEMS}",
                                     what="alloc free list", size=len(self.free), limit=MAX_BATCH_ITEMS,
                                     unit="names")
        for name in self.free:
            if not isinstance(name, str):
                raise LocalProtocolError(f"alloc free list holds a {type(name).__name__}, not a name")
            _check_name(name)


@dataclass(frozen=True, slots=True)
class Allocated(Message):
    TYPE: ClassVar[str] = "allocated"
    req: int
    segment: str
    nbytes: int  # capacity of the slot
    offset: int = 0  # the slot starts this many bytes into the segment


@dataclass(frozen=True, slots=True)
class Op(Message):
    """Client starts a collective on the tensor stored at ``offset`` in ``segment``."""

    TYPE: ClassVar[str] = "op"
    req: int
    name: str
    kind: str
    dtype: str
    shape: list[int]
    segment: str
    average: bool = False
    priority: int = 0
    root: int = -1
    offset: int = 0  # where the tensor starts in ``segment``
    # A CUDA tensor instead: its CUDA IPC description (bps_runtime.cuda.describe); ``segment`` is empty.
    cuda: list[Any] = field(default_factory=list)
    # True: the worker copies the result into the slot (``segment``/``offset``). False: it leaves the result
    # in its own results segment and names it in ``Done``, for the client to read from there (one copy less
    # when the client copies it elsewhere anyway).
    handback: bool = True
    # What the tensor holds beyond its dtype and shape, set by a framework layer: a fused gradient bucket's
    # digest of its parameters' names, shapes and dtypes (bps_worker.torch). Every process's op of a round,
    # on every machine, must carry the same (the workers and the servers compare it).
    layout: str = ""
    staleness: int = -1  # an async_init's staleness bound (-1: none); see Push.staleness

    def validate(self) -> None:
        _check_tensor(self.name, self.dtype, self.shape, self.kind)
        _check_offset(self.offset)
        _check_layout("op", self.layout)
        if self.staleness < -1 or (self.staleness != -1 and self.kind != KIND_ASYNC_INIT):
            raise LocalProtocolError(f"{self.kind} op of {self.name!r} has staleness {self.staleness}; only an "
                                     f"async_init has one, -1 (none) or at least 0")


@dataclass(frozen=True, slots=True)
class Done(Message):
    """The result of operation ``req`` is in the client's slot, or, when ``segment`` is set (an ``Op`` with
    ``handback`` false), at ``offset`` in that segment of the worker, until the next round of the same name.
    The worker keeps that segment until the client has mapped it (``Taken``), or for the cluster's timeout:
    after that it may free it for room (its results arena is capped, ``cluster.arena_bytes``)."""

    TYPE: ClassVar[str] = "done"
    CHECKED_WHEN_PARSED: ClassVar[bool] = True
    req: int
    segment: str = ""
    offset: int = 0

    def validate(self) -> None:
        _check_segment(self.segment)
        _check_offset(self.offset)


# -- fusion (issue 16): many small sums in one message at every hop -------------------------------------------
MAX_FUSED_ENTRIES: Final = 4096  # tensors named in one OpBatch, DoneBatch, FuseReady, FuseAbort or FusePlan
# Senders close a fused message once its names (in UTF-8, bounded) reach this, well under every header limit.
FUSED_NAMES_BUDGET: Final = 24 * 1024
# The prefix of the names the worker gives its fused tensors (one per server, lane and dtype); a training
# process may not use it (the session refuses it).
FUSED_PREFIX: Final = "\x00fused/"
# A lane generation's name (FusePlan.lanes): printable, no "@" (it ends a fused tensor's name after one).
MAX_LANES_CHARS: Final = 64


def fused_name(server: int, lane: int, dtype: str, average: bool, lanes: str) -> str:
    """The name of server ``server``'s fused tensor of ``dtype`` (and ``average``) on ``lane`` of lane
    generation ``lanes`` (see FusePlan.lanes): one name per generation, so that every worker numbers its
    rounds from 0."""
    return f"{FUSED_PREFIX}{server}/{lane}/{dtype}{'/avg' if average else ''}@{lanes}"


def fused_lanes(name: str) -> str | None:
    """The lane generation a fused tensor's name says (``fused_name``); None for any other name."""
    if not name.startswith(FUSED_PREFIX):
        return None
    head, at, lanes = name.rpartition("@")
    return lanes if at else None


def fused_server(name: str) -> int | None:
    """The server a fused tensor's name says (``fused_name``): the one that planned it, which holds all of it;
    None for any other name."""
    if not name.startswith(FUSED_PREFIX):
        return None
    server, slash, _ = name[len(FUSED_PREFIX):].partition("/")
    return int(server) if slash and server.isdigit() else None

# A fused tensor's spec on the wire: [dtype, shape, average, layout] (a sum: fusion never carries a broadcast).
Spec = tuple[str, tuple[int, ...], bool, str]


def check_spec(spec: Any) -> Spec:
    """A wire spec as a hashable tuple; LocalProtocolError names what is wrong with it."""
    if not isinstance(spec, (list, tuple)) or len(spec) != 4:
        raise LocalProtocolError(f"a fused spec is [dtype, shape, average, layout], got {shown(spec)}")
    dtype, shape, average, layout = spec
    if not isinstance(dtype, str) or not isinstance(shape, (list, tuple)) or not isinstance(average, bool) \
            or not isinstance(layout, str):
        raise LocalProtocolError(f"a fused spec is [str, list, bool, str], got {shown(spec)}")
    _check_dtype(dtype)
    _check_shape(list(shape))
    _check_layout("fused spec", layout)
    if average and dtype not in dtypes.FLOAT_TYPES:
        raise LocalProtocolError(f"a fused spec averages {dtype}, not a floating dtype")
    return dtype, tuple(shape), average, layout


def check_group(group: Any) -> tuple[str, bool]:
    """A wire plan group ([dtype, average], see FusePlan) as a tuple; LocalProtocolError names what is wrong."""
    if not isinstance(group, (list, tuple)) or len(group) != 2 or not isinstance(group[0], str) \
            or not isinstance(group[1], bool):
        raise LocalProtocolError(f"a fused plan group is [dtype, average], got {shown(group)}")
    dtype, average = group
    _check_dtype(dtype)
    if average and dtype not in dtypes.FLOAT_TYPES:
        raise LocalProtocolError(f"a fused plan group averages {dtype}, not a floating dtype")
    return dtype, average


def fused_chunks(names: list[str]) -> list[tuple[int, int]]:
    """``names`` cut into runs (start, stop) of at most MAX_FUSED_ENTRIES names and FUSED_NAMES_BUDGET bytes
    of UTF-8 (plus 16 a name for the other columns): what one fused message may carry."""
    chunks, start, used = [], 0, 0
    for i, name in enumerate(names):
        size = (len(name) if name.isascii() else len(name.encode())) + 16
        if i > start and (used + size > FUSED_NAMES_BUDGET or i - start >= MAX_FUSED_ENTRIES):
            chunks.append((start, i))
            start, used = i, 0
        used += size
    if start < len(names):
        chunks.append((start, len(names)))
    return chunks


def describe_spec(spec: Spec) -> str:
    """A fused tensor as a mismatch names it (:func:`describe_tensor`)."""
    dtype, shape, average, layout = spec
    return describe_tensor(dtype, shape, average=average, layout=layout)


def _check_fused_names(tag: str, names: list[Any]) -> None:
    if not 1 <= len(names) <= MAX_FUSED_ENTRIES:
        raise LocalProtocolError(f"{tag} of {len(names)} tensors; 1 to {MAX_FUSED_ENTRIES} allowed", what=tag,
                                 size=len(names), limit=MAX_FUSED_ENTRIES, unit="tensors")
    if set(map(type, names)) == {str} and 0 < min(map(len, names)) and max(map(len, names)) <= MAX_NAME_CHARS:
        return  # the usual case, in C loops (thousands of names per message); else find the culprit:
    for name in names:
        if not isinstance(name, str):
            raise LocalProtocolError(f"{tag} names a {type(name).__name__}, not a tensor name")
        if not 0 < len(name) <= MAX_NAME_CHARS:
            _check_name(name)


def _check_lanes(tag: str, lanes: str) -> None:
    """A lane generation (FusePlan.lanes): it ends fused tensors' names, after their last "@"."""
    _check_text(tag, "lanes", lanes, MAX_LANES_CHARS)
    if "@" in lanes or not lanes.isprintable():
        raise LocalProtocolError(f"{tag} lanes {shown(lanes)}: printable, without '@'")


def _check_indexes(tag: str, what: str, values: list[Any], count: int, bound: int | None = None) -> None:
    """``values`` has ``count`` non-negative ints (each under ``bound`` if given)."""
    if len(values) != count:
        raise LocalProtocolError(f"{tag} has {count} tensors but {len(values)} {what}")
    if not values or (set(map(type, values)) == {int} and min(values) >= 0
                      and (bound is None or max(values) < bound)):
        return  # the usual case, in C loops; else find the culprit:
    for v in values:
        if v.__class__ is not int or v < 0 or (bound is not None and v >= bound):
            limit = "a non-negative int" if bound is None else f"an int in 0..{bound - 1}"
            raise LocalProtocolError(f"{tag} {what} must each be {limit}, got {shown(v)}")


@dataclass(frozen=True, slots=True)
class OpBatch(Message):
    """Small sums one process issued close together (the client's fusion): tensor ``names[i]`` is request
    ``reqs[i]``, of spec ``specs[spec[i]]``, at byte ``offsets[i]`` of segment ``segments[seg[i]]``, with
    priority ``priority[i]``. The worker sums each with the same name of the other processes, copies the
    sum back into the slot and answers with DoneBatch (or a Failure per request)."""

    TYPE: ClassVar[str] = "op_batch"
    reqs: list[int]
    names: list[str]
    specs: list[Any]
    spec: list[int]
    segments: list[str]
    seg: list[int]
    offsets: list[int]
    priority: list[int]

    def validate(self) -> None:
        _check_fused_names("op batch", self.names)
        n = len(self.names)
        _check_indexes("op batch", "requests", self.reqs, n)
        _check_indexes("op batch", "spec indexes", self.spec, n, len(self.specs))
        _check_indexes("op batch", "segment indexes", self.seg, n, len(self.segments))
        _check_indexes("op batch", "offsets", self.offsets, n)
        if len(self.priority) != n or not set(map(type, self.priority)) <= {int}:
            raise LocalProtocolError(f"op batch has {n} tensors but priorities {shown(self.priority)}")
        if len(self.specs) > n or len(self.segments) > n:
            raise LocalProtocolError("op batch has more specs or segments than tensors")
        for spec in self.specs:
            check_spec(spec)
        for segment in self.segments:
            _check_segment(segment, required=True)


@dataclass(frozen=True, slots=True)
class DoneBatch(Message):
    """The sums of requests ``reqs`` are in their slots (the answer to OpBatch entries)."""

    TYPE: ClassVar[str] = "done_batch"
    CHECKED_WHEN_PARSED: ClassVar[bool] = True
    reqs: list[int]

    def validate(self) -> None:
        if not 1 <= len(self.reqs) <= MAX_FUSED_ENTRIES:
            raise LocalProtocolError(f"done batch of {len(self.reqs)} requests; 1 to {MAX_FUSED_ENTRIES} allowed")
        _check_indexes("done batch", "requests", self.reqs, len(self.reqs))


@dataclass(frozen=True, slots=True)
class Leave(Message):
    """Client tells the worker it is leaving (``shutdown()``), answered by ``Done(req)`` once its leave took effect:
    the rounds that awaited it failed, and, where it was the machine's last process, every connected server has
    taken the worker's ``Reset`` (the worker pinged each connection after it and heard the answer). A barrier of the job's own
    after every process's shutdown then starts the next ``init()`` on a clean slate everywhere: without the answer
    a peer's new processes could report a round before this machine's daemon or a server had heard the leave, and
    that leave failed their round. The client sends nothing after it but closes the connection."""

    TYPE: ClassVar[str] = "leave"
    req: int


@dataclass(frozen=True, slots=True)
class Taken(Message):
    """Client tells the worker that it mapped the results segments the ``Done`` of requests ``reqs`` named: its
    mapping keeps them from now on, so the worker may free them for room again. Sent by the client's reader
    thread once per read that brought such Dones (never blocking it: a frame it cannot send at once goes ahead
    of the client's next message). Requests the worker does not hold a result for are ignored."""

    TYPE: ClassVar[str] = "taken"
    reqs: list[int]

    def validate(self) -> None:
        if not 1 <= len(self.reqs) <= MAX_FUSED_ENTRIES:
            raise LocalProtocolError(f"taken of {len(self.reqs)} requests; 1 to {MAX_FUSED_ENTRIES} allowed",
                                     what="taken", size=len(self.reqs), limit=MAX_FUSED_ENTRIES, unit="requests")
        _check_indexes("taken", "requests", self.reqs, len(self.reqs))


# A Notice: at most this many lines, each at most this many characters (a stall line names a tensor, at most
# MAX_NAME_CHARS, and a few ranks or workers), so that one always fits a frame's header (4 UTF-8 bytes a
# character at most: 12 x 1,280 x 4 bytes, under 64 KiB).
MAX_NOTICE_LINES: Final = 12
MAX_NOTICE_LINE_CHARS: Final = 1280


@dataclass(frozen=True, slots=True)
class Notice(Message):
    """Lines a training process should see that fail nothing: its tensors that stall. A worker daemon sends a
    process the ``stall:`` lines of its log about the rounds that process is part of (one it submitted that
    waits for its peers, or one its peers submitted that waits for it), and those its servers sent it about
    them; a server sends a worker the lines about the rounds that wait for other workers. After the timeout,
    then every timeout while the wait lasts. The client logs each line as a warning."""

    TYPE: ClassVar[str] = "notice"
    lines: list[str]

    def validate(self) -> None:
        if not 1 <= len(self.lines) <= MAX_NOTICE_LINES:
            raise LocalProtocolError(f"notice of {len(self.lines)} lines; 1 to {MAX_NOTICE_LINES} allowed",
                                     what="notice", size=len(self.lines), limit=MAX_NOTICE_LINES, unit="lines")
        for line in self.lines:
            if not isinstance(line, str) or len(line) > MAX_NOTICE_LINE_CHARS:
                raise LocalProtocolError(f"notice line is not text of at most {MAX_NOTICE_LINE_CHARS} characters")


def notice_lines(lines: list[str]) -> list[str]:
    """``lines`` made fit for a :class:`Notice` (the first MAX_NOTICE_LINES, each cut at MAX_NOTICE_LINE_CHARS)."""
    cut = MAX_NOTICE_LINE_CHARS - 3
    return [line if len(line) <= MAX_NOTICE_LINE_CHARS else line[:cut] + "..." for line in lines[:MAX_NOTICE_LINES]]


@dataclass(frozen=True, slots=True)
class FuseReady(Message):
    """Worker to the anchor server of ``names``: every local process issued these small sums (tensor
    ``names[i]`` of spec ``specs[spec[i]]``). The server plans them (FusePlan) once every worker did."""

    TYPE: ClassVar[str] = "fuse_ready"
    CHECKED_WHEN_PARSED: ClassVar[bool] = True
    names: list[str]
    specs: list[Any]
    spec: list[int]
    # Per name, how many plans this worker daemon ran it in (its fused rounds so far): a server that restarted
    # tells from it who missed a plan (see FuseRunning).
    counts: list[int] = field(default_factory=list)
    # Per name, the round reported: how many rounds of it this worker's processes made before it (planned or
    # failed), counted since they began (empty: not said; a worker whose processes are new since a reset
    # counts otherwise than its peers, and says none). The anchor matches workers' rounds by it where every
    # side says it, so that a round a restart of the server left unanswered on one side is not summed with
    # the next round of another (see bps_server.fusion).
    rounds: list[int] = field(default_factory=list)

    def validate(self) -> None:
        _check_fused_names("fuse ready", self.names)
        if self.counts:
            _check_indexes("fuse ready", "counts", self.counts, len(self.names))
        if self.rounds:
            _check_indexes("fuse ready", "rounds", self.rounds, len(self.names))
        _check_indexes("fuse ready", "spec indexes", self.spec, len(self.names), len(self.specs))
        if len(self.specs) > len(self.names):
            raise LocalProtocolError("fuse ready has more specs than tensors")
        for spec in self.specs:
            check_spec(spec)


@dataclass(frozen=True, slots=True)
class FuseAbort(CarriesWhy):
    """Worker to the anchor server: these fused sums failed here (``message``, ``code``); fail them for every
    worker, those that reported them already and those that will. ``reported``: the round given up is the one
    this worker reported last (its processes failed it after the report), not its next one; the server answers
    that report all the same (a plan, or a failure), as it answers every report. ``rounds``: as in FuseReady,
each name's round given up (empty: not said). ``message`` and the rest: the worker's why (see
:class:`CarriesWhy`), which the server tells the other workers (``FuseFailed``)."""

    TYPE: ClassVar[str] = "fuse_abort"
    names: list[str]
    message: str
    reported: bool = False
    rounds: list[int] = field(default_factory=list)

    def validate(self) -> None:
        _check_fused_names("fuse abort", self.names)
        self._check_why("fuse abort", self.message)
        if self.rounds:
            _check_indexes("fuse abort", "rounds", self.rounds, len(self.names))


@dataclass(frozen=True, slots=True)
class FusePlan(Message):
    """Server to every worker: plan ``seq`` of this server sums ``names`` (in this order, grouped by dtype
    and average) as one fused tensor per group, pushed to this server (see bps_worker.fusion). ``resent``: a
    plan sent again to a worker that lost it, not the next of this run's plans: "restart", a plan of the
    server's previous run (FuseRunning; the worker reported its names again), "restart_lost", one of the
    previous run whose rounds the worker failed since (it reports later rounds: FuseReady.rounds), or "lost",
    lost with a broken connection (FuseResync; the worker failed its rounds then). Of the last two the worker
    fails its groups as the peers do.

    ``groups``: the plan's groups, [dtype, average] each, and ``group[i]`` the index of ``names[i]``'s: a
    worker that has no round of a name (failed and forgotten here) still numbers and gives up its group as
    the peers number it (empty: not said, the worker groups by its own specs). ``epoch``: the worker's epoch
    as the server knew it when it sent the plan (see ``Hello.epoch``, ``Reset``): a worker whose processes
    are new since ignores it (its names are the old processes' rounds, and the server fails them).

    ``lanes``: the plan's lane generation, part of its fused tensors' names (``fused_name``). The anchor
    starts a new one at every worker reset it handles (its lanes' rounds start at 0 on every worker: the
    reset worker dropped plans its peers ran, so the old lanes' rounds are out of step for good) and fails
    every round of the old ones; a plan resent keeps its own."""

    TYPE: ClassVar[str] = "fuse_plan"
    CHECKED_WHEN_PARSED: ClassVar[bool] = True
    seq: int
    names: list[str]
    resent: PlanResent = ""
    groups: list[Any] = field(default_factory=list)
    group: list[int] = field(default_factory=list)
    epoch: str = ""
    lanes: str = ""

    def validate(self) -> None:
        _check_non_negative("fuse plan", seq=self.seq)
        _check_fused_names("fuse plan", self.names)
        _check_text("fuse plan", "epoch", self.epoch)
        _check_lanes("fuse plan", self.lanes)
        if self.groups or self.group:
            if len(self.groups) > len(self.names):
                raise LocalProtocolError("fuse plan has more groups than tensors")
            _check_indexes("fuse plan", "group indexes", self.group, len(self.names), len(self.groups))
            for group in self.groups:
                check_group(group)


@dataclass(frozen=True, slots=True)
class FuseRunning(Message):
    """Worker to a server that restarted: plan ``seq`` of its previous run is running here (``counts``: as in
    FuseReady, this plan included; ``rounds``: the index of each name's round in it, as FuseReady says it,
    or empty). A worker that reports these names one plan behind lost the plan when the server died, and
    gets it again: to run (its round is the plan's), or to give up (its round is a later one). ``lanes``: the
    plan's lane generation (FusePlan.lanes), which the plan keeps when sent again."""

    TYPE: ClassVar[str] = "fuse_running"
    seq: int
    names: list[str]
    counts: list[int]
    rounds: list[int] = field(default_factory=list)
    lanes: str = ""

    def validate(self) -> None:
        _check_non_negative("fuse running", seq=self.seq)
        _check_lanes("fuse running", self.lanes)
        _check_fused_names("fuse running", self.names)
        _check_indexes("fuse running", "counts", self.counts, len(self.names))
        if self.rounds:
            _check_indexes("fuse running", "rounds", self.rounds, len(self.names))


@dataclass(frozen=True, slots=True)
class FusePast(Message):
    """Worker to a server that restarted, after its FuseRunning and before its reports: its processes are
    past the rounds of ``names[i]`` below index ``rounds[i]`` (as FuseReady says them; planned or failed
    here), and will never report them; ``counts``: as in FuseReady. The new run fails a peer's round below
    it rather than wait for a round this worker gave up while the old run died, and sends the worker a plan
    of the old run it lost whose round it is past, to give up (see bps_server.fusion)."""

    TYPE: ClassVar[str] = "fuse_past"
    names: list[str]
    rounds: list[int]
    counts: list[int]

    def validate(self) -> None:
        _check_fused_names("fuse past", self.names)
        _check_indexes("fuse past", "rounds", self.rounds, len(self.names))
        _check_indexes("fuse past", "counts", self.counts, len(self.names))


@dataclass(frozen=True, slots=True)
class FuseResync(Message):
    """Worker to the anchor server, first on the connection that replaces a broken one: of each of ``names``
    it told the server's run ``incarnation`` of ``counts[i]`` rounds (reports, and aborts of rounds it had
    not reported; see bps_server.fusion). A round the server did not hear of was lost with the broken
    connection; the worker failed it, and so does the server, for every worker. ``next_plan``: the seq of
    the first plan of that run the worker did not get (-1: said in another part); the server sends the plans
    from there again (``FusePlan.resent``), so that the worker numbers their sums as the peers did. A server
    of another run ignores it (it heard nothing of the worker's old counts, and made none of those plans)."""

    TYPE: ClassVar[str] = "fuse_resync"
    incarnation: str
    names: list[str]
    counts: list[int]
    next_plan: int = -1
    epoch: str = ""  # the worker's epoch when the connection broke: counts of processes gone since are void
    # Per name, the index of the last round told (as FuseReady.rounds says it; empty: not said): the last of
    # those the server did not hear of is that round.
    rounds: list[int] = field(default_factory=list)

    def validate(self) -> None:
        _check_text("fuse resync", "incarnation", self.incarnation)
        _check_text("fuse resync", "epoch", self.epoch)
        if self.names:
            _check_fused_names("fuse resync", self.names)
        _check_indexes("fuse resync", "counts", self.counts, len(self.names))
        if self.rounds:
            _check_indexes("fuse resync", "rounds", self.rounds, len(self.names))
        if self.next_plan < -1:
            raise LocalProtocolError(f"fuse resync has next_plan {self.next_plan}; -1 or more allowed")


@dataclass(frozen=True, slots=True)
class FuseFailed(CarriesWhy):
    """Server to a worker: fused tensor ``name`` failed at its meeting point, and why (``message`` and the rest,
    see :class:`CarriesWhy`: a mismatch addressed to this worker, or with its ``sides``, to be addressed to
    each of its processes). ``epoch``: as in FusePlan, the worker's epoch as the server knew it (a failure of
    the old processes' round is not the new processes')."""

    TYPE: ClassVar[str] = "fuse_failed"
    name: str
    message: str
    epoch: str = ""

    def validate(self) -> None:
        _check_name(self.name)
        self._check_why("fuse failed", self.message)
        _check_text("fuse failed", "epoch", self.epoch)

    def why(self) -> Why:
        return Why.carried(self, self.name)


MAX_BATCH_ITEMS: Final = 1024
# Senders close a batch once its items' estimated header bytes reach this (well under the frame limit).
BATCH_HEADER_BUDGET: Final = 32 * 1024


_FREE_TEXT: Final = ("name", "message", "ours", "theirs", "peer", "what", "detail", "layout", "auth")


# Per message class: which of _FREE_TEXT it has, and whether it has a shape (estimated_header_bytes runs for every
# push a worker queues and every answer a server batches: a getattr per possible field was most of its cost).
_ESTIMATED: dict[type, tuple[tuple[str, ...], bool]] = {}


def estimated_header_bytes(message: Message) -> int:
    """An upper bound of a message's encoded header size, without encoding it.

    Counts the fields whose length is not bounded by a small limit (names and free text, up to 4 bytes a
    character in UTF-8) and the shape; 256 bytes cover the keys and the fixed-size values."""
    cls = type(message)
    known = _ESTIMATED.get(cls)
    if known is None:
        known = _ESTIMATED[cls] = (tuple(f for f in _FREE_TEXT if hasattr(cls, f)), hasattr(cls, "shape"))
    text = 0
    for f in known[0]:
        text += len(getattr(message, f))
    return 4 * text + (24 * len(message.shape) if known[1] else 0) + 256  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Batch(Message):
    """Several small messages in one frame: ``items`` are their headers, ``sizes`` their payload
    lengths, and the frame's payload is their payloads back to back. Saves a frame, a syscall and
    a wake-up per message when thousands of tiny tensors move at once."""

    TYPE: ClassVar[str] = "batch"
    items: list[Any]
    sizes: list[int]

    def validate(self) -> None:
        if not 1 <= len(self.items) <= MAX_BATCH_ITEMS:
            raise LocalProtocolError(f"batch of {len(self.items)} items; 1 to {MAX_BATCH_ITEMS} allowed",
                                     what="batch", size=len(self.items), limit=MAX_BATCH_ITEMS, unit="items")
        if len(self.sizes) != len(self.items):
            raise LocalProtocolError(f"batch has {len(self.items)} items but {len(self.sizes)} sizes")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.sizes):
            raise LocalProtocolError("batch sizes must be non-negative integers")


MESSAGES: Final[dict[str, type[Message]]] = {
    cls.TYPE: cls
    for cls in (Challenge, Hello, Welcome, Failure, Push, Result, Abort, Reset, Announce, Release, RoundQuery,
                RoundInfo, Ping, StatsRequest, Stats, Alloc, Allocated, Op, Done, Batch, OpBatch, DoneBatch,
                FuseReady, FuseAbort, FusePlan, FuseRunning, FusePast, FuseResync, FuseFailed, Restored, Taken,
                Notice, Joined, Leave, InitFailed)
}

class _Field(NamedTuple):
    name: str
    kind: type  # what isinstance checks (list for list[int], str for a Literal of strings)
    required: bool
    choices: tuple[Any, ...] | None  # the allowed values of a Literal field


_FIELDS: dict[type[Message], list[_Field]] = {}


def _fields(cls: type[Message]) -> list[_Field]:
    cached = _FIELDS.get(cls)
    if cached is None:
        hints = get_type_hints(cls)
        cached = []
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            choices: tuple[Any, ...] | None = None
            if get_origin(hint) is Literal:
                choices = get_args(hint)
                kind: type = type(choices[0])
            else:
                kind = getattr(hint, "__origin__", hint)
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            cached.append(_Field(f.name, kind, required, choices))
        _FIELDS[cls] = cached
    return cached


def _check_types(message: Message) -> None:
    """Each field holds its declared type (an int is no bool; a float field takes an int), a Literal one of
    its values; LocalProtocolError names the first field that does not.

    The check runs on every message built, a few per partition on the hot path, so each class gets one
    generated function (as dataclasses and attrs generate ``__init__``): a loop over the fields with
    ``getattr`` cost 5 us per Push, the generated check about 1 us."""
    cls = type(message)
    check = _CHECKERS.get(cls)
    if check is None:
        check = _CHECKERS[cls] = _compile_check(cls)
    check(message)


_CHECKERS: dict[type[Message], Any] = {}


def _compile_check(cls: type[Message]) -> Any:
    fields = _fields(cls)
    env: dict[str, Any] = {"_bad": _bad_field, "_fields": fields}
    lines = ["def check(m):"]
    for i, f in enumerate(fields):
        env[f"K{i}"] = (int, float) if f.kind is float else f.kind
        cond = f"isinstance(v, K{i}) and v.__class__ is not bool" if f.kind in (int, float) else \
            f"isinstance(v, K{i})"
        lines.append(f"    v = m.{f.name}")
        lines.append(f"    if not ({cond}): _bad(m, _fields[{i}], v)")
        if f.choices is not None:
            env[f"C{i}"] = frozenset(f.choices)
            lines.append(f"    if v not in C{i}: _bad(m, _fields[{i}], v)")
    if not fields:
        lines.append("    pass")
    exec("\n".join(lines), env)  # noqa: S102 - code built from our own dataclass fields only
    return env["check"]


def _bad_field(message: Message, f: _Field, value: Any) -> None:
    if f.choices is not None and isinstance(value, f.kind) and value not in f.choices:
        allowed = ", ".join(repr(c) for c in f.choices)
        raise LocalProtocolError(f"{message.TYPE} message field {f.name!r} must be one of {allowed}, "
                                 f"got {shown(value)}")
    raise LocalProtocolError(f"{message.TYPE} message field {f.name!r} must be {f.kind.__name__}, "
                             f"got {type(value).__name__}")


def parse(header: dict[str, Any]) -> Message:
    """Turn a decoded header into its message; RemoteProtocolError names what is wrong.

    This is the receive boundary: the checks a message runs when built are the peer's fault here."""
    tag = header.get("t")
    cls = MESSAGES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {shown(tag)}")
    kwargs = dict(header)
    del kwargs["t"]
    try:
        try:
            message = cls(**kwargs)  # a header of exactly the message's fields: every honest peer's
        except TypeError:  # a field missing, or one we do not know (a newer peer's): field by field
            kwargs = {}
            for f in _fields(cls):
                if f.name in header:
                    kwargs[f.name] = header[f.name]
                elif f.required:
                    raise RemoteProtocolError(f"{tag} message lacks field {f.name!r}") from None
            message = cls(**kwargs)
        if cls.CHECKED_WHEN_PARSED:
            message.check()
        return message
    except ProtocolError as exc:
        raise RemoteProtocolError.from_error(exc) from None
    except RecursionError:  # (a value nested past the interpreter's limit, by a peer)
        raise RemoteProtocolError(f"{tag} message nested too deeply") from None


def to_header(message: Message) -> dict[str, Any]:
    """The header map for ``message`` (its fields plus the ``t`` tag), by a function generated per class
    (one dict display: a loop over the fields with ``getattr`` cost three times as much per Push)."""
    cls = type(message)
    encode = _ENCODERS.get(cls)
    if encode is None:
        names = [f.name for f in _fields(cls)]
        body = ", ".join([f"'t': {cls.TYPE!r}"] + [f"{name!r}: m.{name}" for name in names])
        env: dict[str, Any] = {}
        exec(f"def to_header(m):\n    return {{{body}}}", env)  # noqa: S102 - our own dataclass fields only
        encode = _ENCODERS[cls] = env["to_header"]
    return cast(dict[str, Any], encode(message))


_ENCODERS: dict[type[Message], Any] = {}


def batch_header(parts: list[tuple[Message, int]]) -> dict[str, Any]:
    """The header of a Batch of ``(message, payload length)`` pairs."""
    return to_header(Batch([to_header(m) for m, _ in parts], [n for _, n in parts]))


def split_batch(batch: Batch, payload: memoryview | None) -> list[tuple[Message, memoryview | None]]:
    """The messages of a received batch, each with its slice of the payload; RemoteProtocolError on any bad
    item."""
    total = 0 if payload is None else payload.nbytes
    if sum(batch.sizes) != total:
        raise RemoteProtocolError(f"batch sizes add up to {sum(batch.sizes)} bytes but the payload has {total}")
    out: list[tuple[Message, memoryview | None]] = []
    offset = 0
    for item, size in zip(batch.items, batch.sizes):
        if not isinstance(item, dict) or not isinstance(item.get("t"), str):
            raise RemoteProtocolError("batch item is not a map with a string field 't'")
        message = parse(item)
        if isinstance(message, Batch):
            raise RemoteProtocolError("batches may not nest")
        out.append((message, payload[offset:offset + size] if payload is not None and size else None))
        offset += size
    return out

