"""Which server sums which bytes: the paper's Theorem 1, split by bytes, deterministically.

With ``n`` worker machines, each with one colocated server, and ``k`` CPU-only
servers (``0 <= k <= n``), the optimal share of every round's bytes is

    M_cpu = 2(n-1) / (n^2 + kn - 2k)   for each CPU-only server
    M_gpu = (n-k)  / (n^2 + kn - 2k)   for each colocated server.

A small tensor (at most ``partition_bytes / SMALL_TENSOR_FRACTION`` bytes) goes whole to its *anchor*
server, chosen by a stable hash of its name with probability proportional to the servers' shares:
splitting a bias over every server would cost a message per server for a few bytes, and the hash keeps
the expected load on target (the deviation of many small tensors is far below one partition). Every
larger tensor is cut into contiguous per-server ranges proportional to the shares (largest-remainder
rounding to whole elements, ties broken by an order starting at the tensor's anchor server), and each
range into partitions of at most ``partition_bytes`` (larger where a tensor would take more than about
``MAX_PIECES`` of them) and, for pipelining, into at least
``PIPELINE_DEPTH`` of them (none under ``MIN_PIPELINE_BYTES``): a server answers a partition only once
every worker pushed it, so with one partition per server each link would carry all the pushes and then
all the sums, never both at once (measured on emulated links: 2x the optimal time at 4 MiB partitions,
``benchmarks/RESULTS.md``). Where the servers are on several hosts (the network is the limit) the ranges
are cut finer, into at least ``NETWORK_PIPELINE_DEPTH`` partitions per stream (below) of at least
``NETWORK_MIN_PIPELINE_BYTES``, and, where the cluster file gives the links' rate, of at least
``PIECE_LINK_TIME_S`` of it (more on links faster than ``PIECE_TIME_GROWS_ABOVE_BITS``:
:func:`piece_link_time`) but no fewer than ``NETWORK_MIN_DEPTH`` per stream, and of at least
``PIECE_MIN_LINK_TIME_S`` of it (fewer and larger pieces where links are fast: a piece costs CPU whatever
its size): the worker's links pace their pushes by a window of a few partitions
(``bps_worker.window``), so that every worker's flow into a server progresses at the same pace, and that
needs many partitions per range. On one host (every server at the same address: a demo or a test, where
memory bandwidth is the limit) each partition costs CPU that the pipelining does not win back, so the
ranges are cut coarser. On several hosts, each stream's first two and last two pieces are also smaller,
a quarter and a half of the others (``Placement._sizes``), and a worker issues the pieces of all its
flows in turn (``interleave``): a server's first sum waits for every worker's first piece into it and
its last sums for the last ones, so the pipeline fills and drains sooner (measured on emulated links:
the first sums leave sooner and k=4 comes closer to the optimal time, ``benchmarks/RESULTS.md``).

Streams: TCP shares a link fairly between its connections, but the Theorem 1 split gives a CPU-only
server a larger share than a colocated one (``M_cpu / M_gpu = 2(n-1)/(n-k)``, 3 at n=4, k=2). With
one connection each, a worker's flow to a CPU-only server would get the same part of its uplink as
a flow to a colocated one and finish last, with the CPU-only machine's downlink idle part of the time
(measured: 1.3x the optimal time at k=1, 2). So, where the servers are on several hosts, a worker
opens ``streams(server)`` connections to each server, in proportion to its share (the smallest
positive share gets one, at most ``MAX_STREAMS``), and the partitions of a server's range take them
in turn: every flow on every link then carries about the same bytes, and fair sharing is the
optimal split.

Windows: a worker paces its pushes by the answers (``bps_worker.window``), and every connection gets the same
window (:meth:`Placement.stream_window`), or the flows would no longer share the links in proportion to the
shares. With ``cluster.window_pieces`` pieces a connection, a flow of three streams kept three times the pieces
of a one-stream flow in flight, so a CPU-only server's downlink queued three times the time of the others' and
its first sums, which wait for every worker's first pieces, left late. So ``window_pieces`` is the window of
the largest flow, spread over its streams: 1 a connection at n = 4, k = 2, 2 at k = 1, the whole window where
every server has one stream (k = 0, k = n, one host). Measured on emulated links, ``benchmarks/RESULTS.md``.

A server's load deviates from its target by less than one element per
tensor, whatever the order in which names appear, and every worker computes the
same pieces from the config and the tensor alone. Partition 0 always lives on
the anchor server, even for an empty tensor, so processes that disagree about a
tensor's shape always meet at one key and the server can tell them.

Other layouts (``k > n``, several servers on one machine, workers without a
colocated server) fall back to spreading evenly over the CPU-only servers if
there are at least ``n`` of them, else over all servers.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from fractions import Fraction
from typing import TypeVar

from protocol.config import ClusterConfig
from protocol.messages import MAX_STREAMS, fused_name, fused_server


# Tensors of at most partition_bytes / SMALL_TENSOR_FRACTION bytes are not split across servers.
SMALL_TENSOR_FRACTION = 64
# Each server's range of a tensor is cut into at least this many partitions, none under MIN_PIPELINE_BYTES
# (nor over partition_bytes), so that pushes, sums and pulls of one tensor overlap on every link.
PIPELINE_DEPTH = 8
MIN_PIPELINE_BYTES = 256 * 1024
# Servers on several hosts: finer (measured on emulated links, benchmarks/RESULTS.md).
NETWORK_PIPELINE_DEPTH = 32  # per stream
NETWORK_MIN_PIPELINE_BYTES = 32 * 1024
# Where the cluster file gives the link rate (cluster.link_rate), no piece carries less than
# PIECE_LINK_TIME_S of the link's time, unless that would leave a stream fewer than NETWORK_MIN_DEPTH pieces
# of a range; and never less than PIECE_MIN_LINK_TIME_S. A piece costs the daemons 100-200 us of CPU
# whatever its size: at 1 Gbit/s the depth's pieces (1 ms of the link) made them CPU-bound; pieces of 4 ms
# cost a GPU machine a quarter less CPU than 2 ms ones there (n = 4, k = 0), and a third less at 200 Mbit/s,
# k = 2, for 1-3% more time at 1 Gbit/s, k = 0 (the pipeline fills and drains a little later); at 10 Gbit/s
# pieces of 0.5 ms were the best measured, and at 200 Mbit/s, k = 0 the depth's pieces are larger than the
# floor (measured on emulated links, benchmarks/RESULTS.md).
PIECE_LINK_TIME_S = 4e-3
NETWORK_MIN_DEPTH = 8  # per stream
PIECE_MIN_LINK_TIME_S = 0.5e-3
# Above PIECE_TIME_GROWS_ABOVE_BITS a piece's time grows with the rate, up to PIECE_LINK_TIME_MAX_S (8 ms
# from 1 Gbit/s). A machine's CPU per second of link is its bytes' (in proportion to the rate) plus its
# pieces' (the pieces a second): the faster the link, the fewer pieces a second it can afford. At 1 Gbit/s,
# n = 4, k = 0, pieces of 8 ms cost a GPU machine a quarter less CPU than 4 ms ones (1.5-1.9x a gloo rank,
# against 2.1-2.3x) for about 2% more time; at 200 Mbit/s, k = 2, pieces of 8 ms took 1.30 t_opt against
# 1.15 (a CPU-only server's start waits for every worker's first pieces), so slower links keep 4 ms
# (measured on emulated links, benchmarks/RESULTS.md).
PIECE_TIME_GROWS_ABOVE_BITS = 500e6
PIECE_LINK_TIME_MAX_S = 8e-3
# A tensor takes at most about MAX_PIECES pieces: where partition_bytes would cut it into more, its pieces grow
# to a MAX_PIECES-th of it (each range still pipelined as above). A piece costs the daemons CPU whatever its
# size: a partition_bytes of a few bytes cut a tensor of a million elements into a million pieces, and the
# worker daemon's event loop stalled cutting and pushing them until the rank's operation timed out.
MAX_PIECES = 4096
# Names whose anchor and pieces a Placement remembers (the oldest forgotten first): a job issues the same
# names every step, and the cut is the same every time (issue 16's per-name cache).
PLACEMENT_CACHE_NAMES = 1 << 14


def piece_link_time(link_bits_per_s: float) -> float:
    """The least link time of a piece on links of ``link_bits_per_s`` (see PIECE_TIME_GROWS_ABOVE_BITS)."""
    return min(PIECE_LINK_TIME_MAX_S, PIECE_LINK_TIME_S * max(1.0, link_bits_per_s / PIECE_TIME_GROWS_ABOVE_BITS))


@dataclass(frozen=True, slots=True)
class Piece:
    """One partition of a tensor: ``count`` elements from ``offset``, summed by ``server``."""

    part: int
    server: int
    offset: int
    count: int
    stream: int = 0  # which of the worker's connections to ``server`` carries it


def theorem1_shares(n: int, k: int) -> tuple[Fraction, Fraction]:
    """(M_cpu, M_gpu) as fractions of M for ``n`` workers and ``k`` CPU-only servers, 0 <= k <= n."""
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"Theorem 1 needs n >= 1 and 0 <= k <= n, got n={n}, k={k}")
    if n == 1:  # one machine: nothing crosses a network, sum next to the worker
        return Fraction(0), Fraction(1)
    denom = n * n + k * n - 2 * k
    return Fraction(2 * (n - 1), denom), Fraction(n - k, denom)


def server_shares(config: ClusterConfig) -> dict[int, Fraction]:
    """Each server's share of every round's bytes (sums to 1).

    Theorem 1 is about machines: where a worker's machine runs several servers (several ``[[server]]`` tables
    with its ``worker``, for more cores), they share its ``M_gpu`` evenly, and its link carries what one server
    would. One worker machine sends nothing over a network: its own servers take everything (the paper's
    denominator is 0)."""
    return split(config)[0]


def split(config: ClusterConfig) -> tuple[dict[int, Fraction], str]:
    """:func:`server_shares`, and a line that says which split it is (the worker daemon logs it once it listens:
    a daemon that cannot start says only why)."""
    n = config.workers
    cpu = [s.id for s in config.servers if s.worker is None]
    colocated: dict[int, list[int]] = {}
    for s in config.servers:
        if s.worker is not None:
            colocated.setdefault(s.worker, []).append(s.id)
    every_worker = len(colocated) == n
    if every_worker and (len(cpu) <= n or n == 1):
        m_cpu, m_gpu = theorem1_shares(n, min(len(cpu), n))
        note = (f"Theorem 1's split for n = {n}, k = {len(cpu)}: {m_cpu} of every round's bytes on each CPU-only "
                f"server, {m_gpu} on each worker machine's servers")
        shares = {sid: (Fraction(0) if n == 1 else m_cpu) for sid in cpu}
        for ids in colocated.values():
            shares.update({sid: m_gpu / len(ids) for sid in ids})
        return shares, note
    if len(cpu) >= n:
        note = (f"{len(cpu)} CPU-only servers for {n} workers (k {'>' if every_worker else '>='} n): spreading evenly "
                f"over the CPU-only servers")
        chosen = cpu
    else:
        note = (f"server layout has workers without a colocated server and fewer CPU-only servers than workers: "
                f"spreading evenly over all {len(config.servers)} servers")
        chosen = [s.id for s in config.servers]
    shares = {s.id: Fraction(0) for s in config.servers}
    shares.update({sid: Fraction(1, len(chosen)) for sid in chosen})
    return shares, note


def interleave(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` in the order a worker issues them: the first piece of every flow (server and
    stream), then the second of every flow, and so on; each flow keeps its pieces' order.

    Issued in range order, the first flows' pieces fill the uplink's queue before the last flows get
    a byte out, and a server's first sum waits for every worker's first piece into it; interleaved,
    every server gets its first piece at once (figures in benchmarks/RESULTS.md).
    """
    flows: dict[tuple[int, int], int] = {}
    rank: list[int] = []
    for piece in pieces:
        key = (piece.server, piece.stream)
        rank.append(flows.get(key, 0))
        flows[key] = rank[-1] + 1
    order = sorted(range(len(pieces)), key=lambda i: rank[i])  # stable: flows keep their first-seen order
    return [pieces[i] for i in order]


K = TypeVar("K")
V = TypeVar("V")


def _remember(cache: dict[K, V], key: K, value: V) -> V:
    """``value`` kept in ``cache`` under ``key``, the oldest entry forgotten beyond PLACEMENT_CACHE_NAMES."""
    if len(cache) >= PLACEMENT_CACHE_NAMES:
        del cache[next(iter(cache))]
    cache[key] = value
    return value


class Placement:
    """Cuts tensors into pieces for one cluster configuration."""

    def __init__(self, config: ClusterConfig) -> None:
        self.partition_bytes = config.partition_bytes
        self.max_payload_bytes = config.max_payload_bytes
        self.one_host = config.one_host
        if config.one_host:
            self.depth, self.min_bytes = PIPELINE_DEPTH, MIN_PIPELINE_BYTES
        else:
            self.depth, self.min_bytes = NETWORK_PIPELINE_DEPTH, NETWORK_MIN_PIPELINE_BYTES
        # The least bytes of a piece for the link's rate (0: rate not given, or one host).
        link_bytes_per_s = 0 if config.one_host else config.link_bits_per_s / 8
        self.rate_bytes = int(link_bytes_per_s * piece_link_time(8 * link_bytes_per_s))
        self.min_rate_bytes = int(link_bytes_per_s * PIECE_MIN_LINK_TIME_S)
        shares, self.split_note = split(config)
        self.server_ids = [s.id for s in config.servers]
        self.shares = [shares[sid] for sid in self.server_ids]
        self.small_tensor_bytes = self.partition_bytes // SMALL_TENSOR_FRACTION
        cumulative, total = [], Fraction(0)
        for share in self.shares:
            total += share
            cumulative.append(total)
        self._cumulative = cumulative
        positive = [share for share in self.shares if share > 0]
        smallest_share = min(positive) if positive else Fraction(1)
        # Fused tensors (bps_worker.fusion): all of each one on the server that planned it, which its name says
        # (nothing kept per name: a lane generation's names are new at every reset of any worker).
        self._index = {sid: i for i, sid in enumerate(self.server_ids)}
        self._streams = {sid: 1 if config.one_host or share == 0
                         else max(1, min(MAX_STREAMS, round(share / smallest_share)))
                         for sid, share in zip(self.server_ids, self.shares)}
        self._anchors: dict[str, int] = {}
        self._orders: dict[tuple[str, int, int], tuple[Piece, ...]] = {}

    def streams(self, server: int) -> int:
        """How many connections a worker opens to ``server`` (see the module docstring)."""
        return self._streams[server]

    def stream_window(self, window_pieces: int) -> int:
        """The pieces each connection may have unanswered (``bps_worker.window``): ``cluster.window_pieces``
        on the worker's largest flow, spread over that server's streams (rounded up; 0, no pacing, stays 0).

        Every connection gets the same window, so that fair sharing keeps the flows' rates in proportion to
        the shares, and each flow's pieces in flight are in proportion to its share: a CPU-only server's
        downlink queues about as many pieces as a colocated server's (see the module docstring, Windows)."""
        if window_pieces <= 0:
            return 0
        return -(-window_pieces // max(self._streams.values(), default=1))

    def fused_key(self, server: int, lane: int, dtype: str, average: bool, lanes: str) -> str:
        """The name of server ``server``'s fused tensor of ``dtype`` (and ``average``) on ``lane`` of lane
        generation ``lanes`` (``protocol.messages.fused_name``): all of it lives on that server (the anchor of
        every small tensor in it)."""
        return fused_name(server, lane, dtype, average, lanes)

    def anchor(self, name: str) -> int:
        """Index (into ``server_ids``) of the server that holds partition 0 of ``name``.

        Chosen with probability proportional to the servers' shares (never a server without one); a fused
        tensor's is the server that planned it (``fused_key``).
        """
        fused = self._fused_index(name)
        return fused if fused is not None else self._hashed_index(name)

    def _fused_index(self, name: str) -> int | None:
        """Index of the server a fused tensor's name says (``fused_key``); None for any other name."""
        server = fused_server(name)
        return None if server is None else self._index.get(server)

    def _hashed_index(self, name: str) -> int:
        """Index of an ordinary tensor's anchor (see :meth:`anchor`), remembered per name."""
        index = self._anchors.get(name)
        if index is None:
            index = _remember(self._anchors, name, self._hash_to_index(name))
        return index

    def _hash_to_index(self, name: str) -> int:
        u = Fraction(zlib.crc32(name.encode()), 1 << 32)
        for i, bound in enumerate(self._cumulative):
            if u < bound and self.shares[i] > 0:
                return i
        return max(i for i, share in enumerate(self.shares) if share > 0)

    def issue_order(self, name: str, count: int, itemsize: int) -> tuple[Piece, ...]:
        """The pieces of :meth:`split` in the order a worker issues them (:func:`interleave`), remembered per
        name and size: the same every step."""
        key = (name, count, itemsize)
        order = self._orders.get(key)
        if order is None:
            order = _remember(self._orders, key, tuple(interleave(self.split(name, count, itemsize))))
        return order

    def split(self, name: str, count: int, itemsize: int) -> list[Piece]:
        """The pieces of a tensor of ``count`` elements of ``itemsize`` bytes."""
        s = len(self.server_ids)
        fused = self._fused_index(name)  # (the name read once)
        start = fused if fused is not None else self._hashed_index(name)
        if count * itemsize <= self.small_tensor_bytes:
            return [Piece(0, self.server_ids[start], 0, count)]
        # Elements of a piece: at most a partition, more where that would make over MAX_PIECES, never more than a
        # frame may carry (a server drops a worker whose push is larger: it reconnected and pushed it again).
        largest = min(max(1, self.partition_bytes // itemsize, -(-count // MAX_PIECES)),
                      self.max_payload_bytes // itemsize)
        if fused is not None:  # a fused tensor: partitions of at most ``largest``, all on its server
            sid = self.server_ids[start]
            streams = self._streams[sid]
            return [Piece(i, sid, lo, min(largest, count - lo), i % streams)
                    for i, lo in enumerate(range(0, count, largest))]
        order = [(start + i) % s for i in range(s)]
        exact = [self.shares[i] * count for i in order]
        alloc = [int(x) for x in exact]
        left = count - sum(alloc)
        # Largest remainder first; among equal remainders, the anchor's order decides.
        by_remainder = sorted(range(s), key=lambda j: (-(exact[j] - alloc[j]), j))
        for j in by_remainder[:left]:
            alloc[j] += 1
        smallest = max(1, min(self.partition_bytes, self.min_bytes) // itemsize)
        pieces: list[Piece] = []
        offset = 0
        for j, idx in enumerate(order):
            remaining = alloc[j]
            if remaining == 0 and j == 0:
                pieces.append(Piece(0, self.server_ids[idx], offset, 0))
                continue
            streams = self._streams[self.server_ids[idx]]
            by_rate = max(self.min_rate_bytes // itemsize,
                          min(self.rate_bytes // itemsize, -(-remaining // (NETWORK_MIN_DEPTH * streams))))
            per_part = min(largest, max(smallest, -(-remaining // (self.depth * streams)), by_rate))
            for turn, take in enumerate(self._sizes(remaining, per_part, smallest, streams)):
                pieces.append(Piece(len(pieces), self.server_ids[idx], offset, take, turn % streams))
                offset += take
        return pieces

    def _sizes(self, total: int, per_part: int, smallest: int, streams: int) -> list[int]:
        """Element counts of one server range's pieces, in order; the pieces take the streams in turn.

        Where the servers are on several hosts, every stream's first and last pieces are a quarter
        and a half of the others (none under ``smallest``): the first sums leave once every worker's
        first piece arrived, and the last ones after its last piece, so smaller pieces there shorten
        the pipeline's fill and drain.
        """
        ramp: list[int] = []
        if not self.one_host:
            ramp = [max(smallest, per_part // 4)] * streams + [max(smallest, per_part // 2)] * streams
            if ramp[0] >= per_part or 2 * sum(ramp) + per_part * streams > total:
                ramp = []
        middle = total - 2 * sum(ramp)
        count = -(-middle // per_part)
        sizes = [middle // count + (1 if i < middle % count else 0) for i in range(count)] if count else []
        return ramp + sizes + ramp[::-1]

