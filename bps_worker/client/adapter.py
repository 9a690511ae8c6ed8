"""The one door for framework layers (:mod:`bps_worker.torch`, or a layer of your own) into the client.

The public API takes numpy arrays and returns them. A framework layer needs a little more, and gets it here
rather than from the client's internals:

* :func:`settings`: what ``init()`` resolved (``cuda_ipc``: whether CUDA tensors may go by CUDA IPC;
  ``timeout``: the bound for waits after a failure);
* :func:`shared_slot` and :func:`start_filled`: assemble an input straight in the name's shared slot (a
  gradient bucket filled piece by piece as backward produces it), then start the sum on it, no staging copy;
* :func:`start_cuda`: start a sum on a CUDA tensor that the daemon opens through CUDA IPC and writes in place;
* :func:`start_broadcast`: an asynchronous broadcast (``broadcast_parameters`` starts them all, then waits);
  :func:`start_broadcast_bytes` one of a tensor's bytes (a dtype the wire does not carry);
* :func:`start_async_init` and :func:`start_async`: asynchronous mode's init and delta, started (a layer
  starts a model's buckets together, then waits for each);
* :func:`finish_view`: wait for a handle and read its result where it lies in shared memory, without the copy
  that :func:`~bps_worker.client.synchronize` makes;
* :func:`settle`: wait for handles nobody will read (those started before a start failed part-way), so
  that no name stays in flight.

Every function works on the process's connection (``init()`` first) and raises :class:`BPSError` like the
public API. Handles are the public :class:`~bps_worker.client.Handle`: :func:`~bps_worker.client.poll` and
:func:`~bps_worker.client.synchronize` take them too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.messages import KIND_BROADCAST, KIND_SUM

from . import _current, _operations
from .handle import Handle
from .operations import Fill
from .settings import Settings

__all__ = ["Fill", "abandon", "connection", "finish_view", "settings", "settle", "shared_slot", "start_async",
           "start_async_init", "start_broadcast", "start_broadcast_bytes", "start_cuda", "start_filled"]


def connection() -> object | None:
    """The process's connection now, or None (none yet, or shut down): another object after ``shutdown()`` and
    ``init()``, so that a layer tells state it made on an earlier connection (asynchronous values it initialised
    there) from this one's. Never raises."""
    return _current()


def settings() -> Settings:
    """The settings ``init()`` resolved from its arguments and the environment."""
    return _operations().settings


def shared_slot(name: str, shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """The shared slot of ``name`` as an array to fill in place (the memory :func:`shared_array` gives), held until
    the name is next pushed (then given up for room like any idle slot: the layer asks for it again each step)."""
    return _operations().shared_array(name, shape, dtype, pinned=False)


def _already_filled(view: np.ndarray) -> None:
    """The input is in the slot already (written through :func:`shared_slot`)."""


def start_filled(name: str, dtype: npt.DTypeLike, shape: tuple[int, ...], fill: Fill | None = None, *,
                 average: bool, priority: int = 0, out: np.ndarray | None = None, layout: str = "") -> Handle:
    """Start summing (averaging) ``name``'s slot: ``fill(view)`` writes the input into it first, or, with no
    ``fill``, the slot already holds it. ``out`` as for ``push_pull_async``. ``layout``: what a fused tensor
    holds (at most ``protocol.messages.MAX_LAYOUT_CHARS`` characters, e.g. a digest of a gradient bucket's
    parameters): every process's must be the same, or each gets a :class:`BPSMismatchError` naming both."""
    return _operations().start_filled(name, KIND_SUM, np.dtype(dtype), tuple(shape), fill or _already_filled,
                                      average=average, priority=priority, root=-1, out=out, layout=layout)


def start_cuda(name: str, wire_dtype: str, shape: tuple[int, ...], description: list[Any], *, average: bool,
               priority: int = 0) -> Handle:
    """Start summing (averaging) a CUDA tensor in place; ``description`` from :func:`bps_runtime.cuda.describe`,
    ``wire_dtype`` a wire dtype name (:func:`~bps_worker.client.dtype_name`). Its result is the tensor itself:
    synchronize it, then read the tensor."""
    return _operations().start_cuda(name, KIND_SUM, wire_dtype, tuple(shape), description, average=average,
                                    priority=priority, root=-1)


def start_broadcast(array: np.ndarray, name: str, root_rank: int) -> Handle:
    """Start a broadcast of ``root_rank``'s ``array``; :func:`~bps_worker.client.synchronize` gives the result."""
    ops = _operations()
    return ops.start(array, name, KIND_BROADCAST, average=False, priority=0, root=ops.check_root(root_rank),
                     out=None)


def start_broadcast_bytes(raw: np.ndarray, name: str, root_rank: int, what: str) -> Handle:
    """Start a broadcast of ``root_rank``'s bytes ``raw`` (1-d uint8): a tensor of a dtype the wire does not
    carry, bit for bit. ``what`` names its dtype and shape (every process's must be the same, or each gets a
    :class:`BPSMismatchError` naming both). The result is int32 words: its first ``raw.size`` bytes are the
    root's (:func:`~bps_worker.client.arrays.bytes_of`)."""
    ops = _operations()
    return ops.start_broadcast_bytes(raw, name, ops.check_root(root_rank), what)


def start_async_init(array: np.ndarray, name: str, root_rank: int, staleness: int | None) -> Handle:
    """Start :func:`~bps_worker.client.async_init`; synchronize the handle for the value."""
    return _operations().start_async_init(array, name, root_rank, staleness)


def start_async(delta: np.ndarray, name: str) -> Handle:
    """Start :func:`~bps_worker.client.async_push_pull`; synchronize the handle for the value."""
    return _operations().start_async(delta, name)


def finish_view(handle: Handle, timeout: float | None = None) -> np.ndarray:
    """Wait for ``handle`` and return its result in place: read-only, valid until the next operation on the
    same name (``out``, if the operation had one)."""
    return _operations().finish(handle, timeout, view=True)


def settle(handles: list[Handle]) -> None:
    """Wait, within one ``timeout`` for them all, for ``handles`` and forget them, whatever they end in: a layer
    that starts several operations and fails to start one must not leave the others in flight, or every later
    use of their names fails. One that has not ended by then is given up: its name is free once it ends."""
    if not handles:
        return
    ops = _operations()
    if ops.fusion is not None:  # (a small sum may wait in the fusion buffer for its cycle)
        ops.fusion.flush()
    ops._settle(handles)


def abandon(handles: list[Handle]) -> None:
    """Forget ``handles`` without waiting (sums that cannot succeed, e.g. whose peers issued other names): those
    not ended are given up, and each name is free again once its operation ends (its timeout at the latest)."""
    if handles:
        _operations()._settle(handles, within=0.0)
