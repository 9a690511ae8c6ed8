"""ServerConnection and shared memory, through a fake transport (issue 14, items 2 and 3): a push may name only
segments its connection announced, and a segment truncated under the server fails that one push (with the
tensor, the segment and both sizes), never the connection; the sum is not written into a shrunk segment."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import numpy as np
import pytest

from bps_runtime.segments import create_segment, release, segment_name
from bps_server.connection import ServerConnection
from protocol import PROTOCOL_VERSION
from protocol.frames import encode_message
from protocol.messages import ROLE_WORKER, Announce, Failure, Hello, Push, Result, Welcome

from fake_transport import FakeTransport
from test_server_connection import _connect, _feed, _server

NBYTES = 4096


@pytest.fixture
def segments():
    made = [create_segment(segment_name(0), NBYTES) for _ in range(3)]
    made[0].buf[:32] = bytes(range(32))  # the probe
    yield made
    for seg in made:
        release(seg, unlink=True)  # (the server's attach, in this process, leaves the tracker alone)


def _shm_worker(server, probe) -> tuple[ServerConnection, FakeTransport]:
    conn, t = _connect(server)
    _feed(conn, encode_message(Hello(PROTOCOL_VERSION, ROLE_WORKER, 0, shm=probe.name,
                                     shm_key=bytes(range(32)).hex())))
    welcome = t.messages()[-1][0]
    assert isinstance(welcome, Welcome) and welcome.shm
    return conn, t


def _announced(segments):
    """A server, and worker 0's shared-memory connection that announced the data and result segments."""
    server = _server(workers=1)
    probe, data, out = segments
    conn, t = _shm_worker(server, probe)
    _feed(conn, encode_message(Announce([data.name, out.name])))
    return server, conn, t


async def _answer(t: FakeTransport):
    """The last answer to a push (replies leave in a batch at the end of the loop iteration)."""
    for _ in range(200):
        answers = [m for m, _ in t.messages() if isinstance(m, (Failure, Result))]
        if answers:
            return answers[-1]
        await asyncio.sleep(0.01)
    raise AssertionError(f"no answer: {t.messages()}")


def _push(data, out) -> Push:
    return Push(req=1, name="w", part=0, round=0, worker=0, dtype="float32", shape=[NBYTES // 4], offset=0,
                count=NBYTES // 4, segment=data.name, out_segment=out.name)


@pytest.mark.timeout(30)
async def test_a_push_naming_an_unannounced_segment_fails_alone(segments):
    server = _server(workers=1)
    probe, data, out = segments
    conn, t = _shm_worker(server, probe)
    _feed(conn, encode_message(_push(data, out)))
    failure = await _answer(t)
    assert isinstance(failure, Failure) and failure.req == 1 and not t.closed
    assert data.name in failure.message and "did not announce" in failure.message
    assert data.name not in conn.segments  # never mapped
    np.frombuffer(data.buf, np.float32)[:] = 2.0
    _feed(conn, encode_message(Announce([data.name, out.name])))
    _feed(conn, encode_message(_push(data, out)))
    for _ in range(200):
        if any(isinstance(m, Result) for m, _ in t.messages()):
            break
        await asyncio.sleep(0.01)
    assert any(isinstance(m, Result) and m.inplace for m, _ in t.messages()), t.messages()
    assert np.frombuffer(out.buf, np.float32).tolist() == [2.0] * (NBYTES // 4)
    await server.stop()


@pytest.mark.timeout(30)
async def test_an_announce_of_another_workers_segment_is_a_protocol_error(segments):
    server = _server(workers=2)
    probe = segments[0]
    conn, t = _shm_worker(server, probe)
    _feed(conn, encode_message(Announce([segment_name(1)])))
    failure = t.messages()[-1][0]
    assert isinstance(failure, Failure) and failure.code == "protocol_error" and t.closed
    await server.stop()


@pytest.mark.timeout(30)
async def test_a_truncated_segment_fails_its_push_and_the_connection_stays(segments):
    server, conn, t = _announced(segments)
    _, data, out = segments
    assert conn.push_data(_push(data, out), None) is not None  # mapped, as for a first round
    os.truncate(f"/dev/shm/{data.name}", 0)  # as a training process could, under the server
    await asyncio.sleep(0)  # (a size is read once per pass of the loop: segments.check_size)
    assert conn.push_data(_push(data, out), None) is None  # reading it now would be a SIGBUS
    failure = await _answer(t)
    assert isinstance(failure, Failure) and failure.req == 1 and not t.closed
    assert f"{data.name!r} of tensor 'w' has 0 bytes now; {NBYTES} bytes are needed" in failure.message
    await server.stop()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("which", ["data", "out"])
async def test_a_sparse_segment_fails_its_push_and_the_connection_stays(segments, which):
    """A segment with holes (grown with ftruncate: a review's reproducer announced segments made that way) is
    memory no page backs yet: where /dev/shm is full, the server's first touch of one was a SIGBUS that killed
    it. It fails the push alone, naming what is backed, before anything reads or writes it."""
    server, conn, t = _announced(segments)
    _, data, out = segments
    os.truncate(f"/dev/shm/{(data if which == 'data' else out).name}", 4 * NBYTES)  # the last 3/4 are a hole
    assert conn.push_data(_push(data, out), None) is None
    failure = await _answer(t)
    assert isinstance(failure, Failure) and failure.req == 1 and not t.closed
    sparse = (data if which == "data" else out).name
    assert f"{sparse!r} of tensor 'w' has only {NBYTES} of its {4 * NBYTES} bytes in memory" in failure.message
    assert "sparse" in failure.message
    await server.stop()


@pytest.mark.timeout(30)
async def test_no_sum_is_written_into_a_result_segment_that_shrank(segments):
    server, conn, t = _announced(segments)
    _, data, out = segments
    push = _push(data, out)
    assert conn.push_data(push, None) is not None  # both mapped and checked
    os.truncate(f"/dev/shm/{out.name}", 0)
    await asyncio.sleep(0)  # (a size is read once per pass of the loop: segments.check_size)
    conn.reply(push, np.ones(NBYTES // 4, np.float32))  # would be a SIGBUS in np.copyto without the check
    failure = await _answer(t)
    assert isinstance(failure, Failure) and failure.req == 1 and "has 0 bytes now" in failure.message
    assert not t.closed
    await server.stop()


def _two_workers(segments):
    """A two-worker server: worker 0 on shared memory (data and result segments announced), worker 1 on TCP."""
    server = _server(workers=2)
    probe, data, out = segments
    conn0, t0 = _shm_worker(server, probe)
    _feed(conn0, encode_message(Announce([data.name, out.name])))
    conn1, t1 = _connect(server)
    _feed(conn1, encode_message(Hello(PROTOCOL_VERSION, ROLE_WORKER, 1)))
    assert isinstance(t1.messages()[-1][0], Welcome)
    return server, (conn0, t0), (conn1, t1)


def _tcp_push(dtype: str, round_: int, value: float) -> tuple[Push, bytes]:
    count = NBYTES // np.dtype(dtype).itemsize
    push = Push(req=2 + round_, name="w", part=0, round=round_, worker=1, dtype=dtype, shape=[count], offset=0,
                count=count)
    return push, np.full(count, value, dtype).tobytes()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", ["float32", "float16"])  # an accumulator's first view; a one-pass sum's input
async def test_a_held_borrowed_push_whose_segment_shrank_fails_the_round_not_the_server(segments, dtype):
    """Worker 0's push is a view of its memory, held (not copied) until worker 1 pushes; the segment is
    truncated in that wait. Before, the sum read the view: a SIGBUS of the server. Now the round fails for
    both workers, naming the segment, whose it is (a peer's daemon that died took its segments with it: the
    other worker's processes heard of a segment, not of a worker) and both sizes, and the next round is summed."""
    server, (conn0, t0), (conn1, t1) = _two_workers(segments)
    _, data, out = segments
    count = NBYTES // np.dtype(dtype).itemsize
    data.buf[:NBYTES] = np.full(count, 2.0, dtype).tobytes()
    push0 = dataclasses.replace(_push(data, out), dtype=dtype, shape=[count], count=count)
    _feed(conn0, encode_message(push0))
    await asyncio.sleep(0.05)  # the push is in, held as a view of the worker's memory
    assert not [m for m, _ in t0.messages() if isinstance(m, (Failure, Result))]
    os.truncate(f"/dev/shm/{data.name}", 0)
    push1, payload = _tcp_push(dtype, 0, 3.0)
    _feed(conn1, encode_message(push1, len(payload)) + payload)
    for t, req in ((t0, 1), (t1, push1.req)):
        failure = await _answer(t)
        assert isinstance(failure, Failure) and failure.req == req, failure
        assert f"worker 0's shared memory {data.name!r} of tensor 'w' has 0 bytes now; {NBYTES} bytes are needed" \
            in failure.message
        assert not t.closed
    assert server.aggregator.counters.rounds_failed == 1
    # the server keeps serving: round 1, both on TCP now (worker 0's segment is gone)
    t0.data.clear(), t1.data.clear()
    push0b, payload0 = _tcp_push(dtype, 1, 2.0)
    _feed(conn0, encode_message(dataclasses.replace(push0b, worker=0, req=10), len(payload0)) + payload0)
    push1b, payload1 = _tcp_push(dtype, 1, 3.0)
    _feed(conn1, encode_message(push1b, len(payload1)) + payload1)
    for t in (t0, t1):
        result = await _answer(t)
        assert isinstance(result, Result), result
    assert [np.frombuffer(p, dtype).tolist() for m, p in t1.messages() if isinstance(m, Result)] == [[5.0] * count]
    await server.stop()


@pytest.mark.timeout(30)
async def test_a_push_by_reference_larger_than_max_payload_bytes_is_a_protocol_error():
    """Over TCP the frame reader refuses a payload over cluster.max_payload_bytes; a push by shared-memory
    reference was checked only against its segment (a sparse file can be any size), and the server allocated
    its sum: 2 GiB a push in a review. (At the least max_payload_bytes, 64 KiB, segments of twice that.)"""
    from protocol.config import parse_config
    from bps_server.server import ServerConfig, SummationServer

    cluster = parse_config({"cluster": {"workers": 1, "partition_bytes": 2048, "max_payload_bytes": 1 << 16},
                            "server": [{"id": 0, "address": "127.0.0.1:9"}],
                            "worker": [{"id": 0, "local_size": 1, "socket": "/tmp/none0"}]})
    server = SummationServer(ServerConfig(cluster, 0, threads=1))
    probe, data, out = made = [create_segment(segment_name(0), 1 << 17) for _ in range(3)]
    try:
        probe.buf[:32] = bytes(range(32))
        conn, t = _shm_worker(server, probe)
        _feed(conn, encode_message(Announce([data.name, out.name])))
        push = Push(req=1, name="w", part=0, round=0, worker=0, dtype="float32", shape=[1 << 15], offset=0,
                    count=1 << 15, segment=data.name, out_segment=out.name)
        _feed(conn, encode_message(push))  # 131072 bytes, within both segments
        failure = t.messages()[-1][0]
        assert isinstance(failure, Failure) and failure.code == "protocol_error" and t.closed, t.messages()
        assert "131072 bytes, more than cluster.max_payload_bytes" in failure.message
    finally:
        await server.stop()
        for seg in made:
            release(seg, unlink=True)
