"""Programs for rank processes that exercise the client library itself (threads, argument checks).

Top-level functions, so that ``harness.run_ranks`` can spawn them; each returns plain data for the test.
They run on a one-process cluster, where a sum is the process's own input.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

import bps_worker.client as bps
from bps_worker.client import adapter

NAME = "threads.same"


def _push(n: int, value: float, slow_fill: float) -> np.ndarray:
    """One push of ``NAME`` holding ``value``; with ``slow_fill`` the input is written into the slot and the
    thread then sleeps that long before the operation starts (so another thread surely starts meanwhile)."""
    if not slow_fill:
        return bps.push_pull(np.full(n, value, np.float32), NAME, average=False)

    def fill(view: np.ndarray) -> None:
        view[...] = value
        time.sleep(slow_fill)

    return bps.synchronize(adapter.start_filled(NAME, np.float32, (n,), fill, average=False))


def same_name_from_two_threads(rounds: int, n: int, slow_fill: float) -> dict[str, Any]:
    """Two threads push ``NAME`` at the same instant, ``rounds`` times. Each push must give back its own
    thread's data, or fail fast with a BPSError naming the tensor: never the other thread's data."""
    barrier = threading.Barrier(2)
    outcomes: list[list[tuple[str, str, float]]] = [[], []]

    def thread(t: int) -> None:
        for r in range(rounds):
            value = float(1 + t + 10 * r)
            barrier.wait()
            t0 = time.monotonic()
            try:
                result = _push(n, value, slow_fill)
            except bps.BPSError as exc:
                outcomes[t].append(("error", str(exc), time.monotonic() - t0))
            else:
                got = sorted(set(result.tolist()))
                outcomes[t].append(("own" if got == [value] else "wrong", repr(got[:4]), time.monotonic() - t0))
            barrier.wait()  # both pushes of this round are over before the next starts

    threads = [threading.Thread(target=thread, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    after = bps.push_pull(np.arange(5, dtype=np.float32), "threads.after", average=False)
    return {"outcomes": outcomes, "after": after.tolist()}


def bad_arguments_then_a_push(cases: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Each case is (label, push_pull keyword arguments) that must fail with a BPSError; then an ordinary
    push must still work on the same connection."""
    errors: dict[str, str] = {}
    for label, kwargs in cases:
        args = {"array": np.ones(4, np.float32), "name": "args.ok", **kwargs}
        try:
            bps.push_pull(**args)
            errors[label] = "no error"
        except bps.BPSError as exc:
            errors[label] = f"BPSError: {exc}"
        except Exception as exc:  # the failure this program exists to catch
            errors[label] = f"{type(exc).__name__}: {exc}"
    after = bps.push_pull(np.arange(4, dtype=np.float32), "args.after", average=False)
    return {"errors": errors, "after": after.tolist()}


def leaves_with_its_round_ready(flags: str) -> dict[str, Any]:
    """Both local ranks push "left"; rank 1 exits once rank 0's push went, while the round waits for its base at
    a frozen server (the test's part): the operation then finds rank 1's memory gone."""
    import os
    import time
    from pathlib import Path
    rank, n = bps.rank(), 1 << 15  # 128 KiB: not fused
    if rank == 1:
        handle = bps.push_pull_async(np.ones(n, np.float32), "left", average=False)
        bps.poll(handle)
        while not (Path(flags) / "pushed").exists():
            time.sleep(0.01)
        (Path(flags) / "leaving").touch()
        os._exit(0)
    handle = bps.push_pull_async(np.ones(n, np.float32), "left", average=False)
    bps.poll(handle)
    (Path(flags) / "pushed").touch()
    try:
        bps.synchronize(handle)
        return {"ok": True}
    except bps.BPSError as exc:
        return {"type": type(exc).__name__, "text": str(exc)}


def allocates_again_what_another_name_reads() -> dict[str, Any]:
    """Rank 0 pushes "y" from the slot it allocated as "x" (a slot under another name, as the client's slabs
    are), then asks for "x" larger before synchronizing: refused (moving it would free what "y" reads)."""
    import time
    from bps_runtime import segments as shm
    from bps_worker.client.handle import Handle
    from protocol.messages import Op
    n = 1 << 18
    if bps.rank() == 0:
        conn = bps._operations().conn
        segment, offset, _ = conn.allocate("x", n * 4)
        mapped = shm.attach_segment(segment)
        np.frombuffer(mapped.buf, np.float32, n, offset)[:] = 1.0
        req = conn.next_req()
        handle = Handle(req, "y", np.dtype(np.float32), (n,), None)
        conn.submit(handle, Op(req, "y", "sum", "float32", [n], segment, offset=offset, handback=False))
        try:
            conn.allocate("x", 4 * n * 4)
            refused = ""
        except bps.BPSError as exc:
            refused = str(exc)
        handle.wait(30)
        return {"refused": refused, "error": str(handle.error) if handle.error else ""}
    time.sleep(0.5)
    return {"sum": float(bps.push_pull(np.ones(n, np.float32), "y", average=False)[0])}


def cuda_ops_checked_as_any() -> dict[str, str]:
    """Ops naming a CUDA tensor get the checks every op gets (an integer average, a root out of range) before
    anything needs the GPU: the daemon answers them so on a machine without one too."""
    from bps_runtime import cuda
    from bps_worker.client.handle import Handle
    from protocol.messages import Op
    conn = bps._operations().conn
    description = [[4], [1], 0, "int32", 0, None] + [None] * (len(cuda.DESCRIPTION_FIELDS) - 6)
    out = {}
    for label, kind, average, root in (("average", "sum", True, -1), ("root", "broadcast", False, 99)):
        req = conn.next_req()
        handle = Handle(req, f"cuda.{label}", np.dtype(np.int32), (4,), None)
        conn.submit(handle, Op(req, f"cuda.{label}", kind, "int32", [4], "", average=average, root=root,
                               cuda=description))
        handle.wait(30)
        out[label] = str(handle.error)
    return out


def failed_init_beside_an_open_round(sock: str, flags: str) -> dict[str, Any]:
    """Local rank 1 leaves, rank 0 issues "p" (its round waits for rank 1), then rank 1's ``init`` fails on a timeline
    it cannot write and it inits again and pushes "p". Its failed ``init`` connected and left before, which failed
    rank 0's round ("rank 1 disconnected during the fused round", a review's case). Both sums, exact or the error."""
    import os

    rank = bps.local_rank()
    flag = os.path.join(flags, "{}")
    x = np.full(4, rank + 1, np.float32)
    try:
        if rank == 1:
            bps.shutdown()
            open(flag.format("left"), "w").close()
            _wait_for(flag.format("issued"))
            time.sleep(0.3)  # rank 0's op reaches the daemon
            try:
                bps.init(socket=sock, local_rank=1, timeout=10.0, timeline="/proc/no/such/t.json")
                return {"error": "init with a bad timeline did not fail"}
            except bps.BPSError:
                pass
            bps.init(socket=sock, local_rank=1, timeout=10.0)
            return {"sum": bps.push_pull(x, "p", average=False).tolist()}
        _wait_for(flag.format("left"))
        time.sleep(0.3)  # the daemon saw rank 1 leave
        handle = bps.push_pull_async(x, "p", average=False)
        open(flag.format("issued"), "w").close()
        return {"sum": bps.synchronize(handle, timeout=30).tolist()}
    except bps.BPSError as exc:
        return {"error": str(exc)}


def _wait_for(path: str) -> None:
    import os

    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def shutdown_under_a_waiting_thread() -> dict[str, Any]:
    """Rank 0: a thread waits in push_pull (rank 1 never pushes the name) and the main thread calls shutdown(): the
    waiting call's error said "the socket failed: [Errno 9] Bad file descriptor" (a review's case)."""
    if bps.rank() != 0:
        time.sleep(2.0)
        return {}
    heard: list[str] = []
    issued = threading.Event()

    def waiting() -> None:
        try:
            handle = bps.push_pull_async(np.ones(4, np.float32), "never", average=False)
            issued.set()
            bps.synchronize(handle)
        except bps.BPSError as exc:
            heard.append(str(exc))

    thread = threading.Thread(target=waiting)
    thread.start()
    issued.wait(30)
    time.sleep(0.5)  # (it waits in synchronize: a call made after shutdown() hears "not initialized")
    bps.shutdown()
    thread.join(10)
    return {"heard": heard, "alive": thread.is_alive()}


def _shutdown_barrier_init(barrier: str, tag: str, rank: int, size: int) -> None:
    """shutdown(), a barrier of the job's own (a file per rank in ``barrier``, named by ``tag``: as the docstring of
    shutdown() asks), and init() again on the same socket."""
    import os

    settings, local_rank = bps._operations().settings, bps.local_rank()
    bps.shutdown()
    open(os.path.join(barrier, f"{tag}.{rank}"), "w").close()
    deadline = time.monotonic() + 30
    while sum(f.startswith(f"{tag}.") for f in os.listdir(barrier)) < size and time.monotonic() < deadline:
        time.sleep(0.005)
    bps.init(socket=settings.socket, local_rank=local_rank, timeout=settings.timeout)


def shutdown_and_init_again(barrier: str, cycles: int) -> list[str]:
    """Each cycle: a fused and an unfused sum of names every cycle reuses (each cycle's own values), shutdown(), a
    barrier of the job's own (a file per rank, as the docstring of shutdown() asks), init() again. Without the
    daemons' answer to Leave, a peer's new process could report a round before this machine's daemon or a server had
    heard the leave, and the leave failed that round (the timeline test, a CI run). Returns the errors met."""
    rank, size = bps.rank(), bps.size()
    errors: list[str] = []
    for cycle in range(cycles):
        value = float(cycle * 10 + rank)
        expected = sum(cycle * 10 + r for r in range(size))
        try:
            small = bps.push_pull(np.full(3, value, np.float32), "again.small", average=False)
            large = bps.push_pull(np.full(300_000, value, np.float32), "again.large", average=False)
            if not (np.all(small == expected) and np.all(large == expected)):
                errors.append(f"cycle {cycle}: sums {small[0]} and {large[0]}, expected {expected}")
        except bps.BPSError as exc:
            errors.append(f"cycle {cycle}: {exc}")
        _shutdown_barrier_init(barrier, f"{cycle}", rank, size)
    return errors


def shutdown_with_sums_in_flight_then_init_again(barrier: str, cycles: int) -> list[str]:
    """Each cycle: several large sums started (push_pull_async) and shutdown() at once with them in flight, a
    barrier of the job's own, init() again and the same names summed: exact, each cycle's own values. Where a
    machine has several connections to a server (separate hosts), pieces of the ended job still on their way on one
    connection could reach the server after the machine's Reset on another, and reopen the ended job's rounds there:
    the next job's first sums of those partitions were stale. Returns the errors of the next jobs' sums."""
    import os

    rank, size = bps.rank(), bps.size()
    errors: list[str] = []
    names = [f"big{i}" for i in range(4)]
    for cycle in range(cycles):
        value = float(cycle * 10 + rank)
        expected = sum(cycle * 10 + r for r in range(size))
        try:
            for name in names:
                result = bps.push_pull(np.full(500_000, value, np.float32), name, average=False)
                if not np.all(result == expected):
                    errors.append(f"cycle {cycle}: {name} summed {result[0]}, expected {expected}")
        except bps.BPSError as exc:
            errors.append(f"cycle {cycle}: {exc}")
        for name in names:  # the ended job's pushes, in flight at the shutdown
            bps.push_pull_async(np.full(500_000, value, np.float32), name, average=False)
        _shutdown_barrier_init(barrier, f"{cycle}", rank, size)
    return errors


def shutdown_from_a_signal_handler_inside(held: str) -> dict[str, Any]:
    """A signal handler that calls shutdown() (what a pod's SIGTERM handler does) runs while this very thread holds
    one of the client's locks (``held``): as when the signal lands in the middle of a call. shutdown() waited for
    ever on the lock its own thread held. Returns how long it took and what the client says after it."""
    import os
    import signal

    from bps_worker import client

    bps.push_pull(np.ones(3, np.float32), "sig.small", average=False)  # (slots, a fusion buffer, a result)
    ops = client._operations()
    assert ops.fusion is not None
    lock = {"module": client._lock, "send": ops.conn.send_lock, "handles": ops.conn.lock,
            "fusion": ops.fusion._cond, "slots": ops.slots._lock,
            "timeline": ops.timeline._lock if ops.timeline is not None else None}[held]
    assert lock is not None
    took: list[float] = []

    def handler(signum: int, frame: Any) -> None:
        start = time.monotonic()
        bps.shutdown()
        took.append(time.monotonic() - start)

    import atexit

    registered: list[Any] = []  # what shutdown() leaves for the exit (the timeline's close, where it could not end it)
    register = atexit.register
    atexit.register = lambda fn, *a, **k: (registered.append(fn), register(fn, *a, **k))[1]  # type: ignore
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        with lock:
            os.kill(os.getpid(), signal.SIGUSR1)  # (the handler runs in this thread, at once)
            deadline = time.monotonic() + 30
            while not took and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        atexit.register = register
    outcome: dict[str, Any] = {"took": took, "initialized": bps.is_initialized()}
    if held == "timeline":  # its file is ended at exit then, which a forked rank skips (os._exit): as exit would
        assert ops.timeline is not None
        outcome.update(tracing=ops.timeline._file is not None, at_exit=ops.timeline.close in registered)
        ops.timeline.close()
    return outcome


def two_threads_shut_down(marker: str, go: str) -> dict[str, float]:
    """A sum, then (once the test froze the server) two threads call shutdown() 0.2 s apart: seconds from the first
    call to each return. The second waits for the first, which returns once its leave took effect."""
    import os

    bps.push_pull(np.ones(3, np.float32), "x", average=False)
    open(marker, "w").close()
    while not os.path.exists(go):
        time.sleep(0.02)
    took: dict[str, float] = {}
    start = time.monotonic()

    def call(who: str) -> None:
        bps.shutdown()
        took[who] = time.monotonic() - start

    threads = [threading.Thread(target=call, args=(who,)) for who in ("first", "second")]
    threads[0].start()
    time.sleep(0.2)
    threads[1].start()
    for t in threads:
        t.join()
    return took
