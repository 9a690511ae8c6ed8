"""push_pull_group's plan and agreement (``bps_worker.client.group``), without a daemon."""

from __future__ import annotations

import itertools
import random

import numpy as np

from bps_worker.client.group import PACK_MAX_BYTES, agreement, agrees, plan_group

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)


def _plan(entries, average=True):
    names = [n for n, _, _ in entries]
    return plan_group(names, [d for _, d, _ in entries], [s for _, _, s in entries],
                      ["float32" if d == F32 else "float64" for _, d, _ in entries], average=average)


def test_every_order_of_one_group_packs_alike():
    entries = [("b", F32, (3,)), ("a", F64, (2, 2)), ("c", F32, ()), ("big", F32, (PACK_MAX_BYTES // 4 + 1,)),
               ("d", F32, (0,))]
    plans = []
    for order in itertools.permutations(range(len(entries))):
        plan = _plan([entries[i] for i in order])
        names = [entries[i][0] for i in order]
        plans.append((plan.names_digest, plan.digest,
                      [(p.wire, [(names[i], off, n) for i, off, n in p.entries], p.total) for p in plan.packed],
                      [names[i] for i in plan.large]))
    assert all(p == plans[0] for p in plans)
    assert plans[0][2] == [("float32", [("b", 0, 3), ("c", 3, 1), ("d", 4, 0)], 4), ("float64", [("a", 0, 4)], 4)]
    assert plans[0][3] == ["big"]


def test_the_digest_sees_every_dtype_and_shape_and_the_names_digest_only_the_names():
    base = _plan([("a", F32, (4,)), ("b", F32, (2,))])
    for other in ([("a", F32, (5,)), ("b", F32, (2,))], [("a", F64, (4,)), ("b", F32, (2,))]):
        plan = _plan(other)
        assert plan.digest != base.digest and plan.names_digest == base.names_digest
    summed = _plan([("a", F32, (4,)), ("b", F32, (2,))], average=False)  # (a process that sums, not averages)
    assert summed.digest != base.digest and summed.names_digest == base.names_digest
    assert _plan([("a", F32, (4,)), ("c", F32, (2,))]).names_digest != base.names_digest


def test_the_agreement_is_the_same_answer_on_every_process():
    """Each process decides alone from one sum; where the digests differ, every one of them must see it, also
    a process whose chunks are the mean of the others' (the sum alone would match it: the squares do not)."""
    size = 3
    same = [agreement(b"\x01" * 16)] * size
    total = sum(same)
    assert all(agrees(mine, total, size) for mine in same)
    middle = [np.array([1, 1, 1, 1, 1, 1, 1, 1]), np.array([2, 2, 2, 2, 4, 4, 4, 4]),
              np.array([3, 3, 3, 3, 9, 9, 9, 9])]
    assert not any(agrees(mine, sum(middle), size) for mine in middle)
    rng = random.Random(5)
    for _ in range(200):
        digests = [bytes(rng.getrandbits(8) for _ in range(16)) for _ in range(size)]
        digests[1] = digests[0] if rng.random() < 0.5 else digests[1]
        pushed = [agreement(d) for d in digests]
        answers = {agrees(mine, sum(pushed), size) for mine in pushed}
        assert answers == {len(set(digests)) == 1}
