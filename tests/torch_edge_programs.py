"""Rank programs for the PyTorch layer's edges (tests/daemons/test_torch_edges.py): gradients set without
backward, two asynchronous models, broadcasts of dtypes the wire does not carry, a parameter unfrozen after
wrapping, numpy hyper-parameters, GradScaler, a model wrapped twice, sparse gradients, optimizers that list the
parameters in other orders, a bucket that differs."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

import bps_worker.torch as bps


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _one_weight_model() -> tuple[nn.Linear, Any]:
    """A 3-to-1 linear model at zero on every rank (exact steps: a random weight minus 1.5 is not always 1.5
    away in float32), and its DistributedOptimizer (SGD, lr 1)."""
    m = nn.Linear(3, 1, bias=False)
    nn.init.zeros_(m.weight)
    opt = bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1.0), named_parameters=m.named_parameters())
    bps.broadcast_parameters(m.state_dict(), 0)
    return m, opt


def assigned_grads() -> dict[str, Any]:
    """``p.grad = g`` (torch.autograd.grad, torch.func, DP-SGD code), no backward: still averaged."""
    r = bps.rank()
    m, opt = _one_weight_model()
    before = m.weight.detach().clone()
    loss = m(torch.full((1, 3), float(r + 1))).sum()
    (m.weight.grad,) = torch.autograd.grad(loss, [m.weight])
    opt.step()
    return {"grad": m.weight.grad.tolist(), "moved": (before - m.weight.detach()).tolist()}


def two_async_models() -> dict[str, Any]:
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    first = bps.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), named_parameters=a.named_parameters(),
                                     asynchronous=True)
    try:
        bps.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.1), named_parameters=b.named_parameters(),
                                 asynchronous=True)
    except bps.BPSError as exc:
        refused = str(exc)
    else:
        refused = ""
    named = bps.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.1), asynchronous=True,
                                     named_parameters=[("critic." + n, p) for n, p in b.named_parameters()])
    return {"refused": refused, "named": named is not None and first is not None}


def odd_dtypes() -> dict[str, Any]:
    """Broadcasts of dtypes the wire does not carry: every rank gets the root's bits."""
    r = bps.rank()
    tensors = {
        "c64": torch.full((3,), complex(1.5 + r, 2.5 - r), dtype=torch.complex64),
        "c128": torch.full((2, 2), complex(-0.25 * (r + 1), 3.75), dtype=torch.complex128),
        "u32": torch.tensor([4_000_000_000 - r, 7], dtype=torch.uint32),
        "u8": torch.tensor([255 - r, r], dtype=torch.uint8),
        "flag": torch.tensor(r == 0),
        "f8": torch.tensor([0.4375 + r, -3.0], dtype=torch.float32).to(torch.float8_e4m3fn),
    }
    def bits(of: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {name: [str(t.dtype), list(t.shape),
                       t.reshape(-1).view(torch.uint8).tolist() if t.dtype != torch.bool else t.tolist()]
                for name, t in of.items()}

    before = bits(tensors)
    # bps.broadcast too (it refused all of them: "unsupported tensor dtype torch.bool", a review), then in place
    plain = bits({name: bps.broadcast(t, 0, f"plain.{name}") for name, t in tensors.items()})
    bps.broadcast_parameters(tensors, 0)
    return {"before": before, "plain": plain, "after": bits(tensors)}


def numpy_odd_broadcasts() -> dict[str, Any]:
    """The numpy client's broadcast of dtypes the wire does not carry (and of sizes that are not whole words)."""
    import bps_worker.client as client

    r = client.rank()
    arrays = {
        "bool": np.array([r == 0, True, r == 1]),
        "u8": np.array([[255 - r, r, 7]], np.uint8),  # 3 bytes
        "i16": np.arange(5, dtype=np.int16) * (r + 1) - 3,
        "big": np.array([1.5 + r, -2.0], dtype=">f4"),
        "rec": np.array([(r - 1, 2.5 * r)], dtype=[("a", "<i2"), ("b", "<f8")]),
        "empty": np.zeros((0, 3), np.bool_),
        "scalar": np.array(np.complex64(1 + r * 1j)),
        "columns": np.arange(12, dtype=np.int8).reshape(3, 4)[:, ::2] * (r + 1),  # not contiguous
    }

    def described(of: dict[str, np.ndarray]) -> dict[str, Any]:
        return {name: [a.dtype.str, list(a.shape), np.ascontiguousarray(a).tobytes().hex()] for name, a in of.items()}

    got = {name: client.broadcast(a, 0, f"np.{name}") for name, a in arrays.items()}
    try:  # the same name as bool on one rank and uint8 on the other: a mismatch naming both
        client.broadcast(np.zeros(4, np.bool_ if r == 0 else np.uint8), 0, "np.differ")
        mismatch: Any = None
    except client.BPSMismatchError as exc:
        mismatch = [exc.name, exc.ours, exc.theirs]
    after = client.broadcast(np.array([r == 0]), 0, "np.after")  # (nothing left in flight)
    return {"before": described(arrays), "after": described(got), "mismatch": mismatch, "later": after.tolist()}


def not_dense_inputs() -> dict[str, Any]:
    """A sparse tensor to push_pull or broadcast, an expand()-ed out=: BPSErrors before anything is sent (they
    were torch's RuntimeErrors, the expanded out's after every rank had summed: a review)."""
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,), check_invariants=True)
    errors = []
    for call in (lambda: bps.push_pull(sparse, "sp", average=False),
                 lambda: bps.broadcast(sparse, 0, "sp.b"),
                 lambda: bps.push_pull(torch.ones(3), "sp.out", out=sparse),
                 lambda: bps.push_pull(torch.ones(4, 3), "expanded", out=torch.zeros(1, 3).expand(4, 3)),
                 lambda: bps.push_pull_async(torch.ones(2, 2), "strided",
                                             out=torch.zeros(3).as_strided((2, 2), (1, 1))),
                 lambda: bps.push_pull(torch.ones(3), "notatensor", out=[0.0, 0.0, 0.0])):  # type: ignore[arg-type]
        try:
            call()
            errors.append("")
        except Exception as exc:
            errors.append(_error(exc))
    fine = torch.zeros(4, 3).t()  # (transposed: written through its strides, as before)
    bps.push_pull(torch.ones(3, 4), "expanded", average=False, out=fine)
    return {"errors": errors, "summed": fine.tolist()}


def unfrozen_after_wrapping() -> dict[str, Any]:
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    m[0].weight.requires_grad_(False)
    opt = bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
    m[0].weight.requires_grad_(True)
    m(torch.ones(2, 3)).sum().backward()
    try:
        opt.step()
    except bps.BPSError as exc:
        first = str(exc)
    else:
        first = ""
    opt.zero_grad()
    again = bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
    m(torch.full((2, 3), float(bps.rank() + 1))).sum().backward()
    again.step()
    return {"first": first, "w0": m[0].weight.detach().sum().item()}


def group_added_to_the_wrapped_optimizer(asynchronous: bool, how: str = "added") -> dict[str, Any]:
    """A param group added to the wrapped optimizer itself after wrapping (not through the wrapper, which refuses
    it), or (``how="replaced"``) a new parameter put in another's place in a group (a re-initialised head): its
    parameters were stepped with each process's own gradient, no error (two reviews' cases). Then the same
    optimizer wrapped again: averaged."""
    m = nn.Linear(3, 1)
    old = nn.Parameter(torch.zeros(3))
    inner = torch.optim.SGD([{"params": m.parameters()}] + ([{"params": [old]}] if how == "replaced" else []),
                            lr=1.0)
    named = [*m.named_parameters()] + ([("old", old)] if how == "replaced" else [])
    opt = bps.DistributedOptimizer(inner, named_parameters=named, asynchronous=asynchronous)
    if asynchronous:
        bps.broadcast_parameters(m.state_dict(), 0)
    head = nn.Parameter(torch.zeros(3))
    if how == "replaced":
        inner.param_groups[1]["params"] = [head]  # as many parameters as before: only which ones changed
    else:
        inner.add_param_group({"params": [head]})
    opt.zero_grad()
    (m(torch.ones(1, 3)).sum() + (head * (bps.rank() + 1)).sum()).backward()
    try:
        opt.step()
        first = ""
    except bps.BPSError as exc:
        first = str(exc)
    if asynchronous:
        return {"first": first, "head": head.detach().tolist()}
    opt.zero_grad()
    named = [*m.named_parameters(), ("head", head)]
    again = bps.DistributedOptimizer(inner, named_parameters=named)
    (m(torch.ones(1, 3)).sum() + (head * (bps.rank() + 1)).sum()).backward()
    again.step()
    return {"first": first, "head": head.detach().tolist()}


def async_broadcast_again() -> dict[str, Any]:
    """Asynchronous mode: a second broadcast_parameters of the model (the root restored a checkpoint mid-job)
    wrote the root's tensors, then the init again wrote the servers' values over them, silently (a review's
    case). Refused now before anything is written; a buffer-only broadcast (no asynchronous parameter) goes on."""
    m = nn.Linear(3, 1, bias=False)
    nn.init.zeros_(m.weight)
    opt = bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1.0), named_parameters=m.named_parameters(),
                                   asynchronous=True, staleness=0)
    bps.broadcast_parameters(m.state_dict(), 0)
    for _ in range(2):
        opt.zero_grad()
        m.weight.grad = torch.ones(1, 3)
        opt.step()
    before = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.fill_(7.0 if bps.rank() == 0 else -3.0)
    try:
        bps.broadcast_parameters(m.state_dict(), 0)
        refused = ""
    except bps.BPSError as exc:
        refused = str(exc)
    kept = m.weight.detach().tolist()
    with torch.no_grad():
        m.weight.copy_(before)
    other = {"steps": torch.tensor([float(bps.rank())])}
    bps.broadcast_parameters(other, 0)
    return {"refused": refused, "kept": kept, "other": other["steps"].tolist()}


def optimizer_state_not_broadcast() -> dict[str, Any]:
    """Optimizer state holding an object the weights-only load refuses (a deque, as some optimizers keep a history
    in): torch's UnpicklingError about a checkpoint on every process, not a BPSError (a review's case); then the
    same state as a list goes."""
    import collections

    m = nn.Linear(3, 1)
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    for p in m.parameters():
        inner.state[p]["history"] = collections.deque([1.0, float(bps.rank())], maxlen=4)
    opt = bps.DistributedOptimizer(inner, named_parameters=m.named_parameters())
    try:
        bps.broadcast_optimizer_state(opt, 0)
        refused = ""
    except bps.BPSError as exc:
        refused = str(exc)
    for p in m.parameters():
        inner.state[p]["history"] = list(inner.state[p]["history"])
    bps.broadcast_optimizer_state(opt, 0)
    return {"refused": refused, "history": inner.state[m.weight]["history"]}


def numpy_hyperparameters() -> dict[str, Any]:
    m = nn.Linear(4, 3)
    base = torch.optim.SGD(m.parameters(), lr=0.1)
    for group in base.param_groups:
        group["lr"] = np.float64(0.1 + bps.rank())  # as a numpy schedule gives
    bps.broadcast_optimizer_state(base, 0)
    lr = base.param_groups[0]["lr"]
    return {"lr": float(lr), "type": type(lr).__name__}


def scaler_recipe_step(model: nn.Module, opt: Any, scaler: torch.amp.GradScaler) -> None:
    """The README's GradScaler recipe after backward: synchronize, unscale, clip, then step without synchronizing
    again."""
    opt.synchronize()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()


def grad_scaler() -> dict[str, Any]:
    """The README's recipe (scaler_recipe_step) on every rank."""
    r = bps.rank()
    m, opt = _one_weight_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = m.weight.detach().clone()
    scaler.scale(m(torch.full((1, 3), float(r + 1))).sum()).backward()
    scaler_recipe_step(m, opt, scaler)
    return {"moved": (before - m.weight.detach()).tolist()}


def scaler_without_the_recipe_behind_wrappers() -> dict[str, Any]:
    """``scaler.step(opt)`` without synchronize() first, with an LR scheduler's wrapper of ``opt.step`` and a
    decorator of the user's around that: a BPSError (the unscale would be lost), as without the wrappers. The
    scaler was looked for four frames up only: it stepped with the scaled gradients, 1024 times too large."""
    import functools

    m, opt = _one_weight_model()
    torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    inner = opt.step

    @functools.wraps(inner)
    def logged(*args: Any, **kwargs: Any) -> Any:  # (a timing or logging decorator)
        return inner(*args, **kwargs)

    opt.step = logged  # type: ignore[method-assign]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(m(torch.full((1, 3), float(bps.rank() + 1))).sum()).backward()
    try:
        scaler.step(opt)
        error = ""
    except bps.BPSError as exc:
        error = str(exc)
    return {"error": error, "weight": m.weight.detach().tolist()}


def guard_on_one_rank() -> dict[str, Any]:
    """A bad-batch guard written the DDP way (look at the gradients after backward(), zero them) that fires on
    rank 0 only, in a loop that catches BPSError and goes on: rank 0's step() raised without stepping while its
    peers stepped, and it stayed a step apart for good (a review's case). Two steps, each rank's gradient its
    rank + 1."""
    m, opt = _one_weight_model()
    errors = []
    for step in range(2):
        opt.zero_grad()
        m(torch.full((1, 3), float(bps.rank() + 1))).sum().backward()
        if step == 0 and bps.rank() == 0:
            m.weight.grad.zero_()
        try:
            opt.step()
            errors.append("")
        except bps.BPSError as exc:
            errors.append(str(exc))
    return {"errors": errors, "weight": m.weight.detach().tolist()}


def closure_steps() -> dict[str, Any]:
    """``opt.step(closure)``, the closure zeroing, evaluating and back-propagating (as SGD(closure) and LBFGS
    users write it), two steps at lr 1 from zero, each rank's input its rank + 1: every step applies the average
    gradient, 1.5. The closure ran inside the wrapped step, after the averages were taken: each rank stepped
    on its own gradient, silently."""
    m, opt = _one_weight_model()
    x = torch.full((1, 3), float(bps.rank() + 1))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = m(x).sum()
        loss.backward()
        return loss

    losses = [float(opt.step(closure)) for _ in range(2)]
    return {"weight": m.weight.detach().tolist(), "losses": losses}


def closure_that_raises() -> dict[str, Any]:
    """``opt.step(closure)`` whose closure raises: on rank 0 before its backward, on every rank after it, a step each;
    then a normal step. A rank whose closure raised still takes part in the sums its peers wait for (zeros where it
    has no gradient: rank 1's first step moves by half its gradient), and nothing is left in flight: the closure
    raised after backward left its sums in flight, and every later step failed in zero_grad() (a review)."""
    m, opt = _one_weight_model()
    x = torch.full((1, 3), float(bps.rank() + 1))
    raised: list[str] = []

    def closure(fail_before: bool, fail_after: bool) -> torch.Tensor:
        if fail_before:
            raise ValueError("before backward")
        opt.zero_grad()
        loss = m(x).sum()
        loss.backward()
        if fail_after:
            raise ValueError("after backward")
        return loss

    for before, after in ((bps.rank() == 0, False), (False, True), (False, False)):
        try:
            opt.step(lambda: closure(before, after))
        except ValueError as exc:
            raised.append(str(exc))
        opt.zero_grad()
    return {"raised": raised, "weight": m.weight.detach().tolist()}


def wrapped_twice() -> dict[str, Any]:
    """A second training phase wraps a new optimizer round the same model."""
    r = bps.rank()
    m = nn.Linear(3, 2)
    bps.broadcast_parameters(m.state_dict(), 0)
    x = torch.full((2, 3), float(r + 1))
    first = bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
    first.zero_grad()
    m(x).sum().backward()
    first.step()
    second = bps.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01),
                                      named_parameters=m.named_parameters())
    for _ in range(2):
        second.zero_grad()
        m(x).sum().backward()
        second.step()
    return {"weight": m.weight.detach().tolist()}


def sparse_gradient() -> dict[str, Any]:
    """A sparse embedding behind a dense layer, one bucket a gradient: the dense layer's buckets start during
    backward before the embedding's sparse gradient is refused, three steps in the loop that catches the error
    and goes on (they stayed in flight, and every later step failed at zero_grad(), a review's case); then a
    dense model's step goes through (no round of the failed steps is left behind)."""
    e = nn.Embedding(10, 3, sparse=True)
    lin = nn.Linear(3, 1)
    named = [("emb." + n, p) for n, p in e.named_parameters()] + [("lin." + n, p) for n, p in lin.named_parameters()]
    opt = bps.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1), named_parameters=named,
                                   bucket_bytes=0)
    errors = []
    for _ in range(3):
        try:
            opt.zero_grad()
            lin(e(torch.tensor([bps.rank(), 1]))).sum().backward()
            opt.step()
            errors.append("")
        except Exception as exc:
            errors.append(_error(exc))
    dense = nn.Linear(3, 1)
    nn.init.zeros_(dense.weight)
    opt2 = bps.DistributedOptimizer(torch.optim.SGD(dense.parameters(), lr=0.1),
                                    named_parameters=[("dense." + n, p) for n, p in dense.named_parameters()])
    dense(torch.full((1, 3), float(bps.rank()))).sum().backward()
    opt2.step()
    return {"errors": errors, "grad": dense.weight.grad.tolist()}


def optimizer_orders() -> dict[str, Any]:
    """Rank 0's optimizer lists the parameters in the model's order, rank 1's in two groups in other orders; both
    name them by the model's named_parameters (Horovod's names let ranks do this). Three independent layers at
    zero, each fed the rank's r + 1: every weight's average gradient is exactly 1.5, every bias's 1."""
    r = bps.rank()
    layers = nn.ModuleList([nn.Linear(k, 1) for k in (3, 4, 5)])
    for p in layers.parameters():
        nn.init.zeros_(p)
    params = list(layers.parameters())
    groups = [{"params": params}] if r == 0 else [{"params": params[::-2]}, {"params": params[-2::-2]}]
    opt = bps.DistributedOptimizer(torch.optim.SGD(groups, lr=1.0),
                                   named_parameters=[(f"order.{n}", p) for n, p in layers.named_parameters()])
    sum(layer(torch.full((1, layer.in_features), float(r + 1))).sum() for layer in layers).backward()
    opt.step()
    return {"moved": [(-p.detach()).unique().tolist() for p in params]}


def mismatched_bucket() -> dict[str, Any]:
    """Rank 1's model has another shape (one bucket of 80 KB or so: not fused with others)."""
    m = nn.Linear(100, 200 + bps.rank())
    opt = bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=[(f"differs.{n}", p) for n, p in m.named_parameters()])
    m(torch.ones(1, 100)).sum().backward()
    try:
        opt.step()
    except bps.BPSError as exc:
        return {"error": _error(exc)}
    return {"error": ""}


def optimizer_state_in_other_orders() -> dict[str, Any]:
    """Rank 1 lists the optimizer's parameters in another order (named by named_parameters); after a step with
    momentum the buffers are the same on every rank, and a broadcast of the optimizer state keeps each
    parameter's own (it gave rank 1 the other parameter's). Then a rank whose groups differ: a BPSError there."""
    r = bps.rank()
    torch.manual_seed(0)
    m = nn.ModuleDict({"a": nn.Linear(3, 3, bias=False), "b": nn.Linear(3, 3, bias=False)})
    params = [m["a"].weight, m["b"].weight] if r == 0 else [m["b"].weight, m["a"].weight]
    opt = bps.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9),
                                   named_parameters=[(f"ostate.{n}", p) for n, p in m.named_parameters()])
    bps.broadcast_parameters(m.state_dict(), 0)
    x = torch.ones(1, 3)
    (m["a"](x).sum() + m["b"](x).sum() * 100.0).backward()
    opt.step()
    before = {n: opt.state[p]["momentum_buffer"].tolist() for n, p in m.named_parameters()}
    bps.broadcast_optimizer_state(opt, 0)
    after = {n: opt.state[p]["momentum_buffer"].tolist() for n, p in m.named_parameters()}
    groups = [{"params": params}] if r == 0 else [{"params": params[:1]}, {"params": params[1:]}]
    other = bps.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1, momentum=0.9),
                                     named_parameters=[(f"ogroups.{n}", p) for n, p in m.named_parameters()])
    try:
        bps.broadcast_optimizer_state(other, 0)
        error = ""
    except bps.BPSError as exc:
        error = _error(exc)
    # An optimizer made from named parameters labels its state with their names: ours, in our order.
    named = [(n, p) for p in params for n, q in m.named_parameters() if q is p]
    labelled = bps.DistributedOptimizer(torch.optim.SGD(named, lr=0.1, momentum=0.9),
                                        named_parameters=[(f"olabels.{n}", p) for n, p in m.named_parameters()])
    bps.broadcast_optimizer_state(labelled, 0)
    labels = labelled.state_dict()["param_groups"][0]["param_names"]
    return {"kept": before == after, "a": after["a.weight"][0][0], "b": after["b.weight"][0][0], "error": error,
            "labels_ours": labels == [n for n, _ in named]}


def group_and_shared_array() -> dict[str, Any]:
    """push_pull_group and shared_array on tensors, as the client has them ("the same functions on torch.Tensor":
    the layer had neither, a review); shared_array's shape as one integer, as numpy takes it."""
    r = bps.rank()
    tensors = [torch.full((3,), float(r + 1)), torch.arange(4, dtype=torch.int64) * (r + 1),
               torch.full((2, 2), 0.5 * r, dtype=torch.bfloat16), torch.ones(2, 3).t()]
    summed = bps.push_pull_group(tensors, ["g.a", "g.b", "g.c", "g.d"], average=False)
    shared = bps.shared_array("g.shared", 4)
    shared.fill_(r + 1)
    same = bps.push_pull(shared, "g.shared", average=False, out=shared)
    errors = []
    for call in (lambda: bps.push_pull_group(tensors, ["g.a"]),
                 lambda: bps.push_pull_group([torch.ones(2).to_sparse()], ["g.sparse"])):
        try:
            call()
            errors.append("")
        except Exception as exc:
            errors.append(_error(exc))
    return {"summed": [[str(t.dtype), t.tolist()] for t in summed], "shared": shared.tolist(),
            "in_place": same is shared, "errors": errors}
