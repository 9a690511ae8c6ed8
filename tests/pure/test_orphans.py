"""The step that makes the launcher's processes end with it (bps_runtime.orphans), without a cluster."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from bps_runtime.orphans import ENDED_STATUS, PARENT_ENV, rank_argv, sigint_blocked
from bps_worker.launch import _why_unstartable

PY = sys.executable
# What a command sees of the step: its pid and its parent-death signal.
SHOW = ("import ctypes, os\n"
        "got = ctypes.c_int(0)\n"
        "ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0)\n"  # PR_GET_PDEATHSIG
        "print(os.getpid(), got.value)\n")


def test_a_rank_is_its_command_ending_with_its_parent_and_writing_to_a_tostop_terminal():
    started = subprocess.Popen(rank_argv([PY, "-c", SHOW], os.getpid()), stdout=subprocess.PIPE, text=True)
    out, _ = started.communicate(timeout=60)
    pid, sig = map(int, out.split())
    assert pid == started.pid and sig == signal.SIGTERM  # exec: the pid the launcher holds (and signals)
    # The signals the command starts with ignored (a Python command would ignore SIGPIPE itself): SIGTTOU,
    # not the interpreter's SIGPIPE and SIGXFSZ (beside whatever this process ignores, inherited as ever).
    status = subprocess.run(rank_argv(["cat", "/proc/self/status"], os.getpid()), capture_output=True, text=True,
                            timeout=60).stdout
    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    ours = {sig for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT) if signal.getsignal(sig) == signal.SIG_IGN}
    assert {sig for sig in signal.Signals if ignored & (1 << (sig - 1))} == {signal.SIGTTOU, *ours}


@pytest.mark.parametrize("delay", [0.0, 0.002, 0.01, 0.03])
def test_a_ctrl_c_passed_on_while_the_step_runs_ends_the_rank_silently(delay):
    """The launcher passes a Ctrl-C on to its ranks; one that reaches a rank still in this step (an interpreter
    of its own) ended it with a KeyboardInterrupt's traceback. SIGINT's default action now, whenever it comes."""
    with sigint_blocked():
        proc = subprocess.Popen(rank_argv(["sleep", "30"], os.getpid()), stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (-signal.SIGINT, "")


def test_a_rank_whose_parent_is_gone_already_does_not_start():
    proc = subprocess.run(rank_argv([PY, "-c", "print('ran')"], parent=1), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == ENDED_STATUS and proc.stdout == ""


def test_a_rank_that_cannot_be_execd_says_why():
    proc = subprocess.run(rank_argv(["/nonexistent/train"], os.getpid()), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 127
    assert proc.stderr == "bps-launch: cannot start the training command '/nonexistent/train': " \
                          "No such file or directory\n"


@pytest.mark.parametrize("parent, asked, ok", [(None, 0, True), ("self", signal.SIGTERM, True),
                                               ("1", signal.SIGTERM, False)])
def test_a_daemon_ends_with_the_parent_its_environment_names(parent, asked, ok):
    code = ("from bps_runtime.orphans import end_with_parent\n"
            "import ctypes\n"
            "ok = end_with_parent()\n"
            "got = ctypes.c_int(0)\n"
            "ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0)\n"
            "print(ok, got.value)\n")
    env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    if parent is not None:
        env[PARENT_ENV] = str(os.getpid()) if parent == "self" else parent
    proc = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(ok), str(int(asked))]


def test_the_launcher_says_why_a_command_cannot_start(tmp_path):
    env = {"PATH": str(tmp_path)}
    (tmp_path / "not_executable").write_text("#!/bin/sh\n")
    (tmp_path / "train").write_text("#!/bin/sh\n")
    (tmp_path / "train").chmod(0o755)
    assert _why_unstartable("train", env) is None
    assert _why_unstartable(str(tmp_path / "train"), env) is None
    assert _why_unstartable("missing", env) == os.strerror(errno.ENOENT)
    assert _why_unstartable(str(tmp_path / "missing"), env) == os.strerror(errno.ENOENT)
    assert _why_unstartable("not_executable", env) == os.strerror(errno.EACCES)
    assert _why_unstartable(str(tmp_path / "not_executable"), env) == os.strerror(errno.EACCES)
