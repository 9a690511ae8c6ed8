"""The TCP receive low-water mark that follows the frame being received (bps_runtime.lowat)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import uvloop

from bps_runtime.lowat import LOW_WATER_MAX_BYTES, ReceiveLowWater
from protocol.frames import FrameReader, encode_header

MiB = 1 << 20
# Linux holds a mark at most half of tcp_rmem's maximum (tcp_set_rcvlowat).
KERNEL_CAP = int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2]) // 2


class Receiver(asyncio.BufferedProtocol):
    """Frames in, through a FrameReader, with the low-water mark following it (as both daemons do)."""

    def __init__(self) -> None:
        self.reader = FrameReader(max_payload_bytes=4 * MiB)
        self.frames: asyncio.Queue = asyncio.Queue()
        self.low_water: ReceiveLowWater | None = None
        self.reads = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.low_water = ReceiveLowWater(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.reads += 1
        for frame in self.reader.buffer_updated(nbytes):
            self.frames.put_nowait((frame.header, None if frame.payload is None else bytes(frame.payload)))
        assert self.low_water is not None
        self.low_water.follow(self.reader.payload_wanted)


async def _connected_pair() -> tuple[asyncio.Transport, Receiver, asyncio.AbstractServer]:
    loop = asyncio.get_running_loop()
    receivers: list[Receiver] = []

    def factory() -> Receiver:
        receivers.append(Receiver())
        return receivers[-1]

    server = await loop.create_server(factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    for _ in range(100):
        if receivers and receivers[0].low_water is not None:
            break
        await asyncio.sleep(0.01)
    return transport, receivers[0], server


def test_mark_follows_the_payload_and_returns_to_one():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        sock = transport.get_extra_info("socket")
        mark = ReceiveLowWater(transport)

        def current() -> int:
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)

        mark.follow(100_000)  # a payload starts
        assert current() == 100_000
        mark.follow(150_000)  # never raised mid-payload (fewer system calls; only more wake-ups)
        assert current() == 100_000
        mark.follow(40_000)  # lowered to what is still needed, else the last bytes would never wake us
        assert current() == 40_000
        mark.follow(0)  # between payloads
        assert current() == 1
        mark.follow(500_000)  # a piece of 4 ms of a 1 Gbit/s link: one wake-up for all of it
        assert current() == min(500_000, KERNEL_CAP)
        mark.follow(0)
        mark.follow(64 * MiB)
        assert current() == min(LOW_WATER_MAX_BYTES, KERNEL_CAP)
        mark.follow(0)
        transport.close()  # its descriptor may be gone (or another socket's) by the next call: left alone
        mark.follow(100_000)
        assert mark._fd == -1
        server.close()

    uvloop.run(main())


def test_unix_sockets_are_left_alone(tmp_path):
    async def main() -> None:
        loop = asyncio.get_running_loop()
        path = str(tmp_path / "s.sock")
        server = await loop.create_unix_server(asyncio.Protocol, path)
        transport, _ = await loop.create_unix_connection(asyncio.Protocol, path)
        mark = ReceiveLowWater(transport)
        mark.follow(100_000)
        assert transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        transport.close()
        server.close()

    uvloop.run(main())


def test_short_frames_after_long_ones_arrive_without_stalling():
    """A 3 MiB payload (the mark goes up, in steps of at most LOW_WATER_MAX_BYTES), then frames of a few
    bytes: each must arrive at once. Were the mark left above 1 after the payload, Linux would not wake
    the reader for them, and this test would time out."""
    async def main() -> None:
        transport, receiver, server = await _connected_pair()
        payload = bytes(range(256)) * (3 * MiB // 256)
        for i in range(3):
            transport.writelines([encode_header({"t": "x", "i": i, "big": True}, len(payload)), payload])
            header, body = await asyncio.wait_for(receiver.frames.get(), 5)
            assert header == {"t": "x", "i": i, "big": True} and body == payload
            # sent only once the long frame is in: nothing else in the socket to wake the reader
            transport.write(encode_header({"t": "x", "i": i, "big": False}, 5) + b"hello")
            assert await asyncio.wait_for(receiver.frames.get(), 5) == ({"t": "x", "i": i, "big": False}, b"hello")
            transport.write(encode_header({"t": "x", "i": i, "ping": True}))
            assert await asyncio.wait_for(receiver.frames.get(), 5) == ({"t": "x", "i": i, "ping": True}, None)
        # and a payload arriving a few bytes at a time still completes (the mark is lowered as it goes)
        transport.write(encode_header({"t": "x", "slow": True}, 300_000))
        for start in range(0, 300_000, 60_000):
            transport.write(payload[start:start + 60_000])
            await asyncio.sleep(0.02)
        header, body = await asyncio.wait_for(receiver.frames.get(), 5)
        assert header == {"t": "x", "slow": True} and body == payload[:300_000]
        transport.close()
        server.close()

    uvloop.run(main())
