"""protocol.frames: encode_header, the message encoder, the batch writer and FrameReader (pure, no sockets)."""

from __future__ import annotations

import random
import struct

import msgpack
import numpy as np
import pytest

from protocol import messages as m
from protocol.errors import LocalProtocolError, ProtocolError
from protocol.frames import (
    BATCH_ITEM_MAX_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    DIRECT_RECEIVE_MIN_BYTES,
    HEADER_PEEK_BYTES,
    PREFIX,
    RECEIVE_BUFFER_BYTES,
    BatchWriter,
    FrameReader,
    decode_header,
    encode_frame,
    encode_header,
    encode_message,
)


def frame_bytes(header: dict, payload: bytes = b"", **limits) -> bytes:
    return encode_header(header, len(payload), **limits) + payload


def raw_frame(body: bytes, payload: bytes = b"", *, payload_len: int | None = None) -> bytes:
    """A frame with an arbitrary (possibly invalid) header body."""
    plen = len(payload) if payload_len is None else payload_len
    return PREFIX.pack(len(body), plen) + body + payload


def payload_bytes(frame) -> bytes | None:
    return None if frame.payload is None else bytes(frame.payload)


def feed_bufferedprotocol(reader: FrameReader, data: bytes, max_chunk: int) -> tuple[list, list[int]]:
    """Deliver ``data`` the way asyncio.BufferedProtocol does: get_buffer, write, buffer_updated.

    Returns the frames and the length of every buffer the reader handed out.
    """
    frames, sizes = [], []
    pos = 0
    while pos < len(data):
        buf = reader.get_buffer(-1)
        sizes.append(len(buf))
        assert len(buf) > 0
        n = min(len(buf), max_chunk, len(data) - pos)
        buf[:n] = data[pos:pos + n]
        pos += n
        frames.extend(reader.buffer_updated(n))
    return frames, sizes


# -- constants & encode_header ------------------------------------------------------------

def test_prefix_layout_is_network_order_u32_u64():
    assert PREFIX.size == 12
    data = encode_header({"t": "x"}, 0x0102030405, max_payload_bytes=1 << 40)
    header_len, payload_len = struct.unpack("!IQ", data[:12])
    assert payload_len == 0x0102030405
    assert header_len == len(data) - 12
    assert msgpack.unpackb(data[12:], raw=False) == {"t": "x"}
    assert data[:4] == struct.pack(">I", header_len)


def test_encode_header_rejects_oversize_header():
    big = {"t": "x", "pad": "a" * 200}
    size = len(msgpack.packb(big, use_bin_type=True))
    encode_header(big, max_header_bytes=size)  # exactly at the limit is fine
    with pytest.raises(LocalProtocolError, match=rf"{size} bytes exceeds the limit of {size - 1}"):
        encode_header(big, max_header_bytes=size - 1)


def test_encode_header_default_header_limit():
    with pytest.raises(LocalProtocolError, match="header"):
        encode_header({"t": "x", "pad": "a" * DEFAULT_MAX_HEADER_BYTES})


def test_encode_header_rejects_oversize_and_negative_payload():
    assert len(encode_header({"t": "x"}, 100, max_payload_bytes=100)) > 12
    with pytest.raises(LocalProtocolError, match="payload of 101 bytes exceeds the limit of 100"):
        encode_header({"t": "x"}, 101, max_payload_bytes=100)
    with pytest.raises(LocalProtocolError, match="payload"):
        encode_header({"t": "x"}, DEFAULT_MAX_PAYLOAD_BYTES + 1)
    with pytest.raises(LocalProtocolError):
        encode_header({"t": "x"}, -1)


# -- round trips ------------------------------------------------------------------------------

def test_header_only_round_trip():
    header = {"t": "hello", "version": 1, "role": "worker", "id": 3, "shape": [2, 3], "f": 1.5,
              "b": b"\x00\xff", "nested": {"a": [1, {"b": None}]}}
    reader = FrameReader()
    frames = reader.receive_data(frame_bytes(header))
    assert len(frames) == 1
    assert frames[0].header == header
    assert frames[0].payload is None
    assert not reader.payload_pending


def test_header_and_payload_round_trip():
    payload = bytes(range(256)) * 7
    reader = FrameReader()
    frames = reader.receive_data(frame_bytes({"t": "push", "req": 9}, payload))
    assert [f.header for f in frames] == [{"t": "push", "req": 9}]
    assert isinstance(frames[0].payload, memoryview)
    assert payload_bytes(frames[0]) == payload
    assert not reader.payload_pending


def _sample_stream(rng: random.Random, count: int) -> tuple[bytes, list[tuple[dict, bytes | None]]]:
    expected, parts = [], []
    for i in range(count):
        header = {"t": f"m{i % 5}", "i": i, "s": "x" * rng.randrange(0, 50)}
        kind = rng.randrange(4)
        if kind == 0:
            payload = b""
        elif kind == 3:
            payload = rng.randbytes(rng.randrange(DIRECT_RECEIVE_MIN_BYTES, 3 * DIRECT_RECEIVE_MIN_BYTES))
        else:
            payload = rng.randbytes(rng.randrange(1, 300))
        parts.append(frame_bytes(header, payload))
        expected.append((header, payload or None))
    return b"".join(parts), expected


def test_many_frames_in_one_chunk():
    rng = random.Random(1)
    data, expected = _sample_stream(rng, 60)
    frames = FrameReader().receive_data(data)
    assert [(f.header, payload_bytes(f)) for f in frames] == expected


def test_frames_fed_one_byte_at_a_time():
    rng = random.Random(2)
    data, expected = b"", []  # small payloads only: keep the byte-by-byte loop short
    for i in range(15):
        header = {"t": "m", "i": i}
        payload = rng.randbytes(rng.choice([0, 1, 7, 100]))
        data += frame_bytes(header, payload)
        expected.append((header, payload or None))
    reader = FrameReader()
    frames = []
    counts = []
    for b in data:
        got = reader.receive_data(bytes([b]))
        counts.append(len(got))
        frames.extend(got)
    assert [(f.header, payload_bytes(f)) for f in frames] == expected
    assert max(counts) == 1  # a frame completes exactly on its last byte
    assert not reader.payload_pending


def test_payload_pending_tracks_partial_frames():
    data = frame_bytes({"t": "x"}, b"abcdef")
    reader = FrameReader()
    assert not reader.payload_pending
    assert reader.receive_data(data[:5]) == []
    assert reader.payload_pending  # part of the prefix
    assert reader.receive_data(data[5:-2]) == []
    assert reader.payload_pending  # header parsed, payload incomplete
    frames = reader.receive_data(data[-2:])
    assert payload_bytes(frames[0]) == b"abcdef"
    assert not reader.payload_pending


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_random_chunk_sizes(seed):
    rng = random.Random(seed)
    data, expected = _sample_stream(rng, 80)
    reader = FrameReader()
    frames = []
    pos = 0
    while pos < len(data):
        n = rng.choice([1, 2, 11, 12, 13, rng.randrange(1, 5000), rng.randrange(1, 70000)])
        frames.extend(reader.receive_data(data[pos:pos + n]))
        pos += n
    assert [(f.header, payload_bytes(f)) for f in frames] == expected


@pytest.mark.parametrize("seed", [6, 7])
def test_random_chunks_via_get_buffer(seed):
    rng = random.Random(seed)
    data, expected = _sample_stream(rng, 80)
    reader = FrameReader()
    frames, pos = [], 0
    while pos < len(data):
        buf = reader.get_buffer()
        n = min(len(buf), len(data) - pos, rng.randrange(1, 40000))
        buf[:n] = data[pos:pos + n]
        pos += n
        frames.extend(reader.buffer_updated(n))
    assert [(f.header, payload_bytes(f)) for f in frames] == expected


def test_payloads_stay_valid_after_more_data():
    """A returned payload must not alias the reader's receive buffer."""
    reader = FrameReader()
    first = reader.receive_data(frame_bytes({"t": "a"}, b"A" * 100) + frame_bytes({"t": "b"}, b"B" * 50))
    for _ in range(20):
        reader.receive_data(frame_bytes({"t": "c"}, b"Z" * 1000))
    assert payload_bytes(first[0]) == b"A" * 100
    assert payload_bytes(first[1]) == b"B" * 50


def test_large_payload_received_directly_like_buffered_protocol():
    rng = random.Random(8)
    big = rng.randbytes(3 * 1024 * 1024 + 17)
    data = (frame_bytes({"t": "small", "i": 0}, b"xyz")
            + frame_bytes({"t": "big", "i": 1}, big)
            + frame_bytes({"t": "after", "i": 2}))
    reader = FrameReader()
    frames, sizes = feed_bufferedprotocol(reader, data, max_chunk=1 << 30)
    assert [f.header["t"] for f in frames] == ["small", "big", "after"]
    assert payload_bytes(frames[0]) == b"xyz"
    assert payload_bytes(frames[1]) == big
    assert frames[2].payload is None
    # The payload's remainder was handed out as one buffer, larger than the receive buffer.
    assert max(sizes) > RECEIVE_BUFFER_BYTES
    assert not reader.payload_pending


def test_large_payload_in_socket_sized_chunks():
    rng = random.Random(9)
    big = rng.randbytes((1 << 20) + 12345)
    data = frame_bytes({"t": "big"}, big) + frame_bytes({"t": "tail"}, b"t")
    reader = FrameReader()
    frames, _ = feed_bufferedprotocol(reader, data, max_chunk=65536)
    assert [f.header["t"] for f in frames] == ["big", "tail"]
    assert payload_bytes(frames[0]) == big
    assert payload_bytes(frames[1]) == b"t"


def test_payload_sink_destination_filled_in_place():
    n = (1 << 20) // 4 + 3
    src = np.arange(n, dtype=np.float32) * 0.5
    dest = np.zeros((n,), dtype=np.float32)
    calls = []

    def sink(header, nbytes):
        calls.append((header, nbytes))
        return memoryview(dest)

    reader = FrameReader(payload_sink=sink)
    data = frame_bytes({"t": "result", "part": 4}, src.tobytes()) + frame_bytes({"t": "next"})
    frames, sizes = feed_bufferedprotocol(reader, data, max_chunk=100_000)
    assert calls == [({"t": "result", "part": 4}, src.nbytes)]
    assert [f.header["t"] for f in frames] == ["result", "next"]
    np.testing.assert_array_equal(dest, src)
    payload = frames[0].payload
    assert payload.nbytes == src.nbytes
    assert np.shares_memory(np.frombuffer(payload, dtype=np.uint8), dest)
    # Direct receive: a buffer the reader handed out *was* part of dest.
    assert max(sizes) > RECEIVE_BUFFER_BYTES


def _pieces_into_sinks(reader_header_bytes: int = 0) -> tuple[FrameReader, bytes, list[np.ndarray], list[bytes]]:
    """Four 512 KiB pieces, each with a sink of its own, back to back, then a run of small frames."""
    rng = random.Random(31)
    dests = [np.zeros(1 << 19, dtype=np.uint8) for _ in range(4)]
    payloads = [rng.randbytes(1 << 19) for _ in dests]
    pad = "h" * reader_header_bytes
    data = b"".join(frame_bytes({"t": "result", "i": i, "pad": pad}, p) for i, p in enumerate(payloads))
    data += b"".join(frame_bytes({"t": "small", "i": i}, b"s" * 100) for i in range(50))
    reader = FrameReader(payload_sink=lambda header, nbytes: memoryview(dests[header["i"]])
                         if header["t"] == "result" else memoryview(bytearray(nbytes)))
    return reader, data, dests, payloads


def test_after_a_payload_received_in_place_only_a_header_s_worth_is_read_into_the_buffer():
    """The read after a large payload asks for HEADER_PEEK_BYTES, so at most that much of the next payload
    goes through the receive buffer (and is copied); the rest is received in place. Every byte is right."""
    reader, data, dests, payloads = _pieces_into_sinks()
    handed: list[tuple[int, bool]] = []  # (length, inside a destination) of every buffer handed out
    pos, frames = 0, []
    while pos < len(data):
        buf = reader.get_buffer(-1)
        inside = any(np.shares_memory(np.frombuffer(buf, dtype=np.uint8), d) for d in dests)
        handed.append((len(buf), inside))
        n = min(len(buf), len(data) - pos)  # a socket with everything already in
        buf[:n] = data[pos:pos + n]
        pos += n
        frames.extend(reader.buffer_updated(n))
        if inside:  # a read that fills its buffer is followed by another, which may find nothing yet (EAGAIN:
            reader.get_buffer(-1)  # no buffer_updated); the peek still holds for the read that brings bytes
    assert [f.header["t"] for f in frames] == ["result"] * 4 + ["small"] * 50
    for dest, payload in zip(dests, payloads):
        assert dest.tobytes() == payload
    assert all(f.payload.tobytes() == b"s" * 100 for f in frames[4:])
    # The first read takes the whole buffer (no payload came yet); after each piece, a peek; then in place.
    assert handed[0] == (RECEIVE_BUFFER_BYTES, False)
    kinds = [("dest" if inside else "peek" if n == HEADER_PEEK_BYTES else n) for n, inside in handed[1:]]
    assert kinds[:7] == ["dest", "peek", "dest", "peek", "dest", "peek", "dest"]
    # After the last piece's peek, the small frames get the rest of the buffer (not a read per 4 KiB).
    assert kinds[7] == "peek" and kinds[8] == RECEIVE_BUFFER_BYTES - HEADER_PEEK_BYTES and len(kinds) == 9
    copied = sum(n for n, inside in handed[1:] if not inside)
    assert copied <= 4 * HEADER_PEEK_BYTES + RECEIVE_BUFFER_BYTES


def test_the_tail_of_a_large_payload_is_read_with_a_peek_s_worth_more_not_the_whole_buffer():
    """A payload's last bytes, too few to be received in place, are read into the buffer: that read asks for
    them and HEADER_PEEK_BYTES more, so the next payload is again received in place, not copied."""
    reader, data, dests, payloads = _pieces_into_sinks()
    handed: list[tuple[int, bool]] = []
    pos, frames, cut = 0, [], set()
    while pos < len(data):
        buf = reader.get_buffer(-1)
        dest = next((i for i, d in enumerate(dests) if np.shares_memory(np.frombuffer(buf, np.uint8), d)), None)
        handed.append((len(buf), dest is not None))
        n = min(len(buf), len(data) - pos)
        if dest is not None and dest not in cut:  # the socket has all but 1,000 bytes of the payload yet
            cut.add(dest)
            n -= 1000
        buf[:n] = data[pos:pos + n]
        pos += n
        frames.extend(reader.buffer_updated(n))
    assert [f.header["t"] for f in frames] == ["result"] * 4 + ["small"] * 50
    for dest, payload in zip(dests, payloads):
        assert dest.tobytes() == payload
    tails = [n for n, inside in handed if not inside and n == 1000 + HEADER_PEEK_BYTES]
    assert len(tails) == 4
    copied = sum(n for n, inside in handed[1:] if not inside)
    assert copied <= 4 * (1000 + HEADER_PEEK_BYTES) + RECEIVE_BUFFER_BYTES


def test_peeks_go_on_while_they_come_back_short():
    """A small frame alone on the socket after a large payload (a short peek) leaves the reader peeking, so
    the large payload after it is received in place too; a full peek hands out the whole buffer next."""
    dest = np.zeros(1 << 19, dtype=np.uint8)
    big = random.Random(5).randbytes(dest.nbytes)
    reader = FrameReader(payload_sink=lambda header, nbytes: memoryview(dest) if header["t"] == "result"
                         else memoryview(bytearray(nbytes)))
    for chunk in (frame_bytes({"t": "result"}, big), frame_bytes({"t": "pong"}), frame_bytes({"t": "result"}, big)):
        sizes = []
        while chunk:  # each chunk is all the socket holds when it is read
            buf = reader.get_buffer(-1)
            sizes.append(len(buf))
            n = min(len(buf), len(chunk))
            buf[:n], chunk = chunk[:n], chunk[n:]
            reader.buffer_updated(n)
    assert dest.tobytes() == big
    assert sizes[0] == HEADER_PEEK_BYTES  # the second result's header still came by a peek
    assert reader.get_buffer(-1).nbytes == HEADER_PEEK_BYTES
    reader.receive_data(b"".join(frame_bytes({"t": "pong", "i": i}) for i in range(400)))  # full: a run of frames
    assert reader.get_buffer(-1).nbytes > HEADER_PEEK_BYTES


def test_a_header_longer_than_the_peek_is_read_whole_after_it():
    reader, data, dests, payloads = _pieces_into_sinks(reader_header_bytes=3 * HEADER_PEEK_BYTES)
    frames, sizes = feed_bufferedprotocol(reader, data, max_chunk=1 << 30)
    assert [f.header["t"] for f in frames] == ["result"] * 4 + ["small"] * 50
    assert all(len(f.header["pad"]) == 3 * HEADER_PEEK_BYTES for f in frames[:4])
    for dest, payload in zip(dests, payloads):
        assert dest.tobytes() == payload
    assert HEADER_PEEK_BYTES in sizes  # the peek happened, and the header's rest came in the next read


def test_payload_sink_multidimensional_destination_small_payload():
    dest = np.zeros((2, 3), dtype=np.int64)
    src = np.arange(6, dtype=np.int64).reshape(2, 3) + 40
    reader = FrameReader(payload_sink=lambda h, n: memoryview(dest))
    frames = reader.receive_data(frame_bytes({"t": "r"}, src.tobytes()))
    np.testing.assert_array_equal(dest, src)
    assert frames[0].payload.format == "B" and frames[0].payload.ndim == 1
    assert bytes(frames[0].payload) == src.tobytes()
    assert np.shares_memory(np.frombuffer(frames[0].payload, dtype=np.uint8), dest)


def test_payload_sink_not_called_for_empty_payload():
    calls = []
    reader = FrameReader(payload_sink=lambda h, n: calls.append(n) or memoryview(bytearray(n)))
    frames = reader.receive_data(frame_bytes({"t": "x"}))
    assert frames[0].payload is None and calls == []


@pytest.mark.parametrize("bad_dest", [
    lambda n: memoryview(bytearray(n + 1)),  # wrong size
    lambda n: memoryview(bytes(n)),  # read-only
    lambda n: bytearray(n),  # not a memoryview
])
def test_payload_sink_wrong_destination_is_protocol_error(bad_dest):
    reader = FrameReader(payload_sink=lambda h, n: bad_dest(n))
    with pytest.raises(ProtocolError, match="payload sink"):
        reader.receive_data(frame_bytes({"t": "x"}, b"12345678"))
    with pytest.raises(ProtocolError, match="unusable"):
        reader.receive_data(frame_bytes({"t": "x"}))


def test_payload_sink_exception_becomes_protocol_error():
    def sink(header, nbytes):
        raise KeyError("no such tensor")

    reader = FrameReader(payload_sink=sink)
    with pytest.raises(ProtocolError, match="no destination for a payload of 8 bytes"):
        reader.receive_data(frame_bytes({"t": "x"}, b"12345678"))
    with pytest.raises(ProtocolError):
        reader.get_buffer()


def test_payload_sink_protocol_error_passes_through():
    def sink(header, nbytes):
        raise ProtocolError("unknown partition 7")

    reader = FrameReader(payload_sink=sink)
    with pytest.raises(ProtocolError, match="unknown partition 7"):
        reader.receive_data(frame_bytes({"t": "x"}, b"1"))


# -- limits -----------------------------------------------------------------------------------

def test_header_limit_is_exact_on_reader():
    header = {"t": "x", "pad": "p" * 100}
    size = len(msgpack.packb(header, use_bin_type=True))
    ok = FrameReader(max_header_bytes=size)
    assert ok.receive_data(frame_bytes(header))[0].header == header
    bad = FrameReader(max_header_bytes=size - 1)
    with pytest.raises(ProtocolError, match=rf"header of {size} bytes exceeds the limit of {size - 1}"):
        bad.receive_data(frame_bytes(header))


def test_header_over_limit_raises_on_prefix_alone():
    reader = FrameReader(max_header_bytes=1000)
    assert reader.receive_data(PREFIX.pack(1001, 0)[:11]) == []  # 11 bytes: not yet known
    with pytest.raises(ProtocolError, match="header of 1001 bytes"):
        reader.receive_data(PREFIX.pack(1001, 0)[11:])  # the 12th byte completes the prefix


def test_huge_declared_header_raises_on_prefix_with_default_limit():
    reader = FrameReader()
    with pytest.raises(ProtocolError, match=f"limit of {DEFAULT_MAX_HEADER_BYTES}"):
        reader.receive_data(PREFIX.pack(0xFFFFFFFF, 0))


def test_payload_over_limit_raises_on_prefix_alone():
    reader = FrameReader(max_payload_bytes=4096)
    prefix = PREFIX.pack(10, 4097)
    for b in prefix[:-1]:
        assert reader.receive_data(bytes([b])) == []
    with pytest.raises(ProtocolError, match="payload of 4097 bytes exceeds the limit of 4096"):
        reader.receive_data(prefix[-1:])


def test_payload_at_limit_is_accepted():
    reader = FrameReader(max_payload_bytes=16)
    frames = reader.receive_data(frame_bytes({"t": "x"}, b"0123456789abcdef"))
    assert payload_bytes(frames[0]) == b"0123456789abcdef"


def test_zero_payload_limit_rejects_any_payload():
    reader = FrameReader(max_payload_bytes=0)
    assert reader.receive_data(frame_bytes({"t": "ok"}))[0].header == {"t": "ok"}
    with pytest.raises(ProtocolError, match="payload of 1 bytes"):
        reader.receive_data(PREFIX.pack(5, 1))


def test_huge_payload_rejected_before_allocation_with_default_limit():
    reader = FrameReader()
    with pytest.raises(ProtocolError, match="payload"):
        reader.receive_data(PREFIX.pack(8, (1 << 64) - 1))


def test_limit_violation_after_valid_frames_in_same_chunk():
    reader = FrameReader(max_payload_bytes=10)
    data = frame_bytes({"t": "a"}, b"1") + PREFIX.pack(3, 11)
    with pytest.raises(ProtocolError):
        reader.receive_data(data)
    with pytest.raises(ProtocolError, match="unusable"):
        reader.get_buffer()


# -- malformed headers ------------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    b"",  # empty header
    b"\xc1",  # never-used msgpack byte
    b"\x92\x01",  # truncated array
    b"\x81\xa1t\xa1x\x00",  # valid map followed by extra bytes
    msgpack.packb([1, 2, 3]),  # not a map
    msgpack.packb("t"),
    msgpack.packb(None),
    msgpack.packb({"x": 1}),  # no t
    msgpack.packb({"t": 1}),  # t not a string
    msgpack.packb({"t": b"push"}, use_bin_type=True),  # t is bytes, not str
    msgpack.packb({"t": None}),
    msgpack.packb({1: "x", "t": "y"}),  # non-string key
    b"\xff" * 20,
])
def test_malformed_header_is_protocol_error(body):
    with pytest.raises(ProtocolError):
        decode_header(body)
    reader = FrameReader()
    with pytest.raises(ProtocolError):
        reader.receive_data(raw_frame(body))
    # and the reader stays broken
    with pytest.raises(ProtocolError, match="unusable after an earlier error"):
        reader.receive_data(frame_bytes({"t": "fine"}))
    with pytest.raises(ProtocolError):
        reader.get_buffer()
    with pytest.raises(ProtocolError):
        reader.buffer_updated(0)


def test_decode_header_error_messages():
    with pytest.raises(ProtocolError, match="not a map with a string field 't'"):
        decode_header(msgpack.packb({"t": 5}))
    with pytest.raises(ProtocolError, match="undecodable frame header"):
        decode_header(b"\xc1")
    assert decode_header(msgpack.packb({"t": "ok", "n": [1]})) == {"t": "ok", "n": [1]}


def test_error_after_good_frames_in_one_chunk_state():
    """Frames before the bad one are lost with the exception; the reader then refuses use."""
    reader = FrameReader()
    with pytest.raises(ProtocolError):
        reader.receive_data(frame_bytes({"t": "ok"}) + raw_frame(msgpack.packb([1])))
    with pytest.raises(ProtocolError, match="unusable"):
        reader.receive_data(frame_bytes({"t": "ok"}))


# -- fuzz -------------------------------------------------------------------------------------

def _fuzz_input(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:  # pure noise
        return rng.randbytes(rng.randrange(0, 200))
    if kind == 1:  # plausible prefix, random header body
        body = rng.randbytes(rng.randrange(0, 60))
        return PREFIX.pack(len(body), rng.choice([0, 0, 1, 5, 100])) + body + rng.randbytes(rng.randrange(0, 120))
    if kind == 2:  # plausible lengths, body that may be cut short or over-long
        return PREFIX.pack(rng.randrange(0, 300), rng.randrange(0, 3000)) + rng.randbytes(rng.randrange(0, 400))
    if kind == 3:  # valid frames with bit flips
        data = bytearray(frame_bytes({"t": "push", "req": rng.randrange(100), "shape": [1, 2]},
                                     rng.randbytes(rng.randrange(0, 50))) * rng.randrange(1, 4))
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 4:  # valid msgpack of random shape as header
        obj = rng.choice([[], {}, {"t": 1}, {"t": "a"}, {"t": "a", 1: 2}, "x", 3, 2.5, None, True,
                          {"t": ["nested"]}, {"u": "x"}, b"raw"])
        body = msgpack.packb(obj, use_bin_type=rng.random() < 0.5, strict_types=False)
        return PREFIX.pack(len(body), rng.randrange(0, 40)) + body + rng.randbytes(rng.randrange(0, 60))
    # truncated / concatenated valid frames followed by noise
    data = frame_bytes({"t": "x", "i": rng.randrange(1000)}, rng.randbytes(rng.randrange(0, 30)))
    return data[: rng.randrange(len(data) + 1)] + rng.randbytes(rng.randrange(0, 30))


def test_random_bytes_only_ever_raise_protocol_error():
    rng = random.Random(20240601)
    raised = completed = 0
    for _ in range(4000):
        data = _fuzz_input(rng)
        reader = FrameReader(max_header_bytes=256, max_payload_bytes=4096)
        try:
            pos = 0
            while pos < len(data):
                n = rng.randrange(1, 64)
                for frame in reader.receive_data(data[pos:pos + n]):
                    assert isinstance(frame.header, dict) and isinstance(frame.header["t"], str)
                    assert frame.payload is None or frame.payload.nbytes > 0
                    completed += 1
                pos += n
        except ProtocolError:
            raised += 1
            with pytest.raises(ProtocolError):
                reader.receive_data(b"\x00")
        # any other exception type propagates and fails the test
    # the generator really exercised both outcomes
    assert raised > 1000
    assert completed > 100


def test_discarding_a_pending_payload_spares_its_destination():
    dest = bytearray(64 * 1024)
    reader = FrameReader(payload_sink=lambda header, n: memoryview(dest))
    data = encode_header({"t": "result"}, len(dest)) + b"\x07" * len(dest)
    half = len(data) // 2
    reader.receive_data(data[:half])
    assert reader.pending_destination is not None
    reader.discard_pending_payload()
    frames = reader.receive_data(data[half:])
    assert len(frames) == 1 and frames[0].payload.nbytes == len(dest)  # the stream stays in step
    assert dest[: len(dest) // 3] == b"\x07" * (len(dest) // 3)  # what came before stayed
    assert dest[-(len(dest) // 3):] == bytes(len(dest) // 3)  # the rest never reached it


# -- the pure encoder and the batch writer --------------------------------------------------------------------


def _result(i: int, name: str = "t") -> m.Result:
    return m.Result(req=i, name=f"{name}{i}", part=0, round=3)


_PATTERN = bytes(range(251)) * (300_000 // 251 + 2)


def _payload(i: int, n: int) -> memoryview:
    """``n`` bytes that differ from item to item (a slice of 0, 1, ... 250 starting at ``i % 251``)."""
    return memoryview(_PATTERN)[i % 251:i % 251 + n]


def test_encode_message_is_encode_header_of_to_header():
    for msg, n in ((m.Ping(7), 0), (_result(1), 4096), (m.Failure(-1, "bye", code="protocol_error"), 0),
                   (m.Push(3, "w", 1, 2, 0, "float16", [4, 4], 8, 8), 16)):
        assert encode_message(msg, n) == encode_header(m.to_header(msg), n)
        assert encode_message(msg, n, max_payload_bytes=1 << 20) == encode_header(m.to_header(msg), n)
    with pytest.raises(LocalProtocolError, match="payload of 101 bytes exceeds the limit of 100"):
        encode_message(m.Ping(1), 101, max_payload_bytes=100)
    with pytest.raises(LocalProtocolError, match="header"):
        encode_message(m.Failure(1, "x" * 200), max_header_bytes=100)


def test_encode_frame_gives_the_buffers_the_transports_wrote():
    """links._send / server._write: the header alone, or the header and then the payload."""
    assert encode_frame(m.Ping(1)) == [encode_header(m.to_header(m.Ping(1)), 0)]
    assert encode_frame(_result(1), memoryview(b"")) == [encode_header(m.to_header(_result(1)), 0)]
    data = np.arange(6, dtype=np.float32)
    head, body = encode_frame(_result(2), data)
    assert head == encode_header(m.to_header(_result(2)), 24) and bytes(body) == data.tobytes()
    frames = FrameReader().receive_data(b"".join(encode_frame(_result(2), data)))
    assert m.parse(frames[0].header) == _result(2) and bytes(frames[0].payload) == data.tobytes()


def _legacy_batch_frame(items: list[tuple[m.Message, memoryview | None]], max_payload_bytes: int) -> bytes:
    """What links._send_batch / server._flush write for several items (as of 806b78e)."""
    if len(items) == 1:
        msg, p = items[0]
        n = 0 if p is None else p.nbytes
        return encode_header(m.to_header(msg), n, max_payload_bytes=max_payload_bytes) + (bytes(p) if n else b"")
    parts = [(msg, 0 if p is None else p.nbytes) for msg, p in items]
    payload = b"".join(bytes(p) for _, p in items if p is not None and p.nbytes)
    return encode_header(m.batch_header(parts), len(payload), max_payload_bytes=max_payload_bytes) + payload


def test_one_batch_is_byte_identical_to_batch_header_and_encode_header():
    items = [(_result(0), _payload(0, 8)), (m.Done(1), None), (_result(2), memoryview(b"")),
             (m.Failure(3, "round 3 failed", code="round_failed"), None), (_result(4), _payload(4, 100))]
    writer = BatchWriter()
    for msg, p in items:
        assert writer.fits(0 if p is None else p.nbytes)
        assert writer.add(msg, p) is False
    assert len(writer) == 5 and writer.payload_nbytes == 108
    buffers = writer.flush()
    assert b"".join(buffers) == _legacy_batch_frame(items, DEFAULT_MAX_PAYLOAD_BYTES)
    assert len(buffers) == 3  # the header, then only the payloads that have bytes, uncopied
    assert len(writer) == 0 and writer.payload_nbytes == 0 and writer.flush() == []
    batch = m.parse(FrameReader().receive_data(b"".join(buffers))[0].header)
    assert isinstance(batch, m.Batch) and batch.sizes == [8, 0, 0, 0, 100]


def test_one_item_leaves_as_a_plain_frame():
    writer = BatchWriter()
    writer.add(_result(1), _payload(1, 16))
    assert b"".join(writer.flush()) == encode_header(m.to_header(_result(1)), 16) + bytes(_payload(1, 16))
    writer.add(m.RoundInfo(2, 5))
    assert writer.flush() == [encode_header(m.to_header(m.RoundInfo(2, 5)), 0)]


def test_numpy_payloads_are_sent_as_their_bytes():
    writer = BatchWriter()
    a, b = np.arange(4, dtype=np.float64), np.array([[1, 2], [3, 4]], dtype=np.int32)
    writer.add(_result(1), a)
    writer.add(_result(2), b)
    got = b"".join(writer.flush())
    items = [(_result(1), memoryview(a.tobytes())), (_result(2), memoryview(b.tobytes()))]
    assert got == _legacy_batch_frame(items, DEFAULT_MAX_PAYLOAD_BYTES)


def test_limits_full_fits_and_batchable():
    writer = BatchWriter(max_items=3, max_payload_bytes=100, item_max_bytes=40)
    assert writer.batchable(40) and not writer.batchable(41)
    assert writer.fits(40) and not writer.fits(41)
    assert writer.add(_result(0), _payload(0, 40)) is False
    assert writer.add(_result(1), _payload(1, 40)) is False
    assert not writer.fits(21) and writer.fits(20)  # 80 + 21 > 100
    assert writer.add(_result(2), _payload(2, 20)) is True  # the third item: full
    assert writer.full and not writer.fits(0)
    writer.flush()
    budget = BatchWriter(header_budget=2 * m.estimated_header_bytes(_result(0)))
    assert budget.add(_result(0)) is False and budget.add(_result(1)) is True and not budget.fits(0)
    assert BATCH_ITEM_MAX_BYTES == 64 * 1024 and BatchWriter().max_items == m.MAX_BATCH_ITEMS
    assert BatchWriter().header_budget == m.BATCH_HEADER_BUDGET


def test_a_batch_too_large_for_the_frame_is_refused_before_anything_is_written():
    writer = BatchWriter(max_payload_bytes=10)
    writer.add(_result(0), _payload(0, 8))
    writer.add(_result(1), _payload(1, 8))  # the caller skipped fits(): the encoder still refuses
    with pytest.raises(LocalProtocolError, match="payload of 16 bytes exceeds the limit of 10"):
        writer.flush()


# The two senders' batching loops as they were (806b78e), over a stream of (message, payload) items, against
# the same loops written with BatchWriter: the same frames, byte for byte.

def _stream(seed: int) -> list[tuple[m.Message, memoryview | None]]:
    rng = random.Random(seed)
    out: list[tuple[m.Message, memoryview | None]] = []
    for i in range(3000):
        size = rng.choice([0, 0, 4, 64, 1000, 30_000, 64 * 1024, 64 * 1024 + 1, 200_000])
        name = "n" * rng.choice([1, 10, 300, 1024])
        if rng.random() < 0.1:
            out.append((m.Failure(i, "f" * rng.randrange(0, 3000), code="round_failed"), None))
        else:
            out.append((m.Result(i, name, rng.randrange(8), 1), _payload(i, size) if size else None))
    return out


def _server_legacy(stream, max_payload: int) -> bytes:
    """server.send/_flush: batch replies of at most 64 KiB; flush when the next would pass the payload limit,
    and once MAX_BATCH_ITEMS or BATCH_HEADER_BUDGET is reached."""
    wire, outbox, header_bytes, payload_bytes = [], [], 0, 0

    def flush():
        nonlocal outbox, header_bytes, payload_bytes
        if outbox:
            wire.append(_legacy_batch_frame(outbox, max_payload))
        outbox, header_bytes, payload_bytes = [], 0, 0

    for msg, p in stream:
        n = 0 if p is None else p.nbytes
        if n > 64 * 1024:  # written at once; the outbox waits for its flush
            wire.append(_legacy_batch_frame([(msg, p)], max_payload))
            continue
        if payload_bytes + n > max_payload:
            flush()
        outbox.append((msg, p))
        header_bytes += m.estimated_header_bytes(msg)
        payload_bytes += n
        if len(outbox) >= m.MAX_BATCH_ITEMS or header_bytes >= m.BATCH_HEADER_BUDGET:
            flush()
    flush()
    return b"".join(wire)


def _server_with_writer(stream, max_payload: int) -> bytes:
    wire: list[bytes | memoryview] = []
    writer = BatchWriter(max_payload_bytes=max_payload)
    for msg, p in stream:
        n = 0 if p is None else p.nbytes
        if not writer.batchable(n):
            wire += encode_frame(msg, p, max_payload_bytes=max_payload)
            continue
        if not writer.fits(n):
            wire += writer.flush()
        if writer.add(msg, p):
            wire += writer.flush()
    wire += writer.flush()
    return b"".join(wire)


def _link_legacy(stream, max_payload: int) -> bytes:
    """links.pump/_send_batch: a small push with more queued behind it takes the following small ones while
    the item count, the header budget and min(1 MiB, the payload limit) allow."""
    limit = min(1 << 20, max_payload)
    wire, i = [], 0
    while i < len(stream):
        first = stream[i]
        i += 1
        size = 0 if first[1] is None else first[1].nbytes
        if not (size <= 64 * 1024 and i < len(stream)):
            wire.append(_legacy_batch_frame([first], max_payload))
            continue
        items, nbytes, header_bytes = [first], size, m.estimated_header_bytes(first[0])
        while i < len(stream) and len(items) < m.MAX_BATCH_ITEMS and header_bytes < m.BATCH_HEADER_BUDGET:
            nxt = stream[i]
            size = 0 if nxt[1] is None else nxt[1].nbytes
            if size > 64 * 1024 or nbytes + size > limit:
                break
            i += 1
            items.append(nxt)
            nbytes += size
            header_bytes += m.estimated_header_bytes(nxt[0])
        wire.append(_legacy_batch_frame(items, max_payload))
    return b"".join(wire)


def _link_with_writer(stream, max_payload: int) -> bytes:
    writer = BatchWriter(max_payload_bytes=min(1 << 20, max_payload))
    wire: list[bytes | memoryview] = []
    i = 0
    while i < len(stream):
        first = stream[i]
        i += 1
        size = 0 if first[1] is None else first[1].nbytes
        if not (writer.batchable(size) and i < len(stream)):
            wire += encode_frame(*first, max_payload_bytes=max_payload)
            continue
        writer.add(*first)
        while i < len(stream) and writer.fits(0 if stream[i][1] is None else stream[i][1].nbytes):
            writer.add(*stream[i])
            i += 1
        wire += writer.flush()
    return b"".join(wire)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("max_payload", [DEFAULT_MAX_PAYLOAD_BYTES, 300_000])
def test_the_server_batching_with_the_writer_is_byte_identical(seed, max_payload):
    stream = _stream(seed)
    legacy = _server_legacy(stream, max_payload)
    assert _server_with_writer(stream, max_payload) == legacy
    frames = FrameReader().receive_data(legacy)
    assert sum(1 for f in frames if f.header["t"] == "batch") > 5  # the stream really made batches


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("max_payload", [DEFAULT_MAX_PAYLOAD_BYTES, 300_000])
def test_the_link_batching_with_the_writer_is_byte_identical(seed, max_payload):
    stream = _stream(seed)
    legacy = _link_legacy(stream, max_payload)
    assert _link_with_writer(stream, max_payload) == legacy
    frames = FrameReader().receive_data(legacy)
    assert sum(1 for f in frames if f.header["t"] == "batch") > 5
