"""A transport that keeps what a protocol class writes, for the fake-transport tier (no socket)."""

from __future__ import annotations

from typing import Any

from protocol.frames import FrameReader
from protocol.messages import Challenge, parse


class FakeTransport:
    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def writelines(self, chunks: list[Any]) -> None:
        for c in chunks:
            self.data += bytes(c)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0  # the kernel takes every byte at once

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default  # no socket: no low-water mark

    def messages(self, with_challenge: bool = False) -> list[Any]:
        """(message, payload) of every frame written, without the server's Challenge unless asked."""
        reader = FrameReader()
        out = [(parse(f.header), f.payload) for f in reader.receive_data(bytes(self.data))]
        return out if with_challenge else [(m, p) for m, p in out if not isinstance(m, Challenge)]


def feed(protocol: Any, data: bytes) -> None:
    """Hand ``data`` to a buffered protocol as the event loop would, in buffers of the size it offers."""
    view = memoryview(data)
    while view:
        buf = protocol.get_buffer(-1)
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        view = view[n:]
        protocol.buffer_updated(n)


class FakeSession:
    """What a worker daemon answers a training process through: here, a list of its answers."""

    def __init__(self, local_rank: int) -> None:
        self.local_rank = local_rank
        self.pid = 1000 + local_rank
        self.answers: list[Any] = []

    def send(self, message: Any) -> None:
        self.answers.append(message)

    def release_segments(self) -> None:
        pass


def worker_daemon(local_size: int) -> Any:
    """Worker 0's daemon, made in this process and not started, of a cluster of two workers of ``local_size``
    processes, a server colocated with worker 0 (id 0) and a CPU-only one (id 1): its decisions run on the
    test's loop, and nothing connects."""
    from bps_worker.daemon import WorkerConfig, WorkerDaemon
    from protocol.config import parse_config

    cluster = parse_config({"cluster": {"workers": 2},
                            "server": [{"id": 0, "address": "10.0.0.1:9000", "worker": 0},
                                       {"id": 1, "address": "10.0.0.2:9000"}],
                            "worker": [{"id": w, "local_size": local_size, "socket": f"/tmp/w{w}.sock"}
                                       for w in range(2)]})
    return WorkerDaemon(WorkerConfig(cluster, 0))


def reconnect_link(link: Any, proto: Any, *, restarted: bool) -> FakeTransport:
    """Break ``link``'s connection ``proto`` and give it a new one, ready, on a fake transport (its handshake
    said the same server run, or a ``restarted`` one); the new transport."""
    from bps_worker.link import _LinkProtocol

    link.on_broken(proto, "lost connection to server 0")
    link._connecting.cancel()
    proto2 = _LinkProtocol(link)
    transport = FakeTransport()
    proto2.connection_made(transport)
    proto2.proven = True  # (as once its Welcome is verified)
    link._proto, link._ready = proto2, True
    link._settle_held(proto2, restarted=restarted)
    return transport
