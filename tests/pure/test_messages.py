"""protocol.messages: to_header/parse round trips and validation errors."""

from __future__ import annotations

import dataclasses
import re

import msgpack
import numpy as np
import pytest

from protocol import messages as m
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.frames import DEFAULT_MAX_HEADER_BYTES, FrameReader, encode_header

# One fully populated instance per message type, with non-default values everywhere.
SAMPLES: dict[str, m.Message] = {
    "challenge": m.Challenge(nonce="00ff" * 8, version=1),
    "hello": m.Hello(version=1, role="worker", id=2, pid=4242, auth="ab" * 32, shm="bps_w2_1_ab", shm_key="cd" * 32,
                     epoch="5eed", stream=2),
    "welcome": m.Welcome(version=1, rank=3, size=4, local_rank=1, local_size=2, worker=1, workers=2, shm=True,
                         incarnation="0123abcd"),
    "failure": m.Failure(req=17, message="tensor 'w' has another shape", code="mismatch", name="w",
                         ours="sum float32[8]", theirs="sum float32[9]", peer="server 1 at 10.0.0.2:9100",
                         what="tensor 'w'", timeout_s=2.5, detail="2 of 4 partitions hold sums"),
    "push": m.Push(req=5, name="layer1.weight", part=2, round=9, worker=1, dtype="bfloat16", shape=[64, 3, 3],
                   offset=128, count=448, divisor=4, kind="sum", segment="bps_w1_9_ff", seg_offset=4096,
                   out_segment="bps_w1_9_ee", out_offset=64, replay=True),
    "result": m.Result(req=5, name="layer1.weight", part=2, round=9, inplace=True, applied=[9, 7]),
    "abort": m.Abort(name="emb", part=0, round=3, worker=1, message="tensor 'emb' mismatch", code="mismatch",
                     ours="float32[4]", theirs="float32[5]", peer="rank 1", what="tensor 'emb'", timeout_s=1.5,
                     detail="rank 0 has float32[4] but rank 1 has float32[5]", sides=["float32[4]", "float32[5]"]),
    "init_failed": m.InitFailed(name="emb", worker=1, root=3, round=2, message="tensor 'emb' mismatch", code="mismatch",
                                ours="float32[4]", theirs="float32[5]", detail="rank 0 has float32[4] but rank 1 has "
                                "float32[5]", sides=["float32[4]", "float32[5]"]),
    "reset": m.Reset(worker=1, epoch="beef"),
    "joined": m.Joined(worker=1),
    "release": m.Release(segment="bps_w1_9_ff"),
    "announce": m.Announce(segments=["bps_w1_9_ff", "bps_w1_9_fe"]),
    "round_query": m.RoundQuery(req=3, name="layer1.weight", part=2),
    "round_info": m.RoundInfo(req=3, round=41),
    "ping": m.Ping(seq=12),
    "restored": m.Restored(worker=2),
    "stats_request": m.StatsRequest(req=77),
    "stats": m.Stats(req=77, stats={"bytes_in": 123, "rounds": {"emb": 3}, "ratio": 0.5}),
    "alloc": m.Alloc(req=1, name="grad/fc", nbytes=1 << 20),
    "allocated": m.Allocated(req=1, segment="bps-1234-0", nbytes=1 << 20),
    "op": m.Op(req=8, name="grad/fc", kind="broadcast", dtype="float16", shape=[10, 20], segment="bps-1234-0",
               average=True, priority=-3, root=2, cuda=[[4, 5], [5, 1], 0, "float16", 1, b"h" * 64, 40, 0, b"r", 8,
                                                        b"e" * 64, True], handback=False),
    "done": m.Done(req=8, segment="bps_w1_9_aa", offset=4096),
    "op_batch": m.OpBatch(reqs=[4, 5, 6], names=["a", "b", "c"], specs=[["float32", [4], False, ""],
                                                                      ["float16", [2, 2], True, "x:1"]],
                          spec=[0, 1, 0], segments=["bps_w1_9_aa", "bps_w1_9_ab"], seg=[0, 0, 1],
                          offsets=[0, 64, 128], priority=[0, -1, 3]),
    "done_batch": m.DoneBatch(reqs=[4, 5, 6]),
    "taken": m.Taken(reqs=[4, 6]),
    "leave": m.Leave(req=9),
    "notice": m.Notice(lines=["stall: tensor 'w' (round 3 on worker 0) has waited 30.0 s for local rank 1 (rank 1)"]),
    "fuse_ready": m.FuseReady(names=["a", "b"], specs=[["int64", [3], False, ""]], spec=[0, 0], counts=[3, 0],
                              rounds=[7, 0]),
    "fuse_running": m.FuseRunning(seq=4, names=["a", "b"], counts=[4, 1], rounds=[9, 2], lanes="0123abcd.2"),
    "fuse_past": m.FusePast(names=["a", "b"], rounds=[10, 3], counts=[4, 1]),
    "fuse_resync": m.FuseResync(incarnation="0123abcd", names=["a", "b"], counts=[7, 0], rounds=[9, 0]),
    "fuse_abort": m.FuseAbort(names=["a"], message="rank 1 disconnected", code="connection", reported=True,
                              rounds=[5], ours="float32[4]", theirs="float32[5]", peer="rank 1 (pid 7)",
                              what="tensor 'a'", timeout_s=2.0, detail="it disconnected", sides=["x[1]", "y[1]"]),
    "fuse_plan": m.FusePlan(seq=7, names=["b", "a"], resent="lost", groups=[["float16", True], ["int32", False]],
                            group=[1, 0], epoch="5f3a9c0d11e2b4a7", lanes="0123abcd.1"),
    "fuse_failed": m.FuseFailed(name="a", message="tensor 'a' mismatch", code="mismatch", ours="float32[4]",
                                theirs="float16[4]", peer="worker 1", detail="worker 0 has float32[4]",
                                epoch="5f3a9c0d11e2b4a7", what="tensor 'a'", timeout_s=4.0,
                                sides=["float32[4]", "float16[4]"]),
    "batch": m.Batch(items=[{"t": "done", "req": 1}, {"t": "result", "req": 2, "name": "b", "part": 0, "round": 1}],
                     sizes=[0, 8]),
}

VALID: dict[str, dict] = {t: m.to_header(msg) for t, msg in SAMPLES.items()}


def header(t: str, **changes) -> dict:
    h = dict(VALID[t])
    h.update(changes)
    return h


def without(t: str, field: str) -> dict:
    h = dict(VALID[t])
    del h[field]
    return h


def test_samples_cover_every_message_type():
    assert set(SAMPLES) == set(m.MESSAGES)
    for t, msg in SAMPLES.items():
        assert type(msg) is m.MESSAGES[t] and msg.TYPE == t


@pytest.mark.parametrize("t", sorted(m.MESSAGES))
def test_to_header_then_parse_round_trip(t):
    msg = SAMPLES[t]
    h = m.to_header(msg)
    assert h["t"] == t
    assert set(h) == {"t"} | {f.name for f in dataclasses.fields(msg)}
    for f in dataclasses.fields(msg):
        assert h[f.name] == getattr(msg, f.name)
    assert m.parse(h) == msg


@pytest.mark.parametrize("t", sorted(m.MESSAGES))
def test_round_trip_through_the_wire(t):
    """to_header -> encode_header -> FrameReader -> parse gives the same message back."""
    msg = SAMPLES[t]
    frames = FrameReader().receive_data(encode_header(m.to_header(msg)))
    assert len(frames) == 1
    assert m.parse(frames[0].header) == msg


@pytest.mark.parametrize("t", sorted(m.MESSAGES))
def test_optional_fields_take_their_defaults(t):
    cls = m.MESSAGES[t]
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    h = {k: v for k, v in VALID[t].items() if k == "t" or k in required}
    msg = m.parse(h)
    for f in dataclasses.fields(cls):
        if f.name in required:
            assert getattr(msg, f.name) == VALID[t][f.name]
        elif f.default is not dataclasses.MISSING:
            assert getattr(msg, f.name) == f.default
        else:
            assert getattr(msg, f.name) == f.default_factory()


def test_specific_defaults():
    assert m.parse({"t": "hello", "version": 1, "role": "client", "id": 0}).pid == 0
    push = m.parse(without("push", "divisor") | {"kind": "sum"})
    assert push.divisor == 1 and push.kind == "sum"
    op = m.parse({k: v for k, v in VALID["op"].items() if k not in ("average", "priority", "root")})
    assert (op.average, op.priority, op.root) == (False, 0, -1)
    assert m.parse({"t": "failure", "req": -1, "message": "bye"}).code == "error"
    assert m.parse({"t": "stats", "req": 1}).stats == {}


def test_unknown_extra_fields_are_ignored():
    assert m.parse(header("done", extra="future")) == SAMPLES["done"]


def test_push_payload_nbytes():
    assert SAMPLES["push"].payload_nbytes == 448 * 2
    assert m.parse(header("push", dtype="float64", count=10)).payload_nbytes == 80


# -- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("tag", ["nope", "", "Hello", 5, None, b"hello"])
def test_unknown_type_names_it(tag):
    with pytest.raises(ProtocolError, match="unknown message type") as info:
        m.parse({"t": tag})
    assert repr(tag) in str(info.value)


def test_missing_t_is_unknown_type():
    with pytest.raises(ProtocolError, match="unknown message type None"):
        m.parse({"req": 1})


@pytest.mark.parametrize("t", sorted(m.MESSAGES))
def test_every_missing_required_field_is_named(t):
    cls = m.MESSAGES[t]
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    assert required  # every message has at least one required field
    for name in required:
        with pytest.raises(ProtocolError, match=rf"{t} message lacks field '{name}'"):
            m.parse(without(t, name))


WRONG_TYPES = [
    ("done", "req", "8", "int", "str"),
    ("done", "req", 8.0, "int", "float"),
    ("done", "req", True, "int", "bool"),
    ("done", "req", False, "int", "bool"),
    ("done", "req", None, "int", "NoneType"),
    ("hello", "version", True, "int", "bool"),
    ("hello", "role", 1, "str", "int"),
    ("welcome", "workers", [2], "int", "list"),
    ("push", "name", b"layer1.weight", "str", "bytes"),
    ("push", "shape", (1, 2), "list", "tuple"),
    ("push", "shape", {"0": 1}, "list", "dict"),
    ("push", "shape", 7, "list", "int"),
    ("push", "divisor", True, "int", "bool"),
    ("push", "count", 1.5, "int", "float"),
    ("stats", "stats", [1, 2], "dict", "list"),
    ("op", "average", 1, "bool", "int"),
    ("op", "average", "yes", "bool", "str"),
    ("op", "priority", True, "int", "bool"),
    ("alloc", "nbytes", "10", "int", "str"),
    ("failure", "message", None, "str", "NoneType"),
]


@pytest.mark.parametrize("t,field,value,want,got", WRONG_TYPES)
def test_wrong_type_names_field_and_types(t, field, value, want, got):
    with pytest.raises(ProtocolError) as info:
        m.parse(header(t, **{field: value}))
    assert str(info.value) == f"{t} message field {field!r} must be {want}, got {got}"


@pytest.mark.parametrize("t", ["push", "op"])
@pytest.mark.parametrize("shape", [
    [-1],
    [4, -2, 3],
    [1.0, 2],
    [True, 2],
    ["3"],
    [None],
    [[2, 2]],
    [1] * (m.MAX_DIMS + 1),
])
def test_invalid_shape_names_the_shape(t, shape):
    with pytest.raises(ProtocolError, match="invalid shape") as info:
        m.parse(header(t, shape=shape))
    assert repr(shape) in str(info.value)


@pytest.mark.parametrize("t", ["push", "op"])
def test_shape_limits_that_are_valid(t):
    assert m.parse(header(t, shape=[1] * m.MAX_DIMS)).shape == [1] * m.MAX_DIMS
    assert m.parse(header(t, shape=[])).shape == []  # a scalar
    assert m.parse(header(t, shape=[0, 5])).shape == [0, 5]  # an empty tensor


@pytest.mark.parametrize("t", ["push", "op"])
@pytest.mark.parametrize("dtype", ["complex64", "float8", "int8", "uint16", "FLOAT32", ""])
def test_unknown_dtype_is_named(t, dtype):
    with pytest.raises(ProtocolError, match="unsupported dtype") as info:
        m.parse(header(t, dtype=dtype))
    assert repr(dtype) in str(info.value)


@pytest.mark.parametrize("t", ["push", "op"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32", "int64"])
def test_every_wire_dtype_is_accepted(t, dtype):
    extra = {"divisor": 1} if t == "push" else {}
    assert m.parse(header(t, dtype=dtype, **extra)).dtype == dtype


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_push_cannot_ask_to_divide_an_integer_sum(dtype):
    with pytest.raises(ProtocolError, match="averages need floats"):
        m.parse(header("push", dtype=dtype, divisor=4))


@pytest.mark.parametrize("role", ["admin", "", "Worker", "server"])
def test_bad_role_is_named(role):
    with pytest.raises(ProtocolError, match="unknown role") as info:
        m.parse(header("hello", role=role))
    assert repr(role) in str(info.value)


@pytest.mark.parametrize("stream", [-1, m.MAX_STREAMS])
def test_hello_stream_out_of_range_is_named(stream):
    with pytest.raises(ProtocolError, match=rf"stream {stream} outside 0\.\.{m.MAX_STREAMS - 1}"):
        m.parse(header("hello", stream=stream))


@pytest.mark.parametrize("field,value", [("segment", "x" * (m.MAX_SEGMENT_CHARS + 1)), ("offset", -1)])
def test_done_with_a_bad_result_location_is_refused(field, value):
    with pytest.raises(ProtocolError, match="segment"):
        m.parse(header("done", **{field: value}))


def test_both_roles_accepted():
    assert m.parse(header("hello", role=m.ROLE_CLIENT)).role == "client"
    assert m.parse(header("hello", role=m.ROLE_WORKER)).role == "worker"


@pytest.mark.parametrize("t", ["push", "op"])
@pytest.mark.parametrize("kind", ["max", "", "SUM", "allreduce"])
def test_bad_kind_is_named(t, kind):
    with pytest.raises(ProtocolError, match="unknown operation kind") as info:
        m.parse(header(t, kind=kind))
    assert repr(kind) in str(info.value)


@pytest.mark.parametrize("t", ["push", "op", "alloc"])
def test_empty_name_rejected(t):
    with pytest.raises(ProtocolError, match=r"tensor name must have 1 to \d+ characters, got 0"):
        m.parse(header(t, name=""))


@pytest.mark.parametrize("t", ["push", "op", "alloc"])
def test_name_length_limit(t):
    assert m.parse(header(t, name="n" * m.MAX_NAME_CHARS)).name == "n" * m.MAX_NAME_CHARS
    with pytest.raises(ProtocolError, match=f"tensor name .* got {m.MAX_NAME_CHARS + 1}"):
        m.parse(header(t, name="n" * (m.MAX_NAME_CHARS + 1)))


@pytest.mark.parametrize("field", ["part", "round", "offset", "count", "worker", "seg_offset", "out_offset"])
def test_push_negative_numbers_rejected(field):
    with pytest.raises(ProtocolError, match=field):
        m.parse(header("push", **{field: -1}))
    assert getattr(m.parse(header("push", **{field: 0})), field) == 0


def test_segment_names_are_bounded():
    too_long = "s" * (m.MAX_SEGMENT_CHARS + 1)
    for t, field in (("push", "segment"), ("push", "out_segment"), ("hello", "shm"), ("release", "segment")):
        with pytest.raises(ProtocolError, match="segment|shared-memory"):
            m.parse(header(t, **{field: too_long}))
    with pytest.raises(ProtocolError, match="release"):
        m.parse(header("release", segment=""))
    with pytest.raises(ProtocolError, match="not both"):
        m.parse(header("push", out_segment=""))


@pytest.mark.parametrize("divisor", [0, -1])
def test_push_divisor_below_one_rejected(divisor):
    with pytest.raises(ProtocolError, match="divisor < 1"):
        m.parse(header("push", divisor=divisor))


def test_alloc_negative_size_rejected():
    with pytest.raises(ProtocolError, match="negative size"):
        m.parse(header("alloc", nbytes=-1))
    assert m.parse(header("alloc", nbytes=0)).nbytes == 0


def test_parse_result_is_frozen():
    msg = m.parse(VALID["done"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.req = 3  # type: ignore[misc]


def test_header_is_plain_msgpack_map():
    body = msgpack.packb(m.to_header(SAMPLES["push"]), use_bin_type=True)
    assert msgpack.unpackb(body, raw=False) == VALID["push"]


def test_split_batch_gives_each_item_its_payload_slice():
    parts = [(m.Done(1), 0), (m.Result(2, "b", 0, 1), 8), (m.Result(3, "c", 1, 1), 4)]
    batch = m.parse(m.batch_header(parts))
    payload = memoryview(bytes(range(12)))
    items = m.split_batch(batch, payload)
    assert [type(i).__name__ for i, _ in items] == ["Done", "Result", "Result"]
    assert items[0][1] is None and bytes(items[1][1]) == bytes(range(8)) and bytes(items[2][1]) == bytes(range(8, 12))


@pytest.mark.parametrize("sizes,payload,match", [
    ([4], 8, "add up to 4 bytes but the payload has 8"),
    ([-1], 0, "non-negative"),
    ([1, 2], 3, "1 items but 2 sizes"),
])
def test_bad_batches_are_protocol_errors(sizes, payload, match):
    items = [{"t": "done", "req": 1}]
    with pytest.raises(ProtocolError, match=match):
        batch = m.parse({"t": "batch", "items": items, "sizes": sizes})
        m.split_batch(batch, memoryview(bytes(payload)) if payload else None)


def test_batches_do_not_nest_and_items_are_validated():
    inner = {"t": "batch", "items": [{"t": "done", "req": 1}], "sizes": [0]}
    with pytest.raises(ProtocolError, match="nest"):
        m.split_batch(m.parse({"t": "batch", "items": [inner], "sizes": [0]}), None)
    with pytest.raises(ProtocolError, match="lacks field 'req'"):
        m.split_batch(m.parse({"t": "batch", "items": [{"t": "done"}], "sizes": [0]}), None)
    with pytest.raises(ProtocolError, match="1 to 1024"):
        m.parse({"t": "batch", "items": [], "sizes": []})


def test_a_header_with_a_field_we_do_not_know_parses_to_the_fields_we_know():
    """A newer peer's extra field (or a non-string key) is ignored, as before the fast path of parse."""
    header = m.to_header(m.Done(7))
    assert m.parse({**header, "from_the_future": [1, 2]}) == m.Done(7)
    assert m.parse({**header, 5: "x"}) == m.Done(7)
    with pytest.raises(ProtocolError, match="lacks field 'req'") as info:
        m.parse({"t": "done", "from_the_future": 1})
    assert isinstance(info.value, RemoteProtocolError)


def test_to_header_lists_every_field_after_the_tag():
    push = m.Push(req=5, name="w", part=1, round=2, worker=3, dtype="float32", shape=[8], offset=0, count=8)
    header = m.to_header(push)
    assert list(header) == ["t"] + [f.name for f in dataclasses.fields(m.Push)]
    assert header["t"] == "push" and m.parse(header) == push


# -- built means checked ------------------------------------------------------------------

def _push(**changes) -> m.Push:
    fields = dict(req=5, name="w", part=0, round=0, worker=0, dtype="float32", shape=[8], offset=0, count=8)
    fields.update(changes)
    return m.Push(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("build,match", [
    (lambda: _push(name=""), "tensor name must have 1 to 1024 characters, got 0"),
    (lambda: _push(dtype="complex64"), "unsupported dtype 'complex64'"),
    (lambda: _push(shape=[4, -1]), r"invalid shape \[4, -1\]"),
    (lambda: _push(kind="max"), "unknown operation kind 'max'"),
    (lambda: _push(part=-1), "push has a negative part: -1"),
    (lambda: _push(round=-2), "push has a negative round: -2"),
    (lambda: _push(divisor=0), r"push has divisor < 1: 0"),
    (lambda: _push(dtype="int32", divisor=2), "averages need floats"),
    (lambda: _push(segment="bps_w0_1"), "not both"),
    (lambda: _push(resumed=True, replay=True), "is resumed, but only a synchronous contribution can be"),
    (lambda: _push(resumed=True, kind="async", round=0), "async push of 'w' is resumed"),
    (lambda: _push(shape=(8,)), "push message field 'shape' must be list, got tuple"),
    (lambda: _push(count=True), "push message field 'count' must be int, got bool"),
    (lambda: _push(count=np.int64(8)), "push message field 'count' must be int, got int64"),
    (lambda: m.Op(1, "w", "sum", "float32", [2], "seg", offset=-4), "negative segment offset -4"),
    (lambda: m.Op(1, "w", "allreduce", "float32", [2], "seg"), "unknown operation kind 'allreduce'"),
    (lambda: m.Done(1, "s" * (m.MAX_SEGMENT_CHARS + 1)), "segment name of 201 characters; 0 to 200 allowed"),
    (lambda: m.Release(""), "released segment name of 0 characters; 1 to 200 allowed"),
    (lambda: m.Alloc(1, "w", -1), "alloc of a negative size: -1"),
    (lambda: m.RoundQuery(1, "w", part=-1), "round query has a negative part: -1"),
    (lambda: m.Abort("w", 0, 0, 0, "x" * (m.MAX_MESSAGE_CHARS + 1)), "abort message of 4097 characters"),
    (lambda: m.Abort("w", 0, -1, 0, "bye"), "abort has a negative round: -1"),
    (lambda: m.RoundQuery(1, "w", fate=-2), "round query asks the fate of round -2"),
    (lambda: m.Batch([], []), "batch of 0 items; 1 to 1024 allowed"),
    (lambda: m.Failure(1, "x", code="oops"),  # type: ignore[arg-type]
     "failure message field 'code' must be one of 'error', 'mismatch', 'round_failed', 'protocol_error', "
     "'bad_request', 'timeout', 'connection', 'duplicate', 'answer_lost', got 'oops'"),
    (lambda: m.Failure(1, "x", code="timeout", timeout_s=-1.0), "timeout_s must be finite and >= 0, got -1.0"),
    (lambda: m.Failure(1, "x", code="timeout", timeout_s=float("nan")), "timeout_s must be finite"),
    (lambda: m.Failure(1, None), "failure message field 'message' must be str, got NoneType"),  # type: ignore
    (lambda: m.Stats(1, [1]), "stats message field 'stats' must be dict, got list"),  # type: ignore[arg-type]
    (lambda: m.FuseFailed("a", "x", epoch="e" * (m.MAX_MESSAGE_CHARS + 1)), "fuse failed epoch of 4097 characters"),
    (lambda: m.FuseFailed("a", "x", epoch=None), "fuse_failed message field 'epoch' must be str"),  # type: ignore
    (lambda: m.FuseAbort(["a", "b"], "x", rounds=[1]), "fuse abort has 2 tensors but 1 rounds"),
    (lambda: m.FuseRunning(1, ["a", "b"], [1, 1], rounds=[0, 0, 0]), "fuse running has 2 tensors but 3 rounds"),
    (lambda: m.FuseRunning(1, ["a"], [1], rounds=["0"]), "fuse running rounds must each be a non-negative int"),
    (lambda: m.FuseRunning(1, ["a"], [1], lanes="r@1"), "fuse running lanes 'r@1': printable, without '@'"),
    (lambda: m.FuseRunning(1, ["a"], [1], lanes="r" * 65), "fuse running lanes of 65 characters; at most 64"),
    (lambda: m.FusePast(["a", "b"], [1], [0, 0]), "fuse past has 2 tensors but 1 rounds"),
    (lambda: m.FusePast(["a"], [-2], [0]), "fuse past rounds must each be a non-negative int, got -2"),
    (lambda: m.FusePast(["a"], [2], []), "fuse past has 1 tensors but 0 counts"),
    (lambda: m.FusePast([], [], []), "fuse past of 0 tensors"),
    (lambda: m.FuseResync("r", ["a"], [1], rounds=[1, 2]), "fuse resync has 1 tensors but 2 rounds"),
    (lambda: m.FuseResync("r", ["a"], [1], rounds=[-1]), "fuse resync rounds must each be a non-negative int"),
    (lambda: m.FuseAbort(["a"], "x", rounds=[-1]), "fuse abort rounds must each be a non-negative int, got -1"),
    (lambda: m.FuseAbort(["a"], "x", rounds=[True]), "fuse abort rounds must each be a non-negative int, got True"),
])
def test_a_bad_message_is_refused_where_it_is_built_or_by_its_check(build, match):
    """Built means checked, but for the hot path's messages (CHECKED_WHEN_PARSED): those are checked by
    ``check()``, which parse runs (test_a_bad_hot_path_message_is_refused_where_it_is_parsed)."""
    try:
        message = build()
    except LocalProtocolError as exc:
        assert re.search(match, str(exc)), exc
        return
    assert type(message).CHECKED_WHEN_PARSED, f"{type(message).__name__} was built unchecked"
    with pytest.raises(LocalProtocolError, match=match):
        message.check()


HOT_PATH = {"push", "result", "done", "done_batch", "fuse_ready", "fuse_plan"}


def test_only_the_hot_paths_messages_are_checked_when_parsed():
    assert {t for t, cls in m.MESSAGES.items() if cls.CHECKED_WHEN_PARSED} == HOT_PATH


@pytest.mark.parametrize("t, changes, says", [
    ("push", dict(part=-1), "push has a negative part: -1"),
    ("push", dict(shape=[4, -1]), "invalid shape"),
    ("push", dict(count=True), "push message field 'count' must be int, got bool"),
    ("result", dict(applied=[0, -1]), "applied vector must hold non-negative integers"),
    ("done", dict(offset=-4), "negative segment offset -4"),
    ("done_batch", dict(reqs=[1, -2]), "requests must each be a non-negative int"),
    ("fuse_ready", dict(spec=[0, 5]), "spec indexes must each be an int in 0..0"),
    ("fuse_ready", dict(rounds=[1]), "fuse ready has 2 tensors but 1 rounds"),
    ("fuse_ready", dict(rounds=[0, -3]), "fuse ready rounds must each be a non-negative int, got -3"),
    ("fuse_ready", dict(rounds=[0, 1.0]), "fuse ready rounds must each be a non-negative int, got 1.0"),
    ("fuse_plan", dict(names=[]), "fuse plan of 0 tensors"),
    ("fuse_plan", dict(group=[0, 2]), "fuse plan group indexes must each be an int in 0..1"),
    ("fuse_plan", dict(group=[0]), "fuse plan has 2 tensors but 1 group indexes"),
    ("fuse_plan", dict(group=[]), "fuse plan has 2 tensors but 0 group indexes"),
    ("fuse_plan", dict(groups=[], group=[0, 0]), "fuse plan group indexes must each be an int in 0..-1"),
    ("fuse_plan", dict(groups=[["float32", False]] * 3, group=[0, 1]), "fuse plan has more groups than tensors"),
    ("fuse_plan", dict(groups=[["float32"], ["int32", False]]), "a fused plan group is [dtype, average]"),
    ("fuse_plan", dict(groups=[["float32", 1], ["int32", False]]), "a fused plan group is [dtype, average]"),
    ("fuse_plan", dict(groups=[["complex", False], ["int32", False]]), "unsupported dtype 'complex'"),
    ("fuse_plan", dict(groups=[["float32", False], ["int32", True]]), "a fused plan group averages int32"),
    ("fuse_plan", dict(epoch="e" * (m.MAX_MESSAGE_CHARS + 1)), "fuse plan epoch of 4097 characters"),
    ("fuse_plan", dict(epoch=7), "fuse_plan message field 'epoch' must be str, got int"),
    ("fuse_plan", dict(lanes="run@1"), "fuse plan lanes 'run@1': printable, without '@'"),
    ("fuse_plan", dict(lanes="run\n1"), "fuse plan lanes 'run\\n1': printable, without '@'"),
    ("fuse_plan", dict(lanes="r" * 65), "fuse plan lanes of 65 characters; at most 64"),
    ("fuse_plan", dict(lanes=1), "fuse_plan message field 'lanes' must be str, got int"),
])
def test_a_bad_hot_path_message_is_refused_where_it_is_parsed(t, changes, says):
    with pytest.raises(RemoteProtocolError, match=re.escape(says)):
        m.parse(header(t, **changes))


def test_replace_checks_too():
    op = m.Op(1, "w", "sum", "float32", [2], "seg")
    with pytest.raises(LocalProtocolError, match="negative segment offset"):
        dataclasses.replace(op, offset=-1)
    push = _push()
    with pytest.raises(LocalProtocolError, match="negative offset"):
        dataclasses.replace(push, offset=-1).check()  # a hot path message: checked by check() (and parse)
    assert dataclasses.replace(push, replay=True).replay is True


def test_a_received_bad_value_is_the_peers_fault():
    for h in (header("push", part=-1), header("failure", code="nope"), header("done", req="1"), {"t": "x"},
              without("push", "name"), header("batch", items=[])):
        with pytest.raises(RemoteProtocolError):
            m.parse(h)
    with pytest.raises(RemoteProtocolError, match="nest"):
        m.split_batch(m.parse({"t": "batch", "items": [VALID["batch"]], "sizes": [0]}), None)


def test_a_failure_code_is_one_of_the_closed_set():
    assert m.FAILURE_CODES == {"error", "mismatch", "round_failed", "protocol_error", "bad_request", "timeout",
                               "connection", "duplicate", "answer_lost"}
    for code in sorted(m.FAILURE_CODES):
        assert m.parse(header("failure", code=code)).code == code
    with pytest.raises(RemoteProtocolError, match="field 'code' must be one of"):
        m.parse(header("failure", code="Mismatch"))
    with pytest.raises(RemoteProtocolError, match="field 'code' must be str, got int"):
        m.parse(header("failure", code=3))


def test_an_old_failure_frame_parses_with_empty_structured_fields():
    old = m.parse({"t": "failure", "req": 3, "message": "tensor 'w' mismatch", "code": "mismatch"})
    assert old == m.Failure(3, "tensor 'w' mismatch", code="mismatch")
    assert (old.name, old.ours, old.theirs, old.peer, old.what, old.timeout_s, old.detail) == \
        ("", "", "", "", "", 0.0, "")


def test_a_float_field_takes_an_int():
    assert m.parse(header("failure", timeout_s=30)).timeout_s == 30
    assert m.Failure(1, "x", code="timeout", what="w", timeout_s=5).timeout_s == 5
    with pytest.raises(LocalProtocolError, match="'timeout_s' must be float, got bool"):
        m.Failure(1, "x", timeout_s=True)


def test_push_extent_is_checked_by_the_receiver():
    _push(offset=4, count=4).check_extent()
    _push(shape=[], count=1).check_extent()  # a scalar
    _push(shape=[0, 5], count=0).check_extent()  # an empty tensor
    with pytest.raises(RemoteProtocolError, match="push of 'w' part 3 exceeds its tensor's 8 elements") as info:
        _push(part=3, offset=4, count=5).check_extent()
    assert (info.value.size, info.value.limit, info.value.unit) == (9, 8, "elements")


def test_estimated_header_bytes_bounds_the_encoded_header():
    for msg in list(SAMPLES.values()) + [m.Failure(1, "é" * 1000, code="mismatch", name="ü" * 1024, ours="o" * 4096,
                                                   theirs="t" * 4096, detail="d" * 4096)]:
        if isinstance(msg, (m.Batch, m.Stats, m.Op)):
            continue  # these carry unbounded structures; no sender batches them
        assert len(msgpack.packb(m.to_header(msg), use_bin_type=True)) <= m.estimated_header_bytes(msg)


def test_estimated_header_bytes_counts_the_fields_each_class_has():
    """The estimate looks up once per class which of the free-text fields (and the shape) a message has: for
    every message class it is what a lookup of each field on the instance gives."""
    for msg in SAMPLES.values():
        text = sum(len(getattr(msg, f, "")) for f in m._FREE_TEXT)
        assert m.estimated_header_bytes(msg) == 4 * text + 24 * len(getattr(msg, "shape", ())) + 256, type(msg)


def test_estimated_header_bytes_of_pushes_and_results_is_unchanged():
    """Batch boundaries depend on it: the estimate of what is batched today stays as it was."""
    push = SAMPLES["push"]
    assert m.estimated_header_bytes(push) == 4 * len(push.name) + 24 * len(push.shape) + 256
    result = SAMPLES["result"]
    assert m.estimated_header_bytes(result) == 4 * len(result.name) + 256
    failure = m.Failure(1, "round 3 failed", code="round_failed")
    assert m.estimated_header_bytes(failure) == 4 * len(failure.message) + 256


def _op_batch(**changes) -> dict:
    return header("op_batch", **changes)


@pytest.mark.parametrize("changes, says", [
    (dict(spec=[0, 2, 0]), "spec indexes must each be an int in 0..1"),
    (dict(seg=[0, 0]), "has 3 tensors but 2 segment indexes"),
    (dict(offsets=[0, -1, 0]), "offsets must each be a non-negative int"),
    (dict(reqs=[1, 2, True]), "requests must each be a non-negative int"),
    (dict(names=["a", "", "c"]), "tensor name must have 1 to"),
    (dict(names=["a", 3, "c"]), "names a int, not a tensor name"),
    (dict(specs=[["float32", [4], False, ""], ["complex", [2], False, ""]]), "unsupported dtype"),
    (dict(specs=[["int32", [4], True, ""], ["float16", [2, 2], True, ""]]), "averages int32"),
    (dict(specs=[["float32", [4]], ["float16", [2, 2], True, ""]]), "a fused spec is [dtype, shape, average, layout]"),
    (dict(priority=[0, 1]), "has 3 tensors but priorities"),
    (dict(segments=["", "x"]), "segment name of 0 characters"),
    (dict(names=["a", "b" * (m.MAX_NAME_CHARS + 1), "c"]), "tensor name must have 1 to"),
    (dict(priority=[0, False, 1]), "has 3 tensors but priorities"),
    (dict(offsets=[0, 1.0, 0]), "offsets must each be a non-negative int"),
    (dict(seg=[0, 0, 2]), "segment indexes must each be an int in 0..1"),
])
def test_a_bad_op_batch_is_a_protocol_error_naming_the_column(changes, says):
    with pytest.raises(RemoteProtocolError, match=re.escape(says)):
        m.parse(_op_batch(**changes))


def test_fused_messages_are_bounded():
    names = [f"n{i}" for i in range(m.MAX_FUSED_ENTRIES + 1)]
    with pytest.raises(LocalProtocolError, match="1 to 4096 allowed"):
        m.FusePlan(1, names).check()
    with pytest.raises(LocalProtocolError, match="1 to 4096 allowed"):
        m.FuseReady([], [], []).check()
    chunks = m.fused_chunks(["x" * 1000] * 60 + ["y"] * 5000)
    assert chunks[0][0] == 0 and chunks[-1][1] == 5060
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # contiguous, every name once
    for start, stop in chunks:
        assert stop - start <= m.MAX_FUSED_ENTRIES
        assert stop - start == 1 or sum(len(n) + 16 for n in (["x" * 1000] * 60 + ["y"] * 5000)[start:stop]) \
            <= m.FUSED_NAMES_BUDGET


def test_a_fused_spec_reads_as_a_hashable_tuple_and_is_described_as_an_op():
    spec = m.check_spec(["float16", [2, 3], True, "fused:ab:2"])
    assert spec == ("float16", (2, 3), True, "fused:ab:2") and hash(spec)
    assert m.describe_spec(spec) == "float16[2,3] (average) (layout fused:ab:2)"


def test_async_fields_are_checked() -> None:
    """Asynchronous mode's fields: a staleness only on asynchronous pushes (and an async_init op), -1 or at least
    0; an async_init names its root as a broadcast does; applied vectors hold non-negative integers."""
    base = dict(req=1, name="w", part=0, round=0, worker=0, dtype="float32", shape=[4], offset=0, count=4)
    assert m.Push(**base, kind="async_init", root=0, holds_root=True, staleness=2).staleness == 2
    for bad in (dict(kind="async_init"), dict(kind="sum", staleness=1), dict(kind="async", staleness=-2),
                dict(kind="async", applied=[1, -1]), dict(kind="async", root=0)):
        with pytest.raises(LocalProtocolError):
            m.Push(**base, **bad).check()  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="only an async_init"):
        m.Op(req=1, name="w", kind="async", dtype="float32", shape=[4], segment="s", staleness=1)
    with pytest.raises(LocalProtocolError, match="applied vector"):
        m.Result(req=1, name="w", part=0, round=1, applied=[0] * (m.MAX_WORKERS + 1)).check()


def test_a_failures_free_text_is_clipped_not_refused():
    """A failure built from a long tensor name's repr (a name of 1024 control characters is a valid name, its
    repr four times as long) could not be built: the daemon's own error, raised where it failed the round, left
    its waiters with no answer. Its free text is clipped to MAX_MESSAGE_CHARS instead, parsed or built."""
    name = "\x01" * m.MAX_NAME_CHARS
    failure = m.Failure(1, f"tensor {name!r} timed out", code="timeout", what=f"tensor {name!r}", timeout_s=3.0,
                        detail=f"waited for {name!r}")
    assert len(failure.what) == len(failure.detail) == m.MAX_MESSAGE_CHARS and failure.what.startswith("tensor '\\x01")
    assert len(failure.message) == m.MAX_MESSAGE_CHARS and failure.timeout_s == 3.0
    parsed = m.parse({"t": "failure", "req": 2, "message": "x", "ours": "o" * (m.MAX_MESSAGE_CHARS + 5)})
    assert isinstance(parsed, m.Failure) and parsed.ours == "o" * m.MAX_MESSAGE_CHARS


# -- a Why between the daemons --------------------------------------------------------------------------------
def _carriers(why: m.Why) -> list[m.Message]:
    """``why`` in each message that carries it between the daemons, through the wire and back."""
    built = [m.Abort("w", 0, 3, 1, **why.carry()), m.FuseAbort(["w"], reported=True, **why.carry()),
             m.FuseFailed("w", epoch="e1", **why.carry())]
    return [m.parse(FrameReader().receive_data(encode_header(m.to_header(msg)))[0].header) for msg in built]


@pytest.mark.parametrize("why", [
    m.Why.mismatch("w", "float32[4] (average)", "float32[5] (average)",
                   "rank 0 has float32[4] (average) but rank 1 has float32[5] (average)"),
    m.Why("tensor 'w' timed out", "timeout", name="w", what="tensor 'w'", timeout_s=5.0, detail="rank 3 is absent"),
    m.Why("rank 1 left", "connection", name="w", peer="rank 1 (pid 77)", detail="it disconnected"),
    m.Why("tensor 'w': every process of worker 0 left", "round_failed", name="w"),
], ids=["mismatch", "timeout", "connection", "plain"])
def test_a_why_travels_whole_in_every_message_that_carries_it(why):
    """Abort, FuseAbort and FuseFailed carry a Why's code and facts, and a mismatch's two sides unaddressed: the
    receiver rebuilds the same Why (the tensor's name is the message's own), and each side hears its own."""
    for carrier in _carriers(why):
        assert m.Why.carried(carrier, "w") == why, carrier  # type: ignore[arg-type]
    if why.code == "mismatch":
        heard = m.Why.carried(_carriers(why)[0], "w").heard_by("float32[5] (average)")  # type: ignore[arg-type]
        assert (heard.ours, heard.theirs, heard.sides) == ("float32[5] (average)", "float32[4] (average)", None)


def test_an_old_abort_frame_parses_as_a_round_failed_without_facts():
    """A worker from before the facts travelled: its Abort and FuseAbort say only words."""
    old = m.parse({"t": "abort", "name": "w", "part": 0, "round": 2, "worker": 1, "message": "gave up"})
    assert isinstance(old, m.Abort) and m.Why.carried(old, old.name) == m.Why("gave up", "round_failed", name="w")
    fused = m.parse({"t": "fuse_abort", "names": ["w"], "message": "gave up"})
    assert isinstance(fused, m.FuseAbort) and m.Why.carried(fused) == m.Why("gave up", "round_failed")


def test_a_carried_why_has_no_sides_or_two_and_its_text_is_clipped():
    for sides in (["float32[4]"], ["a", "b", "c"], ["a", 3]):
        with pytest.raises(RemoteProtocolError, match="sides must be none or two descriptions"):
            m.parse(header("abort", sides=sides))
    with pytest.raises(RemoteProtocolError, match="fuse abort timeout_s must be finite"):
        m.parse(header("fuse_abort", timeout_s=-1.0))
    long = "\x01" * m.MAX_NAME_CHARS
    why = m.Why.mismatch(long, f"float32[4] {long!r}", "float32[5]", f"{long!r} " * 3)
    abort = m.Abort("w", 0, 0, 0, **why.carry())
    assert len(abort.message) == len(abort.detail) == len(abort.sides[0]) == m.MAX_MESSAGE_CHARS


def test_the_relayed_why_says_who_gave_the_round_up_before_its_text_and_detail():
    why = m.Why.mismatch("w", "float32[4]", "float32[5]", "rank 0 has float32[4] but rank 1 has float32[5]")
    told = why.relayed("worker 0 gave the fused sum up")
    assert told.text == "worker 0 gave the fused sum up: tensor 'w' mismatch: rank 0 has float32[4] but rank 1 has " \
        "float32[5]"
    assert told.detail == "worker 0 gave the fused sum up: rank 0 has float32[4] but rank 1 has float32[5]"
    assert told.sides == why.sides and m.Why("gone").relayed("worker 2").detail == "worker 2"


def test_a_notice_is_bounded_and_its_lines_made_to_fit():
    with pytest.raises(LocalProtocolError, match="notice of 0 lines; 1 to 12 allowed"):
        m.Notice([])
    with pytest.raises(LocalProtocolError, match="notice of 13 lines"):
        m.Notice(["x"] * 13)
    with pytest.raises(LocalProtocolError, match="notice line is not text of at most 1280 characters"):
        m.Notice(["x" * 1281])
    with pytest.raises(RemoteProtocolError, match="notice line is not text"):
        m.parse({"t": "notice", "lines": ["ok", 3]})
    lines = m.notice_lines(["a" * 5000, "b"] + ["c"] * 20)
    assert len(lines) == 12 and lines[0] == "a" * 1277 + "..." and lines[1:] == ["b"] + ["c"] * 10
    encoded = m.to_header(m.Notice(m.notice_lines(["\U0001f600" * 5000] * 20)))
    assert len(msgpack.packb(encoded, use_bin_type=True)) < DEFAULT_MAX_HEADER_BYTES  # always one frame


def test_only_an_asynchronous_push_names_a_job_and_a_jobs_name_is_bounded():
    assert m.parse(header("push", kind=m.KIND_ASYNC, job="job-7")).job == "job-7"
    with pytest.raises(ProtocolError, match="sum push of 'layer1.weight' names job 'job-7'; only an asynchronous"):
        m.parse(header("push", job="job-7"))
    with pytest.raises(ProtocolError, match=f"at most {m.MAX_JOB_CHARS} characters"):
        m.parse(header("push", kind=m.KIND_ASYNC, job="j" * (m.MAX_JOB_CHARS + 1)))
    assert m.parse(header("hello", job="j" * m.MAX_JOB_CHARS)).job == "j" * m.MAX_JOB_CHARS
    with pytest.raises(ProtocolError, match="hello: job of 129 characters; at most 128"):
        m.parse(header("hello", job="j" * (m.MAX_JOB_CHARS + 1)))


def test_a_workers_job_and_its_age_are_checked():
    assert m.parse(header("joined", job="job-7")).job == "job-7"
    with pytest.raises(ProtocolError, match="joined job of 129 characters; at most 128"):
        m.parse(header("joined", job="j" * (m.MAX_JOB_CHARS + 1)))
    assert m.parse(header("hello", job="job-7", job_age_s=12.5)).job_age_s == 12.5
    for bad in (-1.0, float("inf"), float("nan")):
        for t in ("hello", "joined"):
            with pytest.raises(ProtocolError, match="job_age_s must be finite and >= 0"):
                m.parse(header(t, job_age_s=bad))
