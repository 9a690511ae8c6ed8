"""bps_runtime.admission: the bounds on connections that have not finished their handshake, and the
rate limit of the lines about them (issue 14, item 5)."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from bps_runtime.admission import Admission
from bps_runtime.loglimit import LogLimit

log = logging.getLogger("test.admission")


def _admission(**kwargs) -> Admission:
    return Admission(log, "server 9", **{"deadline_s": 60.0, "per_peer": 2, "total": 3, **kwargs})


async def test_per_peer_and_total_bounds_close_the_oldest_pending_and_release(caplog):
    """Over a bound the oldest pending connection that counts against it makes room: refusing the newest let
    idle connections from a worker's address (another user of its machine, a NAT) refuse its reconnects for
    as long as they stayed, without a token (a review's reproducer: 64 idle sockets from 127.0.0.1)."""
    caplog.set_level(logging.WARNING, "test.admission")
    adm, closed = _admission(), []
    a1 = adm.enter("10.0.0.1", "10.0.0.1:1", lambda: closed.append("a1"))
    a2 = adm.enter("10.0.0.1", "10.0.0.1:2", lambda: closed.append("a2"))
    a3 = adm.enter("10.0.0.1", "10.0.0.1:3", lambda: closed.append("a3"))  # a third from one host: a1 goes
    assert closed == ["a1"] and not a1.peer and adm.pending == 2
    b1 = adm.enter("10.0.0.2", "10.0.0.2:1", lambda: closed.append("b1"))
    assert adm.pending == 3
    c1 = adm.enter("10.0.0.3", "10.0.0.3:1", lambda: closed.append("c1"))  # a fourth in all: the oldest, a2
    assert closed == ["a1", "a2"] and adm.pending == 3 and adm.refused == 2
    assert dict(adm.counts) == {"10.0.0.1": 1, "10.0.0.2": 1, "10.0.0.3": 1}
    assert re.search(r"server 9 closes the connection from 10\.0\.0\.1:1, pending for \d+\.\d s, for a new one "
                     r"from 10\.0\.0\.1:3: 2 connections from 10\.0\.0\.1 have not finished their handshake \(at "
                     r"most 2 per peer\)", caplog.text), caplog.text
    assert "for a new one from 10.0.0.3:1: 3 connections have not finished their handshake (at most 3)" in caplog.text
    a3.release()
    a3.release()  # twice: counted once
    assert adm.pending == 2 and dict(adm.counts) == {"10.0.0.2": 1, "10.0.0.3": 1}
    a1.release()  # (its connection's loss after it was closed: nothing more)
    assert adm.pending == 2
    assert adm.enter("10.0.0.1", "10.0.0.1:4", lambda: closed.append("a4")) is not None
    for ticket in (b1, c1):
        ticket.release()
    assert closed == ["a1", "a2"] and adm.pending == 1


async def test_a_connection_without_handshake_is_closed_at_the_deadline(caplog):
    caplog.set_level(logging.WARNING, "test.admission")
    adm, overdue = _admission(deadline_s=0.05), []
    slow = adm.enter("10.0.0.1", "10.0.0.1:7", lambda: overdue.append("slow"))
    quick = adm.enter("10.0.0.1", "10.0.0.1:8", lambda: overdue.append("quick"))
    assert slow is not None and quick is not None
    quick.release()  # its handshake finished in time
    for _ in range(200):
        if overdue:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)
    assert overdue == ["slow"]
    assert adm.pending == 0  # the overdue one's place is free
    assert "server 9 closes the connection from 10.0.0.1:7: no handshake within 0.05 s" in caplog.text
    assert "10.0.0.1:8" not in caplog.text
    slow.release()  # the connection's own loss afterwards: nothing more
    assert adm.pending == 0


def test_the_log_limit_keeps_a_burst_then_counts_what_it_left_out(caplog):
    caplog.set_level(logging.WARNING, "test.admission")
    limit = LogLimit(burst=3, interval_s=1000.0)
    for i in range(50):
        limit.log(log, logging.WARNING, "line %d", i)
    assert [r.getMessage() for r in caplog.records] == ["line 0", "line 1", "line 2"]
    assert limit.suppressed == 47
    limit = LogLimit(burst=2, interval_s=1.0)
    assert [limit.allow(t) for t in (0.0, 0.5, 0.9, 1.0, 1.5, 1.7)] == [True, True, False, True, True, False]
    limit = LogLimit(burst=1, interval_s=0.0)  # every line its own window: the count goes with the next one
    limit.suppressed = 5
    limit.log(log, logging.WARNING, "after %s", "flood")
    assert caplog.records[-1].getMessage() == "after flood (5 similar lines left out)" and limit.suppressed == 0


@pytest.mark.parametrize("burst", [1, 5])
def test_a_flood_is_a_few_lines_per_interval(burst):
    limit = LogLimit(burst=burst, interval_s=10.0)
    allowed = sum(limit.allow(t * 0.001) for t in range(100_000))  # 100 s of 1,000 refusals a second
    assert allowed == 10 * burst


def test_a_flood_that_ended_still_has_its_count_said(caplog):
    """The count of lines left out went with the next line allowed: a flood that ended had none."""
    caplog.set_level(logging.WARNING, "test.admission")
    limit = LogLimit(burst=2, interval_s=1000.0, what="lines")
    for i in range(7):
        limit.log(log, logging.WARNING, "line %d", i)
    limit.flush(log, logging.WARNING)  # the window is full: not now
    assert [r.getMessage() for r in caplog.records] == ["line 0", "line 1"] and limit.suppressed == 5
    limit._window_start = float("-inf")  # (the interval has passed)
    limit.flush(log, logging.WARNING)
    limit.flush(log, logging.WARNING)  # said once
    assert [r.getMessage() for r in caplog.records] == ["line 0", "line 1", "5 more lines left out"]
