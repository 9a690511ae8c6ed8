"""The daemons' start-up helpers that change the process itself (bps_runtime.lifecycle)."""

from __future__ import annotations

import gc

from bps_runtime.lifecycle import settle_heap


def test_settle_heap_takes_what_start_up_built_out_of_the_collectors_walks():
    gc.unfreeze()
    start_up = [[i] for i in range(10_000)]  # long-lived containers, as numba's import leaves
    try:
        settle_heap()
        assert gc.get_freeze_count() >= len(start_up)
        tracked = {id(o) for o in gc.get_objects()}
        assert id(start_up) not in tracked and id(start_up[0]) not in tracked  # no generation holds them now
        later = [1]
        assert id(later) in {id(o) for o in gc.get_objects()}  # what the daemon allocates after is collected
        assert gc.isenabled()
    finally:
        gc.unfreeze()


def test_a_bind_error_says_why_in_words_for_errno_and_for_a_name_that_does_not_resolve():
    """getaddrinfo's codes are negative: os.strerror(-2) is "Unknown error -2"; the error's own text says it."""
    import errno
    import socket

    from bps_runtime.lifecycle import describe_bind_error

    assert describe_bind_error(OSError(errno.EADDRINUSE, "[Errno 98] error while attempting to bind"), "x:1") == \
        "cannot listen on x:1: Address already in use"
    assert describe_bind_error(socket.gaierror(-2, "Name or service not known"), "nosuchhost.invalid:9") == \
        "cannot listen on nosuchhost.invalid:9: Name or service not known"


def test_a_sigint_inside_interrupts_deferred_is_recorded_not_raised_and_the_handler_before_comes_back():
    """numba's warm-up calls back into Python through ctypes, where a KeyboardInterrupt is printed and lost."""
    import os
    import signal

    from bps_runtime.commands import interrupts_deferred

    before = signal.getsignal(signal.SIGINT)
    with interrupts_deferred() as interrupted:
        assert not interrupted()
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100):  # (Python runs the handler at its next check of pending signals)
            if interrupted():
                break
        assert interrupted()
    assert signal.getsignal(signal.SIGINT) is before


def test_exit_with_turns_a_ctrl_c_into_status_130_and_passes_other_statuses_and_errors_through():
    import pytest

    from bps_runtime.commands import INTERRUPTED_STATUS, exit_with

    def interrupted() -> int:
        raise KeyboardInterrupt

    def failing() -> int:
        raise ValueError("a bug")

    with pytest.raises(SystemExit) as stopped:
        exit_with(interrupted)
    assert stopped.value.code == INTERRUPTED_STATUS == 130
    with pytest.raises(SystemExit) as ended:
        exit_with(lambda: 2)
    assert ended.value.code == 2
    with pytest.raises(ValueError, match="a bug"):  # a traceback where there is a bug
        exit_with(failing)


def test_sigint_ignored_runs_through_sh_where_there_is_one_and_the_command_alone_elsewhere(monkeypatch):
    from bps_runtime import commands

    argv = ["python", "-m", "bps_server"]
    assert commands.sigint_ignored(argv) == ["/bin/sh", "-c", 'trap "" INT; exec "$@"', "sh", *argv]
    monkeypatch.setattr(commands, "_SH", "/nonexistent/sh")
    assert commands.sigint_ignored(argv) == argv  # (its daemons then hear a Ctrl-C, and stop themselves)


def test_only_a_launchers_daemon_keeps_sigint_ignored(monkeypatch):
    import signal

    from bps_runtime.commands import LAUNCHER_ENV, launcher_owns_sigint

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        monkeypatch.delenv(LAUNCHER_ENV, raising=False)
        assert not launcher_owns_sigint()  # (a shell's background job: it takes SIGINT over as ever)
        monkeypatch.setenv(LAUNCHER_ENV, "1")
        assert launcher_owns_sigint()
    finally:
        signal.signal(signal.SIGINT, before)
    assert not launcher_owns_sigint()  # (SIGINT not ignored: the variable alone is nothing)


def test_say_writes_its_line_in_one_write_where_stderr_is_unbuffered(monkeypatch):
    """A launch's daemons share one stderr. Under PYTHONUNBUFFERED (CI images, containers) sys.stderr is a
    write-through wrapper over the raw descriptor, where print() is two writes: three servers refused at once
    read "...in usebps-server: ...in use". Built here as Python builds it then."""
    import io
    import sys

    from bps_runtime.commands import say

    class Writes(io.RawIOBase):
        def __init__(self) -> None:
            self.calls: list[bytes] = []

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            self.calls.append(bytes(b))
            return len(b)

    raw = Writes()
    unbuffered = io.TextIOWrapper(raw, encoding="utf-8", line_buffering=True, write_through=True)
    print("bps-server: printed", file=unbuffered)
    assert raw.calls == [b"bps-server: printed", b"\n"]  # (what made the lines interleave)
    raw.calls.clear()
    monkeypatch.setattr(sys, "stderr", unbuffered)
    say("bps-server: cannot listen on 127.0.0.1:1: Address already in use")
    say("bps-launch: server-0 exited with status 1 during start-up")
    assert raw.calls == [b"bps-server: cannot listen on 127.0.0.1:1: Address already in use\n",
                         b"bps-launch: server-0 exited with status 1 during start-up\n"]
