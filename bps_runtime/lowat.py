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
import socket

LOW_WATER_MAX_BYTES = 256 * 1024


class ReceiveLowWater:
    """The ``SO_RCVLOWAT`` of one TCP transport; call :meth:`follow` after every receive."""

    __slots__ = ("_sock", "_mark")

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        usable = (getattr(sock, "family", None) in (socket.AF_INET, socket.AF_INET6)
                  and hasattr(socket, "SO_RCVLOWAT"))
        self._sock = sock if usable else None
        self._mark = 1

    def follow(self, wanted: int) -> None:
        """The payload being received still needs ``wanted`` bytes (0: none is being received)."""
        if self._sock is None:
            return
        target = min(wanted, LOW_WATER_MAX_BYTES) if wanted > 0 else 1
        # Raise the mark only from 1 (a payload starts); lower it whenever it is above what is needed.
        if target < self._mark or (self._mark == 1 and target > 1):
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, target)
            except OSError:
                self._sock = None  # closing, or not a TCP socket after all: wake up as usual
                return
            self._mark = target
