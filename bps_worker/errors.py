"""Errors a user of the worker daemon and its client libraries can meet (nats-core ``errors.py`` model).

Every failure the client API raises derives from :class:`BPSError`. The subclasses keep their facts as
typed attributes and build their message from them, so code catches a class and reads attributes, never
the text:

* :class:`BPSMismatchError` (``name``, ``ours``, ``theirs``): processes disagree about a name;
* :class:`BPSConnectionError` (``peer``): a daemon or peer is unreachable or went away;
* :class:`BPSTimeoutError` (``what``, ``timeout_s``): something did not happen in time.

Each also takes free text: as its whole message where the attributes are not known (the call style of
code written before the attributes: ``BPSConnectionError("worker daemon is stopping")``), or as a detail
after the message built from them. :func:`error_from_failure` turns a daemon's ``Failure`` into the
matching subclass by its ``code``, filling the attributes from the structured fields;
:func:`failure_from_error` is its inverse, for a daemon that hands an error on to its training processes,
and :func:`why_from_error` hands one on to the peers on other machines (an abort at a server).
"""

from __future__ import annotations

from typing import Any, Callable

from protocol.messages import Failure, Why

__all__ = ["BPSError", "BPSMismatchError", "BPSConnectionError", "BPSTimeoutError", "LinkBrokenError",
           "AnswerLostError", "error_from_failure", "failure_from_error", "reworded", "why_from_error"]


def _join(head: str, detail: str) -> str:
    return f"{head}: {detail}" if head and detail else head or detail


class BPSError(RuntimeError):
    """Base class of every failure the client API raises."""

    def _attributes(self) -> dict[str, Any]:
        return {}

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the attributes across pickling (an error handed from a worker process or thread pool).
        return (_rebuild, (type(self), self.args, self._attributes()))


def reworded(error: BPSError, change: Callable[[str], str]) -> BPSError:
    """``error`` again, of its class, with ``change`` applied to its message and to each of its text attributes
    (an internal name put in the words of the call that used it)."""
    def text(value: Any) -> Any:
        return change(value) if isinstance(value, str) else value
    return _rebuild(type(error), tuple(map(text, error.args)), {k: text(v) for k, v in error._attributes().items()})


def _rebuild(cls: type[BPSError], args: tuple[Any, ...], attributes: dict[str, Any]) -> BPSError:
    error = cls.__new__(cls)
    BPSError.__init__(error, *args)
    error.__dict__.update(attributes)
    return error


class BPSMismatchError(BPSError):
    """Processes disagree about a tensor (shape, dtype or operation) for the same name.

    ``name`` is the tensor; ``ours`` and ``theirs`` describe each side (dtype, shape, kind, root, and
    offset/count where those differ): ``tensor 'w' mismatch: ours is float32[8], theirs is float32[9]``.
    """

    name: str
    ours: str
    theirs: str
    detail: str

    def __init__(self, detail: str = "", *, name: str = "", ours: str = "", theirs: str = "") -> None:
        self.name, self.ours, self.theirs, self.detail = name, ours, theirs, detail
        head = f"tensor {name!r} mismatch: ours is {ours}, theirs is {theirs}" if name else ""
        super().__init__(_join(head, detail))

    def _attributes(self) -> dict[str, Any]:
        return {"name": self.name, "ours": self.ours, "theirs": self.theirs, "detail": self.detail}


class BPSConnectionError(BPSError):
    """The worker daemon (or, through it, a peer) could not be reached or went away.

    ``peer`` says what it is, e.g. ``"server 2 at 10.0.0.5:9100"``, ``"worker 1"``, ``"the worker daemon
    at /run/bps/worker-0.sock"``: ``connection to server 2 at 10.0.0.5:9100 failed: connection refused``.
    """

    peer: str
    detail: str

    def __init__(self, detail: str = "", *, peer: str = "") -> None:
        self.peer, self.detail = peer, detail
        super().__init__(_join(f"connection to {peer} failed" if peer else "", detail))

    def _attributes(self) -> dict[str, Any]:
        return {"peer": self.peer, "detail": self.detail}


class LinkBrokenError(BPSConnectionError):
    """A push lost with the worker daemon's connection to a server (raised inside the worker daemon).

    ``unanswered_shm``: the push went as a shared-memory reference and its server never answered, so
    that server may still write the sum into our memory: the caller must not reuse that memory.
    ``fate_unknown``: the push had reached the connection, and the link gave up reconnecting to the server
    run that had it: that run may have summed its round for the other workers (``RoundQuery.fate`` asks).
    """

    unanswered_shm: bool
    fate_unknown: bool

    def __init__(self, detail: str = "", *, peer: str = "", unanswered_shm: bool = False,
                 fate_unknown: bool = False) -> None:
        super().__init__(detail, peer=peer)
        self.unanswered_shm = unanswered_shm
        self.fate_unknown = fate_unknown

    def _attributes(self) -> dict[str, Any]:
        return {**super()._attributes(), "unanswered_shm": self.unanswered_shm, "fate_unknown": self.fate_unknown}


class AnswerLostError(LinkBrokenError):
    """A push that a server, the same run, answered again after our connection to it broke: the other workers
    got its round's sum, ours died with the connection (raised inside the worker daemon). The peers' round
    succeeded, so this failure is this machine's alone."""


class BPSTimeoutError(BPSError):
    """Something did not happen within its timeout.

    ``what`` names it, ``timeout_s`` is how long it was given (None where unknown):
    ``tensor 'w' timed out after 30 s``.
    """

    what: str
    timeout_s: float | None
    detail: str

    def __init__(self, detail: str = "", *, what: str = "", timeout_s: float | None = None) -> None:
        self.what, self.timeout_s, self.detail = what, timeout_s, detail
        head = ""
        if what:
            head = f"{what} timed out" if timeout_s is None else f"{what} timed out after {timeout_s:g} s"
        super().__init__(_join(head, detail))

    def _attributes(self) -> dict[str, Any]:
        return {"what": self.what, "timeout_s": self.timeout_s, "detail": self.detail}


def error_from_failure(failure: Failure) -> BPSError:
    """The typed error for a daemon's ``Failure``: the subclass by ``failure.code``, its attributes from the
    structured fields (never from the message text).

    Where the structured fields are set, the message is built from them plus ``failure.detail``; a Failure
    without them (a sender that does not fill them yet) keeps its whole ``message`` as the error's text.
    ``protocol_error`` means the daemon broke off the connection, so it is a connection error too.
    """
    match failure.code:
        case "mismatch" if failure.name:
            return BPSMismatchError(failure.detail, name=failure.name, ours=failure.ours, theirs=failure.theirs)
        case "mismatch":
            return BPSMismatchError(failure.message)
        case "connection" | "protocol_error" | "duplicate" | "answer_lost" if failure.peer:
            return BPSConnectionError(failure.detail, peer=failure.peer)
        case "connection" | "protocol_error" | "duplicate" | "answer_lost":
            return BPSConnectionError(failure.message)
        case "timeout" if failure.what:
            return BPSTimeoutError(failure.detail, what=failure.what, timeout_s=failure.timeout_s)
        case "timeout":
            return BPSTimeoutError(failure.message)
        case "error" | "round_failed" | "bad_request":
            return BPSError(failure.message)
    raise AssertionError(f"unhandled failure code {failure.code!r}")  # FailureCode is closed: unreachable


def failure_from_error(req: int, error: BPSError, note: str = "") -> Failure:
    """The ``Failure`` that hands ``error`` on (the worker daemon answering its training processes):
    the code of its class and its attributes as the structured fields, so that :func:`error_from_failure`
    on the other side rebuilds the same class with the same attributes. ``note`` is appended to the text
    (and to the detail where the attributes are known)."""
    message = f"{error}{note}"
    match error:
        case BPSMismatchError() if error.name:
            return Failure(req, message, code="mismatch", name=error.name, ours=error.ours, theirs=error.theirs,
                           detail=error.detail + note)
        case BPSMismatchError():
            return Failure(req, message, code="mismatch")
        case BPSConnectionError() if error.peer:
            return Failure(req, message, code="connection", peer=error.peer, detail=error.detail + note)
        case BPSConnectionError():
            return Failure(req, message, code="connection")
        case BPSTimeoutError() if error.what:
            return Failure(req, message, code="timeout", what=error.what, timeout_s=error.timeout_s or 0.0,
                           detail=error.detail + note)
        case BPSTimeoutError():
            return Failure(req, message, code="timeout")
    return Failure(req, message)


def why_from_error(error: BaseException, text: str) -> Why:
    """The :class:`~protocol.messages.Why` that tells ``error`` on to the peers (the worker daemon giving a round
    up at a server, where they meet): ``text`` for people, and a BPSError's code and facts as
    :func:`failure_from_error` gives them (any other exception: the text alone). A mismatch goes as its two
    sides, this one's first: each peer hears its own as ``ours`` (``Why.heard_by``)."""
    if not isinstance(error, BPSError):
        return Why(text)
    f = failure_from_error(-1, error)
    sides = (f.ours, f.theirs) if f.code == "mismatch" and f.name else None
    return Why(text, f.code, name=f.name, ours=f.ours, theirs=f.theirs, peer=f.peer, what=f.what,
               timeout_s=f.timeout_s, detail=f.detail, sides=sides)
