"""The launcher's processes end when it does, however it ends.

``bps-launch`` stops its cluster itself on a Ctrl-C, SIGTERM or SIGHUP, and when a rank or a daemon fails. A
launcher killed outright (SIGKILL: ``kill -9``, the OOM killer, a scheduler's last resort) can stop nothing:
its daemons served and its ranks trained on, children of init, for ever. So each process it starts asks the
kernel for SIGTERM when its parent ends (``PR_SET_PDEATHSIG``):

- a daemon, in :func:`bps_runtime.commands.run_command`, where :data:`PARENT_ENV` names its parent (the
  launcher's :class:`~bps_worker.supervise.Supervisor` sets it): SIGTERM stops it as it always does;
- the forkserver's helper started for the launcher likewise, and each daemon it forks (``PARENT_ENV`` then
  names the helper): the helper ends with the launcher, its daemons with the helper;
- a rank, which is the user's program, through :func:`rank_argv`: a bare interpreter (``-I -S``: no site, no
  ``PYTHON*`` variables) that asks for it and ``exec``\\ s the command, which keeps it. The same step ignores
  SIGTTOU: a rank is a background process group on the launcher's terminal (a group of its own, as under
  torchrun), and with ``stty tostop`` its first line of output stopped it, and the launcher waited for it for
  ever. With SIGTTOU ignored the write goes through, as POSIX says.

A parent that ended before the request is seen at once (``getppid`` is then another process): the child ends
there. The kernel sends the signal when the *thread* that started the child ends, not the process: the launcher
starts its daemons, its helper and its ranks on its main thread, and the helper has no other.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from typing import Final, Iterator, Sequence

__all__ = ["ENDED_STATUS", "PARENT_ENV", "ask_to_end_with_parent", "end_with_parent", "rank_argv", "sigint_blocked"]

PARENT_ENV: Final = "BPS_PARENT_PID"  # the pid of the parent a process ends with (set by the launcher)
_PR_SET_PDEATHSIG: Final = 1
ENDED_STATUS: Final = 128 + signal.SIGTERM  # what a shell reports for a process that SIGTERM ended

# The rank's first step: argv is [-c, PARENT, COMMAND...]. It starts with SIGINT blocked (rank_started): a
# Ctrl-C passed on by the launcher while it runs ends it at once and silently, with SIGINT's default action,
# never a KeyboardInterrupt from this interpreter. SIGPIPE and SIGXFSZ back to their defaults (the interpreter
# ignores them, and exec would keep that: subprocess restores them for its children the same way).
_RANK_STEP: Final = """\
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(128 + signal.SIGTERM)
argv = sys.argv[2:]
try:
    os.execvp(argv[0], argv)
except OSError as exc:
    sys.stderr.write(f"bps-launch: cannot start the training command {argv[0]!r}: {exc.strerror or exc}\\n")
    os._exit(127)
"""


def ask_to_end_with_parent(parent: int, sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for ``sig`` when our parent ends; False if ``parent`` is no longer our parent (it ended
    before the request could be seen). Where ``prctl`` cannot be called nothing is asked (True)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return True
    prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return os.getppid() == parent


def end_with_parent() -> bool:
    """Where :data:`PARENT_ENV` names our parent, end when it does; False if it has ended already (the caller
    exits with :data:`ENDED_STATUS`). True where the variable is not set."""
    value = os.environ.get(PARENT_ENV, "")
    if not value.isdigit():
        return True
    return ask_to_end_with_parent(int(value))


def rank_argv(command: Sequence[str], parent: int, python: str = sys.executable) -> list[str]:
    """``command`` started so that it ends with process ``parent`` and writes to a ``tostop`` terminal (see the
    module); its pid and environment are the command's own (``exec``). Start it inside :func:`sigint_blocked`."""
    return [python, "-I", "-S", "-c", _RANK_STEP, str(parent), *command]


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT held back from this thread (and from the children it starts, which inherit the mask) inside the
    block; one that came meanwhile is handled after it."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
