"""The PyTorch layer's edges, with real daemons (2 processes on one machine): each was a silent wrong result, a
bare exception or a broken second phase before its fix (a review of the layer, session 29). Programs in
tests/torch_edge_programs.py."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

import torch_edge_programs as tp
from bps_worker.supervise import Cluster
from harness import run_ranks, start_cluster, write_config


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    made = start_cluster(write_config(tmp_path_factory.mktemp("torch_edges"), [2], cpu_servers=0))
    try:
        yield made
    finally:
        made.stop()


def _run(cluster: Cluster, program: Any) -> list[dict[str, Any]]:
    return run_ranks(cluster, program, timeout=60, client_timeout=10)


@pytest.mark.timeout(90)
def test_gradients_set_without_backward_are_averaged(cluster: Cluster) -> None:
    for r in _run(cluster, tp.assigned_grads):
        assert r["grad"] == [[1.5, 1.5, 1.5]] and r["moved"] == [[1.5, 1.5, 1.5]], r


@pytest.mark.timeout(90)
def test_a_second_asynchronous_model_with_the_same_names_is_refused(cluster: Cluster) -> None:
    for r in _run(cluster, tp.two_async_models):
        assert "already held by another asynchronous optimizer" in r["refused"] and r["named"], r


@pytest.mark.timeout(90)
def test_a_broadcast_of_a_dtype_the_wire_does_not_carry_gives_the_roots_bits(cluster: Cluster) -> None:
    root, other = _run(cluster, tp.odd_dtypes)
    assert root["after"] == root["before"]  # (complex and float8 values cast to int32 lost all but their integer part)
    assert other["after"] == root["before"] != other["before"]
    assert root["after"]["flag"] == ["torch.bool", [], True] and root["after"]["u8"][2] == [255, 0]
    assert root["plain"] == other["plain"] == root["before"]  # bps.broadcast as well as broadcast_parameters


@pytest.mark.timeout(90)
def test_the_numpy_broadcast_carries_any_dtype_bit_for_bit_and_a_differing_one_is_a_mismatch(cluster: Cluster
                                                                                               ) -> None:
    root, other = _run(cluster, tp.numpy_odd_broadcasts)
    assert root["after"] == other["after"] == root["before"] != other["before"]
    assert root["after"]["big"][0] == ">f4" and root["after"]["rec"][1] == [1] and root["after"]["empty"][1] == [0, 3]
    assert root["mismatch"] == ["np.differ", "int32[1] (broadcast from rank 0) (layout bytes of bool[4])",
                                "int32[1] (broadcast from rank 0) (layout bytes of uint8[4])"], root
    assert other["mismatch"] == ["np.differ", root["mismatch"][2], root["mismatch"][1]], other
    assert root["later"] == other["later"] == [True]


@pytest.mark.timeout(90)
def test_sparse_and_self_overlapping_tensors_are_bps_errors_before_anything_is_sent(cluster: Cluster) -> None:
    for r in _run(cluster, tp.not_dense_inputs):
        sparse = "tensor {}: {}is a torch.sparse_coo tensor; only dense tensors are summed and broadcast (pass " \
                 "{}.to_dense())"
        assert r["errors"][:3] == ["BPSError: " + sparse.format("'sp'", "", "it"),
                                   "BPSError: " + sparse.format("'sp.b'", "", "it"),
                                   "BPSError: " + sparse.format("'sp.out'", "out ", "out")], r
        overlapping = "out has elements that share memory (an expand()-ed or as_strided tensor, strides {}); the " \
                      "result cannot be written into it"
        assert r["errors"][3:5] == ["BPSError: tensor 'expanded': " + overlapping.format("(0, 1)"),
                                    "BPSError: tensor 'strided': " + overlapping.format("(1, 1)")], r
        assert r["errors"][5] == "BPSError: tensor 'notatensor': out expected a torch.Tensor, got list", r
        assert r["summed"] == [[2.0] * 4] * 3, r


@pytest.mark.timeout(90)
def test_a_parameter_unfrozen_after_wrapping_is_an_error_until_wrapped_again(cluster: Cluster) -> None:
    results = _run(cluster, tp.unfrozen_after_wrapping)
    for r in results:
        assert "did not require one when this DistributedOptimizer was made" in r["first"], r
    assert results[0]["w0"] == results[1]["w0"]  # averaged once wrapped again


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["added", "replaced"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_group_added_to_the_wrapped_optimizer_is_an_error_until_wrapped_again(cluster: Cluster,
                                                                                 asynchronous: bool, how: str) -> None:
    """``replaced``: a parameter put in another's place, the groups' sizes unchanged (failed before: counted)."""
    results = run_ranks(cluster, tp.group_added_to_the_wrapped_optimizer, asynchronous, how, timeout=60,
                        client_timeout=10)
    for r in results:
        assert "the wrapped optimizer's parameters changed after DistributedOptimizer wrapped it (1 new" in \
            r["first"], r
        # untouched by the refused step; then averaged (-(1 + 2) / 2) once wrapped again
        assert r["head"] == ([0.0] * 3 if asynchronous else [-1.5] * 3), r


@pytest.mark.timeout(90)
def test_a_second_broadcast_of_asynchronous_parameters_is_refused_before_writing(cluster: Cluster) -> None:
    for rank, r in enumerate(_run(cluster, tp.async_broadcast_again)):
        assert "whose asynchronous values the servers hold already" in r["refused"], r
        assert r["kept"] == [[7.0 if rank == 0 else -3.0] * 3], r  # nothing written
        assert r["other"] == [0.0], r


@pytest.mark.timeout(90)
def test_optimizer_state_that_is_not_broadcast_is_a_bps_error_naming_it(cluster: Cluster) -> None:
    for r in _run(cluster, tp.optimizer_state_not_broadcast):
        assert "the root's optimizer state holds a collections.deque, which is not broadcast" in r["refused"], r
        assert r["history"] == [1.0, 0.0], r  # as a list: the root's


@pytest.mark.timeout(90)
def test_numpy_hyperparameters_are_broadcast(cluster: Cluster) -> None:
    for r in _run(cluster, tp.numpy_hyperparameters):
        assert r == {"lr": 0.1, "type": "float"}, r


@pytest.mark.timeout(90)
def test_grad_scaler_steps_with_the_unscaled_average(cluster: Cluster) -> None:
    for r in _run(cluster, tp.grad_scaler):
        assert r["moved"] == [[1.5, 1.5, 1.5]], r


@pytest.mark.timeout(90)
def test_grad_scaler_without_the_recipe_is_an_error_behind_any_wrappers_of_step(cluster: Cluster) -> None:
    for r in _run(cluster, tp.scaler_without_the_recipe_behind_wrappers):
        assert "changed after backward() handed it to DistributedOptimizer" in r["error"], r
        assert r["weight"] == [[0.0, 0.0, 0.0]], r  # (nothing stepped)


@pytest.mark.timeout(90)
def test_a_gradient_changed_on_one_process_only_leaves_the_replicas_identical(cluster: Cluster) -> None:
    for rank, r in enumerate(_run(cluster, tp.guard_on_one_rank)):
        assert r["weight"] == [[-3.0, -3.0, -3.0]], r  # the average, 1.5, stepped twice on every process
        if rank == 0:
            assert "changed after backward()" in r["errors"][0] and "as every other process has them" in \
                r["errors"][0], r
            assert r["errors"][1] == "", r
        else:
            assert r["errors"] == ["", ""], r


@pytest.mark.timeout(90)
def test_step_with_a_closure_applies_the_averaged_gradients(cluster: Cluster) -> None:
    for rank, r in enumerate(_run(cluster, tp.closure_steps)):
        assert r["weight"] == [[-3.0, -3.0, -3.0]], r
        assert r["losses"] == [0.0, -4.5 * (rank + 1)], r  # (each process's own loss, as under DDP)


@pytest.mark.timeout(90)
def test_a_closure_that_raises_fails_only_its_step(cluster: Cluster) -> None:
    first, second = _run(cluster, tp.closure_that_raises)
    assert first["raised"] == ["before backward", "after backward"], first
    assert second["raised"] == ["after backward"], second
    # step 1: rank 0 took part with zeros (the mean 1.0 moved rank 1 only); step 2 moved nobody; step 3: the mean 1.5
    assert first["weight"] == [[-1.5, -1.5, -1.5]] and second["weight"] == [[-2.5, -2.5, -2.5]], (first, second)


@pytest.mark.timeout(90)
def test_a_model_wrapped_twice_trains_under_the_second_optimizer(cluster: Cluster) -> None:
    first, second = _run(cluster, tp.wrapped_twice)
    assert first["weight"] == second["weight"]


@pytest.mark.timeout(90)
def test_a_sparse_gradient_is_a_bps_error(cluster: Cluster) -> None:
    results = _run(cluster, tp.sparse_gradient)
    for r in results:
        assert len(r["errors"]) == 3, r
        for error in r["errors"]:
            assert error.startswith("BPSError") and "'emb.weight' has a torch.sparse_coo gradient" in error, r
    mean = sum(range(len(results))) / len(results)  # (each rank's input is its rank)
    for r in results:
        assert r["grad"] == [[mean, mean, mean]], r


@pytest.mark.timeout(90)
def test_optimizers_may_list_the_named_parameters_in_other_orders(cluster: Cluster) -> None:
    """Buckets follow named_parameters, not the optimizer's param groups (whose order differed: a mismatch)."""
    for r in _run(cluster, tp.optimizer_orders):
        assert r["moved"] == [[1.5], [1.0]] * 3, r


@pytest.mark.timeout(90)
def test_a_bucket_mismatch_names_the_parameters_and_the_rule(cluster: Cluster) -> None:
    for r, width in zip(_run(cluster, tp.mismatched_bucket), (200, 201)):
        assert r["error"].startswith("BPSMismatchError: tensor 'grad.differs.bias' mismatch"), r
        assert f"holds 'differs.bias' torch.float32 ({width},), 'differs.weight'" in r["error"], r
        assert "in the same order: that of named_parameters" in r["error"], r


@pytest.mark.timeout(90)
def test_optimizer_state_goes_by_parameter_name_where_the_orders_differ(cluster: Cluster) -> None:
    results = _run(cluster, tp.optimizer_state_in_other_orders)
    for r in results:
        assert r["kept"] and (r["a"], r["b"]) == (1.0, 100.0) and r["labels_ours"], r
    assert results[0]["error"] == "", results
    assert results[1]["error"].startswith("BPSError: broadcast_optimizer_state: this process's optimizer groups "
                                          "its parameters otherwise than the root's ([1, 1] parameters in its "
                                          "groups, the root [2])"), results


@pytest.mark.timeout(90)
def test_push_pull_group_and_shared_array_on_tensors(cluster: Cluster) -> None:
    for r in _run(cluster, tp.group_and_shared_array):
        assert r["summed"] == [["torch.float32", [3.0] * 3], ["torch.int64", [0, 3, 6, 9]],
                               ["torch.bfloat16", [[0.5, 0.5], [0.5, 0.5]]], ["torch.float32", [[2.0] * 2] * 3]], r
        assert r["shared"] == [3.0] * 4 and r["in_place"], r
        assert r["errors"] == ["BPSError: push_pull_group: 4 tensors but 1 names",
                               "BPSError: tensor 'g.sparse': is a torch.sparse_coo tensor; only dense tensors are "
                               "summed and broadcast (pass it.to_dense())"], r
