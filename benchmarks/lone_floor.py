"""The floor of a lone small sum's process structure: what issue 16's lone call costs with the least Python.

    .venv/bin/python benchmarks/lone_floor.py                    # 4 KiB, 300 warm-up + 5000 timed calls
    .venv/bin/python benchmarks/lone_floor.py --calls 200 --warmup 20   # smoke test

The same processes as a lone ``push_pull`` on ``configs/local.toml``'s one-box cluster, on the same cores: four
ranks, two worker daemons (two ranks each, over a Unix socket) and one server (over loopback TCP, both workers
to it). Every hop does only what moves the bytes: a rank sends an 8-byte header and its float32 array; a worker
daemon (a uvloop ``Protocol``) sums its two ranks' arrays with numpy and sends the sum to the server, which
sums the two workers' and sends the total back; each worker hands it to its ranks. No shared memory, names,
checks, rounds, timeouts, windows or failure handling: none of the product's guarantees, so this is not a
design to copy, only a measure of what the interpreter, uvloop and the kernel's wake-ups cost per call on this
box, against which the product's figures (``benchmarks/RESULTS.md``) can be read.

Reported: each rank's p50 per call, and CPU microseconds per call of every process (user + sys over the timed
calls, from each process's own ``time.process_time``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HEADER = struct.Struct("<II")  # a tag (unused) and the payload's byte count


class _Framed(asyncio.Protocol):
    """Frames of HEADER + ``nbytes`` payload; ``on_array(self, array)`` for each."""

    def __init__(self, nbytes: int, on_array: Any) -> None:
        self.nbytes, self.on_array = nbytes, on_array
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        frame = HEADER.size + self.nbytes
        while len(self.buf) >= frame:
            array = np.frombuffer(bytes(self.buf[HEADER.size:frame]), np.float32)
            del self.buf[:frame]
            self.on_array(self, array)


class _Meter:
    """CPU per call of this process over the calls after ``warmup``, printed once ``warmup + calls`` are done."""

    def __init__(self, role: str, warmup: int, calls: int) -> None:
        self.role, self.warmup, self.calls, self.done, self.start = role, warmup, calls, 0, 0.0

    def tick(self) -> None:
        self.done += 1
        if self.done == self.warmup:
            self.start = time.process_time()
        elif self.done == self.warmup + self.calls:
            print(f"cpu {self.role} {(time.process_time() - self.start) / self.calls * 1e6:.1f}", flush=True)


def _summing(arrivals: int, meter: _Meter, send: Any) -> Any:
    """A protocol callback that sums ``arrivals`` arrays (one per peer, in any order) and calls ``send``."""
    got: dict[int, np.ndarray] = {}

    def on_array(peer: _Framed, array: np.ndarray) -> None:
        got[id(peer)] = array
        if len(got) == arrivals:
            first, *rest = got.values()
            total = first.copy()
            for array in rest:
                total += array
            got.clear()
            meter.tick()
            send(HEADER.pack(0, total.nbytes) + total.tobytes())
    return on_array


def serve(nbytes: int, warmup: int, calls: int) -> None:
    async def main() -> None:
        peers: list[_Framed] = []
        on_array = _summing(2, _Meter("server", warmup, calls),
                            lambda frame: [p.transport.write(frame) for p in peers])  # type: ignore[union-attr]

        def make() -> _Framed:
            peers.append(_Framed(nbytes, on_array))
            return peers[-1]
        server = await asyncio.get_running_loop().create_server(make, "127.0.0.1", 0)
        print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
        await asyncio.Event().wait()
    _run(main())


def work(path: str, port: int, nbytes: int, warmup: int, calls: int) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        ranks: list[_Framed] = []
        _, up = await loop.create_connection(
            lambda: _Framed(nbytes, lambda _, array: [r.transport.write(  # type: ignore[union-attr]
                HEADER.pack(0, array.nbytes) + array.tobytes()) for r in ranks]), "127.0.0.1", port)
        on_array = _summing(2, _Meter(f"worker{path[-6]}", warmup, calls), up.transport.write)  # type: ignore

        def make() -> _Framed:
            ranks.append(_Framed(nbytes, on_array))
            return ranks[-1]
        await loop.create_unix_server(make, path)
        print("ready", flush=True)
        await asyncio.Event().wait()
    _run(main())


def rank(index: int, path: str, nbytes: int, warmup: int, calls: int) -> None:
    x = np.arange(nbytes // 4, dtype=np.float32)
    frame = HEADER.pack(0, nbytes) + x.tobytes()
    answer = bytearray(HEADER.size + nbytes)
    view = memoryview(answer)
    times = []
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        for i in range(warmup + calls):
            if i == warmup:
                cpu = time.process_time()
            start = time.perf_counter()
            s.sendall(frame)
            got = 0
            while got < len(answer):
                got += s.recv_into(view[got:])
            times.append(time.perf_counter() - start)
        cpu = time.process_time() - cpu
    assert np.array_equal(np.frombuffer(bytes(answer[HEADER.size:]), np.float32), 4 * x), "wrong sum"
    timed = sorted(times[warmup:])
    print(f"p50 {index} {timed[len(timed) // 2] * 1e3:.3f}", flush=True)
    print(f"cpu rank{index} {cpu / calls * 1e6:.1f}", flush=True)


def _run(main: Any) -> None:
    try:
        import uvloop
        uvloop.run(main)
    except ImportError:
        asyncio.run(main)


def _spawn(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, *map(str, args)], stdout=subprocess.PIPE, text=True)


def measure(nbytes: int, warmup: int, calls: int) -> dict[str, float]:
    """Run the whole structure once; {"p50 ms": median of the ranks' p50s, "<process> us": CPU per call}."""
    procs: list[subprocess.Popen[str]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="lone_floor.") as tmp:
            procs.append(_spawn("serve", nbytes, warmup, calls))
            port = int(procs[0].stdout.readline().split()[1])  # type: ignore[union-attr]
            paths = [os.path.join(tmp, f"w{w}.sock") for w in range(2)]
            for path in paths:
                procs.append(_spawn("work", path, port, nbytes, warmup, calls))
                assert procs[-1].stdout.readline().strip() == "ready"  # type: ignore[union-attr]
            ranks = [_spawn("rank", r, paths[r // 2], nbytes, warmup, calls) for r in range(4)]
            procs += ranks
            lines = [line for p in ranks for line in p.communicate(timeout=600)[0].splitlines()]
            for p in procs[:3]:
                lines.append(p.stdout.readline())  # type: ignore[union-attr]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    p50s = sorted(float(line.split()[2]) for line in lines if line.startswith("p50"))
    out = {"p50 ms": p50s[len(p50s) // 2]}
    for line in lines:
        if line.startswith("cpu"):
            _, who, value = line.split()
            out[f"{who} CPU us"] = float(value)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("serve", "work", "rank"):
        role, values = sys.argv[1], [int(a) if a.isdigit() else a for a in sys.argv[2:]]
        {"serve": serve, "work": work, "rank": rank}[role](*values)  # type: ignore[operator]
        return
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--bytes", type=int, default=4096, help="float32 bytes a rank sums (default 4096)")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--calls", type=int, default=5000)
    args = p.parse_args()
    result = measure(args.bytes, args.warmup, args.calls)
    for key, value in result.items():
        print(f"{key:>16}  {value:8.3f}" if key == "p50 ms" else f"{key:>16}  {value:8.1f}")


if __name__ == "__main__":
    main()
