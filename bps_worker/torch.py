"""PyTorch integration: ``import bps_worker.torch as bps``.

The same functions as :mod:`bps_worker.client` on ``torch.Tensor``, plus what
Horovod users know::

    bps.init()
    model = Net()
    optimizer = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(optimizer, root_rank=0)

``DistributedOptimizer`` packs gradients into buckets (4 MiB by default, in
reverse declaration order) and starts the push_pull of a bucket from the
post-accumulate-grad hook of its last gradient, as soon as backward has
produced it, so communication overlaps the rest of backward; front layers get
the highest priority so their sums come back first (the next forward pass
needs them first). ``step()`` waits for all of them and writes the averages
into ``.grad``. So a gradient changed after backward (unscaled, clipped) must be
changed after ``optimizer.synchronize()``, then stepped inside
``optimizer.skip_synchronize()``, as in Horovod; a change before is a BPSError
at ``step()``, not a silently lost change.

Parameters without a gradient: every process pushes every parameter every
step, with one extra element per gradient that says whether it had one. A parameter
that got one on some process but not on this one takes part with zeros, so
every process applies the same averaged gradient; a parameter that got none
anywhere keeps its ``grad`` (``None`` after ``zero_grad()``) and is skipped by
the optimizer on every process alike. A gradient accumulated over fewer passes
than ``backward_passes_per_step`` is pushed as it is at ``step()``. Nothing
hangs and nothing is skipped silently on only some processes.

DDP users keep ``DistributedDataParallel`` and change one line:
``model.register_comm_hook(state=None, hook=bps.ddp_comm_hook)`` (see :mod:`bps_worker.torch_ddp`).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import operator
import re
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from bps_runtime import cuda as _cuda

from . import client as _client
from . import torch_async as _async
from .client import adapter as _adapter
from .client.arrays import bytes_of
from .client.handle import checked
from .client import (  # re-exported: the same on every framework
    BPSConnectionError,
    BPSError,
    BPSMismatchError,
    BPSTimeoutError,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from .torch_ddp import DDPHookState, ddp_comm_hook, register_ddp_hook  # the DDP drop-in, in its own module

__all__ = [
    "BPSError", "BPSConnectionError", "BPSMismatchError", "BPSTimeoutError", "Compression", "Handle",
    "DistributedOptimizer", "broadcast", "broadcast_", "broadcast_optimizer_state", "broadcast_parameters",
    "init", "is_initialized", "local_rank", "local_size", "poll", "push_pull", "push_pull_async", "push_pull_group",
    "rank", "shared_array", "shared_tensor", "shutdown", "size", "synchronize", "DDPHookState", "ddp_comm_hook",
    "register_ddp_hook", "async_init", "async_push_pull",
]

_WIRE_TYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64}


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16 through ml_dtypes); a host copy of a CUDA one."""
    if t.device.type != "cpu":
        t = t.detach().to("cpu")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_client.NUMPY_DTYPES["bfloat16"])
    if t.dtype not in _WIRE_TYPES:
        raise BPSError(f"unsupported tensor dtype {t.dtype}; supported: float32, float64, float16, bfloat16, "
                       f"int32, int64")
    return t.numpy()


def _from_numpy(a: np.ndarray, like: torch.Tensor | None = None) -> torch.Tensor:
    if a.dtype.name == "bfloat16":  # ml_dtypes' (only ml_dtypes makes a numpy bfloat16)
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


_NUMPY_OF = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
             torch.bfloat16: "bfloat16", torch.int32: np.int32, torch.int64: np.int64}  # bfloat16: see _numpy_of


def _numpy_of(dtype: torch.dtype) -> Any:
    """The numpy dtype of a wire torch dtype (bfloat16 through ml_dtypes, imported only when used)."""
    np_dtype = _NUMPY_OF[dtype]
    return _client.NUMPY_DTYPES["bfloat16"] if np_dtype == "bfloat16" else np_dtype


def shared_tensor(name: str, shape: Iterable[int] | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A CPU tensor whose storage is the shared-memory slot of ``name`` (see
    :func:`bps_worker.client.shared_array`): ``push_pull(t, name, out=t)`` on it sums in place
    with no copy in or out. Reused across rounds while the size fits; valid until ``shutdown()``."""
    if dtype not in _NUMPY_OF:
        raise BPSError(f"unsupported tensor dtype {dtype}; supported: float32, float64, float16, bfloat16, "
                       f"int32, int64")
    return _from_numpy(_client.shared_array(name, shape, _numpy_of(dtype)))


shared_array = shared_tensor  # (the client's name for it: "the same functions on torch.Tensor")


@dataclass(eq=False)
class Handle:
    """A torch push_pull/broadcast in flight."""

    inner: _client.Handle
    output: torch.Tensor
    staging: torch.Tensor | None  # the CPU tensor the result lands in, when it is not `output` itself


def _check_dense(tensor: object, name: str, what: str = "") -> None:
    """A BPSError unless ``tensor`` is a dense (strided) torch.Tensor (a sparse one failed inside torch, with its
    own error: a review). ``what``: the argument, where it is not the tensor itself."""
    of = f"tensor {name!r}: {what + ' ' if what else ''}"
    if not isinstance(tensor, torch.Tensor):
        raise BPSError(f"{of}expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise BPSError(f"{of}is a {tensor.layout} tensor; only dense tensors are summed and broadcast (pass "
                       f"{what or 'it'}.to_dense())")


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (an ``expand``-ed or ``as_strided`` tensor): the result could not
    be written into it. Its dimensions, taken by stride, must each step over the whole of the ones below."""
    extent = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1):
        if stride < extent:
            return True
        extent = stride * size
    return False


def _start(tensor: torch.Tensor, name: str, *, average: bool, priority: int, out: torch.Tensor | None) -> Handle:
    _check_dense(tensor, name)
    if out is not None:
        _check_dense(out, name, "out")
        if _overlaps_itself(out):
            raise BPSError(f"tensor {name!r}: out has elements that share memory (an expand()-ed or as_strided "
                           f"tensor, strides {out.stride()}); the result cannot be written into it")
    output = out if out is not None else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    if output.shape != tensor.shape or output.dtype != tensor.dtype:
        raise BPSError(f"tensor {name!r}: out has shape {tuple(output.shape)} and dtype {output.dtype}, expected "
                       f"{tuple(tensor.shape)} and {tensor.dtype}")
    if output.device.type == "cuda" and output.is_contiguous() and _adapter.settings().cuda_ipc:
        # The worker daemon opens `output` through CUDA IPC, sums on the GPU and writes the result back:
        # no host copy in this process (see bps_runtime/cuda.py). init(cuda_ipc=False) or BPS_CUDA_IPC=0:
        # through host copies instead.
        if output is not tensor:
            with torch.no_grad():
                output.copy_(tensor)
        wire = _client.dtype_name(np.dtype(_numpy_of(tensor.dtype))) if tensor.dtype in _NUMPY_OF else None
        if wire is None:
            raise BPSError(f"unsupported tensor dtype {tensor.dtype}")
        inner = _adapter.start_cuda(name, wire, tuple(tensor.shape), _cuda.describe(output), average=average,
                                    priority=priority)
        return Handle(inner, output, None)
    direct = output.device.type == "cpu" and output.is_contiguous()
    staging = None if direct else torch.empty(tensor.shape, dtype=tensor.dtype)
    target = output if staging is None else staging
    inner = _client.push_pull_async(_to_numpy(tensor), name, average=average, priority=priority,
                                    out=_to_numpy(target))
    return Handle(inner, output, staging)


def push_pull_async(tensor: torch.Tensor, name: str, *, average: bool = True, priority: int = 0,
                    out: torch.Tensor | None = None) -> Handle:
    """Start summing (averaging) ``tensor`` across every process; ``out`` may be ``tensor`` itself."""
    return _start(tensor, name, average=average, priority=priority, out=out)


def poll(handle: Handle) -> bool:
    return _client.poll(checked(handle, "poll", Handle).inner)


def synchronize(handle: Handle, timeout: float | None = None) -> torch.Tensor:
    """Wait for ``handle``; return its output tensor (on the input's device)."""
    _client.synchronize(checked(handle, "synchronize", Handle).inner, timeout)
    if handle.staging is not None:
        handle.output.copy_(handle.staging)
    return handle.output


class _PushPull(torch.autograd.Function):
    """push_pull as a differentiable op: the gradient of a sum over processes is the sum of the gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str, average: bool, priority: int) -> torch.Tensor:
        ctx.name, ctx.average, ctx.priority = name, average, priority
        return synchronize(_start(tensor, name, average=average, priority=priority, out=None))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        handle = _start(grad.contiguous(), ctx.name + ".grad", average=ctx.average, priority=ctx.priority, out=None)
        return synchronize(handle), None, None, None


def push_pull(tensor: torch.Tensor, name: str, *, average: bool = True, priority: int = 0,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum (or mean over ``size()``) of ``tensor`` across every process; differentiable when it needs a grad."""
    if out is None and isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return _PushPull.apply(tensor, name, average, priority)
    return synchronize(_start(tensor, name, average=average, priority=priority, out=out))


def push_pull_group(tensors: Sequence[torch.Tensor], names: Sequence[str], *, average: bool = True,
                    priority: int = 0) -> list[torch.Tensor]:
    """:func:`bps_worker.client.push_pull_group` on tensors: a model's whole tree in one call (its small tensors
    packed per dtype); each result a new tensor on its input's device."""
    tensors, names = list(tensors), list(names)
    if len(tensors) != len(names):
        raise BPSError(f"push_pull_group: {len(tensors)} tensors but {len(names)} names")
    for tensor, name in zip(tensors, names):
        _check_dense(tensor, name)
    results = _client.push_pull_group([_to_numpy(t) for t in tensors], names, average=average, priority=priority)
    return [_from_numpy(r, t).to(t.device) for r, t in zip(results, tensors)]


def broadcast(tensor: torch.Tensor, root_rank: int, name: str) -> torch.Tensor:
    """``root_rank``'s value of ``tensor``, as a new tensor on every process. Any dtype: the wire's as themselves,
    the others (bool, the small and unsigned integers, complex, float8) as their bytes, bit for bit."""
    _check_dense(tensor, name)
    return _broadcast_result(_client.synchronize(_start_broadcast(tensor, name, root_rank)), tensor).to(tensor.device)


def _start_broadcast(tensor: torch.Tensor, name: str, root_rank: int) -> _client.Handle:
    """Start a broadcast of ``tensor`` (detached, on any device): a wire dtype as itself, another as its bytes."""
    if tensor.dtype in _WIRE_TYPES:
        return _adapter.start_broadcast(_to_numpy(tensor), name, root_rank)
    return _adapter.start_broadcast_bytes(_raw_bytes(tensor), name, root_rank, f"{tensor.dtype}{list(tensor.shape)}")


def _broadcast_result(result: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """The result of :func:`_start_broadcast` as a CPU tensor of ``like``'s dtype and shape (no copy)."""
    return _from_numpy(result, like) if like.dtype in _WIRE_TYPES else _bytes_as(result, like)


def async_init(tensor: torch.Tensor, name: str, root_rank: int = 0, *, staleness: int | None = None) -> torch.Tensor:
    """:func:`bps_worker.client.async_init` on a tensor: the servers' value of ``name``, as a new tensor."""
    result = _client.async_init(_to_numpy(tensor), name, root_rank, staleness=staleness)
    return _from_numpy(result, tensor).to(tensor.device)


def async_push_pull(delta: torch.Tensor, name: str) -> torch.Tensor:
    """:func:`bps_worker.client.async_push_pull` on a tensor: ``delta`` added, the value after it."""
    return _from_numpy(_client.async_push_pull(_to_numpy(delta), name), delta).to(delta.device)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str) -> torch.Tensor:
    """In-place broadcast: ``tensor`` takes ``root_rank``'s value."""
    with torch.no_grad():
        tensor.copy_(broadcast(tensor, root_rank, name))
    return tensor


# -- compression --------------------------------------------------------------------
class _Compressor:
    """Casts gradients for the wire and back; the error of a cast is bounded by its dtype's precision."""

    wire_dtype: torch.dtype | None = None

    def compress(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.wire_dtype is None or not tensor.is_floating_point() or tensor.dtype == self.wire_dtype:
            return tensor
        return tensor.to(self.wire_dtype)

    def decompress(self, tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.dtype == like.dtype else tensor.to(like.dtype)

    def __repr__(self) -> str:
        return f"Compression.{type(self).__name__.lower().lstrip('_')}"


class _NoneCompressor(_Compressor):
    pass


class _FP16Compressor(_Compressor):
    wire_dtype = torch.float16


class _BF16Compressor(_Compressor):
    wire_dtype = torch.bfloat16


class Compression:
    """Gradient compression for DistributedOptimizer (as in Horovod)."""

    none: _Compressor = _NoneCompressor()
    fp16: _Compressor = _FP16Compressor()
    bf16: _Compressor = _BF16Compressor()


# -- broadcasting state -------------------------------------------------------------
def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = list(params.items())
    elif isinstance(params, Iterable):
        items = list(params)
    else:
        raise BPSError(f"params must be a state_dict() or named_parameters(), got {type(params).__name__}")
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise BPSError("params must hold (name, tensor) pairs, as state_dict().items() or named_parameters() do")
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise BPSError("params has duplicate names")
    return items


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite every tensor of ``params`` (state_dict() or named_parameters()) with ``root_rank``'s, in place."""
    named = _named_tensors(params)
    _async.check_broadcast([t for _, t in named])
    handles = []
    try:
        for name, tensor in named:
            wire = tensor.detach()
            # A dtype the wire does not carry (bool, the small and unsigned integers, complex, float8) travels as
            # its bytes, bit for bit: its values cast to int32 would wrap (uint32, uint64) or lose all but the
            # integer part (complex, float8).
            handles.append((tensor, wire, _start_broadcast(wire, f"bcast.param.{name}", root_rank)))
    except BaseException:  # (e.g. over the arena's cap) those started must not stay in flight: every later
        _adapter.settle([h for _, _, h in handles])  # broadcast of their names would fail
        raise
    first_error: BPSError | None = None
    with torch.no_grad():
        for tensor, wire, handle in handles:
            try:
                result = _client.synchronize(handle)
            except BPSError as exc:  # drain the rest so no name stays in flight
                first_error = first_error or exc
                continue
            tensor.copy_(_broadcast_result(result, wire).to(device=tensor.device, dtype=tensor.dtype))
    if first_error is not None:
        raise first_error
    _async.init_all(root_rank)  # asynchronous optimizers: the servers' values start as the root's parameters


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of ``t`` (on the host, contiguous), as a 1-d uint8 array."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def _bytes_as(words: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A byte broadcast's result (see ``start_broadcast_bytes``; a copy of the words already) as a tensor of
    ``like``'s dtype and shape, on its memory."""
    raw = torch.from_numpy(bytes_of(words, like.numel() * like.element_size()))
    return raw.view(like.dtype).reshape(like.shape)


def _broadcast_bytes(data: bytes, root_rank: int, name: str) -> bytes:
    length = _client.broadcast(np.array([len(data)], np.int64), root_rank, f"{name}.length")
    n = int(length[0])
    # (the root's bytes; the others', zeros of that length: the root's replace them)
    raw = np.frombuffer(data, np.uint8) if _client.rank() == root_rank else np.zeros(n, np.uint8)
    return _client.broadcast(raw, root_rank, f"{name}.bytes").tobytes()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every process ``root_rank``'s optimizer state (moments, step counts, hyper-parameters).

    An optimizer's state is by position in its parameter groups. A DistributedOptimizer given
    ``named_parameters`` lets processes list its parameters in other orders (it names each gradient): its
    state goes by those names (the root's positions were taken as ours, and each process whose order differed
    got other parameters' moments, silently: a review), and each group must hold the same names as the root's
    (a BPSError on a process whose groups differ)."""
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    names = optimizer.names_in_groups() if isinstance(optimizer, DistributedOptimizer) else None
    payload = b""
    if _client.rank() == root_rank:
        stream = io.BytesIO()  # (loaded with weights_only: no numpy objects)
        torch.save({"state": _plain(inner.state_dict()), "names": names}, stream)
        payload = stream.getvalue()
    data = _broadcast_bytes(payload, root_rank, "bcast.optimizer_state")
    got = _load_state(data)
    state = got["state"]
    if names is not None and got["names"] is not None and got["names"] != names:
        state = _by_our_positions(state, got["names"], names, inner.param_groups)
    inner.load_state_dict(state)


def _load_state(data: bytes) -> dict[str, Any]:
    """The root's optimizer state from its bytes, loaded as weights only (tensors, numbers, strings and containers
    of them: a peer's bytes run no code here); every process loads the same bytes, so all fail alike, with a
    BPSError naming what the state held (it was torch's UnpicklingError about a checkpoint: a review's case)."""
    try:
        got: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return got
    except Exception as exc:  # (pickle.UnpicklingError, or a RuntimeError of torch's)
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        what = f"a {found.group(1)}" if found else (str(exc).splitlines() or [type(exc).__name__])[0]
        raise BPSError(f"broadcast_optimizer_state: the root's optimizer state holds {what}, which is not "
                       f"broadcast (only tensors, numbers, strings, and lists, tuples and dicts of them are "
                       f"loaded from another process): keep such state out of the optimizer's state_dict, or "
                       f"convert it (e.g. a deque to a list)") from None


def _by_our_positions(state: dict[str, Any], theirs: list[list[str]], ours: list[list[str]],
                      our_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """``state`` (an optimizer's state_dict, by the positions of ``theirs``: each group's parameter names) with
    each parameter's state at its position in ``ours`` (and torch's labels, ``param_names``, those of
    ``our_groups``: an optimizer made from named parameters labels its state with them); BPSError where a group
    holds other names."""
    if len(theirs) != len(ours) or any(sorted(t) != sorted(o) for t, o in zip(theirs, ours)):
        raise BPSError(f"broadcast_optimizer_state: this process's optimizer groups its parameters otherwise than "
                       f"the root's ({[len(g) for g in ours]} parameters in its groups, the root "
                       f"{[len(g) for g in theirs]}): every group must hold the same named parameters")
    index = {name: i for i, name in enumerate(n for group in ours for n in group)}
    their_names = [n for group in theirs for n in group]
    groups = []
    for group, names, mine in zip(state["param_groups"], ours, our_groups):
        groups.append({**group, "params": [index[n] for n in names]})
        if "param_names" in mine:
            groups[-1]["param_names"] = list(mine["param_names"])
    return {"state": {index[their_names[i]]: v for i, v in state["state"].items()}, "param_groups": groups}


def _plain(value: Any) -> Any:
    """``value`` with numpy scalars and arrays (a schedule's learning rate) as Python numbers and tensors."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    return value


# -- the optimizer ------------------------------------------------------------------
DEFAULT_BUCKET_BYTES = 4 << 20
# Each parameter's hook of the DistributedOptimizer that wrapped it last (kept beside the parameter, not on it: an
# attribute on it would go along with a deepcopy or a pickle of the model).
_HOOKS: Any = WeakIdKeyDictionary()  # (by identity: a tensor's == is elementwise)
_OPTIMIZERS: weakref.WeakSet[DistributedOptimizer] = weakref.WeakSet()  # this process's, to explain a name clash


# The names of GradScaler's methods that call an optimizer's step() (see _scaler_unscaled).
_SCALER_METHODS = frozenset({"step", "_maybe_opt_step"})


class _Seen(NamedTuple):
    """A gradient as it was when its hook copied it into its bucket: the tensor and its version counter. Changed
    in place since (clipped) or replaced, it would be stepped with the sum of what it was, and the change lost
    on every process: :meth:`DistributedOptimizer.synchronize` refuses. Two attribute reads a parameter: a
    comparison of some of its elements as well cost half as much again as a whole step of a model of many small
    parameters. What torch does not count in ``_version`` goes unseen: writes through ``.data`` or numpy, and
    GradScaler's unscale kernel, which is caught where it matters instead (:func:`_scaler_unscaled`)."""

    grad: torch.Tensor | None
    version: int
    hooked: bool  # copied as backward produced it (not by synchronize(), which reads it after any unscale)

    @classmethod
    def of(cls, grad: torch.Tensor | None, hooked: bool = True) -> _Seen:
        return cls(grad, 0 if grad is None else grad._version, hooked)

    def changed(self, grad: torch.Tensor | None) -> bool:
        return grad is not self.grad or (grad is not None and grad._version != self.version)


class _GradientChanged(BPSError):
    """A gradient changed between backward() and the step (see :meth:`DistributedOptimizer.synchronize`);
    ``written``: the averages were written into ``.grad`` all the same."""

    def __init__(self, message: str, *, written: bool) -> None:
        super().__init__(message)
        self.written = written

    def _attributes(self) -> dict[str, Any]:
        return {"written": self.written}


def _scaler_unscaled(optimizer: object) -> bool:
    """Whether a torch GradScaler's ``step(optimizer)`` is calling ours after it unscaled the gradients in place
    (torch's documented AMP usage: ``scaler.step`` unscales first, and its kernel leaves ``_version`` alone): the
    frames above ``step()``, looked at once a step, all of them (only those of a method named as GradScaler's are
    read). Any number of wrappers may stand between: an LR scheduler's of ``optimizer.step``, a user's decorator;
    only the nearest four were looked at, and a second wrapper made the step silently apply the scaled gradients
    (1024 times too large, a review)."""
    frame = sys._getframe(1).f_back
    while frame is not None:
        if frame.f_code.co_name in _SCALER_METHODS:
            scaler = frame.f_locals.get("self")
            if isinstance(scaler, torch.amp.GradScaler):
                state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
                return getattr(state.get("stage"), "name", "") == "UNSCALED"
        frame = frame.f_back
    return False


def _unscaled_by_any_scaler(optimizer: object) -> bool:
    """Whether any live GradScaler unscaled ``optimizer``'s gradients since its last ``update()`` (its
    ``unscale_(optimizer)``, then our ``step()`` called directly, not through ``scaler.step``: no frame of it above
    us). Every object is looked at: only where a gradient changed (the error's path, once), never a step."""
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.amp.GradScaler):  # (not isinstance: a deprecated proxy's __class__ warns)
            state = getattr(obj, "_per_optimizer_states", {}).get(id(optimizer), {})
            if getattr(state.get("stage"), "name", "") == "UNSCALED":
                return True
    return False


def _unhook(params: list[torch.Tensor]) -> None:
    """The hooks that DistributedOptimizers put on ``params`` go."""
    for p in params:
        earlier = _HOOKS.pop(p, None)
        if earlier is not None:
            earlier.remove()


@dataclass(eq=False)
class _Bucket:
    """Gradients pushed together as one tensor: their elements one after another, then one presence
    flag per gradient (1 where this process has that gradient, 0 where not)."""

    name: str
    params: list[torch.Tensor]
    offsets: list[int]  # element offset of each gradient in the flat tensor
    numel: int  # elements of the gradients; the flags follow
    dtype: torch.dtype  # on the wire
    priority: int
    layout: str  # what every process's bucket of this name must hold (_bucket_layout)
    names: list[str]  # of the parameters
    filled: dict[int, _Seen] = field(default_factory=dict)  # the gradients already in the slot, by index
    slot: torch.Tensor | None = None  # the flat shared slot while it is being filled
    handle: _client.Handle | None = None

    @property
    def total(self) -> int:
        return self.numel + len(self.params)


def _bucket_layout(names: list[str], params: list[torch.Tensor]) -> str:
    """A bucket's ``Op.layout``: its number of parameters and a digest of their names, shapes and dtypes in
    order, so that two processes whose buckets of one name hold anything else disagree."""
    described = json.dumps([[n, list(p.shape), str(p.dtype)] for n, p in zip(names, params)])
    return f"{len(params)} params {hashlib.blake2b(described.encode(), digest_size=8).hexdigest()}"


_LISTED_PARAMS = 8  # a bucket mismatch names this many of the bucket's parameters
_BUCKET_RULE = ("every process must give the same parameters (names, shapes, dtypes) in the same order: that of "
                "named_parameters, or without it that of the optimizer's param groups; and the same bucket_bytes "
                "and compression")


def _holds(bucket: _Bucket, limit: int = _LISTED_PARAMS) -> str:
    """``bucket``'s first ``limit`` parameters as an error lists them (name, dtype, shape), and how many more."""
    listed = ", ".join(f"{n!r} {p.dtype} {tuple(p.shape)}" for n, p in zip(bucket.names[:limit], bucket.params))
    more = len(bucket.names) - limit
    return listed + (f" and {more} more" if more > 0 else "")


def _bucket_error(bucket: _Bucket, error: BPSError) -> BPSError:
    """A mismatch of a gradient bucket, with what makes the buckets of processes agree; where it is about
    ``bucket`` by name, also naming this process's parameters in it: the digest alone does not say which
    differ, and each process's error lists its own, so the user can compare two processes' errors. (A fused
    sum given up for a mismatch names no tensor: it may be about another bucket fused with this one.)"""
    if not isinstance(error, BPSMismatchError):
        return error
    if error.name != bucket.name:
        return BPSMismatchError(f"{error.detail}; {_BUCKET_RULE}", name=error.name, ours=error.ours,
                                theirs=error.theirs)
    detail = f"{error.detail}; this process's bucket {bucket.name!r} holds {_holds(bucket)}; {_BUCKET_RULE}"
    return BPSMismatchError(detail, name=error.name, ours=error.ours, theirs=error.theirs)


class _LayoutCheck:
    """Whether every process's DistributedOptimizer over these parameters made the same buckets: one small sum
    each step, sent before the first bucket, whose ``Op.layout`` is a digest of every bucket (name, contents and
    dtype, as a set: buckets of one parameter each agree in any order).

    Buckets are named after their first gradient: a process whose ``named_parameters`` come in another order
    (the same model, listed otherwise) makes buckets of other names, so its peers and it would wait for each
    other's names (stall: lines, for ever without ``stall_timeout``). The check's name is the same there (a
    digest of the parameters' names, in any order), its layout is not: every process gets a
    :class:`BPSMismatchError` at once, as DDP's constructor check gives one.

    Every step, as the buckets: a process that wraps its optimizer again, or a new process of a machine back
    from a crash, sends it when its peers do (once per optimizer, those were lone checks that nobody answered,
    and a later optimizer's check met them: a review's cases). It never holds a bucket back. ``synchronize``
    waits for the buckets, and meanwhile heeds the check's mismatch; then for the check, which every process
    sent before its buckets, but only a little where a bucket failed (processes whose names differ have no
    common check: their buckets tell)."""

    def __init__(self, buckets: list[_Bucket]) -> None:
        names = sorted(n for b in buckets for n in b.names)
        self.name = f"grad.layout.{hashlib.blake2b(chr(0).join(names).encode(), digest_size=6).hexdigest()}"
        described = json.dumps(sorted([b.name, b.layout, str(b.dtype)] for b in buckets))
        self.layout = (f"{len(names)} params in {len(buckets)} buckets "
                       f"{hashlib.blake2b(described.encode(), digest_size=8).hexdigest()}")
        self.handle: _client.Handle | None = None  # this step's
        # They differ: what later steps raise, pushing nothing, while a bucket given up then has not ended (its
        # name is in flight until its peers' come, or the timeout); then the next step checks again.
        self.error: BPSError | None = None
        self.stuck: list[_client.Handle] = []

    def blocking(self) -> BPSError | None:
        """``error``, where this step must push nothing and raise it (see there)."""
        if self.error is not None and all(h.done() for h in self.stuck):
            self.error, self.stuck = None, []
        return self.error

    def send(self) -> None:
        """Start this step's check (before the first bucket), sent at once (not left to fusion's cycle)."""
        if self.handle is not None:
            return
        try:
            self.handle = _adapter.start_filled(self.name, np.float32, (1,), _zero, average=False,
                                                layout=self.layout)
            _client.poll(self.handle)
        except BPSError:  # (still in flight from a step that failed: this step goes unchecked)
            self.handle = None

    def settle(self, buckets: list[_Bucket]) -> BPSMismatchError | None:
        """Wait for this step's buckets, or for the check's mismatch if it comes first; then for the check. Its
        mismatch, unless every bucket was summed (then they agree: the check met another optimizer's)."""
        handle, self.handle = self.handle, None
        if handle is None:
            return None
        started = [b.handle for b in buckets if b.handle is not None]
        for h in started:
            _client.poll(h)  # (one waiting in fusion's buffer goes now)
            while not h.wait(0.05) and not _mismatched(handle):
                pass
        summed = all(h.done() and h.error is None for h in started)
        if not _mismatched(handle):
            handle.wait(_adapter.settings().timeout if summed else LAYOUT_GRACE_S)
        if not handle.done():
            _adapter.abandon([handle])  # a bucket failed first, and the check may never come (other names)
            return None
        try:
            _adapter.finish_view(handle, 0)
        except BPSMismatchError as exc:
            _wait_for(lambda: all(h.done() for h in started), LAYOUT_GRACE_S)
            if all(h.done() and h.error is None for h in started):
                return None
            return BPSMismatchError(f"{exc.detail}: the processes' DistributedOptimizers over these parameters "
                                    f"made different gradient buckets; {_listed(buckets)}; {_BUCKET_RULE}",
                                    name=exc.name, ours=exc.ours, theirs=exc.theirs)
        except BPSError:
            pass  # (a timeout, a lost peer: the buckets' own errors say it)
        return None


LAYOUT_GRACE_S = 2.0  # after a layout mismatch or a failed bucket: how long buckets, or the check, are waited for


def _mismatched(handle: _client.Handle) -> bool:
    return handle.done() and isinstance(handle.error, BPSMismatchError)


def _wait_for(ended: Callable[[], bool], timeout: float) -> None:
    """Poll ``ended`` (1 ms, doubling to 50 ms) until it is true or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not ended() and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _listed(buckets: list[_Bucket]) -> str:
    """This process's buckets and their parameters, in order (at most ``_LISTED_PARAMS`` parameters)."""
    parts, left = [], _LISTED_PARAMS
    for b in buckets:
        if left <= 0:
            break
        parts.append(f"{b.name!r} holds {_holds(b, left)}")
        left -= len(b.names)
    more = len(buckets) - len(parts)
    return f"this process's buckets: {'; '.join(parts)}" + (f"; and {more} more" if more > 0 else "")


def _zero(view: np.ndarray) -> None:
    view[...] = 0


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that ``step()`` applies gradients averaged over every process.

    ``named_parameters`` names the gradients on the wire (identical on every process) and gives their
    order, so processes may list the optimizer's parameters in other orders; without it parameters are
    named by their position in the optimizer's param groups, which must then be the same everywhere.

    Gradients travel in buckets (tensor fusion, as in Horovod and DDP): parameters are taken in
    reverse declaration order (of ``named_parameters``: about the order backward produces their
    gradients) and packed into buckets of at least ``bucket_bytes`` (on the wire); a bucket's
    push_pull starts as soon as its last gradient is ready. Each gradient is copied into the bucket's
    shared-memory slot when it is ready, and the average is copied from the slot into ``.grad``.
    ``bucket_bytes=0`` pushes every gradient on its own. Every process must use the same
    ``bucket_bytes`` (a different one is a mismatch error naming the bucket).

    ``step(closure)``: the closure (zero the gradients, forward, backward, return the loss) runs inside the wrapped
    optimizer's step, and its gradients are averaged before that optimizer reads them, at each evaluation (LBFGS
    evaluates several times a step). The loss it returns is this process's own: an optimizer that decides from it
    (LBFGS's line search and tolerances) must see the same on every process, or processes evaluate different
    numbers of times and their sums pair different evaluations; return the average from the closure
    (``bps.push_pull(loss.detach(), "loss")``), as under DDP.

    ``asynchronous=True``: parameter-server training (:mod:`bps_worker.torch_async`). No gradient is
    pushed; ``step()`` steps the wrapped optimizer on this process's own gradients, pushes each bucket's
    ``new - old`` parameters and takes the servers' value back. ``staleness=s`` keeps every machine within
    ``s`` steps of the slowest (``None``: unbounded); ``broadcast_parameters`` initialises the values.
    """

    # GradScaler steps an optimizer that says it supports AMP scaling (a fused one: SGD/Adam/AdamW(fused=True))
    # without unscaling it, handing it grad_scale and found_inf to unscale and skip inf steps in its kernel. Read
    # through __getattr__ from the wrapped one, that was True: the scaler set them on us, the wrapped kernel never
    # saw them, and it stepped with the scaled gradients (1024 times too large), inf steps included, silently (a
    # review). Ours is no such optimizer: the scaler unscales first (after synchronize(), the documented recipe),
    # on the averaged gradients, so that every process skips the same steps.
    _step_supports_amp_scaling = False

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, Any]] | None = None,
                 compression: _Compressor = Compression.none, backward_passes_per_step: int = 1, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, asynchronous: bool = False,
                 staleness: int | None = None) -> None:
        # The wrapped optimizer owns param_groups, state and defaults; we share them (no copy).
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise BPSError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise BPSError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        if not isinstance(compression, _Compressor):
            raise BPSError(f"compression must be one of Compression.none/fp16/bf16, got {compression!r}")
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 0:
            raise BPSError(f"bucket_bytes must be an integer >= 0, got {bucket_bytes!r}")
        self.optimizer = optimizer
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.bucket_bytes = bucket_bytes
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._groups = self._groups_now()  # (see _check_groups)
        self._positional = named_parameters is None
        self._names = self._resolve_names(named_parameters)  # (in the order buckets take them)
        self._buckets = self._make_buckets()
        self._bucket_of = {p: (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._layout = _LayoutCheck(self._buckets) if self._buckets and not asynchronous else None
        self._passes: dict[torch.Tensor, int] = {}
        self._synchronized = False
        self._skip_sync = False
        self._async: _async.AsyncParameters | None = None
        if asynchronous:
            if compression is not Compression.none:
                raise BPSError("asynchronous mode pushes parameter deltas in the parameters' dtype; "
                               "compression is for gradients")
            self._async = _async.AsyncParameters([(n, p) for p, n in self._names.items()], bucket_bytes,
                                                 staleness)
        elif staleness is not None:
            raise BPSError("staleness is a bound of asynchronous mode; pass asynchronous=True with it")
        # A second wrap round the same parameters replaces the first, in either mode (see _hook).
        if asynchronous:
            _unhook(self._params)
        else:
            _async.release(self._params)
        self._hooks = [self._hook(p) for p in self._params if p.requires_grad and not asynchronous]
        # Optimizer parameters frozen when wrapped: in no bucket (see synchronize).
        self._unbucketed = [p for p in self._params if p not in self._bucket_of]
        _OPTIMIZERS.add(self)

    def _hook(self, p: torch.Tensor) -> Any:
        """Our hook on ``p``; the hook of a DistributedOptimizer that wrapped it before goes (a second training
        phase wraps a new optimizer round the same model: two hooks would push each gradient twice; an
        asynchronous optimizer has none, and the synchronous one's would push every gradient to no one)."""
        _unhook([p])
        handle = p.register_post_accumulate_grad_hook(self._grad_ready)
        _HOOKS[p] = handle
        return handle

    def _wire_dtype(self, p: torch.Tensor) -> torch.dtype:
        wire = self.compression.wire_dtype
        dtype = wire if wire is not None and p.is_floating_point() else p.dtype
        if dtype not in _NUMPY_OF:
            raise BPSError(f"parameter {self._names[p]!r} has dtype {p.dtype}, which cannot be summed; supported: "
                           f"float32, float64, float16, bfloat16")
        return dtype

    def _make_buckets(self) -> list[_Bucket]:
        """Buckets in reverse declaration order (of ``_names``); front layers get the highest priority (their sums
        come back first, as the next forward pass needs them first)."""
        position = {p: i for i, p in enumerate(self._names)}
        buckets: list[_Bucket] = []
        group: list[torch.Tensor] = []
        nbytes = 0

        def close() -> None:
            nonlocal group, nbytes
            if group:
                offsets, numel = [], 0
                for p in group:
                    offsets.append(numel)
                    numel += p.numel()
                front = min(position[p] for p in group)
                # Named after its first gradient. The same name with other contents on another process (other
                # parameters, shapes or dtypes, in another order, or a different bucket_bytes) is a mismatch
                # error: the daemons compare the layout, a digest of the contents. An order that starts the
                # bucket with another gradient names it otherwise: the processes then wait for each other's
                # names, as for any names that differ (stall: lines; an error with cluster.stall_timeout).
                names = [self._names[p] for p in group]
                buckets.append(_Bucket(f"grad.{names[0]}", group, offsets, numel, self._wire_dtype(group[0]),
                                       -front, _bucket_layout(names, group), names))
            group, nbytes = [], 0

        for p in reversed(self._names):
            if not p.requires_grad:
                continue
            if group and self._wire_dtype(p) != self._wire_dtype(group[0]):
                close()
            group.append(p)
            nbytes += p.numel() * self._wire_dtype(p).itemsize
            if nbytes >= self.bucket_bytes:
                close()
        close()
        return buckets

    # Optimizer API, delegated --------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise BPSError("add_param_group() after wrapping is not supported: wrap the optimizer once it has all "
                       "its parameters")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, compression={self.compression!r})"

    def __getattr__(self, name: str) -> Any:
        # Anything else an optimizer offers (hooks, custom attributes) comes from the wrapped one.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def names_in_groups(self) -> list[list[str]] | None:
        """Each parameter group's parameter names, in the group's order (None: named by position, where every
        process's order is the same)."""
        if self._positional:
            return None
        return [[self._names[p] for p in group["params"]] for group in self.optimizer.param_groups]

    # Gradients ----------------------------------------------------------------------
    def _resolve_names(self, named_parameters: Iterable[tuple[str, Any]] | None) -> dict[torch.Tensor, str]:
        """Each optimizer parameter's name on the wire, in the order buckets take them: that of
        ``named_parameters`` where it is given, not that of the optimizer's param groups. Every process must
        cut the same buckets, and processes may well list the optimizer's parameters in other orders (groups
        built from a set, or by a rank's role), as Horovod allows since it names each gradient alone;
        ``model.named_parameters()`` is the model's declaration order on every process, about the order backward
        produces the gradients in (reversed), which the buckets need to start early. Without names, the
        position in the optimizer is the name, and the order."""
        if named_parameters is None:
            return {p: str(i) for i, p in enumerate(self._params)}
        pairs = list(named_parameters)
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
                raise BPSError("named_parameters must yield (name, parameter) pairs, as model.named_parameters() does")
        names = [n for n, _ in pairs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise BPSError(f"named_parameters has duplicate names: {', '.join(dup)}")
        by_param = {p: n for n, p in pairs}
        missing = [i for i, p in enumerate(self._params) if p not in by_param]
        if missing:
            shapes = ", ".join(f"#{i} {tuple(self._params[i].shape)}" for i in missing[:5])
            raise BPSError(f"{len(missing)} optimizer parameters are missing from named_parameters ({shapes}); "
                           f"pass the model's named_parameters() for every parameter the optimizer updates")
        mine = dict.fromkeys(self._params)  # (by identity: a tensor hashes by id, and dicts try `is` first)
        return {p: by_param[p] for _, p in pairs if p in mine}

    def _grad_ready(self, p: torch.Tensor) -> None:
        count = self._passes.get(p, 0) + 1
        self._passes[p] = count
        if count < self.backward_passes_per_step:
            return
        if self._layout is not None and self._layout.blocking() is not None:
            return  # the processes' buckets differ: nothing is filled or pushed (synchronize raises it)
        bucket, index = self._bucket_of[p]
        if count > self.backward_passes_per_step or bucket.handle is not None:
            if index in bucket.filled:  # this error reports the change: step() applies the sum as handed over
                bucket.filled[index] = _Seen.of(p.grad)
            raise BPSError(f"gradient {self._names[p]!r} was produced more than backward_passes_per_step = "
                           f"{self.backward_passes_per_step} times before step(); call step() or synchronize()")
        try:
            self._fill(bucket, index, p.grad)
            if len(bucket.filled) == len(bucket.params):
                self._start(bucket)
        except BPSError:  # (a sparse gradient, a clash, a daemon gone): backward ends here, and so does this pass
            self._drop_pass()
            raise
        self._synchronized = False

    def _fill(self, bucket: _Bucket, index: int, grad: torch.Tensor | None, hooked: bool = True) -> None:
        """Copy one gradient (cast for the wire) into the bucket's slot, or zeros where this process has none."""
        if bucket.slot is None:
            # Before the slot is touched: another optimizer's bucket of this name is filled into it, or read from it
            # in flight (two optimizers named by position: a review's case wrote over the other's gradients, then
            # failed "already in flight").
            clash = self._clash(bucket)
            if clash is not None:
                raise clash
            view = _adapter.shared_slot(bucket.name, (bucket.total,), _numpy_of(bucket.dtype))
            bucket.slot = _from_numpy(view)
        p = bucket.params[index]
        if grad is not None and grad.layout != torch.strided:
            raise BPSError(f"parameter {self._names[p]!r} has a {grad.layout} gradient; DistributedOptimizer sums "
                           f"dense gradients (for nn.Embedding, sparse=False)")
        part = bucket.slot[bucket.offsets[index]:bucket.offsets[index] + p.numel()]
        with torch.no_grad():
            if grad is None:
                part.zero_()
            else:
                part.copy_(grad.detach().reshape(-1))
        bucket.slot[bucket.numel + index] = 0.0 if grad is None else 1.0
        bucket.filled[index] = _Seen.of(grad, hooked)

    def _drop_pass(self) -> None:
        """Forget this pass's gradients: every bucket emptied, the sums of those that started drained (bounded by the
        timeout; where _start or _finish_all failed part-way, or backward raised, their rounds must not stay in
        flight: the next zero_grad() said "gradients are being summed" at every later step, a review's case)."""
        for bucket in self._buckets:
            bucket.filled.clear()
            bucket.slot = None
            if bucket.handle is not None:
                with contextlib.suppress(BPSError):
                    _adapter.finish_view(bucket.handle, _adapter.settings().timeout)
                bucket.handle = None
        self._passes.clear()

    def _clash(self, bucket: _Bucket) -> BPSError | None:
        """Where another DistributedOptimizer of this process is filling or summing a bucket of the same name (its
        shared slot, which is the name's), the error that says how to name them apart."""
        busy = [o for o in _OPTIMIZERS if o is not self and any(
            b.name == bucket.name and (b.handle is not None or b.filled) for b in o._buckets)]
        if not busy:
            return None
        how = ("pass named_parameters to each (e.g. model.named_parameters()): without it a gradient is named by "
               "its position in its optimizer, the same in every optimizer" if self._positional else
               "give each optimizer's parameters their own names (named_parameters with a prefix, e.g. "
               "[('critic.' + n, p) for n, p in ...])")
        return BPSError(f"gradient bucket {bucket.name!r} is in use by another DistributedOptimizer of this "
                        f"process: {how}")

    def _start(self, bucket: _Bucket) -> None:
        bucket.slot = None  # no reference to the slot outlives the push (it may move, or close at shutdown)
        if self._layout is not None:
            self._layout.send()
        # the gradients are in the slot already (_fill wrote them through shared_slot)
        bucket.handle = _adapter.start_filled(bucket.name, _numpy_of(bucket.dtype), (bucket.total,), average=True,
                                              priority=bucket.priority, layout=bucket.layout)

    def _groups_now(self) -> list[tuple[torch.Tensor, ...]]:
        return [tuple(group["params"]) for group in self.optimizer.param_groups]

    def _check_groups(self) -> None:
        """The wrapped optimizer has the parameters it had when wrapped: one added since (its own
        ``add_param_group``, a group appended to ``param_groups``) or put in another's place (a re-initialised
        layer's) would be stepped with this process's own gradient, unlike the others (the models drift apart, no
        error: two reviews' cases; counting them per group missed the one put in another's place). Compared by
        identity, in C: well under a microsecond a parameter, a step."""
        groups = self.optimizer.param_groups
        if len(groups) == len(self._groups) and all(
                len(group["params"]) == len(known) and all(map(operator.is_, group["params"], known))
                for group, known in zip(groups, self._groups)):
            return
        known_params = dict.fromkeys(self._params)
        new = [p for group in groups for p in group["params"] if p not in known_params]
        raise BPSError(f"the wrapped optimizer's parameters changed after DistributedOptimizer wrapped it "
                       f"({len(new)} new, e.g. of shape {tuple(new[0].shape) if new else '?'}: a param group "
                       f"added to it, or parameters appended to one or put in another's place): they would be "
                       f"stepped with this process's own gradient. Wrap the optimizer once it has all its "
                       f"parameters (again after replacing any)")

    def synchronize(self) -> None:
        """Wait for every gradient of this step and write the averages into ``.grad``.

        Every process takes part for every parameter: buckets whose gradients this process does not
        all have (or has only partly accumulated) are pushed now, before any wait, with zeros for the
        missing ones, so that no two processes wait for each other.

        A gradient changed since backward handed it over (clipped, replaced: see :class:`_Seen`) is a
        BPSError (:class:`_GradientChanged`), once every sum has come back: its change is lost. The averages are
        written all the same, as every other process has them (``written``), so that a caller that catches the
        error and goes on (a guard that zeroed a bad batch's gradients on one process only) keeps the replicas
        identical; its ``step()`` steps with them before it raises. Where GradScaler's ``step()`` unscaled them
        (its documented usage without our recipe: the sums are of the scaled gradients) nothing is written:
        every process uses its scaler alike, and none steps.
        """
        if self._async is not None:
            self._check_groups()
            return  # nothing to wait for: every gradient stays here
        try:
            self._check_groups()  # (in here: the buckets already started are drained all the same)
            blocking = self._layout.blocking() if self._layout is not None else None
            if blocking is not None:
                raise blocking  # (the hooks started nothing)
            self._start_rest()
            self._check_layout()
            changed = self._changed_gradient()
            first_error = self._finish_all(write=changed is None or changed.written) or changed
        finally:
            self._drop_pass()
        if first_error is not None:
            if first_error is changed and changed.written:
                self._synchronized = True  # (the averages are in .grad, as after a synchronize that succeeded)
            raise first_error
        late = [self._names[p] for p in self._unbucketed if p.requires_grad and p.grad is not None]
        if late:  # it would be stepped with this process's own gradient, unlike the others: never silently
            raise BPSError(f"parameter {late[0]!r} has a gradient but did not require one when this "
                           f"DistributedOptimizer was made ({len(late)} such): wrap the optimizer again after "
                           f"unfreezing parameters")
        self._synchronized = True

    def _check_layout(self) -> None:
        """Where the processes' buckets differ (:class:`_LayoutCheck`): raise at once, with a bucket's own mismatch
        (it names the bucket) or else the check's, every bucket of this pass given up unwaited (those whose names
        differ would wait for the timeout); the next steps raise it too while one of those is in flight."""
        layout = self._layout
        if layout is None:
            return
        mismatch = layout.settle(self._buckets)
        if mismatch is None:
            return
        layout.error = next((_bucket_error(b, b.handle.error) for b in self._buckets if b.handle is not None
                             and b.handle.done() and isinstance(b.handle.error, BPSMismatchError)), mismatch)
        started = [b.handle for b in self._buckets if b.handle is not None]
        layout.stuck = [h for h in started if not h.done()]
        for bucket in self._buckets:
            bucket.handle = None
        _adapter.abandon(started)
        raise layout.error

    def _start_rest(self) -> None:
        """Start every bucket not started yet, its missing gradients taken as they are now."""
        for bucket in self._buckets:
            if bucket.handle is not None:
                continue
            for index, p in enumerate(bucket.params):
                if index not in bucket.filled:  # (a gradient set without backward, e.g. torch.func's: summed)
                    self._fill(bucket, index, p.grad, hooked=False)
            self._start(bucket)

    def _changed_gradient(self) -> _GradientChanged | None:
        """The error for the first gradient that changed since it was copied (see :class:`_Seen`), if any."""
        changed = hooked = None
        for bucket in self._buckets:
            for index, seen in bucket.filled.items():
                if seen.changed(bucket.params[index].grad):
                    changed = changed or bucket.names[index]
                if seen.hooked:
                    hooked = hooked or bucket.names[index]
        # GradScaler's step() after its unscale (copied before it: scaled sums) is never stepped over, whatever else
        # changed too: torch's own AMP recipe clips after unscale_, and stepping its sums moved the weights 1024
        # times too far (a review of the first version, which asked the scaler only where nothing else changed).
        unscaled = hooked is not None and _scaler_unscaled(self)
        if unscaled and changed is None:
            changed = hooked
        elif changed is not None and not unscaled:  # (unscale_ and a clip, then our step() called directly)
            unscaled = _unscaled_by_any_scaler(self)
        if changed is None:
            return None
        if unscaled:
            what = "unscaled by GradScaler's step(); the sums are of the scaled gradients, so nothing was stepped"
        else:
            what = ("e.g. clipped, zeroed or replaced; the averages of the gradients as backward produced them were "
                    "written over the change, as every other process has them, and step() applies them")
        return _GradientChanged(
            f"the gradient of parameter {changed!r} changed after backward() handed it to DistributedOptimizer "
            f"({what}). Call optimizer.synchronize() before changing gradients, then step() inside "
            f"optimizer.skip_synchronize() (with a GradScaler: synchronize(), scaler.unscale_(optimizer), then "
            f"scaler.step(optimizer) inside it)", written=not unscaled)

    def _finish_all(self, *, write: bool) -> BPSError | None:
        """Wait for every bucket's sum; with ``write``, and until an error, the averages into ``.grad``; the
        first error."""
        first_error: BPSError | None = None
        for bucket in self._buckets:
            handle, bucket.handle = bucket.handle, None
            if handle is None:
                continue
            try:
                # the sum in the bucket's shared slot: read in place, copied once into each .grad.
                # After an error (a mismatch: then other buckets may never complete), wait at most
                # the timeout for each of the rest.
                wait = None if first_error is None else _adapter.settings().timeout
                out = _adapter.finish_view(handle, wait)
            except BPSError as exc:
                # Keep draining: every handle must be consumed, or its name stays "in flight"
                # and every later step fails. The first error is raised once all are done.
                first_error = first_error or _bucket_error(bucket, exc)
                continue
            if first_error is None and write:
                self._write_grads(bucket, _from_numpy(out))
            del out
        return first_error

    @staticmethod
    def _write_grads(bucket: _Bucket, flat: torch.Tensor) -> None:
        present = flat[bucket.numel:].tolist()
        with torch.no_grad():
            for index, p in enumerate(bucket.params):
                if present[index] == 0:
                    continue  # no process had this gradient: leave .grad as it is (None after zero_grad)
                start = bucket.offsets[index]
                average = flat[start:start + p.numel()].view(p.shape)
                if p.grad is None:
                    p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
                p.grad.copy_(average)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not synchronize (you called ``synchronize()`` already)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure: Any = None) -> Any:
        if self._async is not None:
            self._check_groups()
            if not self._async.initialised:
                self._async.init(0)
            loss = self.optimizer.step(closure)
            self._async.push()
            return loss
        if closure is not None:  # (the gradients are the closure's: it evaluates the model inside the step)
            if any(bucket.filled for bucket in self._buckets):  # a backward before it: its sums are drained first
                self.synchronize()
            try:
                return self.optimizer.step(self._averaging(closure))
            finally:
                self._synchronized = False
        if not self._skip_sync:
            try:
                self.synchronize()
            except _GradientChanged as exc:
                if exc.written:  # as every other process steps (see synchronize)
                    self._synchronized = False
                    self.optimizer.step()
                raise
        elif not self._synchronized:
            raise BPSError("step() inside skip_synchronize() without a synchronize() call before it")
        self._synchronized = False
        return self.optimizer.step()

    def _averaging(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (it zeroes the gradients, runs forward and backward, returns the loss), followed by
        :meth:`synchronize`: the wrapped optimizer reads each evaluation's gradients averaged, as DDP gives them
        (LBFGS evaluates several times a step; its loss is this process's own, as under DDP). Before, the averages
        were taken before the closure ran, and each process stepped on its own gradients, silently (a review)."""
        def evaluate() -> Any:
            try:
                loss = closure()
            except BaseException:
                # Where it raised (before or after backward), this process still takes part in the sums its peers
                # wait for (zeros for what it lacks), and none is left in flight to refuse the next step's zero_grad().
                with contextlib.suppress(BPSError):
                    self.synchronize()
                raise
            self.synchronize()
            return loss
        return evaluate

    def zero_grad(self, set_to_none: bool = True) -> None:
        busy = sum(len(b.filled) for b in self._buckets)
        if busy:
            raise BPSError(f"zero_grad() while {busy} gradients are being summed; call step() or "
                           f"synchronize() first")
        self.optimizer.zero_grad(set_to_none=set_to_none)
