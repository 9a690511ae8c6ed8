"""CUDA tensors between training processes and their worker daemon, through CUDA IPC.

A training process does not copy a CUDA tensor to the host: it sends the
daemon an IPC description of it (:func:`describe`, the same data torch's own
multiprocessing uses) in its ``Op``. The daemon opens every local process's
tensor (:class:`CudaBridge`, handles cached by torch), sums them on the GPU of
local rank 0 (float16/bfloat16 in float32, rounded once), and copies the sum
once into the name's staging buffer, which is page-locked (``cudaHostRegister``
on the shared-memory segment) so the copy is a DMA and the colocated server can
still read it in place. The global sum comes back into the (also registered)
results buffer and is copied into each process's tensor on its own GPU. The
daemon synchronizes the devices before it answers ``Done``; the process
synchronizes its stream before it sends the ``Op``.

torch is imported only when the first CUDA operation arrives: CPU-only daemons
never pay for it.
"""

from __future__ import annotations

import ctypes
import logging
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np


log = logging.getLogger("bps.worker.cuda")

# Fields of an IPC description, in order (see describe()).
DESCRIPTION_FIELDS = ("size", "stride", "offset", "dtype", "device", "handle", "storage_bytes", "storage_offset",
                      "ref_handle", "ref_offset", "event_handle", "event_sync")


class CudaUnavailableError(RuntimeError):
    """This process cannot take CUDA tensors (no torch, or no device); the worker reports it as a BPSError."""


def describe(tensor: Any) -> list[Any]:
    """What the worker daemon needs to open ``tensor`` (a CUDA tensor of this process) in place."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.current_stream(tensor.device).synchronize()  # its producers are done before the daemon reads
    _, args = reduce_tensor(tensor.detach())
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_bytes, storage_offset, _grad,
     ref_handle, ref_offset, event_handle, event_sync) = args
    return [list(size), list(stride), int(offset), str(dtype).removeprefix("torch."), int(device), handle,
            int(storage_bytes), int(storage_offset), ref_handle, int(ref_offset), event_handle, bool(event_sync)]


def check_description(desc: list[Any]) -> str | None:
    """Why ``desc`` is not an IPC description (a message for the process), or None."""
    if len(desc) != len(DESCRIPTION_FIELDS):
        return f"a CUDA tensor description has {len(DESCRIPTION_FIELDS)} fields, got {len(desc)}"
    size, stride, offset, dtype, device, handle = desc[:6]
    if not (isinstance(size, list) and isinstance(stride, list) and len(size) == len(stride)
            and all(isinstance(d, int) and d >= 0 for d in size + stride)):
        return "bad size or stride in a CUDA tensor description"
    if not (isinstance(offset, int) and offset >= 0 and isinstance(dtype, str) and isinstance(device, int)):
        return "bad offset, dtype or device in a CUDA tensor description"
    if handle is not None and not isinstance(handle, bytes):
        return "bad IPC handle in a CUDA tensor description"
    return None


class CudaBridge:
    """The daemon's side: open processes' CUDA tensors, sum on the GPU, move sums through pinned memory."""

    def __init__(self) -> None:
        try:
            import torch
        except ImportError:
            raise CudaUnavailableError("a process sent a CUDA tensor, but this worker daemon has no torch "
                                       "installed") from None
        if not torch.cuda.is_available():
            raise CudaUnavailableError("a process sent a CUDA tensor, but this worker daemon sees no CUDA device")
        try:
            torch.cuda.init()  # here, in the daemon's thread that makes the bridge, not in the first operation
        except RuntimeError as exc:  # a driver that does not match, a device in a bad state
            raise CudaUnavailableError(f"a process sent a CUDA tensor, but this worker daemon cannot start CUDA: "
                                       f"{exc}") from None
        self.torch = torch
        self._pinned: dict[int, int] = {}  # host address -> bytes registered with cudaHostRegister

    # -- tensors -----------------------------------------------------------------------
    def open(self, desc: list[Any]) -> Any:
        """The process's tensor, mapped into this daemon (torch caches the IPC mapping per allocation)."""
        torch = self.torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        (size, stride, offset, dtype, device, handle, storage_bytes, storage_offset, ref_handle, ref_offset,
         event_handle, event_sync) = desc
        return rebuild_cuda_tensor(torch.Tensor, torch.Size(size), tuple(stride), offset, torch.storage.TypedStorage,
                                   getattr(torch, dtype), device, handle, storage_bytes, storage_offset, False,
                                   ref_handle, ref_offset, event_handle, event_sync)

    def open_all(self, descs: list[list[Any]]) -> list[Any]:
        """:meth:`open` of each, named in the error where one cannot be opened (its process may be gone)."""
        tensors = []
        for i, desc in enumerate(descs):
            try:
                tensors.append(self.open(desc))
            except (RuntimeError, OSError) as exc:  # the allocation's process exited, or its handle is stale
                raise CudaUnavailableError(f"cannot open the CUDA tensor of local process {i} of this operation: "
                                           f"{exc}") from None
        return tensors

    def sum_to_host(self, tensors: list[Any], host: np.ndarray, root: int | None = None) -> None:
        """Sum ``tensors`` (or take ``tensors[root]`` for a broadcast) on the GPU into ``host``."""
        torch = self.torch
        first = tensors[0 if root is None else root]
        with torch.cuda.device(first.device):
            if root is not None:
                total = first.reshape(-1)
            else:
                wide = torch.float32 if first.dtype in (torch.float16, torch.bfloat16) else first.dtype
                acc = first.reshape(-1).to(wide, copy=True)
                for t in tensors[1:]:
                    acc += t.reshape(-1).to(device=first.device, dtype=wide)  # peer copy, then add
                total = acc.to(first.dtype)  # half types: rounded once, here
            self.host_tensor(host, first.dtype).copy_(total)
            torch.cuda.synchronize(first.device)

    def copy_back(self, host: np.ndarray, tensors: list[Any]) -> None:
        """The global sum in ``host`` into every process's tensor, on its own GPU."""
        torch = self.torch
        src = self.host_tensor(host, tensors[0].dtype)
        devices = set()
        for t in tensors:
            t.view(-1).copy_(src, non_blocking=True)
            devices.add(t.device)
        for device in devices:
            torch.cuda.synchronize(device)

    def host_tensor(self, host: np.ndarray, dtype: Any) -> Any:
        """``host`` (a staging array of storage dtype) as a CPU tensor of ``dtype``, without a copy."""
        torch = self.torch
        flat = host.reshape(-1)
        if dtype in (torch.float16, torch.bfloat16):
            return torch.from_numpy(flat.view(np.int16)).view(dtype)
        return torch.from_numpy(flat)

    # -- page-locked shared memory --------------------------------------------------------
    def pin(self, seg: SharedMemory) -> None:
        """Page-lock a staging segment so that copies to and from the GPU are DMA transfers."""
        address = ctypes.addressof(ctypes.c_char.from_buffer(seg.buf))  # type: ignore[arg-type]  # open segment
        if address in self._pinned:
            return
        code = self.torch.cuda.cudart().cudaHostRegister(address, seg.size, 0)
        if int(code) != 0:
            log.warning("cudaHostRegister of %s (%d bytes) failed with %s: copies will be staged by CUDA",
                        seg.name, seg.size, code)
            return
        self._pinned[address] = seg.size

    def unpin(self, seg: SharedMemory) -> None:
        """Undo :meth:`pin` before the segment is unmapped."""
        if seg.buf is None:
            return
        address = ctypes.addressof(ctypes.c_char.from_buffer(seg.buf))
        if self._pinned.pop(address, None) is not None:
            self.torch.cuda.cudart().cudaHostUnregister(address)
