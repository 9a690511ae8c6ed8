"""The worker's link in asynchronous mode, through a fake transport: each answer's value and vector are kept
as a copy, replayed to a restarted server before anything else and followed by ``Restored``; a delta whose
answer never came goes again after them."""

from __future__ import annotations

import numpy as np

from bps_worker.link import ServerLink, _LinkProtocol
from protocol.config import ServerSpec
from protocol.messages import KIND_ASYNC, KIND_ASYNC_INIT, Failure, Push, Restored, Result
from fake_transport import FakeTransport

FIELDS = {"name": "w", "part": 0, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}


def _connected(link: ServerLink) -> tuple[_LinkProtocol, FakeTransport]:
    proto = _LinkProtocol(link)
    transport = FakeTransport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.proven = True  # (as once its Welcome is verified)
    link._proto, link._ready = proto, True  # as after a handshake
    return proto, transport


def _link(worker: int) -> tuple[ServerLink, _LinkProtocol, FakeTransport]:
    """Worker ``worker``'s link, connected to a server's run "run-1"."""
    link = ServerLink(ServerSpec(0, "127.0.0.1", 9, None), worker, credit_bytes=1 << 20, timeout=5.0,
                      max_payload_bytes=1 << 20)
    proto, transport = _connected(link)
    link.incarnation = "run-1"
    return link, proto, transport


def _answer(link: ServerLink, proto: _LinkProtocol, push: Push, value: list[float], applied: list[int]) -> None:
    payload = np.array(value, np.float32)
    link.on_message(proto, Result(push.req, push.name, push.part, push.round, applied=applied),
                    memoryview(payload).cast("B"))


def _last_push(transport: FakeTransport) -> Push:
    pushes = [m for m, _ in transport.messages() if isinstance(m, Push)]
    return pushes[-1]


async def test_a_restarted_server_gets_our_copy_then_restored_then_the_delta_again():
    link, proto, transport = _link(1)
    dest = memoryview(bytearray(8))
    link.push({**FIELDS, "round": 0, "kind": KIND_ASYNC_INIT, "root": 0, "staleness": 2},
              memoryview(bytearray(8)), dest, 0)
    _answer(link, proto, _last_push(transport), [1, 2], [0, 0])
    link.push({**FIELDS, "round": 1, "kind": KIND_ASYNC, "staleness": 2}, memoryview(bytearray(8)), dest, 0)
    _answer(link, proto, _last_push(transport), [3, 4], [0, 1])
    pending = link.push({**FIELDS, "round": 2, "kind": KIND_ASYNC, "staleness": 2},
                        memoryview(np.array([5, 5], np.float32)).cast("B"), dest, 0)
    dest[:] = b"\xff" * 8  # the dying server was writing the next value into it: not a copy to restore
    link.on_broken(proto, "lost connection to server 0")
    assert not pending.done()  # held while we learn whether the server restarted

    proto, transport = _connected(link)
    link._settle_held(proto, restarted=True)
    link.pump()
    (replay, copy), (restored, _), (again, data) = transport.messages()
    assert isinstance(replay, Push) and replay.replay and replay.round == 1 and replay.applied == [0, 1]
    assert np.frombuffer(copy, np.float32).tolist() == [3, 4]
    assert restored == Restored(1)
    assert isinstance(again, Push) and not again.replay and again.round == 2
    assert np.frombuffer(data, np.float32).tolist() == [5, 5]
    link.close()


def _one_step_answered() -> tuple[ServerLink, _LinkProtocol, FakeTransport, memoryview]:
    """A link whose first asynchronous step was answered (value [7, 8], vector [1, 0]); its result buffer."""
    link, proto, transport = _link(0)
    dest = memoryview(bytearray(8))
    link.push({**FIELDS, "round": 1, "kind": KIND_ASYNC}, memoryview(bytearray(8)), dest, 0)
    _answer(link, proto, _last_push(transport), [7, 8], [1, 0])
    return link, proto, transport, dest


def _assert_a_restart_replays_the_copy(link: ServerLink, proto: _LinkProtocol) -> None:
    """The connection breaks and a restarted server takes it: the first step's copy is replayed, then Restored."""
    link.on_broken(proto, "lost connection to server 0")
    proto, transport = _connected(link)
    link._settle_held(proto, restarted=True)
    (replay, copy), (restored, _) = transport.messages()
    assert isinstance(replay, Push) and replay.applied == [1, 0] and np.frombuffer(copy, np.float32).tolist() == [7, 8]
    assert restored == Restored(0)
    link.close()


async def test_a_failed_delta_keeps_the_copy_before_it():
    link, proto, transport, dest = _one_step_answered()
    failed = link.push({**FIELDS, "round": 2, "kind": KIND_ASYNC}, memoryview(bytearray(8)), dest, 0)
    link.on_message(proto, Failure(_last_push(transport).req, "worker 1 is dead", code="connection",
                                   peer="worker 1"), None)
    assert failed.exception() is not None
    _assert_a_restart_replays_the_copy(link, proto)


async def test_a_delta_given_up_keeps_the_copy_before_it():
    """Another piece of the same local round failed, so the op gave this one up (``forget``): the window dropped
    the partition's kept copy with it, and a restarted server lost the deltas only that copy held."""
    link, proto, transport, dest = _one_step_answered()
    given_up = link.push({**FIELDS, "round": 2, "kind": KIND_ASYNC}, memoryview(bytearray(8)), dest, 0)
    assert link.forget(given_up) and given_up.cancelled()
    _assert_a_restart_replays_the_copy(link, proto)
