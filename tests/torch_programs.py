"""Rank programs of the PyTorch-layer tests (top-level, so spawn can import them).

Every program runs in one process per rank after ``bps.init`` (see harness.run_ranks) and
returns plain Python values. Data are deterministic functions of fixed seeds, so each rank
can also train the single-process reference that the distributed run must reproduce.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import bps_worker.torch as bps

STEPS = 20
BATCH = 8
N_CLASSES = 3


def _threads() -> None:
    torch.set_num_threads(1)


# -- models and data ----------------------------------------------------------------
class SmallCNN(nn.Module):
    """1x8x8 images, 3 classes; ``bn`` adds a BatchNorm (running stats + num_batches_tracked buffers)."""

    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4) if bn else nn.Identity()
        self.conv2 = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def dataset(n: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, N_CLASSES, (n,), generator=g)


# -- digests ------------------------------------------------------------------------
def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous().reshape(-1)
    return str(t.dtype).encode() + str(tuple(t.shape)).encode() + t.view(torch.uint8).numpy().tobytes()


def _canon(obj: Any, h: Any) -> None:
    if isinstance(obj, torch.Tensor):
        h.update(b"T" + _tensor_bytes(obj))
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode() + b":")
            _canon(obj[k], h)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _canon(v, h)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def digest(obj: Any) -> str:
    """sha256 of tensors' bytes (and of everything else's repr), recursively; dicts in key order."""
    h = hashlib.sha256()
    _canon(obj, h)
    return h.hexdigest()


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.state_dict().values(), b.state_dict().values())
               if p.is_floating_point())


# -- 1-3: training equals single-process training on the whole batch ------------------
WIRE_DTYPES = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def train_cnn(compression: str = "none", passes: int = 1, steps: int = STEPS, batch: int = BATCH,
              lr: float = 0.05, momentum: float = 0.9, bucket_bytes: int | None = None,
              device: str = "cpu") -> dict[str, Any]:
    """Data-parallel SGD(momentum) vs one process training on the concatenated batch.

    Step ``s`` uses the global batch ``X[s*G:(s+1)*G]`` with ``G = size * passes * batch``;
    backward pass ``k`` of rank ``r`` takes the ``batch`` samples at ``s*G + (k*size + r)*batch``
    with its mean loss divided by ``passes``, so the averaged, accumulated gradient is the gradient
    of the mean loss over the ``G`` samples: exactly what the reference computes in one pass.
    On ``device`` "cuda" the model, its gradients and the reference are on the GPU: the gradients reach
    the worker daemon by CUDA IPC.
    """
    rank, size = bps.rank(), bps.size()
    if device == "cuda":  # float32 convolutions and products in float32, as on the CPU (not TF32's 10 bits)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(1000 + rank)  # every rank starts from different weights...
    model = SmallCNN().to(device)
    before = digest(model.state_dict())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)  # ...until rank 0's are broadcast
    after = digest(model.state_dict())
    initial = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    buckets = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                   named_parameters=[(f"{compression}.{passes}.{bucket_bytes}.{n}", p)
                                                     for n, p in model.named_parameters()],
                                   compression=getattr(bps.Compression, compression),
                                   backward_passes_per_step=passes, **buckets)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr, momentum=momentum)
    g = size * passes * batch
    X, Y = (t.to(device) for t in dataset(steps * g))
    # Is every averaged gradient element representable in the wire dtype (float16 for "none",
    # where it must not be: that shows the check would notice uncompressed gradients)?
    wire = WIRE_DTYPES[compression] if compression != "none" else torch.float16
    grads_on_wire_grid = True
    max_grad = 0.0  # largest |gradient element| the reference saw
    for s in range(steps):
        opt.zero_grad()
        for k in range(passes):
            lo = s * g + (k * size + rank) * batch
            (F.cross_entropy(model(X[lo:lo + batch]), Y[lo:lo + batch]) / passes).backward()
        opt.step()
        for p in model.parameters():
            grads_on_wire_grid &= bool(torch.equal(p.grad, p.grad.to(wire).float()))
        ref_opt.zero_grad()
        F.cross_entropy(reference(X[s * g:(s + 1) * g]), Y[s * g:(s + 1) * g]).backward()
        max_grad = max(max_grad, max(float(p.grad.abs().max()) for p in reference.parameters()))
        ref_opt.step()
    return {
        "rank": rank,
        "before": before,
        "after": after,
        "final": digest(model.state_dict()),
        "max_diff": max_diff(model, reference),
        "moved": max_diff(reference, initial),  # how far training took the weights
        "grads_on_wire_grid": grads_on_wire_grid,
        "max_grad": max_grad,
        "buckets": [[opt._names[p] for p in b.params] for b in opt._buckets],
        "steps": steps, "lr": lr, "momentum": momentum,
    }


def train_variants(variants: list[tuple[str, int, int | None]], device: str = "cpu") -> dict[str, dict[str, Any]]:
    """``train_cnn(compression, passes, bucket_bytes=..., device=device)`` for each variant, in one process
    (torch's first optimizer costs seconds of imports per process); keyed ``"compression/passes"``, plus
    ``"/bucket_bytes"`` where it is not the default."""
    _threads()
    return {variant_key(*v): train_cnn(v[0], v[1], bucket_bytes=v[2], device=device) for v in variants}


def variant_key(compression: str, passes: int, bucket_bytes: int | None) -> str:
    return f"{compression}/{passes}" + ("" if bucket_bytes is None else f"/{bucket_bytes}")


# -- 4: broadcast_parameters + broadcast_optimizer_state ------------------------------
def broadcast_state(device: str = "cpu") -> dict[str, Any]:
    """Rank 0 trains Adam locally (non-trivial moments, step, BN stats); the others are fresh. The model and
    its optimizer's state are on ``device``."""
    _threads()
    rank = bps.rank()
    torch.manual_seed(2000 + rank)
    model = SmallCNN(bn=True)
    # Buffers of dtypes the wire lacks (they travel as int32), different on every rank.
    model.register_buffer("mask", torch.arange(6) % (rank + 2) == 0)
    model.register_buffer("codes", (torch.arange(5, dtype=torch.uint8) * (rank + 3)))
    model.to(device)
    if rank == 0:
        inner = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95))
        X, Y = (t.to(device) for t in dataset(3 * 16, seed=99))
        for s in range(3):  # local, non-distributed steps
            inner.zero_grad()
            F.cross_entropy(model(X[16 * s:16 * (s + 1)]), Y[16 * s:16 * (s + 1)]).backward()
            inner.step()
    else:
        inner = torch.optim.Adam(model.parameters(), lr=0.5 + rank)
    opt = bps.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    model_before, opt_before = digest(model.state_dict()), digest(opt.state_dict())
    params_before = digest(dict(model.named_parameters()))
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(opt, root_rank=0)
    sd = opt.state_dict()
    first = sd["state"].get(0, {})
    out = {
        "rank": rank,
        "model_before": model_before,
        "opt_before": opt_before,
        "model": digest(model.state_dict()),
        "params": digest(dict(model.named_parameters())),
        "params_before": params_before,
        "buffers": digest(dict(model.named_buffers())),
        "opt": digest(sd),
        "moments": digest({k: {n: v for n, v in st.items() if n in ("exp_avg", "exp_avg_sq")}
                           for k, st in sd["state"].items()}),
        "n_state": len(sd["state"]),
        "steps": sorted({float(st["step"]) for st in sd["state"].values()}),
        "lr": [grp["lr"] for grp in sd["param_groups"]],
        "betas": [list(grp["betas"]) for grp in sd["param_groups"]],
        "num_batches_tracked": int(model.bn.num_batches_tracked),
        "mask": model.mask.tolist(), "mask_dtype": str(model.mask.dtype),
        "codes": model.codes.tolist(), "codes_dtype": str(model.codes.dtype),
        "running_var_is_default": bool(torch.equal(model.bn.running_var.cpu(), torch.ones(4))),
        "exp_avg_nonzero": bool(first and first["exp_avg"].abs().sum() > 0),
        "devices": sorted({str(t.device) for t in [*model.state_dict().values(), *(
            v for st in sd["state"].values() for n, v in st.items() if n != "step")]}),
    }
    # The broadcast state is usable: one distributed Adam step keeps every rank identical.
    X, Y = (t.to(device) for t in dataset(4 * 8, seed=7))
    opt.zero_grad()
    F.cross_entropy(model(X[8 * rank:8 * (rank + 1)]), Y[8 * rank:8 * (rank + 1)]).backward()
    opt.step()
    # Parameters only: BatchNorm's running stats follow each rank's own batch (local, as in Horovod).
    out["after_step"] = digest(dict(model.named_parameters()))
    out["opt_after_step"] = digest(opt.state_dict())
    out["steps_after"] = sorted({float(st["step"]) for st in opt.state_dict()["state"].values()})
    return out


# -- 5: parameters without a gradient -------------------------------------------------
class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 6)
        self.head_a = nn.Linear(6, 2)
        self.head_b = nn.Linear(6, 2)
        self.never = nn.Linear(6, 2)  # used by nobody, ever

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head_a(h) if use_a else self.head_b(h)


# Ranks that use head_a in each step (the others use head_b): only rank 0, everyone (head_b unused
# everywhere), nobody (head_a unused everywhere), only rank 3, ranks 1 and 2.
HEAD_A_USERS = [{0}, {0, 1, 2, 3}, set(), {3}, {1, 2}]


def _branch_loss(model: Branchy, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + 10 * step + rank)
    x = torch.randn(5, 4, generator=g)
    return (model(x, rank in HEAD_A_USERS[step]) ** 2).mean()


def unused_parameters() -> dict[str, Any]:
    _threads()
    rank, size = bps.rank(), bps.size()
    torch.manual_seed(3000 + rank)
    model = Branchy()
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    never_initial = digest(dict(model.never.named_parameters()))
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    steps = []
    for s in range(len(HEAD_A_USERS)):
        # What every rank's gradients are, computed here from the same weights and inputs.
        expected: dict[str, torch.Tensor | None] = {n: None for n, _ in model.named_parameters()}
        ref = copy.deepcopy(model)
        for r in range(size):
            ref.zero_grad(set_to_none=True)
            _branch_loss(ref, r, s).backward()
            for n, p in ref.named_parameters():
                if p.grad is not None:
                    expected[n] = p.grad.clone() if expected[n] is None else expected[n] + p.grad
        opt.zero_grad()
        _branch_loss(model, rank, s).backward()
        local_none = sorted(n for n, p in model.named_parameters() if p.grad is None)
        opt.step()
        report = {"local_none": local_none, "none": [], "diff": {}, "grads": {}}
        for n, p in model.named_parameters():
            if p.grad is None:
                report["none"].append(n)
                report["diff"][n] = None if expected[n] is None else "grad is None but expected one"
            else:
                report["grads"][n] = digest(p.grad)
                report["diff"][n] = ("grad present but expected None" if expected[n] is None
                                     else float((p.grad - expected[n] / size).abs().max()))
        steps.append(report)
    return {"rank": rank, "steps": steps, "final": digest(model.state_dict()),
            "never_unchanged": digest(dict(model.never.named_parameters())) == never_initial,
            "partial": partial_passes()}


def partial_passes() -> dict[str, Any]:
    """backward_passes_per_step=2 where head_a gets a gradient in only some of the passes.

    Case "some": rank 0 uses head_a in both passes, the others in their first pass only.
    Case "all": every rank uses head_a in its first pass only.
    Reported: each rank's accumulated local gradient of head_a.bias before step(), the gradient
    step() left there, and the true average of the local accumulations (an explicit push_pull).
    """
    rank = bps.rank()
    torch.manual_seed(7)
    model = Branchy()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=[(f"partial.{n}", p) for n, p in model.named_parameters()],
                                   backward_passes_per_step=2)
    out = {}
    for case in ("some", "all"):
        opt.zero_grad()
        x = torch.full((2, 4), float(rank + 1))
        for k in range(2):
            use_a = k == 0 or (case == "some" and rank == 0)
            ((model(x, use_a) ** 2).mean() / 2).backward()
        local = model.head_a.bias.grad.clone()
        opt.step()
        after = model.head_a.bias.grad.clone()
        true_mean = bps.push_pull(local, f"partial.check.{case}", average=True)
        out[case] = {"local": local.tolist(), "after": after.tolist(), "after_digest": digest(after),
                     "diff": float((after - true_mean).abs().max())}
    out["weights"] = digest(model.state_dict())
    return out


# -- 7: push_pull / broadcast on tensors, autograd ------------------------------------
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}


def int_valued(dtype: str, shape: tuple[int, ...], rank: int, seed: int) -> torch.Tensor:
    """Integers in [-8, 8]: every partial sum and quarter is exact in every dtype (bfloat16 included)."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randint(-8, 9, shape, generator=g).to(TORCH_DTYPES[dtype])


def tensor_ops(device: str = "cpu") -> dict[str, Any]:
    """push_pull, broadcast and autograd on tensors of ``device`` (every result compared on the CPU)."""
    _threads()
    rank, size = bps.rank(), bps.size()
    out: dict[str, Any] = {}
    for i, (dt, torch_dtype) in enumerate(TORCH_DTYPES.items()):
        shape = (3, 5)
        for average in (False, True):
            if average and not torch_dtype.is_floating_point:
                continue
            x = int_valued(dt, shape, rank, i).to(device)
            before = x.clone()
            y = bps.push_pull(x, f"t.{dt}.{average}", average=average)
            ref = sum(int_valued(dt, shape, r, i).double() for r in range(size))
            ref = (ref / size if average else ref).to(torch_dtype)
            out[f"pp.{dt}.{average}"] = {"exact": bool(y.dtype == torch_dtype and y.shape == shape
                                                       and y.device == x.device and torch.equal(y.cpu(), ref)),
                                         "input_unchanged": torch.equal(x, before), "digest": digest(y)}
        # broadcast from rank 1, as a new tensor and in place
        x = int_valued(dt, (7,), rank, 50 + i).to(device)
        y = bps.broadcast(x, 1, f"b.{dt}")
        z = x.clone()
        bps.broadcast_(z, 2, f"b_.{dt}")
        out[f"bc.{dt}"] = {"exact": bool(y.device == x.device
                                         and torch.equal(y.cpu(), int_valued(dt, (7,), 1, 50 + i))
                                         and torch.equal(z.cpu(), int_valued(dt, (7,), 2, 50 + i))
                                         and torch.equal(x.cpu(), int_valued(dt, (7,), rank, 50 + i))),
                           "digest": digest([y, z])}
    _noise_and_layouts(out, device)
    # Autograd: the gradient of a cross-process sum is the cross-process sum of the gradients.
    for average in (False, True):
        x = torch.full((3,), float(rank + 1), requires_grad=True, device=device)
        y = bps.push_pull(x, f"ag.{average}", average=average)
        (y * (rank + 1)).sum().backward()
        out[f"autograd.{average}"] = {"y": y.detach().tolist(), "grad": x.grad.tolist(),
                                      "requires_grad": y.requires_grad}
    x = torch.ones(4, requires_grad=True, device=device)
    y = bps.push_pull(x, "ag.plain", average=False)
    y.sum().backward()
    out["autograd.ones"] = {"grad": x.grad.tolist(), "size": size}
    return out


def _noise_and_layouts(out: dict[str, Any], device: str) -> None:
    """tensor_ops' float noise, in-place and non-contiguous cases."""
    rank, size = bps.rank(), bps.size()
    # Non-integer float32 data: close to torch's sum, identical bytes everywhere.
    xs = [torch.randn(1001, generator=torch.Generator().manual_seed(9 + r)) for r in range(size)]
    y = bps.push_pull(xs[rank].to(device), "t.noise", average=True)
    out["noise"] = {"exact": bool(torch.allclose(y.cpu(), torch.stack(xs).mean(0), rtol=1e-6, atol=1e-6)),
                    "digest": digest(y)}
    # out= the input itself (in place), and a non-contiguous input and out (staging copies).
    x = int_valued("float32", (4, 6), rank, 70).to(device)
    y = bps.push_pull(x, "t.inplace", average=False, out=x)
    ref = sum(int_valued("float32", (4, 6), r, 70) for r in range(size))
    out["inplace"] = {"exact": bool(y is x and torch.equal(x.cpu(), ref)), "digest": digest(x)}
    base = int_valued("float64", (5, 3), rank, 71).to(device)
    target = torch.zeros(3, 5, dtype=torch.float64, device=device).t()  # non-contiguous (5, 3)
    y = bps.push_pull(base.t(), "t.noncontig", average=False, out=target.t())
    ref = sum(int_valued("float64", (5, 3), r, 71) for r in range(size))
    out["noncontig"] = {"exact": bool(torch.equal(y.cpu(), ref.t()) and torch.equal(target.cpu(), ref)),
                        "digest": digest(y)}


# -- 8: LR scheduler, synchronize + clip + skip_synchronize, errors in a cluster -----
def scheduler_and_clip(steps: int = 8, batch: int = BATCH) -> dict[str, Any]:
    _threads()
    rank, size = bps.rank(), bps.size()
    torch.manual_seed(4000 + rank)
    model = SmallCNN()
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    plain = copy.deepcopy(model)  # distributed, plain step(): no synchronize, no clipping
    skipped = copy.deepcopy(model)  # distributed, synchronize() + step() inside skip_synchronize()
    reference = copy.deepcopy(model)  # one process, the whole batch, clipped, StepLR
    max_norm = 0.05

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    def named(m: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
        return [(f"{prefix}.{n}", p) for n, p in m.named_parameters()]

    opt = bps.DistributedOptimizer(sgd(model), named_parameters=named(model, "clip"))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    opt_plain = bps.DistributedOptimizer(sgd(plain), named_parameters=named(plain, "plain"))
    opt_skip = bps.DistributedOptimizer(sgd(skipped), named_parameters=named(skipped, "skip"))
    ref_opt = sgd(reference)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    g = size * batch
    X, Y = dataset(steps * g, seed=4321)
    lrs, ref_lrs, norms, ref_norms = [], [], [], []
    for s in range(steps):
        lo = s * g + rank * batch
        xb, yb = X[lo:lo + batch], Y[lo:lo + batch]
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.synchronize()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        with opt.skip_synchronize():
            opt.step()
        sched.step()

        opt_plain.zero_grad()
        F.cross_entropy(plain(xb), yb).backward()
        opt_plain.step()

        opt_skip.zero_grad()
        F.cross_entropy(skipped(xb), yb).backward()
        opt_skip.synchronize()
        with opt_skip.skip_synchronize():
            opt_skip.step()

        ref_lrs.append(ref_opt.param_groups[0]["lr"])
        ref_opt.zero_grad()
        F.cross_entropy(reference(X[s * g:(s + 1) * g]), Y[s * g:(s + 1) * g]).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)))
        ref_opt.step()
        ref_sched.step()

    result: dict[str, Any] = {
        "rank": rank, "lrs": lrs, "ref_lrs": ref_lrs, "norms": norms, "ref_norms": ref_norms,
        "clip_vs_reference": max_diff(model, reference),
        "skip_vs_plain": max_diff(skipped, plain),
        "skip_equals_plain_bitwise": digest(skipped.state_dict()) == digest(plain.state_dict()),
        "final": digest(model.state_dict()), "final_plain": digest(plain.state_dict()),
    }
    # Errors that need gradients in flight; each is followed by a clean recovery.
    xb, yb = X[rank * batch:(rank + 1) * batch], Y[rank * batch:(rank + 1) * batch]
    errors: dict[str, str | None] = {}

    opt.zero_grad()
    F.cross_entropy(model(xb), yb).backward()  # gradients now in flight
    try:
        opt.zero_grad()
        errors["zero_grad"] = None
    except bps.BPSError as exc:
        errors["zero_grad"] = str(exc)
    try:
        with opt.skip_synchronize():
            opt.step()
        errors["skip_without_sync"] = None
    except bps.BPSError as exc:
        errors["skip_without_sync"] = str(exc)
    opt.step()  # recovers: synchronizes what was in flight
    result["after_errors"] = digest(model.state_dict())

    opt.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    try:
        F.cross_entropy(model(xb), yb).backward()  # a second backward with backward_passes_per_step=1
        errors["twice"] = None
    except bps.BPSError as exc:
        errors["twice"] = str(exc)
    opt.step()
    result["after_twice"] = digest(model.state_dict())
    result["errors"] = errors
    return result


def recover_after_mismatch() -> dict[str, Any]:
    """Step 1: rank 3's model has another shape for fc (a mismatch); step 2: everyone agrees again."""
    _threads()
    rank = bps.rank()

    def make(width: int) -> tuple[nn.Module, bps.DistributedOptimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
        return model, bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               named_parameters=model.named_parameters())

    good, opt = make(6)
    x, y = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank)), torch.tensor([0, 1, 0, 1, 1])
    model, o = make(7) if rank == 3 else (good, opt)
    F.cross_entropy(model(x), y).backward()
    error = None
    try:
        o.step()
    except bps.BPSError as exc:
        error = str(exc)
    opt.zero_grad()
    F.cross_entropy(good(x), y).backward()
    opt.step()  # must work: no name may be left "in flight" by the failed step
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in good.parameters())).hexdigest()
    return {"error": error, "digest": digest}
