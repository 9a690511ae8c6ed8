"""The process's Unix socket to its worker daemon: handshake, a reader thread, and the table of requests.

Only control messages travel here (tensors are in shared memory or CUDA IPC). Two kinds of request wait
for an answer, keyed by ``req``: operations (a :class:`Handle`, completed by ``Done`` or ``Failure``) and
control requests (``Alloc``, answered by ``Allocated`` or ``Failure``; see :meth:`Connection.rpc`). The reader
maps the results segment a ``Done`` names as it arrives, and tells the daemon (``Taken``), which keeps the
segment until then: ahead of this process's next message (no frame, no wake-up of the daemon of its own), or
when the daemon asks (a ``Ping``: its periodic one, or one it sends where it waits for room).

One reader thread receives everything. When the connection breaks (the daemon closed it, sent a bad frame,
dropped this process, or fell silent for ``timeout`` while something was pending) every waiting request
fails with one :class:`BPSConnectionError`, and every later request is refused with it.

The daemon also tells the process what fails nothing but it should know (``Notice``): its tensors that stall
(a peer that never pushed one, after the timeout and every timeout again). The reader logs each line as a
warning of the ``bps_worker.client`` logger: on stderr where the program set up no logging.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket as _socket
import threading
import time
from multiprocessing.shared_memory import SharedMemory
from typing import Callable, Final, Sequence

from protocol import PROTOCOL_VERSION
from protocol.errors import ProtocolError
from protocol.frames import Frame, FrameReader, encode_message
from protocol.handshake import ClientHandshake, Established, HandshakeRefused
from protocol.messages import (MAX_FUSED_ENTRIES, ROLE_CLIENT, Alloc, Allocated, Done, DoneBatch, Failure, Hello,
                               Leave, Message, Notice, Ping, Taken, Welcome, parse)

from bps_runtime.locks import OwnedLock
from bps_runtime.segments import SHM_DIR
from bps_runtime.timeline import now_us

from ..errors import BPSConnectionError, BPSError, BPSTimeoutError, error_from_failure
from .handle import Handle

__all__ = ["CONNECT_RETRY_S", "Connection"]

log = logging.getLogger("bps_worker.client")

CONNECT_RETRY_S: Final = 0.05  # between attempts while the daemon's socket is not there yet

# When this process last closed its connection to a daemon's socket as a local rank: a new handshake for that
# rank soon after may meet the old connection not yet ended there (see Connection._welcomed).
_CLOSED_AT: dict[tuple[str, int], float] = {}


class _FatalFailure(Exception):
    """The daemon sent a Failure for no request (req -1): it dropped this process."""


class Connection:
    """The process's connection to its worker daemon (one per process)."""

    def __init__(self, path: str, local_rank: int, timeout: float, job: str = "") -> None:
        self.path = path
        self.job = job  # (Hello.job)
        self.peer = f"the worker daemon at {path}"  # BPSConnectionError.peer
        self.timeout = timeout
        self.sock = _connect(path, self.peer, timeout)
        self.reader = FrameReader(max_payload_bytes=0)
        self.send_lock = OwnedLock()
        self.lock = OwnedLock()  # guards handles, rpcs and broken
        self.reqs = itertools.count(1)
        self.handles: dict[int, Handle] = {}
        self.rpcs: dict[int, tuple[threading.Event, list[Message]]] = {}
        self.broken: BPSConnectionError | None = None
        self.closing = False  # close() was called: what the reader then meets is that
        self.leaving = False  # close() sent Leave: no other thread's message may follow it (the daemon drops us)
        # Maps a Done's results segment (tensor name, segment) as the Done arrives, not at synchronize: a mapping
        # keeps it alive, and the daemon may free it for room once told it is mapped (or after its timeout).
        self.map_result: Callable[[str, str], SharedMemory] | None = None
        self.mapped_result: Callable[[str], str | None] | None = None  # the segment a name's last result was in
        self.describe_notice: Callable[[str], str] | None = None  # a notice's line as logged (client.group.described)
        # The daemon keeps such a segment until told it is mapped (Taken): the requests of the Dones mapped and
        # not told yet (appended by the reader thread), and the part of a frame that could not go at once (under
        # send_lock). Both go ahead of the next message, or with the reader's next try (see _acknowledge).
        self._taken: list[int] = []
        self._owed = b""
        self.welcome = self._welcomed(local_rank)
        self.thread = threading.Thread(target=self._read_loop, name="bps-client-reader", daemon=True)
        self.thread.start()

    def next_req(self) -> int:
        return next(self.reqs)

    # -- set-up ----------------------------------------------------------------------
    def _welcomed(self, local_rank: int) -> Welcome:
        """The handshake, tried again while the daemon still holds this process's own previous connection (it
        was closed a moment ago: shutdown(), then init(); the daemon may read the new Hello before the old
        connection's end, and refused it as "already connected", about one re-init in five with operations in
        flight). A local rank held by another live process is refused at once, as before."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self._handshake(local_rank)
            except BPSError as exc:
                closed = _CLOSED_AT.get((self.path, local_rank))
                if ("is already connected" not in str(exc) or closed is None
                        or time.monotonic() - closed > self.timeout or time.monotonic() >= deadline):
                    raise
            time.sleep(CONNECT_RETRY_S)
            self.sock = _connect(self.path, self.peer, max(0.0, deadline - time.monotonic()))
            self.reader = FrameReader(max_payload_bytes=0)

    def _handshake(self, local_rank: int) -> Welcome:
        """Hello -> Welcome (or a Failure naming why the daemon refuses this local rank), as the connecting
        side of ``protocol.handshake`` without a challenge (the Unix socket has no token)."""
        handshake = ClientHandshake(Hello(PROTOCOL_VERSION, ROLE_CLIENT, local_rank, os.getpid(), job=self.job),
                                    challenge=False, who=self.peer)
        self.sock.settimeout(self.timeout)
        try:
            hello = handshake.start()
            assert hello is not None  # without a challenge the client speaks first
            self._send(hello)
            frames: list[Frame] = []
            while not frames:
                data = self.sock.recv(65536)
                if not data:
                    raise BPSConnectionError("it closed the connection during the handshake", peer=self.peer)
                frames = self.reader.receive_data(data)
            established = handshake.receive(parse(frames[0].header))
            assert isinstance(established, Established)  # the Hello went first: what comes back ends it
            welcome = established.welcome
        except _socket.timeout:
            self.sock.close()
            raise BPSTimeoutError(what=f"the handshake with {self.peer}", timeout_s=self.timeout) from None
        except HandshakeRefused as exc:
            self.sock.close()
            raise BPSError(f"{self.peer} refused local rank {local_rank}: {exc.reason}") from None
        except (OSError, ProtocolError) as exc:
            self.sock.close()
            raise BPSConnectionError(f"handshake failed: {exc}", peer=self.peer) from None
        except BPSError:
            self.sock.close()
            raise
        self.sock.settimeout(None)
        return welcome

    # -- requests --------------------------------------------------------------------
    def check(self) -> None:
        """Raise the connection's error if it broke."""
        broken = self.broken
        if broken is not None:
            raise BPSConnectionError(broken.detail, peer=broken.peer)

    def submit(self, handle: Handle, message: Message) -> None:
        """Register ``handle`` and send its operation; undone if the send fails."""
        with self.lock:
            self.check()
            self.handles[handle.req] = handle
        try:
            self._send(message)
        except BPSError:
            with self.lock:
                self.handles.pop(handle.req, None)
            raise

    def submit_many(self, handles: list[Handle], message: Message) -> None:
        """Register ``handles`` and send the one message that starts them all (an OpBatch)."""
        with self.lock:
            self.check()
            for handle in handles:
                self.handles[handle.req] = handle
        try:
            self._send(message)
        except BPSError:
            with self.lock:
                for handle in handles:
                    self.handles.pop(handle.req, None)
            raise

    def rpc(self, message: Alloc | Leave, *, last: bool = False) -> Message:
        """Send a control request and wait (at most ``timeout``) for its answer (``last``: see _send)."""
        event = threading.Event()
        box: list[Message] = []
        if last and self.lock.mine():  # (see bps_runtime.locks)
            raise BPSError("shutdown() interrupted a call of this thread's holding the client's lock")
        with self.lock:
            self.check()
            self.rpcs[message.req] = (event, box)
        self._send(message, last=last)
        if not event.wait(self.timeout):
            with self.lock:
                self.rpcs.pop(message.req, None)
            raise BPSTimeoutError(what=f"the answer of {self.peer} to {message.TYPE}", timeout_s=self.timeout)
        self.check()
        return box[0]

    def allocate(self, name: str, nbytes: int, free: Sequence[str] = ()) -> tuple[str, int, int]:
        """Ask the daemon for a slot of ``nbytes`` for tensor ``name``, giving up the slots of ``free``
        first: (segment, offset, capacity)."""
        reply = self.rpc(Alloc(self.next_req(), name, nbytes, list(free)))
        if isinstance(reply, Failure):
            raise error_from_failure(reply)
        assert isinstance(reply, Allocated)
        return reply.segment, reply.offset, reply.nbytes

    # -- I/O -------------------------------------------------------------------------
    def _send(self, message: Message, *, last: bool = False) -> None:
        """Send ``message`` (``last``: our Leave; after it only the reader's Taken go, and another thread's call
        hears that shutdown() was called, as it would a moment later)."""
        data = encode_message(message)
        if last and self.send_lock.mine():  # (see bps_runtime.locks)
            raise BPSError("shutdown() interrupted a send of this thread's")
        with self.send_lock:
            if self.leaving:
                raise self.cut()
            self.leaving = last
            if self._taken or self._owed:
                data = self._unsent() + data
            try:
                self.sock.sendall(data)
            except OSError as exc:
                raise BPSConnectionError(f"lost the connection: {exc}", peer=self.peer) from None

    def _unsent(self) -> bytes:
        """(Under send_lock.) What must go before any other message: the rest of a frame begun, then the Taken of
        the results mapped since the last one."""
        taken, self._taken = self._taken, []  # (the reader appends to one list or the other, never lost)
        data, self._owed = self._owed, b""
        for start in range(0, len(taken), MAX_FUSED_ENTRIES):
            data += encode_message(Taken(taken[start:start + MAX_FUSED_ENTRIES]))
        return data

    def _acknowledge(self) -> None:
        """The reader thread tells the daemon which results it mapped (Taken), asked by a Ping, only as far as
        that never blocks it: a reader blocked on a full socket would stop reading the daemon, which stops
        reading a process whose answers pile up. What cannot go now goes ahead of the next message, or at the
        next try (the daemon pings every second)."""
        if not self.send_lock.acquire(blocking=False):
            return  # a thread is sending: it takes them along, or the next try does
        try:
            data = self._unsent()
            try:
                poller = select.poll()
                poller.register(self.sock, select.POLLOUT)
                sent = self.sock.send(data, _socket.MSG_DONTWAIT) if data and poller.poll(0) else 0
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                sent = len(data)  # the connection broke: the reader learns it from its next read
            self._owed = data[sent:]
        finally:
            self.send_lock.release()

    def _read_loop(self) -> None:
        reason = "the worker daemon closed the connection"
        # The daemon pings every second; silence for `timeout` while something is pending means it
        # stalled (or its machine did), and the process must get an error, not wait for ever.
        try:
            self.sock.settimeout(self.timeout)  # (in the try: a connection closed at once is an OSError here)
            while True:
                buf = self.reader.get_buffer()
                try:
                    n = self.sock.recv_into(buf)
                except _socket.timeout:
                    with self.lock:
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
                asked = False
                for frame in self.reader.buffer_updated(n):
                    message = parse(frame.header)
                    asked = asked or isinstance(message, Ping)
                    self._dispatch(message)
                if asked and (self._taken or self._owed):  # (else they go with our next message)
                    self._acknowledge()
        except ProtocolError as exc:
            reason = f"the worker daemon sent a bad frame: {exc}"
        except OSError as exc:
            reason = f"the socket failed: {exc}"
        except _FatalFailure as exc:
            reason = f"the worker daemon dropped this process: {exc}"
        except Exception as exc:  # a bug of ours: every waiter must still hear it, never wait for ever
            reason = f"the client's reader failed: {exc!r}"
        if self.closing:  # (its callers on other threads heard "the socket failed: Bad file descriptor"; a review)
            self._fail_everything(self.cut())
            return
        self._fail_everything(BPSConnectionError(reason, peer=self.peer))

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, Notice):
            for line in message.lines:
                try:  # (the program's logging runs here: whatever it raises must not end this thread's reading)
                    log.warning("%s", line if self.describe_notice is None else self.describe_notice(line))
                except Exception:
                    pass
            return
        if isinstance(message, DoneBatch):
            with self.lock:
                handles = self.handles
                done = [handles.pop(req) for req in message.reqs if req in handles]
            now = now_us() if done and done[0].times is not None else None
            for finished in done:
                finished.succeed(None, now)
            return
        if isinstance(message, Failure) and message.req == -1:
            raise _FatalFailure(message.message)
        req: int = getattr(message, "req", -1)
        with self.lock:
            handle = self.handles.pop(req, None) if isinstance(message, (Done, Failure)) else None
            rpc = self.rpcs.pop(req, None) if handle is None else None
        if handle is not None:
            now = now_us() if handle.times is not None else None
            if isinstance(message, Failure):
                # (one cut by our Leave hears that, not how the daemon's teardown of our job failed it)
                handle.fail(self.cut() if self.leaving else error_from_failure(message), now)
            else:
                assert isinstance(message, Done)
                if message.segment and self.map_result is not None:
                    # A name's Dones that name one segment in a row are a run (bps_worker.result_holds): mapped
                    # at its first, kept mapped while it lasts, so only the first is told (Taken).
                    first = self.mapped_result is None or self.mapped_result(handle.name) != message.segment
                    try:
                        self.map_result(handle.name, message.segment)  # finish() finds it mapped
                    except (OSError, BPSError) as exc:
                        handle.fail(self.cut() if self.leaving else self._unmapped(handle.name, message.segment, exc),
                                    now)
                        return
                    finally:
                        if first:
                            self._taken.append(req)  # (mapped or not: the daemon need not keep it any longer)
                handle.succeed((message.segment, message.offset) if message.segment else None, now)
        elif rpc is not None:
            rpc[1].append(message)
            rpc[0].set()

    def cut(self) -> BPSConnectionError:
        """The error of a call cut by shutdown() (see _read_loop)."""
        return BPSConnectionError("shutdown() was called in this process", peer=self.peer)

    def _unmapped(self, name: str, segment: str, exc: Exception) -> BPSError:
        """The error of an operation whose result could not be mapped, saying why where the segment is gone."""
        why = ""
        if not os.path.exists(os.path.join(SHM_DIR, segment)):
            why = (f"; the worker daemon freed it for room: it keeps an answered result for the cluster's timeout "
                   f"until its process maps it, then frees it where its results arena is at its cap "
                   f"(cluster.arena_bytes = {self.welcome.arena_bytes} bytes), and this process's reader did not "
                   f"map it in that time (was it stopped or starved of CPU?)")
        return BPSError(f"cannot map the result of {name!r} ({segment}): {exc}{why}")

    def _fail_everything(self, exc: BPSConnectionError) -> None:
        with self.lock:
            self.broken = exc
            handles = list(self.handles.values())
            self.handles.clear()
            rpcs = list(self.rpcs.values())
            self.rpcs.clear()
        for h in handles:
            h.fail(exc)
        for event, _ in rpcs:
            event.set()

    def forget(self) -> None:
        """In a forked child: close this process's copy of the socket, and only that (a shutdown would cut the
        parent's connection), so that the daemon sees the parent leave when it does."""
        self.sock.close()

    def close(self) -> None:
        """Leave (the daemon answers once the leave took effect, see Leave), shut the socket and wait (briefly)
        for the reader thread. A daemon that is gone or does not answer within the timeout is left all the same."""
        try:
            self.rpc(Leave(self.next_req()), last=True)
            left = True
        except BPSError:  # (the daemon is gone or silent, or this thread holds a lock: see bps_runtime.locks)
            left = False
        self.closing = True
        _CLOSED_AT[(self.path, self.welcome.local_rank)] = time.monotonic()
        try:
            self.sock.shutdown(_socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        # (the reader ends at the socket's end, unless it waits for a lock this thread holds: then not for long)
        self.thread.join(timeout=5.0 if left else 0.5)


def _connect(path: str, peer: str, timeout: float) -> _socket.socket:
    """A connected Unix socket; retries while the daemon's socket does not exist (yet) or refuses."""
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
                                         f"{exc.strerror}", peer=peer) from None
            time.sleep(CONNECT_RETRY_S)
        except OSError as exc:
            sock.close()
            raise BPSConnectionError(str(exc), peer=peer) from None
