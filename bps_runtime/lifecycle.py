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
from typing import Any, Awaitable, Callable

import uvloop

from .commands import interrupts_deferred, launcher_owns_sigint, say

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def open_standard_fds() -> None:
    """Descriptors 0-2 open, on /dev/null where they were closed (``bps-launch ... >&-``, a supervisor that
    closes them): what the process opens next would otherwise take their numbers, and uvloop aborts when it
    closes a descriptor below 3 (``uv__close`` asserts). Each is inheritable, as a standard descriptor is, so
    that a launcher's children get it too (``os.open`` makes a descriptor close-on-exec)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # (the lowest free number: this one, or a lower one just made)
            if null != fd:
                os.dup2(null, fd)  # (dup2 makes it inheritable)
                os.close(null)
            else:
                os.set_inheritable(fd, True)


def setup_logging(level: str, log_file: str | None = None) -> None:
    """Log to stderr (journald picks it up under systemd), or to ``log_file`` (reopened on SIGHUP); ValueError
    (one line, as for a bad config) where that file cannot be opened."""
    try:
        handler: logging.Handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler()
    except OSError as exc:
        raise ValueError(f"cannot open --log-file {log_file}: {exc.strerror or exc}") from None
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


def prepare_to_serve() -> bool:
    """A daemon's start before its event loop: glibc keeps freed memory, the kernels are compiled (before the
    daemon says it is ready, never on a job's first tensor; a Ctrl-C meanwhile is deferred, see
    ``bps_runtime.commands``) and the heap settled. False where a Ctrl-C came: the daemon ends then."""
    from . import kernels

    keep_freed_memory()
    with interrupts_deferred() as interrupted:
        kernels.warm_up(blas=False)
    if interrupted():
        return False
    settle_heap()
    return True


def settle_heap() -> None:
    """Take what start-up built out of the cyclic garbage collector's walks: call once, before serving.

    Importing numba and numpy and compiling the kernels leaves over 100,000 long-lived objects, and every
    full collection walked them all (about 20-60 ms each): the hot path's short-lived messages, futures and
    closures triggered one often enough that the collector took 12% of a worker daemon's CPU on emulated
    1 Gbit/s links (py-spy, ``benchmarks/RESULTS.md``). :func:`gc.freeze` moves them to the permanent
    generation; the collector still runs, over what the daemon allocated since.
    """
    gc.collect()
    gc.freeze()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The daemons' loop: uvloop, chosen by factory rather than a global policy."""
    return uvloop.new_event_loop()


_notify_dropped = False  # a notification was dropped already (said once at warning level)
# READY=1 and STOPPING=1 come once each, and systemd acts on them (a Type=notify unit that never says READY is
# killed at its start timeout): they wait this long for room in the socket's queue before they are dropped.
NOTIFY_ONCE_WAIT_S: float = 2.0


def sd_notify(state: str, notify_socket: str | None) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to systemd's notify socket, if there is one; whether it went.

    Never waits for ever. The socket's queue is short (``net.unix.max_dgram_qlen``, 10 by default), and a
    reader that falls behind (a busy manager, a container runtime, a test) made a blocking send freeze the
    daemon's event loop for as long; it hung a daemon's stop for good once its reader had stopped reading.
    The periodic messages (``WATCHDOG=1``, ``STATUS=``) are sent without waiting, and dropped when they do not
    fit: a dropped ping is what systemd's watchdog would see of a frozen loop anyway. ``READY=1`` and
    ``STOPPING=1`` wait up to :data:`NOTIFY_ONCE_WAIT_S` for room first."""
    global _notify_dropped
    if not notify_socket:
        return False
    address = "\0" + notify_socket[1:] if notify_socket.startswith("@") else notify_socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            once = state.startswith(("READY=", "STOPPING="))
            sock.settimeout(NOTIFY_ONCE_WAIT_S if once else 0.0)
            sock.sendto(state.encode(), address)
        return True
    except (BlockingIOError, TimeoutError):
        level = logging.DEBUG if _notify_dropped else logging.WARNING
        _notify_dropped = True
        logging.getLogger("bps").log(level, "systemd's notify socket %s is full (its reader is behind): %r "
                                     "dropped", notify_socket, state)
        return False
    except OSError as exc:
        logging.getLogger("bps").debug("cannot notify systemd at %s: %s", notify_socket, exc)
        return False


def install_stop_signals(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT ask the daemon to stop cleanly; SIGINT stays ignored in ``bps-launch``'s daemons (the
    launcher stops them itself, see ``bps_runtime.commands``)."""
    loop.add_signal_handler(signal.SIGTERM, stop)
    if not launcher_owns_sigint():
        loop.add_signal_handler(signal.SIGINT, stop)


class ListenError(OSError):
    """A failure to listen on another address than the daemon's main one: ``what`` names it."""

    def __init__(self, what: str, exc: OSError) -> None:
        super().__init__(exc.errno, exc.strerror or str(exc))
        self.what = what


def describe_bind_error(exc: OSError, what: str) -> str:
    """A one-line reason for a failed bind/listen."""
    if exc.errno and exc.errno > 0:
        reason = os.strerror(exc.errno)
    else:  # (a name that does not resolve: getaddrinfo's codes are negative, and os.strerror knows none of them)
        reason = exc.strerror or str(exc)
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
        say(f"{prog}: {describe_bind_error(exc, what)}")
        return 1
    sd_notify("READY=1", notify_socket)
    await stopped.wait()
    logging.getLogger("bps").info("%s stopping", prog)
    sd_notify("STOPPING=1", notify_socket)
    await stop()
    return 0

