"""Daemons forked from one process that imported them once: a start of about 0.1 CPU-s instead of 1.2.

A daemon started with ``exec`` (``python -m bps_server``) spends about 1.1 CPU-s before it serves, 0.8 of it
importing numba and loading the kernels from numba's cache, the same work in every daemon. A box that starts
many clusters (the test suite starts about 600 daemons; the emulator's sweeps hundreds) pays it each time. A
:class:`Forkserver` pays it once: its helper process imports both daemons and loads every kernel, then forks
a copy of itself for each daemon, which runs the daemon's own ``__main__`` as ``python -m`` would.

Theory of operation:

- The helper (``python -m bps_runtime.forkserver FD``) is single-threaded: it imports, loads the kernels
  (:func:`bps_runtime.kernels.warm_up`, which starts no thread) and then only waits on two descriptors, its
  request socket and the wake-up pipe of its ``SIGCHLD`` handler. A fork of it is a clean process.
- :meth:`Forkserver.spawn` sends one request (``argv`` after the interpreter, the environment, the working
  directory) over a ``SOCK_SEQPACKET`` pair, with two descriptors (``SCM_RIGHTS``): the daemon's output
  (stdout and stderr both) and one end of a fresh socket pair, the daemon's *status* socket. The helper
  forks; the child resets what the helper changed (signal handlers, the wake-up descriptor), takes the
  output as 1 and 2 and ``/dev/null`` as 0, closes every other descriptor, takes the environment and the
  directory, and runs the module. The helper ignores SIGINT (a terminal's Ctrl-C is the spawner's, which
  stops the daemons), from its first instruction where its first spawner asks; a daemon gets Python's
  handler back, or keeps SIGINT ignored where the spawner asks (the launcher's, as ``bps_runtime.commands``
  says). Its exit is Python's: the status of ``SystemExit``, ``atexit``
  handlers, flushed output.
- The helper sends the child's pid on the status socket at once, and its wait status when it has reaped it.
  :class:`ForkedProcess` is the spawner's handle, with the part of :class:`subprocess.Popen`'s interface the
  supervisor uses (``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``).
- The helper ends when its request socket closes (the :class:`Forkserver` is closed or its process ended)
  and every child it forked has been reaped: a daemon's status always has a reader.
- What differs from ``exec``: ``/proc/PID/cmdline`` is the helper's (the process name, ``comm``, is set to
  the daemon's, e.g. ``bps-server``); a variable read while importing (numba's ``NUMBA_*``) is the
  helper's environment's; the network namespace is the helper's, so :meth:`Forkserver.serves` answers
  False for a caller that moved to another one. Callers (``bps_worker.supervise.Supervisor``) start
  daemons with ``exec`` for any command it does not serve: another interpreter, a prefix (``ip netns
  exec``), a module other than the daemons'.
"""

from __future__ import annotations

import ctypes
import gc
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Any, Final, Mapping, Sequence

import msgpack

from .commands import say, sigint_ignored
from .orphans import ENDED_STATUS, PARENT_ENV, end_with_parent, on_main_thread

__all__ = ["DAEMON_MODULES", "ForkedProcess", "Forkserver", "ForkserverError", "serve"]

DAEMON_MODULES: Final = ("bps_server", "bps_worker")
START_TIMEOUT_S: Final = 60.0   # the helper's imports and kernels, on a busy box
SPAWN_TIMEOUT_S: Final = 10.0   # one fork's answer (its pid)
_PID = struct.Struct("!q")
_STATUS = struct.Struct("!i")
_REQUEST_MAX: Final = 1 << 20
_PR_SET_NAME: Final = 15


class ForkserverError(RuntimeError):
    """The helper could not start, or did not answer a request."""


def _netns() -> str:
    try:
        return os.readlink("/proc/thread-self/ns/net")
    except OSError:
        return ""


class ForkedProcess:
    """A daemon forked by a :class:`Forkserver`: ``Popen``'s interface as far as supervision needs it.

    ``returncode`` is ``Popen``'s: the exit status, or ``-N`` for signal N; 255 where the helper died
    before it could say (never while the spawner lives: the helper outlives its children).
    """

    def __init__(self, pid: int, status: socket.socket, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._status = status
        self._lock = threading.Lock()

    def _collect(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            ready, _, _ = select.select([self._status], [], [], timeout)
        except (ValueError, OSError):  # closed meanwhile: another thread collected the status
            return self.returncode
        if not ready:
            return None
        with self._lock:  # no lock while waiting: a thread's wait() must not block another's poll()
            if self.returncode is None:
                try:
                    data = self._status.recv(_STATUS.size, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return None
                self.returncode = os.waitstatus_to_exitcode(_STATUS.unpack(data)[0]) if data else 255
                self._status.close()
            return self.returncode

    def poll(self) -> int | None:
        return self._collect(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never a signal to a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __repr__(self) -> str:
        return f"<ForkedProcess pid={self.pid} returncode={self.returncode}>"


class Forkserver:
    """One helper process, started at the first :meth:`spawn` (see the module), shared by threads."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self._lock = threading.Lock()
        self._requests: socket.socket | None = None
        self._helper: subprocess.Popen[bytes] | None = None
        self._netns = ""
        self._owner = os.getpid()

    def serves(self, argv: Sequence[str], prefix: Sequence[str] = ()) -> bool:
        """Whether ``prefix + argv`` is a daemon this forkserver can fork: ``PYTHON -m bps_server|bps_worker
        ...`` with no prefix, from this process, in the network namespace the helper was started in."""
        if prefix or len(argv) < 3 or argv[0] != self.python or argv[1] != "-m" or argv[2] not in DAEMON_MODULES:
            return False
        if os.getpid() != self._owner:
            return False
        return self._requests is None or _netns() == self._netns

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], output: int | None = None, *,
              ignore_sigint: bool = False) -> ForkedProcess:
        """Fork daemon ``argv`` (``python -m MODULE ARGS``, :meth:`serves`) with ``env``, its stdout and stderr
        on descriptor ``output`` (our descriptor 2 when None, as a Popen child inherits it), in our working
        directory; ``ignore_sigint``: as started by :func:`bps_runtime.commands.sigint_ignored`."""
        if not self.serves(argv):
            raise ForkserverError(f"not a daemon this forkserver can fork: {' '.join(argv)}")
        request = msgpack.packb({"argv": list(argv[1:]), "env": dict(env), "cwd": os.getcwd(),
                                 "ignore_sigint": ignore_sigint})
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self._lock:
                requests = self._started(ignore_sigint)
                socket.send_fds(requests, [request], [2 if output is None else output,
                                                      theirs.fileno()])
            theirs.close()
            ours.settimeout(SPAWN_TIMEOUT_S)
            data = ours.recv(_PID.size)
            ours.settimeout(None)
        except (OSError, socket.timeout) as exc:
            ours.close()
            theirs.close()
            raise ForkserverError(f"the forkserver did not start {' '.join(argv[2:4])}: {exc}") from exc
        if len(data) != _PID.size:
            ours.close()
            raise ForkserverError(f"the forkserver did not start {' '.join(argv[2:4])}: it closed the request")
        return ForkedProcess(_PID.unpack(data)[0], ours, argv)

    def _started(self, ignore_sigint: bool) -> socket.socket:
        if self._requests is not None and self._helper is not None and self._helper.poll() is None:
            return self._requests
        self._close_requests()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            # (for the launcher, SIGINT ignored from its first instruction: a terminal's Ctrl-C is the spawner's;
            # serve() ignores it once the helper's imports are done, in any case)
            argv = [self.python, "-m", "bps_runtime.forkserver", str(theirs.fileno())]
            # (the launcher's helper ends with it, and its daemons with the helper: bps_runtime.orphans)
            env = dict(os.environ, **{PARENT_ENV: str(os.getpid())}) if ignore_sigint and on_main_thread() else None
            self._helper = subprocess.Popen(sigint_ignored(argv) if ignore_sigint else argv, env=env,
                                            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        ours.settimeout(START_TIMEOUT_S)
        try:
            ready = ours.recv(4096)
        except (OSError, socket.timeout) as exc:
            ours.close()
            self._helper.kill()
            raise ForkserverError(f"the forkserver was not ready within {START_TIMEOUT_S:g} s: {exc}") from exc
        if not ready:
            ours.close()
            raise ForkserverError(f"the forkserver exited during start-up with status {self._helper.wait()}")
        ours.settimeout(None)
        self._requests, self._netns = ours, ready.decode()
        return ours

    def _close_requests(self) -> None:
        if self._requests is not None:
            self._requests.close()
            self._requests = None

    def close(self) -> None:
        """Close the request socket: the helper exits once its children have, and a thread of ours reaps it then
        (it stayed a zombie as long as this process lived)."""
        with self._lock:
            self._close_requests()
            helper, self._helper = self._helper, None
        if helper is not None and helper.poll() is None:
            threading.Thread(target=helper.wait, name="bps-forkserver-reaper", daemon=True).start()


# --- the helper ---------------------------------------------------------------------------------------------

def _preload() -> None:
    """Import what every daemon imports and load every kernel, as a daemon's start does (blas=False). By name,
    as ``python -m`` finds them: the runtime depends on neither daemon's code."""
    import importlib

    from bps_runtime import kernels

    for module in DAEMON_MODULES:
        importlib.import_module(f"{module}.main")
    kernels.warm_up(blas=False)
    # What the imports built, out of every collection's walk in the daemons (each daemon's own settle_heap walked
    # it all once more, writing every object's header: a copy of most of the heap's pages in each fork).
    gc.collect()
    gc.freeze()


def _child(request: dict[str, Any], output: int, helper: int) -> None:
    """In a fresh fork of ``helper``: become the daemon ``request`` names, run it, exit with its status. Never
    returns. Every descriptor of the helper above 2 is closed here (the caller detached its socket objects). A
    daemon that would end with the launcher ends with the helper instead (which ends with the launcher)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN if request["ignore_sigint"] else signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.environ.clear()
        os.environ.update(request["env"])
        if PARENT_ENV in os.environ:
            os.environ[PARENT_ENV] = str(helper)
        os.chdir(request["cwd"])
        code = _run_module(request["argv"])
    except BaseException:  # what python -m would print
        import traceback
        traceback.print_exc()
    finally:
        _exit(code)


def _run_module(argv: list[str]) -> int:
    """``python -m MODULE ARGS`` in this process: the status its ``SystemExit`` gives (or 0)."""
    import runpy

    module = argv[1]
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_NAME, ("bps-server" if module == "bps_server" else "bps-worker").encode(), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    sys.argv = ["-m", *argv[2:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        say(str(exc.code))
        return 1
    return 0


def _exit(code: int) -> None:
    import atexit

    try:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code & 0xFF)


def _fork(requests: socket.socket, children: dict[int, socket.socket]) -> bool:
    """Take one request and fork its daemon; False once the request socket is closed."""
    try:
        data, fds, _, _ = socket.recv_fds(requests, _REQUEST_MAX, 2)
    except ConnectionError:
        data, fds = b"", []
    if not data or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        return bool(data)
    output, status_fd = fds
    status = socket.socket(fileno=status_fd)
    request = msgpack.unpackb(data)
    sys.stdout.flush()
    sys.stderr.flush()
    helper = os.getpid()
    pid = os.fork()
    if pid == 0:
        for sock in (requests, status, *children.values()):
            sock.detach()  # (their finalizers must not close a descriptor number the daemon reuses)
        _child(request, output, helper)
    os.close(output)
    children[pid] = status
    try:
        status.send(_PID.pack(pid))
    except OSError:
        pass  # the spawner is gone: the child's status is then written to no one
    return True


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status = children.pop(pid, None)
        if status is not None:
            try:
                status.send(_STATUS.pack(wait_status))
            except OSError:
                pass
            status.close()


def serve(fd: int) -> None:
    """The helper's loop (see the module): ``fd`` is its end of the request socket pair."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the spawner, which stops daemons
    if not end_with_parent():  # (started for a launcher that is gone already)
        os._exit(ENDED_STATUS)
    requests = socket.socket(fileno=fd)
    _preload()
    wake = os.pipe()
    os.set_blocking(wake[1], False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    requests.send(_netns().encode() or b"-")
    listening = True
    while listening or children:
        readable, _, _ = select.select([requests.fileno(), wake[0]] if listening else [wake[0]], [], [])
        if wake[0] in readable:
            os.read(wake[0], 4096)
        _reap(children)
        if requests.fileno() in readable:
            listening = _fork(requests, children)
    requests.close()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
