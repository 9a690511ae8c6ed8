"""The client API for any framework (numpy arrays): ``import bps_worker.client as bps``.

A training process connects to its machine's worker daemon over a Unix socket.
Only control messages use the socket: each tensor name gets a shared-memory
slot (created by the daemon, reused across rounds) that the tensor is copied
into, and the daemon writes the result back into the same slot.

Example::

    import bps_worker.client as bps
    bps.init()                       # BPS_SOCKET and BPS_LOCAL_RANK / LOCAL_RANK from the environment
    g = bps.push_pull(grad, "layer1.weight")   # mean over all processes of the cluster

No copies at all: :func:`shared_array` returns the slot itself as an array. Fill
it, and ``push_pull(a, name, out=a)`` sums it in place, without copying it in or
out (the daemon reads and writes that very memory)::

    g = bps.shared_array("layer1.weight", (256, 128), np.float32)
    g[...] = compute_gradient()
    bps.push_pull(g, "layer1.weight", out=g)

Timeline: with ``BPS_TIMELINE=DIR`` (or ``FILE.json``; or ``init(timeline=...)``) every process writes a
Chrome trace of its operations (copy in, waiting for the daemon, copy out) to ``DIR/rank<N>.json``
(``FILE.rank<N>.json``); merge it with the daemons' (``--timeline``) using ``python -m bps_runtime.timeline merge``.

The package, one room each: ``settings`` (init()'s arguments and environment defaults), ``arrays`` (numpy
dtypes, views of shared memory), ``connection`` (the socket: handshake, reader thread, requests), ``slots`` (the
daemon's segments as this process maps them), ``handle``, ``operations`` (start and finish, names in flight,
timeline), ``adapter`` (the one door for framework layers such as :mod:`bps_worker.torch`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Sequence, SupportsIndex

import numpy as np
import numpy.typing as npt

from protocol.messages import KIND_BROADCAST, KIND_SUM

from bps_runtime.locks import OwnedLock

from ..errors import BPSConnectionError, BPSError, BPSMismatchError, BPSTimeoutError
from . import group
from .arrays import NUMPY_DTYPES, bytes_of, dtype_name, wire_name
from .handle import Handle, checked
from .operations import Operations
from .settings import DEFAULT_TIMEOUT_S, resolve

__all__ = [
    "BPSError", "BPSConnectionError", "BPSMismatchError", "BPSTimeoutError", "Handle",
    "init", "shutdown", "rank", "size", "local_rank", "local_size",
    "push_pull", "push_pull_async", "push_pull_group", "poll", "synchronize", "broadcast", "is_initialized", "shared_array",
    "async_init", "async_push_pull",
    "NUMPY_DTYPES", "dtype_name",
]

_conn: Operations | None = None
_lock = OwnedLock()


def _current() -> Operations | None:
    """The process's operations, or None where it has none: never connected, shut down, or a fork's copy."""
    conn = _conn
    return conn if conn is not None and conn.pid == os.getpid() else None


def _operations() -> Operations:
    """The process's operations (the adapter's and the public functions' one way to them)."""
    conn = _conn
    if conn is None:
        raise BPSError("bps_worker.client is not initialized; call init() first")
    if conn.pid != os.getpid():
        raise BPSError(f"bps_worker.client was initialized in process {conn.pid}, and this process "
                       f"({os.getpid()}) is a fork of it: a fork cannot use that process's connection to the "
                       f"worker daemon; call init() here to connect it as a training process of its own")
    return conn


def _after_fork_in_child() -> None:
    """A forked child keeps its parent's client state, but not its connection (see :func:`_operations`): its copy
    of the socket is closed at once, so that a long-lived child (a data loader's worker) does not keep the
    parent's connection open after the parent is gone, which the daemon would then not see leave. (The module's
    lock is made anew: a thread of the parent's may have held it, and no thread of the parent's runs here.)"""
    global _lock
    _lock = OwnedLock()
    conn = _conn
    if conn is not None:
        conn.conn.forget()


os.register_at_fork(after_in_child=_after_fork_in_child)


def init(socket: str | None = None, local_rank: int | None = None, timeout: float = DEFAULT_TIMEOUT_S, *,
         timeline: str | None = None, cuda_ipc: bool | None = None, fusion_bytes: int | None = None,
         cycle_time_ms: float | None = None) -> None:
    """Connect this process to its machine's worker daemon (a second call does nothing, unless the connection
    broke: the daemon died or was restarted; it then connects again, and handles from before are refused).

    ``socket`` defaults to the environment variable ``BPS_SOCKET``; ``local_rank``
    to ``BPS_LOCAL_RANK``, else ``LOCAL_RANK`` (as set by torchrun). ``timeout``
    bounds the wait for the daemon to appear, for its answers to control requests, and
    the silence of a daemon (it pings every second) while an operation is pending.
    ``timeline`` (default ``BPS_TIMELINE``): a directory or ``FILE.json`` for this process's
    Chrome trace. ``cuda_ipc`` (default: on unless ``BPS_CUDA_IPC=0``): framework layers hand
    CUDA tensors to the daemon through CUDA IPC rather than host copies. ``fusion_bytes``
    (default ``BPS_FUSION_BYTES``, 64 MiB) and ``cycle_time_ms`` (``BPS_CYCLE_TIME_MS``, 1 ms) bound
    the fusion of small sums: the ones issued close together go to the daemon in one message once
    that many bytes wait or the first waited that long (``fusion_bytes=0``: no fusion). This is
    the one place the client reads the environment (see :mod:`bps_worker.client.settings`).
    """
    global _conn
    with _lock:
        if _conn is not None and _conn.pid == os.getpid():
            if _conn.conn.broken is None:
                return
            # (its daemon is gone: this init returned and every later call failed with the old error; a review)
            _conn.close()
        _conn = None  # (a forked child's copy of its parent's state: forgotten, see _after_fork_in_child)
        _conn = Operations(resolve(socket, local_rank, timeout, timeline, cuda_ipc, os.environ, fusion_bytes,
                                   cycle_time_ms))


def is_initialized() -> bool:
    """Whether :func:`init` connected this process (and :func:`shutdown` has not been called since)."""
    return _conn is not None and _conn.pid == os.getpid()


def shutdown() -> None:
    """Leave and disconnect; the daemon frees this process's shared memory. Safe to call twice.

    A process that leaves fails every round that awaits it, on every machine (a dead peer is an error, never a
    hang), and the daemon cannot tell a leave from a crash. So ``shutdown()`` then ``init()`` again within a job
    is for every process together: each must have left before any of them starts an operation again (a barrier
    of the job's own between the two; handles from before are refused after it). ``shutdown()`` returns once its
    leave took effect: where this was its machine's last process, every server has heard that the machine has
    none (within the cluster's timeout), so the barrier alone starts the next ``init()`` clean everywhere.
    It may be called from a signal handler (a pod's SIGTERM): where the signal interrupted a call of this thread's,
    it returns all the same (see :mod:`bps_runtime.locks`)."""
    global _conn
    # (without the lock where this thread holds it: a signal handler's shutdown() inside init() or shutdown())
    with contextlib.nullcontext() if _lock.mine() else _lock:
        if _conn is not None and _conn.pid == os.getpid():
            _conn.close()
        _conn = None  # (a forked child's copy of its parent's state is only forgotten: the parent still uses it)


def rank() -> int:
    """Global rank of this process (ranks are numbered worker by worker)."""
    return _operations().rank


def size() -> int:
    """Training processes in the whole cluster."""
    return _operations().size


def local_rank() -> int:
    """Rank of this process on its machine (0 .. local_size() - 1)."""
    return _operations().local_rank


def local_size() -> int:
    """Training processes on this machine."""
    return _operations().local_size


def shared_array(name: str, shape: Iterable[SupportsIndex] | SupportsIndex, dtype: npt.DTypeLike = np.float32
                 ) -> np.ndarray:
    """The shared-memory slot of tensor ``name`` as an array: use it to avoid every copy.

    ``push_pull(a, name, out=a)`` on it sums in place: the worker daemon reads the
    input from and writes the result into this memory. The same name always gives
    the same memory while the size fits and an array of it (or a view of one) is alive:
    it is reused across rounds, never given up for another name's room meanwhile; a
    larger size moves the slot, and arrays from before no longer take part. Passed with
    another (or no) ``out``, it is left unchanged like any input. Being the name's slot, it is
    also where any other array pushed under the same name is handed over: such a push
    overwrites it (with its input, then its sum). Valid until :func:`shutdown`.
    """
    return _operations().shared_array(name, shape, dtype)


def push_pull_async(array: np.ndarray, name: str, *, average: bool = True, priority: int = 0,
                    out: np.ndarray | None = None) -> Handle:
    """Start summing ``array`` across every process of the cluster (the mean if ``average``, which needs a
    floating dtype); a larger ``priority`` is served first."""
    return _operations().start(array, name, KIND_SUM, average=average, priority=priority, root=-1, out=out)


def poll(handle: Handle) -> bool:
    """True once the operation finished (successfully or not)."""
    if _conn is None:  # (after shutdown: what it came to, which synchronize no longer reads)
        return checked(handle, "poll").done()
    return _operations().poll(handle)  # (in a fork: its error, as every call; a flush there could hang)


def synchronize(handle: Handle, timeout: float | None = None) -> np.ndarray:
    """Wait for ``handle`` and return its result (``out`` if one was given); raise BPSError on failure."""
    return _operations().finish(handle, timeout)


def push_pull(array: np.ndarray, name: str, *, average: bool = True, priority: int = 0,
              out: np.ndarray | None = None) -> np.ndarray:
    """Sum (or mean over ``size()``, floating dtypes only) of ``array`` across every process; identical bytes
    everywhere. A larger ``priority`` is served first."""
    ops = _operations()
    return ops.finish(ops.start(array, name, KIND_SUM, average=average, priority=priority, root=-1, out=out,
                                waited=True), None)


def push_pull_group(arrays: Sequence[np.ndarray], names: Sequence[str], *, average: bool = True,
                    priority: int = 0) -> list[np.ndarray]:
    """:func:`push_pull` of every ``arrays[i]`` as ``names[i]``, in one call: a model's whole tree.

    The same sums as ``push_pull_async`` on each and ``synchronize`` on all; every process must name the same
    tensors (in any order). Where every process's group has the same names, dtypes and shapes, the small
    entries travel packed into one tensor per dtype (:mod:`bps_worker.client.group`): the daemons see a few
    tensors instead of thousands. Every entry is checked before anything is sent (a bad entry or a name given
    twice starts nothing). A name that differs between processes fails alone, with the error naming it: the
    others all complete, then the first failure is raised. Groups that name other tensors on other processes
    cannot meet: they wait, as names pushed one by one would (stall warnings, ``cluster.stall_timeout``), naming
    the group.
    """
    return group.push_pull_group(_operations(), arrays, names, average=average, priority=priority)


def broadcast(array: np.ndarray, root_rank: int, name: str) -> np.ndarray:
    """``root_rank``'s ``array``, on every process. Any dtype numpy holds by value: the wire's as themselves, the
    others (bool, the small and unsigned integers, complex, records, another byte order) as their bytes, bit for
    bit; every process's array must have the same dtype and shape."""
    ops = _operations()
    root = ops.check_root(root_rank)
    array = np.asarray(array)
    if wire_name(array.dtype) is not None or array.dtype.hasobject:  # (objects: refused by the wire's check)
        return ops.finish(ops.start(array, name, KIND_BROADCAST, average=False, priority=0, root=root, out=None),
                          None)
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    words = ops.finish(ops.start_broadcast_bytes(raw, name, root, f"{array.dtype}{list(array.shape)}"), None)
    return bytes_of(words, raw.size).view(array.dtype).reshape(array.shape)


def async_init(array: np.ndarray, name: str, root_rank: int = 0, *, staleness: int | None = None) -> np.ndarray:
    """Make ``name`` asynchronous: the servers hold its value, which starts as ``root_rank``'s ``array``
    (unless this job's value exists already: a process that rejoins gets the value as it is now). Returns
    the value. Every process calls it once per job, with the same shape, dtype, root and ``staleness``.

    ``staleness=s`` keeps every machine within ``s`` pushes of ``name`` of the slowest live one (its
    :func:`async_push_pull` does not return before); ``0`` is bulk-synchronous; ``None`` is unbounded.
    A name is either synchronous or asynchronous for the life of a job: any other use of it is a BPSError.
    """
    ops = _operations()
    return ops.finish(ops.start_async_init(array, name, root_rank, staleness), None)


def async_push_pull(delta: np.ndarray, name: str) -> np.ndarray:
    """Add ``delta`` to ``name``'s value at once (no round barrier: other machines' deltas are added as they
    arrive) and return the value after it. The processes of one machine are summed first, so each call
    of every process adds its delta once. Exactly once, also across a server restart; a call that
    raises may or may not have added its delta."""
    ops = _operations()
    return ops.finish(ops.start_async(delta, name), None)
