"""The pacing window of a worker's link to a server (``bps_worker.links.ServerLink``), without I/O."""

from __future__ import annotations

from types import SimpleNamespace

from bps_worker.links import PACED_MIN_BYTES, ServerLink
from protocol.config import ServerSpec

KiB = 1024


def make_link(window_pieces: int = 3) -> ServerLink:
    return ServerLink(ServerSpec(4, "10.0.0.5", 9000, None), 0, credit_bytes=64 << 20, timeout=5.0,
                      window_pieces=window_pieces, max_payload_bytes=64 << 20)


def send(link: ServerLink, size: int, req: int) -> SimpleNamespace:
    assert not link._window_blocks(size)
    item = SimpleNamespace(paced=0, push=SimpleNamespace(req=req))
    link._take(item, size)
    return item


def test_window_counts_pieces_of_the_largest_size_in_flight():
    """A link holds a push while its unanswered paced bytes plus the push come to more than
    window_pieces of the largest unanswered piece: smaller pieces after large ones (a range's last
    pieces are a half and a quarter of the others) do not shrink the window to a piece or two."""
    link = make_link(3)
    big = [send(link, 128 * KiB, i) for i in range(3)]
    assert link._window_blocks(128 * KiB) and link._window_blocks(64 * KiB) and link._window_blocks(32 * KiB)
    link._answered_one(big[0])  # 256 KiB in flight
    assert not link._window_blocks(64 * KiB)  # 256 + 64 <= 3 x 128 (sized by itself: 256 + 64 > 3 x 64)
    half = send(link, 64 * KiB, 3)
    assert not link._window_blocks(64 * KiB) and link._window_blocks(128 * KiB)  # 320 + 64 = 384
    send(link, 64 * KiB, 4)
    assert link._window_blocks(32 * KiB)  # 384 + 32 > 384
    for item in (*big[1:], half):
        link._answered_one(item)
    assert not link._window_blocks(128 * KiB) and link._paced == 64 * KiB


def test_window_starts_from_the_first_piece_again_once_empty():
    """At the start of a tensor the window counts its first (small) pieces: four of 32, 64, 128 and
    128 KiB go out before the first answer, not three of 32 KiB only."""
    link = make_link(3)
    old = send(link, 256 * KiB, 0)
    link._answered_one(old)
    assert link._paced == 0 and link._unit == 0
    for req, size in enumerate((32 * KiB, 64 * KiB, 128 * KiB, 128 * KiB), start=1):
        send(link, size, req)
    assert link._window_blocks(128 * KiB)


def test_small_pushes_and_no_window_are_not_held():
    link = make_link(3)
    for req in range(3):
        send(link, 128 * KiB, req)
    assert not link._window_blocks(PACED_MIN_BYTES)  # small pushes are never held
    unpaced = make_link(0)
    for req in range(10):
        send(unpaced, 128 * KiB, req)
    assert unpaced._paced == 0
