"""The DDP drop-in (bps_worker.torch_ddp): DDP with ``bps.ddp_comm_hook`` trains like DDP's own all-reduce.

Rank programs are in ddp_programs.py; each rank joins a gloo group besides bps, on a port from free_ports.
Rank processes spend seconds importing torch on this 2-core machine, so the comparisons share one run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import bps_worker.torch as bps
import ddp_programs as dp
from harness import free_ports, run_ranks, write_config

SIZE = 4  # cluster_2x2: 2 workers x 2 processes


@pytest.fixture(scope="module")
def runs(cluster_2x2) -> list[dict]:
    (port,) = free_ports(1)
    return run_ranks(cluster_2x2, dp.ddp_vs_allreduce, port, timeout=110)


def _check_against_ddp(results: list[dict], size: int = SIZE) -> None:
    assert [r["rank"] for r in results] == list(range(size))
    assert len({r["final"] for r in results}) == 1, "the hook's replicas differ between ranks"
    for r in results:
        assert r["max_diff"] < 1e-6, r
        assert r["moved"] > 0.05, f"training barely moved the weights: the comparison would be weak ({r})"


def test_the_hook_returns_before_the_sum_is_done(runs):
    """Backward goes on while the daemons sum: rank 0's future was pending when the hook returned (the others
    pushed only after it), and completed with the mean of 0, 1, 2, 3."""
    assert runs[0]["at_once"]["pending"] is True
    for r in runs:
        assert r["at_once"]["value"] == [1.5] * 4, r


def test_unused_parameters_and_no_sync_train_like_ddp(runs):
    """find_unused_parameters=True (a head unused on some ranks each step, one layer unused everywhere), two
    steps with a micro-batch under no_sync(), state=None: 20 steps equal DDP-gloo's weights."""
    results = [r["unused"] for r in runs]
    _check_against_ddp(results)
    for r in results:
        assert r["never_unchanged"] == {"bps": True, "ddp": True}, r


def test_rebuilt_buckets_get_new_names_and_train_like_ddp(runs):
    """DDP rebuilds its buckets after the first iteration: bucket 0 shrinks from every gradient (1,571) to out
    and mid (1,155), and gets a new name rather than the same name with another shape."""
    results = [r["rebuilt"] for r in runs]
    _check_against_ddp(results)
    for r in results:
        assert r["names"] == {"chain.ddp.b0.0": [0, "torch.float32", 1571],
                              "chain.ddp.b0.1": [0, "torch.float32", 1155],
                              "chain.ddp.b1.0": [1, "torch.float32", 416]}, r["names"]


@pytest.mark.timeout(180)
@pytest.mark.cuda
def test_cuda_buckets_train_like_ddp(make_cluster):
    """The same comparison on CUDA (buckets handed to the worker daemon by CUDA IPC), 2 machines x 1 process:
    DDP over NCCL where each rank has a GPU of its own, over gloo's CUDA path on a single GPU."""
    cluster = make_cluster([1, 1], cpu_servers=0)
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    runs = run_ranks(cluster, dp.ddp_vs_allreduce, free_ports(1)[0], "cuda", backend, timeout=150)
    assert runs[0]["at_once"]["pending"] is True and runs[1]["at_once"]["value"] == [0.5] * 4, runs
    for case in ("unused", "rebuilt"):
        _check_against_ddp([r[case] for r in runs], size=2)


def test_failures_reach_the_user_as_bps_errors(cluster_2x2):
    """Ranks 0 and 1 (worker 0) disagree about a bucket: they get the BPSMismatchError naming it; worker 1's
    ranks get a BPSError too (which one depends on timing: the worker 0 gave the sum up, or its processes
    left). Never DDP's RuntimeError, never a hang."""
    ports = free_ports(3)
    results = run_ranks(cluster_2x2, dp.ddp_errors, ports, timeout=90)
    for rank, r in enumerate(results):
        for case in ("future", "backward", "world"):
            assert r[case]["bps"], (case, r)
        # from the future (a direct call: 6 elements on rank 0, 8 elsewhere)
        assert "direct.ddp.b0.0" in r["future"]["message"], r
        assert "float32[6]" in r["future"]["message"] and "float32[8]" in r["future"]["message"], r
        # nothing stuck after it: the next bucket is the mean over the 4 processes, in place
        assert r["after"] == {"value": [2.5] * 5, "in_place": True}, r
        # from backward(): rank 0 cut the model into buckets otherwise (buckets 1 and 2 differ)
        assert r["split"] == ([[0, 16], [1, 272], [2, 168]] if rank == 0 else [[0, 16], [1, 256], [2, 184]]), r
        if rank < 2:
            assert r["future"]["type"] == "BPSMismatchError" and r["future"]["name"] == "direct.ddp.b0.0", r
            assert r["backward"]["type"] == "BPSMismatchError" and r["backward"]["name"] == "split.ddp.b1.0", r
        # two DDP models sharing a hook state in one backward; then with a prefix each
        assert r["twins"]["twins"]["type"] == "BPSError", r["twins"]
        assert "give each DDP model its own prefix" in r["twins"]["twins"]["message"], r["twins"]
        assert r["twins"]["twin1"] == {"type": None} and r["twins"]["grad"] == [[2.5] * 4], r["twins"]
        # a DDP group of 2 in a job of 4
        assert r["world"]["type"] == "BPSError", r
        assert "has 2 processes but the bps job has 4" in r["world"]["message"], r


def test_a_dead_peer_fails_backward_with_a_bps_error(make_cluster):
    """2 machines x 1 process; rank 1 exits after two steps: rank 0's third backward raises the BPSError its
    worker reports (every process of worker 1 left), well within the client's timeout (20 s here)."""
    cluster = make_cluster([1, 1], cpu_servers=0)
    (port,) = free_ports(1)
    result, _ = run_ranks(cluster, dp.dead_peer, port, timeout=60, may_die=frozenset({1}))
    assert result["bps"] and result["type"].startswith("BPS"), result
    assert "worker 1" in result["message"], result
    assert result["seconds"] < 20, result


def test_a_ddp_on_a_subgroup_registered_by_register_ddp_hook_is_refused(make_cluster):
    """2 machines x 1 process, each rank's DDP on a group of its own. The hook alone sees only the default group:
    it averages the two groups' buckets (1.5 where DDP gives each rank its own 1.0 / 2.0), as the README says;
    register_ddp_hook checks DDP's own group and refuses it, naming both sizes."""
    cluster = make_cluster([1, 1], cpu_servers=0)
    (port,) = free_ports(1)
    for rank, r in enumerate(run_ranks(cluster, dp.subgroups, port, timeout=90)):
        assert r["hook"]["type"] is None and r["hook"]["grad"] == [[1.5, 1.5]], r
        assert r["helper"]["bps"] and "has 1 processes but the bps job has 2" in r["helper"]["message"], r


def test_bad_state_and_no_init_fail_the_future_without_a_cluster():
    assert not bps.is_initialized()
    bucket = dp.Bucket(0, torch.ones(3))
    with pytest.raises(bps.BPSError, match="state must be None, a prefix \\(str\\) or a DDPHookState, got int"):
        bps.ddp_comm_hook(42, bucket).wait()  # type: ignore[arg-type]
    with pytest.raises(bps.BPSError, match="not initialized"):
        bps.ddp_comm_hook(None, bucket).wait()  # type: ignore[arg-type]
    sparse = dp.Bucket(2, torch.ones(12).to_sparse(), [torch.ones(3, 4)])
    with pytest.raises(bps.BPSError, match="DDP bucket 2 holds torch.sparse_coo gradients \\(of the parameters of "
                                           "shapes 3x4, e.g. an nn.Embedding\\(sparse=True\\)\\)"):
        bps.ddp_comm_hook(bps.DDPHookState("sparse"), sparse).wait()  # type: ignore[arg-type]
    with pytest.raises(bps.BPSError, match="prefix must be a str, got bytes"):
        bps.DDPHookState(b"x")  # type: ignore[arg-type]


LAUNCHED = """
import atexit, json, os, sys, threading
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import bps_worker.torch as bps

bps.init()
RANK = bps.rank()


@atexit.register  # registered before the hook's first call: runs after the hook's own exit handler
def threads_at_exit():
    with open(os.path.join(sys.argv[1], f"threads{RANK}"), "w") as f:
        json.dump(sorted(t.name for t in threading.enumerate() if t.is_alive()), f)


dist.init_process_group("gloo")  # env://, from bps-launch as from torchrun
torch.manual_seed(0)
model = DistributedDataParallel(nn.Linear(3, 1, bias=False))
model.register_comm_hook(state=None, hook=bps.ddp_comm_hook)
model(torch.full((1, 3), float(dist.get_rank() + 1))).sum().backward()
with open(os.path.join(sys.argv[1], str(bps.rank())), "w") as f:
    json.dump({"world": dist.get_world_size(), "grad": model.module.weight.grad.tolist()}, f)
dist.destroy_process_group()
bps.shutdown()
"""


def test_a_ddp_script_runs_under_bps_launch(tmp_path):
    """The README's DDP lines as a script under bps-launch (2 machines x 1 process): the gradient of w.x with
    x = rank + 1 is x, averaged over both ranks: 1.5."""
    script, out = tmp_path / "ddp_job.py", tmp_path / "out"
    script.write_text(LAUNCHED)
    out.mkdir()
    config = write_config(tmp_path, [1, 1], cpu_servers=0)
    result = subprocess.run([sys.executable, "-m", "bps_worker.launch", "--config", str(config), "--",
                             sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in ("0", "1"):
        assert json.loads((out / rank).read_text()) == {"world": 2, "grad": [[1.5, 1.5, 1.5]]}
        # the hook's thread was joined at exit, before Python finalized (else a rare SIGABRT: torch_ddp)
        assert "bps-ddp-hook" not in json.loads((out / f"threads{rank}").read_text())


def test_a_name_claimed_twice_in_one_backward_fails_whatever_the_timing():
    """The second claim of a name in one backward fails even when the first push_pull has ended; in the next
    backward (another graph task) the name is free again; outside backward only a name in flight fails."""
    state = bps.DDPHookState("claims")
    name = state.claim(0, torch.float32, 4, task=7)
    assert name == "claims.ddp.b0.0"
    state.release(name)  # the first model's sum ended before the second model's hook ran
    with pytest.raises(bps.BPSError, match="'claims.ddp.b0.0'.*summed in the same backward.*own prefix"):
        state.claim(0, torch.float32, 4, task=7)
    assert state.claim(0, torch.float32, 4, task=8) == name  # the next step
    with pytest.raises(bps.BPSError, match="own prefix"):
        state.claim(0, torch.float32, 4, task=-1)  # in flight
    state.release(name)
    assert state.claim(0, torch.float32, 4, task=-1) == name
    state.release(name)
    assert state.claim(0, torch.float32, 4, task=-1) == name  # outside backward, one after another: fine
