"""One connection handshake for every transport, as pure steps (sans-IO).

Both ends of every connection (worker -> server over TCP, observer -> server over TCP, client ->
worker daemon over the Unix socket) run the same two small state machines: the accepting side a
:class:`ServerHandshake`, the connecting side a :class:`ClientHandshake`. They are fed parsed
messages and return the next message to send, or the verified result (:class:`Established`); they
never touch a socket, a clock or shared memory.

Theory of operation
-------------------
::

    accepting side (ServerHandshake)                 connecting side (ClientHandshake)
    start() -> Challenge(Ns, version)  ------------>  receive(Challenge) -> Hello(..., nonce=Nc,
                                                                                auth=P_hello)
    receive(Hello) -> the verified Hello  <---------
      (the caller decides what only it can: may it map the shared-memory probe? the role's
       Welcome fields: rank, worker, incarnation...)
    accept(Welcome) -> Established, whose .welcome
      carries auth=P_welcome and config_digest  --->  receive(Welcome) -> Established
    (a refusal: the HandshakeError, sent as Failure(-1)) receive(Failure) raises HandshakeRefused

With a cluster token both sides prove it, each on the *other* side's fresh nonce, and each proof is
an HMAC-SHA256 over a canonical encoding (:func:`transcript`: sorted-key JSON of the messages' fields)
of everything said so far:

* ``P_hello   = HMAC(token, "bps-hello/2"   | Challenge | Hello without auth)``
* ``P_welcome = HMAC(token, "bps-welcome/2" | Challenge | Hello without auth | Welcome without auth)``
* ``session_key = HMAC(token, "bps-session/2" | the same)`` (32 bytes, never sent)
* ``P_refusal = HMAC(token, "bps-refusal/2" | Challenge | Hello without auth | Failure without auth)``, in a
  refusal's ``auth`` (:meth:`ServerHandshake.refuse`, once a Hello proved the token). The connecting side
  takes a refusal without it as code ``unproven`` (:class:`HandshakeRefused`): a worker gives up at once,
  or backs off, only on the server's proven word (``duplicate``: another daemon has our id; ``mismatch``:
  another cluster file), never on a stranger's that holds the address. For the same reason a Challenge or
  Welcome of another protocol version is unproven where a token is set (``VersionMismatchError.proven``: no
  proof holds across versions), and retried.

So a proof holds for one connection (its two nonces) and one set of values: a relay that forwards a
worker's Hello to another connection (another Ns), or changes ``stream``, ``shm``, ``shm_key``,
``epoch``, ``daemon``, ``id``, ``role``, ``server`` or the config description on the way, is refused by the
server; a fake server (no token) or a replayed Welcome (another Nc) is refused by the worker before it sends
anything else, so a restart replay never goes to an unproven server. The labels keep a Hello proof from ever
passing for a Welcome proof.

The proofs also say *which* server: every server holds the same token, so a stranger on a free server's
address could relay the whole handshake, untouched, to another server's, and pass that server's proof off
as the free one's (then answer the worker's pushes itself). So a worker's or observer's Hello names the
server it is for (``Hello.server``: a server refuses a Hello for another, before registering anything), and
the Welcome the server that answers (``Welcome.server``: a worker refuses any other). A Hello that names no
server (-1) is taken: only a holder of the token can prove one, and our worker and observer always name it.

What the token gives: both ends know the other holds it, and the handshake's fields are the ones both
ends sent. What it does not give: the frames after the handshake are neither encrypted nor MACed (a
relay that forwards the handshake untouched can still read and change pushes and results).
:attr:`Established.session_key` is the key both ends can use to MAC result frames (issue 14, item 1);
nothing uses it yet. Without a token both sides skip the proofs, as in version 1, and the
session key is None.

The Unix-socket client session has no token and no challenge (``challenge=False`` on both sides): the
client sends its Hello first. A token without a challenge is refused at construction (a proof without
the accepting side's fresh nonce could be replayed).

The placement digest (issue 14, item 7): a worker's Hello carries ``config_items``, its cluster file's
placement-relevant entries (:func:`protocol.config.placement_items`); a server built with its own
refuses a Hello whose entries differ (:class:`ConfigMismatchError`: both digests and the entries that
differ) and puts its digest in the Welcome, which the worker checks too.

After any error the machine is in the ``error`` state and refuses further use (the connection must be
closed), as :class:`protocol.frames.FrameReader` does.

How each of the five sites uses it
----------------------------------
* Server (``bps_server`` ServerConnection): ``hs = ServerHandshake(peers={ROLE_WORKER: workers,
  ROLE_OBSERVER: None}, token=token, config_items=placement_items(cluster), server=id, who=f"server {id}")``;
  in ``connection_made`` send ``hs.start()`` (the Challenge) and size the reader with
  :data:`HANDSHAKE_MAX_HEADER_BYTES` and :data:`HANDSHAKE_BUFFER_BYTES`; on the first message ``hello = hs.receive(message)``, then
  ``shm = self._accept_shm(hs.shm_offer, hello.id)`` (owner check, map, read the key), the
  registration (streams, links, epoch), and ``send(hs.accept(Welcome(PROTOCOL_VERSION, worker=...,
  workers=..., shm=shm, incarnation=...)).welcome)``; an observer gets ``hs.accept(Welcome(
  PROTOCOL_VERSION, workers=...))``. A HandshakeError is a ProtocolError: the existing
  ``hs.refuse(Failure(-1, str(exc), code="protocol_error"))`` and close (every refusal is signed). Keep ``.session_key`` for result MACs.
* Worker link to a server (``bps_worker`` ServerLink._connect): ``hs = ClientHandshake(Hello(
  PROTOCOL_VERSION, ROLE_WORKER, worker_id, shm=probe_name, shm_key=key, epoch=epoch, stream=stream,
  config_items=list(placement_items(cluster)), daemon=daemon_id()), token=token, server=spec.id,
  who=f"server {spec.id} at {address}")``;
  on the Challenge send ``hs.receive(challenge)`` (a Hello); on the Welcome (or a Failure during the
  handshake) ``est = hs.receive(message)`` (raises HandshakeRefused / AuthenticationError / ...:
  close and reconnect, or fail with the error's text); ``self.shm = est.welcome.shm``; the
  incarnation from ``est.welcome.incarnation``; replay only after this returned.
* Worker's client session on the Unix socket (``bps_worker`` ClientSession): ``hs =
  ServerHandshake(peers={ROLE_CLIENT: local_size}, challenge=False, who=f"worker {worker_id}")``;
  ``hello = hs.receive(message)``; the "already connected" check stays with the session; then
  ``send(hs.accept(Welcome(PROTOCOL_VERSION, rank=..., size=..., local_rank=hello.id, ...)).welcome)``.
* Training-process client (``bps_worker`` client ``_Connection._handshake``): ``hs =
  ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_CLIENT, local_rank, os.getpid()), challenge=False,
  who=f"the worker daemon at {path}")``; send ``hs.start()`` (the Hello), then ``welcome =
  hs.receive(parse(first_frame)).welcome``; HandshakeRefused -> the BPSError "refused local rank".
* Launcher's stats observer (``bps_worker.launch.server_stats``): ``hs = ClientHandshake(Hello(
  PROTOCOL_VERSION, ROLE_OBSERVER, 0), token=token, server=spec.id, who=f"server {spec.id}")``; on the
  Challenge send ``hs.receive(challenge)`` and the StatsRequest; feed the Welcome to ``hs.receive`` before
  believing the Stats that follow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from typing import Any, Final, Literal, Mapping, Sequence, overload

from . import PROTOCOL_VERSION
from .config import placement_differences, placement_digest
from .errors import LocalProtocolError, RemoteProtocolError
from .messages import ROLE_WORKER, Challenge, Failure, Hello, Message, Welcome, to_header

# The header limit an accepting side sets on its FrameReader until the handshake is done: a Hello with the
# largest config description a cluster file may have (messages.MAX_CONFIG_CHARS, about 600 machines) fits;
# nothing larger is read from a stranger (whose buffer starts small: HANDSHAKE_BUFFER_BYTES).
HANDSHAKE_MAX_HEADER_BYTES: Final = 128 * 1024
# The receive buffer an accepting side gives a peer until its Hello is verified: a small cluster's Hello
# fits; a larger one grows it, up to the header limit (protocol.frames.FrameReader).
HANDSHAKE_BUFFER_BYTES: Final = 4 * 1024
NONCE_BYTES: Final = 16  # of randomness in each side's nonce (hex: 32 characters)
SESSION_KEY_BYTES: Final = 32
HELLO_CONTEXT: Final = f"bps-hello/{PROTOCOL_VERSION}"
WELCOME_CONTEXT: Final = f"bps-welcome/{PROTOCOL_VERSION}"
SESSION_CONTEXT: Final = f"bps-session/{PROTOCOL_VERSION}"
REFUSAL_CONTEXT: Final = f"bps-refusal/{PROTOCOL_VERSION}"

State = Literal["idle", "await_challenge", "await_hello", "deciding", "await_welcome", "done", "error"]


# -- errors ------------------------------------------------------------------------------------------
class HandshakeError(RemoteProtocolError):
    """The handshake did not complete; the connection must be closed. ``who``: the peer or our side's label."""

    def __init__(self, message: str, *, who: str = "") -> None:
        super().__init__(message)
        self.who = who

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


class VersionMismatchError(HandshakeError):
    """The peer speaks another protocol version (``theirs``; ours is ``ours``). ``proven`` is False where a
    cluster token is set: no proof is checked across versions, so the words may be a stranger's on the
    server's address, and a worker retries as it does after an ``unproven`` refusal."""

    def __init__(self, message: str, *, who: str = "", ours: int = PROTOCOL_VERSION, theirs: int = 0,
                 proven: bool = True) -> None:
        super().__init__(message, who=who)
        self.ours = ours
        self.theirs = theirs
        self.proven = proven


class AuthenticationError(HandshakeError):
    """The peer did not prove the cluster token for this connection (``missing``: it sent no proof)."""

    def __init__(self, message: str, *, who: str = "", missing: bool = False) -> None:
        super().__init__(message, who=who)
        self.missing = missing


class UnexpectedPeerError(HandshakeError):
    """A Hello from a role, id or stream this side does not accept."""

    def __init__(self, message: str, *, who: str = "", role: str = "", ident: int = -1) -> None:
        super().__init__(message, who=who)
        self.role = role
        self.ident = ident


class ConfigMismatchError(HandshakeError):
    """The two sides read different cluster files: ``ours``/``theirs`` placement digests, and the
    entries that differ (``differences``; empty where only the peer's digest is known)."""

    def __init__(self, message: str, *, who: str = "", ours: str = "", theirs: str = "",
                 differences: Sequence[str] = ()) -> None:
        super().__init__(message, who=who)
        self.ours = ours
        self.theirs = theirs
        self.differences = tuple(differences)


class HandshakeRefused(HandshakeError):
    """The accepting side answered our Hello with a Failure (``message``, ``code``)."""

    def __init__(self, message: str, *, who: str = "", reason: str = "", code: str = "error") -> None:
        super().__init__(message, who=who)
        self.reason = reason
        self.code = code


def _rebuild(cls: type[HandshakeError], message: str, attrs: dict[str, Any]) -> HandshakeError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(attrs)
    return error


# -- the proofs ----------------------------------------------------------------------------------------
def transcript(context: str, challenge: Challenge | None, hello: Hello, welcome: Welcome | None = None,
               refusal: Failure | None = None) -> bytes:
    """The canonical bytes a proof covers: every field of each message but its ``auth``, as sorted-key
    ASCII JSON (so both sides encode the same values to the same bytes, whatever the map order)."""

    def fields(message: Message | None) -> dict[str, Any] | None:
        if message is None:
            return None
        header = to_header(message)
        header.pop("auth", None)
        return header

    document = {"context": context, "challenge": fields(challenge), "hello": fields(hello),
                "welcome": fields(welcome)}
    if refusal is not None:
        document["refusal"] = fields(refusal)
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def hello_proof(token: bytes, challenge: Challenge | None, hello: Hello) -> str:
    """The connecting side's proof: the token, on the accepting side's nonce and all of the Hello."""
    return hmac.new(token, transcript(HELLO_CONTEXT, challenge, hello), hashlib.sha256).hexdigest()


def welcome_proof(token: bytes, challenge: Challenge | None, hello: Hello, welcome: Welcome) -> str:
    """The accepting side's proof: the token, on the connecting side's nonce, that Hello and this Welcome."""
    return hmac.new(token, transcript(WELCOME_CONTEXT, challenge, hello, welcome), hashlib.sha256).hexdigest()


def session_key(token: bytes, challenge: Challenge | None, hello: Hello, welcome: Welcome) -> bytes:
    """A key only the two ends of this connection know (for MACs on later frames); never sent."""
    return hmac.new(token, transcript(SESSION_CONTEXT, challenge, hello, welcome), hashlib.sha256).digest()


def refusal_proof(token: bytes, challenge: Challenge | None, hello: Hello, refusal: Failure) -> str:
    """The accepting side's proof on a refusal: the token, on the connecting side's nonce, that Hello and this
    Failure (so a refusal that makes a worker give up, ``duplicate`` or ``mismatch``, is the server's own)."""
    return hmac.new(token, transcript(REFUSAL_CONTEXT, challenge, hello, refusal=refusal),
                    hashlib.sha256).hexdigest()


def _proof_holds(expected: str, given: str) -> bool:
    return hmac.compare_digest(expected.encode("ascii"), given.encode("ascii", "replace"))


# -- results -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ShmOffer:
    """A worker's shared-memory offer: its probe segment, which should hold ``key`` (hex)."""

    segment: str
    key: str


@dataclass(frozen=True, slots=True)
class Established:
    """A finished handshake: the Hello and Welcome as they went over the wire (with their proofs)."""

    hello: Hello
    welcome: Welcome
    # HMAC key for MACs on this connection's later frames; None without a token (nothing authenticated).
    session_key: bytes | None

    @property
    def authenticated(self) -> bool:
        """Both sides proved the cluster token."""
        return self.session_key is not None

    @property
    def shm_offer(self) -> ShmOffer | None:
        return _offer(self.hello)


def _offer(hello: Hello) -> ShmOffer | None:
    return ShmOffer(hello.shm, hello.shm_key) if hello.shm else None


def _new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _check_token_mode(token: bytes | None, challenge: bool) -> None:
    if token is not None and not challenge:
        raise LocalProtocolError("a cluster token needs a challenge: without the accepting side's fresh nonce "
                                 "a proof could be replayed")
    if token is not None and not token:
        raise LocalProtocolError("an empty cluster token")


class _Machine:
    """What both sides share: the state and the error state."""

    __slots__ = ("_state", "who")

    def __init__(self, who: str) -> None:
        self._state: State = "idle"
        self.who = who

    @property
    def state(self) -> State:
        return self._state

    def _expect(self, *states: State) -> None:
        if self._state == "error":
            raise LocalProtocolError(f"the handshake with {self.who} already failed; close the connection")
        if self._state not in states:
            raise LocalProtocolError(f"handshake call out of order in state {self._state!r}")

    def _fail(self, error: HandshakeError) -> HandshakeError:
        self._state = "error"
        return error


# -- the accepting side --------------------------------------------------------------------------------
class ServerHandshake(_Machine):
    """The accepting side: challenge (TCP), verify the Hello, then sign the caller's Welcome.

    ``peers`` maps each role this side accepts to its number of ids (``0..n-1``), or None for any id.
    ``config_items``: this side's placement description; a Hello that carries another is refused.
    ``server``: this side's server id (a server's connections): a Hello for another server is refused, and
    the Welcome names this one. ``who`` names this side in errors (``"server 1"``, ``"worker 0"``).
    """

    __slots__ = ("peers", "token", "config_items", "server", "challenge", "_nonce", "_challenge", "_hello",
                 "_proven")

    def __init__(self, *, peers: Mapping[str, int | None], token: bytes | None = None,
                 config_items: Sequence[str] | None = None, challenge: bool = True, nonce: str | None = None,
                 server: int | None = None, who: str = "server") -> None:
        super().__init__(who)
        _check_token_mode(token, challenge)
        self.peers = dict(peers)
        self.server = server
        self.token = token
        self.config_items = None if config_items is None else tuple(config_items)
        self.challenge = challenge
        self._nonce = nonce or _new_nonce()
        self._challenge: Challenge | None = None
        self._hello: Hello | None = None
        self._proven: Hello | None = None  # a Hello whose proof held (or any, without a token), checked or not

    def start(self) -> Challenge | None:
        """The first message to send: the Challenge, or None without one (the peer speaks first)."""
        self._expect("idle")
        self._state = "await_hello"
        if self.challenge:
            self._challenge = Challenge(self._nonce, PROTOCOL_VERSION)
        return self._challenge

    def receive(self, message: Message) -> Hello:
        """The peer's first message: the Hello, checked (version, proof, role/id/stream, config)."""
        if self._state == "idle" and not self.challenge:
            self.start()
        self._expect("await_hello")
        try:
            hello = self._check(message)
        except HandshakeError as exc:
            raise self._fail(exc) from None
        self._hello = hello
        self._state = "deciding"
        return hello

    @property
    def hello(self) -> Hello:
        """The verified Hello (after :meth:`receive`)."""
        if self._hello is None:
            raise LocalProtocolError("no verified hello yet")
        return self._hello

    @property
    def shm_offer(self) -> ShmOffer | None:
        """The peer's shared-memory probe offer, for the caller to try (None: no offer)."""
        return _offer(self.hello)

    def accept(self, welcome: Welcome) -> Established:
        """Sign the caller's Welcome (its ``auth``, ``config_digest`` and ``server`` are filled in here); send
        ``.welcome`` of the result."""
        self._expect("deciding")
        hello = self.hello
        if welcome.version != PROTOCOL_VERSION or welcome.auth or welcome.config_digest or welcome.server != -1:
            raise LocalProtocolError("accept() takes a Welcome of our version without auth, config_digest or server")
        if self.server is not None:
            welcome = dataclasses.replace(welcome, server=self.server)
        if welcome.shm and not hello.shm:
            raise LocalProtocolError(f"a welcome accepting shared memory that {hello.role} {hello.id} did not offer")
        if self.config_items is not None:
            welcome = dataclasses.replace(welcome, config_digest=placement_digest(self.config_items))
        key = None
        if self.token is not None:
            welcome = dataclasses.replace(welcome, auth=welcome_proof(self.token, self._challenge, hello, welcome))
            key = session_key(self.token, self._challenge, hello, welcome)
        self._state = "done"
        return Established(hello, welcome, key)

    def refuse(self, failure: Failure) -> Failure:
        """``failure`` (a refusal, ``req == -1``) to send, signed (``auth``, :func:`refusal_proof`) where a
        token is set and a Hello proved it, whatever the refusal is for: the connecting side takes a refusal
        it cannot verify as from a server that is not ours. In any state; unsigned before such a Hello."""
        if self.token is None or self._proven is None:
            return failure
        failure = dataclasses.replace(failure, auth="")
        return dataclasses.replace(failure, auth=refusal_proof(self.token, self._challenge, self._proven, failure))

    # -- the checks, in order: what it is, its version, its proof (before anything else), who it is, its config
    def _check(self, message: Message) -> Hello:
        if not isinstance(message, Hello):
            raise HandshakeError(f"expected hello, got {message.TYPE}", who=self.who)
        if message.version != PROTOCOL_VERSION:
            raise VersionMismatchError(f"protocol version {message.version} not supported ({self.who} speaks "
                                       f"{PROTOCOL_VERSION})", who=self.who, theirs=message.version)
        peer = f"{message.role} {message.id}"
        if self.token is not None and not _proof_holds(hello_proof(self.token, self._challenge, message),
                                                       message.auth):
            what = "no proof" if not message.auth else \
                "a wrong proof (another token, or one made for another connection or other values)"
            raise AuthenticationError(f"authentication failed for {peer}: {what} of the cluster token",
                                      who=self.who, missing=not message.auth)
        self._proven = message
        self._check_peer(message, peer)
        if self.config_items is not None and message.config_items:
            self._check_config(message, peer)
        # (after the config: another cluster file puts servers elsewhere, which the mismatch's refusal explains)
        if self.server is not None and message.server not in (-1, self.server):
            raise UnexpectedPeerError(f"{self.who} refuses {peer}: its hello is for server {message.server} (a "
                                      f"handshake relayed from that server's address, or a cluster file that puts "
                                      f"that server at this one's)", who=self.who, role=message.role,
                                      ident=message.id)
        return message

    def _check_peer(self, hello: Hello, peer: str) -> None:
        if hello.role not in self.peers:
            allowed = ", ".join(r + "s" if n is None else f"{r}s 0..{n - 1}" for r, n in self.peers.items())
            raise UnexpectedPeerError(f"{self.who} refuses {peer}: only {allowed} may connect", who=self.who,
                                      role=hello.role, ident=hello.id)
        count = self.peers[hello.role]
        if count is not None and not 0 <= hello.id < count:
            raise UnexpectedPeerError(f"{self.who} refuses {peer}: its id is outside 0..{count - 1}; only "
                                      f"{hello.role}s 0..{count - 1} may connect", who=self.who,
                                      role=hello.role, ident=hello.id)
        if hello.role != ROLE_WORKER and (hello.stream or hello.shm):
            raise UnexpectedPeerError(f"{self.who} refuses {peer}: only workers open streams or offer shared "
                                      f"memory", who=self.who, role=hello.role, ident=hello.id)
        if bool(hello.shm) != bool(hello.shm_key):
            raise UnexpectedPeerError(f"{self.who} refuses {peer}: a shared-memory offer needs both a probe "
                                      f"name and a key", who=self.who, role=hello.role, ident=hello.id)

    def _check_config(self, hello: Hello, peer: str) -> None:
        assert self.config_items is not None
        ours, theirs = placement_digest(self.config_items), placement_digest(hello.config_items)
        if ours == theirs:
            return
        differences = placement_differences(self.config_items, hello.config_items, here=f"at {self.who}",
                                            there=f"at {peer}")
        shown = "; ".join(differences[:8]) + (f"; and {len(differences) - 8} more" if len(differences) > 8 else "")
        raise ConfigMismatchError(f"{peer} read another cluster file than {self.who} (placement digest {theirs} "
                                  f"at {peer}, {ours} at {self.who}): {shown or 'the same entries, reordered'}",
                                  who=self.who, ours=ours, theirs=theirs, differences=differences)


# -- the connecting side -------------------------------------------------------------------------------
class ClientHandshake(_Machine):
    """The connecting side: answer the Challenge with the Hello, then verify the Welcome.

    ``hello``: what to say (role, id, pid, shm offer, epoch, stream, config_items); its ``nonce``, ``auth``
    and ``server`` are filled in here. ``server``: the server id this connection is meant to reach (a
    worker's or an observer's): the Hello names it, and a Welcome from another server is refused. ``who``
    names the peer in errors (``"server 1 at 10.0.0.2:9001"``).
    """

    __slots__ = ("token", "challenge", "server", "_template", "_nonce", "_challenge", "_hello")

    def __init__(self, hello: Hello, *, token: bytes | None = None, challenge: bool = True,
                 nonce: str | None = None, server: int | None = None, who: str = "server") -> None:
        super().__init__(who)
        _check_token_mode(token, challenge)
        if hello.version != PROTOCOL_VERSION or hello.auth or hello.nonce or hello.server != -1:
            raise LocalProtocolError("ClientHandshake takes a Hello of our version without auth, nonce or server")
        self.token = token
        self.challenge = challenge
        self.server = server
        self._template = hello if server is None else dataclasses.replace(hello, server=server)
        self._nonce = nonce or _new_nonce()
        self._challenge: Challenge | None = None
        self._hello: Hello | None = None

    def start(self) -> Hello | None:
        """Without a challenge: the Hello to send now. With one: None (wait for the Challenge)."""
        self._expect("idle")
        if self.challenge:
            self._state = "await_challenge"
            return None
        self._state = "await_welcome"
        self._hello = self._make_hello()
        return self._hello

    @overload
    def receive(self, message: Challenge) -> Hello: ...
    @overload
    def receive(self, message: Welcome | Failure) -> Established: ...
    @overload
    def receive(self, message: Message) -> Hello | Established: ...

    def receive(self, message: Message) -> Hello | Established:
        """Feed the peer's message: a Challenge gives the Hello to send; the Welcome gives the result.

        A Failure (the peer refused us) raises :class:`HandshakeRefused`."""
        if self._state == "idle":
            self.start()
        self._expect("await_challenge", "await_welcome")
        try:
            if isinstance(message, Failure):
                raise self._refused(message)
            if self._state == "await_challenge":
                return self._answer(message)
            return self._finish(message)
        except HandshakeError as exc:
            raise self._fail(exc) from None

    def _version_mismatch(self, text: str, theirs: int) -> VersionMismatchError:
        """The error for a Challenge or Welcome of another version: unproven where a token is set (no proof
        holds across versions), as a refusal without its proof is."""
        if self.token is None:
            return VersionMismatchError(text, who=self.who, theirs=theirs)
        return VersionMismatchError(f"{text} (said before any proof of the cluster token: not taken as the "
                                    f"server's word)", who=self.who, theirs=theirs, proven=False)

    def _refused(self, refusal: Failure) -> HandshakeRefused:
        """The error for ``refusal``. With a token, one without a proof that holds (:func:`refusal_proof`) is
        code ``unproven``: whoever sent it did not show the token, so a worker does not give up on its word
        (``duplicate``, ``mismatch``) but retries, as from a server that is not up."""
        text = f"{self.who} refused the connection: {refusal.message}"
        if self.token is None:
            return HandshakeRefused(text, who=self.who, reason=refusal.message, code=refusal.code)
        if self._hello is None or not _proof_holds(refusal_proof(self.token, self._challenge, self._hello, refusal),
                                                   refusal.auth):
            return HandshakeRefused(f"{text} (a refusal without a proof of the cluster token: not taken as the "
                                    f"server's word)", who=self.who, reason=refusal.message, code="unproven")
        return HandshakeRefused(text, who=self.who, reason=refusal.message, code=refusal.code)

    def _make_hello(self) -> Hello:
        hello = dataclasses.replace(self._template, nonce=self._nonce)
        if self.token is not None:
            hello = dataclasses.replace(hello, auth=hello_proof(self.token, self._challenge, hello))
        return hello

    def _answer(self, message: Message) -> Hello:
        if not isinstance(message, Challenge):
            raise HandshakeError(f"expected a challenge from {self.who}, got {message.TYPE}", who=self.who)
        if message.version != PROTOCOL_VERSION:
            raise self._version_mismatch(f"{self.who} speaks protocol version {message.version}; this side "
                                         f"speaks {PROTOCOL_VERSION}", message.version)
        self._challenge = message
        self._hello = self._make_hello()
        self._state = "await_welcome"
        return self._hello

    def _finish(self, message: Message) -> Established:
        hello = self._hello
        assert hello is not None
        if not isinstance(message, Welcome):
            raise HandshakeError(f"expected a welcome from {self.who}, got {message.TYPE}", who=self.who)
        if message.version != PROTOCOL_VERSION:
            raise self._version_mismatch(f"{self.who} welcomed us with protocol version {message.version}; this "
                                         f"side speaks {PROTOCOL_VERSION}", message.version)
        key = None
        if self.token is not None:
            if not _proof_holds(welcome_proof(self.token, self._challenge, hello, message), message.auth):
                what = "its welcome carries no proof (a server without the token, or not ours)" if not message.auth \
                    else "its welcome's proof is wrong (another token, or made for another connection or values)"
                raise AuthenticationError(f"{self.who} did not prove the cluster token: {what}", who=self.who,
                                          missing=not message.auth)
            key = session_key(self.token, self._challenge, hello, message)
        if message.shm and not hello.shm:
            raise HandshakeError(f"{self.who} accepted a shared-memory offer that was not made", who=self.who)
        if self.server is not None and message.server != self.server:
            raise HandshakeError(f"{self.who} answered as " + (f"server {message.server}" if message.server >= 0
                                 else "no server") + f", not as server {self.server}: our handshake was relayed "
                                 f"to another server (or that server is at this address); not connected",
                                 who=self.who)
        if hello.config_items and message.config_digest:
            ours = placement_digest(hello.config_items)
            if ours != message.config_digest:
                raise ConfigMismatchError(f"{self.who} read another cluster file (placement digest "
                                          f"{message.config_digest} there, {ours} here)", who=self.who,
                                          ours=ours, theirs=message.config_digest)
        self._state = "done"
        return Established(hello, message, key)
