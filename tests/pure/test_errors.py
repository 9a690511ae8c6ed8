"""protocol.errors and bps_worker.errors: who is at fault, the facts as attributes, messages built from them,
and every Failure code mapped to its typed error."""

from __future__ import annotations

import pickle
from typing import get_args

import pytest

from bps_worker.errors import (BPSConnectionError, BPSError, BPSMismatchError, BPSTimeoutError, error_from_failure,
                               reworded, why_from_error)
from protocol import messages as m
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.frames import FrameReader, encode_header

# -- protocol errors ---------------------------------------------------------------------


@pytest.mark.parametrize("cls", [LocalProtocolError, RemoteProtocolError])
def test_except_protocol_error_catches_both_kinds(cls):
    with pytest.raises(ProtocolError):
        raise cls("x")
    assert issubclass(cls, ProtocolError) and issubclass(cls, Exception)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)
    assert not issubclass(RemoteProtocolError, LocalProtocolError)


def test_the_base_is_still_instantiable_for_callers_outside_protocol():
    exc = ProtocolError("unexpected push message from worker 1")
    assert str(exc) == "unexpected push message from worker 1"
    assert (exc.what, exc.size, exc.limit, exc.unit) == ("", None, None, "bytes")


def test_a_limit_error_builds_its_message_from_its_attributes():
    exc = RemoteProtocolError(what="frame header", size=70000, limit=65536)
    assert (exc.what, exc.size, exc.limit, exc.unit) == ("frame header", 70000, 65536, "bytes")
    assert str(exc) == "frame header of 70000 bytes exceeds the limit of 65536 bytes"
    chars = LocalProtocolError(what="abort message", size=5000, limit=4096, unit="characters")
    assert str(chars) == "abort message of 5000 characters exceeds the limit of 4096 characters"
    # An explicit message wins; the attributes stay.
    told = LocalProtocolError("batch of 0 items; 1 to 1024 allowed", what="batch", size=0, limit=1024, unit="items")
    assert str(told) == "batch of 0 items; 1 to 1024 allowed" and told.size == 0 and told.limit == 1024


def test_from_error_blames_the_peer_and_keeps_the_facts():
    local = LocalProtocolError(what="tensor name", size=2000, limit=1024, unit="characters")
    remote = RemoteProtocolError.from_error(local)
    assert type(remote) is RemoteProtocolError
    assert str(remote) == str(local) == "tensor name of 2000 characters exceeds the limit of 1024 characters"
    assert (remote.what, remote.size, remote.limit, remote.unit) == ("tensor name", 2000, 1024, "characters")
    assert RemoteProtocolError.from_error(remote) is remote
    assert type(RemoteProtocolError.from_error(ProtocolError("bad"))) is RemoteProtocolError


@pytest.mark.parametrize("exc", [
    LocalProtocolError(what="frame payload", size=101, limit=100),
    RemoteProtocolError("unknown message type 'x'"),
    ProtocolError("plain"),
])
def test_protocol_errors_survive_pickling(exc):
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    assert (back.what, back.size, back.limit, back.unit) == (exc.what, exc.size, exc.limit, exc.unit)


def test_the_frame_reader_blames_the_peer_with_size_and_limit():
    reader = FrameReader(max_header_bytes=1000)
    with pytest.raises(RemoteProtocolError) as info:
        reader.receive_data(b"\x00\x00\x03\xe9" + bytes(8))
    assert (info.value.what, info.value.size, info.value.limit) == ("frame header", 1001, 1000)
    with pytest.raises(LocalProtocolError, match="unusable"):  # using it afterwards is our mistake
        reader.receive_data(b"\x00")
    reader = FrameReader(max_payload_bytes=4096)
    with pytest.raises(RemoteProtocolError) as info:
        reader.receive_data(encode_header({"t": "x"}, 4097, max_payload_bytes=1 << 20))
    assert (info.value.what, info.value.size, info.value.limit) == ("frame payload", 4097, 4096)
    with pytest.raises(RemoteProtocolError, match="undecodable"):
        FrameReader().receive_data(b"\x00\x00\x00\x01" + bytes(8) + b"\xc1")


def test_encoding_over_a_limit_is_our_fault_with_size_and_limit():
    with pytest.raises(LocalProtocolError) as info:
        encode_header({"t": "x"}, 101, max_payload_bytes=100)
    assert (info.value.what, info.value.size, info.value.limit) == ("frame payload", 101, 100)
    assert str(info.value) == "frame payload of 101 bytes exceeds the limit of 100 bytes"


def test_a_bad_value_is_local_when_built_and_remote_when_received():
    with pytest.raises(LocalProtocolError) as built:
        m.Alloc(1, "n" * (m.MAX_NAME_CHARS + 1), 8)
    assert (built.value.size, built.value.limit, built.value.unit) == (m.MAX_NAME_CHARS + 1, m.MAX_NAME_CHARS,
                                                                       "characters")
    with pytest.raises(RemoteProtocolError) as received:
        m.parse({"t": "alloc", "req": 1, "name": "n" * (m.MAX_NAME_CHARS + 1), "nbytes": 8})
    assert str(received.value) == str(built.value)
    assert (received.value.size, received.value.limit) == (m.MAX_NAME_CHARS + 1, m.MAX_NAME_CHARS)


# -- user errors -------------------------------------------------------------------------


def test_mismatch_error_attributes_and_message():
    exc = BPSMismatchError(name="w", ours="sum float32[8]", theirs="sum float32[9]")
    assert isinstance(exc, BPSError) and isinstance(exc, RuntimeError)
    assert (exc.name, exc.ours, exc.theirs, exc.detail) == ("w", "sum float32[8]", "sum float32[9]", "")
    assert str(exc) == "tensor 'w' mismatch: ours is sum float32[8], theirs is sum float32[9]"
    noted = BPSMismatchError("the array now holds the sums of 2 of its 4 partitions", name="w", ours="a",
                             theirs="b")
    assert str(noted) == ("tensor 'w' mismatch: ours is a, theirs is b: the array now holds the sums of 2 of "
                          "its 4 partitions")


def test_connection_error_attributes_and_message():
    exc = BPSConnectionError("connection refused", peer="server 2 at 10.0.0.5:9100")
    assert (exc.peer, exc.detail) == ("server 2 at 10.0.0.5:9100", "connection refused")
    assert str(exc) == "connection to server 2 at 10.0.0.5:9100 failed: connection refused"
    assert str(BPSConnectionError(peer="worker 1")) == "connection to worker 1 failed"


def test_timeout_error_attributes_and_message():
    exc = BPSTimeoutError(what="tensor 'w'", timeout_s=30.0)
    assert (exc.what, exc.timeout_s) == ("tensor 'w'", 30.0)
    assert str(exc) == "tensor 'w' timed out after 30 s"
    assert str(BPSTimeoutError(what="alloc", timeout_s=0.25)) == "alloc timed out after 0.25 s"
    assert str(BPSTimeoutError("no answer", what="hello")) == "hello timed out: no answer"


@pytest.mark.parametrize("cls", [BPSError, BPSMismatchError, BPSConnectionError, BPSTimeoutError])
def test_todays_call_style_a_plain_message_still_works(cls):
    exc = cls("worker daemon at /tmp/w.sock did not answer within 30 s")
    assert str(exc) == "worker daemon at /tmp/w.sock did not answer within 30 s"
    assert isinstance(exc, BPSError)


def test_a_plain_message_leaves_the_attributes_empty():
    assert (BPSMismatchError("x").name, BPSMismatchError("x").ours, BPSMismatchError("x").theirs) == ("", "", "")
    assert BPSConnectionError("x").peer == ""
    assert (BPSTimeoutError("x").what, BPSTimeoutError("x").timeout_s) == ("", None)


@pytest.mark.parametrize("exc", [
    BPSMismatchError("note", name="w", ours="float32[8]", theirs="float32[9]"),
    BPSConnectionError(peer="worker 1"),
    BPSTimeoutError(what="tensor 'w'", timeout_s=2.5),
    BPSMismatchError("plain text"),
    BPSError("base"),
])
def test_user_errors_keep_their_attributes_across_pickling(exc):
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc) and back.args == exc.args
    assert back.__dict__ == exc.__dict__


# -- Failure -> typed error ---------------------------------------------------------------

# One Failure per code, with its structured fields where the code has them, and what it must become.
FAILURES = [
    (m.Failure(3, "tensor 'w' mismatch: rank 0 has float32[8] but rank 1 has float32[9]", code="mismatch",
               name="w", ours="float32[8]", theirs="float32[9]"),
     BPSMismatchError, "tensor 'w' mismatch: ours is float32[8], theirs is float32[9]",
     {"name": "w", "ours": "float32[8]", "theirs": "float32[9]"}),
    (m.Failure(4, "server 2 went away", code="connection", peer="server 2 at 10.0.0.5:9100", detail="reset"),
     BPSConnectionError, "connection to server 2 at 10.0.0.5:9100 failed: reset",
     {"peer": "server 2 at 10.0.0.5:9100"}),
    (m.Failure(5, "tensor 'w' did not complete in 30 s", code="timeout", what="tensor 'w'", timeout_s=30.0),
     BPSTimeoutError, "tensor 'w' timed out after 30 s", {"what": "tensor 'w'", "timeout_s": 30.0}),
    (m.Failure(-1, "bad frame", code="protocol_error", peer="the worker daemon at /tmp/w.sock"),
     BPSConnectionError, "connection to the worker daemon at /tmp/w.sock failed", {"peer": "the worker daemon at "
                                                                                           "/tmp/w.sock"}),
    (m.Failure(-1, "worker 0 is already served by another daemon", code="duplicate",
               peer="worker 0 from 10.0.0.7:41000 (daemon 5eed, epoch 0e0e)", detail="stop one of them"),
     BPSConnectionError, "connection to worker 0 from 10.0.0.7:41000 (daemon 5eed, epoch 0e0e) failed: stop one of "
                         "them", {"peer": "worker 0 from 10.0.0.7:41000 (daemon 5eed, epoch 0e0e)"}),
    (m.Failure(9, "tensor 'x' part 0: round 3 was summed for the other workers, but worker 1's answer was lost "
                  "with its connection", code="answer_lost"),
     BPSConnectionError, "tensor 'x' part 0: round 3 was summed for the other workers, but worker 1's answer was "
                         "lost with its connection", {"peer": ""}),
    (m.Failure(6, "tensor 'x' is already in flight", code="bad_request"),
     BPSError, "tensor 'x' is already in flight", {}),
    (m.Failure(7, "round 3 of 'x' aborted by worker 1", code="round_failed"),
     BPSError, "round 3 of 'x' aborted by worker 1", {}),
    (m.Failure(8, "cannot allocate 8 bytes"), BPSError, "cannot allocate 8 bytes", {}),
]


def test_the_table_covers_every_failure_code():
    assert {f.code for f, *_ in FAILURES} == set(get_args(m.FailureCode)) == m.FAILURE_CODES


@pytest.mark.parametrize("failure,cls,text,attributes", FAILURES, ids=[f.code for f, *_ in FAILURES])
def test_error_from_failure_picks_the_class_by_code_and_fills_the_attributes(failure, cls, text, attributes):
    exc = error_from_failure(failure)
    assert type(exc) is cls
    assert str(exc) == text
    for name, value in attributes.items():
        assert getattr(exc, name) == value


@pytest.mark.parametrize("failure,cls,text,attributes", FAILURES, ids=[f.code for f, *_ in FAILURES])
def test_error_from_failure_after_the_wire(failure, cls, text, attributes):
    exc = error_from_failure(m.parse(m.to_header(failure)))
    assert type(exc) is cls and str(exc) == text


def test_the_class_never_comes_from_the_text():
    # The word "mismatch" in an "error" failure is just text.
    assert type(error_from_failure(m.Failure(1, "tensor 'w' mismatch: rank 0 has a but rank 1 has b"))) is BPSError
    # A mismatch code is a mismatch whatever the text says.
    assert type(error_from_failure(m.Failure(1, "it broke", code="mismatch", name="w"))) is BPSMismatchError


@pytest.mark.parametrize("code,cls", [("mismatch", BPSMismatchError), ("connection", BPSConnectionError),
                                      ("protocol_error", BPSConnectionError), ("timeout", BPSTimeoutError)])
def test_a_failure_without_structured_fields_keeps_its_message(code, cls):
    """A sender that does not fill the fields yet (or an old frame): the class from the code, the text as is."""
    old_frame = {"t": "failure", "req": 2, "message": "tensor 'w' mismatch: rank 0 has [8] but rank 1 has [9]",
                 "code": code}
    exc = error_from_failure(m.parse(old_frame))
    assert type(exc) is cls
    assert str(exc) == "tensor 'w' mismatch: rank 0 has [8] but rank 1 has [9]"


def test_an_error_told_on_to_the_peers_keeps_its_code_and_facts_and_a_mismatch_both_sides():
    """A worker daemon that gives a round up for an error (an abort at a server) tells the peers its code and
    facts (why_from_error); a mismatch goes as its two sides, so that each peer hears its own as ``ours``."""
    mismatch = BPSMismatchError("server 0: worker 0 pushed float32[8]", name="w", ours="float32[8]",
                                theirs="float32[9]")
    why = why_from_error(mismatch, "tensor 'w': given up")
    assert (why.text, why.code, why.name, why.sides, why.detail) == (
        "tensor 'w': given up", "mismatch", "w", ("float32[8]", "float32[9]"), "server 0: worker 0 pushed float32[8]")
    heard = why.heard_by("float32[9]")
    assert (heard.ours, heard.theirs) == ("float32[9]", "float32[8]")
    lost = why_from_error(BPSConnectionError("gone", peer="server 2 at h:9"), "lost")
    assert (lost.code, lost.peer, lost.detail, lost.sides) == ("connection", "server 2 at h:9", "gone", None)
    late = why_from_error(BPSTimeoutError("slow", what="round 2 of 'w'", timeout_s=5.0), "late")
    assert (late.code, late.what, late.timeout_s) == ("timeout", "round 2 of 'w'", 5.0)
    assert why_from_error(KeyError("a bug"), "internal error") == m.Why("internal error")
    assert why_from_error(BPSError("plain"), "plain") == m.Why("plain")


def test_reworded_keeps_the_class_and_changes_every_text():
    slow = reworded(BPSTimeoutError("worker 0 did not push it", what="round 0 of 'x'", timeout_s=2.0),
                    lambda text: text.replace("'x'", "the agreement"))
    assert type(slow) is BPSTimeoutError and (slow.what, slow.timeout_s, slow.detail) == (
        "round 0 of the agreement", 2.0, "worker 0 did not push it")
    assert str(slow) == "round 0 of the agreement timed out after 2 s: worker 0 did not push it"
    gone = reworded(BPSConnectionError("lost 'x'", peer="server 1"), lambda text: text.replace("'x'", "it"))
    assert type(gone) is BPSConnectionError and (gone.peer, gone.detail, str(gone)) == (
        "server 1", "lost it", "connection to server 1 failed: lost it")
    assert str(reworded(BPSError("plain 'x'"), lambda text: text.upper())) == "PLAIN 'X'"
