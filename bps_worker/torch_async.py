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
from .client import synchronize as _synchronize

_CREATED = itertools.count()  # the order of AsyncParameters made in this process
_LIVE: weakref.WeakSet[AsyncParameters] = weakref.WeakSet()  # initialised by broadcast_parameters

_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


@dataclass(eq=False)
class _Bucket:
    name: str
    params: list[torch.Tensor]
    dtype: torch.dtype
    old: np.ndarray | None = None  # the value last received: what this process's parameters hold


class AsyncParameters:
    """The asynchronous buckets of one optimizer's parameters (see the module docstring)."""

    def __init__(self, params: list[tuple[str, torch.Tensor]], bucket_bytes: int, staleness: int | None) -> None:
        if staleness is not None and (not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0):
            raise BPSError(f"staleness must be None or an integer >= 0, got {staleness!r}")
        for name, p in params:
            if p.dtype not in _DTYPES:
                raise BPSError(f"parameter {name!r} has dtype {p.dtype}; asynchronous mode holds float32, float64 "
                               f"and float16 parameters")
        self.staleness = staleness
        self.buckets = _buckets(params, bucket_bytes)
        taken = {b.name for other in _LIVE for b in other.buckets} & {b.name for b in self.buckets}
        if taken:  # the servers hold one value per name: a second model's would take the first one's
            raise BPSError(f"asynchronous bucket {sorted(taken)[0]!r} is already held by another asynchronous "
                           f"optimizer in this process: give each model's parameters their own names "
                           f"(named_parameters with a prefix, e.g. [('critic.' + n, p) for n, p in ...])")
        self.initialised = False
        self.created = next(_CREATED)
        _LIVE.add(self)

    def init(self, root_rank: int) -> None:
        """Make every bucket's value ``root_rank``'s parameters (or the job's value, for a process that
        rejoins), and take it as this process's parameters."""
        self._start_all(lambda b: _adapter.start_async_init(_flat(b), b.name, root_rank, self.staleness))
        self.initialised = True

    def push(self) -> None:
        """Push every bucket's ``new - old``; the values that come back become the parameters."""
        def start(b: _Bucket) -> Handle:
            assert b.old is not None  # set by init
            return _adapter.start_async(_flat(b) - b.old, b.name)

        self._start_all(start)

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
    """``broadcast_parameters``'s part: every asynchronous optimizer of this process initialises its values, in
    the order they were made (the same on every process: a set's order would differ, and two processes each
    waiting in another optimizer's init would wait for ever)."""
    for params in sorted(_LIVE, key=lambda p: p.created):
        params.init(root_rank)


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
    return flat.numpy().astype(_DTYPES[bucket.dtype], copy=False)


def _unflatten(bucket: _Bucket, value: np.ndarray) -> None:
    flat = torch.from_numpy(value)
    offset = 0
    with torch.no_grad():
        for p in bucket.params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view(p.shape))
            offset += n
