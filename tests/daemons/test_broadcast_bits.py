"""A broadcast is a copy of the root's bytes, bit for bit, on every rank, the root too (issue 14 item 4).

Before, the machines without the root pushed -0.0 and the server summed: x + -0.0 == x for every value, but
a signalling NaN came back quieted (its quiet bit set), on the root too, and half types took a float32 round
trip. Now the server's broadcast round copies the root's push. The arrays cycle through signalling and quiet
NaNs with payloads, -0.0, subnormals and infinities, in every float dtype; 40,000 elements span several
partitions and servers (64 KiB partitions), 9 elements one.
"""

from __future__ import annotations

from typing import Any

import pytest

import silent_programs as sp
from harness import run_ranks

COUNTS = [9, 40_000]


def _check(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        for key, r in result.items():
            assert r["got"] == r["want"], f"rank {rank} {key}: the bytes differ from the root's " \
                                          f"(first difference at byte {_first_difference(r['got'], r['want'])})"


def _first_difference(got: str, want: str) -> int:
    return next((i // 2 for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)) // 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("root", [0, 3])
def test_broadcast_bytes_are_the_roots_on_two_machines(cluster_2x2: Any, root: int) -> None:
    _check(run_ranks(cluster_2x2, sp.broadcast_bits, root, COUNTS, timeout=90))


@pytest.mark.timeout(120)
def test_broadcast_bytes_one_process_per_machine(make_cluster: Any) -> None:
    """One process per machine: the root's slot is pushed as it is, the other machine's ignored."""
    cluster = make_cluster([1, 1], cpu_servers=0)
    _check(run_ranks(cluster, sp.broadcast_bits, 1, COUNTS, timeout=90))
