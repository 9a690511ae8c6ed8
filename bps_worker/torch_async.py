"""Asynchronous training for the PyTorch layer: ``DistributedOptimizer(..., asynchronous=True)``.

The servers hold the parameters (``bps_worker.client.async_init``). Each ``step()`` lets the wrapped
optimizer step locally on this process's own gradients, pushes ``new - old`` per bucket of parameters
(``async_push_pull``: added at once, no barrier) and copies the value that comes back into the parameters;
``old`` is that value. So every process's every step is in the servers' value once, and a slow process
holds the others back only as far as ``staleness`` says (``None``: not at all).

Buckets are as for gradients (parameters in reverse declaration order, at least ``bucket_bytes`` each, one
dtype per bucket), named ``param.<first parameter>``. :func:`~bps_worker.torch.broadcast_parameters`
initialises them from the root's parameters (after its broadcast); a first ``step()`` before that
initialises them from rank 0's.

A DistributedOptimizer made later over the same parameters, in either mode (a second training phase), replaces
this one: an asynchronous one with the same buckets goes on from their values, as the servers' are initialised
once per job; the replaced one refuses any use, as two optimizers pushing one model's deltas would add them twice.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .client import BPSError, Handle
from .client import adapter as _adapter
from .client.arguments import check_staleness
from .client import synchronize as _synchronize

_CREATED = itertools.count()  # the order of AsyncParameters made in this process
_LIVE: weakref.WeakSet[AsyncParameters] = weakref.WeakSet()  # initialised by broadcast_parameters

_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16}  # (numpy's bfloat16: ml_dtypes')


@dataclass(eq=False)
class _Bucket:
    name: str
    params: list[torch.Tensor]
    dtype: torch.dtype
    old: np.ndarray | None = None  # the value last received: what this process's parameters hold


class AsyncParameters:
    """The asynchronous buckets of one optimizer's parameters (see the module docstring)."""

    def __init__(self, params: list[tuple[str, torch.Tensor]], bucket_bytes: int, staleness: int | None) -> None:
        bound = check_staleness(staleness)  # (any integer type, as numpy's)
        for name, p in params:
            if p.dtype not in _DTYPES:
                raise BPSError(f"parameter {name!r} has dtype {p.dtype}; asynchronous mode holds float32, float64, "
                               f"float16 and bfloat16 parameters")
        self.staleness = None if bound < 0 else bound
        self.buckets = _buckets(params, bucket_bytes)
        self._initialised_on: weakref.ref[object] | None = None  # the connection its init ran on (initialised)
        self.replaced = False  # by a newer AsyncParameters (or a synchronous optimizer) over the same parameters
        earlier = [o for o in _LIVE if o.overlaps(self)]
        for other in earlier:
            self._check_replaces(other)
        for other in earlier:  # a wrap again round the very same parameters; a partial overlap (a shared trunk
            if _ids(other) == _ids(self):  # under other names) leaves both as they were
                self._take_over(other)
        self.created = next(_CREATED)
        _LIVE.add(self)

    def overlaps(self, other: AsyncParameters) -> bool:
        """Whether the two hold a bucket name or a parameter in common."""
        return bool({b.name for b in self.buckets} & {b.name for b in other.buckets}) or bool(
            _ids(self) & _ids(other))

    def _check_replaces(self, other: AsyncParameters) -> None:
        """A BPSError unless this may replace ``other`` (:meth:`_take_over`): a bucket name of ``other``'s on
        other parameters (the servers hold one value per name, and a second model's would take the first one's),
        or on the same parameters in other buckets (the servers keep each bucket as its init made it)."""
        taken = sorted({b.name for b in self.buckets} & {b.name for b in other.buckets})
        if taken and not _ids(self) & _ids(other):
            raise BPSError(f"asynchronous bucket {taken[0]!r} is already held by another asynchronous "
                           f"optimizer in this process: give each model's parameters their own names "
                           f"(named_parameters with a prefix, e.g. [('critic.' + n, p) for n, p in ...])")
        if taken and (_layout(self) != _layout(other) or self.staleness != other.staleness):
            raise BPSError(f"asynchronous bucket {taken[0]!r} is held by an earlier asynchronous optimizer over "
                           f"these parameters, with other contents or staleness: the servers keep each bucket as "
                           f"its init made it, so wrap them again with the same named_parameters, bucket_bytes "
                           f"and staleness")

    def _take_over(self, other: AsyncParameters) -> None:
        """Replace ``other``, made before over some of the same parameters (a second training phase wraps a new
        optimizer round the same model): where its buckets are ours, their values and whether they were
        initialised go on here (an init again would be a second init of the names in this job); ``other``
        refuses any later use."""
        if _layout(self) == _layout(other):
            for mine, theirs in zip(self.buckets, other.buckets):
                mine.old = theirs.old
            self._initialised_on = other._initialised_on
        other.retire()

    @property
    def initialised(self) -> bool:
        """Whether :meth:`init` ran on the process's connection now. After ``shutdown()`` and ``init()`` (a
        restarted worker daemon, a rejoin) it runs again: a process that rejoins takes the job's values as they
        are, as the numpy client's ``async_init`` does. Before, the flag outlived the connection: every step
        failed ("async_push_pull before async_init") and broadcast_parameters was refused, for good (a review)."""
        conn = _adapter.connection()
        return conn is not None and self._initialised_on is not None and self._initialised_on() is conn

    def retire(self) -> None:
        """Replaced: out of ``init_all``, and every later use a BPSError (see :meth:`_take_over`)."""
        self.replaced = True
        _LIVE.discard(self)

    def init(self, root_rank: int) -> None:
        """Make every bucket's value ``root_rank``'s parameters (or the job's value, for a process that
        rejoins), and take it as this process's parameters."""
        self._check_current()
        self._start_all(lambda b: _adapter.start_async_init(_flat(b), b.name, root_rank, self.staleness))
        conn = _adapter.connection()
        self._initialised_on = None if conn is None else weakref.ref(conn)

    def push(self) -> None:
        """Push every bucket's ``new - old``; the values that come back become the parameters."""
        self._check_current()

        def start(b: _Bucket) -> Handle:
            assert b.old is not None  # set by init
            return _adapter.start_async(_flat(b) - b.old, b.name)

        self._start_all(start)

    def _check_current(self) -> None:
        if self.replaced:
            raise BPSError("this asynchronous DistributedOptimizer was replaced by a DistributedOptimizer made "
                           "later over the same parameters: step that one")

    def _start_all(self, start: Callable[[_Bucket], Handle]) -> None:
        """``start`` every bucket's operation, then :meth:`_settle` them. Where a start fails part-way (over the
        arena's cap), those already started are settled all the same before its error is raised: left in flight,
        their names would fail every later step; and their values must be taken, as their deltas are in the
        servers' value. The buckets not started keep their parameters: their deltas go with the next push."""
        handles: list[Handle] = []
        try:
            for b in self.buckets:
                handles.append(start(b))
        except BaseException:
            with contextlib.suppress(BPSError):
                self._settle(handles)
            raise
        self._settle(handles)

    def _settle(self, handles: list[Handle]) -> None:
        """Wait for every handle (all of them, so that no name stays in flight); the values into the
        parameters; then the first failure, if any. ``handles`` are those of the first buckets (of them all,
        but after a failed start). A bucket whose push failed goes back to its last value: its delta may or
        may not be in the servers' value (an answer can fail after the delta was added), and kept in the
        parameters it would be pushed again, inside the next step's ``new - old``."""
        first: BPSError | None = None
        for b, handle in zip(self.buckets, handles):
            try:
                value = _synchronize(handle)
            except BPSError as exc:
                first = first or exc
                if b.old is not None:
                    _unflatten(b, b.old)
                continue
            b.old = value
            _unflatten(b, value)
        if first is not None:
            raise first


def init_all(root_rank: int) -> None:
    """``broadcast_parameters``'s part: every asynchronous optimizer of this process not initialised yet initialises
    its values, in the order they were made (the same on every process: a set's order would differ, and two
    processes each waiting in another optimizer's init would wait for ever)."""
    for params in sorted(_LIVE, key=lambda p: p.created):
        if not params.initialised:
            params.init(root_rank)


def check_broadcast(tensors: list[torch.Tensor]) -> None:
    """Before ``broadcast_parameters`` of ``tensors``: none may be a parameter of an asynchronous optimizer whose
    values the servers hold already (initialised). A job's values are set once (a process that rejoins takes them
    as they are): the broadcast wrote the root's tensors, then the init again wrote the servers' values over them
    (a checkpoint restored on the root mid-job was silently lost, a review's case). Compared by memory: a
    state_dict's tensors are other objects over the parameters' storage."""
    where = {(t.device, t.data_ptr()) for t in tensors if t.numel()}
    for params in _LIVE:
        if params.initialised and any((p.device, p.data_ptr()) in where for b in params.buckets for p in b.params):
            raise BPSError("broadcast_parameters of parameters whose asynchronous values the servers hold already "
                           "(set by an earlier broadcast_parameters or step() in this job): a job's values are set "
                           "once, and a process that rejoins takes them as they are. Restore a checkpoint before "
                           "the first broadcast_parameters, or start a new job")


def release(params: list[torch.Tensor]) -> None:
    """A synchronous DistributedOptimizer over ``params``: every asynchronous one holding any of them is replaced
    (see :meth:`AsyncParameters._take_over`)."""
    ids = {id(p) for p in params}
    for other in [o for o in _LIVE if _ids(o) & ids]:
        other.retire()


def _ids(params: AsyncParameters) -> set[int]:
    """The identities of the parameters (a tensor's ``==`` is elementwise); all alive while ``params`` is."""
    return {id(p) for b in params.buckets for p in b.params}


def _layout(params: AsyncParameters) -> list[tuple[str, list[int], torch.dtype]]:
    """Each bucket's name, parameters (by identity) and dtype."""
    return [(b.name, [id(p) for p in b.params], b.dtype) for b in params.buckets]


def _buckets(params: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[_Bucket]:
    """Parameters in reverse declaration order, cut into buckets of ``bucket_bytes`` and one dtype."""
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    nbytes = 0
    for name, p in reversed(params):
        if groups[-1] and (p.dtype != groups[-1][0][1].dtype or nbytes >= bucket_bytes):
            groups.append([])
            nbytes = 0
        groups[-1].append((name, p))
        nbytes += p.numel() * p.element_size()
    return [_Bucket(f"param.{g[0][0]}", [p for _, p in g], g[0][1].dtype) for g in groups if g]


def _flat(bucket: _Bucket) -> np.ndarray:
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).to("cpu") for p in bucket.params])
    from .torch import _to_numpy  # (not at import: bps_worker.torch imports this module)

    return _to_numpy(flat)


def _unflatten(bucket: _Bucket, value: np.ndarray) -> None:
    from .torch import _from_numpy

    flat = _from_numpy(value)
    offset = 0
    with torch.no_grad():
        for p in bucket.params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view(p.shape))
            offset += n
