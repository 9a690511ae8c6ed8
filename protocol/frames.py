"""Length-prefixed frames: a msgpack control header plus an optional raw payload.

Layout on the wire (network byte order)::

    u32 header_len | u64 payload_len | header (msgpack map) | payload (raw bytes)

Tensor bytes only ever travel as the raw payload; they are never msgpack-encoded.

Theory of operation of :class:`FrameReader` (sans-IO, shaped for
``asyncio.BufferedProtocol`` and for ``socket.recv_into``):

* The caller asks :meth:`FrameReader.get_buffer` where to put incoming bytes,
  writes into it, and reports the count with :meth:`FrameReader.buffer_updated`,
  which returns the frames completed by those bytes.
* Headers are parsed out of an internal receive buffer. Once a header announces
  a payload, the reader asks the optional ``payload_sink(header, nbytes)`` for a
  destination (for example a slice of a tensor's staging buffer); without a sink
  it allocates a ``bytearray``. Large payloads are then received *directly* into
  that destination, so a tensor partition is not copied after the kernel wrote it.
* Right after such a payload, the next buffer handed out is only ``HEADER_PEEK_BYTES``
  long: the read that brings the next frame's header then brings at most that much of
  its payload, which is all that is copied; the rest is received in place. (With the
  whole receive buffer, a read took a header with up to 256 KiB of its payload behind
  it, copied again: about 40% of a daemon's received bytes at 1 Gbit/s.) The same holds
  for the last bytes of a large payload (fewer than ``DIRECT_RECEIVE_MIN_BYTES``, read
  into the buffer): the read asks for them and a peek's worth more. Peeks go on while
  they come back short (a small frame, or nothing yet); a full one may be a header
  longer than a peek or a run of small frames, and the whole buffer is handed out next.
* Limits are checked as soon as the prefix is in, before anything is allocated.
  Any violation raises :class:`RemoteProtocolError` (with ``size`` and ``limit``);
  afterwards the reader is in an error state and refuses further use with a
  :class:`LocalProtocolError` (the connection must be closed).

Sending is pure as well: :func:`encode_message` gives a message's prefix and header,
:func:`encode_frame` the buffers of one whole frame, and :class:`BatchWriter` gathers
small messages into one ``Batch`` frame. They return bytes; the caller writes them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable, Final, TypeAlias

import msgpack

from .errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from .messages import BATCH_HEADER_BUDGET, MAX_BATCH_ITEMS, Message, batch_header, estimated_header_bytes, to_header

PREFIX: Final = struct.Struct("!IQ")
DEFAULT_MAX_HEADER_BYTES: Final = 64 * 1024
DEFAULT_MAX_PAYLOAD_BYTES: Final = 1 << 30
RECEIVE_BUFFER_BYTES: Final = 256 * 1024
# Payload remainders at least this large are received straight into their destination.
DIRECT_RECEIVE_MIN_BYTES: Final = 16 * 1024
# After a payload received in place, the next read asks for this much: a frame's prefix and header (a Push's
# or a Result's is a few hundred bytes), and little of its payload, which is then copied (see the docstring).
HEADER_PEEK_BYTES: Final = 4 * 1024

# Payloads up to this size may travel inside a Batch frame (larger ones get a frame of their own).
BATCH_ITEM_MAX_BYTES: Final = 64 * 1024

PayloadSink = Callable[[dict[str, Any], int], memoryview]
# What a sender hands over as a payload: anything with the buffer protocol, C-contiguous (bytes, bytearray,
# memoryview, a numpy array); typing has no name for that before Python 3.12's collections.abc.Buffer.
Payload: TypeAlias = Any


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame: the header map and the payload (None when empty)."""

    header: dict[str, Any]
    payload: memoryview | None


def encode_header(
    header: dict[str, Any],
    payload_nbytes: int = 0,
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> bytes:
    """Return prefix + encoded header; the caller sends ``payload_nbytes`` raw bytes after it.

    Raises LocalProtocolError before anything is written if a limit would be exceeded.
    """
    body = msgpack.packb(header, use_bin_type=True)
    if len(body) > max_header_bytes:
        raise LocalProtocolError(what="frame header", size=len(body), limit=max_header_bytes)
    if payload_nbytes < 0 or payload_nbytes > max_payload_bytes:
        raise LocalProtocolError(what="frame payload", size=payload_nbytes, limit=max_payload_bytes)
    return PREFIX.pack(len(body), payload_nbytes) + body


def encode_message(
    message: Message,
    payload_nbytes: int = 0,
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> bytes:
    """Prefix + header of a frame carrying ``message``; ``payload_nbytes`` raw bytes follow it.

    The same bytes as ``encode_header(to_header(message), payload_nbytes)``; LocalProtocolError on a limit."""
    return encode_header(to_header(message), payload_nbytes,
                         max_header_bytes=max_header_bytes, max_payload_bytes=max_payload_bytes)


def _as_bytes_view(payload: Payload) -> memoryview:
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def encode_frame(
    message: Message,
    payload: Payload | None = None,
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> list[bytes | memoryview]:
    """The buffers of one frame, for ``transport.writelines``: the header, then the payload if it has bytes."""
    view = None if payload is None else _as_bytes_view(payload)
    nbytes = 0 if view is None else view.nbytes
    head = encode_message(message, nbytes, max_header_bytes=max_header_bytes, max_payload_bytes=max_payload_bytes)
    return [head, view] if view is not None and nbytes else [head]


class BatchWriter:
    """Gathers small messages and their payloads into one ``Batch`` frame (pure: it returns the bytes).

    Many small rounds complete at once (thousands of tiny tensors): one frame for all of them saves a
    frame, a system call and a wake-up each. The sender asks :meth:`fits` before it adds an item,
    :meth:`add` says when the batch is full (send it now), and :meth:`flush` returns the frame's buffers and
    empties the writer. One item leaves as a plain frame, several as a Batch whose payload is theirs back
    to back. Limits:

    * ``max_items`` items and about ``header_budget`` header bytes (estimated with
      :func:`~protocol.messages.estimated_header_bytes`, well under the header limit);
    * ``max_payload_bytes`` of payload in all (a batch is one frame: the peer's payload limit holds for it,
      and a sender may keep it smaller still);
    * items of at most ``item_max_bytes`` each (:meth:`batchable`).
    """

    __slots__ = ("max_items", "header_budget", "max_payload_bytes", "max_header_bytes", "item_max_bytes",
                 "_items", "_header_bytes", "_payload_bytes")

    def __init__(
        self,
        *,
        max_items: int = MAX_BATCH_ITEMS,
        header_budget: int = BATCH_HEADER_BUDGET,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        item_max_bytes: int = BATCH_ITEM_MAX_BYTES,
    ) -> None:
        self.max_items = max_items
        self.header_budget = header_budget
        self.max_payload_bytes = max_payload_bytes
        self.max_header_bytes = max_header_bytes
        self.item_max_bytes = item_max_bytes
        self._items: list[tuple[Message, memoryview | None]] = []
        self._header_bytes = 0
        self._payload_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def payload_nbytes(self) -> int:
        """Payload bytes gathered so far."""
        return self._payload_bytes

    @property
    def full(self) -> bool:
        """No further item may join: the item count or the header budget is reached."""
        return len(self._items) >= self.max_items or self._header_bytes >= self.header_budget

    def batchable(self, payload_nbytes: int) -> bool:
        """Whether a payload this large may travel in a batch at all."""
        return payload_nbytes <= self.item_max_bytes

    def fits(self, payload_nbytes: int) -> bool:
        """Whether an item with ``payload_nbytes`` may join this batch now (else flush first)."""
        return (not self.full and self.batchable(payload_nbytes)
                and self._payload_bytes + payload_nbytes <= self.max_payload_bytes)

    def add(self, message: Message, payload: Payload | None = None) -> bool:
        """Append one item; True when the batch is now full and should be flushed."""
        view = None if payload is None else _as_bytes_view(payload)
        self._items.append((message, view))
        self._header_bytes += estimated_header_bytes(message)
        self._payload_bytes += 0 if view is None else view.nbytes
        return self.full

    def flush(self) -> list[bytes | memoryview]:
        """The buffers of the gathered frame (none when empty); the writer is empty afterwards."""
        items, self._items = self._items, []
        self._header_bytes = self._payload_bytes = 0
        if not items:
            return []
        if len(items) == 1:
            return encode_frame(*items[0], max_header_bytes=self.max_header_bytes,
                                max_payload_bytes=self.max_payload_bytes)
        parts = [(m, 0 if p is None else p.nbytes) for m, p in items]
        payloads: list[bytes | memoryview] = [p for _, p in items if p is not None and p.nbytes]
        head = encode_header(batch_header(parts), sum(n for _, n in parts), max_header_bytes=self.max_header_bytes,
                             max_payload_bytes=self.max_payload_bytes)
        return [head, *payloads]


def decode_header(body: bytes | memoryview) -> dict[str, Any]:
    """Decode a received msgpack header map; anything but a map with a string ``t`` is a RemoteProtocolError."""
    try:
        header = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many unrelated types on garbage
        raise RemoteProtocolError(f"undecodable frame header: {exc.__class__.__name__}: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("t"), str):
        raise RemoteProtocolError("frame header is not a map with a string field 't'")
    return header


class FrameReader:
    """Incremental frame parser (see the module docstring for the theory of operation)."""

    def __init__(
        self,
        *,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        payload_sink: PayloadSink | None = None,
        buffer_bytes: int = RECEIVE_BUFFER_BYTES,
    ) -> None:
        self.max_header_bytes = max_header_bytes
        self.max_payload_bytes = max_payload_bytes
        self.payload_sink = payload_sink
        # The receive buffer. A header larger than it makes it grow, up to one whole header (get_buffer), so
        # a reader for a peer that has not proved itself yet may start small (issue 14, item 5); set_limits
        # makes it larger once the peer is known.
        self._buf = bytearray(max(buffer_bytes, PREFIX.size + 1))
        self._view = memoryview(self._buf)
        self._start = 0  # first unparsed byte in _buf
        self._end = 0  # one past the last received byte in _buf
        self._header: dict[str, Any] | None = None  # header of the frame whose payload is pending
        self._dest: memoryview | None = None
        self._filled = 0
        self._direct = False  # the last get_buffer() handed out the payload destination
        self._peek = False  # a payload was just received in place: the next read asks for a header's worth
        # What made the reader unusable, as text: the exception itself would hold its traceback's frames, and
        # through them this reader and its caller (a cycle that only the cyclic collector could free).
        self._error: str | None = None

    def set_limits(self, *, max_header_bytes: int, max_payload_bytes: int,
                   buffer_bytes: int = RECEIVE_BUFFER_BYTES) -> None:
        """New limits (e.g. the larger ones of an authenticated peer); the receive buffer grows to
        ``buffer_bytes``, keeping the bytes not parsed yet. It never shrinks."""
        self.max_header_bytes = max_header_bytes
        self.max_payload_bytes = max_payload_bytes
        if buffer_bytes > len(self._buf):
            self._grow(buffer_bytes)

    @property
    def buffer_bytes(self) -> int:
        """The size of the receive buffer (what this reader holds between frames)."""
        return len(self._buf)

    # -- receiving -------------------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes must be written."""
        self._check_usable()
        if self._dest is not None and len(self._dest) - self._filled >= DIRECT_RECEIVE_MIN_BYTES \
                and self._start == self._end:
            self._direct = True
            return self._dest[self._filled:]
        self._direct = False
        if self._start == self._end:
            self._start = self._end = 0
            if self._dest is not None and len(self._dest) >= DIRECT_RECEIVE_MIN_BYTES:
                return self._view[:len(self._dest) - self._filled + HEADER_PEEK_BYTES]  # a large payload's tail
            if self._peek:  # until a peek comes back full (a read that finds nothing reports nothing)
                return self._view[:HEADER_PEEK_BYTES]
        elif len(self._buf) - self._end < PREFIX.size + self.max_header_bytes:
            # Compact so a whole header fits after the unparsed bytes, if the buffer can hold it; if they
            # fill it, it grows (doubling, up to one whole header: more is never unparsed, see _parse).
            remaining = self._end - self._start
            if remaining == len(self._buf):
                self._grow(max(min(2 * len(self._buf), PREFIX.size + self.max_header_bytes), remaining + 1))
            else:
                self._buf[:remaining] = self._buf[self._start:self._end]
                self._start, self._end = 0, remaining
        return self._view[self._end:]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Account for ``nbytes`` written into the last buffer; return the completed frames."""
        self._check_usable()
        if self._direct:
            self._direct = False
            self._filled += nbytes
            self._peek = True
            frames: list[Frame] = []
            self._finish_payload_if_complete(frames)
            return frames
        self._end += nbytes
        # A short peek (a small frame, or none yet) keeps peeking; a full one may be a run of small frames.
        self._peek = self._peek and nbytes < HEADER_PEEK_BYTES
        try:
            return self._parse()
        except ProtocolError as exc:
            self._error = str(exc)
            raise

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Feed bytes that were received elsewhere (tests, fuzzers, simple transports)."""
        frames: list[Frame] = []
        data = memoryview(data).cast("B")
        while data:
            buf = self.get_buffer()
            n = min(len(buf), len(data))
            buf[:n] = data[:n]
            data = data[n:]
            frames.extend(self.buffer_updated(n))
        return frames

    @property
    def pending_destination(self) -> memoryview | None:
        """Where the rest of the frame now being received will go (None between payloads)."""
        return self._dest

    def discard_pending_payload(self) -> None:
        """Receive the rest of the current payload into scratch space, not its destination.

        For a receiver that gave up on the frame (its destination is being reused)."""
        if self._dest is not None:
            self._dest = memoryview(bytearray(len(self._dest)))

    @property
    def payload_wanted(self) -> int:
        """Bytes still to come of the payload now being received (0 between payloads)."""
        return 0 if self._dest is None else len(self._dest) - self._filled

    @property
    def payload_pending(self) -> bool:
        """True while part of a frame has been received but not all of it."""
        return self._header is not None or self._start != self._end

    # -- internals -------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._error is not None:
            raise LocalProtocolError(f"frame reader unusable after an earlier error: {self._error}")

    def _grow(self, size: int) -> None:
        """A receive buffer of ``size`` bytes, holding the unparsed bytes at its start."""
        unparsed = self._end - self._start
        grown = bytearray(size)
        grown[:unparsed] = self._view[self._start:self._end]
        self._buf, self._view = grown, memoryview(grown)
        self._start, self._end = 0, unparsed

    def _parse(self) -> list[Frame]:
        frames: list[Frame] = []
        while True:
            if self._dest is not None:
                take = min(len(self._dest) - self._filled, self._end - self._start)
                self._dest[self._filled:self._filled + take] = self._view[self._start:self._start + take]
                self._filled += take
                self._start += take
                if not self._finish_payload_if_complete(frames):
                    return frames
                continue
            available = self._end - self._start
            if available < PREFIX.size:
                return frames
            header_len, payload_len = PREFIX.unpack_from(self._buf, self._start)
            if header_len > self.max_header_bytes:
                raise RemoteProtocolError(what="frame header", size=header_len, limit=self.max_header_bytes)
            if payload_len > self.max_payload_bytes:
                raise RemoteProtocolError(what="frame payload", size=payload_len, limit=self.max_payload_bytes)
            if available < PREFIX.size + header_len:
                return frames
            body_start = self._start + PREFIX.size
            header = decode_header(self._view[body_start:body_start + header_len])
            self._start = body_start + header_len
            if payload_len == 0:
                frames.append(Frame(header, None))
                continue
            self._header = header
            self._dest = self._destination(header, payload_len)
            self._filled = 0

    def _destination(self, header: dict[str, Any], nbytes: int) -> memoryview:
        if self.payload_sink is None:
            return memoryview(bytearray(nbytes))
        try:
            dest = self.payload_sink(header, nbytes)
        except ProtocolError:
            raise
        except Exception as exc:  # the peer sent a payload we have no place for (an unknown request, ...)
            raise RemoteProtocolError(f"no destination for a payload of {nbytes} bytes: {exc}") from None
        if not isinstance(dest, memoryview) or dest.nbytes != nbytes or dest.readonly:  # our sink's bug
            raise LocalProtocolError(f"payload sink gave a wrong destination for {nbytes} bytes")
        return dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest

    def _finish_payload_if_complete(self, frames: list[Frame]) -> bool:
        assert self._dest is not None and self._header is not None  # internal invariant
        if self._filled < len(self._dest):
            return False
        frames.append(Frame(self._header, self._dest))
        self._header = None
        self._dest = None
        self._filled = 0
        return True
