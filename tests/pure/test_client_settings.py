"""bps_worker.client.settings: init()'s arguments and their environment defaults, resolved without a daemon."""

from __future__ import annotations

import re

import pytest

from bps_worker.client import BPSError
from bps_worker.client.settings import DEFAULT_TIMEOUT_S, Settings, resolve, timeline_path


def _resolve(environ: dict[str, str], **kwargs: object) -> Settings:
    args: dict[str, object] = {"socket": None, "local_rank": None, "timeout": DEFAULT_TIMEOUT_S, "timeline": None,
                               "cuda_ipc": None}
    args.update(kwargs)
    return resolve(environ=environ, **args)  # type: ignore[arg-type]


def test_everything_from_the_environment() -> None:
    s = _resolve({"BPS_SOCKET": "/run/w.sock", "BPS_LOCAL_RANK": "1", "BPS_TIMELINE": "/tmp/t",
                  "BPS_CUDA_IPC": "0"})
    assert s == Settings("/run/w.sock", 1, DEFAULT_TIMEOUT_S, "/tmp/t", False)


def test_arguments_win_over_the_environment() -> None:
    env = {"BPS_SOCKET": "/env.sock", "BPS_LOCAL_RANK": "1", "BPS_TIMELINE": "/env", "BPS_CUDA_IPC": "0"}
    s = _resolve(env, socket="/arg.sock", local_rank=0, timeout=5, timeline="/arg", cuda_ipc=True)
    assert s == Settings("/arg.sock", 0, 5.0, "/arg", True)


def test_local_rank_falls_back_to_torchrun_and_defaults() -> None:
    s = _resolve({"BPS_SOCKET": "/s", "LOCAL_RANK": "3"})
    assert (s.local_rank, s.timeline, s.cuda_ipc) == (3, None, True)
    assert _resolve({"BPS_SOCKET": "/s", "BPS_LOCAL_RANK": "2", "LOCAL_RANK": "3"}).local_rank == 2
    assert _resolve({"BPS_SOCKET": "/s", "LOCAL_RANK": "0", "BPS_TIMELINE": ""}).timeline is None


@pytest.mark.parametrize("environ, kwargs, message", [
    ({}, {"local_rank": 0}, "no worker socket: pass init(socket=...) or set BPS_SOCKET"),
    ({"BPS_SOCKET": "/s"}, {}, "no local rank: pass init(local_rank=...) or set BPS_LOCAL_RANK or LOCAL_RANK"),
    ({"BPS_SOCKET": "/s", "LOCAL_RANK": "x"}, {}, "local rank must be an integer, got 'x'"),
    ({"BPS_SOCKET": "/s"}, {"local_rank": 0, "timeout": 0}, "timeout must be a positive number of seconds, got 0"),
    ({"BPS_SOCKET": "/s"}, {"local_rank": 0, "timeout": float("inf")}, "timeout must be a positive number"),
])
def test_missing_or_malformed_settings_name_what(environ: dict[str, str], kwargs: dict[str, object],
                                                 message: str) -> None:
    with pytest.raises(BPSError) as info:
        _resolve(environ, **kwargs)
    assert message in str(info.value)


def test_timeline_paths() -> None:
    assert timeline_path("/tmp/trace", 3) == "/tmp/trace/rank3.json"
    assert timeline_path("/tmp/run.json", 3) == "/tmp/run.rank3.json"


def test_fusion_bounds_from_arguments_or_the_environment() -> None:
    base = {"BPS_SOCKET": "/s", "BPS_LOCAL_RANK": "0"}
    s = _resolve(base)
    assert (s.fusion_bytes, s.cycle_time_ms) == (64 << 20, 1.0)
    s = _resolve({**base, "BPS_FUSION_BYTES": "0", "BPS_CYCLE_TIME_MS": "2.5"})
    assert (s.fusion_bytes, s.cycle_time_ms) == (0, 2.5)
    s = _resolve({**base, "BPS_FUSION_BYTES": "0"}, fusion_bytes=1024, cycle_time_ms=0)
    assert (s.fusion_bytes, s.cycle_time_ms) == (1024, 0.0)


@pytest.mark.parametrize("env, kwargs, says", [
    ({"BPS_FUSION_BYTES": "lots"}, {}, "BPS_FUSION_BYTES must be a non-negative int, got 'lots'"),
    ({"BPS_CYCLE_TIME_MS": "-1"}, {}, "BPS_CYCLE_TIME_MS must be a non-negative float, got -1.0"),
    ({}, {"fusion_bytes": 1.5}, "fusion_bytes must be a non-negative int, got 1.5"),
    ({}, {"cycle_time_ms": float("inf")}, "cycle_time_ms must be a non-negative float, got inf"),
])
def test_bad_fusion_bounds_are_refused_by_name(env: dict[str, str], kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(BPSError, match=re.escape(says)):
        _resolve({"BPS_SOCKET": "/s", "BPS_LOCAL_RANK": "0", **env}, **kwargs)


def test_a_local_rank_of_any_integer_type_is_taken_and_others_refused_by_name() -> None:
    """numpy's integers too (one failed the handshake's type check: a LocalProtocolError, not a BPSError, and the
    socket left open; a review's case)."""
    import numpy as np

    s = _resolve({"BPS_SOCKET": "/run/w.sock"}, local_rank=np.int64(1))
    assert s.local_rank == 1 and type(s.local_rank) is int
    for bad in ("1", 1.0, True):
        with pytest.raises(BPSError, match="local rank must be an integer, got"):
            _resolve({"BPS_SOCKET": "/run/w.sock"}, local_rank=bad)


def test_the_timeline_directory_is_made_or_refused_before_connecting(tmp_path) -> None:
    from bps_worker.client.settings import timeline_directory

    assert timeline_directory(str(tmp_path / "a" / "t.json")) == str(tmp_path / "a") and (tmp_path / "a").is_dir()
    assert timeline_directory(str(tmp_path / "b")) == str(tmp_path / "b") and (tmp_path / "b").is_dir()
    with pytest.raises(BPSError, match="cannot write the timeline in '/proc/no': "):
        timeline_directory("/proc/no/t.json")


@pytest.mark.parametrize("environ, job", [
    ({}, ""),
    ({"BPS_JOB": "run-3", "TORCHELASTIC_RUN_ID": "elastic", "SLURM_JOB_ID": "77"}, "run-3"),
    ({"TORCHELASTIC_RUN_ID": "0f2c-random-per-single-node-run"}, ""),  # a different one on every machine
    ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "2"}, ""),
], ids=["none", "bps-job", "not-torchruns-run-id", "not-slurms"])
def test_the_job_is_bps_job_alone(environ: dict[str, str], job: str) -> None:
    assert _resolve({"BPS_SOCKET": "/s", "BPS_LOCAL_RANK": "0", **environ}).job == job


def test_a_jobs_name_longer_than_the_protocol_carries_is_refused() -> None:
    with pytest.raises(BPSError, match="BPS_JOB is 129 characters; at most 128"):
        _resolve({"BPS_SOCKET": "/s", "BPS_LOCAL_RANK": "0", "BPS_JOB": "j" * 129})
