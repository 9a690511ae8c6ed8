"""FrameReader's receive buffer: small for a stranger, grown for a large header, larger once the peer is
known (issue 14, item 5: 256 KiB for every idle connection took a server to 1.2 GB)."""

from __future__ import annotations

import pytest

from protocol.errors import RemoteProtocolError
from protocol.frames import PREFIX, RECEIVE_BUFFER_BYTES, FrameReader, encode_header
from protocol.handshake import HANDSHAKE_BUFFER_BYTES, HANDSHAKE_MAX_HEADER_BYTES


def _stranger() -> FrameReader:
    return FrameReader(max_header_bytes=HANDSHAKE_MAX_HEADER_BYTES, max_payload_bytes=0,
                       buffer_bytes=HANDSHAKE_BUFFER_BYTES)


def _feed_in(reader: FrameReader, data: bytes, chunk: int) -> list:
    frames = []
    for i in range(0, len(data), chunk):
        piece = data[i:i + chunk]
        while piece:
            buf = reader.get_buffer(-1)
            n = min(len(buf), len(piece))
            buf[:n] = piece[:n]
            piece = piece[n:]
            frames += reader.buffer_updated(n)
    return frames


def test_a_strangers_reader_starts_small():
    assert _stranger().buffer_bytes == HANDSHAKE_BUFFER_BYTES <= 4096
    assert FrameReader().buffer_bytes == RECEIVE_BUFFER_BYTES


@pytest.mark.parametrize("chunk", [1, 1000, 65536])
def test_a_header_larger_than_the_buffer_grows_it_up_to_one_header(chunk):
    reader = _stranger()
    big = {"t": "hello", "items": ["x" * 100] * 140}  # about 14.5 KiB: the Hello of a large cluster
    small = {"t": "ping", "seq": 1}
    data = encode_header(small) + encode_header(big) + encode_header(small)
    frames = _feed_in(reader, data, chunk)
    assert [f.header for f in frames] == [small, big, small]
    assert HANDSHAKE_BUFFER_BYTES < reader.buffer_bytes <= PREFIX.size + HANDSHAKE_MAX_HEADER_BYTES


def test_a_header_over_the_limit_is_refused_before_the_buffer_grows_for_it():
    reader = _stranger()
    with pytest.raises(RemoteProtocolError, match="exceeds the limit"):
        _feed_in(reader, PREFIX.pack(HANDSHAKE_MAX_HEADER_BYTES + 1, 0) + b"\0" * 8192, 8192)
    assert reader.buffer_bytes == HANDSHAKE_BUFFER_BYTES


def test_set_limits_grows_the_buffer_and_keeps_unparsed_bytes():
    reader = _stranger()
    hello, push = {"t": "hello", "id": 1}, {"t": "push", "req": 1}
    data = encode_header(hello) + encode_header(push, 5) + b"12345"
    cut = len(encode_header(hello)) + 7  # the push's prefix and part of its header arrive with the hello
    frames = _feed_in(reader, data[:cut], cut)
    assert [f.header for f in frames] == [hello]
    reader.set_limits(max_header_bytes=64 * 1024, max_payload_bytes=1 << 20)
    assert reader.buffer_bytes == RECEIVE_BUFFER_BYTES
    frames = _feed_in(reader, data[cut:], 3)
    assert [(f.header, bytes(f.payload)) for f in frames] == [(push, b"12345")]
    reader.set_limits(max_header_bytes=1024, max_payload_bytes=0, buffer_bytes=1024)  # it never shrinks
    assert reader.buffer_bytes == RECEIVE_BUFFER_BYTES and reader.max_header_bytes == 1024
