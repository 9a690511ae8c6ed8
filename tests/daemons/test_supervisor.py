"""bps_worker.supervise.Supervisor with stand-in daemons (small Python processes that speak the systemd
readiness protocol): the wait for READY=1, a daemon that dies during start-up, restart, the command prefix,
the wait for ranks, the layered stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bps_runtime.commands import LAUNCHER_ENV
from bps_runtime.orphans import PARENT_ENV
from bps_worker.supervise import Child, Cluster, DaemonCommand, LaunchError, Supervisor
from harness import write_config

PY = sys.executable
# argv: log file, label, seconds before READY=1 (negative: never), exit status instead of READY (or "")
STAND_IN = """
import os, signal, socket, sys, time
log, label, delay, status = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
def note(what):
    with open(log, "a") as f:
        f.write(f"{label} {what} {os.environ.get('STAND_IN_PREFIX', '-')}\\n")
def term(*_):
    note("term")
    time.sleep(0.2)  # a drain: the next layer must not be signalled before this one is gone
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
if status:
    sys.exit(int(status))
if delay >= 0:
    time.sleep(delay)
    note("ready")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto(b"READY=1", os.environ["NOTIFY_SOCKET"])
while True:
    time.sleep(1)
"""


def _command(log: Path, label: str, delay: float = 0.0, status: str = "", prefix: tuple[str, ...] = ()
             ) -> DaemonCommand:
    return DaemonCommand(label, (PY, "-c", STAND_IN, str(log), label, str(delay), status), prefix=prefix)


def _notes(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.timeout(60)
def test_launch_returns_once_every_daemon_is_ready_and_stop_goes_in_layers(tmp_path):
    log = tmp_path / "notes"
    sup = Supervisor(tmp_path)
    try:
        sup.launch([_command(log, "server-0", 0.3), _command(log, "worker-0", 0.6)])
        assert sorted(_notes(log)) == ["server-0 ready -", "worker-0 ready -"]
        rank = subprocess.Popen([PY, "-c", STAND_IN, str(log), "rank", "-1", ""])
        sup.children.append(Child("rank 0", rank, daemon=False))
        time.sleep(0.5)  # the rank has installed its SIGTERM handler
    finally:
        sup.stop()
    assert [n for n in _notes(log) if "term" in n] == ["rank term -", "worker-0 term -", "server-0 term -"]
    assert sup.children == []


@pytest.mark.timeout(60)
def test_a_daemon_that_exits_during_start_up_is_named(tmp_path):
    sup = Supervisor(tmp_path, log_dir=tmp_path / "logs")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "worker-1.log").write_text("an earlier run's last line\n")  # (logs are appended to)
    try:
        with pytest.raises(LaunchError, match="worker-1 exited with status 3 during start-up") as info:
            sup.launch([_command(tmp_path / "notes", "server-0", -1), _command(tmp_path / "notes", "worker-1",
                                                                               status="3")])
        assert info.value.label == "worker-1"
        # it wrote nothing: no line of its own (not the earlier run's), and where its log is
        assert str(info.value).endswith(f"during start-up (its log: {tmp_path / 'logs' / 'worker-1.log'})"), info.value
        assert (tmp_path / "logs" / "worker-1.log").exists()
        assert sup.log_tail("worker-1").startswith(f"; its log ({tmp_path / 'logs' / 'worker-1.log'})")
    finally:
        sup.stop()
    assert list(tmp_path.glob("notify-*")) == []


@pytest.mark.timeout(60)
def test_not_ready_in_time(tmp_path):
    sup = Supervisor(tmp_path, ready_timeout_s=0.5)
    try:
        with pytest.raises(LaunchError, match=r"not ready within 0.5 s \(0 of 1 daemons ready\)"):
            sup.launch([_command(tmp_path / "notes", "server-0", -1)])
    finally:
        sup.stop()


@pytest.mark.timeout(60)
def test_an_interrupt_ends_the_waits(tmp_path):
    sup = Supervisor(tmp_path, interrupted=lambda: True)
    try:
        with pytest.raises(KeyboardInterrupt):
            sup.launch([_command(tmp_path / "notes", "server-0", -1)])
        with pytest.raises(KeyboardInterrupt):
            sup.watch([])
    finally:
        sup.stop()


@pytest.mark.timeout(60)
def test_kill_and_restart_with_the_prefix(tmp_path):
    log = tmp_path / "notes"
    sup = Supervisor(tmp_path)
    try:
        sup.launch([_command(log, "server-2", prefix=("env", "STAND_IN_PREFIX=yes"))])
        first = sup.daemon("server-2").proc.pid
        with pytest.raises(LaunchError, match="still running"):
            sup.restart("server-2")
        sup.kill("server-2", signal.SIGKILL)
        assert sup.dead_daemon() is sup.daemon("server-2")
        sup.restart("server-2")
        assert sup.daemon("server-2").proc.pid != first and sup.dead_daemon() is None
        assert _notes(log) == ["server-2 ready yes", "server-2 ready yes"]
    finally:
        sup.stop()


@pytest.mark.timeout(60)
def test_watch_ends_at_the_first_failure_or_a_dead_daemon(tmp_path):
    sup = Supervisor(tmp_path)
    try:
        ranks = [Child(f"rank {i}", subprocess.Popen([PY, "-c", f"import sys, time; time.sleep({i} * 0.3); "
                                                               f"sys.exit({i})"]), daemon=False) for i in range(3)]
        sup.children.extend(ranks)
        ending = sup.watch(ranks, timeout=30)
        assert (ending.code, ending.reason, ending.culprit) == (1, "rank 1 exited with status 1", ranks[1])
        sup.launch([_command(tmp_path / "notes", "worker-0")])
        sleeper = Child("rank 3", subprocess.Popen([PY, "-c", "import time; time.sleep(30)"]), daemon=False)
        sup.children.append(sleeper)
        assert sup.watch([sleeper], timeout=0.3).reason == "ranks did not finish within 0.3 s"
        sup.kill("worker-0")
        ending = sup.watch([sleeper], timeout=30)
        assert ending.code == 1 and ending.culprit is sup.daemon("worker-0")
    finally:
        sup.stop()


def _ignores_sigint(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    sig_ign = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    return bool(sig_ign & (1 << (signal.SIGINT - 1)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", [True, False], ids=["launcher", "caller"])
def test_a_launchers_daemons_start_with_sigint_ignored_and_others_with_it_as_ours(tmp_path, launcher):
    """The launcher (a caller that learns of Ctrl-C itself, ``interrupted``) stops its daemons: they start
    with SIGINT ignored (bps_runtime.commands), so that a terminal's Ctrl-C is not a traceback from each.
    Other callers' daemons hear a Ctrl-C as before."""
    sup = Supervisor(tmp_path, interrupted=(lambda: False) if launcher else None)
    try:
        sup.launch([_command(tmp_path / "notes", "server-0", 0.0)])
        pid = sup.children[0].proc.pid
        assert _ignores_sigint(pid) == launcher
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert (f"{LAUNCHER_ENV}=1".encode() in environ) == launcher  # (the daemon keeps it ignored then)
    finally:
        sup.stop()


@pytest.mark.timeout(60)
def test_a_forkserver_that_cannot_start_is_a_launch_error_naming_the_daemon(tmp_path):
    """Its helper killed during its start (a Ctrl-C before it ignored SIGINT) was a traceback out of the
    launcher."""
    from bps_runtime.forkserver import Forkserver

    python = str(tmp_path / "python")  # (a "python" that exits at once: the helper dies during start-up)
    Path(python).write_text("#!/bin/sh\nexit 3\n")
    Path(python).chmod(0o755)
    forkserver = Forkserver(python)
    sup = Supervisor(tmp_path, forkserver=forkserver)
    try:
        with pytest.raises(LaunchError, match="server-0 did not start: the forkserver exited during start-up "
                                              "with status 3") as info:
            sup.launch([DaemonCommand("server-0", (python, "-m", "bps_server", "--config", "x", "--id", "0"))])
        assert info.value.label == "server-0"
    finally:
        sup.stop()
        forkserver.close()


@pytest.mark.timeout(60)
def test_a_daemon_command_that_cannot_be_started_is_a_launch_error_naming_it(tmp_path):
    sup = Supervisor(tmp_path)  # (the launcher's go through sh, whose exec fails: a status 127 during start-up)
    try:
        with pytest.raises(LaunchError, match="worker-0 did not start: .*No such file") as info:
            sup.launch([DaemonCommand("worker-0", (str(tmp_path / "no-such-python"), "-m", "bps_worker"))])
        assert info.value.label == "worker-0"
    finally:
        sup.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("thread", [False, True], ids=["main thread", "other thread"])
def test_a_launchers_daemons_end_with_it_only_when_started_on_its_main_thread(tmp_path, thread):
    """A launcher's daemons ask the kernel for SIGTERM when it ends (BPS_PARENT_PID, bps_runtime.orphans); the
    kernel follows the thread that started a child, so a daemon started from a thread that then ends asks
    nothing."""
    sup = Supervisor(tmp_path, interrupted=lambda: False)
    try:
        commands = [_command(tmp_path / "notes", "server-0", 0.0)]
        if thread:
            starter = threading.Thread(target=sup.launch, args=(commands,))
            starter.start()
            starter.join()
        else:
            sup.launch(commands)
        environ = Path(f"/proc/{sup.children[0].proc.pid}/environ").read_bytes().split(b"\0")
        assert (f"{PARENT_ENV}={os.getpid()}".encode() in environ) == (not thread)
    finally:
        sup.stop()


@pytest.mark.timeout(120)
def test_a_cluster_a_thread_started_outlives_that_thread(tmp_path, forked_daemons):
    """A cluster started (with ``interrupted``, as the launcher's) from a thread that then ended: its daemons
    asked for SIGTERM when their parent's starting thread ended, and were stopped while we lived."""
    config = write_config(tmp_path, [1], cpu_servers=1)
    cluster = Cluster(str(config), interrupted=lambda: False)
    try:
        starter = threading.Thread(target=cluster.start)
        starter.start()
        starter.join()
        assert len(cluster.children) == 3
        time.sleep(2.0)
        assert cluster.dead_daemon() is None
    finally:
        cluster.stop()
