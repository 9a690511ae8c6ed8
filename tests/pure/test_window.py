"""The send queue, credit, pacing window and replay memory of a worker's link (``bps_worker.window``),
without sockets: pieces of real sizes in, the frames to write out, time passed in."""

from __future__ import annotations

from dataclasses import dataclass

from bps_worker.window import (
    BATCH_ITEM_MAX_BYTES,
    BATCH_MAX_BYTES,
    PACED_MIN_BYTES,
    STALL_ANSWER_TIMES,
    WINDOW_STALL_MAX_S,
    WINDOW_STALL_S,
    Piece,
    SendWindow,
)
from protocol.messages import BATCH_HEADER_BUDGET, MAX_BATCH_ITEMS

KiB = 1024
MiB = 1024 * KiB


@dataclass(slots=True, eq=False, kw_only=True)
class Gone(Piece):
    """A piece whose caller can give it up (the link's pieces: their future is done)."""

    gone: bool = False

    def settled(self) -> bool:
        return self.gone


def make_window(window_pieces: int = 3, credit_bytes: int = 64 * MiB, **limits: int) -> SendWindow[Gone]:
    return SendWindow(credit_bytes=credit_bytes, window_pieces=window_pieces, **limits)


_reqs = iter(range(1, 1 << 30))


def piece(size: int, priority: int = 0, name: str = "w", part: int = 0, in_segments: bool = False) -> Gone:
    return Gone(req=next(_reqs), key=(name, part), priority=priority, nbytes=size, header_bytes=300,
                in_segments=in_segments)


def send(window: SendWindow[Gone], size: int, now: float = 0.0) -> Gone:
    """Offer a piece of ``size`` bytes that must go out alone, now."""
    assert not window.holds(size)
    item = piece(size)
    window.offer(item)
    assert window.next_to_send(now, 0) == [item]
    return item


def frames(window: SendWindow[Gone], now: float = 0.0) -> list[list[Gone]]:
    """Every frame the window lets go now (as a link's pump writes them)."""
    out = []
    while sent := window.next_to_send(now, 0):
        out.append(sent)
    return out


def answer_at_once(window: SendWindow[Gone], item: Gone) -> Gone | None:
    """The server answers ``item`` the instant it went: out of the window, and nothing for the stall to learn."""
    return window.answered(item.req, item.sent_at)


# -- the window of unanswered pieces (ported from the link's tests) ------------------------
def test_window_counts_pieces_of_the_largest_size_in_flight() -> None:
    """A link holds a push while its unanswered paced bytes plus the push come to more than
    window_pieces of the largest unanswered piece: smaller pieces after large ones (a range's last
    pieces are a half and a quarter of the others) do not shrink the window to a piece or two."""
    window = make_window(3)
    big = [send(window, 128 * KiB) for _ in range(3)]
    assert window.holds(128 * KiB) and window.holds(64 * KiB) and window.holds(32 * KiB)
    assert answer_at_once(window, big[0]) is big[0]  # 256 KiB in flight
    assert not window.holds(64 * KiB)  # 256 + 64 <= 3 x 128 (sized by itself: 256 + 64 > 3 x 64)
    half = send(window, 64 * KiB)
    assert not window.holds(64 * KiB) and window.holds(128 * KiB)  # 320 + 64 = 384
    send(window, 64 * KiB)
    assert window.holds(32 * KiB)  # 384 + 32 > 384
    for item in (*big[1:], half):
        answer_at_once(window, item)
    assert not window.holds(128 * KiB) and window.paced_bytes == 64 * KiB


def test_window_starts_from_the_first_piece_again_once_empty() -> None:
    """At the start of a tensor the window counts its first (small) pieces: four of 32, 64, 128 and
    128 KiB go out before the first answer, not three of 32 KiB only."""
    window = make_window(3)
    old = send(window, 256 * KiB)
    answer_at_once(window, old)
    assert window.paced_bytes == 0 and window.unit_bytes == 0
    for size in (32 * KiB, 64 * KiB, 128 * KiB, 128 * KiB):
        send(window, size)
    assert window.holds(128 * KiB)


def test_small_pushes_and_no_window_are_not_held() -> None:
    window = make_window(3)
    for _ in range(3):
        send(window, 128 * KiB)
    assert not window.holds(PACED_MIN_BYTES)  # small pushes are never held
    unpaced = make_window(0)
    for _ in range(10):
        send(unpaced, 128 * KiB)
    assert unpaced.paced_bytes == 0


# -- the queue -------------------------------------------------------------------
def test_higher_priority_first_then_first_come_first_served() -> None:
    window = make_window(0)
    pieces = [piece(1 * MiB, priority=p) for p in (0, 5, 1, 5)]
    for item in pieces:
        window.offer(item)
    assert frames(window) == [[pieces[1]], [pieces[3]], [pieces[2]], [pieces[0]]]
    assert all(window.in_flight(item.req) is item for item in pieces)


def test_settled_pieces_are_dropped_unsent() -> None:
    window = make_window(0)
    first, second = piece(1 * MiB, priority=1), piece(1 * MiB)
    window.offer(first)
    window.offer(second)
    first.gone = True
    assert window.queued_wire_bytes() == 2 * MiB  # still queued until it reaches the head
    assert frames(window) == [[second]]
    assert window.in_flight(first.req) is None and not window.has_queued


# -- credit ----------------------------------------------------------------------
def test_nothing_goes_while_the_write_buffer_holds_the_credit() -> None:
    window = make_window(0, credit_bytes=1 * MiB)
    item = piece(4 * MiB)  # larger than the credit: it goes, once the buffer is below it
    window.offer(item)
    assert window.next_to_send(0.0, 1 * MiB) == []
    assert window.next_to_send(0.0, 1 * MiB + 1) == []
    assert window.next_to_send(0.0, 1 * MiB - 1) == [item]


def test_paused_writing_holds_everything_until_resumed() -> None:
    window = make_window(0)
    item = piece(100)
    window.offer(item)
    window.pause_writing()
    assert window.next_to_send(0.0, 0) == []
    window.resume_writing()
    assert window.next_to_send(0.0, 0) == [item]


# -- pacing and the stall --------------------------------------------------------
def test_three_unanswered_pieces_then_one_per_answer() -> None:
    window = make_window(3)
    pieces = [piece(128 * KiB) for _ in range(5)]
    for item in pieces:
        window.offer(item)
    assert frames(window) == [[pieces[0]], [pieces[1]], [pieces[2]]]
    assert window.paced_bytes == 384 * KiB and window.unit_bytes == 128 * KiB
    answer_at_once(window, pieces[1])
    assert frames(window) == [[pieces[3]]]
    answer_at_once(window, pieces[0])
    assert frames(window) == [[pieces[4]]]


def test_a_stalled_window_opens_after_the_stall_time_until_the_next_answer() -> None:
    window = make_window(3)
    pieces = [piece(128 * KiB) for _ in range(6)]
    for item in pieces[:4]:
        window.offer(item)
    assert len(frames(window, now=10.0)) == 3
    assert window.stall_deadline == 10.0 + WINDOW_STALL_S  # the fourth waits from 10.0
    assert frames(window, now=10.1) == [] and window.stall_deadline == 10.0 + WINDOW_STALL_S
    assert frames(window, now=10.0 + WINDOW_STALL_S) == [[pieces[3]]]  # open...
    assert window.stall_deadline is None
    window.offer(pieces[4])
    assert frames(window, now=11.0) == [[pieces[4]]]  # ...until an answer comes
    answer_at_once(window, pieces[0])
    window.offer(pieces[5])
    assert frames(window, now=12.0) == [] and window.stall_deadline == 12.0 + WINDOW_STALL_S


def test_an_answer_before_the_stall_time_cancels_it() -> None:
    window = make_window(3)
    pieces = [piece(128 * KiB) for _ in range(5)]
    for item in pieces:
        window.offer(item)
    frames(window, now=1.0)
    assert window.stall_deadline == 1.0 + WINDOW_STALL_S
    answer_at_once(window, pieces[0])
    assert window.stall_deadline is None
    assert frames(window, now=1.1) == [[pieces[3]]]
    assert window.stall_deadline == 1.1 + WINDOW_STALL_S  # the fifth waits from now on
    assert frames(window, now=1.0 + WINDOW_STALL_S) == []  # not opened by the first stall's time


def test_where_answers_take_longer_than_the_stall_time_the_window_waits_for_several_of_them() -> None:
    """The stall follows the link's answer time (smoothed, from sent to answered): answers that take 0.4 s
    by nature (n = 8 at 100 Mbit/s) keep a waiting piece held for STALL_ANSWER_TIMES of them, where a fixed
    0.25 s opened the window at every piece; a mis-ordered step still opens it, later. Never over
    WINDOW_STALL_MAX_S; an answer that takes no time teaches nothing."""
    window = make_window(1)
    pieces = [piece(128 * KiB) for _ in range(50)]
    for item in pieces:
        window.offer(item)
    assert frames(window, now=0.0) == [[pieces[0]]]
    answer_at_once(window, pieces[0])  # at once: nothing learned
    assert window.stall_after == WINDOW_STALL_S
    now = 1.0
    assert frames(window, now=now) == [[pieces[1]]]
    window.answered(pieces[1].req, now + 1.5)  # one slow first answer (a late peer) moves it an eighth of the way
    assert abs(window.stall_after - STALL_ANSWER_TIMES * 1.5 / 8) < 1e-9
    for item in pieces[2:42]:  # then each answered 0.4 s after it went
        assert frames(window, now=now) == [[item]]
        now += 0.4
        window.answered(item.req, now)
    assert abs(window.stall_after - STALL_ANSWER_TIMES * 0.4) < 0.01
    assert frames(window, now=now) == [[pieces[42]]]  # the next goes; the one after waits from now
    deadline = window.stall_deadline
    assert deadline is not None and abs(deadline - (now + window.stall_after)) < 1e-9
    assert frames(window, now=now + 0.3) == []  # a fixed stall would have opened here (0.25 s)
    assert frames(window, now=deadline) == [[item] for item in pieces[43:]]
    for item in pieces[42:]:
        window.answered(item.req, now + 100.0)  # answers that took minutes: the stall stops at its cap
    assert window.stall_after == WINDOW_STALL_MAX_S
    fast = make_window(3)
    quick = [piece(128 * KiB) for _ in range(3)]
    for item in quick:
        fast.offer(item)
    frames(fast, now=0.0)
    for item in quick:
        fast.answered(item.req, 0.01)  # fast answers: the stall stays at its floor
    assert fast.stall_after == WINDOW_STALL_S


def test_the_stall_time_passing_while_paused_still_opens_the_window() -> None:
    """A link wakes itself at the deadline even when its transport paused writing: the window
    must open then, or the link would wake again and again at a deadline already past."""
    window = make_window(3)
    pieces = [piece(128 * KiB) for _ in range(4)]
    for item in pieces:
        window.offer(item)
    frames(window, now=0.0)
    window.pause_writing()
    assert window.next_to_send(WINDOW_STALL_S, 0) == [] and window.stall_deadline is None
    window.resume_writing()
    assert window.next_to_send(WINDOW_STALL_S + 1, 0) == [pieces[3]]


def test_shared_memory_references_are_held_by_neither_window_nor_credit() -> None:
    window = make_window(3, credit_bytes=1 * MiB)
    window.by_reference = True
    refs = [piece(4 * MiB, in_segments=True) for _ in range(5)]
    for item in refs:
        window.offer(item)
    assert window.queued_wire_bytes() == 0
    assert frames(window) == [refs]  # zero wire bytes each: small enough to batch, never paced
    assert window.paced_bytes == 0
    tcp = piece(4 * MiB)  # not in segments: goes over TCP even to this server
    window.offer(tcp)
    assert window.queued_wire_bytes() == 4 * MiB
    window.by_reference = False
    window.offer(late := piece(4 * MiB, in_segments=True))
    assert window.queued_wire_bytes() == 8 * MiB  # a server that does not map our memory: real bytes
    assert frames(window) == [[tcp], [late]]


# -- batching --------------------------------------------------------------------
def test_small_pieces_go_together_in_priority_order() -> None:
    window = make_window(3)
    small = [piece(4 * KiB, priority=p) for p in (0, 2, 1)]
    for item in small:
        window.offer(item)
    assert frames(window) == [[small[1], small[2], small[0]]]


def test_a_batch_stops_at_a_large_piece_and_a_large_piece_goes_alone() -> None:
    window = make_window(0)
    first, large, after = piece(4 * KiB, 3), piece(BATCH_ITEM_MAX_BYTES + 1, 2), piece(4 * KiB, 1)
    for item in (first, large, after):
        window.offer(item)
    assert frames(window) == [[first], [large], [after]]


def test_a_batch_holds_at_most_its_payload_limit() -> None:
    window = make_window(0)
    items = [piece(BATCH_ITEM_MAX_BYTES) for _ in range(BATCH_MAX_BYTES // BATCH_ITEM_MAX_BYTES + 1)]
    for item in items:
        window.offer(item)
    assert frames(window) == [items[:-1], items[-1:]]


def test_a_batch_holds_at_most_its_item_count_and_header_budget() -> None:
    window = make_window(0)
    items = [piece(0) for _ in range(MAX_BATCH_ITEMS + 1)]
    for item in items:
        item.header_bytes = 1
        window.offer(item)
    assert [len(f) for f in frames(window)] == [MAX_BATCH_ITEMS, 1]
    window = make_window(0)
    items = [piece(100) for _ in range(10)]
    for item in items:
        item.header_bytes = BATCH_HEADER_BUDGET // 4  # the budget is reached after four headers
        window.offer(item)
    assert [len(f) for f in frames(window)] == [4, 4, 2]


def test_batched_pieces_over_the_pacing_size_count_against_the_window() -> None:
    window = make_window(3)
    items = [piece(32 * KiB) for _ in range(5)]
    for item in items:
        window.offer(item)
    assert frames(window) == [items[:3]]  # 96 KiB = 3 x 32 KiB: the fourth waits
    assert window.paced_bytes == 96 * KiB
    answer_at_once(window, items[0])
    assert frames(window) == [[items[3]]]


def test_a_settled_piece_behind_the_first_is_dropped_from_the_batch() -> None:
    window = make_window(0)
    items = [piece(100) for _ in range(3)]
    for item in items:
        window.offer(item)
    items[1].gone = True
    assert frames(window) == [[items[0], items[2]]]


# -- answers, replays and reconnects ---------------------------------------------
def test_abandoning_a_piece_in_flight_frees_its_window_share() -> None:
    window = make_window(3)
    sent = [send(window, 128 * KiB) for _ in range(3)]
    queued = piece(128 * KiB, part=7)
    window.offer(queued)
    window.keep_sum(queued)
    assert window.next_to_send(0.0, 0) == []
    assert window.abandon(sent[0]) and window.in_flight(sent[0].req) is None
    assert answer_at_once(window, sent[0]) is None  # a late answer finds nothing
    assert not window.abandon(queued) and window.sums_kept == 0  # queued: stays, no sum replayed
    assert window.next_to_send(0.0, 0) == [queued]


def test_the_sums_of_tensors_never_pushed_again_are_not_kept() -> None:
    """An ended lane generation's fused keys (``FusedSums._forget_ended``): every partition of each goes."""
    window = make_window(3)
    kept = []
    for name, part in (("old.a", 0), ("old.a", 1), ("old.b", 0), ("new", 0), ("new", 1)):
        item = send(window, 128 * KiB)
        item.key = (name, part)
        assert answer_at_once(window, item) is item
        window.keep_sum(item)
        kept.append(item)
    window.drop_sums_of({"old.a", "old.b", "never.pushed"})
    assert window.sums_kept == 2 and window.restarted() == kept[3:]


def test_a_restarted_server_gets_the_kept_sums_then_the_held_pieces_again() -> None:
    window = make_window(3)
    done = [send(window, 128 * KiB) for _ in range(2)]
    for part, item in enumerate(done, start=10):
        item.key = ("w", part)
        assert answer_at_once(window, item) is item
        window.keep_sum(item)
    newer = send(window, 128 * KiB)
    newer.key = done[1].key
    answer_at_once(window, newer)
    window.keep_sum(newer)  # the last sum of its partition replaces the one before
    failed = send(window, 128 * KiB)
    failed.key = ("w", 12)
    answer_at_once(window, failed)
    window.keep_sum(failed)
    window.drop_sum(failed.key)  # its next round failed: nothing of it is replayed
    a, b = piece(128 * KiB, part=1), piece(128 * KiB, part=2)
    later = piece(128 * KiB, part=3)
    window.offer(a)
    window.offer(b)
    assert frames(window) == [[a], [b]]
    window.offer(later)
    window.hold()
    assert a.held and b.held and not later.held and window.held_count == 2
    assert window.in_flight(a.req) is None and window.paced_bytes == 0 and window.unit_bytes == 0
    assert window.queued_wire_bytes() == 3 * 128 * KiB
    assert window.sums_kept == 2
    assert window.restarted() == [done[0], newer]
    assert not a.held and not b.held and window.held_count == 0
    assert frames(window) == [[a], [b], [later]]  # in their first order: ahead of the later piece


def test_the_same_server_again_sends_the_held_pieces_again_in_their_places() -> None:
    window = make_window(0)
    a, b = piece(1 * MiB, part=1), piece(1 * MiB, part=2)
    window.offer(a)
    assert frames(window) == [[a]]
    window.offer(b)
    window.hold()
    assert window.resumed() == [a] and not a.held
    assert frames(window) == [[a], [b]]  # (a was offered first: it goes first again)
    assert window.resumed() == []


def test_clear_takes_everything_out_and_drop_sums_forgets_the_replays() -> None:
    window = make_window(3)
    sent = send(window, 128 * KiB)
    queued = piece(128 * KiB, part=1)
    window.offer(queued)
    window.keep_sum(sent)
    assert window.clear() == [sent, queued]
    assert not window.has_queued and window.in_flight(sent.req) is None and window.paced_bytes == 0
    assert window.restarted() == [sent]  # sums survive a clear: the job is not over
    window.drop_sums()
    assert window.restarted() == []


def test_a_sum_answered_after_the_job_ended_is_not_kept_for_the_next_job() -> None:
    # Every training process left (drop_sums: the results are being freed) while a push was in flight; its round
    # completed anyway. Kept, it would be replayed to a restarted server in the next job with the old round.
    window = make_window(3)
    old = send(window, 128 * KiB)
    window.drop_sums()
    assert answer_at_once(window, old) is old
    window.keep_sum(old)
    assert window.restarted() == []
    new = send(window, 128 * KiB)
    assert answer_at_once(window, new) is new
    window.keep_sum(new)
    assert window.restarted() == [new]
