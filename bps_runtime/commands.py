"""The commands' entry points (``bps-server``, ``bps-worker``, ``bps-launch`` and their ``python -m`` forms).

A terminal's Ctrl-C reaches the launcher and every daemon it started at once. A daemon handles SIGINT itself
once its event loop runs (a clean stop); before that, while it imports, compiles its kernels and starts, a Ctrl-C
was a ``KeyboardInterrupt`` traceback from each of them, several screens of interleaved stacks for one key
press. Three things make it quiet:

- The launcher starts its daemons with SIGINT ignored (:func:`sigint_ignored`, inherited through ``exec`` and
  ``fork``: Python then installs no ``KeyboardInterrupt``) and with :data:`LAUNCHER_ENV` set, and a daemon so
  started keeps it ignored (:func:`launcher_owns_sigint`): the launcher alone hears a Ctrl-C, and stops ranks,
  workers and servers in that order. They stay in the launcher's process group, so that what signals the group
  (a ``kill`` of it, Ctrl-\\\\, a job control stop) reaches them as before. A daemon that finds SIGINT ignored
  without the variable (a shell script's background job) takes it over as ever.
- A daemon run by hand (``bps-server`` in a terminal) imports its module with the interrupt deferred (a
  ``KeyboardInterrupt`` raised inside a compiled module's import can be swallowed: numpy's random module
  registers its types under a bare ``except``, and the daemon then served for ever) and runs it inside
  :func:`exit_with`'s guard: an interrupted start-up ends with status 130 (128 + SIGINT, as a shell reports it)
  and nothing printed, once the interpreter itself has started (its own start, tens of milliseconds, is not
  ours).
- While numba compiles or loads its cache it calls back into Python through ctypes, where a
  ``KeyboardInterrupt`` is printed ("Exception ignored on calling ctypes callback function") and lost: the
  daemon went on starting. A daemon therefore warms its kernels up with the interrupt deferred
  (:class:`interrupts_deferred`) and stops after it.

A daemon that a fatal signal ends (SIGSEGV; SIGBUS, where another process truncated a shared-memory segment
between a check of its size and a sum over it; SIGFPE, SIGABRT, SIGILL) writes every thread's Python stack to
stderr first (the standard library's ``faulthandler``): the journal then says where it died, where a bare "bus
error" from systemd said nothing. The launcher and the training processes are left as they are (the client
library does not change its user's process).

This module imports only ``sys``, ``os`` and ``signal`` (all loaded with the interpreter) before the guard.
``python -m bps_worker.launch`` imports the launcher before its guard; SIGINT has its default action while it
does (the process ends, silently).
"""

from __future__ import annotations

import os
import signal
import sys

TYPE_CHECKING = False  # (not typing's: nothing more is imported before the guard)
if TYPE_CHECKING:
    from typing import Callable, NoReturn, Sequence

INTERRUPTED_STATUS = 130  # 128 + SIGINT: what a shell reports for a job stopped by Ctrl-C
LAUNCHER_ENV = "BPS_LAUNCHER_STOPS_ME"  # "1" in the launcher's daemons: it stops them (SIGINT stays ignored)
# Runs a command with SIGINT ignored: what a shell does for a background job (``trap`` with an empty action
# sets SIG_IGN, which ``exec`` keeps). A prefix, so that nothing runs between fork and exec in our process.
_SH = "/bin/sh"
_IGNORING_SIGINT = (_SH, "-c", 'trap "" INT; exec "$@"', "sh")


def say(line: str) -> None:
    """``line`` on stderr in one ``write(2)``. A launch's servers, workers, ranks and the launcher share one
    stderr, and ``print`` makes two writes (the text, then its newline) where ``PYTHONUNBUFFERED`` is set, as in
    many CI images and containers: three servers refused at once then read "...in usebps-server: ...in use"
    and two empty lines. Nothing where there is no stderr (started with descriptor 2 closed)."""
    stream = sys.stderr
    if stream is not None:
        stream.write(line + "\n")
        stream.flush()


def exit_with(main: Callable[[], int]) -> NoReturn:
    """Exit with ``main()``'s status, or :data:`INTERRUPTED_STATUS` where a Ctrl-C stops it first."""
    try:
        code = main()
    except KeyboardInterrupt:
        code = INTERRUPTED_STATUS
    sys.exit(code)


def run_command(module: str) -> NoReturn:
    """Import ``module`` (with the interrupt deferred) and exit with its ``main()``'s status, both inside
    :func:`exit_with`'s guard."""
    def main() -> int:
        import importlib

        from bps_runtime.orphans import ENDED_STATUS, end_with_parent

        if not end_with_parent():  # (the launcher that started us is gone already)
            return ENDED_STATUS
        if module != "bps_worker.launch":
            import faulthandler

            faulthandler.enable()  # (see the module docstring)
        with interrupts_deferred() as interrupted:
            loaded = importlib.import_module(module)
        if interrupted():
            return INTERRUPTED_STATUS
        return loaded.main()

    exit_with(main)


def bps_server() -> NoReturn:
    run_command("bps_server.main")


def bps_worker() -> NoReturn:
    run_command("bps_worker.main")


def bps_launch() -> NoReturn:
    run_command("bps_worker.launch")


def sigint_ignored(argv: Sequence[str]) -> list[str]:
    """``argv`` run with SIGINT ignored from its first instruction (see the module); as it is where there is no
    ``/bin/sh`` (its daemons then hear a terminal's Ctrl-C too, and stop themselves)."""
    return [*_IGNORING_SIGINT, *argv] if os.path.exists(_SH) else list(argv)


def sigint_is_ignored() -> bool:
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def launcher_owns_sigint() -> bool:
    """Whether a launcher that stops us itself started us with SIGINT ignored: never take it over then."""
    return sigint_is_ignored() and os.environ.get(LAUNCHER_ENV) == "1"


class interrupts_deferred:
    """Inside the block a SIGINT is recorded, not raised; ``with`` gives a callable that says whether one came.
    The handler before is put back after it. Off the main thread (where no handler can be set), or where SIGINT
    is ignored, nothing changes."""

    def __init__(self) -> None:
        self._came = False
        self._before: object = None
        self._installed = False

    def _record(self, signum: int, frame: object) -> None:
        self._came = True

    def __enter__(self) -> Callable[[], bool]:
        if not sigint_is_ignored():
            try:
                self._before = signal.signal(signal.SIGINT, self._record)
                self._installed = True
            except ValueError:  # (not the main thread)
                pass
        return lambda: self._came

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._before)  # type: ignore[arg-type]
