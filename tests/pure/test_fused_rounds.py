"""A machine's fused small sums (``bps_worker.fusion``), without sockets or a loop."""

from __future__ import annotations

from typing import Any

from bps_worker.fusion import FusedRounds
from protocol.messages import Spec, Why

WORKER = 1
OFFSET = 3  # worker 1's local rank 0 is global rank 3
F32: Spec = ("float32", (4,), False, "")
F16: Spec = ("float16", (4,), False, "")


def rounds(local_size: int = 2) -> FusedRounds[str]:
    return FusedRounds(local_size, WORKER, OFFSET)


def entries(names: list[str], req0: int = 1, spec: Spec = F32) -> list[tuple[int, str, Spec, str, int, int]]:
    return [(req0 + i, n, spec, "seg", 64 * i, 0) for i, n in enumerate(names)]


def answered(out: Any) -> list[tuple[str, int, str, str]]:
    return [(member, f.req, f.code, f.message) for member, f in out.answers]


def test_names_are_ready_once_every_local_rank_issued_them_in_any_order_and_batches():
    fr = rounds(3)
    assert fr.submit("p0", 0, entries(["a", "b", "c"])).ready == []
    assert [r.name for r in fr.submit("p2", 2, entries(["c", "a"], 10)).ready] == []
    ready = fr.submit("p1", 1, entries(["b", "a", "c", "d"], 20)).ready
    assert [r.name for r in ready] == ["a", "c"]  # b waits for rank 2, d for ranks 0 and 2
    a = next(r for r in ready if r.name == "a")
    # the local sum runs in local-rank order, whatever the arrival order
    assert [(e.member, e.req) for e in a.members()] == [("p0", 1), ("p1", 21), ("p2", 11)]
    assert a.first_rank == OFFSET + 0
    assert set(fr.reported) == {"a", "c"} and set(fr.collecting) == {"b", "d"}
    assert [r.name for r in fr.submit("p2", 2, entries(["b"], 30)).ready] == ["b"]


def test_a_single_process_machine_reports_at_once():
    fr = rounds(1)
    out = fr.submit("p0", 0, entries(["x", "y"]))
    assert [r.name for r in out.ready] == ["x", "y"] and not fr.collecting


def test_a_name_issued_twice_by_one_process_is_refused_while_in_flight():
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a"]))
    out = fr.submit("p0", 0, entries(["a"], 5))
    assert answered(out) == [("p0", 5, "bad_request", "tensor 'a' is already in flight for rank 3; synchronize it "
                                                      "before pushing it again")]
    fr.submit("p1", 1, entries(["a"], 7))  # complete: reported, still in flight until planned
    assert fr.submit("p1", 1, entries(["a"], 8)).answers[0][1].code == "bad_request"
    rounds_, missing = fr.planned(["a"])
    assert [r.name for r in rounds_] == ["a"] and missing == {}
    assert fr.submit("p1", 1, entries(["a"], 9)).answers == []  # planned: the next round opens


def test_a_mismatch_fails_that_name_only_for_every_local_rank_and_the_peers():
    fr = rounds(3)
    fr.submit("p0", 0, entries(["a", "b"]))
    out = fr.submit("p1", 1, [(10, "a", F16, "seg", 0, 0), (11, "b", F32, "seg", 64, 0)])
    failures = {(m, f.req): f for m, f in out.answers}
    assert set(failures) == {("p0", 1), ("p1", 10)}
    mine, theirs = failures[("p0", 1)], failures[("p1", 10)]
    assert mine.code == theirs.code == "mismatch" and mine.name == "a"
    assert (mine.ours, mine.theirs) == ("float32[4]", "float16[4]")
    assert (theirs.ours, theirs.theirs) == ("float16[4]", "float32[4]")
    assert [name for name, _ in out.aborts] == ["a"]  # the anchor tells the other machines
    # the late rank gets the same error for its round of "a"; "b" completes normally
    late = fr.submit("p2", 2, entries(["a", "b"], 20))
    assert [(m, f.req, f.code) for m, f in late.answers] == [("p2", 20, "mismatch")]
    assert [r.name for r in late.ready] == ["b"]
    assert "a" not in fr.failed  # every local rank heard it: forgotten
    assert fr.submit("p0", 0, entries(["a"], 30)).answers == []  # and the name works again


def test_a_process_that_leaves_fails_every_round_it_is_part_of_or_awaited_by():
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a", "b"]))
    fr.submit("p1", 1, entries(["b"], 10))  # b reported, a collecting
    out = fr.leave(1, pid=99)
    assert sorted((m, f.req, f.code) for m, f in out.answers) == [("p0", 1, "connection"), ("p0", 2, "connection")]
    assert sorted(name for name, _ in out.aborts) == ["a", "b"]
    assert not fr.collecting and not fr.reported and not fr.failed
    # a plan that names b (already on its way) finds it missing, with its spec: its group fails
    rounds_, missing = fr.planned(["b"])
    assert rounds_ == [] and missing == {"b": F32}


def test_a_failure_at_the_anchor_fails_the_reported_round_and_waits_for_late_ranks():
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a"]))
    out = fr.failed_at_anchor("a", Why("worker 0 disagrees", "round_failed"))
    assert [(m, f.req, f.message) for m, f in out.answers] == [("p0", 1, "worker 0 disagrees")]
    assert out.aborts == []  # the anchor knows
    late = fr.submit("p1", 1, entries(["a"], 10))
    assert [(m, f.req, f.message) for m, f in late.answers] == [("p1", 10, "worker 0 disagrees")]


def test_a_broken_link_fails_only_the_rounds_reported_to_that_server():
    fr = rounds(1)
    out = fr.submit("p0", 0, entries(["a", "b"]))
    out.ready[0].server, out.ready[1].server = 0, 2
    lost = fr.link_lost(2, Why("server 2 went away", "connection"))
    assert [(f.req, f.code) for _, f in lost.answers] == [(2, "connection")]
    assert list(fr.reported) == ["a"]


def test_a_reset_fails_everything_and_keeps_nothing():
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a", "b"]))
    fr.submit("p1", 1, entries(["a"], 10))
    out = fr.reset()
    assert sorted((m, f.req) for m, f in out.answers) == [("p0", 1), ("p0", 2), ("p1", 10)]
    assert out.aborts == [] and not (fr.collecting or fr.reported or fr.failed or fr.abandoned)


def test_a_late_rank_joins_its_failed_round_even_after_the_others_started_the_next():
    fr = rounds(3)
    fr.submit("p0", 0, [(1, "a", F16, "seg", 0, 0)])
    fr.submit("p1", 1, entries(["a"], 10))  # mismatch: round 0 fails, rank 2 still to come
    fr.submit("p0", 0, entries(["a"], 2))  # ranks 0 and 1 go on to round 1
    fr.submit("p1", 1, entries(["a"], 11))
    late = fr.submit("p2", 2, entries(["a"], 20))  # rank 2's round-0 entry
    assert [(m, f.req, f.code) for m, f in late.answers] == [("p2", 20, "mismatch")] and late.ready == []
    ready = fr.submit("p2", 2, entries(["a"], 21)).ready  # its round-1 entry completes round 1
    assert [(e.member, e.req) for e in ready[0].members()] == [("p0", 2), ("p1", 11), ("p2", 21)]


def test_a_round_that_waits_for_a_process_that_is_not_connected_fails_after_the_timeout():
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a"]), now=100.0)
    fr.submit("p0", 0, entries(["b"], 5), now=104.0)
    assert fr.overdue({0, 1}, now=200.0, timeout=5.0).answers == []  # rank 1 connected: merely slow
    out = fr.overdue({0}, now=105.5, timeout=5.0)
    assert [(m, f.req, f.code, f.timeout_s) for m, f in out.answers] == [("p0", 1, "timeout", 5.0)]
    assert "rank 4 of worker 1 is not connected" in out.answers[0][1].message
    assert [name for name, _ in out.aborts] == ["a"] and list(fr.collecting) == ["b"]


def test_failing_a_name_answers_its_entries_and_does_not_wait_for_ranks_that_heard_it_unfused():
    """Local rank 0 issued "a" fused, rank 1 too large to fuse (its op heard the failure through its round):
    the fused round fails, the anchor is told, and the name's next fused round is new."""
    fr = rounds(2)
    fr.submit("p0", 0, entries(["a"]))
    why = Why.mismatch("a", "float32[4]", "float32[400]", "sizes on both sides of the fusion limit")
    out = fr.fail_name("a", why, {1})
    assert [(m, f.code) for m, f in out.answers] == [("p0", "mismatch")]
    assert [name for name, _ in out.aborts] == ["a"]
    assert not fr.busy("a") and "a" not in fr.failed
    nxt = fr.submit("p1", 1, entries(["a"], 9))
    assert nxt.answers == [] and "a" in fr.collecting  # a new round, not the failed one's error


def test_a_failed_fused_round_still_waits_for_a_rank_that_heard_nothing():
    fr = rounds(3)
    fr.submit("p0", 0, entries(["a"]))
    why = Why.mismatch("a", "float32[4]", "float32[400]", "sizes on both sides of the fusion limit")
    fr.fail_name("a", why, {1})
    assert "a" in fr.failed  # rank 2 has not issued it yet: it will get this error
    late = fr.submit("p2", 2, entries(["a"], 5))
    assert [(m, f.code) for m, f in late.answers] == [("p2", "mismatch")]
