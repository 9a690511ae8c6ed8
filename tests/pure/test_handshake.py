"""protocol.handshake: both sides of every connection's handshake, with no socket.

Every message crosses a real frame encoding (to_header -> frame -> FrameReader -> parse), as on the wire.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, TypeVar

import pytest

from protocol import PROTOCOL_VERSION
from protocol.config import parse_config, placement_digest, placement_items
from protocol.errors import ConfigError, LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.frames import FrameReader, encode_header
from protocol.handshake import (
    HANDSHAKE_MAX_HEADER_BYTES,
    AuthenticationError,
    ClientHandshake,
    ConfigMismatchError,
    Established,
    HandshakeError,
    HandshakeRefused,
    ServerHandshake,
    ShmOffer,
    UnexpectedPeerError,
    VersionMismatchError,
    refusal_proof,
    welcome_proof,
)
from protocol.messages import (
    ROLE_CLIENT,
    ROLE_OBSERVER,
    ROLE_WORKER,
    Challenge,
    Failure,
    Hello,
    Message,
    Welcome,
    parse,
    to_header,
)

TOKEN = b"cluster-token-0123456789abcdef"
OTHER_TOKEN = b"another-token-0123456789abcdef"
KEY = "5a" * 32
PROBE = "bps_w1_4242_0a1b"


def cluster(addresses: list[str] | None = None) -> dict:
    addresses = addresses or ["10.0.0.1:9000", "10.0.0.2:9001", "10.0.0.3:9002", "10.0.0.4:9003"]
    return {
        "cluster": {"workers": 2, "partition_bytes": 1 << 20},
        "server": [{"id": 0, "address": addresses[0], "worker": 0}, {"id": 1, "address": addresses[1], "worker": 1},
                   {"id": 2, "address": addresses[2]}, {"id": 3, "address": addresses[3]}],
        "worker": [{"id": 0, "local_size": 2, "socket": "/run/bps/w0.sock"},
                   {"id": 1, "local_size": 2, "socket": "/run/bps/w1.sock"}],
    }


ITEMS = placement_items(parse_config(cluster()))


M = TypeVar("M", bound=Message)


def wire(message: M | None) -> M:
    """The message as the other side parses it from the bytes."""
    assert message is not None
    frames = FrameReader(max_header_bytes=HANDSHAKE_MAX_HEADER_BYTES).receive_data(
        encode_header(to_header(message), max_header_bytes=HANDSHAKE_MAX_HEADER_BYTES))
    assert len(frames) == 1
    parsed = parse(frames[0].header)
    assert type(parsed) is type(message) and parsed == message
    return parsed  # narrowed to M by the type check above


def worker_hello(**overrides: Any) -> Hello:
    fields: dict[str, Any] = dict(shm=PROBE, shm_key=KEY, epoch="e90c", stream=0, pid=4242,
                                  config_items=list(ITEMS))
    fields.update(overrides)
    return Hello(PROTOCOL_VERSION, ROLE_WORKER, 1, **fields)


def tcp_server(token: bytes | None = TOKEN, **kwargs) -> ServerHandshake:
    kwargs.setdefault("config_items", ITEMS)
    return ServerHandshake(peers={ROLE_WORKER: 2, ROLE_OBSERVER: None}, token=token, who="server 1", **kwargs)


def worker_welcome(hello: Hello, shm: bool = True) -> Welcome:
    return Welcome(PROTOCOL_VERSION, worker=hello.id, workers=2, shm=shm, incarnation="c0ffee00")


def shake(server: ServerHandshake, client: ClientHandshake, welcome=worker_welcome) -> tuple[Established, Established]:
    """A whole handshake; returns (server's result, client's result)."""
    first = client.start()
    if first is None:
        hello = client.receive(wire(server.start()))
    else:
        assert server.start() is None
        hello = first
    assert isinstance(hello, Hello)
    received = server.receive(wire(hello))
    ours = server.accept(welcome(received))
    theirs = client.receive(wire(ours.welcome))
    assert isinstance(theirs, Established)
    assert server.state == client.state == "done"
    return ours, theirs


# -- the happy paths, one per role ------------------------------------------------------------------

def test_worker_with_token_shm_offer_and_config():
    server, client = tcp_server(), ClientHandshake(worker_hello(stream=2), token=TOKEN, who="server 1")
    ours, theirs = shake(server, client)
    assert ours.authenticated and theirs.authenticated
    assert ours.session_key is not None and ours.session_key == theirs.session_key and len(ours.session_key) == 32
    assert ours.hello == theirs.hello and ours.welcome == theirs.welcome
    hello, welcome = theirs.hello, theirs.welcome
    assert (hello.role, hello.id, hello.stream, hello.epoch, hello.pid) == (ROLE_WORKER, 1, 2, "e90c", 4242)
    assert len(hello.nonce) == 32 and len(hello.auth) == 64
    assert server.shm_offer == ours.shm_offer == ShmOffer(PROBE, KEY)
    assert welcome.shm and welcome.worker == 1 and welcome.incarnation == "c0ffee00" and len(welcome.auth) == 64
    assert welcome.config_digest == placement_digest(ITEMS)


def test_session_keys_differ_per_connection():
    a = shake(tcp_server(), ClientHandshake(worker_hello(), token=TOKEN))[1]
    b = shake(tcp_server(), ClientHandshake(worker_hello(), token=TOKEN))[1]
    assert a.session_key != b.session_key and a.hello.nonce != b.hello.nonce


def test_observer_with_token():
    client = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_OBSERVER, 0), token=TOKEN)
    ours, theirs = shake(tcp_server(), client, lambda hello: Welcome(PROTOCOL_VERSION, workers=2))
    assert theirs.authenticated and theirs.shm_offer is None and theirs.welcome.workers == 2
    assert theirs.hello.config_items == []  # an observer need not describe its config


def test_client_on_the_unix_socket_without_challenge_or_token():
    server = ServerHandshake(peers={ROLE_CLIENT: 2}, challenge=False, who="worker 0")
    client = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_CLIENT, 1, pid=777), challenge=False,
                             who="the worker daemon at /run/bps/w0.sock")
    ours, theirs = shake(server, client, lambda hello: Welcome(
        PROTOCOL_VERSION, rank=3, size=4, local_rank=hello.id, local_size=2, worker=0, workers=2))
    assert theirs.session_key is None and not theirs.authenticated
    assert (theirs.welcome.rank, theirs.welcome.local_rank, theirs.hello.pid) == (3, 1, 777)
    assert theirs.hello.auth == "" and theirs.welcome.auth == ""


def test_the_unix_server_may_be_fed_the_hello_without_start():
    server = ServerHandshake(peers={ROLE_CLIENT: 2}, challenge=False)
    assert server.receive(wire(Hello(PROTOCOL_VERSION, ROLE_CLIENT, 0))).id == 0


def test_no_token_on_tcp_skips_both_proofs():
    ours, theirs = shake(tcp_server(token=None), ClientHandshake(worker_hello()))
    assert theirs.hello.auth == "" and theirs.welcome.auth == "" and theirs.session_key is None
    assert ours.session_key is None


def test_a_server_without_token_ignores_a_proof():
    _, theirs = shake(tcp_server(token=None), ClientHandshake(worker_hello(), token=None))
    assert theirs.welcome.worker == 1


def test_a_refused_shm_offer_is_carried_through():
    _, theirs = shake(tcp_server(), ClientHandshake(worker_hello(), token=TOKEN),
                      lambda hello: worker_welcome(hello, shm=False))
    assert theirs.shm_offer == ShmOffer(PROBE, KEY) and not theirs.welcome.shm


# -- relays and changed fields ----------------------------------------------------------------------

def test_a_relayed_hello_is_refused():
    """A squatter on the server's port sends its own challenge, and forwards the worker's answer to
    the real server, whose connection has another nonce."""
    squatter = Challenge("ab" * 16, PROTOCOL_VERSION)
    client = ClientHandshake(worker_hello(), token=TOKEN)
    hello = client.receive(wire(squatter))
    server = tcp_server()
    server.start()
    with pytest.raises(AuthenticationError, match="authentication failed for worker 1: a wrong proof") as info:
        server.receive(wire(hello))
    assert not info.value.missing and server.state == "error"


def test_a_hello_from_another_connection_of_the_same_server_is_refused():
    s1, s2 = tcp_server(), tcp_server()
    hello = ClientHandshake(worker_hello(), token=TOKEN).receive(wire(s1.start()))
    s2.start()
    assert s1.receive(wire(hello)).id == 1
    with pytest.raises(AuthenticationError, match="a wrong proof"):
        s2.receive(wire(hello))


@pytest.mark.parametrize("change", [
    {"stream": 3}, {"shm": "bps_w0_666_evil"}, {"shm_key": "66" * 32}, {"shm": "", "shm_key": ""}, {"epoch": "0"},
    {"id": 0}, {"role": ROLE_OBSERVER}, {"pid": 1}, {"nonce": "cd" * 16},
    {"config_items": list(placement_items(parse_config(cluster(
        ["10.0.0.1:9000", "10.0.0.2:9001", "10.0.0.4:9003", "10.0.0.3:9002"]))))},
], ids=lambda change: ",".join(change))
def test_a_changed_hello_field_is_refused(change):
    """A relay forwards the real challenge and the worker's Hello, but changes one field on the way."""
    server = tcp_server()
    hello = ClientHandshake(worker_hello(), token=TOKEN).receive(wire(server.start()))
    assert isinstance(hello, Hello)
    with pytest.raises(AuthenticationError, match="a wrong proof"):
        server.receive(wire(dataclasses.replace(hello, **change)))


@pytest.mark.parametrize("change", [{"shm": False}, {"incarnation": "0"}, {"worker": 0}, {"workers": 3},
                                    {"config_digest": "0" * 16}])
def test_a_changed_welcome_field_is_refused(change):
    server, client = tcp_server(), ClientHandshake(worker_hello(), token=TOKEN)
    server.receive(wire(client.receive(wire(server.start()))))
    welcome = server.accept(worker_welcome(server.hello)).welcome
    with pytest.raises(AuthenticationError, match="proof is wrong"):
        client.receive(wire(dataclasses.replace(welcome, **change)))
    assert client.state == "error"


def test_a_welcome_from_another_connection_is_refused():
    """A fake server replays a real server's Welcome to another connection (another client nonce)."""
    server, victim = tcp_server(), ClientHandshake(worker_hello(), token=TOKEN)
    challenge = wire(server.start())
    real = ClientHandshake(worker_hello(), token=TOKEN)
    server.receive(wire(real.receive(challenge)))
    welcome = server.accept(worker_welcome(server.hello)).welcome
    victim.receive(challenge)  # the same challenge, replayed; the victim's own nonce differs
    with pytest.raises(AuthenticationError, match="proof is wrong"):
        victim.receive(wire(welcome))


def test_a_handshake_relayed_untouched_to_another_server_is_refused_by_both():
    """Every server holds the token: a stranger on server 2's free address relays the worker's handshake,
    untouched, to server 1, whose proofs hold for that connection. The Hello names server 2 (its proof covers
    that), so server 1 refuses it, signed, before registering anything; and were a server to answer all the
    same, the worker takes no Welcome from another server than the one it meant to reach."""
    server = tcp_server(server=1)
    client = ClientHandshake(worker_hello(), token=TOKEN, server=2, who="server 2 at 10.0.0.3:9002")
    hello = client.receive(wire(server.start()))
    assert isinstance(hello, Hello) and hello.server == 2
    with pytest.raises(UnexpectedPeerError, match="server 1 refuses worker 1: its hello is for server 2") as info:
        server.receive(wire(hello))
    # The refusal is signed (the Hello proved the token) and relayed back: an ordinary one, which the worker
    # retries (it gives up only on a proven ``duplicate`` or ``mismatch``).
    refusal = server.refuse(Failure(-1, str(info.value), code="protocol_error"))
    with pytest.raises(HandshakeRefused) as refused:
        client.receive(wire(refusal))
    assert refused.value.code == "protocol_error"
    lax = tcp_server()  # a server that does not check (no id of its own) welcomes it
    client = ClientHandshake(worker_hello(), token=TOKEN, server=2, who="server 2 at 10.0.0.3:9002")
    lax.receive(wire(client.receive(wire(lax.start()))))
    answer = lax.accept(worker_welcome(lax.hello)).welcome
    assert answer.server == -1
    with pytest.raises(HandshakeError, match="server 2 at 10.0.0.3:9002 answered as no server, not as server 2"):
        client.receive(wire(answer))
    assert client.state == "error"


def test_each_side_names_the_server_and_a_hello_naming_none_is_taken():
    server = tcp_server(server=1)
    ours, theirs = shake(server, ClientHandshake(worker_hello(), token=TOKEN, server=1))
    assert theirs.hello.server == 1 and theirs.welcome.server == 1 and ours.welcome == theirs.welcome
    signed = tcp_server(server=1)
    client = ClientHandshake(worker_hello(), token=TOKEN, server=1)
    signed.receive(wire(client.receive(wire(signed.start()))))
    forged = dataclasses.replace(signed.accept(worker_welcome(signed.hello)).welcome, server=2)
    with pytest.raises(AuthenticationError, match="proof is wrong"):  # the proof covers the Welcome's server
        client.receive(wire(forged))
    # Only a holder of the token can prove a Hello, and ours always name their server: one naming none is taken
    assert shake(tcp_server(server=1), ClientHandshake(worker_hello(), token=TOKEN))[0].hello.server == -1
    with pytest.raises(LocalProtocolError, match="without auth, nonce or server"):
        ClientHandshake(worker_hello(server=1), token=TOKEN)


def test_a_server_without_the_token_is_refused_by_the_worker():
    server, client = tcp_server(token=None), ClientHandshake(worker_hello(), token=TOKEN, who="server 1 at h:9")
    server.receive(wire(client.receive(wire(server.start()))))
    with pytest.raises(AuthenticationError, match="server 1 at h:9 did not prove the cluster token: its welcome "
                                                  "carries no proof") as info:
        client.receive(wire(server.accept(worker_welcome(server.hello)).welcome))
    assert info.value.missing


def test_a_server_with_another_token_is_refused_by_the_worker():
    challenge = Challenge("ab" * 16, PROTOCOL_VERSION)
    client = ClientHandshake(worker_hello(), token=TOKEN)
    hello = client.receive(wire(challenge))
    assert isinstance(hello, Hello)
    welcome = worker_welcome(hello)
    forged = dataclasses.replace(welcome, auth=welcome_proof(OTHER_TOKEN, challenge, hello, welcome))
    with pytest.raises(AuthenticationError, match="proof is wrong"):
        client.receive(wire(forged))


def test_the_worker_refuses_a_proof_made_with_the_hello_label():
    """A Hello proof is never a Welcome proof (reflection), even over the same bytes."""
    server, client = tcp_server(), ClientHandshake(worker_hello(), token=TOKEN)
    challenge = wire(server.start())
    hello = client.receive(challenge)
    server.receive(wire(hello))
    with pytest.raises(AuthenticationError):
        client.receive(wire(Welcome(PROTOCOL_VERSION, worker=1, workers=2, shm=True, auth=hello.auth)))


def test_a_missing_proof_is_refused_by_the_server():
    server = tcp_server()
    server.start()
    with pytest.raises(AuthenticationError, match="authentication failed for worker 1: no proof of the cluster "
                                                  "token") as info:
        server.receive(wire(worker_hello()))
    assert info.value.missing


def test_a_proof_made_with_another_token_is_refused():
    server = tcp_server()
    hello = ClientHandshake(worker_hello(), token=OTHER_TOKEN).receive(wire(server.start()))
    with pytest.raises(AuthenticationError, match="a wrong proof"):
        server.receive(wire(hello))


# -- versions -------------------------------------------------------------------------------------

def test_protocol_version_is_15():
    assert PROTOCOL_VERSION == 15  # 15: Hello.job and Push.job (protocol/__init__.py)


def test_the_server_refuses_another_version():
    server = tcp_server(token=None)
    server.start()
    with pytest.raises(VersionMismatchError, match="protocol version 1 not supported \\(server 1 speaks 15\\)") \
            as info:
        server.receive(wire(Hello(1, ROLE_WORKER, 0)))
    assert (info.value.ours, info.value.theirs) == (PROTOCOL_VERSION, 1)


def test_the_client_refuses_another_version_before_saying_anything():
    """With a token the words are unproven (no proof holds across versions: a stranger may have said them),
    so a worker retries rather than give up; without one (the Unix-socket client) they are the peer's."""
    for token, proven in ((TOKEN, False), (None, True)):
        client = ClientHandshake(worker_hello(), token=token, who="server 1")
        with pytest.raises(VersionMismatchError, match="server 1 speaks protocol version 1; this side speaks 15") \
                as info:
            client.receive(wire(Challenge("ab" * 16, 1)))
        assert info.value.proven is proven and ("not taken as the server's word" in str(info.value)) is not proven
    client = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_CLIENT, 0), challenge=False)
    client.start()
    with pytest.raises(VersionMismatchError, match="welcomed us with protocol version 5") as info:
        client.receive(wire(Welcome(5)))
    assert info.value.proven


# -- who may connect --------------------------------------------------------------------------------

@pytest.mark.parametrize("hello,match", [
    (Hello(PROTOCOL_VERSION, ROLE_WORKER, 7), "server 1 refuses worker 7: its id is outside 0..1; only workers 0..1"),
    (Hello(PROTOCOL_VERSION, ROLE_WORKER, -1), "outside 0..1"),
    (Hello(PROTOCOL_VERSION, ROLE_CLIENT, 0), "server 1 refuses client 0: only workers 0..1, observers may connect"),
    (Hello(PROTOCOL_VERSION, ROLE_OBSERVER, 0, stream=1), "only workers open streams"),
    (Hello(PROTOCOL_VERSION, ROLE_OBSERVER, 0, shm=PROBE, shm_key=KEY), "only workers open streams or offer"),
    (Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, shm=PROBE), "needs both a probe name and a key"),
])
def test_unexpected_peers(hello, match):
    server = tcp_server(token=None)
    server.start()
    with pytest.raises(UnexpectedPeerError, match=match) as info:
        server.receive(wire(hello))
    assert (info.value.role, info.value.ident) == (hello.role, hello.id)


def test_a_local_rank_outside_the_machine():
    server = ServerHandshake(peers={ROLE_CLIENT: 2}, challenge=False, who="worker 0")
    with pytest.raises(UnexpectedPeerError, match="worker 0 refuses client 5: its id is outside 0..1"):
        server.receive(wire(Hello(PROTOCOL_VERSION, ROLE_CLIENT, 5)))


def test_the_proof_is_checked_before_who_it_is():
    server = tcp_server()
    server.start()
    with pytest.raises(AuthenticationError):
        server.receive(wire(Hello(PROTOCOL_VERSION, ROLE_WORKER, 7)))


def test_a_non_hello_first_message():
    server = tcp_server()
    server.start()
    with pytest.raises(HandshakeError, match="expected hello, got welcome"):
        server.receive(wire(Welcome(PROTOCOL_VERSION)))
    client = ClientHandshake(worker_hello(), token=TOKEN)
    with pytest.raises(HandshakeError, match="expected a challenge from server, got welcome"):
        client.receive(wire(Welcome(PROTOCOL_VERSION)))


# -- the placement digest in the handshake -----------------------------------------------------------

SWAPPED = placement_items(parse_config(cluster(["10.0.0.1:9000", "10.0.0.2:9001", "10.0.0.4:9003",
                                                "10.0.0.3:9002"])))


def test_a_worker_with_another_cluster_file_is_refused_naming_what_differs():
    server = tcp_server()
    hello = ClientHandshake(worker_hello(config_items=list(SWAPPED)), token=TOKEN).receive(wire(server.start()))
    with pytest.raises(ConfigMismatchError) as info:
        server.receive(wire(hello))
    error = info.value
    assert error.ours == placement_digest(ITEMS) and error.theirs == placement_digest(SWAPPED) != error.ours
    assert error.differences == (
        "server.2.address is 10.0.0.3:9002 at server 1, 10.0.0.4:9003 at worker 1",
        "server.3.address is 10.0.0.4:9003 at server 1, 10.0.0.3:9002 at worker 1",
    )
    message = str(error)
    assert error.ours in message and error.theirs in message and "server.2.address is 10.0.0.3:9002" in message
    assert message.startswith("worker 1 read another cluster file than server 1")


def test_the_worker_checks_the_servers_digest_too():
    """A server that does not compare (an observer's view, a build that skips it) but names another digest."""
    client = ClientHandshake(worker_hello(), who="server 1")
    client.receive(wire(Challenge("ab" * 16, PROTOCOL_VERSION)))
    welcome = Welcome(PROTOCOL_VERSION, worker=1, workers=2, config_digest=placement_digest(SWAPPED))
    with pytest.raises(ConfigMismatchError, match=f"server 1 read another cluster file \\(placement digest "
                                                  f"{placement_digest(SWAPPED)} there, {placement_digest(ITEMS)} "
                                                  f"here\\)") as info:
        client.receive(wire(welcome))
    assert (info.value.ours, info.value.theirs) == (placement_digest(ITEMS), placement_digest(SWAPPED))


def test_a_hello_without_config_items_is_not_compared():
    _, theirs = shake(tcp_server(), ClientHandshake(worker_hello(config_items=[]), token=TOKEN))
    assert theirs.welcome.config_digest == placement_digest(ITEMS)


def _machines(gpu: int, cpu: int, host: str = "gpu-node-{:03d}.cluster.example.com") -> dict[str, Any]:
    """A cluster file of ``gpu`` machines (a worker and a colocated server each) and ``cpu`` CPU-only servers."""
    return {
        "cluster": {"workers": gpu},
        "server": [{"id": i, "address": f"{host.format(i)}:{9000 + i % 1000}", "worker": i} for i in range(gpu)]
        + [{"id": gpu + i, "address": f"cpu-{i:03d}.cluster.example.org:9100"} for i in range(cpu)],
        "worker": [{"id": i, "local_size": 8, "socket": f"/run/bps/w{i}.sock"} for i in range(gpu)],
    }


@pytest.mark.parametrize("gpu, cpu", [(64, 32), (170, 0), (500, 100)])
def test_the_hello_of_a_large_cluster_fits_the_handshake_header_limit(gpu, cpu):
    # (170 machines once took more than the 512 entries a Hello carried; 160 with such host names more than the
    # 16 KiB a stranger's header could have: every worker was refused, with no word at start-up)
    items = placement_items(parse_config(_machines(gpu, cpu)))
    client = ClientHandshake(worker_hello(config_items=list(items)), token=TOKEN)
    hello = client.receive(wire(tcp_server(config_items=items).start()))
    assert len(encode_header(to_header(hello), max_header_bytes=HANDSHAKE_MAX_HEADER_BYTES)) \
        <= HANDSHAKE_MAX_HEADER_BYTES


def test_a_cluster_file_no_handshake_could_carry_is_refused_at_start_up():
    with pytest.raises(ConfigError, match=r"1000 workers and 1000 servers take 3002 entries .* at most 2048 entries"):
        parse_config(_machines(1000, 0), "big.toml")


# -- refusals, misuse and the error state -------------------------------------------------------------

def test_a_failure_is_a_refusal_with_its_code():
    client = ClientHandshake(worker_hello(), token=None, who="server 1")
    client.receive(wire(Challenge("ab" * 16, PROTOCOL_VERSION)))
    with pytest.raises(HandshakeRefused, match="server 1 refused the connection: authentication failed") as info:
        client.receive(wire(Failure(-1, "authentication failed for worker 1", code="protocol_error")))
    assert info.value.code == "protocol_error" and info.value.reason.startswith("authentication failed")


def _refused_by(server: ServerHandshake, client: ClientHandshake, failure: Failure) -> HandshakeRefused:
    """What ``client`` raises for ``failure`` as ``server`` sends it after the client's Hello."""
    server.receive(wire(client.receive(wire(server.start()))))
    with pytest.raises(HandshakeRefused) as info:
        client.receive(wire(server.refuse(failure)))
    return info.value


def test_with_a_token_a_servers_refusal_is_signed_and_keeps_its_code():
    refused = _refused_by(tcp_server(), ClientHandshake(worker_hello(), token=TOKEN, who="server 1"),
                          Failure(-1, "worker 1 is already served by another daemon", code="duplicate"))
    assert refused.code == "duplicate" and str(refused) == \
        "server 1 refused the connection: worker 1 is already served by another daemon"


@pytest.mark.parametrize("forge", ["none", "zeros", "other token", "other connection", "other text"])
def test_with_a_token_a_refusal_without_its_proof_is_unproven(forge):
    """A stranger on the server's address cannot make a worker give up (``duplicate``, ``mismatch``): a refusal
    whose proof does not hold, for this connection and these words, is code ``unproven``."""
    client, server = ClientHandshake(worker_hello(), token=TOKEN, who="server 1"), tcp_server()
    challenge = server.start()
    hello = client.receive(wire(challenge))
    server.receive(wire(hello))
    failure = Failure(-1, "worker 1 is already served by another daemon", code="duplicate")
    signed = server.refuse(failure)
    sent = {"none": dataclasses.replace(signed, auth=""),
            "zeros": dataclasses.replace(signed, auth="00" * 32),
            "other token": dataclasses.replace(failure, auth=refusal_proof(b"another token", challenge, hello,
                                                                            failure)),
            "other connection": dataclasses.replace(failure, auth=refusal_proof(
                TOKEN, Challenge("cd" * 16, PROTOCOL_VERSION), hello, failure)),
            "other text": dataclasses.replace(signed, message="worker 1 is yours")}[forge]
    with pytest.raises(HandshakeRefused, match="without a proof of the cluster token") as info:
        client.receive(wire(sent))
    assert info.value.code == "unproven"


def test_a_refusal_before_the_hello_proved_the_token_goes_unsigned():
    server = tcp_server()
    server.start()
    with pytest.raises(AuthenticationError):
        server.receive(wire(worker_hello()))  # no proof
    assert server.refuse(Failure(-1, "authentication failed", code="protocol_error")).auth == ""


def test_after_an_error_the_machine_refuses_use():
    server = tcp_server()
    server.start()
    with pytest.raises(AuthenticationError):
        server.receive(wire(worker_hello()))
    with pytest.raises(LocalProtocolError, match="already failed"):
        server.receive(wire(worker_hello()))
    with pytest.raises(LocalProtocolError):
        server.accept(Welcome(PROTOCOL_VERSION))


def test_handshake_errors_are_remote_protocol_errors_and_pickle():
    server = tcp_server(token=None)
    server.start()
    with pytest.raises(ProtocolError) as info:
        server.receive(wire(Hello(PROTOCOL_VERSION, ROLE_WORKER, 9)))
    assert isinstance(info.value, RemoteProtocolError)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is UnexpectedPeerError and str(again) == str(info.value) and again.ident == 9


@pytest.mark.parametrize("misuse", [
    lambda: ServerHandshake(peers={ROLE_CLIENT: 1}, token=TOKEN, challenge=False),
    lambda: ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_CLIENT, 0), token=TOKEN, challenge=False),
    lambda: ClientHandshake(Hello(1, ROLE_WORKER, 0)),
    lambda: ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, auth="ab")),
    lambda: ServerHandshake(peers={ROLE_WORKER: 1}, token=b""),
], ids=["server-token-without-challenge", "client-token-without-challenge", "old-version-hello", "prefilled-auth",
        "empty-token"])
def test_misuse_is_a_local_error(misuse):
    with pytest.raises(LocalProtocolError):
        misuse()


def test_accept_refuses_a_welcome_that_accepts_no_offer_and_calls_out_of_order():
    server = tcp_server(token=None)
    with pytest.raises(LocalProtocolError, match="out of order"):
        server.accept(Welcome(PROTOCOL_VERSION))
    server.start()
    with pytest.raises(LocalProtocolError, match="no verified hello"):
        _ = server.hello
    server.receive(wire(worker_hello(shm="", shm_key="")))
    with pytest.raises(LocalProtocolError, match="did not offer"):
        server.accept(Welcome(PROTOCOL_VERSION, shm=True))
    with pytest.raises(LocalProtocolError, match="without auth"):
        server.accept(Welcome(PROTOCOL_VERSION, auth="00"))


def test_a_welcome_accepting_an_offer_never_made_is_refused_by_the_client():
    client = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_CLIENT, 0), challenge=False)
    client.start()
    with pytest.raises(HandshakeError, match="accepted a shared-memory offer that was not made"):
        client.receive(wire(Welcome(PROTOCOL_VERSION, shm=True)))
