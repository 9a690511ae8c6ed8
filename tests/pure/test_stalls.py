"""The stall inspector's decision (bps_runtime.stalls): when a wait is warned about, and again."""

from __future__ import annotations

import logging

import pytest

from bps_runtime.stalls import StallWatch

pytestmark = pytest.mark.timeout(10)


def test_a_wait_is_warned_about_once_it_is_old_enough_then_every_repeat():
    watch: StallWatch[str] = StallWatch(warn_after_s=4.0)
    waits = {"w": 10.0}
    assert watch.due(13.9, waits) == []
    assert watch.due(14.0, waits) == [("w", 4.0)]
    assert watch.due(15.0, waits) == []  # just warned
    assert watch.due(17.9, waits) == []
    assert watch.due(18.0, waits) == [("w", 8.0)]  # repeats every warn_after_s by default
    assert watch.due(18.5, waits) == []


def test_a_wait_that_ended_is_forgotten_and_a_new_one_starts_over():
    watch: StallWatch[str] = StallWatch(warn_after_s=4.0, repeat_s=10.0)
    assert watch.due(5.0, {"w": 0.0}) == [("w", 5.0)]
    assert watch.due(6.0, {}) == []  # the round completed
    assert watch.due(9.0, {"w": 6.0}) == []  # the next round of the same key, only 3 s old
    assert watch.due(10.0, {"w": 6.0}) == [("w", 4.0)]  # warned although the key was warned 5 s ago
    assert watch.due(19.9, {"w": 6.0}) == []
    assert watch.due(20.0, {"w": 6.0}) == [("w", 14.0)]


def test_several_waits_come_oldest_first_each_on_its_own_clock():
    watch: StallWatch[tuple[str, int]] = StallWatch(warn_after_s=2.0)
    waits = {("b", 0): 3.0, ("a", 0): 1.0, ("c", 1): 4.5}
    assert watch.due(5.0, waits) == [(("a", 0), 4.0), (("b", 0), 2.0)]
    assert watch.due(6.5, waits) == [(("c", 1), 2.0)]
    assert watch.due(7.0, waits) == [(("a", 0), 6.0), (("b", 0), 4.0)]


def test_thousands_of_stall_warnings_are_a_few_lines_and_a_count():
    """Thousands of rounds can stall at once (a rank that lags with a model's whole step in flight): a line
    each, every look, flooded the daemons' logs (804 lines for 500 names in a review)."""
    from bps_runtime.stalls import STALL_LINES, capped

    few = [f"stall: {i}" for i in range(STALL_LINES)]
    assert capped(few, "rounds have waited as long") == few
    many = [f"stall: {i}" for i in range(500)]
    assert capped(many, "rounds have waited as long") == [
        *many[:STALL_LINES], f"stall: {500 - STALL_LINES} more rounds have waited as long (not listed)"]


def test_each_party_is_told_a_few_lines_a_look_whoever_said_them():
    """A process was told one look's lines once per server beside its daemon's (44 lines with 3 servers, a
    review's case): the lines of a look are gathered and each party told at most STALL_LINES and a count."""
    from bps_runtime.stalls import STALL_LINES, Notices, Stall

    notices = Notices()
    notices.say([Stall("mine", (0,)), Stall("both", (0, 1))], "stalls", logging.getLogger("test"))
    for server in range(3):  # each server's capped lines, passed on for every process
        notices.add(None, [f"server {server} line {i}" for i in range(STALL_LINES)] + ["stall: 4 more (not listed)"])
    told = notices.take([0, 1, 2])
    assert set(told) == {0, 1, 2}
    assert told[0][:3] == ["mine", "both", "server 0 line 0"] and told[1][:2] == ["both", "server 0 line 0"]
    assert len(told[0]) == STALL_LINES + 1
    assert told[0][-1] == f"stall: {2 + 3 * (STALL_LINES + 1) - STALL_LINES} more stall lines (not listed)"
    assert told[2][-1] == f"stall: {3 * (STALL_LINES + 1) - STALL_LINES} more stall lines (not listed)"
    assert notices.take([0, 1, 2]) == {}  # a look's lines are told once


def test_what_a_party_is_told_is_bounded_whatever_comes():
    from bps_runtime.stalls import STALL_LINES, Notices

    notices = Notices()
    for _ in range(1000):
        notices.add(None, ["x" * 5000] * 50)
    assert len(notices._lines[None]) == STALL_LINES  # held: a few, the rest counted
    (lines,) = notices.take([7]).values()
    assert len(lines) == STALL_LINES + 1 and len(lines[0]) <= 1280
    assert lines[-1] == f"stall: {50_000 - STALL_LINES} more stall lines (not listed)"


def test_a_round_has_stalled_once_it_and_every_party_it_waits_for_were_silent_as_long() -> None:
    """cluster.stall_timeout's rule: from the round's opening, and from each waited-for party's last word (a worker
    still pushing its other tensors, in its own order, is busy, not stalled)."""
    from bps_runtime.stalls import stalled

    assert not stalled([1], 100.0, 159.9, 60.0, {})
    assert stalled([1], 100.0, 160.0, 60.0, {})  # never heard: silent since the round opened
    assert not stalled([1], 100.0, 160.0, 60.0, {1: 150.0}) and stalled([1], 100.0, 210.0, 60.0, {1: 150.0})
    assert stalled([1], 100.0, 160.0, 60.0, {1: 20.0})  # (heard before the round opened)
    assert not stalled([1, 2], 100.0, 200.0, 60.0, {2: 190.0})  # one of them busy
    assert not stalled([], 100.0, 1000.0, 60.0, {}) and not stalled([1], 100.0, 1e9, 0.0, {})  # nobody; off
