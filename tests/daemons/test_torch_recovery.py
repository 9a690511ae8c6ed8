"""The PyTorch layer after a call that fails, or a use it cannot honour, with a real one-process cluster and the
client in this process: the process must stay usable (nothing left in flight), and what cannot be done is a
BPSError that says what to do, never a silent wrong result. Each test failed before its fix (a review of the
layer, session 31)."""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

import bps_worker.torch as bps
from bps_worker.supervise import Cluster
from harness import start_cluster, write_config
from torch_edge_programs import scaler_recipe_step

MB = 1 << 20
ARENA = 8 * MB  # cluster.arena_bytes: what one process's slots may hold
BIG = 3 * MB // 4  # float32 elements of a 3 MiB tensor: two fit under the cap, three do not


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    made = start_cluster(write_config(tmp_path_factory.mktemp("torch_recovery"), [1], cpu_servers=0,
                                      cluster={"arena_bytes": ARENA}))
    try:
        yield made
    finally:
        made.stop()


@pytest.fixture
def client(cluster: Cluster) -> Iterator[None]:
    """This process connected to the cluster, as its one training process; every optimizer of the test gone
    after it (an asynchronous one left alive would be initialised by a later test's broadcast_parameters)."""
    bps.init(socket=cluster.socket_path(0), local_rank=0, timeout=5.0)
    try:
        yield
    finally:
        bps.shutdown()
        gc.collect()


def _still_usable(tag: str) -> None:
    """A sum and a broadcast work (they needed the room that operations left in flight held)."""
    assert bps.push_pull(torch.ones(3), f"{tag}.sum", average=False).tolist() == [1.0] * 3
    assert bps.broadcast(torch.ones(2), 0, f"{tag}.bcast").tolist() == [1.0] * 2


@pytest.mark.timeout(60)
def test_a_broadcast_that_fails_part_way_leaves_nothing_in_flight(client: None) -> None:
    big = {f"w{i}": torch.full((BIG,), float(i)) for i in range(4)}
    with pytest.raises(bps.BPSError, match="arena_bytes"):
        bps.broadcast_parameters(big, 0)  # the third start is over the cap; the first two had started
    _still_usable("bcast")
    for name in ("w0", "w1"):  # the names of broadcasts that had started, alone: they fit
        bps.broadcast_parameters({name: big[name]}, 0)
        assert big[name].eq(float(name[1])).all()


def _async_model(tag: str, elements: int) -> tuple[nn.ParameterList, bps.DistributedOptimizer]:
    """Four parameters at zero, each its own bucket, in an asynchronous optimizer (SGD, lr 1)."""
    model = nn.ParameterList([nn.Parameter(torch.zeros(elements)) for _ in range(4)])
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), asynchronous=True, bucket_bytes=0,
                                   named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()])
    return model, opt


def _async_step(model: nn.ParameterList, opt: bps.DistributedOptimizer) -> None:
    for p in model:
        p.grad = torch.ones_like(p)
    opt.step()


@pytest.mark.timeout(60)
def test_an_asynchronous_init_that_fails_part_way_leaves_nothing_in_flight(client: None) -> None:
    model, opt = _async_model("ainit", BIG)
    with pytest.raises(bps.BPSError, match="arena_bytes"):
        _async_step(model, opt)  # its init: the third bucket's start is over the cap
    _still_usable("ainit")
    with pytest.raises(bps.BPSError, match="arena_bytes"):
        _async_step(model, opt)  # the same cause again, not a name left in flight
    _still_usable("ainit2")


@pytest.mark.timeout(60)
def test_an_asynchronous_push_that_fails_part_way_loses_no_step(client: None) -> None:
    """The buckets pushed before the failed start take their values; the others keep their parameters, so their
    step goes with the next push: every step counts once."""
    model, opt = _async_model("apush", 3 * MB // 8)  # 1.5 MiB each: the init fits under the cap
    _async_step(model, opt)
    hog = bps.shared_tensor("apush.hog", (MB,))  # 4 MiB handed out: never given up for room while held
    with pytest.raises(bps.BPSError, match="arena_bytes"):
        _async_step(model, opt)
    bps.push_pull(hog, "apush.hog", out=hog)  # pushed, the hog's slot is idle again: room for every bucket
    del hog
    _still_usable("apush")
    _async_step(model, opt)
    assert [p.detach().unique().tolist() for p in model] == [[-3.0]] * 4


def _linear(tag: str, passes: int = 1, fused: bool = False) -> tuple[nn.Linear, bps.DistributedOptimizer]:
    """A 3-to-1 linear model at zero and its DistributedOptimizer (SGD, lr 1, ``fused``: torch's fused kernel): a
    step moves the weight by exactly its gradient."""
    model = nn.Linear(3, 1, bias=False)
    nn.init.zeros_(model.weight)
    return model, bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0, fused=fused),
                                           named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()],
                                           backward_passes_per_step=passes)


def _backward(model: nn.Module, value: float = 2.0, scaler: torch.amp.GradScaler | None = None) -> None:
    """The weight's gradient: ``value`` (times the scaler's scale)."""
    loss = model(torch.full((1, 3), value)).sum()
    (loss if scaler is None else scaler.scale(loss)).backward()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", ["clip", "grad_scaler", "grad_scaler_fused", "grad_scaler_clipped",
                                    "unscaled_clipped_plain_step", "replace"])
def test_a_gradient_changed_between_backward_and_step_is_an_error(client: None, change: str) -> None:
    """Gradients go to the other processes as backward produces them, so a change made after backward (torch's
    plain GradScaler usage, clipping before step()) was silently lost; now step() says to synchronize() first.
    GradScaler's unscale does not move the gradient's ``_version``: its step() calling ours is what tells. (A
    fused optimizer's scaler skipped the unscale: it stepped with the scaled gradients, without an error.)
    A change of our own (clipped, replaced) is stepped over with the averages, as every other process steps
    (they may not have changed theirs); the scaler's unscaled sums are stepped nowhere."""
    model, opt = _linear(f"changed.{change}", fused=change.endswith("fused"))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _backward(model, scaler=scaler if change.startswith(("grad_scaler", "unscaled")) else None)
    with pytest.raises(bps.BPSError, match=r"'changed\.\w+\.weight' changed after backward.*synchronize\(\)"):
        if change == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        elif change == "grad_scaler_clipped":  # torch's own AMP recipe with clipping, without our synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # (in place: the scaled sums stepped, 1024x)
            scaler.step(opt)
        elif change == "unscaled_clipped_plain_step":  # the same, then our step() called directly
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            opt.step()
        elif change.startswith("grad_scaler"):
            scaler.step(opt)  # unscales in place, then steps
        else:
            model.weight.grad = model.weight.grad / 2
            opt.step()
    stepped = 0.0 if change.startswith(("grad_scaler", "unscaled")) else -2.0  # the average of backward's: 2
    assert model.weight.detach().eq(stepped).all(), model.weight
    opt.zero_grad()  # nothing stays in flight: the next step is a plain one
    _backward(model)
    opt.step()
    assert model.weight.detach().eq(stepped - 2.0).all(), model.weight


@pytest.mark.timeout(60)
def test_gradients_changed_the_documented_ways_are_not_an_error(client: None) -> None:
    """The README's recipe (synchronize, unscale, clip, step inside skip_synchronize), with a fused optimizer too
    (whose scaler stepped with the scaled gradients, and with inf ones), accumulation over passes into gradients
    zeroed in place, and gradients assigned without backward."""
    for fused in (False, True):
        model, opt = _linear(f"recipe.{fused}", fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        _backward(model, scaler=scaler)
        scaler_recipe_step(model, opt, scaler)
        assert model.weight.detach().eq(-2.0).all(), (fused, model.weight)
        opt.zero_grad()
        _backward(model, value=math.inf, scaler=scaler)  # an inf gradient: the step is skipped
        scaler_recipe_step(model, opt, scaler)
        assert model.weight.detach().eq(-2.0).all(), (fused, model.weight)

    model, opt = _linear("passes", passes=2)
    for _ in range(2):
        opt.zero_grad(set_to_none=False)
        _backward(model, 1.0)
        _backward(model, 2.0)
        opt.step()
    assert model.weight.detach().eq(-6.0).all()

    model, opt = _linear("assigned")
    model.weight.grad = torch.full((1, 3), 4.0)
    opt.step()
    assert model.weight.detach().eq(-4.0).all()


@pytest.mark.timeout(60)
def test_a_model_wrapped_again_asynchronously_loses_its_synchronous_hooks(client: None) -> None:
    model, first = _linear("sync_async")
    _backward(model)
    first.step()
    second = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), asynchronous=True,
                                      named_parameters=[("sync_async2.weight", model.weight)])
    bps.broadcast_parameters(model.state_dict(), 0)
    for _ in range(3):  # the first optimizer's hook pushed every gradient, and failed on the second backward
        second.zero_grad()
        _backward(model)
        second.step()
    assert model.weight.detach().eq(-8.0).all()
    third = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                     named_parameters=[("sync_async3.weight", model.weight)])
    third.zero_grad()
    _backward(model)
    third.step()
    assert model.weight.detach().eq(-10.0).all()
    with pytest.raises(bps.BPSError, match="replaced by a DistributedOptimizer made later"):
        second.step()


@pytest.mark.timeout(60)
def test_an_asynchronous_optimizer_wrapped_again_is_taken_over(client: None) -> None:
    """A second training phase: a new optimizer round the same model and names takes over the values (no second
    init); the old one refuses any use. The same parameters in other buckets are refused, naming the cause."""
    model = nn.Linear(3, 1)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    named = [(f"rewrap.{n}", p) for n, p in model.named_parameters()]
    first = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=named,
                                     asynchronous=True)
    bps.broadcast_parameters(model.state_dict(), 0)
    _backward(model)
    first.step()
    second = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), named_parameters=named,
                                      asynchronous=True)
    assert second._async is not None and second._async.initialised
    second.zero_grad()
    _backward(model)
    second.step()
    assert model.weight.detach().eq(-3.0).all() and model.bias.detach().eq(-1.5).all()
    with pytest.raises(bps.BPSError, match="replaced by a DistributedOptimizer made later"):
        first.step()
    with pytest.raises(bps.BPSError, match="with other contents or staleness"):
        bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=named,
                                 asynchronous=True, bucket_bytes=0)
    second.step()  # still the one in charge


@pytest.mark.timeout(60)
def test_two_optimizers_without_names_are_told_to_pass_named_parameters(client: None) -> None:
    """Named by position, two optimizers' gradients have the same names: the second's bucket met the first's
    in flight with only 'already in flight' to say."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    first = bps.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1))
    second = bps.DistributedOptimizer(torch.optim.SGD(model[2].parameters(), lr=0.1))
    with pytest.raises(bps.BPSError, match=r"bucket 'grad\.1' is in use by another .*pass named_parameters"):
        model(torch.ones(1, 4)).sum().backward()
    second.step()  # each step still works, one after the other
    first.step()


@pytest.mark.timeout(60)
def test_two_optimizers_without_names_over_one_models_parts_are_told_before_either_slot_is_written(
        client: None) -> None:
    """The matrices in one, the biases in the other (a common split): both first buckets are 'grad.1', and the
    second's gradients were written into the first's slot (the name's) before it met the first in flight with
    'already in flight' (a review's case). Told as soon as the second fills the name while the first does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    first = bps.DistributedOptimizer(torch.optim.SGD([p for p in model.parameters() if p.dim() == 2], lr=0.1))
    second = bps.DistributedOptimizer(torch.optim.SGD([p for p in model.parameters() if p.dim() < 2], lr=0.1))
    with pytest.raises(bps.BPSError, match=r"bucket 'grad\.1' is in use by another .*pass named_parameters"):
        model(torch.ones(5, 4)).pow(2).mean().backward()
    # told to the second to fill the name, before it wrote into the slot: one of them wrote there
    assert [any(b.filled for b in o._buckets) for o in (first, second)].count(True) == 1


@pytest.mark.timeout(60)
def test_an_asynchronous_optimizer_holds_bfloat16_parameters(client: None) -> None:
    """bfloat16 is a supported dtype, and plain async_push_pull takes it; the asynchronous optimizer refused it.
    Whole numbers below 256 are exact in bfloat16: each step moves every element by exactly 1."""
    model = nn.ParameterList([nn.Parameter(torch.arange(6, dtype=torch.bfloat16)), nn.Parameter(torch.ones(3))])
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), asynchronous=True,
                                   named_parameters=[(f"bf16.{n}", p) for n, p in model.named_parameters()])
    for _ in range(3):
        _async_step(model, opt)
    assert model[0].dtype == torch.bfloat16 and model[0].tolist() == [x - 3.0 for x in range(6)]
    assert model[1].tolist() == [-2.0] * 3


@pytest.mark.timeout(60)
def test_a_grad_scaler_step_over_gradients_read_after_its_unscale_is_no_error(client: None) -> None:
    """The GradScaler check counts only gradients a hook copied (before the unscale): gradients assigned without
    backward, or a step after synchronize() outside skip_synchronize(), are read after it and were refused."""
    model, opt = _linear("scaled.assigned")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    (model.weight.grad,) = torch.autograd.grad(scaler.scale(model(torch.full((1, 3), 2.0)).sum()), [model.weight])
    scaler.step(opt)
    assert model.weight.detach().eq(-2.0).all()
    model, opt = _linear("scaled.synchronized")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _backward(model, scaler=scaler)
    opt.synchronize()
    scaler.step(opt)
    assert model.weight.detach().eq(-2.0).all()


@pytest.mark.timeout(60)
def test_two_asynchronous_optimizers_over_a_shared_trunk_under_other_names_both_step(client: None) -> None:
    """Only a wrap again round the very same parameters replaces an earlier asynchronous optimizer: two that
    share a trunk (actor and critic, named apart as the clash error advises) used to retire the first."""
    trunk, heads = nn.Linear(3, 3), [nn.Linear(3, 1), nn.Linear(3, 1)]
    opts = []
    for role, head in zip(("actor", "critic"), heads):
        named = list(trunk.named_parameters()) + [(f"head.{n}", p) for n, p in head.named_parameters()]
        opts.append(bps.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.125), asynchronous=True,
                                             named_parameters=[(f"{role}.{n}", p) for n, p in named]))
    for opt, head in zip(opts, heads):
        opt.zero_grad()
        head(trunk(torch.ones(1, 3))).sum().backward()
        opt.step()  # (the actor's was refused: "replaced by a DistributedOptimizer made later")
