"""bps_worker.supervise without processes: how a wait for ranks ends, the daemons' command lines, and
where a one-box cluster puts its worker sockets."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from bps_worker.cluster_file import write_config
from bps_worker.supervise import Child, Cluster, Ending, ExitOrder, Supervisor, daemon_argv, judge


@dataclass
class Exited:
    """What :func:`judge` reads of a process: its ``returncode``."""

    returncode: int | None


def _child(label: str, code: int | None = None, *, daemon: bool = False, where: str = "") -> Child:
    return Child(label, Exited(code), daemon=daemon, where=where)  # type: ignore[arg-type]


def test_every_rank_done_is_status_0():
    assert judge([(_child("rank 0"), 0), (_child("rank 1"), 0)], None, False, None) == Ending(0)


def test_still_running_goes_on():
    assert judge([(_child("rank 0"), 0), (_child("rank 1"), None)], None, False, 5.0) is None


def test_the_first_failed_rank_wins_over_a_dead_daemon_and_the_deadline():
    rank1 = _child("rank 1", where="w0")
    dead = _child("worker-0", 0, daemon=True)
    ending = judge([(_child("rank 0"), None), (rank1, 3), (_child("rank 2"), 4)], dead, True, 5.0)
    assert ending == Ending(3, "rank 1 on w0 exited with status 3", rank1)


def test_a_rank_killed_by_a_signal_is_status_1():
    rank = _child("rank 0")
    assert judge([(rank, -2)], None, False, None) == Ending(1, "rank 0 exited with status -2", rank)


def test_a_dead_daemon_then_the_deadline():
    dead = _child("server-2", -9, daemon=True)
    assert judge([(_child("rank 0"), None)], dead, True, 5.0) == Ending(1, "server-2 exited with status -9", dead)
    assert judge([(_child("rank 0"), None)], None, True, 2.5) == Ending(1, "ranks did not finish within 2.5 s")


def _exits(at: float, code: int) -> subprocess.Popen[bytes]:
    """A process that exits with ``code`` at wall-clock time ``at`` (however long its start took)."""
    return subprocess.Popen([sys.executable, "-c",
                             f"import os, time; time.sleep(max(0.0, {at} - time.time())); os._exit({code})"])


@pytest.mark.timeout(60)
def test_the_rank_that_failed_first_is_named_not_the_lowest_of_those_that_followed_it(tmp_path):
    """Rank 2 fails, and ranks 0 and 1 fail after it (their connections broke): judged by rank within one poll
    of the statuses (every 50 ms), the launcher named rank 0, its status and all, about one run in six (a
    review). Each exit now wakes the watch (a pidfd each), which meets the ranks in the order they exited."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for watched in (False, True):
            at = time.time() + 2.0
            procs += [_exits(at + 0.15, 3), _exits(at + 0.2, 3), _exits(at, 7)]
            ranks = [Child(f"rank {i}", proc, daemon=False) for i, proc in enumerate(procs[-3:])]
            if watched:  # the launcher's wait: it ends at the first failure seen
                assert Supervisor(tmp_path).watch(ranks) == Ending(7, "rank 2 exited with status 7", ranks[2])
                continue
            with ExitOrder(ranks) as exits:
                while len(exits.seen) < 3:
                    exits.wait(5.0)
                assert [c.label for c in exits.seen] == ["rank 2", "rank 0", "rank 1"]
                assert [(c.label, code) for c, code in exits.statuses()] == [("rank 2", 7), ("rank 0", 3),
                                                                             ("rank 1", 3)]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_rank_that_exited_before_the_watch_began_is_judged_first():
    early = subprocess.Popen([sys.executable, "-c", "import os; os._exit(5)"])
    early.wait()  # (reaped, as the launcher's stdin thread may reap rank 0)
    later = _exits(time.time() + 0.5, 3)
    ranks = [Child("rank 0", later, daemon=False), Child("rank 1", early, daemon=False)]
    try:
        with ExitOrder(ranks) as exits:
            assert exits.seen == [ranks[1]]
            exits.wait(5.0)
            assert [(c.label, code) for c, code in exits.statuses()] == [("rank 1", 5), ("rank 0", 3)]
    finally:
        later.kill()
        later.wait()


def test_daemon_argv():
    assert daemon_argv(["py", "-m", "bps_server"], Path("/c.toml"), 2, log_level="info") == (
        "py", "-m", "bps_server", "--config", "/c.toml", "--id", "2", "--log-level", "info")
    assert daemon_argv(["bps-worker"], "/c.toml", 0, log_level="warning", extra=["--threads", "1"],
                       timeline="/t/worker-0.json")[-4:] == ("--threads", "1", "--timeline", "/t/worker-0.json")


def test_a_cluster_keeps_sockets_in_a_private_directory_of_its_file(tmp_path):
    cluster = Cluster(str(write_config(tmp_path, [1, 1], cpu_servers=0)), log_level="info")
    try:
        assert cluster.moved == {}
        assert cluster.socket_path(1) == f"{tmp_path}/w1.sock"
        assert cluster.env_for(1, 0)["BPS_SOCKET"] == f"{tmp_path}/w1.sock"
        assert cluster.command("worker-1").argv == (sys.executable, "-m", "bps_worker", "--config",
                                                    cluster.config_path, "--id", "1", "--log-level", "info")
    finally:
        cluster.stop()


def test_ranks_get_torch_distributed_rendezvous_like_torchrun(tmp_path, monkeypatch):
    """A DDP script (bps.ddp_comm_hook still needs a process group) runs under bps-launch unchanged."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("RANK", "7")  # a stale one in the launcher's environment is not passed on
    cluster = Cluster(str(write_config(tmp_path, [2, 1], cpu_servers=0)))
    try:
        envs = [cluster.env_for(0, 0), cluster.env_for(0, 1), cluster.env_for(1, 0)]
        assert [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
            ("0", "3", "2"), ("1", "3", "2"), ("2", "3", "1")]
        assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("127.0.0.1", envs[0]["MASTER_PORT"])}
        assert 0 < int(envs[0]["MASTER_PORT"]) < 65536
        monkeypatch.setenv("MASTER_PORT", "29999")  # the user's choice wins
        assert cluster.env_for(1, 0)["MASTER_PORT"] == "29999"
    finally:
        cluster.stop()


@pytest.mark.parametrize("where", ["missing", "shared"])
def test_a_cluster_moves_sockets_out_of_a_missing_or_shared_directory(tmp_path, where):
    """The demo's /tmp/bps: missing on a fresh box, or pre-created by someone else (here: writable by all)."""
    config = write_config(tmp_path, [1], cpu_servers=0)
    socket_dir = tmp_path / "bps"
    if where == "shared":
        socket_dir.mkdir()
        os.chmod(socket_dir, 0o1777)
    config.write_text(config.read_text().replace(f"{tmp_path}/w0.sock", f"{socket_dir}/worker-0.sock"))
    cluster = Cluster(str(config))
    try:
        private = Path(cluster.socket_path(0)).parent
        assert cluster.socket_path(0) == f"{private}/worker-0.sock" and private != socket_dir
        assert os.stat(private).st_mode & 0o777 == 0o700 and os.stat(private).st_uid == os.geteuid()
        assert cluster.moved[0].kind == where.replace("shared", "writable")
        assert cluster.env_for(0, 0)["BPS_SOCKET"] == cluster.socket_path(0)
        argv = cluster.command("worker-0").argv
        assert argv[argv.index("--socket") + 1] == cluster.socket_path(0)
        assert "--socket" not in cluster.command("server-0").argv
    finally:
        cluster.stop()
    assert not private.exists()


@pytest.mark.parametrize("odd", ["back\\b", 'quo"te'])
def test_a_generated_cluster_file_keeps_an_odd_directory_name(tmp_path, odd):
    """The socket path went into the TOML unescaped: a backslash was read as an escape, a quote broke the file."""
    from protocol.config import load_config

    directory = tmp_path / odd
    config = load_config(str(write_config(directory, [1], cpu_servers=0)))
    assert config.worker(0).socket == f"{directory}/w0.sock"
