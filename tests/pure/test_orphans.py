"""The step that makes the launcher's processes end with it (bps_runtime.orphans), without a cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import pytest

from bps_runtime.orphans import ENDED_STATUS, PARENT_ENV, rank_argv, sigint_blocked, start_rank

PY = sys.executable
# What a command sees of the step: its pid and its parent-death signal.
SHOW = ("import ctypes, os\n"
        "got = ctypes.c_int(0)\n"
        "ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0)\n"  # PR_GET_PDEATHSIG
        "print(os.getpid(), got.value)\n")


@pytest.fixture
def not_our_parent() -> Iterator[int]:
    """The pid of a live process that is no child's parent here (1 would be ours where we run as init)."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _step(command: list[str], parent: int, **popen: Any) -> subprocess.Popen[str]:
    """The step started as it is (not through start_rank, which waits for its exec)."""
    answer, status = os.pipe()
    try:
        with sigint_blocked():
            return subprocess.Popen(rank_argv(command, parent, status, os.environ), pass_fds=[status], text=True,
                                    **popen)
    finally:
        os.close(answer)
        os.close(status)


def _show(**popen: Any) -> tuple[int, int, int]:
    proc = start_rank([PY, "-c", SHOW], os.environ, stdout=subprocess.PIPE, text=True, **popen)
    out, _ = proc.communicate(timeout=60)
    pid, sig = map(int, out.split())
    return proc.pid, pid, sig


def test_a_rank_is_its_command_ending_with_its_parent_and_writing_to_a_tostop_terminal():
    started, pid, sig = _show()
    assert pid == started and sig == signal.SIGTERM  # exec: the pid the launcher holds (and signals)
    # The signals the command starts with ignored (a Python command would ignore SIGPIPE itself): SIGTTOU,
    # not the interpreter's SIGPIPE and SIGXFSZ (beside whatever this process ignores, inherited as ever).
    proc = start_rank(["cat", "/proc/self/status"], os.environ, stdout=subprocess.PIPE, text=True)
    status = proc.communicate(timeout=60)[0]
    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    ours = {sig for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT) if signal.getsignal(sig) == signal.SIG_IGN}
    assert {sig for sig in signal.Signals if ignored & (1 << (sig - 1))} == {signal.SIGTTOU, *ours}
    assert blocked == 0


def test_a_rank_started_off_the_main_thread_does_not_end_with_it():
    """The kernel's signal follows the thread that started the child: one started by a thread that ends would
    be stopped while we live."""
    got: list[tuple[int, int, int]] = []
    thread = threading.Thread(target=lambda: got.append(_show()))
    thread.start()
    thread.join()
    assert got[0][2] == 0


@pytest.mark.parametrize("delay", [0.0, 0.002, 0.01, 0.03])
def test_a_ctrl_c_passed_on_while_the_step_runs_ends_the_rank_silently(delay):
    """The launcher passes a Ctrl-C on to its ranks; one that reaches a rank still in this step (an interpreter
    of its own) ended it with a KeyboardInterrupt's traceback. SIGINT's default action now, whenever it comes."""
    proc = _step(["sleep", "30"], os.getpid(), stderr=subprocess.PIPE)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (-signal.SIGINT, "")


def test_a_rank_whose_parent_is_gone_already_does_not_start(not_our_parent):
    proc = _step([PY, "-c", "print('ran')"], not_our_parent, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == ENDED_STATUS and out == ""


def _exec_error(start: Any) -> tuple[int, str]:
    with pytest.raises(OSError) as info:
        start()
    return info.value.errno, info.value.strerror


@pytest.mark.parametrize("case", ["missing", "not executable", "no interpreter line", "missing interpreter"])
def test_a_rank_that_cannot_be_execd_is_the_error_popen_gives(tmp_path, case):
    """As subprocess does, the step tells the launcher a failed exec (its errno): one LaunchError line, not a
    rank's exit status 127 per rank."""
    program = tmp_path / "train"
    if case != "missing":
        program.write_text({"not executable": "#!/bin/sh\n", "no interpreter line": "\x7fELF garbage",
                            "missing interpreter": "#!/nonexistent/python\n"}[case])
    if case != "not executable" and case != "missing":
        program.chmod(0o755)
    want = _exec_error(lambda: subprocess.Popen([str(program)]))
    assert _exec_error(lambda: start_rank([str(program)], os.environ)) == want


@pytest.mark.parametrize("value", [None, "C", "C.UTF-8"])
def test_a_rank_gets_lc_ctype_as_the_launcher_gave_it(value):
    """The step's interpreter coerces a C locale (``-I`` ignores PYTHONCOERCECLOCALE) by setting LC_CTYPE in
    its environment, which exec would hand on to the command."""
    env = {"PATH": os.environ["PATH"], "LANG": "C"}
    if value is not None:
        env["LC_CTYPE"] = value
    proc = start_rank(["env"], env, stdout=subprocess.PIPE, text=True)
    shown = dict(line.split("=", 1) for line in proc.communicate(timeout=60)[0].splitlines() if "=" in line)
    assert shown.get("LC_CTYPE") == value and shown.get("LANG") == "C"


@pytest.mark.parametrize("parent, asked, ok", [(None, 0, True), ("self", signal.SIGTERM, True),
                                               ("other", signal.SIGTERM, False)])
def test_a_daemon_ends_with_the_parent_its_environment_names(not_our_parent, parent, asked, ok):
    code = ("from bps_runtime.orphans import end_with_parent\n"
            "import ctypes\n"
            "ok = end_with_parent()\n"
            "got = ctypes.c_int(0)\n"
            "ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0)\n"
            "print(ok, got.value)\n")
    env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    if parent is not None:
        env[PARENT_ENV] = str(os.getpid() if parent == "self" else not_our_parent)
    proc = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(ok), str(int(asked))]
