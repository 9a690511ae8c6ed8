"""The worker's link to a server, through a fake transport: what a push's caller gets when the server
fails it (the class its Failure's code names, with the server's facts) or when the connection is lost
(a LinkBrokenError that says whether the server may still write into our memory), and the frames the
link writes (protocol.frames' encoder and batch writer, byte for byte the old ones)."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import numpy as np
import pytest

from bps_runtime import segments as shm
from bps_server.rounds import RoundTable
from bps_worker.errors import (
    AnswerLostError,
    BPSConnectionError,
    BPSError,
    BPSMismatchError,
    BPSTimeoutError,
    LinkBrokenError,
    error_from_failure,
    failure_from_error,
)
from bps_worker.daemon import WorkerConfig, WorkerDaemon
from bps_worker.link import (REFUSED_IN_A_ROW, ServerLink, _LinkProtocol, connection_error, failure_error, write_batch,
                             write_message)
from protocol.config import ServerSpec, parse_config
from protocol.frames import FrameReader, encode_frame, encode_header
from protocol.messages import (Batch, Failure, FuseAbort, FuseReady, FuseResync, Push, Result, RoundInfo, RoundQuery,
                               Why, batch_header, parse, split_batch, to_header)
from fake_transport import FakeTransport, feed, reconnect_link


def _push(worker: int, n: int = 4, *, name: str = "w", req: int = 1) -> Push:
    return Push(req=req, name=name, part=0, round=0, worker=worker, dtype="float32", shape=[n], offset=0, count=n)


def _wire(failure: Failure) -> Failure:
    """``failure`` after a trip over the wire."""
    reader = FrameReader()
    (frame,) = reader.receive_data(encode_header(to_header(failure), 0))
    parsed = parse(frame.header)
    assert isinstance(parsed, Failure)
    return parsed


# -- a server's Failure -> the caller's error, by code ------------------------------------


def test_a_server_mismatch_becomes_a_mismatch_error_with_each_sides_facts():
    table: RoundTable[str] = RoundTable(2)
    table.push(_push(0, 8), np.zeros(8, np.float32), "w0", 0.0)
    (failed,) = table.push(_push(1, 9), np.zeros(9, np.float32), "w1", 0.0)
    errors = {f.handle: failure_error(3, _wire(f.why.failure(f.push.req))) for f in failed.fails}  # type: ignore[union-attr]
    for handle, ours, theirs in (("w0", "float32[8]", "float32[9]"), ("w1", "float32[9]", "float32[8]")):
        error = errors[handle]
        assert isinstance(error, BPSMismatchError), error
        assert (error.name, error.ours, error.theirs) == ("w", ours, theirs)
        assert "server 3" in str(error) and "worker 0 pushed float32[8] but worker 1 pushed float32[9]" in str(error)
        assert "mismatch" in str(error) and "'w'" in str(error)


@pytest.mark.parametrize("failure,cls,attributes", [
    (Failure(1, "worker 1 is disconnected; round 0 of 'w' cannot complete", code="connection", peer="worker 1",
             detail="worker 1 is disconnected; round 0 of 'w' cannot complete"),
     BPSConnectionError, {"peer": "worker 1"}),
    (Failure(1, "worker 2 is not connected (waited 30 s)", code="timeout", what="round 4 of 'w'", timeout_s=30.0,
             detail="worker 2 is not connected (waited 30 s)"),
     BPSTimeoutError, {"what": "round 4 of 'w'", "timeout_s": 30.0}),
    (Failure(1, "tensor 'w' round 0 aborted by worker 1: gone", code="round_failed"), BPSError, {}),
    (Failure(1, "something", code="error"), BPSError, {}),
    (Failure(1, "bad", code="bad_request"), BPSError, {}),
    (Failure(1, "broke it", code="protocol_error"), BPSConnectionError, {}),
    (Failure(1, "tensor 'w' mismatch: no facts", code="mismatch"), BPSMismatchError, {"name": ""}),
])
def test_each_failure_code_reaches_the_caller_as_its_class(failure, cls, attributes):
    error = failure_error(0, _wire(failure))
    assert type(error) is cls, error
    assert {k: getattr(error, k) for k in attributes} == attributes
    assert "server 0" in str(error)
    assert failure.detail in str(error) if failure.detail else f"server 0: {failure.message}" == str(error)


def test_the_text_is_never_read_for_the_class():
    error = failure_error(0, Failure(1, "tensor 'mismatch' round 3 aborted", code="round_failed"))
    assert type(error) is BPSError  # the word in the text does not make it a mismatch


def test_a_long_server_message_still_makes_an_error():
    error = failure_error(0, Failure(1, "x" * 4096, code="connection", peer="worker 1", detail="y" * 4096))
    assert isinstance(error, BPSConnectionError) and error.peer == "worker 1"


def test_errors_handed_on_to_training_processes_keep_class_and_attributes():
    mismatch = BPSMismatchError("server 0: worker 0 pushed a", name="w", ours="float32[8]", theirs="float32[9]")
    lost = LinkBrokenError("gone", peer="server 1 at h:1", unanswered_shm=True)
    late = BPSTimeoutError("slow", what="round 2 of 'w'", timeout_s=5.0)
    for error, cls in ((mismatch, BPSMismatchError), (lost, BPSConnectionError), (late, BPSTimeoutError),
                       (BPSError("plain"), BPSError), (BPSConnectionError("no peer"), BPSConnectionError)):
        again = error_from_failure(_wire(failure_from_error(5, error, " (a note)")))
        assert type(again) is cls and str(again) == f"{error} (a note)"
        for name in ("name", "ours", "theirs", "peer", "what", "timeout_s"):
            if hasattr(error, name):
                assert getattr(again, name) == getattr(error, name), name


# -- a lost connection -> LinkBrokenError ------------------------------------------------


def test_connection_error_says_whether_the_server_may_still_write_our_memory():
    by_reference = connection_error(BPSConnectionError("lost it", peer="server 2 at h:9"), True)
    assert isinstance(by_reference, LinkBrokenError) and isinstance(by_reference, BPSConnectionError)
    assert by_reference.unanswered_shm and by_reference.peer == "server 2 at h:9"
    assert str(by_reference) == "connection to server 2 at h:9 failed: lost it"
    plain = connection_error("lost connection to server 2", False)
    assert not plain.unanswered_shm and str(plain) == "lost connection to server 2"
    assert pickle.loads(pickle.dumps(by_reference)).unanswered_shm


def _link() -> tuple[ServerLink, _LinkProtocol, FakeTransport]:
    link = ServerLink(ServerSpec(0, "127.0.0.1", 9, None), 0, credit_bytes=1 << 20, timeout=5.0,
                      max_payload_bytes=1 << 20)
    proto = _LinkProtocol(link)
    transport = FakeTransport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.proven = True  # (as once its Welcome is verified)
    link._proto, link._ready = proto, True  # as after a handshake
    link.incarnation = "run-1"
    return link, proto, transport


async def test_the_link_fails_a_push_with_the_class_of_the_servers_failure():
    link, proto, transport = _link()
    future = link.push({"name": "w", "part": 0, "round": 0, "dtype": "float32", "shape": [2], "offset": 0,
                        "count": 2}, memoryview(np.ones(2, np.float32)).cast("B"), memoryview(bytearray(8)), 0)
    ((sent, _),) = transport.messages()
    assert isinstance(sent, Push)
    link.on_message(proto, Failure(sent.req, "tensor 'w' mismatch: ...", code="mismatch", name="w",
                                   ours="float32[2]", theirs="float32[3]", detail="worker 0 pushed float32[2]"),
                    None)
    error = future.exception()
    assert isinstance(error, BPSMismatchError) and (error.name, error.ours, error.theirs) == (
        "w", "float32[2]", "float32[3]")
    link.close()


async def test_a_push_by_reference_lost_with_its_connection_is_unanswered_shm():
    link, proto, transport = _link()
    link.window.by_reference = True
    fields = {"name": "w", "part": 0, "round": 0, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}
    by_ref = link.push(fields, memoryview(bytearray(8)), memoryview(bytearray(8)), 0,
                       shm_ref=("bps-0-a", 0), out_ref=("bps-0-a", 8))
    by_tcp = link.push({**fields, "name": "v"}, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    link.incarnation = None  # a first connection: what is in flight fails at once
    link.on_broken(proto, "lost connection to server 0")
    shm_error, tcp_error = by_ref.exception(), by_tcp.exception()
    assert isinstance(shm_error, LinkBrokenError) and shm_error.unanswered_shm
    assert isinstance(tcp_error, BPSConnectionError) and not getattr(tcp_error, "unanswered_shm", False)
    assert "lost connection to server 0" in str(shm_error)
    link.close()
    await asyncio.sleep(0)


async def test_a_push_by_reference_goes_as_made_and_plain_with_its_bytes_where_the_connection_shares_none():
    """A push to a server that maps our memory is made with its references (no copy of it per piece when it is
    written); one that comes to be written on a connection sharing no memory goes plain, with its payload."""
    link, proto, transport = _link()
    link.window.by_reference = True
    fields = {"name": "w", "part": 0, "round": 0, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}
    payload = memoryview(np.arange(2, dtype=np.float32)).cast("B")
    link.push(fields, payload, memoryview(bytearray(8)), 0, shm_ref=("bps-0-a", 16), out_ref=("bps-0-b", 8))
    (item,) = link.window.pieces()
    announce, (sent, sent_payload) = transport.messages()
    assert announce[0].segments == ["bps-0-a", "bps-0-b"]
    assert sent == item.push and sent_payload is None
    assert (sent.segment, sent.seg_offset, sent.out_segment, sent.out_offset) == ("bps-0-a", 16, "bps-0-b", 8)
    assert link._wire(item) == (item.push, None) and link._wire(item)[0] is item.push  # no copy to write it
    link.window.by_reference = False  # (a connection to a server that does not share our memory)
    plain, plain_payload = link._wire(item)
    assert (plain.segment, plain.seg_offset, plain.out_segment, plain.out_offset) == ("", 0, "", 0)
    assert (plain.req, plain.name, plain.count) == (sent.req, "w", 2) and plain_payload is payload
    link.close()
    await asyncio.sleep(0)


@pytest.mark.parametrize("incarnation", [None, "run-1"])
async def test_a_result_the_link_refuses_leaves_its_push_held_or_failed_never_lost(incarnation):
    """A Result no honest server sends (a sum "in shared memory" for a push that went over TCP) breaks the
    connection; its push must still be in flight then, so that the break holds it for the next server (or fails
    it, on a first connection), rather than be taken out of the window first and never answered."""
    link, proto, transport = _link()
    link.incarnation = incarnation
    future = link.push({"name": "w", "part": 0, "round": 0, "dtype": "float32", "shape": [2], "offset": 0,
                        "count": 2}, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    ((sent, _),) = transport.messages()
    feed(proto, b"".join(bytes(c) for c in encode_frame(Result(sent.req, "w", 0, 0, inplace=True))))
    assert link._proto is None  # the bad frame broke the connection
    if incarnation is None:
        assert isinstance(future.exception(), BPSConnectionError)
    else:
        assert not future.done() and [p.push.req for p in link.window.pieces()] == [sent.req]  # held
    link.close()
    assert future.done()
    await asyncio.sleep(0)


async def test_a_result_that_fails_in_our_hands_fails_its_push():
    """Whatever goes wrong after a piece was taken out of flight (here its caller's callback), its caller hears
    it: nothing else would ever answer it."""
    link, proto, transport = _link()

    def broken(message: Result) -> None:
        raise RuntimeError("a bug")

    future = link.push({"name": "w", "part": 0, "round": 0, "dtype": "float32", "shape": [2], "offset": 0,
                        "count": 2}, memoryview(bytearray(8)), memoryview(bytearray(8)), 0, on_result=broken)
    ((sent, _),) = transport.messages()
    with pytest.raises(RuntimeError):
        link.on_message(proto, Result(sent.req, "w", 0, 0), memoryview(np.ones(2, np.float32)).cast("B"))
    error = future.exception()
    assert isinstance(error, BPSError) and "could not be taken" in str(error) and "a bug" in str(error)
    link.close()
    await asyncio.sleep(0)


async def test_a_kept_sum_in_a_freed_results_segment_is_copied_out_and_replayed_from_the_copy():
    """The results arena frees an idle name's segment for room (its cap): the name's kept sum must not keep that
    memory mapped (the cap would free nothing), and a restarted server gets it from our copy, over TCP, not as a
    reference to a segment that is gone."""
    n = 1 << 20
    arena = shm.Arena(0, cap_bytes=2 * n)
    link, proto, transport = _link()
    link.window.by_reference = True  # the colocated server maps our segments
    slots = {}
    try:
        for value, name in ((3.0, "a"), (5.0, "b")):
            slot, _ = arena.alloc(name, n)
            slots[name] = slot
            dest = arena.view(slot)[:n]
            np.frombuffer(dest, np.float32)[:] = value  # the server's sum, written in place
            fields = {"name": name, "part": 0, "round": 7, "dtype": "float32", "shape": [n // 4], "offset": 0,
                      "count": n // 4}
            future = link.push(fields, memoryview(bytearray(n)), dest, 0, shm_ref=("bps-other", 0),
                               out_ref=(slot.segment, 0))
            (sent,) = [m for m, _ in transport.messages() if isinstance(m, Push) and m.name == name]
            link.on_message(proto, Result(sent.req, name, 0, 7, inplace=True), None)
            assert future.done() and future.exception() is None
        _, freed = arena.alloc("c", n)  # "a" is idle and least recently used: its segment goes
        assert freed == [slots["a"].segment]
        link.release_segments(freed)
        with open("/proc/self/maps") as maps:
            assert slots["a"].segment not in maps.read()
        link.on_broken(proto, "lost connection to server 0")  # a restart: the kept sums are replayed
        link._connecting.cancel()
        proto2 = _LinkProtocol(link)
        transport2 = FakeTransport()
        proto2.connection_made(transport2)  # type: ignore[arg-type]
        proto2.proven = True  # (as once its Welcome is verified)
        link._proto, link._ready, link.window.by_reference = proto2, True, True
        link._settle_held(proto2, restarted=True)
        replays = {m.name: (m, p) for m, p in transport2.messages() if isinstance(m, Push) and m.replay}
        a, a_payload = replays["a"]
        assert a.round == 7 and not a.segment and np.all(np.frombuffer(a_payload, np.float32) == 3.0)
        assert replays["b"][0].segment == slots["b"].segment  # still ours: by reference, as before
    finally:
        link.close()
        arena.release_all()
        await asyncio.sleep(0)


async def test_a_reset_drops_what_the_old_processes_queued_of_fused_sums():
    """Every local process left while the link was down: their fused reports, aborts and resync must not go
    after the hello that carries the new processes' epoch (the anchor matches their reports by order then, and
    took the old processes' report for the new ones': a step off, then wrong sums). What is not of fused sums
    (an ordinary abort) still goes, and so does what the new processes tell after the Reset."""
    link, proto, transport = _link()
    link.on_broken(proto, "lost connection to server 0")  # incarnation known: the link reconnects
    link._connecting.cancel()
    link.first_on_reconnect(FuseResync("run-1", ["x"], [3], 4, "e1"))
    link.fuse(FuseReady(["x"], [["float32", [4], False, ""]], [0], [3], [3]))
    link.fuse(FuseAbort(["x"], "rank 0 left", reported=True, rounds=[3]))
    link.abort("big", 0, 7, Why("rank 0 left"))
    link.reset()
    new = FuseReady(["x"], [["float32", [4], False, ""]], [0], [0], [])
    link.fuse(new)
    assert [type(m).__name__ for m in link.control.take()] == ["Abort", "Reset", "FuseReady"]
    link.close()
    await asyncio.sleep(0)


async def test_a_link_says_its_numbering_is_fresh_until_a_round_of_it_goes_to_or_comes_from_its_server():
    """Hello.fresh, per server: a push, an abort or a fused report numbered a round against this server, and so
    did a round query's answer (not the query alone: its answer may come from a later run); a fate query did
    not. The daemon asks every stream of a server, and a new epoch makes them fresh again."""
    fields = {"name": "w", "part": 0, "round": 0, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}
    for act in ("push", "abort", "fuse", "query", "fate", "old-query"):
        link, proto, transport = _link()
        assert link.numbering_fresh()
        if act == "push":
            link.push(fields, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
        elif act == "abort":
            link.abort("w", 0, 3, Why("rank 0 left"))
        elif act == "fuse":
            link.fuse(FuseReady(["x"], [["float32", [4], False, ""]], [0], [0], []))
        else:
            answer = link.query_round("w", 0, 0, fate=3 if act == "fate" else -1)
            assert link.numbering_fresh()  # asked, not answered
            ((query, _),) = transport.messages()
            if act == "old-query":  # a new epoch's before its answer (a failed step's query: a reset leaves it)
                link.epoch = "new"
            link.on_message(proto, RoundInfo(query.req, 5), None)
            await asyncio.sleep(0)  # (the future's callbacks)
            assert answer.result() == 5
        assert link.numbering_fresh() is (act in ("fate", "old-query")), act
        link.close()
    # Queued while the server is down, a push reached nothing of it yet: its run is still new to us (a review's
    # case: both servers restarted, a tensor's pieces for the later one queued meanwhile).
    link, proto, _ = _link()
    link.on_broken(proto, "lost connection to server 0")
    link._connecting.cancel()
    link.push(fields, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    link.abort("w", 0, 3, Why("rank 0 left"))
    assert link.numbering_fresh()
    reconnect_link(link, proto, restarted=True)
    link.pump()
    assert not link.numbering_fresh()
    link.close()
    servers = [{"id": i, "address": f"127.0.0.1:{9400 + i}", "worker": i} for i in range(2)]
    workers = [{"id": i, "local_size": 1, "socket": f"/tmp/w{i}.sock"} for i in range(2)]
    daemon = WorkerDaemon(WorkerConfig(parse_config({"cluster": {"workers": 2}, "server": servers,
                                                     "worker": workers}), 0))
    daemon.streams[1][-1].numbered = True
    assert daemon.numbering_fresh(0) and not daemon.numbering_fresh(1)
    assert daemon.links[0].numbering_fresh() and not daemon.links[1].numbering_fresh()
    daemon._new_epoch()
    assert daemon.numbering_fresh(1)
    await asyncio.sleep(0)


async def test_a_round_query_lost_with_its_connection_goes_again_on_the_next():
    """A server restart rides out a round query as it does a push: the query in flight when the connection
    broke is asked again once the link reconnects, and answered then; only a link that gives up fails it."""
    link, proto, transport = _link()
    answer = link.query_round("w")
    ((sent, _),) = transport.messages()
    assert isinstance(sent, RoundQuery)
    link.on_broken(proto, "lost connection to server 0")  # incarnation known: the link reconnects
    await asyncio.sleep(0)
    assert not answer.done()
    assert link.control.take() == [sent]  # what the next ready connection sends first
    link.on_message(proto, RoundInfo(sent.req, 3), None)
    assert answer.result() == 3
    given_up = link.query_round("v")
    link.close()
    assert isinstance(given_up.exception(), BPSConnectionError)
    await asyncio.sleep(0)


def _paced_link() -> tuple[ServerLink, _LinkProtocol, FakeTransport]:
    """A link connected through a fake transport, ready, with a window of one piece."""
    link = ServerLink(ServerSpec(0, "127.0.0.1", 9, None), 0, credit_bytes=1 << 30, timeout=5.0,
                      max_payload_bytes=1 << 30, window_pieces=1)
    proto = _LinkProtocol(link)
    transport = FakeTransport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.proven = True  # (as once its Welcome is verified)
    link._proto, link._ready, link.incarnation = proto, True, "run-1"
    return link, proto, transport


async def test_a_paced_stream_keeps_one_stall_wake_up_and_a_stall_still_opens_the_window():
    """The window holds pieces while one is unanswered (window_pieces=1): each answer lets the next go and
    sets a new stall deadline, and the one wake-up armed for the first deadline is kept (not cancelled and
    made anew per piece). With no answer for stall_s, the held piece goes; close() cancels the wake-up."""
    link, proto, transport = _paced_link()
    link.window.stall_s = 0.2
    size = 256 << 10  # paced (over PACED_MIN_BYTES), not batched
    futures = [link.push({"name": f"t{i}", "part": 0, "round": 0, "dtype": "float32", "shape": [size // 4],
                          "offset": 0, "count": size // 4}, memoryview(bytearray(size)), memoryview(bytearray(size)),
                         0) for i in range(4)]
    sent = [m.req for m, _ in transport.messages() if isinstance(m, Push)]
    assert len(sent) == 1 and link._stall is not None
    wake_up = link._stall
    for i in range(2):  # two answers: a piece goes after each, and the wake-up stays the same
        link.on_message(proto, Result(sent[-1], f"t{i}", 0, 0), memoryview(bytearray(size)))
        sent = [m.req for m, _ in transport.messages() if isinstance(m, Push)]
        assert len(sent) == i + 2 and link._stall is wake_up
    assert all(f.done() for f in futures[:2]) and not futures[2].done()
    loop = asyncio.get_running_loop()
    waited_from = loop.time()
    while len([m for m, _ in transport.messages() if isinstance(m, Push)]) < 4 and loop.time() < waited_from + 10:
        await asyncio.sleep(0.02)  # no answer: the last piece goes once the stall deadline passes
    assert len([m for m, _ in transport.messages() if isinstance(m, Push)]) == 4
    assert loop.time() - waited_from >= 0.15  # not before the deadline (0.2 s after the last answer)
    link.close()
    assert link._stall is None
    await asyncio.sleep(0)


async def test_a_stall_deadline_that_moves_earlier_moves_the_wake_up():
    """The stall follows the answer time: after slow answers it is long, and a fast answer shortens it, so the
    next held piece's deadline can fall before the wake-up armed for the last one. The wake-up moves to it (it
    was left later: the window opened up to an eighth of the stall late)."""
    link, proto, transport = _paced_link()
    link.window._answer_s = 0.5  # as learned from slow answers: the stall is at its cap
    size = 256 << 10
    for i in range(3):
        link.push({"name": f"t{i}", "part": 0, "round": 0, "dtype": "float32", "shape": [size // 4], "offset": 0,
                   "count": size // 4}, memoryview(bytearray(size)), memoryview(bytearray(size)), 0)
    (first,) = [m.req for m, _ in transport.messages() if isinstance(m, Push)]
    armed = link._stall.when()
    link.on_message(proto, Result(first, "t0", 0, 0), memoryview(bytearray(size)))  # a fast answer
    assert len([m for m, _ in transport.messages() if isinstance(m, Push)]) == 2  # the next went, the last waits
    deadline = link.window.stall_deadline
    assert deadline < armed and link._stall.when() == deadline
    link.close()
    await asyncio.sleep(0)


async def test_a_link_times_its_answers_for_the_stall():
    """The link passes its loop's time with every answer (bps_worker.window: the stall follows the answer
    time): a paced piece answered 0.1 s after it went, the link's first, moves the smoothed answer time an eighth
    of the way there, so a held piece waits 4 x 0.1 / 8 s, not stall_s (0.01 s here)."""
    link, proto, transport = _paced_link()
    link.window.stall_s = 0.01
    size = 256 << 10
    for i in range(2):
        link.push({"name": f"t{i}", "part": 0, "round": 0, "dtype": "float32", "shape": [size // 4], "offset": 0,
                   "count": size // 4}, memoryview(bytearray(size)), memoryview(bytearray(size)), 0)
    (sent,) = [m.req for m, _ in transport.messages() if isinstance(m, Push)]  # the window holds the second
    await asyncio.sleep(0.1)
    link.on_message(proto, Result(sent, "t0", 0, 0), memoryview(bytearray(size)))
    assert 4 * 0.09 / 8 <= link.window.stall_after < 2.0  # a timer may fire a hair early
    link.close()
    await asyncio.sleep(0)


@pytest.mark.parametrize("k,window", [(0, 3), (1, 2), (2, 1)])
def test_a_worker_gives_every_connection_the_largest_flow_s_window_over_its_streams(k, window):
    """A worker daemon's links (4 machines, k CPU-only servers, each on a host of its own): one window for
    every connection, cluster.window_pieces (3) spread over the streams of the server with the most, so a
    CPU-only server's three connections keep three pieces in flight, not nine (bps_worker.placement)."""
    servers = [{"id": i, "address": f"10.0.0.{i}:9000"} | ({"worker": i} if i < 4 else {}) for i in range(4 + k)]
    workers = [{"id": i, "local_size": 1, "socket": f"/tmp/w{i}.sock"} for i in range(4)]
    cluster = parse_config({"cluster": {"workers": 4}, "server": servers, "worker": workers})
    daemon = WorkerDaemon(WorkerConfig(cluster, 0))
    windows = {sid: [link.window.window_pieces for link in links] for sid, links in daemon.streams.items()}
    cpu_streams = {0: 1, 1: 2, 2: 3}[k]
    assert windows == {sid: [window] * (1 if sid < 4 else cpu_streams) for sid in range(4 + k)}
    unpaced = WorkerDaemon(WorkerConfig(parse_config({"cluster": {"workers": 4, "window_pieces": 0},
                                                      "server": servers, "worker": workers}), 0))
    assert all(link.window.window_pieces == 0 for link in unpaced.all_links)


# -- the frames the link writes ----------------------------------------------------------


def test_write_message_and_write_batch_write_the_old_bytes():
    payload = memoryview(np.arange(4, dtype=np.float32)).cast("B")
    one = FakeTransport()
    write_message(one, _push(0), payload, 1 << 20)  # type: ignore[arg-type]
    assert bytes(one.data) == encode_header(to_header(_push(0)), 16) + bytes(payload)
    empty = FakeTransport()
    write_message(empty, _push(0, 0), None, 1 << 20)  # type: ignore[arg-type]
    assert bytes(empty.data) == encode_header(to_header(_push(0, 0)), 0)
    wires = [(_push(0, req=1), payload), (_push(0, name="ref", req=2), None), (_push(0, name="x", req=3), payload)]
    batch = FakeTransport()
    write_batch(batch, wires, 1 << 20)  # type: ignore[arg-type]
    sizes = [(p, 0 if b is None else b.nbytes) for p, b in wires]
    assert bytes(batch.data) == encode_header(batch_header(sizes), 32) + bytes(payload) + bytes(payload)
    closing = FakeTransport()
    closing.closed = True
    write_message(closing, _push(0), payload, 1 << 20)  # type: ignore[arg-type]
    write_batch(closing, wires, 1 << 20)  # type: ignore[arg-type]
    assert closing.data == bytearray()


def _unconnected_link(open_attempt: Any) -> ServerLink:
    """A link with a short timeout whose connection attempts are ``open_attempt(deadline)``."""
    link = ServerLink(ServerSpec(0, "127.0.0.1", 9, None), 0, credit_bytes=1 << 20, timeout=0.6,
                      max_payload_bytes=1 << 20)
    link._open = open_attempt  # type: ignore[method-assign]
    return link


def _push_two(link: ServerLink) -> asyncio.Future[None]:
    return link.push({"name": "w", "part": 0, "round": 0, "dtype": "float32", "shape": [2], "offset": 0,
                      "count": 2}, memoryview(np.ones(2, np.float32)).cast("B"), memoryview(bytearray(8)), 0)


@pytest.mark.timeout(30)
async def test_a_connection_attempt_that_raises_a_bug_of_ours_is_retried_and_fails_within_the_timeout(caplog):
    """An exception other than a connection's (a bug in the handshake's or the replay's code) ended the task
    that reconnects a link, silently: what it held waited for ever (a hang, once, in CI, of a stream's link
    that never came back after a server restart). Now it is logged, and the attempt fails as any other."""
    attempts: list[float] = []

    async def buggy_open(deadline: float) -> None:
        attempts.append(deadline)
        raise KeyError("a bug")

    link = _unconnected_link(buggy_open)
    future = _push_two(link)
    with pytest.raises(BPSConnectionError, match=r"connection to server 0 at .* failed: cannot reach it .* internal error: KeyError\('a bug'\)"):
        await asyncio.wait_for(future, 10)
    assert len(attempts) > 1 and "connection attempt failed" in caplog.text
    link.close()


@pytest.mark.timeout(30)
async def test_a_link_that_holds_work_with_no_attempt_under_way_connects_again():
    """The daemon's every-second check: whatever left a link disconnected with pieces and no connecting task,
    they are sent or fail within the timeout."""
    opened: list[float] = []

    async def refused(deadline: float) -> None:
        opened.append(deadline)
        raise ConnectionRefusedError("refused")

    link = _unconnected_link(refused)
    link._ensure_connecting = lambda *args: None  # type: ignore[method-assign]  # (as if no task had started)
    future = _push_two(link)
    await asyncio.sleep(0.05)
    assert opened == [] and not future.done()
    del link._ensure_connecting  # the class's own again
    link.keep_trying()
    with pytest.raises(BPSConnectionError, match="connection to server 0 at .* failed: cannot reach it"):
        await asyncio.wait_for(future, 10)
    assert opened
    link.keep_trying()  # nothing held any more: no attempt
    await asyncio.sleep(0.05)
    assert link._connecting is None or link._connecting.done()
    link.close()


async def test_a_link_of_a_stopping_daemon_does_not_reconnect_and_its_attempt_ends_with_it():
    """The daemon stops (``stopping``) and a server goes (as when a box's units stop at once): what waited
    fails at once, no reconnection starts. A link closed while it reconnects: ``wait_closed`` returns once its
    attempt has ended (before, the daemon's loop closed on it still pending: "Task was destroyed but it is
    pending!")."""
    link, proto, transport = _link()
    future = link.push({"name": "w", "part": 0, "round": 0, "dtype": "float32", "shape": [2], "offset": 0,
                        "count": 2}, memoryview(np.ones(2, np.float32)).cast("B"), memoryview(bytearray(8)), 0)
    link.stopping = True
    proto.connection_lost(None)
    assert isinstance(future.exception(), BPSConnectionError) and link._connecting is None
    link.close()
    await link.wait_closed()

    other, proto, _ = _link()
    proto.connection_lost(None)  # not stopping: it reconnects (to a port where nothing listens)
    attempt = other._connecting
    assert attempt is not None and not attempt.done()
    await asyncio.sleep(0.05)
    other.close()
    await other.wait_closed()
    assert attempt.done()


async def test_the_same_run_again_gets_the_held_pushes_again_marked_resumed_and_answers_each_from_its_round():
    """A connection that broke while pushes were out, the same server run answering the reconnect: the held
    synchronous pushes go again marked ``resumed`` (the server answers each from its round: the sum, its
    failure, or "answer lost" where the peers got the sum), a held asynchronous one fails (its delta may be in
    the value already)."""
    link, proto, transport = _link()
    fields = {"part": 0, "round": 3, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}
    futures = {name: link.push({**fields, "name": name}, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
               for name in ("summed", "lost", "failed")}
    delta = link.push({**fields, "round": 0, "name": "v", "kind": "async"}, memoryview(bytearray(8)),
                      memoryview(bytearray(8)), 0)
    assert {m.name for m, _ in transport.messages() if isinstance(m, Push)} == {"summed", "lost", "failed", "v"}
    transport2 = reconnect_link(link, proto, restarted=False)  # (the Welcome said the same incarnation)
    proto2 = link._proto
    link.pump()
    assert isinstance(delta.exception(), LinkBrokenError)
    sent = [item for m, p in transport2.messages() for item in (split_batch(m, p) if isinstance(m, Batch) else [(m, p)])]
    again = {m.name: m for m, _ in sent if isinstance(m, Push)}
    assert set(again) == {"summed", "lost", "failed"}
    assert all(m.resumed and m.round == 3 and not m.replay for m in again.values())
    link.on_message(proto2, Result(again["summed"].req, "summed", 0, 3), memoryview(np.ones(2, np.float32)).cast("B"))
    link.on_message(proto2, Failure(again["lost"].req, "tensor 'lost' part 0: round 3 was summed for the other "
                                    "workers, but worker 0's answer was lost with its connection", code="answer_lost"),
                    None)
    link.on_message(proto2, Failure(again["failed"].req, "worker 0 is disconnected; round 3 of 'failed' cannot "
                                    "complete", code="connection", peer="worker 0"), None)
    assert futures["summed"].exception() is None
    lost = futures["lost"].exception()
    assert isinstance(lost, AnswerLostError) and not lost.unanswered_shm and "answer was lost" in str(lost)
    assert ("lost", 0) not in link.given_up  # (summed: nothing for a restarted server to hear)
    failed = futures["failed"].exception()
    assert type(failed) is BPSConnectionError and ("failed", 0) in link.given_up
    link.close()
    await asyncio.sleep(0)


def _refused_then_reconnected(link: ServerLink, proto: _LinkProtocol) -> tuple[_LinkProtocol, FakeTransport]:
    """The server closes ``proto`` for a protocol error of ours (a Failure with req -1); the same run takes the
    reconnect, and what the link held goes again on the new connection (and its transport)."""
    link.on_message(proto, Failure(-1, "push of 'bad' part 0: refused", code="protocol_error"), None)
    transport = reconnect_link(link, proto, restarted=False)  # (its connection is already broken)
    link.pump()
    assert link._proto is not None
    return link._proto, transport


async def test_a_push_the_server_refuses_on_every_connection_fails_instead_of_going_again_for_ever():
    """The server closes the connection for a protocol error of ours: retried, as any broken connection (the
    push goes again, resumed). But the same push refused again on the next connections, with nothing answered
    between, fails with the server's reason: it went again for ever before (no error in 240 s, a review's case:
    pieces larger than the server's frames)."""
    link, proto, transport = _link()
    fields = {"part": 0, "round": 3, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}
    future = link.push({**fields, "name": "bad"}, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    for _ in range(REFUSED_IN_A_ROW - 1):
        proto, transport = _refused_then_reconnected(link, proto)
        ((again, _),) = transport.messages()
        assert isinstance(again, Push) and again.name == "bad" and again.resumed and not future.done()
    link.on_message(proto, Failure(-1, "push of 'bad' part 0: refused", code="protocol_error"), None)
    error = future.exception()
    assert isinstance(error, BPSConnectionError) and "server 0 refused the connection: push of 'bad' part 0: " \
        "refused (3 connections in a row refused, nothing answered between: what they carried fails)" in str(error)
    link.close()
    await asyncio.sleep(0)


async def test_refusals_fail_what_the_connections_carried_and_only_the_servers_answers_count():
    """What the refused connections never carried (queued behind a full write buffer) goes on the next one, not
    failed with them; and a push given up here (``forget``: another operation's piece failed) is no answer from
    the server: the refused push still fails at the third refusal (a review's cases)."""
    link, proto, transport = _link()
    fields = {"part": 0, "round": 3, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}
    bad = link.push({**fields, "name": "bad"}, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    for step in range(REFUSED_IN_A_ROW - 1):
        other = link.push({**fields, "name": f"other{step}"}, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
        proto, transport = _refused_then_reconnected(link, proto)
        link.forget(other)
    link.window.pause_writing()  # nothing more goes on this connection
    queued = link.push({**fields, "name": "queued"}, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    link.on_message(proto, Failure(-1, "push of 'bad' part 0: refused", code="protocol_error"), None)
    assert isinstance(bad.exception(), BPSConnectionError) and not queued.done()
    link.close()
    await asyncio.sleep(0)


async def test_a_refusal_after_answers_is_a_broken_connection_again():
    """Refusals with answers between them are connections that broke and worked again: what is held is held,
    however many there are in all."""
    link, proto, transport = _link()
    fields = {"part": 0, "round": 3, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}
    held = link.push({**fields, "name": "held"}, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    for step in range(2 * REFUSED_IN_A_ROW):
        proto, transport = _refused_then_reconnected(link, proto)
        other = link.push({**fields, "name": f"ok{step}"}, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
        sent = {m.name: m for m, _ in transport.messages() if isinstance(m, Push)}
        link.on_message(proto, Result(sent[f"ok{step}"].req, f"ok{step}", 0, 3),
                        memoryview(np.ones(2, np.float32)).cast("B"))
        assert other.done() and other.exception() is None and not held.done(), step
    link.close()
    await asyncio.sleep(0)


async def test_a_sum_a_resumed_push_got_is_replayed_plain_to_a_restarted_server():
    """The resumed mark is the push's only until its answer: a sum it got is kept for a restarted server, and
    replayed then as a replay alone (a push both resumed and replayed is refused: the frame broke the connection,
    and every replay, given-up round and Restored after it was lost). Found by a review."""
    link, proto, _ = _link()
    fields = {"name": "w", "part": 0, "round": 3, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}
    future = link.push(fields, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    again_transport = reconnect_link(link, proto, restarted=False)
    link.pump()
    ((again, _),) = again_transport.messages()
    assert isinstance(again, Push) and again.resumed
    link.on_message(link._proto, Result(again.req, "w", 0, 3), memoryview(np.ones(2, np.float32)).cast("B"))
    assert future.done() and future.exception() is None
    restarted = reconnect_link(link, link._proto, restarted=True)
    sent = [parse(f.header) for f in FrameReader().receive_data(bytes(restarted.data))]  # (each one checked)
    (replay,) = [m for m in sent if isinstance(m, Push)]
    assert replay.replay and not replay.resumed and replay.round == 3
    link.close()
    await asyncio.sleep(0)


async def test_a_link_that_gives_up_says_which_pushes_had_gone_out_to_a_run_it_knows():
    """The fate of a synchronous push that had reached the connection is unknown once the link gives up (that
    server run may have summed its round for the peers: RoundQuery.fate asks); a push never sent, or an
    asynchronous one, failed plainly."""
    link, proto, transport = _link()
    fields = {"part": 0, "round": 3, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}
    out = link.push({**fields, "name": "out"}, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    delta = link.push({**fields, "round": 0, "name": "v", "kind": "async"}, memoryview(bytearray(8)),
                      memoryview(bytearray(8)), 0)
    link.on_broken(proto, "lost connection to server 0")
    link._connecting.cancel()
    queued = link.push({**fields, "name": "queued"}, memoryview(bytearray(8)), memoryview(bytearray(8)), 0)
    link._fail_all(BPSConnectionError("not within 5 s", peer="server 0 at 127.0.0.1:9"))
    error = out.exception()
    assert isinstance(error, LinkBrokenError) and error.fate_unknown and error.peer == "server 0 at 127.0.0.1:9"
    for plain in (delta.exception(), queued.exception()):
        assert isinstance(plain, BPSConnectionError) and not getattr(plain, "fate_unknown", False)
    link.close()
    await asyncio.sleep(0)


class _FillingTransport(FakeTransport):
    """Nothing drains: what was written stays in the write buffer (a slow network)."""

    def get_write_buffer_size(self) -> int:
        return len(self.data)


async def test_a_resumed_push_still_queued_when_the_link_gives_up_has_an_unknown_fate():
    """Our lane push reached the server on connection A. A breaks; the same run answers B, and the held pushes go
    again marked resumed, but a large one ahead of it fills the write buffer (the credit), so the lane push waits
    in the queue. B breaks and the link gives up: the lane push had reached that run (on A), so its fate is
    unknown too, not a plain failure (its operation would take its unfused numbers at once: the drift). Found by
    a review."""
    link = ServerLink(ServerSpec(0, "127.0.0.1", 9, None), 0, credit_bytes=64 << 10, timeout=5.0,
                      max_payload_bytes=1 << 20)
    link._ensure_connecting = lambda *a, **k: None  # type: ignore[method-assign]  # (connections made by hand)
    proto = _LinkProtocol(link)
    transport = FakeTransport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.proven = True  # (as once its Welcome is verified)
    link._proto, link._ready, link.incarnation = proto, True, "run-1"
    fields = {"part": 0, "dtype": "float32", "offset": 0}
    big = link.push({**fields, "name": "big", "round": 0, "shape": [64 << 10], "count": 64 << 10},
                    memoryview(bytearray(256 << 10)), memoryview(bytearray(256 << 10)), 5)
    lane = link.push({**fields, "name": "lane", "round": 3, "shape": [2], "count": 2}, memoryview(bytearray(8)),
                     memoryview(bytearray(8)), 0)
    link.on_broken(proto, "lost connection to server 0")
    proto_b = _LinkProtocol(link)
    b = _FillingTransport()
    proto_b.connection_made(b)  # type: ignore[arg-type]
    proto_b.proven = True  # (as once its Welcome is verified)
    link._proto, link._ready = proto_b, True
    link._settle_held(proto_b, restarted=False)
    link.pump()
    assert [m.name for m, _ in b.messages() if isinstance(m, Push)] == ["big"]  # the lane push waits for credit
    link.on_broken(proto_b, "lost connection to server 0")
    link._fail_all(BPSConnectionError("not within 5 s", peer="server 0 at 127.0.0.1:9"))
    for future in (big, lane):
        error = future.exception()
        assert isinstance(error, LinkBrokenError) and error.fate_unknown, error
    link.close()
    await asyncio.sleep(0)


async def test_a_push_its_caller_gave_up_is_not_resumed_but_fails_when_the_same_run_answers():
    """A push by shared-memory reference that its operation gave up (another piece failed: the operation aborts
    this one's round and waits for the server to be done with our memory, ServerLink.forget) is held when the
    connection breaks. The same run answering the reconnect must not get it again as a contribution: the abort
    may have died with the connection, and the push would open the round anew, waiting for peers that gave it
    up (fault_soak seed 738 hung so); it fails, as before resumed pushes."""
    link, proto, transport = _link()
    link.window.by_reference = True
    fields = {"name": "w", "part": 2, "round": 0, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}
    future = link.push(fields, memoryview(bytearray(8)), memoryview(bytearray(8)), 0,
                       shm_ref=("bps-0-a", 0), out_ref=("bps-0-a", 8))
    kept = link.push({**fields, "name": "v"}, memoryview(bytearray(8)), memoryview(bytearray(8)), 0,
                     shm_ref=("bps-0-a", 16), out_ref=("bps-0-a", 24))
    assert link.forget(future) is False  # (in the server's hands: its answer is waited for)
    again = reconnect_link(link, proto, restarted=False)
    link.pump()
    error = future.exception()
    assert isinstance(error, LinkBrokenError) and error.unanswered_shm
    pushed = [m for m, _ in again.messages() if isinstance(m, Push)]
    assert [(m.name, m.resumed) for m in pushed] == [("v", True)] and not kept.done()
    link.close()
    await asyncio.sleep(0)


@pytest.mark.parametrize("restarted", [False, True], ids=["same-run", "restarted"])
async def test_a_push_in_flight_when_the_job_ended_is_never_sent_again(restarted):
    """Every process left (a reset) while a push was in flight, then the connection broke: the push fails with the
    job's end, and is not sent again on the next connection (a restarted server, or the same run). Sent again, behind
    the Reset, it opened the ended job's round there: the next job's first sum of it was stale (a review's case)."""
    link, proto, transport = _link()
    fields = {"name": "w", "part": 0, "round": 3, "dtype": "float32", "shape": [2], "offset": 0, "count": 2}
    old = link.push(fields, memoryview(np.ones(2, np.float32)).cast("B"), memoryview(bytearray(8)), 0)
    link.epoch = "e2"  # (the daemon's new numbering, then its links' reset)
    link.reset()
    assert [type(m).__name__ for m, _ in transport.messages()] == ["Push", "Reset"]
    again = reconnect_link(link, proto, restarted=restarted)
    assert isinstance(old.exception(), BPSError) and "its job ended here" in str(old.exception())
    new = link.push(fields | {"round": 0}, memoryview(np.ones(2, np.float32)).cast("B"), memoryview(bytearray(8)), 0)
    link.pump()
    assert [m.round for m, _ in again.messages() if isinstance(m, Push)] == [0]  # (a restarted run: Restored too)
    assert not new.done()
    link.close()
    await asyncio.sleep(0)


async def test_a_handshake_that_spans_a_reset_carries_one_reset():
    """Every process left during the first connection's handshake (its Hello said the old numbering): the Reset
    that waited for the connection goes once, first (the ready path had sent it twice)."""
    link, proto, transport = _link()
    link.epoch = link._hello_epoch = "e1"
    link._ready = False  # (our Hello went; the Welcome is on its way)
    link.epoch = "e2"
    link.reset()  # (queued: the connection is not ready)
    link._ready = True  # the Welcome: as ServerLink._open goes on from there
    waited = link.control.take()
    link._told_on_ready(waited)
    for message in waited:
        link._send(proto, message)
    assert [(type(m).__name__, m.epoch) for m, _ in transport.messages()] == [("Reset", "e2")]
    link.close()
    await asyncio.sleep(0)
