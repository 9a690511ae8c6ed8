"""Bad client arguments with real daemons: each call fails alone with a BPSError, and the connection lives on
(issue 14 item 9: a name of 1,025 to 16K characters made the daemon drop the whole connection)."""

from __future__ import annotations

from pathlib import Path

import pytest

import client_programs as cp
from bps_worker.supervise import Cluster
from harness import run_ranks, start_cluster, write_config
from protocol.messages import MAX_NAME_CHARS

CASES = [
    ("name_1025", {"name": "n" * (MAX_NAME_CHARS + 1)}),
    ("name_16k", {"name": "n" * 16_000}),
    ("name_70k", {"name": "n" * 70_000}),
    ("surrogate", {"name": "bad\ud800"}),
    ("priority", {"priority": 2 ** 70}),
]


def test_bad_arguments_fail_only_their_call(tmp_path: Path) -> None:
    cluster: Cluster = start_cluster(write_config(tmp_path, [1], cpu_servers=0))
    try:
        (result,) = run_ranks(cluster, cp.bad_arguments_then_a_push, CASES, timeout=60)
    finally:
        cluster.stop()
    errors = result["errors"]
    assert set(errors) == {label for label, _ in CASES}
    for label, text in errors.items():
        assert text.startswith("BPSError: "), (label, text)
    assert f"at most {MAX_NAME_CHARS}" in errors["name_1025"] and "1025 characters" in errors["name_1025"]
    assert "cannot be encoded as UTF-8" in errors["surrogate"]
    assert f"priority {2 ** 70} is out of range" in errors["priority"]
    assert result["after"] == [0.0, 1.0, 2.0, 3.0]  # the connection still works


@pytest.mark.timeout(120)
def test_a_slot_another_names_operation_reads_is_not_moved_under_it(tmp_path):
    cluster = start_cluster(write_config(tmp_path / "c", [2], cpu_servers=0))
    try:
        mine, peer = run_ranks(cluster, cp.allocates_again_what_another_name_reads, timeout=90)
        assert "its memory is read by an operation in flight" in mine["refused"], mine
        assert mine["error"] == "" and peer == {"sum": 2.0}, (mine, peer)
    finally:
        cluster.stop()


@pytest.mark.timeout(120)
def test_an_op_naming_a_cuda_tensor_gets_every_ops_checks(tmp_path):
    cluster = start_cluster(write_config(tmp_path / "c", [1], cpu_servers=0))
    try:
        (errors,) = run_ranks(cluster, cp.cuda_ops_checked_as_any, timeout=90)
        assert "average=True needs a floating dtype" in errors["average"], errors
        assert "root rank 99 is outside 0..0" in errors["root"], errors
    finally:
        cluster.stop()


@pytest.mark.timeout(90)
def test_a_call_waiting_on_another_thread_hears_that_shutdown_was_called(tmp_path):
    cluster = start_cluster(write_config(tmp_path, [2], cpu_servers=0))
    try:
        first, _ = run_ranks(cluster, cp.shutdown_under_a_waiting_thread, timeout=60)
    finally:
        cluster.stop()
    assert not first["alive"] and len(first["heard"]) == 1, first
    assert first["heard"][0].endswith("failed: shutdown() was called in this process"), first


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fusion", ["default", "0"])
def test_an_init_that_fails_on_its_timeline_never_connects(tmp_path, monkeypatch, fusion):
    """The timeline's directory is checked before connecting: an init that failed on it connected and left, and
    failed the rounds its peers had open (a review's case)."""
    if fusion != "default":
        monkeypatch.setenv("BPS_FUSION_BYTES", fusion)
    cluster = start_cluster(write_config(tmp_path, [2], cpu_servers=1))
    flags = tmp_path / "flags"
    flags.mkdir()
    try:
        results = run_ranks(cluster, cp.failed_init_beside_an_open_round, cluster.config.worker_specs[0].socket,
                            str(flags), timeout=60)
    finally:
        cluster.stop()
    assert results == [{"sum": [3.0] * 4}, {"sum": [3.0] * 4}], results
