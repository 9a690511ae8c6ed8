"""bps_worker.placement: the paper's Theorem 1 shares and the deterministic byte split."""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from fractions import Fraction

import pytest

import bps_worker.placement as placement_module
from bps_worker.placement import (
    MAX_PIECES,
    MIN_PIPELINE_BYTES,
    NETWORK_MIN_DEPTH,
    NETWORK_MIN_PIPELINE_BYTES,
    NETWORK_PIPELINE_DEPTH,
    PIECE_LINK_TIME_MAX_S,
    PIECE_LINK_TIME_S,
    PIECE_MIN_LINK_TIME_S,
    PIECE_TIME_GROWS_ABOVE_BITS,
    PIPELINE_DEPTH,
    Piece,
    Placement,
    interleave,
    piece_link_time,
    server_shares,
    split,
    theorem1_shares,
)
from protocol.config import ClusterConfig, parse_config
from protocol.errors import ConfigError
from protocol.messages import fused_lanes, fused_name, fused_server

KiB = 1024
MiB = 1024 * KiB


def make_config(n: int, k: int, *, partition_bytes: int = 4 * MiB, colocated: list[int | None] | None = None,
                first_id: int = 0, one_host: bool = True, link_rate: str | None = None) -> ClusterConfig:
    """n workers; servers linked to workers as in ``colocated`` (default: one per worker) + k CPU-only;
    all on one host (ports 9000, 9001, ...) or each on a host of its own."""
    links = list(range(n)) if colocated is None else colocated
    servers = [{"id": first_id + i, "address": f"127.0.0.1:{9000 + i}" if one_host else f"10.0.0.{i}:9000"}
               | ({} if w is None else {"worker": w})
               for i, w in enumerate(links + [None] * k)]
    return parse_config({
        "cluster": {"workers": n, "partition_bytes": partition_bytes} | ({"link_rate": link_rate} if link_rate else {}),
        "server": servers,
        "worker": [{"id": i, "local_size": 1, "socket": f"/tmp/w{i}.sock"} for i in range(n)],
    })


def paper_shares(n: int, k: int) -> tuple[Fraction, Fraction]:
    """The paper's formulas, written out independently: (M_cpu, M_gpu)."""
    d = n * n + k * n - 2 * k
    return Fraction(2 * (n - 1), d), Fraction(n - k, d)


def t_opt(n: int, k: int) -> Fraction:
    """Paper: optimal communication time in units of M/B."""
    return Fraction(2 * n * (n - 1), n * n + k * n - 2 * k)


# -- Theorem 1 -------------------------------------------------------------------------------

@pytest.mark.parametrize("n", range(1, 9))
def test_theorem1_shares_sum_to_one_exactly(n):
    for k in range(0, n + 1):
        m_cpu, m_gpu = theorem1_shares(n, k)
        assert isinstance(m_cpu, Fraction) and isinstance(m_gpu, Fraction)
        assert k * m_cpu + n * m_gpu == 1, (n, k)
        assert m_cpu >= 0 and m_gpu >= 0


@pytest.mark.parametrize("n", range(2, 9))
def test_theorem1_matches_paper_formulas(n):
    for k in range(0, n + 1):
        assert theorem1_shares(n, k) == paper_shares(n, k), (n, k)


@pytest.mark.parametrize("n", range(2, 9))
def test_theorem1_balances_every_nic(n):
    """With the shares, a CPU machine's traffic (n * M_cpu each way) equals a GPU machine's
    (2(n-1) M_gpu + k M_cpu each way), and both equal the paper's optimal time."""
    for k in range(0, n + 1):
        m_cpu, m_gpu = theorem1_shares(n, k)
        gpu_machine = 2 * (n - 1) * m_gpu + k * m_cpu
        assert gpu_machine == t_opt(n, k)
        if k:
            assert n * m_cpu == t_opt(n, k)


@pytest.mark.parametrize("k,want", [(0, Fraction(3, 2)), (2, Fraction(6, 5)), (4, Fraction(1))])
def test_paper_example_n4(k, want):
    assert t_opt(4, k) == want
    m_cpu, m_gpu = theorem1_shares(4, k)
    assert 2 * 3 * m_gpu + k * m_cpu == want


def test_n4_example_values():
    assert theorem1_shares(4, 0) == (Fraction(6, 16), Fraction(1, 4))
    assert theorem1_shares(4, 2) == (Fraction(3, 10), Fraction(1, 10))
    assert theorem1_shares(4, 4) == (Fraction(1, 4), Fraction(0))


def test_theorem1_single_machine():
    assert theorem1_shares(1, 0) == (0, 1)
    assert theorem1_shares(1, 1) == (0, 1)  # the paper's denominator is 0 here; everything stays local


@pytest.mark.parametrize("n,k", [(0, 0), (2, 3), (2, -1), (-1, 0)])
def test_theorem1_rejects_bad_arguments(n, k):
    with pytest.raises(ValueError, match=f"n={n}, k={k}"):
        theorem1_shares(n, k)


# -- server_shares ---------------------------------------------------------------------------

THEOREM_LAYOUTS = [(2, 0), (2, 1), (3, 1), (4, 2), (4, 4)]


@pytest.mark.parametrize("n,k", THEOREM_LAYOUTS)
def test_server_shares_follow_theorem1(n, k):
    config = make_config(n, k)
    shares = server_shares(config)
    m_cpu, m_gpu = paper_shares(n, k)
    assert set(shares) == {s.id for s in config.servers}
    for s in config.servers:
        assert shares[s.id] == (m_gpu if s.worker is not None else m_cpu), s
    assert sum(shares.values()) == 1


def test_the_split_chosen_is_said_for_theorem1_layouts_too():
    """configs/README.md: "The worker daemon logs which it chose": only the fallback layouts said so (a review).
    The daemon logs it once it listens (bps_worker.daemon)."""
    assert split(make_config(4, 2))[1] == ("Theorem 1's split for n = 4, k = 2: 3/10 of every round's bytes on "
                                           "each CPU-only server, 1/10 on each worker machine's servers")
    assert split(make_config(2, 1, colocated=[None, None]))[1] == ("3 CPU-only servers for 2 workers (k >= n): spreading "
                                                            "evenly over the CPU-only servers")


def test_server_shares_with_unordered_ids_and_links():
    config = parse_config({
        "cluster": {"workers": 2},
        "server": [{"id": 7, "address": "a:1"}, {"id": 3, "address": "b:1", "worker": 1},
                   {"id": 5, "address": "c:1", "worker": 0}],
        "worker": [{"id": i, "local_size": 1, "socket": f"/s{i}"} for i in range(2)],
    })
    assert server_shares(config) == {7: Fraction(1, 2), 3: Fraction(1, 4), 5: Fraction(1, 4)}


@pytest.mark.parametrize("n,k", [(2, 3), (3, 5)])
def test_more_cpu_servers_than_workers_spreads_over_cpu_servers(n, k):
    config = make_config(n, k)
    shares = server_shares(config)
    for s in config.servers:
        assert shares[s.id] == (0 if s.worker is not None else Fraction(1, k))


def _machine_time(config: ClusterConfig, shares: dict[int, Fraction]) -> Fraction:
    """The busiest link's time per round in units of M/B, by machine: a worker machine sends (and receives)
    every byte its own servers do not sum, and n - 1 workers' sums (their pushes) of each byte they do; a
    CPU-only machine receives (and sends) n for each of its bytes."""
    n = config.workers
    times = []
    for w in range(n):
        own = sum((shares[s.id] for s in config.servers if s.worker == w), Fraction(0))
        times.append(1 - own + (n - 1) * own)
    times += [n * shares[s.id] for s in config.servers if s.worker is None]
    return max(times)


@pytest.mark.parametrize("n,k,extra", [(2, 1, 1), (4, 2, 1), (8, 4, 1), (16, 15, 3), (4, 0, 2), (3, 3, 1)])
def test_several_servers_on_each_worker_machine_share_its_theorem1_share(n, k, extra):
    """Theorem 1 is about machines: a machine's servers share its M_gpu. They were given an even share of the
    bytes like every other server (a review: 1.40 M/B against t_opt 1.20 at n = 4, k = 2, one extra server a
    machine; 1.71 against 1.03 at n = 16, k = 15, three extra)."""
    config = make_config(n, k, colocated=[w for w in range(n) for _ in range(1 + extra)])
    shares = server_shares(config)
    m_cpu, m_gpu = paper_shares(n, k)
    for s in config.servers:
        assert shares[s.id] == (m_cpu if s.worker is None else m_gpu / (1 + extra)), s
    assert sum(shares.values()) == 1 and _machine_time(config, shares) == t_opt(n, k)


def test_machines_with_different_numbers_of_servers_still_split_by_machine():
    config = make_config(2, 1, colocated=[0, 0, 1])  # two servers on worker 0, one on worker 1
    assert server_shares(config) == {0: Fraction(1, 8), 1: Fraction(1, 8), 2: Fraction(1, 4), 3: Fraction(1, 2)}


@pytest.mark.parametrize("k,extra", [(0, 0), (1, 0), (2, 0), (5, 0), (1, 1), (3, 2)])
def test_one_worker_machine_sums_everything_on_its_own_servers(k, extra):
    """n = 1: nothing needs to cross a network. With k >= 2 CPU-only servers, or several servers on the machine,
    every byte went to the CPU-only servers (M/B a round, where Theorem 1 gives 0; a review)."""
    config = make_config(1, k, colocated=[0] * (1 + extra))
    shares = server_shares(config)
    assert shares == {s.id: (Fraction(1, 1 + extra) if s.worker == 0 else Fraction(0)) for s in config.servers}
    assert _machine_time(config, shares) == 0


def test_several_servers_on_one_worker_with_enough_cpu_servers():
    config = make_config(2, 2, colocated=[0, 0, 1])
    shares = server_shares(config)
    assert shares == {0: 0, 1: 0, 2: 0, 3: Fraction(1, 2), 4: Fraction(1, 2)}


def test_worker_without_colocated_server_falls_back():
    config = make_config(3, 1, colocated=[0, 1])  # worker 2 has no server
    assert server_shares(config) == {i: Fraction(1, 3) for i in range(3)}


@pytest.mark.parametrize("n,servers", [(2, 1), (2, 3), (4, 4), (4, 2)])
def test_no_worker_links_spreads_evenly(n, servers):
    config = make_config(n, servers, colocated=[])
    assert server_shares(config) == {i: Fraction(1, servers) for i in range(servers)}


# -- Placement.split ---------------------------------------------------------------------------

SPLIT_CONFIGS = {
    **{f"n{n}k{k}": make_config(n, k) for n, k in THEOREM_LAYOUTS},
    "n1k0": make_config(1, 0),
    "n2k3": make_config(2, 3),
    "fallback": make_config(2, 1, colocated=[0, 0, 1]),
    "small-partitions": make_config(3, 1, partition_bytes=1000),
    "odd-ids": make_config(3, 2, first_id=40),
}


def check_pieces(placement: Placement, name: str, count: int, itemsize: int) -> list[Piece]:
    pieces = placement.split(name, count, itemsize)
    assert pieces, "a tensor always has at least partition 0"
    assert [p.part for p in pieces] == list(range(len(pieces)))
    # partition_bytes, or a MAX_PIECES-th of the tensor where that is more; never more than a frame carries
    largest = min(max(1, placement.partition_bytes // itemsize, -(-count // MAX_PIECES)),
                  placement.max_payload_bytes // itemsize)
    offset = 0
    for p in pieces:
        assert p.offset == offset, (name, count, pieces)
        assert 0 <= p.count <= largest and p.count * itemsize <= placement.max_payload_bytes
        assert p.server in placement.server_ids
        offset += p.count
    assert offset == count
    # only partition 0 may be empty, and only if its server's share of the tensor is nothing
    assert all(p.count > 0 for p in pieces[1:])
    anchor = placement.server_ids[placement.anchor(name)]
    assert pieces[0].server == anchor
    share = dict(zip(placement.server_ids, placement.shares))
    assert share[anchor] > 0
    for p in pieces:
        assert share[p.server] > 0 or p.count == 0
    return pieces


@pytest.mark.parametrize("label", sorted(SPLIT_CONFIGS))
def test_split_covers_tensor_contiguously(label):
    placement = Placement(SPLIT_CONFIGS[label])
    rng = random.Random(label)
    for i in range(300):
        count = rng.choice([0, 1, 2, 3, 5, 7, 11, rng.randrange(0, 100), rng.randrange(0, 5_000_000)])
        itemsize = rng.choice([2, 4, 8])
        check_pieces(placement, f"t{i}", count, itemsize)


@pytest.mark.parametrize("label", sorted(SPLIT_CONFIGS))
def test_partition_zero_on_anchor_for_empty_and_tiny_tensors(label):
    placement = Placement(SPLIT_CONFIGS[label])
    for i in range(200):
        name = f"layer{i}.bias"
        anchor = placement.server_ids[placement.anchor(name)]
        empty = placement.split(name, 0, 4)
        assert empty == [Piece(0, anchor, 0, 0)]
        for count in (1, 2, 3):
            pieces = check_pieces(placement, name, count, 4)
            assert pieces[0].server == anchor


def test_anchor_is_spread_over_servers_with_a_share():
    placement = Placement(make_config(4, 2))
    anchors = {placement.server_ids[placement.anchor(f"w{i}")] for i in range(500)}
    assert anchors == {0, 1, 2, 3, 4, 5}
    placement = Placement(make_config(4, 4))  # colocated servers have share 0 here
    anchors = {placement.server_ids[placement.anchor(f"w{i}")] for i in range(500)}
    assert anchors == {4, 5, 6, 7}


def test_single_element_goes_to_the_largest_share_when_split():
    # partitions of 16 bytes: no tensor counts as small, so even one element is split by the shares
    placement = Placement(make_config(2, 1, partition_bytes=16))  # shares: gpu 1/4, gpu 1/4, cpu 1/2
    for i in range(50):
        pieces = check_pieces(placement, f"s{i}", 1, 4)
        assert [(p.server, p.count) for p in pieces if p.count] == [(2, 1)]


def test_pieces_respect_partition_bytes():
    placement = Placement(make_config(2, 0, partition_bytes=4 * MiB))
    pieces = check_pieces(placement, "big", 40 * MiB, 4)  # 160 MiB of float32: 80 MiB a server
    assert max(p.count for p in pieces) == MiB  # 4 MiB / 4 bytes
    assert sum(p.count for p in pieces) == 40 * MiB
    by_server = defaultdict(int)
    for p in pieces:
        by_server[p.server] += p.count
    assert dict(by_server) == {0: 20 * MiB, 1: 20 * MiB}
    assert len(pieces) == 40


def test_every_server_range_is_pipelined_on_one_host():
    """At least PIPELINE_DEPTH partitions a server (so pushes, sums and pulls overlap on its link), of
    equal size, but none below MIN_PIPELINE_BYTES."""
    assert (PIPELINE_DEPTH, MIN_PIPELINE_BYTES) == (8, 256 * 1024)
    placement = Placement(make_config(2, 0, partition_bytes=4 * MiB))
    pieces = check_pieces(placement, "mid", 4 * MiB, 4)  # 16 MiB: 8 MiB a server
    by_server = defaultdict(list)
    for p in pieces:
        by_server[p.server].append(p.count * 4)
    assert by_server == {0: [MiB] * 8, 1: [MiB] * 8}
    small = check_pieces(placement, "small", 256 * 1024, 4)  # 1 MiB: 512 KiB a server -> 2 x 256 KiB each
    assert sorted(p.count * 4 for p in small) == [256 * 1024] * 4
    # a range that does not divide evenly is cut into equal pieces (within an element), not a short last one
    odd = check_pieces(placement, "odd", 2 * 1_000_003, 4)
    for sid in (0, 1):
        counts = [p.count for p in odd if p.server == sid]
        assert len(counts) == 8 and max(counts) - min(counts) <= 1


def test_network_ranges_ramp_up_and_down():
    """Servers on several hosts: NETWORK_PIPELINE_DEPTH partitions per stream, and every stream's first
    and last two pieces are a quarter and a half of the others (none under NETWORK_MIN_PIPELINE_BYTES),
    so the pipeline fills and drains sooner."""
    assert (NETWORK_PIPELINE_DEPTH, NETWORK_MIN_PIPELINE_BYTES) == (32, 32 * 1024)
    placement = Placement(make_config(2, 0, partition_bytes=4 * MiB, one_host=False))
    pieces = check_pieces(placement, "mid", 4 * MiB, 4)  # 16 MiB: 8 MiB a server, one stream each
    for sid in (0, 1):
        sizes = [p.count * 4 for p in pieces if p.server == sid]
        assert sizes[:2] == [64 * 1024, 128 * 1024] and sizes[-2:] == [128 * 1024, 64 * 1024]
        middle = sizes[2:-2]
        assert len(middle) == 31 and sum(sizes) == 8 * MiB
        assert all(0.95 * 256 * 1024 <= size <= 256 * 1024 for size in middle), middle
    # several streams: each stream gets a quarter and a half piece first and last
    three = Placement(make_config(4, 2, one_host=False))  # CPU-only servers: 3 streams each
    assert three.streams(4) == 3
    mine = [p for p in check_pieces(three, "big", 64 * MiB // 4, 4) if p.server == 4]  # 19.2 MiB
    full = max(p.count for p in mine)
    assert [round(4 * p.count / full) for p in mine[:6]] == [1, 1, 1, 2, 2, 2]
    assert [round(4 * p.count / full) for p in mine[-6:]] == [2, 2, 2, 1, 1, 1]
    assert [p.stream for p in mine[:6]] == [0, 1, 2, 0, 1, 2] and {p.stream for p in mine[-6:]} == {0, 1, 2}
    # too small a range for a ramp: equal pieces of at least the minimum
    small = check_pieces(placement, "small", 256 * 1024, 4)  # 512 KiB a server
    assert sorted(p.count * 4 for p in small) == [32 * 1024] * 32


def test_fast_links_get_fewer_larger_pieces():
    """With the links' rate in the cluster file, no piece carries less than PIECE_LINK_TIME_S of it (ramp
    pieces a quarter and a half of that), unless a stream would get fewer than NETWORK_MIN_DEPTH pieces of a
    range, and none less than PIECE_MIN_LINK_TIME_S; slower links keep the depth's pieces, one host ignores
    the rate."""
    assert (PIECE_LINK_TIME_S, NETWORK_MIN_DEPTH, PIECE_MIN_LINK_TIME_S) == (4e-3, 8, 0.5e-3)
    count = 16 * MiB // 4  # 4 MiB a server at n = 4, k = 0
    by_count = check_pieces(Placement(make_config(4, 0, one_host=False)), "big", count, 4)
    # 200 Mbit/s: the depth's pieces (128 KiB) are larger than the floor (100 kB) already
    assert check_pieces(Placement(make_config(4, 0, one_host=False, link_rate="200mbit")), "big", count, 4) == by_count

    def sizes_of(rate: str) -> list[list[int]]:
        pieces = check_pieces(Placement(make_config(4, 0, one_host=False, link_rate=rate)), "big", count, 4)
        return [[p.count * 4 for p in pieces if p.server == sid] for sid in range(4)]

    floor = 500e6 / 8 * PIECE_LINK_TIME_S  # 500 Mbit/s: 4 ms, 250 kB, 16 pieces of a 4 MiB range
    for sizes in sizes_of("500mbit"):
        assert len(sizes) == 20 < len(by_count) / 4, sizes
        assert all(0.9 * floor <= size <= floor for size in sizes[2:-2]), sizes  # the floor, evened out
        assert sizes[:2] == sizes[-2:][::-1] and abs(sizes[0] - floor / 4) < 4, sizes  # the ramp, from the floor
    # 1 Gbit/s: 8 ms (1 MB) would leave a stream 4 pieces of the range, so the depth's 8 (512 KiB) it is
    for sizes in sizes_of("1gbit"):
        assert len(sizes) == 11 and all(0.9 * 512 * KiB <= size <= 512 * KiB for size in sizes[2:-2]), sizes
        assert sizes[:2] == sizes[-2:][::-1] == [128 * KiB, 256 * KiB], sizes
    least = 10e9 / 8 * PIECE_MIN_LINK_TIME_S  # 10 Gbit/s: 4 ms would leave 1 piece, the depth 512 KiB ones
    for sizes in sizes_of("10gbit"):
        assert len(sizes) == 10 and all(0.8 * least <= size <= 4 * MiB for size in sizes[2:-2]), sizes
        assert abs(sizes[0] - least / 4) < 4, sizes
    assert max(max(sizes) for sizes in sizes_of("400gbit")) == 4 * MiB  # never over partition_bytes
    one_host = check_pieces(Placement(make_config(4, 0, link_rate="10gbit")), "big", count, 4)
    assert one_host == check_pieces(Placement(make_config(4, 0)), "big", count, 4)


def test_a_piece_s_time_grows_with_the_rate_above_500_mbit():
    """Up to PIECE_TIME_GROWS_ABOVE_BITS a piece carries at least PIECE_LINK_TIME_S (4 ms) of the link; above,
    that time grows with the rate, to PIECE_LINK_TIME_MAX_S (8 ms) from 1 Gbit/s: the faster the link, the more
    CPU its bytes take, and the fewer pieces a second it can afford."""
    assert (PIECE_TIME_GROWS_ABOVE_BITS, PIECE_LINK_TIME_MAX_S) == (500e6, 8e-3)
    assert [piece_link_time(b) for b in (100e6, 200e6, 500e6, 750e6, 1e9, 10e9)] == \
        [4e-3, 4e-3, 4e-3, 6e-3, 8e-3, 8e-3]
    count = 64 * MiB // 4  # 16 MiB a server at n = 4, k = 0: the depth binds at neither rate

    def middle(rate: str) -> list[int]:
        pieces = check_pieces(Placement(make_config(4, 0, one_host=False, link_rate=rate)), "big", count, 4)
        sizes = [p.count * 4 for p in pieces if p.server == 0]
        return sizes[2:-2]

    assert all(0.9 * 1e6 <= size <= 1e6 for size in middle("1gbit"))  # 8 ms of 1 Gbit/s: 1 MB
    assert all(0.9 * 562.5e3 <= size <= 562.5e3 for size in middle("750mbit"))  # 6 ms of 750 Mbit/s
    assert all(0.9 * 512 * KiB <= size <= 512 * KiB for size in middle("500mbit"))  # 4 ms (250 kB) < the depth


def test_interleave_takes_every_flow_in_turn():
    """A worker issues the first piece of every flow (server, stream), then the second, ...; each flow's
    pieces keep their order."""
    placement = Placement(make_config(4, 2, one_host=False))
    pieces = check_pieces(placement, "big", 16 * MiB // 4, 4)
    order = interleave(pieces)
    assert sorted(order, key=lambda p: p.part) == pieces
    flows = sorted({(p.server, p.stream) for p in pieces})
    assert len(flows) == 4 * 1 + 2 * 3
    assert sorted((p.server, p.stream) for p in order[:len(flows)]) == flows  # one piece of every flow first
    for flow in flows:
        mine = [p.part for p in order if (p.server, p.stream) == flow]
        assert mine == sorted(mine)
    depth: dict[tuple[int, int], int] = defaultdict(int)
    rows = []  # the index of each issued piece within its flow: no flow gets its (i+1)-th before all i-th
    for p in order:
        rows.append(depth[(p.server, p.stream)])
        depth[(p.server, p.stream)] += 1
    assert rows == sorted(rows)
    assert interleave([]) == []


def test_issue_order_is_the_interleaved_split_remembered_per_name(monkeypatch: pytest.MonkeyPatch):
    """The cut a worker issues is worked out once per name and size (the same every step); the cache keeps at
    most PLACEMENT_CACHE_NAMES names, forgetting the oldest first, and a forgotten name is cut again alike."""
    monkeypatch.setattr(placement_module, "PLACEMENT_CACHE_NAMES", 3)
    placement = Placement(make_config(4, 2, one_host=False))
    calls: list[str] = []
    split = placement.split
    monkeypatch.setattr(placement, "split",
                        lambda name, count, itemsize: calls.append(name) or split(name, count, itemsize))
    first = placement.issue_order("big", 16 * MiB // 4, 4)
    assert list(first) == interleave(split("big", 16 * MiB // 4, 4))
    assert placement.issue_order("big", 16 * MiB // 4, 4) is first and calls == ["big"]
    assert placement.issue_order("big", 8 * MiB // 4, 4) == tuple(interleave(split("big", 8 * MiB // 4, 4)))
    assert calls == ["big", "big"]  # another size of the name is another cut
    for name in ("a", "b"):
        placement.issue_order(name, 1024, 4)
    assert placement.issue_order("big", 16 * MiB // 4, 4) == first and calls[-1] == "big" and len(calls) == 5
    assert len(placement._orders) == 3
    anchors = {name: placement.anchor(name) for name in ("w0", "w1", "w2", "w3", "w0")}
    assert len(placement._anchors) == 3 and placement.anchor("w0") == anchors["w0"]
    assert all(Placement(make_config(4, 2, one_host=False)).anchor(name) == index for name, index in anchors.items())


def test_itemsize_larger_than_partition_still_progresses():
    placement = Placement(make_config(2, 0, partition_bytes=2))
    pieces = check_pieces(placement, "x", 5, 8)
    assert all(p.count == 1 for p in pieces) and len(pieces) == 5


@pytest.mark.parametrize("one_host", [True, False])
def test_a_tiny_partition_cuts_a_large_tensor_into_at_most_about_max_pieces_split_by_theorem1(one_host):
    """partition_bytes = 4 cut a million float32 into a million pieces: the worker daemon's event loop stalled
    cutting and pushing them, and the rank failed at the timeout. The pieces grow to a MAX_PIECES-th of the
    tensor (245 elements); the servers' ranges are Theorem 1's split, exactly, as before."""
    placement = Placement(make_config(2, 1, partition_bytes=4, one_host=one_host))  # shares 1/4, 1/4, 1/2
    pieces = check_pieces(placement, "w", 1_000_000, 4)
    # one host: ranges of 250,000, 250,000 and 500,000 elements in pieces of at most 245 (1021 + 1021 + 2041);
    # several hosts: each stream's first and last two pieces are smaller (the ramps), a few more pieces
    assert len(pieces) == (4083 if one_host else 4092) and max(p.count for p in pieces) == 245 == -(-10**6 // 4096)
    by_server: dict[int, int] = defaultdict(int)
    for p in pieces:
        by_server[p.server] += p.count
    assert dict(by_server) == {0: 250_000, 1: 250_000, 2: 500_000}
    fused = fused_name(2, 0, "float32", False, "run.0")  # a fused tensor: all on its server
    assert [(p.server, p.count) for p in placement.split(fused, 1_000_000, 4)] == [(2, 245)] * 4081 + [(2, 155)]
    # a partition_bytes that cuts fewer pieces is as it was
    assert len(check_pieces(Placement(make_config(2, 1, partition_bytes=1000)), "w", 1_000_000, 4)) == 4000


@pytest.mark.parametrize("partition,count,itemsize", [(64, 100_003, 4), (4, 3, 8), (8, 1_000_000, 8)])
def test_no_piece_is_larger_than_a_frame_may_carry(partition, count, itemsize):
    """With max_payload_bytes = partition_bytes (a valid file then; the least is 64 KiB since) a piece grown to a
    MAX_PIECES-th of the tensor, or of one element larger than the partition, was larger than a frame may carry:
    the server dropped the worker at every push, which pushed it again on its next connection, for ever (a
    review). The placement still keeps every piece within the limit, whatever it is."""
    config = make_config(2, 1, partition_bytes=partition)
    config = dataclasses.replace(config, max_payload_bytes=max(partition, 8))
    pieces = check_pieces(Placement(config), "p", count, itemsize)
    assert max(p.count for p in pieces) * itemsize <= config.max_payload_bytes
    with pytest.raises(ConfigError, match="cluster.max_payload_bytes must be at least 65536 "):
        parse_config({"cluster": {"workers": 1, "partition_bytes": 4, "max_payload_bytes": 4},
                      "server": [{"id": 0, "address": "127.0.0.1:9000"}],
                      "worker": [{"id": 0, "local_size": 1, "socket": "/tmp/w0.sock"}]})


def test_split_is_deterministic_across_placements():
    rng = random.Random(99)
    tensors = [(f"model/layer{i}/{kind}", rng.randrange(0, 3_000_000), rng.choice([2, 4, 8]))
               for i in range(60) for kind in ("w", "b")]
    for n, k in THEOREM_LAYOUTS:
        a, b = Placement(make_config(n, k)), Placement(make_config(n, k))
        for name, count, itemsize in tensors:
            assert a.split(name, count, itemsize) == b.split(name, count, itemsize)
        # and independent of the order tensors are split in
        forward = [a.split(*t) for t in tensors]
        backward = [b.split(*t) for t in reversed(tensors)][::-1]
        assert forward == backward


def test_split_known_values():
    """Pin the algorithm: any change to the hash, the anchor choice or the rounding shows up here."""
    placement = Placement(make_config(2, 1, partition_bytes=16))  # shares 1/4, 1/4, 1/2; 4 floats a part
    # crc32(b"grad") / 2**32 = 0.902 falls in server 2's slice [1/2, 1) of the cumulative shares
    assert placement.anchor("grad") == 2
    # exact 5 / 2.5 / 2.5 in anchor order (2, 0, 1); the spare element goes to the first tie: server 0
    assert placement.split("grad", 10, 4) == [
        Piece(0, 2, 0, 3), Piece(1, 2, 3, 2), Piece(2, 0, 5, 3), Piece(3, 1, 8, 2),
    ]
    placement = Placement(make_config(4, 2))  # gpu 1/10 each, cpu 3/10 each
    # cpu servers: 900,000 floats in 8 parts of 112,500; gpu servers: 300,000 in 5 equal parts of at least
    # 65,536 (256 KiB)
    pieces = placement.split("layer0.weight", 3_000_000, 4)
    ranges = [(p.server, p.offset, p.count) for p in pieces]
    assert ranges[:8] == [(5, i * 112_500, 112_500) for i in range(8)]
    assert ranges[8:13] == [(0, 900_000 + i * 60_000, 60_000) for i in range(5)]
    assert [r[0] for r in ranges[13:]] == [1] * 5 + [2] * 5 + [3] * 5 + [4] * 8
    assert [p.part for p in pieces] == list(range(len(pieces)))


def test_small_tensors_go_whole_to_their_anchor():
    placement = Placement(make_config(4, 2))  # 4 MiB partitions: up to 64 KiB is small
    for i in range(200):
        pieces = placement.split(f"bias.{i}", 16384, 4)
        assert pieces == [Piece(0, placement.server_ids[placement.anchor(f"bias.{i}")], 0, 16384)]
    assert len(placement.split("big", 16385, 4)) == 6


def test_anchors_follow_the_shares():
    placement = Placement(make_config(4, 2))  # cpu servers 4 and 5 hold 3/10 each, gpu ones 1/10
    counts = defaultdict(int)
    for i in range(20000):
        counts[placement.server_ids[placement.anchor(f"t{i}")]] += 1
    for sid, share in server_shares(make_config(4, 2)).items():
        assert abs(counts[sid] / 20000 - float(share)) < 0.02, (sid, counts[sid])


def _model_sizes(seed: int) -> list[tuple[str, int, int]]:
    rng = random.Random(seed)
    sizes = []
    for i in range(150):
        r = rng.random()
        if r < 0.35:
            count = rng.randrange(1, 1025)  # biases, norms
        elif r < 0.7:
            count = rng.randrange(1024, 1_000_000)
        elif r < 0.95:
            count = rng.randrange(1_000_000, 10_000_000)
        else:
            count = rng.randrange(10_000_000, 30_000_001)  # embeddings
        sizes.append((f"model.layers.{i}.param", count, rng.choice([4, 4, 2, 8])))
    sizes.append(("tok_embeddings.weight", 30_000_000, 4))
    sizes.append(("scalar", 1, 4))
    return sizes


@pytest.mark.parametrize("n,k", THEOREM_LAYOUTS + [(1, 0), (2, 3)])
def test_model_load_matches_theorem1_targets(n, k):
    config = make_config(n, k)
    placement = Placement(config)
    shares = server_shares(config)
    tensors = _model_sizes(seed=n * 100 + k)
    load = defaultdict(int)
    total = 0
    for name, count, itemsize in tensors:
        for p in placement.split(name, count, itemsize):
            load[p.server] += p.count * itemsize
        total += count * itemsize
    assert sum(load.values()) == total
    max_item = max(itemsize for _, _, itemsize in tensors)
    for s in config.servers:
        target = shares[s.id] * total
        deviation = abs(load[s.id] - target)
        assert deviation <= config.partition_bytes, (s.id, float(target), load[s.id])
        # large tensors deviate by less than one element each; small ones by at most their size
        small = sum(c * i for _, c, i in tensors if c * i <= placement.small_tensor_bytes)
        assert deviation < len(tensors) * max_item + small, (s.id, float(deviation))
        if shares[s.id] == 0:
            assert load[s.id] == 0


@pytest.mark.parametrize("k,cpu_streams", [(0, None), (1, 2), (2, 3), (3, 6), (4, 1)])
def test_streams_in_proportion_to_the_shares(k, cpu_streams):
    """Servers on several hosts: connections per server in proportion to its share (M_cpu / M_gpu =
    2(n-1)/(n-k) for n = 4), so that every flow carries about the same bytes; partitions of a range take
    the streams in turn. On one host: one connection each."""
    n = 4
    network = Placement(make_config(n, k, one_host=False))
    for sid in range(n):
        assert network.streams(sid) == 1
    for sid in range(n, n + k):
        assert network.streams(sid) == cpu_streams
    pieces = check_pieces(network, "big", 16 * MiB // 4, 4)
    for sid in range(n + k):
        mine = [p for p in pieces if p.server == sid]
        assert [p.stream for p in mine] == [i % network.streams(sid) for i in range(len(mine))]
    # every flow carries about the same bytes (within a piece)
    per_flow = defaultdict(int)
    for p in pieces:
        per_flow[(p.server, p.stream)] += p.count * 4
    largest_piece = max(p.count * 4 for p in pieces)
    assert max(per_flow.values()) - min(per_flow.values()) <= 2 * largest_piece, per_flow
    one_host = Placement(make_config(n, k))
    assert all(one_host.streams(sid) == 1 for sid in range(n + k))
    assert {p.stream for p in check_pieces(one_host, "big", 16 * MiB // 4, 4)} == {0}


@pytest.mark.parametrize("k,window", [(0, 3), (1, 2), (2, 1), (3, 1), (4, 3)])
def test_the_window_is_the_largest_flow_s_spread_over_its_streams(k, window):
    """Every connection gets one window: window_pieces on the flow with the most streams, over its streams,
    rounded up; so each flow keeps pieces in flight in proportion to its share (a flow of three streams three
    pieces, not three windows). One stream each (k = 0, k = n, one host): the whole window. 0 stays 0."""
    n = 4
    network = Placement(make_config(n, k, one_host=False))
    assert network.stream_window(3) == window
    cpu_streams = max(network.streams(sid) for sid in range(n + k))
    assert cpu_streams * window >= 3 > cpu_streams * (window - 1)  # the largest flow: at least 3, by whole pieces
    assert network.stream_window(0) == 0
    assert network.stream_window(12) == -(-12 // cpu_streams)
    assert Placement(make_config(n, k)).stream_window(3) == 3


@pytest.mark.parametrize("one_host", [True, False])
def test_a_fused_tensor_lives_whole_on_the_server_that_planned_it(one_host):
    p = Placement(make_config(4, 2, partition_bytes=MiB, one_host=one_host))
    for sid in p.server_ids:
        key = p.fused_key(sid, 3, "float16", True, "run.2")
        assert key == f"\x00fused/{sid}/3/float16/avg@run.2" and p.fused_key(sid, 3, "float16", True, "run.2") == key
        assert fused_lanes(key) == "run.2" and fused_lanes("weights@run.2") is None
        assert p.server_ids[p.anchor(key)] == sid
        for count in (1, 1000, 3 * MiB // 2 + 7):
            pieces = p.split(key, count, 2)
            assert {pc.server for pc in pieces} == {sid}
            assert [pc.part for pc in pieces] == list(range(len(pieces)))
            assert sum(pc.count for pc in pieces) == count and all(pc.count * 2 <= MiB for pc in pieces)
            assert [pc.offset for pc in pieces] == [sum(x.count for x in pieces[:i]) for i in range(len(pieces))]
            assert {pc.stream for pc in pieces} <= set(range(p.streams(sid)))
    assert p.fused_key(p.server_ids[0], 0, "int32", False, "").endswith("/0/int32@")


def test_a_fused_tensors_server_is_read_from_its_name_and_nothing_is_kept_per_name():
    """A lane generation's fused names are new at every reset of any worker (``bps_worker.fused_driver``): the
    placement keeps nothing per name (before, a pin per name, for as long as the daemon ran), and places a
    fused name it never made (a plan's, before ``fused_key``, or after a restart) on the server it says."""
    p = Placement(make_config(4, 2, partition_bytes=MiB))
    before = dict(vars(p))
    for sid in p.server_ids:
        for generation in range(50):
            key = fused_name(sid, 3, "float32", False, f"run.{generation}")
            assert p.server_ids[p.anchor(key)] == sid and {pc.server for pc in p.split(key, 3 * MiB // 4, 4)} == {sid}
            assert p.fused_key(sid, 3, "float32", False, f"run.{generation}") == key
    assert {k: len(v) for k, v in vars(p).items() if isinstance(v, dict)} == {
        k: len(v) for k, v in before.items() if isinstance(v, dict)}
    assert fused_server(fused_name(12, 0, "int8", True, "r.0")) == 12 and fused_server("weights") is None
