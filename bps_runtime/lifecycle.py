"""What every daemon of the project needs: a uvloop loop, logging, systemd readiness, signals."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import signal
import socket
import sys
from typing import Any, Awaitable, Callable, Final

import uvloop

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def setup_logging(level: str, log_file: str | None = None) -> None:
    """Log to stderr (journald picks it up under systemd), or to ``log_file`` (reopened on SIGHUP)."""
    handler: logging.Handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)


def reopen_log_files() -> None:
    """SIGHUP: close and reopen every log file, so that logrotate can move them away."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            fresh = logging.FileHandler(handler.baseFilename)
            fresh.setFormatter(handler.formatter)
            fresh.setLevel(handler.level)
            root.addHandler(fresh)
            root.removeHandler(handler)
            handler.close()
    logging.getLogger("bps").info("log files reopened")


# glibc mallopt parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit
_TRIM_THRESHOLD = 2**31 - 1  # keep up to 2 GiB of freed heap instead of handing it back


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory instead of returning it to the kernel.

    A daemon receives a partition into a fresh buffer and frees it a round later; by default glibc
    gives that memory back and the next partition page-faults on every 4 KiB it receives (measured:
    one fault per received page, half of the servers' system time). Keeping it costs RSS up to the
    peak working set, which the daemon needs anyway. No-op where glibc's mallopt is missing.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    return mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok


def settle_heap() -> None:
    """Take what start-up built out of the cyclic garbage collector's walks: call once, before serving.

    Importing numba and numpy and compiling the kernels leaves over 100,000 long-lived objects, and every
    full collection walked them all (about 20-60 ms each): the hot path's short-lived messages, futures and
    closures triggered one often enough that the collector took 12% of a worker daemon's CPU on emulated
    1 Gbit/s links (py-spy, ``benchmarks/RESULTS.md``). :func:`gc.freeze` moves them to the permanent
    generation; the collector still runs, over what the daemon allocated since (on a clock once the daemon
    serves: :class:`ClockedCollection`).
    """
    gc.collect()
    gc.freeze()


class ClockedCollection:
    """While a daemon serves, the cyclic garbage collector runs on the event loop's clock, not on allocations.

    Why: a step of thousands of small tensors keeps tens of thousands of objects alive until its sums are
    back (a worker daemon's rounds, entries, operations). Counted by allocations, the collector ran some 20
    times a step and walked them each time, whatever the threshold (a larger one walks more per run). At
    5000 tensors a step its own CPU in a worker daemon was 9-11 ms of the step's 105-115, and 1.3-1.9 ms on
    the clock (``benchmarks/RESULTS.md``, session 13). On a clock it walks what is alive at that instant,
    once a second: the youngest generation every tick, the middle one every ``middle_every`` ticks,
    everything every ``full_every``.

    Reference counting still frees at once whatever holds no cycle, and the hot path makes none (see
    ``bps_worker.operation.Path``; ``python_gc_objects_collected_total`` on ``/metrics`` would show one).
    Cyclic garbage (an exception and its traceback, mostly) waits for the next tick; so that no burst of it
    can grow without bound meanwhile, the collector also runs as before once the objects allocated since
    its last run outnumber those freed by ``VALVE``.
    """

    PERIOD_S: Final = 1.0
    MIDDLE_EVERY: Final = 10
    FULL_EVERY: Final = 60
    VALVE: Final = 200_000  # the youngest generation's threshold meanwhile (CPython's default: 700)

    def __init__(self, loop: asyncio.AbstractEventLoop, period_s: float = PERIOD_S, *,
                 middle_every: int = MIDDLE_EVERY, full_every: int = FULL_EVERY) -> None:
        self._loop = loop
        self._period_s = period_s
        self._middle_every, self._full_every = middle_every, full_every
        self.ticks = 0
        self._thresholds = gc.get_threshold()
        gc.set_threshold(self.VALVE, *self._thresholds[1:])
        self._timer: asyncio.TimerHandle | None = loop.call_later(period_s, self._tick)

    def _tick(self) -> None:
        self.ticks += 1
        ticks = self.ticks
        gc.collect(2 if ticks % self._full_every == 0 else 1 if ticks % self._middle_every == 0 else 0)
        self._timer = self._loop.call_later(self._period_s, self._tick)

    def stop(self) -> None:
        """Back to collecting on allocations (the daemon is stopping)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            gc.set_threshold(*self._thresholds)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The daemons' loop: uvloop, chosen by factory rather than a global policy."""
    return uvloop.new_event_loop()


def sd_notify(state: str, notify_socket: str | None) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to systemd's notify socket, if there is one."""
    if not notify_socket:
        return False
    address = "\0" + notify_socket[1:] if notify_socket.startswith("@") else notify_socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), address)
        return True
    except OSError as exc:
        logging.getLogger("bps").debug("cannot notify systemd at %s: %s", notify_socket, exc)
        return False


def install_stop_signals(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT ask the daemon to stop cleanly."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


class ListenError(OSError):
    """A failure to listen on another address than the daemon's main one: ``what`` names it."""

    def __init__(self, what: str, exc: OSError) -> None:
        super().__init__(exc.errno, exc.strerror or str(exc))
        self.what = what


def describe_bind_error(exc: OSError, what: str) -> str:
    """A one-line reason for a failed bind/listen."""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    return f"cannot listen on {what}: {reason}"


async def serve_until_signalled(start: Callable[[], Awaitable[Any]], stop: Callable[[], Awaitable[None]], *,
                                prog: str, listen_on: str, notify_socket: str | None) -> int:
    """Start a daemon, tell systemd it is ready, run until SIGTERM/SIGINT, stop it: the exit status.

    A failure to listen is the one-line reason on stderr and status 1.
    """
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    install_stop_signals(loop, stopped.set)
    loop.add_signal_handler(signal.SIGHUP, reopen_log_files)
    try:
        await start()
    except OSError as exc:
        what = exc.what if isinstance(exc, ListenError) else listen_on
        print(f"{prog}: {describe_bind_error(exc, what)}", file=sys.stderr)
        return 1
    sd_notify("READY=1", notify_socket)
    collection = ClockedCollection(loop)
    try:
        await stopped.wait()
    finally:
        collection.stop()
    logging.getLogger("bps").info("%s stopping", prog)
    sd_notify("STOPPING=1", notify_socket)
    await stop()
    return 0

