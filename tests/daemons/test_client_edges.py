"""The numpy client's edges, with a real one-process cluster and the client in this process: a result that cannot
be mapped, slots and results under the arena's cap, a group that fails part-way, the name held until its result
is read, an init that fails after connecting, and a wait without end. Each was a hang, a wrong result or a
leak before its fix (a review of the client, session 29)."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

import bps_worker.client as bps
import bps_worker.client.slots as slots_mod
from bps_worker.client import adapter
from bps_worker.client.operations import Operations
from harness import run_ranks, start_cluster, write_config

MB = 1 << 20


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Callable[..., Operations]]:
    """``client(timeout=..., **cluster_keys)``: a one-process cluster, and this process connected to it."""
    made: list[Any] = []

    def start(timeout: float = 5.0, **cluster: Any) -> Operations:
        made.append(start_cluster(write_config(tmp_path / f"c{len(made)}", [1], cpu_servers=0,
                                               cluster=cluster or None)))
        bps.init(socket=str(tmp_path / f"c{len(made) - 1}" / "w0.sock"), local_rank=0, timeout=timeout)
        return bps._operations()

    yield start
    bps.shutdown()
    for cluster in made:
        cluster.stop()


@pytest.mark.timeout(60)
def test_a_result_that_cannot_be_mapped_fails_its_call_and_the_client_goes_on(client, monkeypatch):
    ops = client(timeout=2.0)
    real, armed = slots_mod.shm.attach_segment, [True]

    def flaky(name: str, *args: Any) -> Any:
        if armed[0] and threading.current_thread().name == "bps-client-reader":
            armed[0] = False
            raise OSError(errno.EMFILE, "Too many open files")
        return real(name, *args)

    monkeypatch.setattr(slots_mod.shm, "attach_segment", flaky)
    big = np.ones(100_000, np.float32)  # (a result in the worker's results segment, mapped as its Done arrives)
    with pytest.raises(bps.BPSError, match="cannot map the result of 'X'.*Too many open files"):
        bps.synchronize(bps.push_pull_async(big, "X", average=False), timeout=10)
    assert ops.conn.thread.is_alive() and ops.conn.broken is None
    np.testing.assert_array_equal(bps.push_pull(big, "X", average=False), big)


@pytest.mark.timeout(60)
def test_a_slot_handed_out_to_be_filled_is_never_given_up_for_another_name(client):
    client(arena_bytes=6 * MB)
    n = MB  # 4 MiB of float32
    view = adapter.shared_slot("bucketA", (n,), np.float32)
    view[...] = 1.0
    # No room for a second 4 MiB slot unless bucketA's goes: refused, naming the cap, rather than summing zeros.
    with pytest.raises(bps.BPSError, match="arena_bytes"):
        bps.push_pull(np.ones(n, np.float32), "bucketB", average=False)
    result = bps.synchronize(adapter.start_filled("bucketA", np.float32, (n,), average=False))
    np.testing.assert_array_equal(result, np.ones(n, np.float32))
    # Pushed since, it is an idle slot like any other: given up for room.
    np.testing.assert_array_equal(bps.push_pull(np.full(n, 2.0, np.float32), "bucketB", average=False), 2.0)


@pytest.mark.timeout(60)
def test_a_name_whose_larger_slot_was_refused_works_again_at_a_size_that_fits(client):
    """The daemon drops the slot a larger one replaces before it finds no room under the cap: the process kept
    it, and every later push of the name, at its old size, named memory the daemon no longer counted as ours
    ("not allocated by this connection") for the rest of the job (a review's case)."""
    client(arena_bytes=4 * MB)
    n = MB // 4  # 1 MiB of int32: a slot of its own
    np.testing.assert_array_equal(bps.push_pull(np.full(n, 3, np.int32), "A", average=False), 3)
    with pytest.raises(bps.BPSError, match="arena_bytes"):
        bps.push_pull(np.full(5 * n, 3, np.int32), "A", average=False)
    for size in (n, n, n // 2):
        np.testing.assert_array_equal(bps.push_pull(np.full(size, 4, np.int32), "A", average=False), 4)


@pytest.mark.timeout(60)
def test_a_finished_handles_result_survives_the_sweep_of_freed_result_segments(client):
    client(arena_bytes=4 * MB)
    a = np.ones(MB // 4, np.float32)
    handle = bps.push_pull_async(a, "A", average=False)
    while not bps.poll(handle):
        time.sleep(0.001)
    for i in range(8):  # their results push A's out of the worker's capped results arena
        bps.push_pull(a, f"N{i}", average=False)
    np.testing.assert_array_equal(bps.synchronize(handle), a)


@pytest.mark.timeout(60)
def test_a_group_failing_part_way_frees_its_small_names_at_once(client):
    client(timeout=2.0, arena_bytes=8 * MB)
    arrays = [np.ones(4, np.float32), np.ones(4, np.float32), np.ones(2 * MB + 1024, np.float32)]
    started = time.monotonic()
    with pytest.raises(bps.BPSError, match="arena_bytes"):
        bps.push_pull_group(arrays, ["a", "b", "big"])
    assert time.monotonic() - started < 1.5  # not a timeout per small entry that was never sent
    np.testing.assert_array_equal(bps.push_pull(np.ones(4, np.float32), "a", average=False), 1.0)


@pytest.mark.timeout(60)
def test_a_failed_groups_sent_names_are_waited_for_once_and_freed_when_they_end(client, monkeypatch):
    """A group that fails part-way waits for the operations it sent, within one timeout for them all (it was one
    timeout each), and gives up those whose peers are slower: their names used to stay in flight for ever."""
    ops = client(timeout=2.0, arena_bytes=8 * MB)
    late: list[Any] = []
    real_submit = ops.conn.submit

    def late_answer(handle: Any, message: Any) -> None:  # sent, but the peers answer after the timeout
        if handle.name.startswith("mid"):
            late.append(handle)
        else:
            real_submit(handle, message)

    monkeypatch.setattr(ops.conn, "submit", late_answer)
    mid = np.ones(MB // 4, np.float32)  # 1 MB each: not fused, each its own Op
    started = time.monotonic()
    with pytest.raises(bps.BPSError, match="arena_bytes"):
        bps.push_pull_group([mid, mid, np.ones(2 * MB + 1024, np.float32)], ["mid1", "mid2", "big"])
    assert 2.0 <= time.monotonic() - started < 3.5  # one timeout for both (it was 4 s)
    assert [h.name for h in late] == ["mid1", "mid2"]
    monkeypatch.setattr(ops.conn, "submit", real_submit)
    with pytest.raises(bps.BPSError, match="'mid1' is still in flight from a push_pull_group that failed"):
        bps.push_pull(mid, "mid1", average=False)
    assert ops._holds("mid1") and ops._holds("mid2")  # their slots stay while the daemon may still write them
    late[0].fail(bps.BPSError("the peers gave up"))  # as the reader thread ends them when the answers come
    late[1].succeed(None, None)
    assert not ops._holds("mid1") and not ops._holds("mid2")  # may be given up for room, never used again or not
    for name in ("mid1", "mid2"):
        np.testing.assert_array_equal(bps.push_pull(mid, name, average=False), mid)


@pytest.mark.timeout(60)
def test_a_name_stays_claimed_until_its_result_is_read(client, monkeypatch):
    ops = client()
    read = ops._result
    tried: list[str] = []

    def reading(handle: Any, view: bool) -> Any:  # another start of the name while its result is read
        with pytest.raises(bps.BPSError) as refused:
            bps.push_pull_async(np.zeros(4, np.float32), handle.name, average=False)
        tried.append(str(refused.value))
        return read(handle, view)

    monkeypatch.setattr(ops, "_result", reading)
    np.testing.assert_array_equal(bps.push_pull(np.ones(4, np.float32), "n", average=False), 1.0)
    assert tried == ["tensor 'n' is already in flight in this process; synchronize it first"]


@pytest.mark.timeout(60)
def test_an_init_that_fails_on_its_timeline_says_why_and_may_be_retried(tmp_path: Path):
    cluster = start_cluster(write_config(tmp_path, [1], cpu_servers=0))
    try:
        with pytest.raises(bps.BPSError, match="cannot write the timeline"):
            bps.init(socket=str(tmp_path / "w0.sock"), local_rank=0, timeout=3.0, timeline="/proc/no/such/t.json")
        bps.init(socket=str(tmp_path / "w0.sock"), local_rank=0, timeout=3.0)  # not "already connected"
        np.testing.assert_array_equal(bps.push_pull(np.ones(4, np.float32), "t", average=False), 1.0)
    finally:
        bps.shutdown()
        cluster.stop()


@pytest.mark.timeout(90)
def test_init_at_once_after_shutdown_with_operations_in_flight(tmp_path: Path):
    """The daemon could read the new connection's Hello before the old connection's end, and refused it: "local
    rank 0 is already connected" (about one re-init in five with operations in flight, a review). The process
    tries again while its own previous connection is what holds the rank."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=0))
    sock = str(tmp_path / "w0.sock")
    try:
        for cycle in range(30):
            bps.init(socket=sock, local_rank=0, timeout=5.0)
            for n in (5, 70_000, 400_000):  # (worker 1 has no process: they stay in flight)
                bps.push_pull_async(np.ones(n, np.float32), f"r{n}", average=False)
            bps.shutdown()
    finally:
        bps.shutdown()
        cluster.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("held", ["module", "send", "handles", "fusion", "slots", "timeline"])
def test_shutdown_from_a_signal_handler_returns_where_the_signal_landed_inside_a_lock(tmp_path: Path, held: str,
                                                                                       monkeypatch):
    """A SIGTERM handler calling shutdown() (a pod's stop) while its thread was inside a call that holds one of the
    client's locks: shutdown() waited for ever on the lock its own thread held. It goes on without what it cannot
    take (the daemon sees the process leave when its connection closes), within a few seconds."""
    import client_programs as cp

    if held == "timeline":  # (its file is ended at exit instead: the lock is the thread's own until then)
        monkeypatch.setenv("BPS_TIMELINE", str(tmp_path / "timeline"))
    cluster = start_cluster(write_config(tmp_path, [1], cpu_servers=0))
    try:
        [outcome] = run_ranks(cluster, cp.shutdown_from_a_signal_handler_inside, held, timeout=40)
    finally:
        cluster.stop()
    assert len(outcome["took"]) == 1 and outcome["took"][0] < 10, outcome
    assert outcome["initialized"] is False
    if held == "timeline":  # not ended in the handler, but at exit (the program calls it, as exit would)
        assert outcome["tracing"] and outcome["at_exit"], outcome
        [trace] = (tmp_path / "timeline").glob("*.json")
        assert json.loads(trace.read_text())  # a whole JSON array


@pytest.mark.timeout(60)
def test_a_second_shutdown_waits_for_the_first_whose_leave_waits_for_a_frozen_server(tmp_path: Path):
    """Two threads' shutdown(): the second waits for the first, which returns once its leave took effect (here the
    cluster's timeout, the server being frozen). A second caller that stopped waiting for the module's lock after a
    second closed the connection under the first, and both returned before the leave took effect (a review)."""
    import client_programs as cp

    cluster = start_cluster(write_config(tmp_path, [1], cpu_servers=0, cluster={"timeout": 3.0}))
    marker, go = tmp_path / "summed", tmp_path / "go"
    server = cluster.supervisor.daemon("server-0").proc.pid
    out: dict[str, Any] = {}
    ranks = threading.Thread(target=lambda: out.update(r=run_ranks(cluster, cp.two_threads_shut_down, str(marker),
                                                                   str(go), timeout=40)))
    ranks.start()
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(server, signal.SIGSTOP)
        go.touch()
        time.sleep(4.0)
    finally:
        os.kill(server, signal.SIGCONT)
        ranks.join()
        cluster.stop()
    [took] = out["r"]
    assert took["first"] > 2.0 and took["second"] >= took["first"], took


@pytest.mark.timeout(120)
def test_every_process_shut_down_behind_a_barrier_then_inited_again_sums_exactly_every_cycle(tmp_path: Path):
    """shutdown() returns once its leave took effect (Leave): where the process was its machine's last, every server
    took the machine's Reset. Before, a barrier of the job's after every shutdown was not enough: a peer's new
    process reported a round before a daemon or a server had heard another machine's leave, and that leave failed
    it ("every training process of worker 1 left", or a rank that disconnected during the fused round; one
    cycle in about twelve under load, a CI run of the timeline test)."""
    import client_programs as cp

    cluster = start_cluster(write_config(tmp_path, [2, 1], cluster={"partition_bytes": 256 * 1024}))
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    try:
        assert run_ranks(cluster, cp.shutdown_and_init_again, str(barrier), 25, timeout=100) == [[], [], []]
    finally:
        cluster.stop()


@pytest.mark.timeout(180)
def test_shutdown_with_large_sums_in_flight_on_several_connections_then_init_again_sums_exactly(tmp_path: Path):
    """Every process calls shutdown() with large sums in flight, a barrier, init() again, the same names: exact.
    Servers on separate hosts, so a machine has several connections to one (streams)."""
    import client_programs as cp

    cluster = start_cluster(write_config(tmp_path, [1, 1], cluster={"partition_bytes": 256 * 1024, "timeout": 5.0},
                                         separate_hosts=True))
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    try:
        assert run_ranks(cluster, cp.shutdown_with_sums_in_flight_then_init_again, str(barrier), 15,
                         timeout=150) == [[], []]
    finally:
        cluster.stop()


@pytest.mark.timeout(120)
def test_shutdown_while_another_thread_sums_cuts_that_call_and_the_next_init_starts_clean(tmp_path: Path):
    """A thread keeps summing a partitioned and a fused name while the main thread calls shutdown(), then init() and
    the same names again (the process is the whole job: no barrier needed). The thread's call hears that shutdown()
    was called, and nothing else; the sums after init() are exact. Before (review of c91bc2c): the thread's next
    call reached the daemon after the Leave, which dropped the process for it ("op message from a client after its
    Leave"; most cycles), and shutdown() then returned unanswered; a round made ready with the Leave read beside it
    ran after the reset, took the next job's numbering and pushed the old round behind the Reset, so the next job's
    first sum of the name was "stale round 0, the server is at round N" (a cycle in ten); and a Done read while the
    main thread unmapped the results failed "cannot attach shared-memory segment"."""
    cluster = start_cluster(write_config(tmp_path, [1], cluster={"partition_bytes": 64 * 1024}))
    sock = str(tmp_path / "w0.sock")
    big, small = np.ones(300_000, np.float32), np.ones(8, np.float32)
    heard: list[str] = []
    try:
        for cycle in range(30):
            bps.init(socket=sock, local_rank=0, timeout=5.0)
            np.testing.assert_array_equal(bps.push_pull(big, "b", average=False), 1.0)  # the job's first sums
            np.testing.assert_array_equal(bps.push_pull(small, "a", average=False), 1.0)
            stop = threading.Event()

            def summing() -> None:
                try:
                    while not stop.is_set():
                        bps.push_pull(small, "a", average=False)
                        bps.push_pull(big, "b", average=False)
                except bps.BPSError as exc:
                    heard.append(str(exc))

            thread = threading.Thread(target=summing)
            thread.start()
            time.sleep(0.02 + 0.01 * (cycle % 7))
            bps.shutdown()
            stop.set()
            thread.join(10)
            assert not thread.is_alive()
    finally:
        bps.shutdown()
        cluster.stop()
    assert heard and all(h.endswith("failed: shutdown() was called in this process") or "not initialized" in h
                         for h in heard), sorted(set(heard))


@pytest.mark.timeout(60)
def test_init_again_after_the_daemon_died_connects_to_its_restarted_daemon(tmp_path: Path):
    """The worker daemon killed and started again (systemd's Restart=on-failure): init() did nothing (already
    initialised) and every later call failed with the old connection's error (a review's case)."""
    cluster = start_cluster(write_config(tmp_path, [1], cpu_servers=0))
    sock = str(tmp_path / "w0.sock")
    try:
        bps.init(socket=sock, local_rank=0, timeout=10.0)
        np.testing.assert_array_equal(bps.push_pull(np.ones(4, np.float32), "d", average=False), 1.0)
        cluster.kill("worker-0")
        with pytest.raises(bps.BPSConnectionError):
            bps.push_pull(np.ones(4, np.float32), "d", average=False)
        cluster.restart("worker-0")
        bps.init(socket=sock, local_rank=0, timeout=10.0)
        np.testing.assert_array_equal(bps.push_pull(np.full(4, 2.0, np.float32), "d", average=False), 2.0)
    finally:
        bps.shutdown()
        cluster.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [math.inf, 1e10])
def test_a_wait_longer_than_a_lock_can_wait_is_a_wait_for_ever(client, timeout):
    client()
    handle = bps.push_pull_async(np.ones(4, np.float32), "inf", average=False)
    np.testing.assert_array_equal(bps.synchronize(handle, timeout=timeout), 1.0)


@pytest.mark.timeout(60)
def test_a_name_whose_result_stays_in_one_segment_says_taken_once(client, monkeypatch):
    """The results holds' acknowledgement is per run of one segment, not per operation (a frame and a parse
    more in the daemon for every push_pull not summed in place, once)."""
    from bps_worker.client import connection as connection_mod

    client()
    told: list[int] = []
    real = connection_mod.Taken

    def counting(reqs: list[int]) -> Any:
        told.extend(reqs)
        return real(reqs)

    monkeypatch.setattr(connection_mod, "Taken", counting)
    big = np.arange(300_000, dtype=np.float32)  # (its result in the worker's results segment, not in place)
    for _ in range(20):
        np.testing.assert_array_equal(bps.push_pull(big, "R", average=False), big)
    assert 1 <= len(told) <= 2, told  # the first result's, and at most one more where the worker moved it


@pytest.mark.timeout(60)
def test_a_forked_child_is_told_it_cannot_use_its_parents_connection(client):
    """A process forked after init() (a data loader's worker, multiprocessing's fork) shared its parent's socket:
    its push_pull waited for ever (no reader thread), its requests took the parent's ids, and a shutdown() in it
    would cut the parent's connection. Now its calls fail at once saying so, its shutdown() only forgets, and
    the parent goes on; the child's copy of the socket is closed at the fork."""
    client()
    x = np.arange(8, dtype=np.float32)
    assert np.array_equal(bps.push_pull(x, "before", average=False), x)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            signal.alarm(20)  # the old code's child waited for ever
            said = [str(bps.is_initialized())]
            for call in (lambda: bps.push_pull(x, "child", average=False), bps.rank):
                try:
                    call()
                    said.append("no error")
                except bps.BPSError as exc:
                    said.append(str(exc))
            bps.shutdown()
            os.write(write, "\n".join(said).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    said = b"".join(chunks).decode().split("\n")
    assert said[0] == "False", said
    for text in said[1:3]:
        assert f"initialized in process {os.getpid()}" in text and f"({pid}) is a fork of it" in text, said
    for i in range(3):  # the parent's connection is whole, its request ids its own
        assert np.array_equal(bps.push_pull(x + i, f"after{i}", average=False), x + i)
    assert bps.is_initialized()


@pytest.mark.timeout(60)
def test_a_root_rank_of_any_integer_type_is_taken_and_a_bool_is_a_bps_error(client):
    """numpy's integers are ranks as Python's are (``np.int64(0)`` was refused as out of range), and a bool is
    refused as the client's own BPSError (it reached the message's check, whose error is not a BPSError)."""
    client()
    x = np.arange(4, dtype=np.float32)
    assert np.array_equal(bps.broadcast(x, np.int64(0), "root.numpy"), x)
    for call in (lambda: bps.broadcast(x, True, "root.bool"), lambda: bps.async_init(x, "root.async", True),
                 lambda: bps.broadcast(x, "0", "root.text"), lambda: bps.broadcast(x, 1, "root.out")):
        with pytest.raises(bps.BPSError, match="root_rank must be an integer in 0..0"):
            call()


def test_a_bfloat16_slot_can_be_asked_for_by_name_before_ml_dtypes_is_imported():
    """``shared_array(name, shape, "bfloat16")`` as the first use of bfloat16 in a process was refused
    ("unsupported dtype"): numpy knows the name only once ml_dtypes is imported, which the client defers."""
    code = ("import sys; import bps_worker.client.arguments as a; assert 'ml_dtypes' not in sys.modules; "
            "print(a.check_dtype('bfloat16')[1])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0 and result.stdout.strip() == "bfloat16", result.stderr


@pytest.mark.timeout(60)
def test_a_group_that_packs_a_name_in_flight_is_refused(client):
    """A name in flight from push_pull_async may not be summed again by the same process before it is
    synchronized: a group of two said so, a group large enough to pack its entries took it."""
    client()
    handle = bps.push_pull_async(np.ones(4, np.float32), "g.3", average=False)
    arrays = [np.full(4, i, np.float32) for i in range(8)]
    with pytest.raises(bps.BPSError, match="'g.3' is already in flight in this process"):
        bps.push_pull_group(arrays, [f"g.{i}" for i in range(8)], average=False)
    assert np.array_equal(bps.synchronize(handle), np.ones(4, np.float32))
    summed = bps.push_pull_group(arrays, [f"g.{i}" for i in range(8)], average=False)
    assert all(np.array_equal(y, a) for y, a in zip(summed, arrays))


@pytest.mark.timeout(60)
def test_a_small_max_payload_still_takes_small_tensors(client):
    """The daemon refused any allocation over 64 payloads: under a 64 KiB max_payload_bytes (the least: a smaller
    one is refused) that was the client's 4 MiB slab of small tensors, and every call failed naming the slab. A
    tensor of 64 payloads is summed; a larger one is refused naming the limit (it did not say it)."""
    client(partition_bytes=32768, max_payload_bytes=65536)
    for n in (1, 1000):
        x = np.arange(n, dtype=np.float32)
        assert np.array_equal(bps.push_pull(x, f"small.{n}", average=False), x)
    x = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: 64 payloads
    assert np.array_equal(bps.push_pull(x, "at_limit", average=False), x)
    with pytest.raises(bps.BPSError, match=r"'big' of 4194308 bytes is too large: at most 4194304 bytes \(64 times "
                                           r"cluster.max_payload_bytes\)"):
        bps.push_pull(np.zeros((1 << 20) + 1, np.float32), "big")


@pytest.mark.timeout(60)
def test_at_the_least_arena_small_tensors_are_summed_and_one_whose_slab_cannot_fit_is_named(client):
    """At the least arena_bytes (slabs of 256 KiB there; a smaller cap is refused: every small tensor failed
    under it), small tensors are summed. Where the rest of the cap is in use, the error names the tensor: it named
    only the slab ('\\x00slab/0'), an internal name the user never gave."""
    client(arena_bytes=4 * MB)
    tiny = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(bps.push_pull(tiny, "tiny", average=False), tiny)
    n = (4 * MB - 256 * 1024) // 4 + 16  # a segment of its own, with less room beside it than a slab
    view = adapter.shared_slot("held", (n,), np.float32)  # handed out to be filled: never given up for room
    view[...] = 1.0
    with pytest.raises(bps.BPSError, match=r"tensor 'tiny2' of 16 bytes is carved from a slab of 262144 bytes.*"
                                           r"arena_bytes"):
        bps.push_pull(tiny, "tiny2")
    result = bps.synchronize(adapter.start_filled("held", np.float32, (n,), average=False))
    np.testing.assert_array_equal(result, np.ones(n, np.float32))
    np.testing.assert_array_equal(bps.push_pull(tiny, "tiny2", average=False), tiny)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [16, 1_000_000], ids=["fused", "unfused"])
def test_a_handle_from_before_shutdown_and_init_is_refused(client, count):
    """An old handle read the new connection's memory: another round's result (a review found the sum of a
    later push of its name), or a segment already freed."""
    ops = client()
    socket = ops.settings.socket
    x = np.ones(count, np.float32)
    old = bps.push_pull_async(4 * x, "w", average=False)
    deadline = time.monotonic() + 30
    while not bps.poll(old):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    bps.shutdown()
    bps.init(socket=socket, local_rank=0, timeout=5.0)
    np.testing.assert_array_equal(bps.synchronize(bps.push_pull_async(7 * x, "w", average=False)), 7.0)
    for call in (bps.synchronize, bps.poll):
        with pytest.raises(bps.BPSError, match="belongs to a connection to the worker daemon that was shut down"):
            call(old)
    np.testing.assert_array_equal(bps.push_pull(x, "w", average=False), 1.0)  # (the name is free)


@pytest.mark.timeout(60)
def test_poll_in_a_forked_child_is_told_it_cannot_use_its_parents_connection(client):
    """poll() alone skipped the fork check: it flushed the parent's fusion buffer in the child, whose lock a
    thread of the parent's may have held at the fork (a hang, 1 child in 30 in a review)."""
    client()
    handle = bps.push_pull_async(np.ones(4, np.float32), "p", average=False)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(20)
            try:
                bps.poll(handle)
            except bps.BPSError as exc:
                code = 0 if "is a fork of it" in str(exc) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    np.testing.assert_array_equal(bps.synchronize(handle), 1.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [4, 300_000], ids=["fused", "unfused"])
def test_a_slice_of_a_shared_array_given_as_input_is_left_unchanged(client, count):
    """Copied into its name's slot, which is the shared array itself, the slice wrote over the array (and the
    sum landed there too)."""
    client()
    shared = bps.shared_array("g", (count + 1,), np.float32)
    shared[:] = np.arange(count + 1, dtype=np.float32)
    before = shared.copy()
    np.testing.assert_array_equal(bps.push_pull(shared[1:], "g", average=False), before[1:])
    np.testing.assert_array_equal(shared, before)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [4, 300_000], ids=["fused", "unfused"])
def test_another_view_of_a_shared_array_summed_into_it_lands_there(client, count):
    """``push_pull(a[::-1], name, out=a)`` with ``a`` the name's shared array: the view went through a copy of
    our own (it would have written over the array) and the sum landed in that copy: ``a`` came back unchanged,
    no error (a review's case)."""
    client()
    shared = bps.shared_array("h", (count,), np.float32)
    shared[:] = np.arange(count, dtype=np.float32)
    want = shared[::-1].copy()
    got = bps.push_pull(shared[::-1], "h", out=shared, average=False)
    assert got is shared
    np.testing.assert_array_equal(shared, want)


@pytest.mark.timeout(60)
def test_arguments_are_checked_by_type_as_well_as_value(client):
    """The argument cache was keyed by value: priority=1.0 (refused) was taken once priority=1 had been."""
    client()
    x = np.ones(4, np.float32)
    with pytest.raises(bps.BPSError, match="priority must be an integer"):
        bps.push_pull(x, "k", priority=1.0)
    bps.push_pull(x, "k", priority=1)
    with pytest.raises(bps.BPSError, match="priority must be an integer"):
        bps.push_pull(x, "k", priority=1.0)
    handle = bps.push_pull_async(x, "k")
    for bad in (math.nan, "5", True, -1, -0.5):  # (-1 was "timed out after -1 s" at once: a review)
        with pytest.raises(bps.BPSError, match=r"timeout must be a number of seconds >= 0 or None"):
            bps.synchronize(handle, timeout=bad)
    # Not a handle: a BPSError, as every failure a user can meet (a TypeError, and AttributeError from poll).
    for call in (lambda: bps.synchronize("k"), lambda: bps.poll("k"), lambda: bps.poll(None)):
        with pytest.raises(bps.BPSError, match="expected a handle from push_pull_async"):
            call()
    np.testing.assert_array_equal(bps.synchronize(handle, timeout=np.float64(30)), 1.0)
