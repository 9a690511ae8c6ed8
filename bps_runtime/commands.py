"""The commands' entry points (``bps-server``, ``bps-worker``, ``bps-launch`` and their ``python -m`` forms).

A terminal's Ctrl-C reaches the launcher and every daemon it started at once. A daemon handles SIGINT itself
once its event loop runs (a clean stop); before that, while it imports, compiles its kernels and starts, a Ctrl-C
was a ``KeyboardInterrupt`` traceback from each of them, several screens of interleaved stacks for one key
press. Here the command's module is imported and run inside the guard, so that an interrupted start-up ends with
status 130 (128 + SIGINT, as a shell reports it) and nothing printed. This module imports nothing of the project
before the guard. ``python -m bps_worker.launch`` imports the launcher before its guard; SIGINT has its default
action while it does (the process ends, silently).

While numba compiles or loads its cache it calls back into Python through ctypes, where a ``KeyboardInterrupt`` is
printed ("Exception ignored on calling ctypes callback function") and lost: the daemon went on starting. A daemon
therefore warms its kernels up with the interrupt deferred (:func:`interrupts_deferred`) and stops after it.
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, NoReturn

INTERRUPTED_STATUS = 130  # 128 + SIGINT: what a shell reports for a job stopped by Ctrl-C


def exit_with(main: Callable[[], int]) -> NoReturn:
    """Exit with ``main()``'s status, or :data:`INTERRUPTED_STATUS` where a Ctrl-C stops it first."""
    try:
        code = main()
    except KeyboardInterrupt:
        code = INTERRUPTED_STATUS
    sys.exit(code)


def run_command(module: str) -> NoReturn:
    """Import ``module`` and exit with its ``main()``'s status, both inside :func:`exit_with`'s guard."""
    exit_with(lambda: importlib.import_module(module).main())


def bps_server() -> NoReturn:
    run_command("bps_server.main")


def bps_worker() -> NoReturn:
    run_command("bps_worker.main")


def bps_launch() -> NoReturn:
    run_command("bps_worker.launch")


@contextmanager
def interrupts_deferred() -> Iterator[Callable[[], bool]]:
    """Inside the block a SIGINT is recorded, not raised; the callable given says whether one came. The handler
    before is put back after it. Off the main thread (where no handler can be set) nothing changes."""
    came: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    before = signal.signal(signal.SIGINT, lambda signum, frame: came.append(True))
    try:
        yield lambda: bool(came)
    finally:
        signal.signal(signal.SIGINT, before)
