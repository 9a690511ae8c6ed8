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

Timeline: with ``BPS_TIMELINE=DIR`` (or ``FILE.json``) every process writes a Chrome trace of its
operations (copy in, waiting for the daemon, copy out) to ``DIR/rank<N>.json`` (``FILE.rank<N>.json``);
merge it with the daemons' (``--timeline``) using ``python -m bps_runtime.timeline merge``.
"""

from __future__ import annotations

import itertools
import os
import socket as _socket
import threading
import time
from dataclasses import dataclass, field
from math import prod
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Callable, Final

import ml_dtypes
import numpy as np

from protocol import PROTOCOL_VERSION, dtypes
from protocol.errors import ProtocolError
from protocol.frames import FrameReader, encode_header
from protocol.messages import (
    KIND_BROADCAST,
    KIND_SUM,
    ROLE_CLIENT,
    Alloc,
    Allocated,
    Done,
    Failure,
    Hello,
    Message,
    Op,
    Welcome,
    parse,
    to_header,
)

from bps_runtime.timeline import Timeline, now_us

from bps_runtime import segments as shm
from .errors import BPSConnectionError, BPSError, BPSMismatchError, BPSTimeoutError

__all__ = [
    "BPSError", "BPSConnectionError", "BPSMismatchError", "BPSTimeoutError", "Handle",
    "init", "shutdown", "rank", "size", "local_rank", "local_size",
    "push_pull", "push_pull_async", "poll", "synchronize", "broadcast", "is_initialized", "shared_array",
]

DEFAULT_TIMEOUT_S: Final = 30.0
CONNECT_RETRY_S: Final = 0.05

NUMPY_DTYPES: Final[dict[str, np.dtype]] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
}
_NAME_OF: Final[dict[np.dtype, str]] = {v: k for k, v in NUMPY_DTYPES.items()}


def dtype_name(dtype: np.dtype) -> str:
    try:
        return _NAME_OF[np.dtype(dtype)]
    except KeyError:
        raise BPSError(f"unsupported dtype {np.dtype(dtype)}; supported: {', '.join(NUMPY_DTYPES)}") from None


@dataclass(eq=False)
class Handle:
    """An operation in flight; pass it to :func:`poll` or :func:`synchronize`."""

    req: int
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    out: np.ndarray | None
    _segment: SharedMemory | None = field(repr=False)  # None: a CUDA tensor the daemon reads and writes itself
    _offset: int = field(repr=False)
    _in_place: bool = field(default=False, repr=False)  # the input was the slot itself (a shared array)
    _result_at: tuple[str, int] | None = field(default=None, repr=False)  # the worker's segment holding the result
    _times: list[int] | None = field(default=None, repr=False)  # timeline: start, filled, done
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _error: BPSError | None = field(default=None, repr=False)
    _consumed: bool = field(default=False, repr=False)

    def _result_view(self) -> np.ndarray:
        count = prod(self.shape)
        return np.frombuffer(self._segment.buf, dtype=self.dtype, count=count, offset=self._offset).reshape(self.shape)


class _Connection:
    """The process's connection to its worker daemon (one per process)."""

    def __init__(self, path: str, local_rank: int, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self.sock = self._connect(path, timeout)
        self.reader = FrameReader(max_payload_bytes=0)
        self.send_lock = threading.Lock()
        self.state_lock = threading.Lock()
        self.reqs = itertools.count(1)
        self.handles: dict[int, Handle] = {}
        self.rpcs: dict[int, tuple[threading.Event, list[Message]]] = {}
        self.inflight: dict[str, Handle] = {}
        self.attached: dict[str, SharedMemory] = {}  # segment name -> our mapping
        self.slots: dict[str, tuple[SharedMemory, int, int]] = {}  # tensor name -> (segment, offset, capacity)
        self.results: dict[str, str] = {}  # tensor name -> the worker's segment that held its last result
        self.broken: BPSError | None = None
        welcome = self._handshake(local_rank)
        self.rank, self.size = welcome.rank, welcome.size
        self.local_rank, self.local_size = welcome.local_rank, welcome.local_size
        self.worker = welcome.worker
        self.timeline = _open_timeline(self.rank)
        self.thread = threading.Thread(target=self._read_loop, name="bps-client-reader", daemon=True)
        self.thread.start()

    # -- set-up ----------------------------------------------------------------------
    @staticmethod
    def _connect(path: str, timeout: float) -> _socket.socket:
        deadline = time.monotonic() + timeout
        while True:
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            try:
                sock.connect(path)
                return sock
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise BPSConnectionError(f"no worker daemon listens on {path} (waited {timeout:g} s): "
                                             f"{exc.strerror}") from None
                time.sleep(CONNECT_RETRY_S)
            except OSError as exc:
                sock.close()
                raise BPSConnectionError(f"cannot connect to the worker daemon at {path}: {exc}") from None

    def _handshake(self, local_rank: int) -> Welcome:
        self.sock.settimeout(self.timeout)
        try:
            self._send(Hello(PROTOCOL_VERSION, ROLE_CLIENT, local_rank, os.getpid()))
            while True:
                data = self.sock.recv(65536)
                if not data:
                    raise BPSConnectionError(f"worker daemon at {self.path} closed the connection during the "
                                             f"handshake")
                frames = self.reader.receive_data(data)
                if frames:
                    break
        except _socket.timeout:
            self.sock.close()
            raise BPSTimeoutError(f"worker daemon at {self.path} did not answer within {self.timeout:g} s") \
                from None
        except (OSError, ProtocolError) as exc:
            self.sock.close()
            raise BPSConnectionError(f"handshake with the worker daemon at {self.path} failed: {exc}") from None
        self.sock.settimeout(None)
        message = parse(frames[0].header)
        if isinstance(message, Failure):
            self.sock.close()
            raise BPSError(f"worker daemon at {self.path} refused local rank {local_rank}: {message.message}")
        if not isinstance(message, Welcome):
            self.sock.close()
            raise BPSConnectionError(f"worker daemon at {self.path} answered {message.TYPE} to hello")
        return message

    # -- I/O -------------------------------------------------------------------------
    def _send(self, message: Message) -> None:
        data = encode_header(to_header(message), 0)
        with self.send_lock:
            try:
                self.sock.sendall(data)
            except OSError as exc:
                raise BPSConnectionError(f"lost the connection to the worker daemon at {self.path}: {exc}") \
                    from None

    def _read_loop(self) -> None:
        reason = "the worker daemon closed the connection"
        # The daemon pings every second; silence for `timeout` while something is pending means it
        # stalled (or its machine did), and the process must get an error, not wait for ever.
        self.sock.settimeout(self.timeout)
        try:
            while True:
                buf = self.reader.get_buffer()
                try:
                    n = self.sock.recv_into(buf)
                except _socket.timeout:
                    with self.state_lock:
                        waiting = bool(self.handles or self.rpcs)
                    if waiting:
                        reason = f"the worker daemon sent nothing for {self.timeout:g} s"
                        try:
                            self.sock.shutdown(_socket.SHUT_RDWR)
                        except OSError:
                            pass
                        break
                    continue
                if n == 0:
                    break
                for frame in self.reader.buffer_updated(n):
                    self._dispatch(parse(frame.header))
        except ProtocolError as exc:
            reason = f"the worker daemon sent a bad frame: {exc}"
        except OSError as exc:
            reason = f"connection to the worker daemon failed: {exc}"
        except _FatalFailure as exc:
            reason = f"the worker daemon dropped this process: {exc}"
        self._fail_everything(BPSConnectionError(f"{reason} ({self.path})"))

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, Failure) and message.req == -1:
            raise _FatalFailure(message.message)
        req = getattr(message, "req", None)
        with self.state_lock:
            handle = self.handles.pop(req, None) if isinstance(message, (Done, Failure)) else None
            rpc = self.rpcs.pop(req, None) if handle is None else None
        if handle is not None:
            if handle._times is not None:
                handle._times[2] = now_us()
            if isinstance(message, Done) and message.segment:
                handle._result_at = (message.segment, message.offset)
            if isinstance(message, Failure):
                cls = BPSMismatchError if message.code == "mismatch" else BPSError
                handle._error = cls(message.message)
            handle._done.set()
        elif rpc is not None:
            rpc[1].append(message)
            rpc[0].set()

    def _fail_everything(self, exc: BPSError) -> None:
        with self.state_lock:
            self.broken = exc
            handles = list(self.handles.values())
            self.handles.clear()
            rpcs = list(self.rpcs.values())
            self.rpcs.clear()
        for h in handles:
            h._error = exc
            h._done.set()
        for event, _ in rpcs:
            event.set()

    def check(self) -> None:
        if self.broken is not None:
            raise BPSConnectionError(str(self.broken))

    def rpc(self, message: Alloc) -> Message:
        event = threading.Event()
        box: list[Message] = []
        with self.state_lock:
            self.check()
            self.rpcs[message.req] = (event, box)
        self._send(message)
        if not event.wait(self.timeout):
            with self.state_lock:
                self.rpcs.pop(message.req, None)
            raise BPSTimeoutError(f"worker daemon did not answer {message.TYPE} within {self.timeout:g} s")
        self.check()
        return box[0]

    # -- segments --------------------------------------------------------------------
    def slot_for(self, name: str, nbytes: int) -> tuple[SharedMemory, int]:
        """The shared memory where tensor ``name`` is handed over (asked of the daemon once per name)."""
        slot = self.slots.get(name)
        if slot is not None and slot[2] >= nbytes:
            return slot[0], slot[1]
        reply = self.rpc(Alloc(next(self.reqs), name, nbytes))
        if isinstance(reply, Failure):
            raise BPSError(reply.message)
        assert isinstance(reply, Allocated)
        seg = self._attach(reply.segment, name)
        self.slots[name] = (seg, reply.offset, reply.nbytes)
        if slot is not None:
            self._release_unused(slot[0].name)  # the daemon moved the tensor and freed its old segment
        return seg, reply.offset

    def _attach(self, segment: str, name: str) -> SharedMemory:
        seg = self.attached.get(segment)
        if seg is None:
            try:
                seg = self.attached[segment] = shm.attach_segment(segment)
            except OSError as exc:
                raise BPSError(f"cannot attach shared-memory segment {segment!r} for {name!r}: {exc}") from None
        return seg

    def _release_unused(self, segment: str) -> None:
        """Unmap ``segment`` unless a slot or a last result still lives there."""
        if segment in self.attached and all(s[0].name != segment for s in self.slots.values()) \
                and segment not in self.results.values():
            shm.release(self.attached.pop(segment), unlink=False)

    def _result_segment(self, handle: Handle) -> None:
        """Point ``handle`` at the worker's segment that holds its result (and forget the one of the last round
        when the worker moved it: the worker has unlinked it, our mapping is all that keeps it)."""
        assert handle._result_at is not None
        segment, offset = handle._result_at
        handle._segment, handle._offset = self._attach(segment, handle.name), offset
        previous = self.results.get(handle.name)
        self.results[handle.name] = segment
        if previous is not None and previous != segment:
            self._release_unused(previous)

    # -- operations ------------------------------------------------------------------
    def start(self, array: np.ndarray, name: str, kind: str, *, average: bool, priority: int, root: int,
              out: np.ndarray | None) -> Handle:
        """Copy ``array`` into its slot (unless it is the slot: a shared array) and start the operation."""
        array = np.asarray(array)

        def fill(view: np.ndarray) -> None:
            if not _same_memory(view, array):
                np.copyto(view, array)

        return self.start_filled(name, kind, array.dtype, array.shape, fill, average=average, priority=priority,
                                 root=root, out=out)

    def shared_array(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if not isinstance(name, str) or not name:
            raise BPSError(f"tensor name must be a non-empty string, got {name!r}")
        dtype = np.dtype(dtype)
        dtype_name(dtype)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise BPSError(f"tensor {name!r}: negative dimension in shape {shape}")
        count = prod(shape)
        with self.state_lock:
            if name in self.inflight:
                raise BPSError(f"tensor {name!r} is in flight in this process; synchronize it first")
        seg, offset = self.slot_for(name, count * dtype.itemsize)
        return np.frombuffer(seg.buf, dtype=dtype, count=count, offset=offset).reshape(shape)

    def start_filled(self, name: str, kind: str, dtype: np.dtype, shape: tuple[int, ...],
                     fill: Callable[[np.ndarray], None], *, average: bool, priority: int, root: int,
                     out: np.ndarray | None) -> Handle:
        """Start an operation whose input ``fill(view)`` writes straight into the shared slot.

        Framework layers use it to assemble an input in place (no staging copy).
        """
        if not isinstance(name, str) or not name:
            raise BPSError(f"tensor name must be a non-empty string, got {name!r}")
        dtype = np.dtype(dtype)
        wire = dtype_name(dtype)
        shape = tuple(shape)
        if average and wire not in dtypes.FLOAT_TYPES:
            raise BPSError(f"tensor {name!r}: average=True needs a floating dtype, got {wire}; pass average=False")
        if out is not None:
            if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != dtype:
                raise BPSError(f"tensor {name!r}: out must be a numpy array of shape {shape} and dtype {dtype}")
            if not out.flags.writeable:
                raise BPSError(f"tensor {name!r}: out is read-only")
        self.check()
        if name in self.inflight:
            raise BPSError(f"tensor {name!r} is already in flight in this process; synchronize it first")
        count = prod(shape)
        t_start = now_us() if self.timeline is not None else 0
        seg, offset = self.slot_for(name, count * dtype.itemsize)
        view = np.frombuffer(seg.buf, dtype=dtype, count=count, offset=offset).reshape(shape)
        fill(view)
        in_place = out is not None and _same_memory(view, out)
        del view
        handle = Handle(next(self.reqs), name, dtype, shape, out, seg, offset, _in_place=in_place)
        if self.timeline is not None:
            handle._times = [t_start, now_us(), 0]
        return self._submit(handle, Op(handle.req, name, kind, wire, list(shape), seg.name, average=average,
                                       priority=priority, root=root, offset=offset, handback=in_place))

    def _submit(self, handle: Handle, op: Op) -> Handle:
        """Register ``handle`` and send its ``op``; undone if the send fails."""
        with self.state_lock:
            self.check()
            self.handles[handle.req] = handle
            self.inflight[handle.name] = handle
        try:
            self._send(op)
        except BPSError:
            with self.state_lock:
                self.handles.pop(handle.req, None)
                self.inflight.pop(handle.name, None)
            raise
        return handle

    def start_cuda(self, name: str, kind: str, wire: str, shape: tuple[int, ...], description: list[Any], *,
                   average: bool, priority: int, root: int) -> Handle:
        """Start an operation on a CUDA tensor that the daemon opens through CUDA IPC and writes in place
        (``description`` from :func:`bps_runtime.cuda.describe`); synchronize() returns None."""
        if average and wire not in dtypes.FLOAT_TYPES:
            raise BPSError(f"tensor {name!r}: average=True needs a floating dtype, got {wire}; pass average=False")
        self.check()
        if name in self.inflight:
            raise BPSError(f"tensor {name!r} is already in flight in this process; synchronize it first")
        handle = Handle(next(self.reqs), name, NUMPY_DTYPES[wire], tuple(shape), None, None, 0, _in_place=True)
        return self._submit(handle, Op(handle.req, name, kind, wire, list(shape), "", average=average,
                                       priority=priority, root=root, cuda=description))

    def finish(self, handle: Handle, timeout: float | None, view: bool = False) -> np.ndarray:
        """Wait for ``handle``; its result (``out``, a copy, or with ``view`` the shared memory that holds it,
        read-only and valid until the next operation on the same name)."""
        if handle._consumed:
            raise BPSError(f"handle of {handle.name!r} was already synchronized")
        if not handle._done.wait(timeout):
            raise BPSTimeoutError(f"tensor {handle.name!r} did not complete within {timeout:g} s")
        handle._consumed = True
        with self.state_lock:
            if self.inflight.get(handle.name) is handle:
                del self.inflight[handle.name]
        if handle._error is not None:
            raise handle._error
        t_copy = now_us() if handle._times is not None else 0
        if handle._result_at is not None:
            self._result_segment(handle)
        if handle._in_place:  # `out` is the slot itself (or a CUDA tensor): the daemon wrote the result there
            result = handle.out
        elif handle.out is not None:
            np.copyto(handle.out, handle._result_view())
            result = handle.out
        elif view:
            result = handle._result_view()  # may be the worker's results segment: read it, never write it
        else:
            result = handle._result_view().copy()
        if handle._times is not None and self.timeline is not None:
            start, filled, done = handle._times
            nbytes = prod(handle.shape) * handle.dtype.itemsize
            self.timeline.span(handle.name, "push_pull", start, now_us(), bytes=nbytes, in_place=handle._in_place)
            self.timeline.span(handle.name, "copy in", start, filled)
            self.timeline.span(handle.name, "worker daemon", filled, done)
            self.timeline.span(handle.name, "copy out", t_copy, now_us())
        return result

    def close(self) -> None:
        try:
            self.sock.shutdown(_socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(timeout=5.0)
        for seg in self.attached.values():
            shm.release(seg, unlink=False)
        self.attached.clear()
        self.slots.clear()
        self.results.clear()
        if self.timeline is not None:
            self.timeline.close()


class _FatalFailure(Exception):
    pass


def _open_timeline(rank: int) -> Timeline | None:
    """The process's trace file if BPS_TIMELINE asks for one (a directory, or a FILE.json to number)."""
    target = os.environ.get("BPS_TIMELINE")
    if not target:
        return None
    path = f"{target[:-5]}.rank{rank}.json" if target.endswith(".json") else os.path.join(target, f"rank{rank}.json")
    return Timeline(path, f"rank {rank} (pid {os.getpid()})")


def _same_memory(view: np.ndarray, array: np.ndarray) -> bool:
    """Whether ``array`` is exactly ``view`` (same first byte, both contiguous, same size)."""
    return (array.size == view.size and array.dtype == view.dtype and array.flags.c_contiguous
            and (array.size == 0 or array.__array_interface__["data"][0] == view.__array_interface__["data"][0]))


_conn: _Connection | None = None
_lock = threading.Lock()


def _connection() -> _Connection:
    conn = _conn
    if conn is None:
        raise BPSError("bps_worker.client is not initialized; call init() first")
    return conn


def init(socket: str | None = None, local_rank: int | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Connect this process to its machine's worker daemon.

    ``socket`` defaults to the environment variable ``BPS_SOCKET``; ``local_rank``
    to ``BPS_LOCAL_RANK``, else ``LOCAL_RANK`` (as set by torchrun). ``timeout``
    bounds the wait for the daemon to appear, for its answers to control requests, and
    the silence of a daemon (it pings every second) while an operation is pending.
    """
    global _conn
    with _lock:
        if _conn is not None:
            return
        path = socket or os.environ.get("BPS_SOCKET")
        if not path:
            raise BPSError("no worker socket: pass init(socket=...) or set BPS_SOCKET")
        if local_rank is None:
            text = os.environ.get("BPS_LOCAL_RANK", os.environ.get("LOCAL_RANK"))
            if text is None:
                raise BPSError("no local rank: pass init(local_rank=...) or set BPS_LOCAL_RANK or LOCAL_RANK")
            try:
                local_rank = int(text)
            except ValueError:
                raise BPSError(f"local rank must be an integer, got {text!r}") from None
        _conn = _Connection(path, local_rank, timeout)


def is_initialized() -> bool:
    return _conn is not None


def shutdown() -> None:
    """Disconnect; the daemon frees this process's shared memory. Safe to call twice."""
    global _conn
    with _lock:
        if _conn is not None:
            _conn.close()
            _conn = None


def rank() -> int:
    """Global rank of this process (ranks are numbered worker by worker)."""
    return _connection().rank


def size() -> int:
    """Training processes in the whole cluster."""
    return _connection().size


def local_rank() -> int:
    return _connection().local_rank


def local_size() -> int:
    return _connection().local_size


def shared_array(name: str, shape: tuple[int, ...], dtype: np.dtype = np.float32) -> np.ndarray:
    """The shared-memory slot of tensor ``name`` as an array: use it to avoid every copy.

    ``push_pull(a, name, out=a)`` on it sums in place: the worker daemon reads the
    input from and writes the result into this memory. The same name always gives
    the same memory while the size fits (it is reused across rounds); a larger size
    moves the slot, and arrays from before no longer take part. Passed with another
    (or no) ``out``, it is left unchanged like any input. Valid until :func:`shutdown`.
    """
    return _connection().shared_array(name, tuple(shape), np.dtype(dtype))


def push_pull_async(array: np.ndarray, name: str, *, average: bool = True, priority: int = 0,
                    out: np.ndarray | None = None) -> Handle:
    """Start summing ``array`` across every process of the cluster (the mean if ``average``)."""
    return _connection().start(array, name, KIND_SUM, average=average, priority=priority, root=-1, out=out)


def poll(handle: Handle) -> bool:
    """True once the operation finished (successfully or not)."""
    return handle._done.is_set()


def synchronize(handle: Handle, timeout: float | None = None) -> np.ndarray:
    """Wait for ``handle`` and return its result (``out`` if one was given); raise BPSError on failure."""
    return _connection().finish(handle, timeout)


def push_pull(array: np.ndarray, name: str, *, average: bool = True, priority: int = 0,
              out: np.ndarray | None = None) -> np.ndarray:
    """Sum (or mean over ``size()``) of ``array`` across every process; identical bytes everywhere."""
    return synchronize(push_pull_async(array, name, average=average, priority=priority, out=out))


def broadcast(array: np.ndarray, root_rank: int, name: str) -> np.ndarray:
    """``root_rank``'s ``array``, on every process."""
    conn = _connection()
    if not isinstance(root_rank, int) or not 0 <= root_rank < conn.size:
        raise BPSError(f"root_rank must be in 0..{conn.size - 1}, got {root_rank!r}")
    return conn.finish(conn.start(array, name, KIND_BROADCAST, average=False, priority=0, root=root_rank,
                                  out=None), None)
