"""Rank programs of the DDP hook's tests (top-level, so spawn can import them).

Every program runs in one process per rank after ``bps.init`` (harness.run_ranks) and joins a
torch.distributed group of its own (gloo on CPU; NCCL on GPUs when each rank has one). Models
are built from fixed seeds and fed data that are functions of (rank, step), so the hook's DDP
and DDP's own all-reduce train the same copies on the same batches in the same processes.
"""

from __future__ import annotations

import copy
import datetime as dt
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bps_worker.torch as bps
import torch_programs as tp

STEPS = 20
NO_SYNC_STEPS = (4, 11)  # these steps accumulate one micro-batch under no_sync() before the synchronized one
BATCH = 6
IN, CLASSES = 12, 3
# A chain of 3 linear layers (1,571 parameters) whose buckets DDP rebuilds after the first iteration: it puts
# every gradient in one bucket first, then, by this cap, out and mid (1,155) in bucket 0 and inp in bucket 1.
CHAIN_CAP_MB = 2048 / 2**20


def join(port: int, rank: int, world: int, backend: str = "gloo") -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=60))


class Heads(nn.Module):
    """A body and two heads, each step's head chosen per rank (one is unused on some ranks); ``never`` is
    used by no rank ever."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(IN, 24)
        self.head_a = nn.Linear(24, CLASSES)
        self.head_b = nn.Linear(24, CLASSES)
        self.never = nn.Linear(CLASSES, CLASSES)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head_a(h) if use_a else self.head_b(h)


class Chain(nn.Module):
    """Declared out of the order of use, so that DDP's rebuilt buckets (by the order gradients are ready)
    differ from its first ones."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(32, CLASSES)
        self.inp = nn.Linear(IN, 32)
        self.mid = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, use_a: bool = True) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def _batch(rank: int, step: int, micro: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    x, y = torch.randn(BATCH, IN, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)
    return x.to(device), y.to(device)


def _uses_a(rank: int, step: int, micro: int) -> bool:
    return (step + rank + micro) % 3 != 0  # every step: head_a on some ranks, head_b on others


def _backward(model: nn.Module, rank: int, step: int, micro: int, device: str) -> None:
    x, y = _batch(rank, step, micro, device)
    F.cross_entropy(model(x, _uses_a(rank, step, micro)), y).backward()


def train_both(make: Callable[[], nn.Module], state: Any, ddp_kwargs: dict[str, Any], device: str
               ) -> dict[str, Any]:
    """The same initial model wrapped twice, with the hook and with DDP's own all-reduce; STEPS steps of SGD
    with momentum on the same batches (NO_SYNC_STEPS accumulate a micro-batch under no_sync() first)."""
    rank = dist.get_rank()
    torch.manual_seed(7)
    initial = make().to(device)
    models = {}
    for system in ("bps", "ddp"):
        device_ids = [torch.device(device)] if device != "cpu" else None
        model = DDP(copy.deepcopy(initial), device_ids=device_ids, **ddp_kwargs)
        if system == "bps":
            model.register_comm_hook(state=state, hook=bps.ddp_comm_hook)
        models[system] = (model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for step in range(STEPS):
        for model, opt in models.values():
            opt.zero_grad()
            if step in NO_SYNC_STEPS:
                with model.no_sync():
                    _backward(model, rank, step, 1, device)
            _backward(model, rank, step, 0, device)
            opt.step()
    ours, theirs = models["bps"][0].module.cpu(), models["ddp"][0].module.cpu()
    initial = initial.cpu()
    never = {s: (bool(torch.equal(m.never.weight, initial.never.weight)) if hasattr(m, "never") else None)
             for s, m in (("bps", ours), ("ddp", theirs))}
    return {"rank": rank, "max_diff": tp.max_diff(ours, theirs), "moved": tp.max_diff(theirs, initial),
            "final": tp.digest(ours.state_dict()), "never_unchanged": never}


def returns_at_once(rank: int, device: str) -> dict[str, Any]:
    """Rank 0 calls the hook while the others wait in a barrier: its future cannot be done when the hook
    returns (the others have not pushed), so the hook did not wait for the sum."""
    state = bps.DDPHookState("at_once")
    bucket = Bucket(0, torch.full((4,), float(rank), device=device))
    pending = None
    if rank == 0:
        future = bps.ddp_comm_hook(state, bucket)  # type: ignore[arg-type]
        pending = not future.done()
        dist.barrier()
    else:
        dist.barrier()
        future = bps.ddp_comm_hook(state, bucket)  # type: ignore[arg-type]
    return {"pending": pending, "value": future.wait().tolist()}


def ddp_vs_allreduce(port: int, device_kind: str = "cpu", backend: str = "gloo") -> dict[str, Any]:
    """The hook against DDP's all-reduce: Heads with find_unused_parameters=True (state=None), then Chain
    with rebuilt buckets and gradients as bucket views (state="chain")."""
    rank, size = bps.rank(), bps.size()
    torch.set_num_threads(1)
    device = "cpu"
    if device_kind == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    join(port, rank, size, backend)
    try:
        at_once = returns_at_once(rank, device)
        unused = train_both(Heads, None, {"find_unused_parameters": True}, device)
        chain_state = bps.DDPHookState("chain")
        rebuilt = train_both(Chain, chain_state, {"bucket_cap_mb": CHAIN_CAP_MB, "gradient_as_bucket_view": True},
                             device)
        rebuilt["names"] = {n: [i, str(d), k] for n, (i, d, k) in chain_state.bucket_names().items()}
    finally:
        dist.destroy_process_group()
    return {"at_once": at_once, "unused": unused, "rebuilt": rebuilt}


# -- errors -------------------------------------------------------------------------
class Split(nn.Module):
    """Layers of 40, 144 and 272 parameters. DDP (torch 2.13, find_unused_parameters=True) cuts them into
    buckets of 16, 272 and 168 elements with bucket_cap_mb = 200 bytes, of 16, 256 and 184 with 680 bytes:
    as many buckets, two of other sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 16)
        self.l3 = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def _error_of(call: Callable[[], Any]) -> dict[str, Any]:
    try:
        call()
    except Exception as exc:
        return {"type": type(exc).__name__, "bps": isinstance(exc, bps.BPSError), "name": getattr(exc, "name", None),
                "message": str(exc)}
    return {"type": None}


class Bucket:
    """What the hook reads of DDP's GradBucket (index and buffer): to call the hook outside backward."""

    def __init__(self, index: int, buffer: torch.Tensor, parameters: list[torch.Tensor] | None = None) -> None:
        self._index, self._buffer = index, buffer
        self._parameters = parameters if parameters is not None else [buffer]

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters


def twin_models(rank: int) -> dict[str, Any]:
    """Two DDP models of one shape in one backward: with one hook state their buckets have one name (a clear
    BPSError); with a prefix each they train (the gradient of w.x summed over both models is x, averaged).

    With one state, rank 0's second hook call waits 0.5 s: the first model's sum has ended by then (the other
    ranks pushed it, then failed at their second hook), so only the backward's claim of the name can tell rank 0
    that the name was taken; otherwise it pushes the name again and waits for peers that have left."""
    x = torch.full((1, 4), float(rank + 1))
    out = {}
    for states in (("twins", "twins"), ("twin0", "twin1")):
        torch.manual_seed(0)
        models = [DDP(nn.Linear(4, 1, bias=False)) for _ in states]
        calls: list[int] = []

        def late_second(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
            calls.append(1)
            if rank == 0 and len(calls) == 2 and states[0] == states[1]:
                time.sleep(0.5)
            return bps.ddp_comm_hook(state, bucket)

        late_second.__annotations__.update(bps.ddp_comm_hook.__annotations__)
        for model, state in zip(models, states):
            model.register_comm_hook(state=state, hook=late_second)
        out[states[1]] = _error_of(lambda: sum(m(x).sum() for m in models).backward())
    out["grad"] = models[0].module.weight.grad.tolist()
    return out


def ddp_errors(ports: list[int]) -> dict[str, Any]:
    """Failures reach the user as BPSErrors: from the future (a direct call), from backward() (buckets that
    differ between ranks), and a DDP group smaller than the job."""
    rank, size = bps.rank(), bps.size()
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    join(ports[0], rank, size)
    try:
        # the future: same index, 6 elements on rank 0, 8 elsewhere; then a good one, still in this state
        state = bps.DDPHookState("direct")
        bad = bps.ddp_comm_hook(state, Bucket(0, torch.ones(6 if rank == 0 else 8)))  # type: ignore[arg-type]
        out["future"] = _error_of(bad.wait)
        good = torch.full((5,), float(rank + 1))
        value = bps.ddp_comm_hook(state, Bucket(1, good)).wait()  # type: ignore[arg-type]
        out["after"] = {"value": value.tolist(), "in_place": value is good}
        out["twins"] = twin_models(rank)
        # backward(): rank 0 cuts the model into buckets otherwise than the others (another bucket_cap_mb). Last
        # on this group: after this failed step (find_unused_parameters=True) a new DDP's set-up on the group
        # timed out in gloo.
        cap = 200 if rank == 0 else 680
        model = DDP(Split(), bucket_cap_mb=cap / 2**20, find_unused_parameters=True)
        split = bps.DDPHookState("split")
        model.register_comm_hook(state=split, hook=bps.ddp_comm_hook)
        out["backward"] = _error_of(lambda: model(torch.ones(2, 4)).sum().backward())
        out["split"] = sorted([i, k] for i, _, k in split.bucket_names().values())
    finally:
        dist.destroy_process_group()
    join(ports[1 + rank // 2], rank % 2, 2)  # two groups of 2 in a job of 4
    try:
        pair = DDP(nn.Linear(4, 2))
        pair.register_comm_hook(state="pairs", hook=bps.ddp_comm_hook)
        out["world"] = _error_of(lambda: pair(torch.ones(2, 4)).sum().backward())
    finally:
        dist.destroy_process_group()
    return out


def dead_peer(port: int) -> dict[str, Any]:
    """Two ranks train two steps (DDP's bucket rebuild, its last collective, is behind them); then rank 1
    dies, and rank 0's next backward must raise a BPSError, not hang."""
    rank = bps.rank()
    torch.set_num_threads(1)
    join(port, rank, 2)
    try:
        model = DDP(nn.Linear(4, 2))
        model.register_comm_hook(state="dead", hook=bps.ddp_comm_hook)
        for _ in range(2):
            model(torch.ones(2, 4)).sum().backward()
        if rank == 1:
            os._exit(0)
        started = time.monotonic()
        error = _error_of(lambda: model(torch.ones(2, 4)).sum().backward())
        return {**error, "seconds": time.monotonic() - started}
    finally:
        dist.destroy_process_group()


def subgroups(port: int) -> dict[str, Any]:
    """Each rank's DDP on a group of its own (the default group spans the job): registered by the hook alone it
    is not refused, and each rank's gradient comes back as the mean of both ranks' (DDP would leave its own);
    by register_ddp_hook, a BPSError names both sizes."""
    rank = bps.rank()
    torch.set_num_threads(1)
    join(port, rank, bps.size())
    try:
        groups = [dist.new_group([0]), dist.new_group([1])]
        out: dict[str, Any] = {}
        for how in ("hook", "helper"):
            model = DDP(nn.Linear(2, 1, bias=False), process_group=groups[rank])
            if how == "hook":
                model.register_comm_hook(state=how, hook=bps.ddp_comm_hook)
            else:
                bps.register_ddp_hook(model, prefix=how)
            x = torch.full((1, 2), float(rank + 1))
            out[how] = _error_of(lambda: model(x).sum().backward())
            out[how]["grad"] = None if model.module.weight.grad is None else model.module.weight.grad.tolist()
        return out
    finally:
        dist.destroy_process_group()
