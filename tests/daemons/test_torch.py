"""The PyTorch layer (bps_worker.torch) on real clusters: training equals single-process training.

Every rank program is in torch_programs.py. Rank processes fork from the harness's forkserver, which
imported torch once (``harness.rank_context``, torch._dynamo included: a first optimizer imports it); a run
still trains for seconds on this 2-core machine, so related checks share one run (module-scoped fixtures) on
the module-scoped 2 workers x 2 processes cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import bps_worker.torch as bps
import torch_programs as tp
from harness import run_ranks

SIZE = 4  # cluster_2x2: 2 workers x 2 processes
# (compression, backward passes per step, bucket_bytes: None for the default)
VARIANTS = [("none", 1, None), ("none", 2, None), ("fp16", 1, None), ("bf16", 1, None), ("none", 1, 0),
            ("none", 1, 512)]
# Unit roundoff of the wire dtype (round to nearest): half the gap between 1 and the next value.
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -9}
# The training and tensor checks run on CPU tensors, and again on CUDA tensors (through CUDA IPC) where a GPU is.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _same_everywhere(results: list[dict], key: str) -> str:
    values = {r[key] for r in results}
    assert len(values) == 1, f"{key} differs between ranks: {values}"
    return values.pop()


# -- 1-3: training a CNN --------------------------------------------------------------
@pytest.fixture(scope="module", params=DEVICES)
def cnn_runs(request, cluster_2x2) -> dict[str, list[dict]]:
    """train_cnn for every variant (20 steps, batch 8 per rank), by variant, in rank order; on the CPU, and on
    the GPU where there is one."""
    per_rank = run_ranks(cluster_2x2, tp.train_variants, VARIANTS, request.param, timeout=100)
    keys = [tp.variant_key(*v) for v in VARIANTS]
    return {k: [r[k] for r in per_rank] for k in keys}


def _check_start_and_end(results: list[dict]) -> None:
    assert [r["rank"] for r in results] == list(range(SIZE))
    assert len({r["before"] for r in results}) == SIZE, "ranks were meant to start from different weights"
    assert all(r["after"] == results[0]["before"] for r in results), "broadcast_parameters did not give rank 0's"
    _same_everywhere(results, "final")
    assert results[0]["final"] != results[0]["after"]
    assert results[0]["moved"] > 0.02, "training barely moved the weights: the comparison would be weak"


def test_cnn_equals_single_process_on_the_whole_batch(cnn_runs):
    """4 processes x batch 8 for 20 steps == one process x batch 32 (SGD with momentum)."""
    results = cnn_runs["none/1"]
    _check_start_and_end(results)
    for r in results:
        assert r["max_diff"] < 1e-5, r
        assert not r["grads_on_wire_grid"], "float32 gradients all representable in float16? (check is vacuous)"


@pytest.mark.parametrize("bucket_bytes", [0, 512])
def test_cnn_with_other_bucket_sizes(cnn_runs, bucket_bytes):
    """Gradients one per push (0), or in buckets of two gradients (512 bytes: fc, conv2, conv1, each weight with
    its bias), train exactly like the default (the whole model in one bucket)."""
    default = cnn_runs["none/1"][0]["buckets"]
    assert len(default) == 1 and len(default[0]) == 6, default
    results = cnn_runs[f"none/1/{bucket_bytes}"]
    _check_start_and_end(results)
    names = [[n.rsplit(".", 2)[-2:] for n in b] for b in results[0]["buckets"]]
    if bucket_bytes == 0:
        assert len(names) == 6 and all(len(b) == 1 for b in names), names
    else:
        assert names == [[["fc", "bias"], ["fc", "weight"]], [["conv2", "bias"], ["conv2", "weight"]],
                         [["conv1", "bias"], ["conv1", "weight"]]], names
    for r in results:
        assert r["max_diff"] < 1e-5, r


def test_cnn_backward_passes_per_step_2(cnn_runs):
    """Two backward passes of 8 samples per rank and step, loss / 2 each == one process x batch 64."""
    results = cnn_runs["none/2"]
    _check_start_and_end(results)
    for r in results:
        assert r["max_diff"] < 1e-5, r
    # Not the same training as with one pass (twice the data per step).
    assert results[0]["final"] != cnn_runs["none/1"][0]["final"]


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_cnn_with_compression_within_rounding_tolerance(cnn_runs, compression):
    """The tolerance, derived: each averaged gradient element is rounded at most 3 times to the wire
    dtype (each process's gradient, the worker's local sum, the server's average; sums accumulate in
    float32 and round once), so its error is <= 3u·G (u the unit roundoff, G the largest gradient
    element). With momentum mu an error in one step's gradient moves the weights by at most
    lr/(1-mu) times it over all later steps, so after n steps |w - w_ref| <= n·lr/(1-mu)·3u·G;
    doubled for the feedback of slightly different weights on later gradients."""
    results = cnn_runs[f"{compression}/1"]
    _check_start_and_end(results)
    r0 = results[0]
    bound = 2 * r0["steps"] * r0["lr"] / (1 - r0["momentum"]) * 3 * UNIT_ROUNDOFF[compression] * r0["max_grad"]
    assert bound < {"fp16": 2e-2, "bf16": 1e-1}[compression], f"tolerance {bound} would be too loose to mean much"
    for r in results:
        assert r["max_diff"] < bound, (r["max_diff"], bound)
        assert r["grads_on_wire_grid"], "an averaged gradient is not representable in the wire dtype"
    # Compression happened: not the result of uncompressed training, and further from the reference.
    assert r0["final"] != cnn_runs["none/1"][0]["final"]
    assert r0["max_diff"] > 10 * cnn_runs["none/1"][0]["max_diff"]


# -- 4: broadcast_parameters + broadcast_optimizer_state --------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_broadcast_parameters_and_optimizer_state(cluster_2x2, device):
    results = run_ranks(cluster_2x2, tp.broadcast_state, device, timeout=60)
    root = results[0]
    assert len({r["model_before"] for r in results}) == SIZE
    assert len({r["opt_before"] for r in results}) == SIZE
    # Every rank now has rank 0's parameters, buffers and optimizer state; rank 0's did not change.
    for key in ("model", "params", "buffers", "opt", "moments"):
        _same_everywhere(results, key)
    assert root["model"] == root["model_before"] and root["opt"] == root["opt_before"], "the root's state changed"
    assert root["params"] == root["params_before"]
    for r in results:
        # Rank 0's Adam state after 3 local steps, everywhere (others had lr 1.5/2.5/3.5 and no state).
        assert r["n_state"] == 8 and r["steps"] == [3.0], r
        assert r["lr"] == [0.01] and r["betas"] == [[0.8, 0.95]], r
        assert r["exp_avg_nonzero"]
        # BatchNorm buffers: running stats and num_batches_tracked from rank 0's 3 training batches.
        assert r["num_batches_tracked"] == 3 and not r["running_var_is_default"]
        # bool and uint8 buffers arrive exactly and keep their dtypes.
        assert r["mask"] == [True, False, True, False, True, False] and r["mask_dtype"] == "torch.bool"
        assert r["codes"] == [0, 3, 6, 9, 12] and r["codes_dtype"] == "torch.uint8"
        assert r["steps_after"] == [4.0]
        # every parameter, buffer and moment stayed on the model's device (Adam's step counts stay on the CPU)
        assert r["devices"] == [device if device == "cpu" else "cuda:0"], r["devices"]
    # The broadcast state is usable: after one distributed Adam step every rank is still identical.
    # (Parameters: BatchNorm's running stats follow each rank's own batch, as in Horovod.)
    assert _same_everywhere(results, "after_step") != root["params"]
    _same_everywhere(results, "opt_after_step")


# -- 5: parameters without a gradient ---------------------------------------------------
@pytest.fixture(scope="module")
def unused_run(cluster_2x2) -> list[dict]:
    return run_ranks(cluster_2x2, tp.unused_parameters, timeout=60)  # a hang fails here


def test_unused_parameters_neither_hang_nor_are_skipped(unused_run):
    results = unused_run
    n_steps = len(tp.HEAD_A_USERS)
    for r in results:
        assert len(r["steps"]) == n_steps
        assert r["never_unchanged"], "the never-used parameter was updated"
        for s, step in enumerate(r["steps"]):
            users_a = tp.HEAD_A_USERS[s]
            expect_none = ["never.weight", "never.bias"]
            if not users_a:
                expect_none = ["head_a.weight", "head_a.bias"] + expect_none
            if len(users_a) == SIZE:
                expect_none = ["head_b.weight", "head_b.bias"] + expect_none
            assert sorted(step["none"]) == sorted(expect_none), (r["rank"], s, step["none"])
            # Averages with zeros from the processes that did not use the parameter.
            for name, diff in step["diff"].items():
                assert diff is None or (isinstance(diff, float) and diff < 1e-6), (r["rank"], s, name, diff)
    # A rank that did not use head_a in step 0 (rank 1) still got rank 0's gradient / 4.
    assert "head_a.weight" in results[1]["steps"][0]["local_none"]
    assert "head_a.weight" not in results[1]["steps"][0]["none"]
    for s in range(n_steps):
        grads = {json.dumps(r["steps"][s]["grads"], sort_keys=True) for r in results}
        assert len(grads) == 1, f"step {s}: ranks got different gradients"
    _same_everywhere(results, "final")


def test_partial_passes_are_averaged_like_any_gradient(unused_run):
    """backward_passes_per_step=2, head_a used in only some passes (torch_programs.partial_passes)."""
    for case in ("some", "all"):
        for r in unused_run:
            assert r["partial"][case]["diff"] < 1e-6, (case, r["rank"], r["partial"][case])
        assert len({r["partial"][case]["after_digest"] for r in unused_run}) == 1, case
    assert len({r["partial"]["weights"] for r in unused_run}) == 1


# -- 6: validation, in this process, without a cluster ---------------------------------
def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def test_validation_errors_without_a_cluster():
    assert not bps.is_initialized()
    m = _model()
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)
    p0, p1 = list(m.parameters())[:2]
    cases = [
        (lambda: bps.DistributedOptimizer(m, named_parameters=m.named_parameters()),
         "wraps a torch.optim.Optimizer, got Sequential"),
        (lambda: bps.DistributedOptimizer(torch.optim.SGD([p0, p1], lr=0.1), named_parameters=[("w", p0), ("w", p1)]),
         "named_parameters has duplicate names: w"),
        (lambda: bps.DistributedOptimizer(sgd, named_parameters=m[2].named_parameters()),
         "2 optimizer parameters are missing from named_parameters (#0 (4, 3), #1 (4,))"),
        (lambda: bps.DistributedOptimizer(sgd, named_parameters=m.parameters()),
         "named_parameters must yield (name, parameter) pairs"),
        (lambda: bps.DistributedOptimizer(sgd, backward_passes_per_step=0),
         "backward_passes_per_step must be an integer >= 1, got 0"),
        (lambda: bps.DistributedOptimizer(sgd, backward_passes_per_step=2.0),
         "backward_passes_per_step must be an integer >= 1, got 2.0"),
        (lambda: bps.DistributedOptimizer(sgd, compression="fp16"),
         "compression must be one of Compression.none/fp16/bf16, got 'fp16'"),
        (lambda: bps.DistributedOptimizer(sgd, compression=torch.float16),
         "compression must be one of Compression.none/fp16/bf16"),
        (lambda: bps.DistributedOptimizer(sgd, bucket_bytes=-1), "bucket_bytes must be an integer >= 0, got -1"),
        (lambda: bps.DistributedOptimizer(sgd, bucket_bytes=True), "bucket_bytes must be an integer >= 0, got True"),
        (lambda: bps.DistributedOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(2, dtype=torch.complex64))],
                                                          lr=0.1)),
         "parameter '0' has dtype torch.complex64, which cannot be summed"),
        (lambda: bps.broadcast_parameters(42, 0), "params must be a state_dict() or named_parameters(), got int"),
        (lambda: bps.broadcast_parameters([("a", p0), ("a", p1)], 0), "params has duplicate names"),
        (lambda: bps.broadcast_parameters([p0, p1], 0), "params must hold (name, tensor) pairs"),
        (lambda: bps.push_pull(torch.ones(3, dtype=torch.bool), "b"), "unsupported tensor dtype torch.bool"),
        (lambda: bps.push_pull(torch.ones(3), "o", out=torch.ones(4)),
         "tensor 'o': out has shape (4,) and dtype torch.float32, expected (3,) and torch.float32"),
        (lambda: bps.push_pull([1.0, 2.0], "l"), "tensor 'l': expected a torch.Tensor, got list"),
        (lambda: bps.push_pull(torch.ones(3), "n"), "not initialized; call init() first"),
    ]
    for call, text in cases:
        with pytest.raises(bps.BPSError) as info:
            call()
        assert text in str(info.value), (text, str(info.value))

    opt = bps.DistributedOptimizer(sgd, named_parameters=m.named_parameters())
    with pytest.raises(bps.BPSError, match=r"add_param_group\(\) after wrapping is not supported"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
    with pytest.raises(bps.BPSError, match=r"step\(\) inside skip_synchronize\(\) without a synchronize\(\)"):
        with opt.skip_synchronize():
            opt.step()
    assert issubclass(bps.BPSError, Exception) and not bps.is_initialized()


# -- 7: push_pull / broadcast on tensors, autograd ---------------------------------------
@pytest.fixture(scope="module", params=DEVICES)
def tensor_ops(request, cluster_2x2) -> list[dict]:
    return run_ranks(cluster_2x2, tp.tensor_ops, request.param, timeout=60)


def test_push_pull_and_broadcast_every_dtype(tensor_ops):
    keys = set(tensor_ops[0]) - {k for k in tensor_ops[0] if k.startswith("autograd")}
    expected = ({f"pp.{d}.False" for d in tp.TORCH_DTYPES} | {f"bc.{d}" for d in tp.TORCH_DTYPES}
                | {f"pp.{d}.True" for d in ("float32", "float64", "float16", "bfloat16")}
                | {"noise", "inplace", "noncontig"})
    assert keys == expected
    for key in sorted(keys):
        for rank, r in enumerate(tensor_ops):
            assert r[key]["exact"], f"{key} on rank {rank} differs from the torch reference"
            assert r[key].get("input_unchanged", True), f"{key} on rank {rank} modified its input"
        assert len({r[key]["digest"] for r in tensor_ops}) == 1, f"{key}: ranks got different bytes"


def test_push_pull_is_differentiable(tensor_ops):
    for r in tensor_ops:
        # y = sum over ranks of x_r (x_r = rank + 1) = 10; loss_r = (rank + 1) * sum(y):
        # d(sum of losses)/dx_r = sum over ranks of (rank + 1) = 10.
        assert r["autograd.False"] == {"y": [10.0] * 3, "grad": [10.0] * 3, "requires_grad": True}
        # y = mean = 2.5; the gradient is the mean of the (rank + 1)s = 2.5.
        assert r["autograd.True"] == {"y": [2.5] * 3, "grad": [2.5] * 3, "requires_grad": True}
        # y.sum().backward(): x.grad = size() (the sum of the ones of every process)
        assert r["autograd.ones"] == {"grad": [4.0] * 4, "size": SIZE}


# -- 8: LR scheduler, synchronize + clipping + skip_synchronize, errors in flight ----------
@pytest.fixture(scope="module")
def scheduler_run(cluster_2x2) -> list[dict]:
    return run_ranks(cluster_2x2, tp.scheduler_and_clip, timeout=60)


def test_lr_scheduler_and_clipping_with_skip_synchronize(scheduler_run):
    for r in scheduler_run:
        assert r["lrs"] == [0.1 * 0.5 ** (s // 3) for s in range(8)] == r["ref_lrs"]
        # Clipping acted on the averaged gradient: the same norm as the one-process gradient's.
        assert all(n > 0.05 for n in r["norms"]), "clipping never acted"
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
        assert r["clip_vs_reference"] < 1e-5
        # synchronize(); step() inside skip_synchronize() == plain step(). Bit for bit: with 2 workers of
        # 2 processes every sum has two operands, and float addition of two operands is commutative.
        assert r["skip_vs_plain"] == 0.0 and r["skip_equals_plain_bitwise"]
    _same_everywhere(scheduler_run, "final")
    _same_everywhere(scheduler_run, "final_plain")


def test_errors_with_gradients_in_flight(scheduler_run):
    for r in scheduler_run:
        e = r["errors"]
        assert e["zero_grad"] == ("zero_grad() while 6 gradients are being summed; call step() or synchronize() "
                                  "first")
        assert e["skip_without_sync"] == "step() inside skip_synchronize() without a synchronize() call before it"
        assert e["twice"] is not None and "was produced more than backward_passes_per_step = 1 times" in e["twice"]
    # After each error, step() recovered and every rank applied the same update.
    _same_everywhere(scheduler_run, "after_errors")
    _same_everywhere(scheduler_run, "after_twice")


# -- 9: torchrun --------------------------------------------------------------------------
def test_torchrun_processes_find_their_worker(make_cluster, tmp_path):
    cluster = make_cluster([2], cpu_servers=0)
    out = tmp_path / "results"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("BPS_LOCAL_RANK", "LOCAL_RANK")}
    # (TMPDIR: torchrun's own temporary directory, which it leaves, goes in the test's)
    env.update(BPS_SOCKET=cluster.config.worker_specs[0].socket, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    script = Path(__file__).resolve().parents[1] / "torchrun_push_pull.py"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           str(script), str(out)], env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert res == {"rank": r, "size": 2, "local_rank": r, "local_size": 2, "env_local_rank": str(r),
                       "sum": [3.0] * 4, "mean": [0.0, 1.5, 3.0]}
    assert elapsed < 30, f"torchrun took {elapsed:.1f} s"


def test_a_failed_step_leaves_the_optimizer_usable(cluster_2x2):
    results = run_ranks(cluster_2x2, tp.recover_after_mismatch, timeout=90)
    for r in results:
        assert r["error"] is not None and "mismatch" in r["error"], r
    assert len({r["digest"] for r in results}) == 1
