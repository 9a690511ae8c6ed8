"""What a worker's link to one server sends next: the send queue, credit and pacing window, sans-IO.

Theory of operation of :class:`SendWindow` (no asyncio, no sockets; the link does the I/O):

* The link :meth:`~SendWindow.offer`\\ s every push as a :class:`Piece`. Pieces wait in a heap ordered
  by (priority, sequence): higher priority first, then first come first served.
* The link asks :meth:`~SendWindow.next_to_send` for the next frame, passing the time and the bytes
  in its transport's write buffer, and writes what it gets (one piece, or several for one
  ``Batch``) before it asks again; an empty list means "nothing now". Nothing goes while the
  transport paused writing (:meth:`~SendWindow.pause_writing`) or its buffer holds ``credit_bytes``
  (the link's share of ``cluster.credit_bytes``): a huge tensor queued first delays a small,
  higher-priority one by at most the credit. Credit comes back as the kernel takes the bytes, not
  when the sum comes back, so a round that waits for a slow peer never blocks other tensors'
  pushes (no credit deadlock).
* **Pacing.** A TCP piece over ``paced_min_bytes`` also counts against a window of unanswered
  pieces while the server has not answered it: it goes only while this link's unanswered paced
  bytes, with it, come to at most ``window_pieces`` (the link's part of ``cluster.window_pieces``,
  ``bps_worker.placement.Placement.stream_window``; 0: no pacing) times the largest of them since
  the window was last empty. The first and last pieces of a range are smaller
  (``bps_worker.placement``); counted in their own size they would shrink the window to a piece or
  two and stall the flow at its end. A server answers a partition only once every
  worker pushed it, so a worker whose flow to a server runs ahead of the others' flows to it stops
  there, and its uplink carries its flows to the servers where it is behind: all flows into a
  server progress together, and each partition's sum leaves as soon as possible (measured on
  emulated links, ``benchmarks/RESULTS.md``).
* **Stall.** A round that waits for a slow peer must not block other tensors for ever (names may
  come in different orders on different processes): once a piece has waited for the window
  without any answer coming, the window opens until the next answer. It waits ``stall_s``, or
  ``STALL_ANSWER_TIMES`` of the link's answer time (smoothed over its paced pieces, from sent to
  answered) where that is longer, up to ``WINDOW_STALL_MAX_S``: where answers take longer than
  ``stall_s`` by nature (many workers, slow links), a fixed stall opened the windows at every piece
  and the bursts overflowed the switches' queues (measured on emulated links, n = 8 at 100 Mbit/s,
  ``benchmarks/RESULTS.md``). The time is passed in; the link wakes itself at
  :attr:`~SendWindow.stall_deadline`.
* **Batching.** A piece of at most ``batch_item_max_bytes`` takes the small pieces queued right
  behind it (in priority order) into the same frame, while they fit ``batch_max_bytes`` of payload,
  ``max_batch_items`` and ``batch_header_budget`` of headers, and the window lets them go.
* **By reference.** While the server maps this worker's shared memory (:attr:`by_reference`), a
  piece whose data and result lie in segments goes as a reference of a few header bytes: zero
  wire bytes, so neither credit nor window holds it (all of a large tensor's pieces reach the
  server at once, and priorities do not reorder them there).
* **Reconnects.** :meth:`answered` takes a piece out of flight; the link records a summed one
  with :meth:`keep_sum`, the last of its partition, which a restarted server is given again
  (replayed). When a connection breaks, :meth:`hold` puts what was in flight back in the queue,
  held: the next server tells whether it is a new run (:meth:`restarted`: the kept sums are to be
  replayed and the held pieces go again) or the same one (:meth:`resumed`: the held pieces are
  taken out, to be failed). :meth:`clear` takes everything out, to be failed.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Container, Final, Generic, Iterator, TypeVar

from protocol.messages import BATCH_HEADER_BUDGET, MAX_BATCH_ITEMS

# Pieces up to this size leave in Batch frames, up to BATCH_MAX_BYTES of payload per frame.
BATCH_ITEM_MAX_BYTES: Final = 64 * 1024
BATCH_MAX_BYTES: Final = 1 << 20
# TCP pieces over this size count against the window (batched ones too).
PACED_MIN_BYTES: Final = 16 * 1024
# Without any answer for this long, a piece the window holds opens it until the next answer; or for
# STALL_ANSWER_TIMES of the link's smoothed answer time (weight ANSWER_SMOOTHING a sample) where that is longer,
# but never longer than WINDOW_STALL_MAX_S.
WINDOW_STALL_S: Final = 0.25
STALL_ANSWER_TIMES: Final = 4
ANSWER_SMOOTHING: Final = 1 / 8
WINDOW_STALL_MAX_S: Final = 2.0


@dataclass(slots=True, eq=False, kw_only=True)
class Piece:
    """One push as the window sees it; the link's subclass adds its buffers and its future.

    The link fills the first five fields; ``seq``, ``paced``, ``sent_at`` and ``held`` are the window's.
    """

    req: int  # the push's request id, unique on the link
    key: tuple[str, int]  # (name, part): the partition whose last sum is replayed
    priority: int
    nbytes: int  # payload bytes it carries over TCP
    header_bytes: int = 0  # an upper bound of its encoded header (messages.estimated_header_bytes)
    in_segments: bool = False  # its data and its result lie in shared-memory segments
    seq: int = 0  # order of offer, among equal priorities
    paced: int = 0  # bytes it counts against the window while unanswered
    sent_at: float = 0.0  # when it went (the link's clock), for the answer time of paced pieces
    held: bool = False  # sent on a connection that broke; awaiting the next server's verdict

    def settled(self) -> bool:
        """Whether its outcome is already decided elsewhere (its caller gave up): it is dropped unsent."""
        return False


P = TypeVar("P", bound=Piece)


class SendWindow(Generic[P]):
    """The send queue, credit, pacing window and replay memory of one link (see the module docstring)."""

    __slots__ = ("credit_bytes", "window_pieces", "paced_min_bytes", "stall_s", "batch_item_max_bytes",
                 "batch_max_bytes", "max_batch_items", "batch_header_budget", "by_reference", "_paused",
                 "_queue", "_seq", "_inflight", "_sums", "_sums_from", "_paced", "_unit", "_open", "_stalled_since",
                 "_answer_s")

    def __init__(self, *, credit_bytes: int, window_pieces: int, paced_min_bytes: int = PACED_MIN_BYTES,
                 stall_s: float = WINDOW_STALL_S, batch_item_max_bytes: int = BATCH_ITEM_MAX_BYTES,
                 batch_max_bytes: int = BATCH_MAX_BYTES, max_batch_items: int = MAX_BATCH_ITEMS,
                 batch_header_budget: int = BATCH_HEADER_BUDGET) -> None:
        self.credit_bytes = credit_bytes
        self.window_pieces = window_pieces
        self.paced_min_bytes = paced_min_bytes
        self.stall_s = stall_s
        self.batch_item_max_bytes = batch_item_max_bytes
        self.batch_max_bytes = batch_max_bytes  # a batch is one frame: at most the peer's payload limit
        self.max_batch_items = max_batch_items
        self.batch_header_budget = batch_header_budget
        self.by_reference = False  # the server maps our segments: pieces in_segments go as references
        self._paused = False  # the transport paused writing
        self._queue: list[tuple[int, int, P]] = []  # heap of (-priority, seq, piece)
        self._seq = itertools.count()
        self._inflight: dict[int, P] = {}  # by req: sent, not answered
        self._sums: dict[tuple[str, int], P] = {}  # by (name, part): the last summed piece, for replays
        self._sums_from = 0  # the first seq whose sum is kept: those offered before the job ended are not
        self._paced = 0  # bytes of unanswered paced pieces
        self._unit = 0  # the largest of them since the window was last empty
        self._open = False  # a piece waited stall_after without an answer: the window is ignored until one
        self._stalled_since: float | None = None  # when a piece first waited for the window
        self._answer_s = 0.0  # smoothed answer time of paced pieces

    # -- the queue -------------------------------------------------------------------
    def offer(self, piece: P) -> None:
        """Queue ``piece`` to be sent."""
        piece.seq = next(self._seq)
        heapq.heappush(self._queue, (-piece.priority, piece.seq, piece))

    def wire_nbytes(self, piece: Piece) -> int:
        """Bytes ``piece`` puts on the wire now: none when it goes as a shared-memory reference."""
        return 0 if self.by_reference and piece.in_segments else piece.nbytes

    def queued_wire_bytes(self) -> int:
        """Wire bytes of every queued piece (held ones included)."""
        return sum(self.wire_nbytes(piece) for _, _, piece in self._queue)

    @property
    def has_queued(self) -> bool:
        return bool(self._queue)

    def queued(self) -> Iterator[P]:
        """The queued pieces, held ones included, in no particular order."""
        return (piece for _, _, piece in self._queue)

    def in_flight(self, req: int) -> P | None:
        """The piece sent as ``req`` and not answered yet, if any."""
        return self._inflight.get(req)

    def pieces(self) -> Iterator[P]:
        """Every piece the window holds: in flight first, then queued."""
        yield from self._inflight.values()
        yield from self.queued()

    # -- sending ---------------------------------------------------------------------
    def pause_writing(self) -> None:
        """The transport's buffer went over its high-water mark (the credit): send nothing."""
        self._paused = True

    def resume_writing(self) -> None:
        """The transport drained to its low-water mark: sending may go on."""
        self._paused = False

    def next_to_send(self, now: float, buffered_bytes: int) -> list[P]:
        """The pieces of the next frame to write (one, or several for a Batch); empty: nothing now.

        ``buffered_bytes``: the transport's write buffer. The pieces are in flight once returned.
        """
        if self._stalled_since is not None and now >= self._stalled_since + self.stall_after:
            self._open = True  # even while paused: the deadline has passed, it must not be waited for again
            self._stalled_since = None
        if self._paused or buffered_bytes >= self.credit_bytes:
            return []
        while self._queue:
            first = self._queue[0][2]
            if first.settled():
                heapq.heappop(self._queue)
                continue
            size = self.wire_nbytes(first)
            if self.holds(size):
                if self._stalled_since is None:
                    self._stalled_since = now
                return []
            heapq.heappop(self._queue)
            self._take(first, size, now)
            if size <= self.batch_item_max_bytes and self._queue:
                return self._batch(first, size, now)
            return [first]
        return []

    @property
    def paced_bytes(self) -> int:
        """Bytes of the unanswered paced pieces."""
        return self._paced

    @property
    def unit_bytes(self) -> int:
        """The largest unanswered paced piece since the window was last empty: what it counts in."""
        return self._unit

    @property
    def stall_after(self) -> float:
        """How long a piece waits for the window without an answer before it opens it (module docstring)."""
        return max(self.stall_s, min(STALL_ANSWER_TIMES * self._answer_s, WINDOW_STALL_MAX_S))

    @property
    def stall_deadline(self) -> float | None:
        """When a piece held by the window opens it (None: none is waiting for it)."""
        return None if self._stalled_since is None else self._stalled_since + self.stall_after

    def _batch(self, first: P, nbytes: int, now: float) -> list[P]:
        """``first`` with the small pieces queued right behind it that fit in one Batch frame."""
        items = [first]
        header_bytes = first.header_bytes
        while self._queue and len(items) < self.max_batch_items and header_bytes < self.batch_header_budget:
            nxt = self._queue[0][2]
            size = self.wire_nbytes(nxt)
            if size > self.batch_item_max_bytes or nbytes + size > self.batch_max_bytes or self.holds(size):
                break
            heapq.heappop(self._queue)
            if nxt.settled():
                continue
            self._take(nxt, size, now)
            items.append(nxt)
            nbytes += size
            header_bytes += nxt.header_bytes
        return items

    def holds(self, size: int) -> bool:
        """Whether a piece of ``size`` wire bytes would wait for answers now (see the module docstring)."""
        return (size > self.paced_min_bytes and self.window_pieces > 0 and self._paced > 0
                and self._paced + size > self.window_pieces * max(size, self._unit) and not self._open)

    def _take(self, piece: P, size: int, now: float) -> None:
        """``piece`` (``size`` wire bytes) goes out ``now``: in flight, and in the window if paced."""
        if size > self.paced_min_bytes and self.window_pieces > 0:
            piece.paced, piece.sent_at = size, now
            self._paced += size
            self._unit = max(self._unit, size)
        self._inflight[piece.req] = piece

    # -- answers ---------------------------------------------------------------------
    def answered(self, req: int, now: float) -> P | None:
        """The server answered ``req`` (a sum or a failure) at ``now`` (the link's clock): its piece, out of
        flight and out of the window."""
        piece = self._inflight.pop(req, None)
        if piece is not None:
            if piece.paced:
                # Smoothed from 0: one slow first answer (a late peer, not the link) moves it an eighth of the way.
                sample = max(0.0, now - piece.sent_at)
                self._answer_s += (sample - self._answer_s) * ANSWER_SMOOTHING
            self._release(piece)
        return piece

    def abandon(self, piece: P) -> bool:
        """Its caller gave ``piece`` up: no sum of it is replayed, and if it is in flight (returns True)
        it leaves the window as if answered (a late answer finds no piece). A queued one stays, and is
        dropped unsent once :meth:`Piece.settled`. The sum kept of an earlier piece of its partition stays
        (the link drops it where the partition's round is lost, :meth:`drop_sum`)."""
        if self._sums.get(piece.key) is piece:
            del self._sums[piece.key]
        if self._inflight.get(piece.req) is not piece:
            return False
        del self._inflight[piece.req]
        self._release(piece)
        return True

    def _release(self, piece: P) -> None:
        """``piece`` left the server's hands: its bytes leave the window, and any answer closes it."""
        if piece.paced:
            self._paced -= piece.paced
            piece.paced = 0
            if self._paced == 0:
                self._unit = 0
        self._open = False
        self._stalled_since = None

    # -- replays and reconnects ------------------------------------------------------
    def keep_sum(self, piece: P) -> None:
        """``piece`` was summed: the last sum of its partition, replayed to a restarted server; not one of a
        job that ended since it was offered (see :meth:`drop_sums`)."""
        if self.of_this_job(piece):
            self._sums[piece.key] = piece

    def of_this_job(self, piece: P) -> bool:
        """Whether ``piece`` was offered since the job last ended (:meth:`drop_sums`): an answer to one offered
        before is the old job's, whose rounds the next job numbers again from 0."""
        return piece.seq >= self._sums_from

    def kept(self) -> Iterator[P]:
        """The pieces whose sums are kept (:meth:`keep_sum`)."""
        return iter(self._sums.values())

    def drop_sum(self, key: tuple[str, int]) -> None:
        """The partition's round failed: nothing of it is replayed."""
        self._sums.pop(key, None)

    def drop_sums_of(self, names: Container[str]) -> None:
        """Tensors ``names`` are never pushed again (the fused keys of a lane generation that ended): none of
        their sums is replayed. Kept, they grew by a generation's keys at every reset anywhere in the job."""
        for key in [key for key in self._sums if key[0] in names]:
            del self._sums[key]

    def drop_sums(self) -> None:
        """The job ended (its buffers are being freed): nothing is replayed any more, nor kept of what it still
        had in flight (an answer that comes after would be replayed, with the old job's round, in the next)."""
        self._sums.clear()
        self._sums_from = next(self._seq)

    def hold(self) -> list[P]:
        """The connection broke and the server may be restarting: what was in flight is queued again,
        held until the next server's verdict (:meth:`restarted` or :meth:`resumed`); but not what a job that ended
        since it went had in flight (:meth:`drop_sums`): returned, to be failed. Sent again, behind the Reset, it
        opened the ended job's round at the server again (a review's case: a server restarted after a reset)."""
        ended = []
        for piece in self._inflight.values():
            if not self.of_this_job(piece):
                ended.append(piece)
                continue
            piece.held = True
            heapq.heappush(self._queue, (-piece.priority, piece.seq, piece))
        self._inflight.clear()
        self._reset_pacing()
        return ended

    def restarted(self) -> list[P]:
        """The next server is a new run: returns the kept sums to replay first; the held pieces go again."""
        for _, _, piece in self._queue:
            piece.held = False
        return list(self._sums.values())

    def resumed(self) -> list[P]:
        """The next server is the same run: the held pieces go again, in their places, and are returned (the
        link says each is a resumed push, or fails it: see ``bps_worker.link``)."""
        held = [piece for _, _, piece in self._queue if piece.held]
        for piece in held:
            piece.held = False
        return held

    @property
    def held_count(self) -> int:
        return sum(1 for _, _, piece in self._queue if piece.held)

    @property
    def sums_kept(self) -> int:
        return len(self._sums)

    def take_inflight(self) -> list[P]:
        """Take the pieces in flight out (those that went on the connection that broke), to be failed; the queued
        ones stay."""
        pieces = list(self._inflight.values())
        self._inflight.clear()
        self._reset_pacing()
        return pieces

    def take_queued(self) -> list[P]:
        """Take the queued pieces out (held ones too), to be failed; those in flight stay, answered as ever. The job
        ended here: nothing more of it goes (ServerLink.reset)."""
        pieces = [piece for _, _, piece in self._queue]
        self._queue = []
        self._stalled_since = None
        return pieces

    def clear(self) -> list[P]:
        """Take every piece out (in flight first, then queued), to be failed."""
        pieces = [*self._inflight.values(), *(piece for _, _, piece in self._queue)]
        self._inflight.clear()
        self._queue = []
        self._reset_pacing()
        return pieces

    def _reset_pacing(self) -> None:
        self._paced = 0
        self._unit = 0
        self._open = False
        self._stalled_since = None
        for _, _, piece in self._queue:
            piece.paced = 0
