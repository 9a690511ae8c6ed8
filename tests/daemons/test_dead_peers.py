"""A worker daemon killed mid-training: every process gets BPSError within the timeout, never a hang."""

from __future__ import annotations

import signal
import threading
import time

import pytest

import rank_programs as rp
from harness import _rank_main, rank_context, run_ranks, server_stats, start_cluster, write_config

TIMEOUT_S = 3.0
TRIALS = 10


def _wait_until_running(cluster, rounds: int = 5, within_s: float = 30.0) -> None:
    """Until the servers have completed ``rounds`` rounds between them: every rank connected and the job
    running (a fixed sleep after start raced the ranks' start-up on a busy machine)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if sum(s["rounds_completed"] for s in server_stats(cluster).values()) >= rounds:
                return
        except OSError:
            pass
        time.sleep(0.02)


def test_kill_9_of_a_worker_daemon_fails_every_process_fast(tmp_path):
    cluster = start_cluster(write_config(tmp_path, [2, 2], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    try:
        victim = next(c for c in cluster.children if c.label == "worker-1")
        killed_at: list[float] = []

        def kill() -> None:
            # Mid-training: every rank connected and some rounds ran (a fixed sleep raced the ranks'
            # start-up on a busy machine, and the daemon died before ranks 2 and 3 connected to it).
            deadline = time.monotonic() + 30
            while server_stats(cluster)[2]["rounds_completed"] < 5 and time.monotonic() < deadline:
                time.sleep(0.02)
            killed_at.append(time.time())
            victim.proc.send_signal(signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
        results = run_ranks(cluster, rp.push_until_error, 30.0, timeout=60)
        assert killed_at
        for rank, r in enumerate(results):
            assert r["error"] is not None, f"rank {rank} never noticed the dead worker"
            assert r["rounds"] > 0
            assert r["at"] - killed_at[0] < TIMEOUT_S + 5, (rank, r["at"] - killed_at[0], r["error"])
        assert "worker 1" in results[0]["error"] or "disconnected" in results[0]["error"], results[0]["error"]
        assert "worker daemon" in results[2]["error"], results[2]["error"]
        for rank, r in enumerate(results):  # a peer that went away, for the others as for its own processes
            assert r["class"] == "BPSConnectionError", (rank, r)
        assert results[0]["peer"] == results[1]["peer"] == "worker 1", results[:2]
    finally:
        cluster.stop()


@pytest.mark.parametrize("n", [8, 50_000], ids=["fused", "partitioned"])
def test_dead_processes_behind_a_live_worker_daemon_fail_their_peers(tmp_path, n):
    """All processes of machine 1 die but its daemon lives (systemd + torchrun): machine 0 must not hang, and
    hears a BPSConnectionError naming worker 1 (a fused name's was a bare BPSError, and a round opened after
    the leaving was heard a BPSTimeoutError: a review of the contract)."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    try:
        start = time.time()
        results = run_ranks(cluster, rp.die_after_one_round, 1, n, may_die=frozenset({1}), timeout=60)
        r = results[0]
        assert r["error"] is not None, "rank 0 never noticed that rank 1 died"
        assert "worker 1" in r["error"], r["error"]
        assert r["class"] == "BPSConnectionError" and r["peer"] == "worker 1", r
        assert r["at"] - start < TIMEOUT_S + 10
    finally:
        cluster.stop()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [1000, 300_000], ids=["fused", "partitioned"])
def test_a_machine_whose_processes_never_start_fails_its_peers_naming_it(tmp_path, n):
    """Machine 0's daemon runs, but its training processes never start: machine 1's step fails within the
    timeout, naming worker 0 (a daemon idle since it started never says Reset: its rounds waited for ever, with
    stall warnings only, where after a job's end they failed naming it)."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    ctx = rank_context()
    queue = ctx.Queue()
    proc = ctx.Process(target=_rank_main, args=(queue, cluster.socket_path(1), 0, 1, rp.lonely_step, (3, n), 10.0),
                       daemon=True)
    try:
        proc.start()
        rank, status, result = queue.get(timeout=TIMEOUT_S + 30)
        assert (rank, status) == (1, "ok"), result
        assert result["seconds"] < TIMEOUT_S + 10, result
        for error in result["errors"]:
            assert error is not None and "worker 0 had no training processes: none had started yet" in error, result
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
        cluster.stop()


def test_a_new_job_starts_clean_after_a_job_died_mid_round(tmp_path):
    """Job 1 dies with a push half done; job 2 on the same daemons gets exact sums from its first step."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    try:
        run_ranks(cluster, rp.die_mid_job, may_die=frozenset({0, 1}), timeout=30)
        # Both worker daemons noticed that their processes are gone once the servers forgot job 1's keys
        # (they do when every worker has reset); a fixed 0.5 s was too short on a busy machine.
        deadline = time.monotonic() + 20
        while sum(s["keys"] for s in server_stats(cluster).values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        results = run_ranks(cluster, rp.clean_job, 3, timeout=60)
        assert results == [[1.0, 21.0, 41.0]] * 2
    finally:
        cluster.stop()


def test_a_stalled_worker_daemon_fails_its_peers_within_the_timeout(tmp_path):
    """SIGSTOP (a hung machine that keeps its TCP connections open): heartbeats notice, nothing hangs."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    victim = next(c for c in cluster.children if c.label == "worker-1")
    stopped_at: list[float] = []

    def stall() -> None:
        _wait_until_running(cluster)
        stopped_at.append(time.time())
        victim.proc.send_signal(signal.SIGSTOP)
        time.sleep(TIMEOUT_S + 8)
        victim.proc.send_signal(signal.SIGCONT)

    try:
        threading.Thread(target=stall, daemon=True).start()
        results = run_ranks(cluster, rp.push_until_error, 30.0, timeout=60)
        r = results[0]
        assert r["error"] is not None and r["rounds"] > 0, r
        assert r["at"] - stopped_at[0] < TIMEOUT_S * 2 + 3, (r["at"] - stopped_at[0], r["error"])
        assert "worker 1" in r["error"], r["error"]
        assert r["class"] == "BPSConnectionError" and r["peer"] == "worker 1", r
    finally:
        victim.proc.send_signal(signal.SIGCONT)
        cluster.stop()


def test_a_process_whose_own_worker_daemon_stalls_gets_an_error(tmp_path):
    """The daemon pings its processes every second; a silent one fails their pending operations."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    victim = next(c for c in cluster.children if c.label == "worker-0")
    stopped_at: list[float] = []

    def stall() -> None:
        _wait_until_running(cluster)
        stopped_at.append(time.time())
        victim.proc.send_signal(signal.SIGSTOP)
        time.sleep(12)
        victim.proc.send_signal(signal.SIGCONT)

    try:
        threading.Thread(target=stall, daemon=True).start()
        results = run_ranks(cluster, rp.push_until_error, 30.0, timeout=60, client_timeout=4.0)
        r = results[0]  # rank 0 talks to the stalled daemon
        assert r["error"] is not None and "sent nothing" in r["error"], r
        assert r["at"] - stopped_at[0] < 4.0 + 3, r["at"] - stopped_at[0]
        assert results[1]["error"] is not None  # its peer learns through the server
    finally:
        victim.proc.send_signal(signal.SIGCONT)
        cluster.stop()


@pytest.mark.timeout(300)
def test_kill_9_of_a_worker_daemon_mid_round_never_hangs_in_ten_trials(tmp_path):
    """The issue's 10 trials: each a new job on the same servers; worker 1's daemon is killed once the
    job is running, and restarted (as systemd would) for the next trial."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    try:
        for trial in range(TRIALS):
            killed_at: list[float] = []
            before = server_stats(cluster)[2]["rounds_completed"]

            def kill() -> None:
                deadline = time.monotonic() + 20
                while server_stats(cluster)[2]["rounds_completed"] < before + 5 and time.monotonic() < deadline:
                    time.sleep(0.02)  # mid-training: the job has run some rounds
                killed_at.append(time.time())
                cluster.kill("worker-1")

            killer = threading.Thread(target=kill, daemon=True)
            killer.start()
            results = run_ranks(cluster, rp.push_until_error, 30.0, timeout=60)
            killer.join(timeout=30)
            assert killed_at, f"trial {trial}: no kill"
            for rank, r in enumerate(results):
                assert r["error"] is not None and r["rounds"] > 0, (trial, rank, r)
                assert r["at"] - killed_at[0] < TIMEOUT_S + 5, (trial, rank, r["at"] - killed_at[0], r["error"])
            cluster.restart("worker-1")
    finally:
        cluster.stop()


def test_a_failed_in_place_push_says_how_many_partitions_hold_sums(tmp_path):
    """Sums land in a shared array pushed in place partition by partition, as they arrive: when the
    operation then fails (here the CPU-only server is frozen), the error says how many partitions of
    the array hold sums, and exactly those do; the rest still hold the input."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    try:
        cluster.kill("server-2", signal.SIGSTOP)  # servers 0 and 1 answer; server 2 never does
        n = 1 << 20  # 4 MiB: 1 MiB on each colocated server, 2 MiB on the CPU-only one
        results = run_ranks(cluster, rp.in_place_push_that_fails, n, timeout=60)
        for rank, r in enumerate(results):
            assert r["error"] is not None, f"rank {rank}: the push succeeded with a frozen server"
            assert "now holds the sums of" in r["error"], r["error"]
            held = int(r["error"].split("now holds the sums of ")[1].split()[0])
            assert 0 < held, r["error"]
            assert r["summed"] == n // 2 and r["kept"] == n // 2, r  # the colocated servers' half
    finally:
        cluster.kill("server-2", signal.SIGCONT)
        cluster.stop()


@pytest.mark.timeout(120)
def test_a_server_that_cannot_be_reached_is_the_errors_peer(tmp_path):
    """The CPU-only server is down when the job starts: every process's BPSConnectionError says which server
    in ``peer``, as the contract shows it ("server 2 at host:port"), not only in its text (a review: ``peer``
    was empty, so code that follows the contract learned nothing)."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    try:
        spec = cluster.config.servers[2]
        cluster.kill("server-2")
        results = run_ranks(cluster, rp.error_attributes, "unreached", 1 << 20, timeout=60)  # a part on each
        names = [f"small.{i}" for i in range(12)]  # fused: those anchored on server 2 fail there
        fused = run_ranks(cluster, rp.fused_error_attributes, names, timeout=60)
    finally:
        cluster.stop()
    for r in results:
        assert r["class"] == "BPSConnectionError" and r["peer"] == f"server 2 at {spec.address}", r
        assert r["message"] == (f"connection to server 2 at {spec.address} failed: tensor 'unreached': cannot "
                                f"reach it within 3 s: [Errno 111] Connection refused"), r
    anchored = [name for name in names if fused[0][name] is not None]
    assert anchored and all(r[name] is None for r in fused for name in names if name not in anchored), fused
    for r in fused:  # (the review of the change: "connection to server 2 failed: connection to server 2 at ...")
        for name in anchored:
            assert r[name] == {"class": "BPSConnectionError", "peer": f"server 2 at {spec.address}", "message":
                               f"connection to server 2 at {spec.address} failed: tensor {name!r}: cannot reach it "
                               f"within 3 s: [Errno 111] Connection refused"}, r[name]


@pytest.mark.timeout(120)
def test_a_process_that_leaves_with_its_round_ready_fails_its_peer_naming_it(tmp_path):
    """Rank 1 leaves after both local ranks pushed, while the round waits for its base at a frozen server: the
    operation finds rank 1's memory gone. Rank 0 hears that rank 1 left (a BPSConnectionError naming it), not an
    internal KeyError about a segment. (If the daemon runs the operation before it notices the exit, rank 0
    gets the sum: both pushed.)"""
    import client_programs as cp
    from harness import daemon_logs
    cluster = start_cluster(write_config(tmp_path / "c", [2], cpu_servers=0, cluster={"timeout": 20}))
    flags = tmp_path / "flags"
    flags.mkdir()
    cluster.kill("server-0", signal.SIGSTOP)  # the name's first round asks server 0 its base: it waits

    def resume() -> None:
        deadline = time.monotonic() + 60
        while not (flags / "leaving").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(1.0)  # the worker daemon sees rank 1's connection close
        cluster.kill("server-0", signal.SIGCONT)

    thread = threading.Thread(target=resume)
    thread.start()
    try:
        results = run_ranks(cluster, cp.leaves_with_its_round_ready, str(flags), timeout=90, may_die=frozenset({1}))
        thread.join()
        result = results[0]
        assert result.get("ok") or (result["type"] == "BPSConnectionError" and "local rank 1" in result["text"]), result
        logs = daemon_logs(cluster)
        assert "KeyError" not in logs and "internal error" not in logs, logs[-3000:]
    finally:
        thread.join()
        cluster.stop()
