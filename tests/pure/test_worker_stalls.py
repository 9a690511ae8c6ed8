"""The worker daemon's stall warnings (bps_worker.stalls) from its local rounds and its links' windows,
without sockets or a loop (a link is only asked for its server id and its window's pieces)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from bps_worker.local_rounds import LocalRounds, Opened, Ready
from bps_worker.stalls import WorkerStalls
from protocol.messages import Op

pytestmark = pytest.mark.timeout(10)
TIMEOUT_S = 4.0


def _op(rank: int) -> Op:
    return Op(req=rank + 1, name="w", kind="sum", segment="seg", offset=0, dtype="float32", shape=[4])


def _link(server: int, *pushes: tuple[str, int]) -> Any:
    """A link of ``server`` whose window holds a piece of each (name, server round)."""
    pieces = [SimpleNamespace(push=SimpleNamespace(name=name, round=round_)) for name, round_ in pushes]
    return SimpleNamespace(spec=SimpleNamespace(id=server), window=SimpleNamespace(pieces=lambda: iter(pieces)))


def test_a_round_waiting_for_a_local_rank_names_it_and_who_submitted():
    rounds: LocalRounds[str] = LocalRounds(3, 1, 3)  # worker 1, its local rank 0 is rank 3
    stalls = WorkerStalls(TIMEOUT_S, 1, 3)
    (opened,) = rounds.submit("s0", 0, _op(0))
    assert isinstance(opened, Opened)
    stalls.began(opened.round, 10.0)
    rounds.submit("s2", 2, _op(2))
    assert stalls.warnings(13.9, rounds, []) == []
    (stall,) = stalls.warnings(14.0, rounds, [])
    assert stall.told == (0, 1, 2)  # told to those that submitted and to the one it waits for
    assert str(stall) == stall.text == ("stall: tensor 'w' (round 0 on worker 1) has waited 4.0 s for local rank 1 (rank 4), which did "
                    "not submit it; submitted by local ranks 0, 2 (ranks 3, 5). Every process must push every "
                    "name once per round: is one stuck, or skipping it?")
    assert stalls.warnings(15.0, rounds, []) == []  # said; again after another timeout
    assert len(stalls.warnings(18.0, rounds, [])) == 1


def test_a_round_every_local_rank_submitted_waits_at_the_servers_holding_its_parts_until_answered():
    rounds: LocalRounds[str] = LocalRounds(1, 0, 0)
    stalls = WorkerStalls(TIMEOUT_S, 0, 0)
    opened, ready = rounds.submit("s0", 0, _op(0))
    assert isinstance(opened, Opened) and isinstance(ready, Ready)
    rounds.numbers.learn("w", 0, 7)  # our round 0 is the servers' round 7
    stalls.began(ready.round, 20.0)
    links = [_link(0, ("w", 7), ("v", 7)), _link(2, ("w", 7)), _link(1, ("w", 6))]
    (stall,) = stalls.warnings(24.5, rounds, links)
    assert stall.told == (0,)
    assert stall.text == ("stall: tensor 'w' (round 0 on worker 0) has waited 4.5 s at servers 0, 2: every local "
                          "rank submitted it; other workers have not pushed it, or the server is slow or out of reach "
                          "(the server's log names whom it waits for)")
    assert stalls.warnings(30.0, rounds, [_link(1, ("w", 6))]) == []  # answered: forgotten
    assert stalls.warnings(40.0, rounds, links) == []


def test_a_round_said_to_have_ended_is_forgotten_at_once():
    """The daemon says when a round's operation ended or it failed: the inspector keeps nothing of it (before, it
    kept every round, with its ops, until the first look after it became due: all the rounds of a timeout)."""
    rounds: LocalRounds[str] = LocalRounds(1, 0, 0)
    stalls = WorkerStalls(TIMEOUT_S, 0, 0)
    opened, ready = rounds.submit("s0", 0, _op(0))
    stalls.began(opened.round, 20.0)
    stalls.began(ready.round, 20.0)
    assert stalls._since
    stalls.ended(ready.round)
    assert not stalls._since
    stalls.ended(ready.round)  # (said twice: a failure after its operation's end)
    assert stalls.warnings(30.0, rounds, [_link(0, ("w", 0))]) == []
