"""The client from several threads of one process, with real daemons (issue 14 item 4's thread race).

One name pushed from two threads at once shares one slot: before the fix the second start filled it while
the first was still starting, and each thread could get the other's data back, with no error. Now the
second start is refused at once with the error a single thread gets for a name already in flight.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

import client_programs as cp
from bps_worker.supervise import Cluster
from harness import run_ranks, start_cluster, write_config


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = start_cluster(write_config(tmp_path_factory.mktemp("threads"), [1], cpu_servers=0))
    try:
        yield cluster
    finally:
        cluster.stop()


def _check(result: dict[str, Any]) -> list[tuple[str, str, float]]:
    outcomes = [o for thread in result["outcomes"] for o in thread]
    wrong = [o for o in outcomes if o[0] == "wrong"]
    assert not wrong, f"a thread got the other thread's data: {wrong[:3]}"
    for kind, text, seconds in outcomes:
        if kind == "error":
            assert f"tensor {cp.NAME!r} is already in flight in this process" in text, text
            assert seconds < 1.0, f"the refused push took {seconds:.2f} s"
    assert result["after"] == [0.0, 1.0, 2.0, 3.0, 4.0]  # the connection still works
    return outcomes


def test_same_name_from_two_threads_during_a_slow_fill_is_refused(one_process: Cluster) -> None:
    """The first start holds the slot (its fill sleeps 50 ms): the other thread's start comes meanwhile and
    must be refused, every round, and the first must get its own data."""
    rounds = 20
    (result,) = run_ranks(one_process, cp.same_name_from_two_threads, rounds, 1024, 0.05, timeout=90)
    outcomes = _check(result)
    per_round = list(zip(*result["outcomes"]))
    assert all(sorted(kind for kind, _, _ in pair) == ["error", "own"] for pair in per_round), per_round
    assert len(outcomes) == 2 * rounds


def test_same_name_from_two_threads_with_push_pull(one_process: Cluster) -> None:
    """The public push_pull, as the finding did it (600 tries; 5 went wrong): own data or a fast refusal."""
    (result,) = run_ranks(one_process, cp.same_name_from_two_threads, 300, 64 * 1024, 0.0, timeout=110)
    outcomes = _check(result)
    assert sum(kind == "own" for kind, _, _ in outcomes) >= 300  # at least one push per round got through
