"""Fewer wake-ups per received partition: the TCP receive low-water mark follows the frame.

A partition's payload arrives a packet or two at a time, and by default the event loop wakes up
for each: on emulated 200 Mbit/s links a worker daemon read 16 MiB in about 1,200 calls (14 KiB
each), and every one costs a system call and the Python of a receive. With ``SO_RCVLOWAT`` set to
the bytes the payload still needs (at most ``LOW_WATER_MAX_BYTES``), epoll reports the socket only
once they are all there. The mark goes back to 1 byte between payloads, because Linux wakes no
reader below it: a short frame after a long one would otherwise wait for bytes that never come.
Linux still reports a socket whose receive window is nearly closed or whose memory is under
pressure, so a mark can never stall a connection; a dead peer is found by the heartbeats as before.
"""

from __future__ import annotations

import asyncio
import ctypes
import socket

# At most this: a piece of 4 ms of a 1 Gbit/s link (about 500 kB) wakes its reader once, not twice (with 256
# KiB: 4-7% more CPU per op on emulated 1 Gbit/s links, benchmarks/RESULTS.md, session 21). Linux caps the mark
# at half of tcp_rmem's maximum and grows the receive buffer to hold it.
LOW_WATER_MAX_BYTES = 1 << 20


def _libc_setsockopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's setsockopt(2), or None where there is none to call.

    The transport's socket (uvloop's ``PseudoSocket``) builds a new :class:`socket.socket` for every
    ``setsockopt``: a ``getsockname`` system call and an object per call, twice per received partition.
    The mark is set on the descriptor directly instead."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).setsockopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32]
    fn.restype = ctypes.c_int
    return fn


_SETSOCKOPT = _libc_setsockopt()


class ReceiveLowWater:
    """The ``SO_RCVLOWAT`` of one TCP transport; call :meth:`follow` after every receive."""

    __slots__ = ("_transport", "_fd", "_mark", "_value")

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        usable = (getattr(sock, "family", None) in (socket.AF_INET, socket.AF_INET6)
                  and hasattr(socket, "SO_RCVLOWAT") and _SETSOCKOPT is not None)
        self._transport = transport
        self._fd = sock.fileno() if usable else -1
        self._mark = 1
        self._value = ctypes.c_int(1)

    def follow(self, wanted: int) -> None:
        """The payload being received still needs ``wanted`` bytes (0: none is being received)."""
        if self._fd < 0:
            return
        target = min(wanted, LOW_WATER_MAX_BYTES) if wanted > 0 else 1
        # Raise the mark only from 1 (a payload starts); lower it whenever it is above what is needed.
        if target < self._mark or (self._mark == 1 and target > 1):
            # A closing transport's descriptor may be closed (and then another socket's): leave it alone.
            if self._transport.is_closing():
                self._fd = -1
                return
            self._value.value = target
            if _SETSOCKOPT(self._fd, socket.SOL_SOCKET, socket.SO_RCVLOWAT,  # type: ignore[misc]
                           ctypes.byref(self._value), ctypes.sizeof(self._value)) != 0:
                self._fd = -1  # not a TCP socket after all: wake up as usual
                return
            self._mark = target
