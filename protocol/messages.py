"""Typed control messages carried in frame headers.

Each message is a small frozen dataclass; ``TYPE`` is its tag (the header's ``t``
field). :func:`parse` validates a decoded header against the message's fields
and raises :class:`ProtocolError` naming the offending field, so a daemon never
touches an unvalidated value. :func:`to_header` turns a message back into a map.

Connections (who sends what):

* every connection starts with ``Hello`` from the connecting side, answered by
  ``Welcome`` (or ``Failure`` and a close);
* worker -> server: ``Push`` (+ payload, or a shared-memory reference to the server on
  the worker's host), ``Abort``, ``Reset``, ``Release`` and ``RoundQuery``; server -> worker:
  ``Result`` (+ payload, or written in place), ``RoundInfo`` or ``Failure``; ``StatsRequest``/``Stats`` on both links;
* client -> worker (Unix socket, never a payload): ``Alloc``/``Allocated``,
  ``Op``/``Done``/``Failure``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, get_type_hints

from . import PROTOCOL_VERSION, dtypes
from .errors import ProtocolError

MAX_NAME_CHARS: Final = 1024
MAX_DIMS: Final = 32
MAX_MESSAGE_CHARS: Final = 4096
MAX_SEGMENT_CHARS: Final = 200
MAX_STREAMS: Final = 16  # TCP connections a worker may open to one server (Hello.stream)

ROLE_WORKER: Final = "worker"
ROLE_CLIENT: Final = "client"
ROLE_OBSERVER: Final = "observer"  # may only ask a server for its statistics (tests, monitoring)
KIND_SUM: Final = "sum"
KIND_BROADCAST: Final = "broadcast"


def _check_shape(shape: list[Any]) -> None:
    if len(shape) > MAX_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(f"invalid shape {shape!r}: at most {MAX_DIMS} non-negative integers")


def _check_name(name: str) -> None:
    if not name or len(name) > MAX_NAME_CHARS:
        raise ProtocolError(f"tensor name must have 1 to {MAX_NAME_CHARS} characters, got {len(name)}")


def _check_dtype(dtype: str) -> None:
    if dtype not in dtypes.ITEMSIZE:
        raise ProtocolError(f"unsupported dtype {dtype!r}")


@dataclass(frozen=True, slots=True)
class Message:
    TYPE: ClassVar[str] = ""

    def validate(self) -> None:
        """Semantic checks beyond field types; raise ProtocolError."""


@dataclass(frozen=True, slots=True)
class Challenge(Message):
    """A server's first frame: the nonce a peer signs with the cluster token (see :func:`auth_digest`)."""

    TYPE: ClassVar[str] = "challenge"
    nonce: str
    version: int


@dataclass(frozen=True, slots=True)
class Hello(Message):
    TYPE: ClassVar[str] = "hello"
    version: int
    role: str
    id: int
    pid: int = 0
    auth: str = ""  # auth_digest(token, nonce, role, id) when the cluster has a token_file
    # A worker offering shared memory to the server on its host: a segment it created holding ``shm_key``
    # (hex). A server that can map it and read the key shares the host and the worker's user or group.
    shm: str = ""
    shm_key: str = ""
    # A worker's round numbering: a new epoch (its daemon restarted) means its rounds start again at 0.
    epoch: str = ""
    # Which of a worker's connections to this server (0: the one for control messages; others carry pushes
    # only, see bps_worker.placement: a server with a larger share gets more, so TCP's fair sharing of a
    # link gives it a proportionally larger part).
    stream: int = 0

    def validate(self) -> None:
        if self.role not in (ROLE_WORKER, ROLE_CLIENT, ROLE_OBSERVER):
            raise ProtocolError(f"unknown role {self.role!r}")
        if not 0 <= self.stream < MAX_STREAMS:
            raise ProtocolError(f"hello: stream {self.stream} outside 0..{MAX_STREAMS - 1}")
        if len(self.shm) > MAX_SEGMENT_CHARS or len(self.shm_key) > 128:
            raise ProtocolError("hello: shared-memory probe name or key too long")


@dataclass(frozen=True, slots=True)
class Welcome(Message):
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


@dataclass(frozen=True, slots=True)
class Failure(Message):
    """An operation (``req``), or the connection itself (``req == -1``), failed."""

    TYPE: ClassVar[str] = "failure"
    req: int
    message: str
    code: str = "error"


@dataclass(frozen=True, slots=True)
class Push(Message):
    """One partition of a worker's (locally summed) tensor; payload: ``count`` elements."""

    TYPE: ClassVar[str] = "push"
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

    def validate(self) -> None:
        _check_name(self.name)
        _check_dtype(self.dtype)
        _check_shape(self.shape)
        if min(self.part, self.round, self.offset, self.count, self.worker, self.seg_offset, self.out_offset) < 0 \
                or self.divisor < 1:
            raise ProtocolError("push has a negative part, round, offset, count, worker, seg_offset or out_offset, "
                                "or divisor < 1")
        if max(len(self.segment), len(self.out_segment)) > MAX_SEGMENT_CHARS:
            raise ProtocolError(f"segment name of more than {MAX_SEGMENT_CHARS} characters")
        if bool(self.segment) != bool(self.out_segment):
            raise ProtocolError("push names a shared-memory segment for its data or its result but not both")
        if self.kind not in (KIND_SUM, KIND_BROADCAST):
            raise ProtocolError(f"unknown operation kind {self.kind!r}")
        if self.divisor != 1 and self.dtype not in dtypes.FLOAT_TYPES:
            raise ProtocolError(f"divisor {self.divisor} given for integer dtype {self.dtype}; averages need floats")

    @property
    def payload_nbytes(self) -> int:
        return self.count * dtypes.ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class Result(Message):
    """The finished sum of one partition; payload: the sum in the tensor's dtype, or none when
    ``inplace``: the server wrote it into the shared memory the push named."""

    TYPE: ClassVar[str] = "result"
    req: int
    name: str
    part: int
    round: int
    inplace: bool = False


@dataclass(frozen=True, slots=True)
class Abort(Message):
    """A worker gave up ``round`` of ``name``'s partition ``part``; the server fails it for all."""

    TYPE: ClassVar[str] = "abort"
    name: str
    part: int
    round: int
    worker: int
    message: str

    def validate(self) -> None:
        _check_name(self.name)
        if len(self.message) > MAX_MESSAGE_CHARS:
            raise ProtocolError(f"abort message of {len(self.message)} characters; at most {MAX_MESSAGE_CHARS}")


@dataclass(frozen=True, slots=True)
class Reset(Message):
    """A worker lost all its training processes: its pending rounds are void, its rounds restart at 0."""

    TYPE: ClassVar[str] = "reset"
    worker: int
    epoch: str = ""  # the worker's new round numbering (see Hello.epoch)


@dataclass(frozen=True, slots=True)
class Release(Message):
    """A worker freed shared-memory ``segment``: the server on its host unmaps it."""

    TYPE: ClassVar[str] = "release"
    segment: str

    def validate(self) -> None:
        if not self.segment or len(self.segment) > MAX_SEGMENT_CHARS:
            raise ProtocolError(f"release of a segment name of {len(self.segment)} characters")


@dataclass(frozen=True, slots=True)
class RoundQuery(Message):
    """Worker -> the server holding partition 0 of ``name``: which round should my next push of it be?

    Asked once per name whenever a worker's round numbering starts (daemon start, new job), so that
    a worker machine that comes back joins the round the others are in."""

    TYPE: ClassVar[str] = "round_query"
    req: int
    name: str
    part: int = 0

    def validate(self) -> None:
        _check_name(self.name)
        if self.part < 0:
            raise ProtocolError("round query of a negative part")


@dataclass(frozen=True, slots=True)
class RoundInfo(Message):
    TYPE: ClassVar[str] = "round_info"
    req: int
    round: int


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

    def validate(self) -> None:
        _check_name(self.name)
        if self.nbytes < 0:
            raise ProtocolError("alloc of a negative size")


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

    def validate(self) -> None:
        _check_name(self.name)
        _check_dtype(self.dtype)
        _check_shape(self.shape)
        if self.offset < 0:
            raise ProtocolError(f"negative segment offset {self.offset}")
        if self.kind not in (KIND_SUM, KIND_BROADCAST):
            raise ProtocolError(f"unknown operation kind {self.kind!r}")


@dataclass(frozen=True, slots=True)
class Done(Message):
    """The result of operation ``req`` is in the client's slot, or, when ``segment`` is set (an ``Op`` with
    ``handback`` false), at ``offset`` in that segment of the worker, until the next round of the same name."""

    TYPE: ClassVar[str] = "done"
    req: int
    segment: str = ""
    offset: int = 0

    def validate(self) -> None:
        if len(self.segment) > MAX_SEGMENT_CHARS:
            raise ProtocolError(f"segment name of more than {MAX_SEGMENT_CHARS} characters")
        if self.offset < 0:
            raise ProtocolError(f"negative segment offset {self.offset}")


MAX_BATCH_ITEMS: Final = 1024
# Senders close a batch once its items' estimated header bytes reach this (well under the frame limit).
BATCH_HEADER_BUDGET: Final = 32 * 1024


def estimated_header_bytes(message: Message) -> int:
    """An upper bound of a message's encoded header size, without encoding it."""
    text = len(getattr(message, "name", "")) + len(getattr(message, "message", ""))
    return 4 * text + 24 * len(getattr(message, "shape", ())) + 256


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
            raise ProtocolError(f"batch of {len(self.items)} items; 1 to {MAX_BATCH_ITEMS} allowed")
        if len(self.sizes) != len(self.items):
            raise ProtocolError(f"batch has {len(self.items)} items but {len(self.sizes)} sizes")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.sizes):
            raise ProtocolError("batch sizes must be non-negative integers")


MESSAGES: Final[dict[str, type[Message]]] = {
    cls.TYPE: cls
    for cls in (Challenge, Hello, Welcome, Failure, Push, Result, Abort, Reset, Release, RoundQuery, RoundInfo, Ping,
                StatsRequest, Stats, Alloc, Allocated, Op, Done, Batch)
}

_FIELDS: dict[type[Message], list[tuple[str, type, bool]]] = {}


def _fields(cls: type[Message]) -> list[tuple[str, type, bool]]:
    cached = _FIELDS.get(cls)
    if cached is None:
        hints = get_type_hints(cls)
        cached = []
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            origin = getattr(hint, "__origin__", hint)
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            cached.append((f.name, origin, required))
        _FIELDS[cls] = cached
    return cached


def parse(header: dict[str, Any]) -> Message:
    """Turn a decoded header into its message; ProtocolError names what is wrong."""
    tag = header.get("t")
    cls = MESSAGES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    kwargs: dict[str, Any] = {}
    for name, kind, required in _fields(cls):
        if name not in header:
            if required:
                raise ProtocolError(f"{tag} message lacks field {name!r}")
            continue
        value = header[name]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ProtocolError(f"{tag} message field {name!r} must be {kind.__name__}, got {type(value).__name__}")
        kwargs[name] = value
    message = cls(**kwargs)
    message.validate()
    return message


def to_header(message: Message) -> dict[str, Any]:
    """The header map for ``message`` (its fields plus the ``t`` tag)."""
    header: dict[str, Any] = {"t": message.TYPE}
    for name, _, _ in _fields(type(message)):
        header[name] = getattr(message, name)
    return header


def batch_header(parts: list[tuple[Message, int]]) -> dict[str, Any]:
    """The header of a Batch of ``(message, payload length)`` pairs."""
    return to_header(Batch([to_header(m) for m, _ in parts], [n for _, n in parts]))


def split_batch(batch: Batch, payload: memoryview | None) -> list[tuple[Message, memoryview | None]]:
    """The messages of a batch, each with its slice of the payload; ProtocolError on any bad item."""
    total = 0 if payload is None else payload.nbytes
    if sum(batch.sizes) != total:
        raise ProtocolError(f"batch sizes add up to {sum(batch.sizes)} bytes but the payload has {total}")
    out: list[tuple[Message, memoryview | None]] = []
    offset = 0
    for item, size in zip(batch.items, batch.sizes):
        if not isinstance(item, dict) or not isinstance(item.get("t"), str):
            raise ProtocolError("batch item is not a map with a string field 't'")
        message = parse(item)
        if isinstance(message, Batch):
            raise ProtocolError("batches may not nest")
        out.append((message, payload[offset:offset + size] if payload is not None and size else None))
        offset += size
    return out


def auth_digest(token: bytes, nonce: str, role: str, ident: int) -> str:
    """Proof of holding the cluster token for one connection: HMAC-SHA256 over the server's nonce.

    The token never travels; a captured digest is useless on another connection (fresh nonce).
    """
    return hmac.new(token, f"bps-auth|{nonce}|{role}|{ident}".encode(), hashlib.sha256).hexdigest()


def check_auth(token: bytes, nonce: str, hello: Hello) -> bool:
    return hmac.compare_digest(auth_digest(token, nonce, hello.role, hello.id), hello.auth)


def expect_hello(message: Message, who: str) -> Hello:
    """The first message a daemon reads: a Hello of our protocol version, or a ProtocolError."""
    if not isinstance(message, Hello):
        raise ProtocolError(f"expected hello, got {message.TYPE}")
    if message.version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {message.version} not supported (this {who} speaks "
                            f"{PROTOCOL_VERSION})")
    return message
