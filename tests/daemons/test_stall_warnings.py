"""A training process that stalls (alive and connected, it never pushes a tensor its peers pushed) fails
nothing, but the daemons say so in their logs after the timeout: the worker daemon names the tensor
and the local ranks that did and did not submit it, and the server the workers it waits for. The ranks
involved hear the same lines (Notice) and log them as warnings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import stall_programs as sp
from harness import run_ranks, start_cluster, write_config

TIMEOUT_S = 3.0
LATE_S = 2.2 * TIMEOUT_S  # warned after the timeout, and again after two


def _log(cluster, label: str) -> str:
    return Path(cluster.log_dir, f"{label}.log").read_text(errors="replace")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fusion", ["default", "0"])
def test_a_rank_that_never_submits_is_named_in_its_worker_daemons_log_and_to_the_ranks(tmp_path, monkeypatch,
                                                                                       fusion):
    """Also told to both ranks (Notice), which log it as a warning: the one that waits for its peer, and the
    late one itself (its reader thread logs it while the program sleeps). Fused and unfused alike."""
    if fusion != "default":
        monkeypatch.setenv("BPS_FUSION_BYTES", fusion)
    cluster = start_cluster(write_config(tmp_path, [2], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    try:
        results = run_ranks(cluster, sp.late_rank, 1, LATE_S, 1000, timeout=90, start_together=True)
        log = _log(cluster, "worker-0")
    finally:
        cluster.stop()
    assert all(r["exact"] for r in results), results  # a stall is not an error: the round completes
    said = (r"stall: tensor 'late' \(round 1 on worker 0\) has waited [\d.]+ s for local rank 1 \(rank 1\), which did "
            r"not submit it; submitted by local rank 0 \(rank 0\)")
    assert re.findall("WARNING " + said, log), log
    assert "tensor 'late' (round 0" not in log and "tensor 'late' (round 2" not in log, log  # on time
    for rank, r in enumerate(results):
        assert r["heard"] and all(re.match(said, line) for line in r["heard"]), (rank, r["heard"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fusion", ["default", "0"])  # the anchor's planner, or the round table
def test_a_machine_whose_rank_never_submits_is_named_by_the_server_and_to_the_ranks(tmp_path, monkeypatch, fusion):
    if fusion != "default":
        monkeypatch.setenv("BPS_FUSION_BYTES", fusion)
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    try:
        results = run_ranks(cluster, sp.late_rank, 1, LATE_S, 1000, timeout=90, start_together=True)
        worker_log = _log(cluster, "worker-0")
        server_logs = "".join(_log(cluster, f"server-{sid}") for sid in range(3))
    finally:
        cluster.stop()
    assert all(r["exact"] for r in results), results
    # Worker 0's own rank submitted: its daemon says the round waits at a server, for other workers.
    assert re.search(r"WARNING stall: tensor 'late' \(round 1 on worker 0\) has waited [\d.]+ s at server \d: "
                     r"every local rank submitted it; other workers have not pushed it", worker_log), worker_log
    # That server knows who: worker 1 (whose rank 1 is late) has not pushed, worker 0 has.
    said = (r"stall: round \d+ of 'late' part 0 has waited [\d.]+ s for worker 1, whose processes have not pushed it "
            r"\(pushed by worker 0\)")
    assert re.search("WARNING " + said, server_logs), server_logs
    # Both ranks hear the server's line (a Notice to both workers, passed on); rank 0 its worker's too.
    assert any(re.match(said, line) for line in results[0]["heard"]), results[0]["heard"]
    assert any(re.match(said, line) for line in results[1]["heard"]), results[1]["heard"]
    assert any(re.match(r"stall: tensor 'late' \(round 1 on worker 0\) has waited [\d.]+ s at server \d: every "
                        r"local rank submitted it", line) for line in results[0]["heard"]), results[0]["heard"]


@pytest.mark.timeout(120)
def test_thousands_of_failed_rounds_are_a_few_lines(tmp_path, monkeypatch):
    """A rank that leaves with thousands of rounds that await it failed each with a line of its own (a review's
    flood: 175,000 lines, 48 MB of log in 30 s). A few lines now (their count: LogLimit, test_admission)."""
    from bps_runtime.loglimit import FAILURE_LINES_BURST

    monkeypatch.setenv("BPS_FUSION_BYTES", "0")  # (unfused: a local round per name)
    cluster = start_cluster(write_config(tmp_path, [2], cpu_servers=1, cluster={"timeout": TIMEOUT_S}))
    flags = tmp_path / "flags"
    flags.mkdir()
    n = 2000
    try:
        results = run_ranks(cluster, sp.many_left_unmatched, n, str(flags), timeout=100, start_together=True)
        assert results[0] == {"failed": n}, results
        log = _log(cluster, "worker-0")
    finally:
        cluster.stop()
    failures = [line for line in log.splitlines() if "'unmatched." in line and "stall" not in line]
    assert len(failures) <= 2 * FAILURE_LINES_BURST, (len(failures), failures[:30])



STALL_S = 2.0  # cluster.stall_timeout of the tests below (at least the timeout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fusion", ["default", "0"])
@pytest.mark.parametrize("layout", [[2], [1, 1]], ids=["one machine", "two machines"])
def test_with_a_stall_timeout_ranks_whose_names_differ_fail_naming_who_did_not_push(tmp_path, monkeypatch, fusion,
                                                                                     layout):
    """cluster.stall_timeout (Horovod's stall shutdown time): a round that waits that long for a connected process
    (one machine: its local round, fused or not) or machine (two: the server's round table, or the anchor's
    planner for a fused name) fails with a BPSTimeoutError naming them, instead of waiting for ever with stall
    warnings; the job goes on (the next sum exact). Without it nothing fails (the tests above)."""
    if fusion != "default":
        monkeypatch.setenv("BPS_FUSION_BYTES", fusion)
    cluster = start_cluster(write_config(tmp_path, layout, cpu_servers=1,
                                         cluster={"timeout": 1.0, "stall_timeout": STALL_S}))
    try:
        results = run_ranks(cluster, sp.names_differ, 1, 1000, timeout=90, start_together=True)
    finally:
        cluster.stop()
    assert all(r["exact"] for r in results), results
    for rank, r in enumerate(results):
        name = "mine" if rank == 1 else "shared"
        other = 0 if rank == 1 else 1
        assert r["error"] is not None and r["error"][0] == "BPSTimeoutError", (rank, r)
        if layout == [2]:  # its worker daemon's local round: the local rank it waited for
            said = rf"tensor '{name}' timed out after 2 s: rank {other} of worker 0 did not submit it"
        else:  # the server's round (or fused name) waited for the other machine
            said = rf"'{name}'.* timed out after 2 s: (server \d: )?worker {other} did not push it"
        said += r" \(cluster.stall_timeout\)"
        assert re.search(said, r["error"][1]), (rank, r)
        assert STALL_S - 0.5 <= r["waited"] <= STALL_S + 8, (rank, r)


@pytest.mark.timeout(120)
def test_with_a_stall_timeout_an_asynchronous_answer_held_by_a_stalled_machine_fails(tmp_path):
    """The staleness bound held rank 0's answer for ever while the other machine's process stalled alive (a
    stall note only); with cluster.stall_timeout it fails, naming that worker, and the delta stands."""
    cluster = start_cluster(write_config(tmp_path, [1, 1], cpu_servers=1,
                                         cluster={"timeout": 1.0, "stall_timeout": STALL_S}))
    try:
        first, second = run_ranks(cluster, sp.async_straggler, STALL_S + 3.0, timeout=90, start_together=True)
    finally:
        cluster.stop()
    assert first["error"] is not None and first["error"][0] == "BPSTimeoutError", first
    assert re.search(r"step \d+ of 'a' timed out after 2 s: server \d: worker 1 did not come within the staleness "
                     r"bound 0 "
                     r"\(cluster.stall_timeout\)", first["error"][1]), first
    assert second["error"] is None and second["value"] == [3.0] * 4, second  # rank 0's delta was applied


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fusion", ["default", "0"])
def test_a_stall_timeout_fails_nothing_while_the_machine_waited_for_is_busy_with_its_other_tensors(tmp_path,
                                                                                                  monkeypatch,
                                                                                                  fusion):
    """Machine 1 issues the names in the other order, one every 0.1 s: machine 0's first names wait about 3 s at
    the servers (and the anchors' planners, fused) while machine 1 keeps pushing (reporting) its others. A stall
    timeout of 2 s failed them (it counted from the first push); it counts from the waiting machine's last catching
    up now. (32 names: every server hears from machine 1 at least every 5 names, 0.5 s, a margin of 4 under load.)"""
    if fusion != "default":
        monkeypatch.setenv("BPS_FUSION_BYTES", fusion)
    cluster = start_cluster(write_config(tmp_path, [2, 2], cpu_servers=1,
                                         cluster={"timeout": 1.0, "stall_timeout": STALL_S}))
    try:
        results = run_ranks(cluster, sp.busy_in_another_order, 32, 100_000 if fusion == "0" else 64, 0.1,
                            timeout=90, start_together=True)
    finally:
        cluster.stop()
    assert all(r == {"errors": []} for r in results), results
