"""The console scripts as users and systemd run them: exit codes, one-line reasons, readiness, signals."""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

import rank_programs as rp
from harness import daemon_logs, run_ranks, start_cluster, write_config

PY = sys.executable


@pytest.fixture(autouse=True, scope="module")
def _launchers_temporary_files() -> Iterator[None]:
    """The launchers these tests kill outright (SIGKILL, SIGQUIT) cannot remove their private directory: it goes
    in a directory of the tests' own (TMPDIR, short: a worker's socket may be moved into it), removed after them,
    not in /tmp (four a run were left there)."""
    where = tempfile.mkdtemp(prefix="bps-cli-")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", where)
        yield
    shutil.rmtree(where, ignore_errors=True)


def _run(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", *args], capture_output=True, text=True, timeout=timeout)


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("module", ["bps_server", "bps_worker"])
def test_bad_config_exits_2_naming_key_and_file(tmp_path, module):
    bad = tmp_path / "bad.toml"
    bad.write_text('[cluster]\nworkers = 1\nbogus = 3\n[[server]]\nid = 0\naddress = "127.0.0.1:1"\n'
                   '[[worker]]\nid = 0\nlocal_size = 1\nsocket = "/tmp/x.sock"\n')
    result = _run([module, "--config", str(bad), "--id", "0"])
    assert result.returncode == 2
    line = _one_line(result.stderr)
    assert "cluster.bogus" in line and str(bad) in line


@pytest.mark.parametrize("module", ["bps_server", "bps_worker", "bps_worker.launch"])
def test_a_cluster_file_that_is_not_utf8_exits_2_naming_the_file_and_the_byte(tmp_path, module):
    """tomllib reads UTF-8 only: a Latin-1 comment was a UnicodeDecodeError traceback (the server, the launcher), or
    the worker's message about its octal modes (a review's case)."""
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('[cluster]\nworkers = 1  # caf\u00e9\n'.encode("latin-1"))
    result = _run([module, "--config", str(bad), *(["--", "true"] if module.endswith("launch") else ["--id", "0"])])
    assert result.returncode == 2, result
    line = _one_line(result.stderr)
    assert f"{bad}: not valid TOML: not UTF-8 (byte 0xe9 on line 2)" in line, line


def test_a_worker_mode_that_is_not_octal_exits_2_naming_both_modes(tmp_path):
    config = write_config(tmp_path, [1], cpu_servers=0)
    result = _run(["bps_worker", "--config", str(config), "--id", "0", "--socket-mode", "9x"])
    assert result.returncode == 2, result
    assert _one_line(result.stderr) == "bps-worker: --socket-mode and --shm-mode must be octal, got '9x', '600'"


def test_an_arena_below_one_slab_exits_2_naming_the_key_and_the_least_value(tmp_path):
    """Under 4 MiB no slab of small tensors fit: the daemon started, and every small tensor failed at run time."""
    config = write_config(tmp_path, [1], cpu_servers=0, cluster={"arena_bytes": 2 << 20})
    result = _run(["bps_worker", "--config", str(config), "--id", "0"])
    assert result.returncode == 2
    assert _one_line(result.stderr) == f"bps-worker: {config}: cluster.arena_bytes must be at least 4194304 " \
                                       "(4 MiB: the slabs small tensors share), got 2097152"


def test_a_socket_path_too_long_for_a_unix_socket_exits_2_naming_the_key_the_length_and_the_limit(tmp_path):
    """It failed at bind with "AF_UNIX path too long", exit status 1, naming neither the key nor the limit."""
    config = write_config(tmp_path, [1], cpu_servers=0)
    long = f"{tmp_path}/{'s' * 100}.sock"
    size = len(long.encode())
    config.write_text(config.read_text().replace(f"{tmp_path}/w0.sock", long))
    result = _run(["bps_worker", "--config", str(config), "--id", "0"])
    assert result.returncode == 2
    assert _one_line(result.stderr) == f"bps-worker: {config}: worker[0].socket (the [[worker]] with id = 0) is " \
                                       f"{size} bytes long; a Unix socket's path may have at most 107 bytes"
    config.write_text(config.read_text().replace(long, f"{tmp_path}/w0.sock"))
    result = _run(["bps_worker", "--config", str(config), "--id", "0", "--socket", long])
    assert result.returncode == 2
    assert _one_line(result.stderr) == f"bps-worker: --socket {long!r} is {size} bytes long; a Unix socket's path " \
                                       "may have at most 107 bytes"


@pytest.mark.parametrize("module", ["bps_server", "bps_worker"])
def test_a_log_file_that_cannot_be_opened_is_one_line(tmp_path, module):
    config = write_config(tmp_path, [1], cpu_servers=0)
    result = _run([module, "--config", str(config), "--id", "0", "--log-file", str(tmp_path / "no" / "d.log")])
    assert result.returncode == 2
    assert _one_line(result.stderr) == f"{module.replace('_', '-')}: cannot open --log-file {tmp_path}/no/d.log: " \
                                       "No such file or directory"


@pytest.mark.parametrize("module", ["bps_server", "bps_worker"])
def test_a_timeline_that_cannot_be_written_is_one_line(tmp_path, module):
    """It was os.makedirs' traceback (a review)."""
    config = write_config(tmp_path, [1], cpu_servers=0)
    result = _run([module, "--config", str(config), "--id", "0", "--timeline", "/proc/nope/t.json"])
    assert result.returncode == 1
    assert _one_line(result.stderr) == f"{module.replace('_', '-')}: cannot write the timeline /proc/nope/t.json: " \
                                       "No such file or directory"


def test_a_huge_worker_count_is_one_line(tmp_path):
    """cluster.workers = 10**12 built a list of that many ids to compare: a MemoryError traceback (a review)."""
    config = write_config(tmp_path, [1], cpu_servers=0)
    config.write_text(config.read_text().replace("workers = 1\n", "workers = 1000000000000\n"))
    result = _run(["bps_server", "--config", str(config), "--id", "0"])
    assert result.returncode == 2
    assert "cluster.workers = 1000000000000 needs [[worker]] tables" in _one_line(result.stderr)


def test_the_launcher_refuses_an_unknown_log_level_before_starting_anything(tmp_path):
    """It passed it to every daemon, which refused it: "server-0 exited with status 2 during start-up"."""
    config = write_config(tmp_path, [1], cpu_servers=0)
    result = _run(["bps_worker.launch", "--config", str(config), "--log-level", "bogus", "--", PY, "-c", "pass"])
    assert result.returncode == 2 and "argument --log-level: invalid choice: 'bogus'" in result.stderr
    assert "exited" not in result.stderr


def test_unknown_id_exits_2(tmp_path):
    config = write_config(tmp_path, [1], cpu_servers=0)
    result = _run(["bps_server", "--config", str(config), "--id", "9"])
    assert result.returncode == 2 and "id = 9" in _one_line(result.stderr)


@contextlib.contextmanager
def _server_port_taken(config: Path) -> Iterator[int]:
    """A port listened on here, written into ``config`` as its server's address, for the block."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        config.write_text(re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{port}", config.read_text()))
        yield port


def test_busy_port_exits_1_with_one_line(tmp_path):
    config = write_config(tmp_path, [1], cpu_servers=0)
    with _server_port_taken(config) as port:
        result = _run(["bps_server", "--config", str(config), "--id", "0"])
    assert result.returncode == 1
    line = _one_line(result.stderr)  # the reason alone (no log line of a start that did not happen: a review)
    assert line.startswith("bps-server:") and "cannot listen" in line and str(port) in line, result.stderr


@pytest.mark.parametrize("module", ["bps_server", "bps_worker"])
def test_busy_metrics_port_exits_1_naming_it(tmp_path, module):
    config = write_config(tmp_path, [1], cpu_servers=0, metrics=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        # (only the daemon's own: two daemons' one address is refused by the config's validation, exit 2)
        text = config.read_text()
        table = "[[server]]" if module == "bps_server" else "[[worker]]"
        start = text.index(table)
        config.write_text(text[:start] + re.sub(r'metrics = "127\.0\.0\.1:\d+"', f'metrics = "127.0.0.1:{port}"',
                                                text[start:], count=1))
        result = _run([module, "--config", str(config), "--id", "0"])
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"{module.replace('_', '-')}: cannot listen on metrics address "
                                          f"127.0.0.1:{port}: Address already in use"], result.stderr
    assert "Traceback" not in result.stderr and "Task was destroyed" not in result.stderr, result.stderr


def test_a_log_directory_the_launcher_cannot_make_is_one_line(tmp_path):
    config = write_config(tmp_path, [1], cpu_servers=0)
    result = subprocess.run([PY, "-m", "bps_worker.launch", "--config", str(config), "--log-dir", "/proc/nope",
                             "--", PY, "-c", "pass"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["bps-launch: server-0: cannot write its log in /proc/nope: No such "
                                                  "file or directory"], result.stderr
    assert _pids_with(str(config)) == {}


@pytest.mark.usefixtures("forked_daemons")  # (about the launcher's line, not the daemons' start)
def test_a_daemon_that_cannot_start_under_a_log_dir_is_one_line_with_its_reason_and_log(tmp_path):
    """With ``--log-dir`` a daemon's stderr goes to its log: the launcher's line said only that it exited."""
    config = write_config(tmp_path, [1], cpu_servers=0)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "server-0.log").write_text("an earlier run's last line\n")  # (logs are appended to)
    with _server_port_taken(config) as port:
        result = subprocess.run([PY, "-m", "bps_worker.launch", "--config", str(config), "--log-dir",
                                 str(tmp_path / "logs"), "--", PY, "-c", "pass"], capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"bps-launch: server-0 exited with status 1 during start-up: bps-server: cannot listen on 127.0.0.1:{port}: "
        f"Address already in use (its log: {tmp_path / 'logs' / 'server-0.log'})"], result.stderr
    assert _pids_with(str(config)) == {}


@pytest.mark.usefixtures("forked_daemons")
def test_a_second_launch_of_a_running_cluster_file_says_why_and_leaves_the_first_alone(tmp_path):
    """The launcher starts the servers first and the workers once every server listens. A second launch of a
    cluster file whose cluster runs stops at its servers' busy ports: before, its workers started beside them,
    connected to the running cluster's servers and were refused there as second daemons of their ids, a
    screenful of lines in both launches before the one that said why."""
    config = write_config(tmp_path, [1, 1], cpu_servers=1)
    first = start_cluster(config, log_dir=tmp_path / "first")
    try:
        ports = sorted(int(port) for port in re.findall(r"127\.0\.0\.1:(\d+)", config.read_text()))
        result = subprocess.run([PY, "-m", "bps_worker.launch", "--config", str(config), "--", PY, "-c",
                                 "print('ran')"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 1 and "ran" not in result.stdout, result.stderr
        # One line of the launcher's, and each server's reason; in any order (a server still starting when the
        # launcher said its line may say its own after it).
        lines = result.stderr.strip().splitlines()
        launcher = [line for line in lines if line.startswith("bps-launch:")]
        assert len(launcher) == 1 and re.fullmatch(r"bps-launch: server-\d exited with status 1 during start-up",
                                                   launcher[0]), result.stderr
        busy = [int(m.group(1)) for line in lines
                if (m := re.fullmatch(r"bps-server: cannot listen on 127\.0\.0\.1:(\d+): Address already in use",
                                      line))]
        assert busy and len(busy) == len(lines) - 1 and set(busy) <= set(ports), result.stderr
        logs = daemon_logs(first)
        assert "second daemon" not in logs and "refused" not in logs, logs[-3000:]
        # The running cluster never noticed: its sums are exact.
        cases = [("after", "float32", (1000,), False, 1)]
        assert all(r["exact"] for report in run_ranks(first, rp.sum_cases, cases) for r in report)
    finally:
        first.stop()


def _notify_socket(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    return sock, path


@pytest.mark.parametrize("module", ["bps_server", "bps_worker"])
def test_ready_notification_and_clean_sigterm(tmp_path, module):
    config = write_config(tmp_path, [1], cpu_servers=0)
    notify, path = _notify_socket(tmp_path)
    proc = subprocess.Popen([PY, "-m", module, "--config", str(config), "--id", "0"],
                            env=dict(os.environ, NOTIFY_SOCKET=path), stderr=subprocess.PIPE, text=True)
    try:
        while (message := notify.recv(100)) != b"READY=1":
            assert message.startswith(b"STATUS="), message  # what the daemon waits for, before it is ready
        if module == "bps_worker":
            sock_path = str(tmp_path / "w0.sock")
            assert os.stat(sock_path).st_mode & 0o777 == 0o600
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()
    if module == "bps_worker":
        assert not os.path.exists(tmp_path / "w0.sock"), "socket file left behind"


@pytest.mark.parametrize("module", ["bps_server", "bps_worker"])
def test_a_fatal_signal_writes_the_daemons_python_stacks(tmp_path, module):
    """A daemon that a bus error ends (a segment truncated under a sum) says where: every thread's Python stack on
    stderr, for the journal (it died with nothing but systemd's "status=7/BUS")."""
    config = write_config(tmp_path, [1], cpu_servers=0)
    notify, path = _notify_socket(tmp_path)
    proc = subprocess.Popen([PY, "-m", module, "--config", str(config), "--id", "0"],
                            env=dict(os.environ, NOTIFY_SOCKET=path), stderr=subprocess.PIPE, text=True)
    try:
        while notify.recv(100) != b"READY=1":
            pass
        proc.send_signal(signal.SIGBUS)
        _, stderr = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, stderr)
    assert "Fatal Python error: Bus error" in stderr, stderr
    assert re.search(rf"File \".*/{module}/main\.py\", line \d+ in main", stderr), stderr


def _quiet(stderr: str) -> bool:
    """No stack of any process in ``stderr`` (a ``KeyboardInterrupt`` shown or swallowed: "Exception ignored")."""
    return "Traceback" not in stderr and "Exception ignored" not in stderr and "KeyboardInterrupt" not in stderr


INTERRUPTED = 128 + signal.SIGINT

# After the mark below: within the daemon's imports, numba's warm-up (which calls back through ctypes), its start.
START_UP_DELAYS_S = [0.0, 0.1, 0.25, 1.0]


def _mapped(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _wait_for(what, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline
        time.sleep(0.005)


@pytest.mark.parametrize("module", ["bps_server", "bps_worker"])
@pytest.mark.parametrize("delay", START_UP_DELAYS_S)
def test_ctrl_c_while_a_daemon_starts_stops_it_without_a_traceback(tmp_path, module, delay):
    """A Ctrl-C before the daemon handles signals itself was a traceback, or, inside numba's warm-up, a
    KeyboardInterrupt printed as "Exception ignored" and lost: the daemon went on and never stopped. Sent once
    the daemon imports numba (the interpreter's own start, before any of our code runs, is not ours)."""
    config = write_config(tmp_path, [1], cpu_servers=0)
    proc = subprocess.Popen([PY, "-m", module, "--config", str(config), "--id", "0"], stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_for(lambda: _mapped(proc.pid, "numba") or proc.poll() is not None)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    # Interrupted while starting, or a clean stop once it served. (-SIGINT: a KeyboardInterrupt raised inside
    # code that exec() built, as dataclasses' and numba's, makes the interpreter end by the signal after
    # the guard's exit; a shell shows 130 either way.)
    assert code in (INTERRUPTED, -signal.SIGINT, 0), (code, stderr)
    assert _quiet(stderr), stderr
    assert not os.path.exists(tmp_path / "w0.sock")


# A SIGINT while a compiled module registers its memoryview types with collections.abc (numpy.random, which numba
# imports): inside a bare ``except``, where a KeyboardInterrupt is swallowed (found by a review's reproducer).
SWALLOWED_SIGINT = """import abc, os, signal, sys
register = abc.ABCMeta.register
fired = []
def register_then_interrupt(cls, subclass):
    if not fired and subclass.__name__ == "_memoryviewslice":
        fired.append(1)
        os.kill(os.getpid(), signal.SIGINT)
    return register(cls, subclass)
abc.ABCMeta.register = register_then_interrupt
import atexit
atexit.register(lambda: os.write(2, b"fired\\n" if fired else b"not fired\\n"))
from bps_runtime.commands import run_command
run_command(sys.argv.pop(1))
"""


@pytest.mark.parametrize("module", ["bps_server.main", "bps_worker.main"])
def test_a_ctrl_c_swallowed_by_an_import_still_stops_a_daemon_run_by_hand(tmp_path, module):
    """Before, the daemon went on and served for ever."""
    config = write_config(tmp_path, [1], cpu_servers=0)
    result = subprocess.run([PY, "-c", SWALLOWED_SIGINT, module, "--config", str(config), "--id", "0"],
                            capture_output=True, text=True, timeout=60)
    assert "fired" in result.stderr.splitlines() and result.returncode in (INTERRUPTED, -signal.SIGINT), result
    assert "listening" not in result.stderr and _quiet(result.stderr), result.stderr


@pytest.mark.parametrize("launcher", [False, True], ids=["background-job", "launcher"])
def test_sigint_ignored_is_kept_only_for_the_launcher(tmp_path, launcher):
    """A daemon that a shell script runs in the background (SIGINT ignored, as shells start background jobs)
    stops on SIGINT as ever; one the launcher started (its variable set) leaves SIGINT to the launcher."""
    from bps_runtime.commands import LAUNCHER_ENV

    config = write_config(tmp_path, [1], cpu_servers=0)
    notify, path = _notify_socket(tmp_path)
    env = dict(os.environ, NOTIFY_SOCKET=path)
    env.pop(LAUNCHER_ENV, None)
    if launcher:
        env[LAUNCHER_ENV] = "1"
    proc = subprocess.Popen(["/bin/sh", "-c", 'trap "" INT; exec "$@"', "sh", PY, "-m", "bps_server",
                             "--config", str(config), "--id", "0"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(notify)
        proc.send_signal(signal.SIGINT)
        if launcher:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=1.5)
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
    finally:
        notify.close()
        if proc.poll() is None:
            proc.kill()
    assert code == 0, proc.stderr.read()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.parametrize("forked", [False, True], ids=["exec", "forkserver"])
@pytest.mark.parametrize("delay", START_UP_DELAYS_S[::2] + START_UP_DELAYS_S[-1:])
def test_ctrl_c_while_the_launcher_starts_the_cluster_is_one_line(tmp_path, request, delay, forked):
    """A terminal's Ctrl-C reaches the launcher and its daemons at once; while they started, every daemon
    printed a traceback (several screens for one key press). Sent once the launcher has started a daemon (or
    the forkserver's helper, which forks them)."""
    if forked:
        request.getfixturevalue("forked_daemons")
    config = write_config(tmp_path, [2], cpu_servers=1)
    script = tmp_path / "rank.py"  # (a rank's own KeyboardInterrupt is its script's: this one stops quietly)
    script.write_text("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_DFL)\n"
                      "import bps_worker.client as bps\nbps.init()\ntime.sleep(60)\n")
    # The rank's own interpreter starts with SIGINT ignored until the script's first line: a Ctrl-C while it
    # imports its site module is Python's fatal error, as for any program started at that instant (under
    # torchrun too), and not the launcher's to silence. (One that comes then is lost: the launcher kills the
    # rank after its grace period.)
    rank = ["/bin/sh", "-c", 'trap "" INT; exec "$@"', "sh", PY, str(script)]
    proc = subprocess.Popen([PY, "-m", "bps_worker.launch", "--config", str(config), "--", *rank],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(lambda: _children(proc.pid) or proc.poll() is not None)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stderr = proc.stderr.read()
    assert _quiet(stderr), stderr
    assert code == INTERRUPTED and "bps-launch: interrupted (SIGINT); cluster stopped" in stderr, (code, stderr)
    assert _pids_with(str(script)) == {}, "ranks left running"
    # Daemons (forked ones show the forkserver's command line, not the config's) and the forkserver's helper are
    # in the launcher's process group: none of it may be left.
    _wait_for(lambda: not _group_members(proc.pid), timeout=15)


def _group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGQUIT])
def test_a_signal_to_the_launchers_process_group_reaches_its_daemons(tmp_path, signum):
    """``kill -KILL -PGID``, ``timeout -s KILL`` or Ctrl-\\ stop the launcher's daemons with it: they share its
    process group (ignoring only SIGINT, which the launcher forwards as it stops them)."""
    config, script, proc = _launch_sleepers(tmp_path)
    try:
        assert proc.stdout.readline().strip() == "up"
        os.killpg(proc.pid, signum)
        proc.wait(timeout=30)
        _wait_for(lambda: not _pids_with(str(config)), timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in _pids_with(str(script)):  # (the ranks have groups of their own, as under torchrun)
            os.kill(pid, signal.SIGKILL)


def _scheduler_free_env(**extra: str) -> dict[str, str]:
    """This environment without any variable a daemon takes its id from, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("BPS_ID", "BPS_ID_OFFSET", "JOB_COMPLETION_INDEX") and not k.startswith("SLURM_")}
    return {**env, **extra}


def _wait_ready(notify: socket.socket) -> None:
    while notify.recv(4096) != b"READY=1":  # a STATUS= line may come first
        pass


@pytest.mark.parametrize("module, env, label, source", [
    ("bps_server", {"JOB_COMPLETION_INDEX": "0", "BPS_ID_OFFSET": "2"}, "server",
     "server id 2, from JOB_COMPLETION_INDEX=0 + BPS_ID_OFFSET=2"),
    ("bps_worker", {"SLURM_NODEID": "1", "SLURM_PROCID": "1"}, "worker", "worker id 1, from SLURM_NODEID=1"),
])
def test_a_daemon_without_id_takes_it_from_the_scheduler_and_says_which(tmp_path, module, env, label, source):
    config = write_config(tmp_path, [1, 1], cpu_servers=1)
    notify, path = _notify_socket(tmp_path)
    proc = subprocess.Popen([PY, "-m", module, "--config", str(config)],
                            env=_scheduler_free_env(NOTIFY_SOCKET=path, **env), stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(notify)
        if label == "server":  # it serves server 2's address, the CPU-only one
            port = int(re.findall(r'address = "127\.0\.0\.1:(\d+)"', config.read_text())[2])
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        else:
            assert stat.S_ISSOCK(os.stat(tmp_path / "w1.sock").st_mode)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert source in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()


@pytest.mark.parametrize("module", ["bps_server", "bps_worker"])
@pytest.mark.parametrize("env, reason", [
    ({}, "no --id given and none of BPS_ID, JOB_COMPLETION_INDEX, SLURM_NODEID is set"),
    ({"JOB_COMPLETION_INDEX": "0", "SLURM_NODEID": "1"}, "names two machines"),
    ({"SLURM_NODEID": "0", "SLURM_PROCID": "1"}, "several tasks on a node"),
])
def test_a_missing_or_ambiguous_id_exits_2_with_one_line(tmp_path, module, env, reason):
    config = write_config(tmp_path, [1], cpu_servers=0)
    result = subprocess.run([PY, "-m", module, "--config", str(config)], env=_scheduler_free_env(**env),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    line = _one_line(result.stderr)
    assert line.startswith(module.replace("_", "-") + ":") and reason in line


def test_a_worker_that_cannot_reach_a_server_says_so_once_a_timeout(tmp_path):
    """Nothing listens at the server's address: the worker logs it once it has failed for the timeout, then once a
    timeout (it logged nothing at all: a down server or a typo'd host looked like an idle, healthy worker; only a
    process's error said why, a review). Not at its first attempts: workers may start before their servers."""
    config = write_config(tmp_path, [1], cpu_servers=0, cluster={"timeout": 2.0})
    port = int(re.findall(r"127\.0\.0\.1:(\d+)", config.read_text())[0])  # (free: nobody listens there)
    worker = subprocess.Popen([PY, "-m", "bps_worker", "--config", str(config), "--id", "0"], stderr=subprocess.PIPE,
                              text=True)
    lines: list[str] = []
    try:
        assert worker.stderr is not None
        deadline = time.monotonic() + 30
        while sum(" WARNING " in line for line in lines) < 2 and time.monotonic() < deadline:
            if select.select([worker.stderr], [], [], max(0.0, deadline - time.monotonic()))[0]:
                lines.append(worker.stderr.readline())
    finally:
        worker.send_signal(signal.SIGTERM)
        _, rest = worker.communicate(timeout=30)
    stderr = "".join(lines) + rest
    assert worker.returncode == 0, stderr
    said = [line.split(" ", 2) for line in stderr.splitlines() if " WARNING " in line]  # [day, time, the rest]
    assert len(said) >= 2, stderr
    for _, _, text in said:
        assert re.fullmatch(rf"bps\.worker\.link WARNING cannot reach server 0 at 127\.0\.0\.1:{port} for \d+ s: "
                            rf".*refused.* \(retrying\)", text, re.IGNORECASE), stderr
    first, second = (datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S,%f") for day, clock, _ in said[:2])
    assert (second - first).total_seconds() >= 1.9, stderr  # once a timeout, not at every attempt (each second)
    assert int(said[0][2].split(" for ")[1].split()[0]) >= 2, stderr  # (not before the timeout)


def test_worker_refuses_a_socket_in_use(tmp_path):
    config = write_config(tmp_path, [1], cpu_servers=0)
    notify, path = _notify_socket(tmp_path)
    first = subprocess.Popen([PY, "-m", "bps_worker", "--config", str(config), "--id", "0"],
                             env=dict(os.environ, NOTIFY_SOCKET=path), stderr=subprocess.DEVNULL)
    try:
        while (message := notify.recv(100)) != b"READY=1":
            assert message.startswith(b"STATUS="), message  # what the daemon waits for, before it is ready
        result = _run(["bps_worker", "--config", str(config), "--id", "0"])
        assert result.returncode == 1
        assert "in use" in _one_line(result.stderr) and result.stderr.startswith("bps-worker:"), result.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=15)
        notify.close()


def test_stale_socket_file_is_replaced(tmp_path):
    config = write_config(tmp_path, [1], cpu_servers=0)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "w0.sock"))
    stale.close()  # the file stays, nobody listens: what a crashed daemon leaves
    notify, path = _notify_socket(tmp_path)
    proc = subprocess.Popen([PY, "-m", "bps_worker", "--config", str(config), "--id", "0"],
                            env=dict(os.environ, NOTIFY_SOCKET=path), stderr=subprocess.DEVNULL)
    try:
        while (message := notify.recv(100)) != b"READY=1":
            assert message.startswith(b"STATUS="), message  # what the daemon waits for, before it is ready
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        notify.close()


def test_a_socket_path_that_names_another_file_is_refused_and_the_file_kept(tmp_path):
    """A failed connect made any file at the socket path "a stale socket": a typo'd --socket naming a file (a
    token, a config) removed it, and the stop removed the socket bound in its place (a review)."""
    config = write_config(tmp_path, [1], cpu_servers=0)
    precious = tmp_path / "precious.txt"
    precious.write_text("precious data")
    result = _run(["bps_worker", "--config", str(config), "--id", "0", "--socket", str(precious)])
    assert result.returncode == 1
    line = [line for line in result.stderr.splitlines() if line.startswith("bps-worker:")][0]
    assert line.startswith(f"bps-worker: cannot listen on {precious}: {precious} exists and is not a socket; not "
                           f"removed"), result.stderr
    assert precious.read_text() == "precious data"


@pytest.mark.parametrize("module", ["bps_server", "bps_worker"])
def test_a_daemon_started_with_its_standard_output_closed_stops_cleanly(tmp_path, module):
    """``bps-server ... >&-`` (a supervisor that closes it): uvloop aborted at the stop (it asserts fd > 2 when
    it closes a descriptor), exit status 134 instead of 0 (a review)."""
    config = write_config(tmp_path, [1], cpu_servers=0)
    notify, path = _notify_socket(tmp_path)
    proc = subprocess.Popen(["bash", "-c", f'exec "$0" -m {module} --config {config} --id 0 >&-', PY],
                            env=dict(os.environ, NOTIFY_SOCKET=path), stderr=subprocess.PIPE, text=True)
    try:
        while (message := notify.recv(100)) != b"READY=1":
            assert message.startswith(b"STATUS="), message
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()
    assert proc.stderr is not None and "Assertion" not in proc.stderr.read()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_worker_refuses_a_socket_directory_of_another_user(tmp_path):
    """Issue 14, item 11: another user's directory could have its socket swapped; the daemon refuses it."""
    config = write_config(tmp_path, [1], cpu_servers=0)
    squatted = tmp_path / "squatted"
    squatted.mkdir(mode=0o755)
    os.chown(squatted, 65534, -1)
    result = _run(["bps_worker", "--config", str(config), "--id", "0", "--socket", str(squatted / "w0.sock")])
    assert result.returncode == 1
    line = [l for l in result.stderr.splitlines() if l.startswith("bps-worker:")][0]
    assert str(squatted) in line and "owned by uid 65534" in line
    assert not (squatted / "w0.sock").exists()


def test_launcher_runs_a_script_on_every_rank(tmp_path):
    config = write_config(tmp_path, [2, 1], cpu_servers=1)
    script = tmp_path / "job.py"
    out = tmp_path / "out"
    out.mkdir()
    script.write_text(
        "import os, numpy as np, bps_worker.client as bps\n"
        "bps.init()\n"
        "y = bps.push_pull(np.array([bps.rank() + 1.0]), 'x', average=False)\n"
        f"open(os.path.join({str(out)!r}, str(bps.rank())), 'w').write(str(y[0]) + ' ' + os.environ['BPS_JOB'])\n"
        "bps.shutdown()\n")
    result = subprocess.run([PY, "-m", "bps_worker.launch", "--config", str(config), "--", PY, str(script)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(out)) == ["0", "1", "2"]
    said = {(out / r).read_text() for r in "012"}
    assert len(said) == 1 and re.fullmatch(r"6\.0 [0-9a-f]{16}", said.pop()), said  # one job: BPS_JOB, the same


@pytest.mark.usefixtures("forked_daemons")  # about the straggler report / token, not the daemons' start
def test_launcher_reports_the_straggler(tmp_path):
    config = write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"partition_bytes": 65536})
    script = tmp_path / "late.py"
    script.write_text(  # worker 1's process pushes each step 0.3 s after worker 0's
        "import os, time, numpy as np, bps_worker.client as bps\n"
        "bps.init()\n"
        "bps.push_pull(np.zeros(100_000, np.float32), 'sync')\n"
        "for _ in range(3):\n"
        "    if os.environ['BPS_WORKER_ID'] == '1':\n"
        "        time.sleep(0.3)\n"
        "    bps.push_pull(np.ones(100_000, np.float32), 'g')\n"
        "bps.shutdown()\n")
    result = subprocess.run([PY, "-m", "bps_worker.launch", "--config", str(config), "--stragglers", "--",
                             PY, str(script)], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[1]: line for line in result.stderr.splitlines()
            if line.startswith("bps-launch: ") and line.split()[1] in ("0", "1")}
    assert sorted(rows) == ["0", "1"], result.stderr
    assert "straggler" in rows["1"] and "straggler" not in rows["0"], result.stderr
    assert rows["0"].split()[2] == rows["1"].split()[2]  # as many pushes from each


def test_a_training_command_that_cannot_start_is_one_line_and_stops_the_cluster(tmp_path):
    config = write_config(tmp_path, [2], cpu_servers=0)
    result = subprocess.run([PY, "-m", "bps_worker.launch", "--config", str(config), "--", str(tmp_path / "nope")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (f"bps-launch: cannot start the training command "
                                                     f"{str(tmp_path / 'nope')!r}: No such file or directory")
    assert "Traceback" not in result.stderr and _pids_with(str(config)) == {}


def test_launcher_stops_everything_when_a_rank_fails(tmp_path):
    config = write_config(tmp_path, [2], cpu_servers=0)
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['BPS_RANK'] == '1': sys.exit(3)\n"
                      "time.sleep(60)\n")
    start = time.monotonic()
    result = subprocess.run([PY, "-m", "bps_worker.launch", "--config", str(config), "--", PY, str(script)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert "rank 1 exited with status 3" in result.stderr
    assert time.monotonic() - start < 30
    assert not os.path.exists(tmp_path / "w0.sock")


# Both ranks share the launcher's stdout: one write(2) per line, as print() makes two where PYTHONUNBUFFERED is
# set (as in many CI images), and two ranks' lines then interleave ("upup", "").
UP_THEN_SLEEP = "import bps_worker.client as bps, os, time\nbps.init()\nos.write(1, b'up\\n')\ntime.sleep(60)\n"


def _launch_sleepers(tmp_path: Path) -> tuple[Path, Path, subprocess.Popen[str]]:
    """bps-launch of 2 ranks that say "up" and sleep, in a session of its own: (config, script, launcher)."""
    config = write_config(tmp_path, [2], cpu_servers=1)
    script = tmp_path / "sleep.py"
    script.write_text(UP_THEN_SLEEP)
    proc = subprocess.Popen([PY, "-m", "bps_worker.launch", "--config", str(config), "--", PY, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return config, script, proc


def test_ctrl_c_stops_the_whole_cluster(tmp_path):
    config, _, proc = _launch_sleepers(tmp_path)
    try:
        assert proc.stdout.readline().strip() == "up"  # the cluster is up and a rank connected
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not os.path.exists(tmp_path / "w0.sock")
    leftovers = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if str(config) in cmdline:
            leftovers.append(entry)
    assert leftovers == [], "daemons left running"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_to_the_launcher_alone_stops_the_whole_cluster(tmp_path, signum):
    """``kill``, ``timeout``, a CI job's time limit or ``docker stop`` signal the launcher alone: it used to die
    at once and leave every daemon and rank running (and the next launch found the ports taken)."""
    config, script, proc = _launch_sleepers(tmp_path)
    try:
        assert proc.stdout.readline().strip() == "up"
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 128 + signum
        assert f"interrupted ({signal.Signals(signum).name}); cluster stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert _pids_with(str(config)) == {} and _pids_with(str(script)) == {}, "daemons or ranks left running"


# A rank that starts a process of its own which ignores SIGINT (as a shell's background job does), then sleeps;
# on KeyboardInterrupt it leaves a mark. {mark} is a directory: the child's command line names it.
RANK_WITH_A_CHILD = """import bps_worker.client as bps, os, subprocess, sys, time
bps.init()
child = subprocess.Popen([sys.executable, "-c", "import os, signal, time; signal.signal(signal.SIGINT, "
                          "signal.SIG_IGN); os.mkdir(os.path.join({mark!r}, 'child-%d' % os.getpid())); "
                          "time.sleep(120)  # {mark}"])
while not os.path.exists(os.path.join({mark!r}, "child-%d" % child.pid)):
    time.sleep(0.01)
open(os.path.join({mark!r}, "ids-%d" % os.getpid()), "w").write("%d %d" % (os.getsid(0), os.getpgid(0)))
try:  # (from before "up": a SIGINT the moment the test reads it, before a sleep, is inside)
    os.write(1, b"up\\n")
    time.sleep(60)
except KeyboardInterrupt:
    open(os.path.join({mark!r}, "interrupted-%d" % os.getpid()), "w").close()
    raise
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_what_a_rank_started_does_not_outlive_the_launcher(tmp_path, signum):
    """Ranks run in sessions of their own and are stopped as process groups: a process a rank started used to
    be left running (a DataLoader worker, a wrapper script's children). A Ctrl-C (SIGINT to the terminal's
    group, which now holds the launcher alone) is passed on, so the ranks still see KeyboardInterrupt."""
    config = write_config(tmp_path, [2], cpu_servers=1)
    mark = tmp_path / "marks"
    mark.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(RANK_WITH_A_CHILD.format(mark=str(mark)))
    proc = subprocess.Popen([PY, "-m", "bps_worker.launch", "--config", str(config), "--", PY, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert [proc.stdout.readline().strip() for _ in range(2)] == ["up", "up"]
        assert len(_pids_with(f"# {mark}")) == 2  # each rank's own child is running
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)  # Ctrl-C reaches the terminal's foreground group
        else:
            proc.send_signal(signum)  # kill(1), timeout(1), a CI job's limit: the launcher alone
        assert proc.wait(timeout=60) == 128 + signum, proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        leftovers = _pids_with(f"# {mark}")
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    assert leftovers == {}, "a rank's child outlived the launcher"
    assert _pids_with(str(config)) == {} and _pids_with(str(script)) == {}, "daemons or ranks left running"
    interrupted = [name for name in os.listdir(mark) if name.startswith("interrupted-")]
    assert len(interrupted) == (2 if signum == signal.SIGINT else 0)
    # each rank leads a process group of its own, in the launcher's session: under the kernel's autogroup
    # scheduling a session of its own would have had as much CPU as all the daemons together
    ids = [name for name in os.listdir(mark) if name.startswith("ids-")]
    assert len(ids) == 2
    for name in ids:
        sid, pgid = map(int, (mark / name).read_text().split())
        assert pgid == int(name[4:]) and sid == proc.pid, (name, sid, pgid, proc.pid)


@pytest.mark.timeout(120)
def test_rank_0_reads_the_launchers_terminal_and_the_others_end_of_file(tmp_path):
    """``input()`` (or ``breakpoint()``) on a rank: ranks lead process groups of their own, in the background of
    the launcher's terminal, so a rank that read it was stopped (SIGTTIN) and the job froze without a word.
    Rank 0 now reads what is typed at the launcher's terminal, through the launcher; the others end of file."""
    config = write_config(tmp_path, [2], cpu_servers=0)
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "ask.py"
    script.write_text("import os\n"
                      "try:\n"
                      "    line = input()\n"
                      "except EOFError:\n"
                      "    line = '<end of file>'\n"
                      f"open(os.path.join({str(out)!r}, os.environ['BPS_RANK']), 'w').write(line)\n")
    pid, terminal = pty.fork()  # the launcher leads a session whose terminal we hold, in its foreground
    if pid == 0:
        try:
            os.execv(PY, [PY, "-m", "bps_worker.launch", "--config", str(config), "--", PY, str(script)])
        finally:
            os._exit(127)
    os.write(terminal, b"typed at the terminal\n")
    status, shown = _wait_reading(pid, terminal, 60)
    if status is None:  # frozen: stopped the way a user would, then asserted
        os.kill(pid, signal.SIGTERM)
        status, more = _wait_reading(pid, terminal, 40)
        shown += more
    os.close(terminal)
    assert status is not None and os.waitstatus_to_exitcode(status) == 0, shown.decode(errors="replace")
    assert {name: (out / name).read_text() for name in os.listdir(out)} == \
        {"0": "typed at the terminal", "1": "<end of file>"}
    assert _pids_with(str(config)) == {} and _pids_with(str(script)) == {}, "daemons or ranks left running"


@pytest.mark.timeout(120)
def test_ranks_write_to_a_tostop_terminal_instead_of_stopping(tmp_path):
    """With ``stty tostop`` a background process group that writes to its terminal is stopped (SIGTTOU): the
    ranks (groups of their own) stopped at their first line, and the launcher waited for them for ever. They
    ignore SIGTTOU now (bps_runtime.orphans), and their lines reach the terminal."""
    config = write_config(tmp_path, [2], cpu_servers=0)
    script = tmp_path / "hello.py"
    script.write_text("import os\nos.write(1, f\"rank {os.environ['BPS_RANK']} says hello\\n\".encode())\n")
    pid, terminal = pty.fork()
    if pid == 0:
        try:
            attrs = termios.tcgetattr(0)
            attrs[3] |= termios.TOSTOP
            termios.tcsetattr(0, termios.TCSANOW, attrs)
            os.execv(PY, [PY, "-m", "bps_worker.launch", "--config", str(config), "--", PY, str(script)])
        finally:
            os._exit(127)
    status, shown = _wait_reading(pid, terminal, 60)
    if status is None:  # stopped ranks: the launcher stopped the way a user would, then asserted
        os.kill(pid, signal.SIGTERM)
        status, more = _wait_reading(pid, terminal, 40)
        shown += more
    os.close(terminal)
    text = shown.decode(errors="replace")
    assert status is not None and os.waitstatus_to_exitcode(status) == 0, text
    assert "rank 0 says hello" in text and "rank 1 says hello" in text, text
    assert _pids_with(str(config)) == {} and _pids_with(str(script)) == {}, "daemons or ranks left running"


@pytest.mark.parametrize("forked", ["1", "0"])
def test_a_launcher_killed_outright_takes_its_daemons_and_ranks_with_it(tmp_path, monkeypatch, forked):
    """SIGKILL of the launcher alone (``kill -9``, the OOM killer) lets it stop nothing: its daemons served and
    its ranks slept on, for ever. Each now ends with its parent (PR_SET_PDEATHSIG: the forked daemons with the
    forkserver's helper, which ends with the launcher)."""
    monkeypatch.setenv("BPS_FORKSERVER", forked)
    config, script, proc = _launch_sleepers(tmp_path)
    try:
        assert proc.stdout.readline().strip() == "up"
        assert _pids_with(str(script)) and _group_members(proc.pid) != [proc.pid]
        proc.kill()
        proc.wait(timeout=30)
        _wait_for(lambda: not _group_members(proc.pid) and not _pids_with(str(script)), timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in _pids_with(str(script)):
            os.kill(pid, signal.SIGKILL)


def _wait_reading(pid: int, terminal: int, seconds: float) -> tuple[int | None, bytes]:
    """Child ``pid``'s wait status (None if it still runs after ``seconds``) and what it wrote to ``terminal``."""
    shown = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if select.select([terminal], [], [], 0.2)[0]:
            try:
                shown += os.read(terminal, 4096)
            except OSError:
                pass  # the terminal's other side is closed (every process of the session is gone)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, shown
    return None, shown


def _pids_with(text: str) -> dict[int, str]:
    """Running processes whose command line contains ``text``: pid -> command line."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if entry.isdigit() and text in cmdline:
            found[int(entry)] = cmdline
    return found


@pytest.mark.timeout(90)
def test_ctrl_c_seen_first_in_the_ranks_still_exits_130_and_stops_everything(tmp_path):
    """The order a loaded box can give to one Ctrl-C: the launcher sees a rank exit from it first and only then
    gets its own SIGINT, while it stops the cluster. Made deterministic here: the ranks get SIGINT first; once
    the launcher has reported one, the whole group gets it, while a frozen server keeps the stop going for its
    grace period. The status is 130 all the same, and the stop is not cut short (the frozen server is killed)."""
    config = write_config(tmp_path, [2], cpu_servers=1)
    script = tmp_path / "sleep.py"
    script.write_text(UP_THEN_SLEEP)
    stderr_path = tmp_path / "launcher.err"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([PY, "-m", "bps_worker.launch", "--config", str(config), "--", PY, str(script)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    server = None
    try:
        assert [proc.stdout.readline().strip() for _ in range(2)] == ["up", "up"]  # both ranks connected
        server = next(pid for pid, cmd in _pids_with(str(config)).items() if "bps_server" in cmd)
        os.kill(server, signal.SIGSTOP)  # the stop waits its grace period for this one, then kills it
        for rank in set(_pids_with(str(script))) - {proc.pid}:  # the launcher's own command line names it too
            os.kill(rank, signal.SIGINT)
        deadline = time.monotonic() + 30
        while "exited with status" not in stderr_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "bps-launch: rank" in stderr_path.read_text(), stderr_path.read_text()
        os.killpg(proc.pid, signal.SIGINT)  # the launcher's own Ctrl-C, while it stops the cluster
        assert proc.wait(timeout=60) == 130, stderr_path.read_text()
        assert "interrupted (SIGINT); cluster stopped" in stderr_path.read_text()
        assert _pids_with(str(config)) == {}, "daemons left running"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _pids_with(str(config)):
            os.kill(pid, signal.SIGKILL)


def test_sighup_reopens_the_log_file(tmp_path):
    config = write_config(tmp_path, [1], cpu_servers=0)
    log_file = tmp_path / "server.log"
    notify, path = _notify_socket(tmp_path)
    proc = subprocess.Popen([PY, "-m", "bps_server", "--config", str(config), "--id", "0", "--log-file", str(log_file)],
                            env=dict(os.environ, NOTIFY_SOCKET=path))
    try:
        while (message := notify.recv(100)) != b"READY=1":
            assert message.startswith(b"STATUS="), message  # what the daemon waits for, before it is ready
        os.rename(log_file, tmp_path / "server.log.1")  # what logrotate does
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not log_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "log files reopened" in log_file.read_text()
        assert "listening" in (tmp_path / "server.log.1").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert "stopping" in log_file.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()


# -- a token by default (issue 14, item 2) ------------------------------------------------------------

TOKEN_JOB = ("import numpy as np, bps_worker.client as bps\n"
             "bps.init()\n"
             "assert bps.push_pull(np.ones(3), 'x', average=False)[0] == bps.size()\n"
             "bps.shutdown()\n")


@pytest.mark.usefixtures("forked_daemons")  # about the straggler report / token, not the daemons' start
def test_launcher_makes_a_private_token_on_first_start_and_reuses_it(tmp_path):
    token = tmp_path / "home" / ".config" / "bps" / "token"
    config = write_config(tmp_path / "c", [1, 1], cpu_servers=1, cluster={"token_file": "~/.config/bps/token"})
    script = tmp_path / "job.py"
    script.write_text(TOKEN_JOB)
    env = dict(os.environ, HOME=str(tmp_path / "home"))
    seen = []
    for _ in range(2):
        result = subprocess.run([PY, "-m", "bps_worker.launch", "--config", str(config), "--", PY, str(script)],
                                capture_output=True, text=True, timeout=90, env=env)
        assert result.returncode == 0, result.stderr
        assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
        seen.append(token.read_text())
    assert seen[0] == seen[1] and len(seen[0].strip()) == 64


@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_launcher_and_daemons_refuse_a_token_others_can_read(tmp_path, mode):
    token = tmp_path / "token"
    token.write_text("0123456789abcdef" * 4 + "\n")
    token.chmod(mode)
    config = write_config(tmp_path, [1], cpu_servers=0, cluster={"token_file": str(token)})
    runs = [[PY, "-m", "bps_worker.launch", "--config", str(config), "--", PY, "-c", "pass"]]
    runs += [[PY, "-m", module, "--config", str(config), "--id", "0"] for module in ("bps_server", "bps_worker")]
    for argv in runs:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        line = _one_line(result.stderr)
        assert result.returncode == 2, (argv, result.stderr)
        assert str(token) in line and f"(mode {mode:03o})" in line and "chmod 600" in line, line


def test_make_token_writes_a_new_token_and_never_replaces_one(tmp_path):
    path = tmp_path / "etc" / "token"
    result = subprocess.run([PY, "-m", "bps_worker.launch", "--make-token", str(path)], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0 and str(path) in result.stderr, result.stderr
    first = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(first.strip()) == 64
    again = subprocess.run([PY, "-m", "bps_worker.launch", "--make-token", str(path)], capture_output=True,
                           text=True, timeout=30)
    assert again.returncode == 1 and "already exists" in _one_line(again.stderr)
    assert path.read_text() == first


def test_a_launcher_started_with_its_standard_input_closed_runs_the_job(tmp_path):
    """``bps-launch ... <&-``: every daemon inherited the closed descriptor and aborted (uvloop asserts fd > 2);
    rank 0 reads end of file as the others do."""
    config = write_config(tmp_path, [2], cpu_servers=1)
    script = tmp_path / "ask.py"
    script.write_text("import os, sys, numpy as np, bps_worker.client as bps\n"
                      "bps.init()\n"
                      "line = sys.stdin.read() if sys.stdin else '<none>'\n"
                      "y = bps.push_pull(np.ones(2), 'x', average=False)\n"
                      "os.write(1, f\"{os.environ['BPS_RANK']} {line!r} {y[0]}\\n\".encode())\n")  # one write a rank
    result = subprocess.run(["bash", "-c", f"exec {PY} -m bps_worker.launch --config {config} -- {PY} {script} <&-"],
                            capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split("\n")[:2]) == ["0 '' 2.0", "1 '' 2.0"], result.stdout
    assert "Assertion" not in result.stderr


def test_a_launcher_started_with_its_standard_output_closed_gives_its_processes_one(tmp_path):
    """``bps-launch ... >&-``: its stand-in for descriptor 1 was close-on-exec, so every daemon and rank had it
    closed (the daemons aborted at the stop, uvloop's assertion, and the launcher still said 0; a review)."""
    config = write_config(tmp_path, [2], cpu_servers=1)
    check = "import os, sys; os.fstat(1); sys.stderr.write('rank ' + os.environ['BPS_RANK'] + ': fd 1 open\\n')"
    result = subprocess.run(["bash", "-c", f'exec {PY} -m bps_worker.launch --config {config} -- {PY} -c "{check}" '
                                           '>&-'], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert sorted(line for line in result.stderr.splitlines() if line.startswith("rank")) == \
        ["rank 0: fd 1 open", "rank 1: fd 1 open"], result.stderr
    assert "Assertion" not in result.stderr
