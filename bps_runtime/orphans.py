"""The launcher's processes end when it does, however it ends.

``bps-launch`` stops its cluster itself on a Ctrl-C, SIGTERM or SIGHUP, and when a rank or a daemon fails. A
launcher killed outright (SIGKILL: ``kill -9``, the OOM killer, a scheduler's last resort) can stop nothing:
its daemons served and its ranks trained on, children of init, for ever. So each process it starts asks the
kernel for SIGTERM when its parent ends (``PR_SET_PDEATHSIG``):

- a daemon, in :func:`bps_runtime.commands.run_command`, where :data:`PARENT_ENV` names its parent (the
  launcher's :class:`~bps_worker.supervise.Supervisor` sets it): SIGTERM stops it as it always does;
- the forkserver's helper started for the launcher likewise, and each daemon it forks (``PARENT_ENV`` then
  names the helper): the helper ends with the launcher, its daemons with the helper;
- a rank, which is the user's program, through :func:`start_rank`: a bare interpreter (``-I -S``: no site, no
  ``PYTHON*`` variables) asks for it, then ``exec`` runs the command, which keeps it (a command that cannot be
  exec'd is an OSError in the launcher, as :class:`subprocess.Popen` raises it). The same step ignores SIGTTOU:
  a rank is a background process group on the launcher's terminal (a group of its own, as under torchrun), and
  with ``stty tostop`` its first line of output stopped it, and the launcher waited for it for ever. With
  SIGTTOU ignored the write goes through, as POSIX says (and so does a rank's change of the terminal's modes,
  ``tcsetattr``, which also stopped it before; reading the terminal still stops it, SIGTTIN: rank 0 reads the
  launcher's standard input instead, ``bps_worker.launch``).

A parent that ended before the request is seen at once (``getppid`` is then another process): the child ends
there. The kernel sends the signal when the *thread* that started the child ends, not the process: only
children started on the main thread ask for it (:func:`on_main_thread`; the launcher starts its daemons, its
helper and its ranks there, and the helper has no other thread), so that a cluster started from another thread
(a test's) is not stopped when that thread ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import signal
import subprocess
import sys
import threading
from typing import Any, Final, Iterator, Mapping, Sequence

__all__ = ["ENDED_STATUS", "PARENT_ENV", "end_with_parent", "on_main_thread", "rank_argv", "sigint_blocked",
           "start_rank"]

PARENT_ENV: Final = "BPS_PARENT_PID"  # the pid of the parent a process ends with (set by the launcher)
_PR_SET_PDEATHSIG: Final = 1
ENDED_STATUS: Final = 128 + signal.SIGTERM  # what a shell reports for a process that SIGTERM ended

# The rank's first step: argv is [-c, PARENT, STATUS_FD, LC_CTYPE, COMMAND...]. It starts with SIGINT blocked
# (start_rank): a Ctrl-C passed on by the launcher while it runs ends it at once and silently, with SIGINT's
# default action, never a KeyboardInterrupt from this interpreter. SIGPIPE and SIGXFSZ back to their defaults
# (the interpreter ignores them, and exec would keep that: subprocess restores them for its children the same
# way); LC_CTYPE as the launcher gave it ("=VALUE", or "" for none: the interpreter's C locale coercion may have
# set it). A command that cannot be exec'd is told on STATUS_FD (its errno), closed by a successful exec.
_RANK_STEP: Final = """\
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
parent, status, lc_ctype, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
os.set_inheritable(status, False)
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
if lc_ctype:
    os.environ["LC_CTYPE"] = lc_ctype[1:]
else:
    os.environ.pop("LC_CTYPE", None)
if parent:
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)
    except Exception:
        pass
    if os.getppid() != parent:
        os._exit(128 + signal.SIGTERM)
try:
    os.execvp(argv[0], argv)
except OSError as exc:
    os.write(status, str(exc.errno or 0).encode())
    os._exit(127)
"""
STEP_ANSWER_S: Final = 30.0  # at most this for the step's exec (an interpreter without site: milliseconds)


def on_main_thread() -> bool:
    """Whether a child started now may end with us: the kernel's signal follows the thread that starts it."""
    return threading.current_thread() is threading.main_thread()


def end_with_parent() -> bool:
    """Where :data:`PARENT_ENV` names our parent, ask the kernel for SIGTERM when it ends; False if it has ended
    already (``getppid`` is another process now: the caller exits with :data:`ENDED_STATUS`). True where the
    variable is not set, or where ``prctl`` cannot be called (nothing is asked)."""
    value = os.environ.get(PARENT_ENV, "")
    if not value.isdigit():
        return True
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return True
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    return os.getppid() == int(value)


def rank_argv(command: Sequence[str], parent: int, status_fd: int, env: Mapping[str, str],
              python: str = sys.executable) -> list[str]:
    """``command`` started so that it ends with process ``parent`` (0: it does not) and writes to a ``tostop``
    terminal (see the module); its pid and environment (``env``) are the command's own (``exec``). A failed exec
    is told on ``status_fd``. :func:`start_rank` runs it."""
    lc_ctype = "=" + env["LC_CTYPE"] if "LC_CTYPE" in env else ""
    return [python, "-I", "-S", "-c", _RANK_STEP, str(parent), str(status_fd), lc_ctype, *command]


def start_rank(command: Sequence[str], env: Mapping[str, str], **popen: Any) -> subprocess.Popen[Any]:
    """Start training process ``command`` in ``env`` through the step (:func:`rank_argv`), ending with us where
    we are on our main thread (the kernel's signal follows the thread that started the child, see the module);
    OSError as :class:`subprocess.Popen` raises it where the command cannot be exec'd."""
    parent = os.getpid() if on_main_thread() else 0
    answer, status = os.pipe()
    try:
        with sigint_blocked():
            proc = subprocess.Popen(rank_argv(command, parent, status, env), env=dict(env), pass_fds=[status],
                                    **popen)
        os.close(status)
        status = -1
        told = b""
        if select.select([answer], [], [], STEP_ANSWER_S)[0]:
            told = os.read(answer, 32)
    finally:
        os.close(answer)
        if status >= 0:
            os.close(status)
    if told:
        proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
        code = int(told) if told.isdigit() else errno.ENOEXEC
        raise OSError(code, os.strerror(code))
    return proc


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT held back from this thread (and from the children it starts, which inherit the mask) inside the
    block; one that came meanwhile is handled after it."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
