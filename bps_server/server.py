"""The Summation Service daemon: server-wide state around the connections and the aggregator.

:class:`SummationServer` listens, keeps the live connections (``links``: each worker's stream 0,
``streams``: its extra ones) and tasks, drops silent workers, sweeps rounds waiting for absent
ones, serves the metrics and health probes and tells systemd its status; each connection is a
:class:`~bps_server.connection.ServerConnection`, and the rounds are the
:class:`~bps_server.aggregator.Aggregator`'s.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from protocol.config import ClusterConfig, placement_items
from protocol.messages import FusePlan, FuseFailed, Notice, RoundQuery

from bps_runtime import metrics
from bps_runtime.health import STALL_LIMIT_S, Pulse, Verdict
from bps_runtime.admission import HANDSHAKE_DEADLINE_S, PENDING_PER_PEER, PENDING_TOTAL, Admission
from bps_runtime.loglimit import LogLimit
from bps_runtime.stalls import Notices
from bps_runtime.timeline import Timeline

from .aggregator import Aggregator
from .async_values import AsyncValues
from .fusion import Failed, Planner
from .rounds import Why
from .connection import BATCH_REPLY_MAX_BYTES, HANDSHAKE_MAX_HEADER_BYTES, HOLDER_SILENCE_FRACTION, ServerConnection

# How long a round query of a worker new to this run waits for the other workers to say hello and tell their
# replays (RoundTable.query_waits), at most (and at most the cluster's timeout): after a restart each live worker
# is back within its reconnect delay (at most a second, bps_worker.link); one that is not is answered as a job
# starting, as before.
QUERY_WAIT_S = 2.0

__all__ = ["BATCH_REPLY_MAX_BYTES", "HANDSHAKE_MAX_HEADER_BYTES", "ServerConfig", "ServerConnection",
           "SummationServer"]

log = logging.getLogger("bps.server")


@dataclass(frozen=True)
class ServerConfig:
    """Everything a Summation Service needs, built once from the cluster file and the command line."""

    cluster: ClusterConfig
    server_id: int
    threads: int = 2
    token: bytes | None = None  # from cluster.token_file
    host: str | None = None  # overrides the address in the cluster file (bind address)
    port: int | None = None
    timeline: str | None = None  # Chrome-trace file of every partition's rounds (bps_runtime.timeline)
    # Connections that have not finished their handshake (bps_runtime.admission): per host, in all, and
    # how long one may take.
    pending_per_host: int = PENDING_PER_PEER
    pending_total: int = PENDING_TOTAL
    handshake_deadline_s: float = HANDSHAKE_DEADLINE_S
    notify_socket: str | None = None  # systemd's NOTIFY_SOCKET: STATUS= lines and watchdog pings go there
    watchdog_s: float | None = None  # systemd's watchdog period (bps_runtime.health.watchdog_seconds)
    stall_limit_s: float = STALL_LIMIT_S  # /livez fails once the event loop has not beaten for this long

    @property
    def bind(self) -> tuple[str, int]:
        spec = self.cluster.server(self.server_id)
        return (self.host or spec.host, spec.port if self.port is None else self.port)


class SummationServer:
    """Server-wide state: the aggregator, live connections and tasks."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.incarnation = secrets.token_hex(8)  # this run of the server: workers notice a restart by it
        # What every connection's handshake compares a worker's cluster file with (issue 14, item 7).
        self.placement_items = placement_items(config.cluster)
        self.executor = ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="bps-sum")
        self.links: dict[int, ServerConnection] = {}  # each worker's stream 0
        self.streams: dict[tuple[int, int], ServerConnection] = {}  # (worker, stream) for streams 1, 2, ...
        # The numberings each worker's stream 0 said (its Hellos, its Resets), the last few: what an extra
        # connection says that is not among them is newer (see ServerConnection.drain_streams).
        self.numberings: dict[int, deque[str]] = {}
        self.timeline = Timeline(config.timeline, f"bps-server {config.server_id}") if config.timeline else None
        self.aggregator = Aggregator(config.cluster.workers, self.executor, lost_grace_s=config.cluster.timeout,
                                     deterministic=config.cluster.deterministic,
                                     connected=lambda w: w in self.links, timeline=self.timeline,
                                     stall_s=config.cluster.stall_timeout, server=f"server {config.server_id}")
        self.values = AsyncValues(config.cluster.workers, config.cluster.timeout, config.cluster.worker_of_rank,
                                  config.cluster.stall_timeout, self.aggregator.counters)
        self.connections: set[ServerConnection] = set()
        self.notices = Notices()  # each worker's stall lines of a look (tell_stalls)
        # The fused small sums this server is the anchor of (their lane generations named by this run).
        self.fusion = Planner(config.cluster.workers, warn_after_s=config.cluster.timeout, run=self.incarnation,
                              server=f"server {config.server_id}")
        self._plans_due = False
        self.admission = Admission(log, f"server {config.server_id}", deadline_s=config.handshake_deadline_s,
                                   per_peer=config.pending_per_host, total=config.pending_total)
        self.refusals = LogLimit()  # of the lines about second daemons with a worker's id
        # Round queries of workers new to this run, until it is known whether they rejoin (RoundTable.query_waits),
        # each at most QUERY_WAIT_S: its connection, the query, until when (loop time).
        self.waiting_queries: list[tuple[ServerConnection, RoundQuery, float]] = []
        self._query_timer: asyncio.TimerHandle | None = None  # at the first one's time
        self._recheck_soon = False  # a re-check of the waiting queries is scheduled (recheck_waiting_queries)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._silence_watch: asyncio.Future[None] | None = None
        self._endpoint: metrics.Endpoint | None = None
        self.pulse = Pulse(self.verdict, notify_socket=config.notify_socket, watchdog_s=config.watchdog_s)

    async def start(self) -> tuple[str, int]:
        """Listen; returns the bound (host, port)."""
        host, port = self.config.bind
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: ServerConnection(self), host, port, reuse_address=True)
        sockname = self._server.sockets[0].getsockname()
        spec = self.config.cluster.server(self.config.server_id)
        if spec.metrics is not None:  # (before any task: a busy metrics port is one line, no task left pending)
            self._endpoint = metrics.Endpoint(*spec.metrics, loop=loop, families=self.metric_families,
                                              health=lambda: self.pulse.latest, stall_limit_s=self.config.stall_limit_s)
        log.info("summation service %d listening on %s:%d (%d workers)", self.config.server_id,  # (once it all
                 sockname[0], sockname[1], self.config.cluster.workers)  # listens: a start that fails says only why)
        self._silence_watch = asyncio.ensure_future(self._watch_silence())
        self.pulse.start()
        return sockname[0], sockname[1]

    def verdict(self) -> Verdict:
        """Ready while it listens and is not stopping; the status names the workers not connected."""
        if self.stopping:
            return Verdict("stopping", "stopping")
        if self._server is None or not self._server.is_serving():
            return Verdict("not listening", "not listening yet")
        workers = self.config.cluster.workers
        missing = [str(w) for w in range(workers) if w not in self.links]
        status = f"serving {workers - len(missing)} of {workers} workers"
        if missing:
            status += f", waiting for worker{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
        return Verdict(None, status)

    def metric_families(self) -> list[metrics.Family]:
        c = self.aggregator.counters
        label = {"server": str(self.config.server_id)}
        # One series per worker of the cluster file from the start, at 0 until it pushes (a series that first
        # appears at its first bytes loses them to rate() and increase()).
        workers = range(self.config.cluster.workers)
        per_worker = tuple(({**label, "worker": str(w)}, float(c.bytes_by_worker.get(w, 0))) for w in workers)
        lags = tuple(({**label, "worker": str(w)}, (c.push_lag.get(w) or metrics.Histogram()).copy())
                     for w in workers)
        return [
            metrics.Family("bps_server_bytes_received_total", "counter", "Tensor bytes received in pushes",
                           per_worker),
            metrics.Family("bps_server_bytes_shared_memory_total", "counter",
                           "Of the bytes received, those read from the colocated worker's shared memory",
                           ((label, float(c.bytes_shm)),)),
            metrics.Family("bps_server_bytes_sent_total", "counter", "Tensor bytes sent in results",
                           ((label, float(c.bytes_sent)),)),
            metrics.Family("bps_server_pushes_total", "counter", "Pushes received", ((label, float(c.pushes)),)),
            metrics.Family("bps_server_rounds_completed_total", "counter", "Rounds summed and answered",
                           ((label, float(c.rounds_completed)),)),
            metrics.Family("bps_server_rounds_failed_total", "counter", "Rounds failed (mismatch, abort, lost worker)",
                           ((label, float(c.rounds_failed)),)),
            metrics.Family("bps_server_workers_connected", "gauge", "Worker connections",
                           ((label, float(len(self.links))),)),
            metrics.Family("bps_server_keys", "gauge", "Partition keys with state",
                           ((label, float(len(self.aggregator.keys))),)),
            metrics.Family("bps_server_fused_plans_total", "counter",
                           "Plans of fused small tensors sent to the workers (this server is those tensors' anchor)",
                           ((label, float(self.fusion.plans)),)),
            metrics.Family("bps_server_fused_tensors_total", "counter", "Small tensors planned, over all plans",
                           ((label, float(self.fusion.planned)),)),
            metrics.Family("bps_server_fused_waiting", "gauge",
                           "Small tensors reported by some workers, waiting for the others' processes to issue them",
                           ((label, float(len(self.fusion.waiting))),)),
            metrics.Family("bps_server_async_keys", "gauge", "Keys of asynchronous names with state here",
                           ((label, float(len(self.values.store.keys))),)),
            metrics.Family("bps_server_async_pushes_total", "counter",
                           "Asynchronous pushes received (deltas and inits, those of the next metric included)",
                           ((label, float(self.values.deltas)),)),
            metrics.Family("bps_server_async_replays_total", "counter",
                           "Asynchronous pushes whose step the value held already (sent again after a reconnect): "
                           "not added",
                           ((label, float(self.values.store.replays)),)),
            metrics.Family("bps_server_round_seconds", "histogram", "From a round's first push to its sum being sent",
                           ((label, c.round_seconds.copy()),)),
            metrics.Family("bps_server_push_lag_seconds", "histogram",
                           "From a round's first push to each worker's push of it: who the round waits for", lags),
        ]

    async def _watch_silence(self) -> None:
        """Drop a worker that has sent nothing (not even a ping) for ``cluster.timeout``: it died or
        stalled without closing its connection, and the rounds waiting for it must fail, not hang.
        Checks every ``timeout / 4``, so a round fails within 1.25 x the timeout. An observer silent as long
        is closed too."""
        timeout = self.config.cluster.timeout
        loop = asyncio.get_running_loop()
        while not self.stopping:
            await asyncio.sleep(timeout / 4)
            now = loop.time()
            for conn in [*self.links.values(), *self.streams.values()]:
                if conn.flow is not None and conn.flow.draining():
                    conn.last_seen = now  # we stopped reading it, and it reads what we send: alive
                if now - conn.last_seen > timeout and not conn.closed:
                    log.warning("worker %s sent nothing for %.1f s (limit %g s): dropping it", conn.worker,
                                now - conn.last_seen, timeout)
                    if conn.transport is not None:
                        conn.transport.abort()  # close() would wait to flush to a peer that reads nothing
                    conn.connection_lost(None)
            for conn in [c for c in self.connections if c.observer and not c.closed and now - c.last_seen > timeout]:
                # An observer asks and leaves (bps_worker.observer): one silent for the timeout holds a socket
                # for nothing (without a token, anyone could hold thousands).
                log.info("observer %s asked nothing for %.1f s (limit %g s): closing it", conn.peer,
                         now - conn.last_seen, timeout)
                conn.close()
            # Rounds that wait for a worker which is not connected at all (never came, or did not
            # come back after this server restarted) fail rather than wait for ever.
            self.aggregator.sweep(time.monotonic())
            self.fused(self.fusion.sweep(time.monotonic(), self.links.keys(), timeout,
                                         self.config.cluster.stall_timeout, self.aggregator.table.joined_at))
            self.aggregator.flush_logs()
            self.notices.say(self.aggregator.stall_warnings(time.monotonic()), "rounds have waited as long", log)
            self.notices.say(self.fusion.stall_warnings(time.monotonic()), "fused names have waited as long", log)
            self.tell_stalls()

    def tell_stalls(self) -> None:
        """Tell each worker this look's stall lines about its rounds (at most a few: ``Notices``): its daemon
        passes them on to its processes."""
        for worker, lines in self.notices.take(self.links.keys()).items():
            conn = self.links[worker]
            if not conn.closed:
                conn.send(Notice(lines))

    def holder(self, worker: int, daemon: str) -> ServerConnection | None:
        """A connection of ``worker`` from another daemon than ``daemon`` that still holds the worker id:
        open and heard within HOLDER_SILENCE_FRACTION of the timeout (see ServerConnection.handshake)."""
        now = asyncio.get_running_loop().time()
        limit = self.config.cluster.timeout * HOLDER_SILENCE_FRACTION
        for conn in [self.links.get(worker), *(c for (w, _), c in self.streams.items() if w == worker)]:
            if conn is not None and not conn.closed and conn.daemon != daemon and now - conn.last_seen <= limit:
                return conn
        return None

    # -- fused small sums (bps_server.fusion) --------------------------------------------
    def fused(self, failures: list[Failed]) -> None:
        """Carry out the planner's decisions: failures to their workers now, the plans at the end of this
        pass of the event loop (every report that one read of each connection brought, in one plan)."""
        for f in failures:
            conn = self.links.get(f.worker)
            if conn is not None:
                conn.send(FuseFailed(f.name, epoch=self.fusion.epoch(f.worker), **f.why.carry()))
        for resend in self.fusion.take_resends():  # before any new plan: a lane runs its plans in order
            conn = self.links.get(resend.worker)
            if conn is not None:
                log.info("worker %d lost plan %d of this server's previous run: sending it again", resend.worker,
                         resend.seq)
                groups, group = self.fusion.groups(resend.names)
                conn.send(FusePlan(resend.seq, resend.names, resent=resend.how, groups=groups, group=group,
                                   epoch=self.fusion.epoch(resend.worker), lanes=resend.lanes))
        if self.fusion.ready and not self._plans_due:
            self._plans_due = True
            asyncio.get_running_loop().call_soon(self._send_plans)

    def _send_plans(self) -> None:
        self._plans_due = False
        fusion = self.fusion
        for seq, names in fusion.take_plans():
            groups, group = fusion.groups(names)
            for worker, conn in list(self.links.items()):  # each with its epoch (see FusePlan.epoch)
                conn.send(FusePlan(seq, names, groups=groups, group=group, epoch=fusion.epoch(worker),
                                   lanes=fusion.lanes))

    def lanes_ended(self) -> None:
        """A worker's reset started a new lane generation (see bps_server.fusion): the open rounds of the fused
        tensors of the ended ones fail now (their later pushes are refused, see ServerConnection.on_push)."""
        self.aggregator.fail_ended(self.fusion.ended, self.lanes_ended_why(""))

    @staticmethod
    def lanes_ended_why(name: str) -> Why:
        """Why a round of a fused tensor of an ended lane generation fails."""
        what = f"fused tensor {name!r}" if name else "fused tensors"
        return Why(f"{what} of plans made before a worker's processes left: that worker dropped those plans, so "
                   f"they cannot complete", "round_failed")

    def wait_query(self, conn: ServerConnection, query: RoundQuery) -> None:
        """Answer ``query`` once its worker's round is known (RoundTable.query_waits), or after QUERY_WAIT_S."""
        wait_s = min(QUERY_WAIT_S, self.config.cluster.timeout)
        self.waiting_queries.append((conn, query, asyncio.get_running_loop().time() + wait_s))
        if self._query_timer is None:  # (else it is at an earlier one's time: they wait alike, in order)
            self._arm_query_timer()

    def answer_waiting_queries(self) -> None:
        """Answer the waiting round queries that wait no more (a hello, a Restored, their time): in their order."""
        if not self.waiting_queries:
            return
        now = asyncio.get_running_loop().time()
        table = self.aggregator.table
        waiting, self.waiting_queries = self.waiting_queries, []
        for conn, query, until in waiting:
            worker = conn.worker
            if conn.closed or worker is None or self.links.get(worker) is not conn:  # (asked again when back)
                continue
            if table.query_waits(worker, query.name, query.part, query.failed, query.given_up):
                if now < until:
                    self.waiting_queries.append((conn, query, until))
                    continue
                table.waited_out.add(worker)
            conn.answer_round_query(query)
        self._arm_query_timer()

    def recheck_waiting_queries(self) -> None:
        """A peer's push or abort may tell a waiting query its key's round: answer what waits no more once the
        frames read with it are in too (a peer back from a restart sends its aborts of earlier rounds and its
        next push in one go; answered at the first abort, a round given up was placed at a round long past)."""
        if not self._recheck_soon:
            self._recheck_soon = True
            asyncio.get_running_loop().call_soon(self._recheck)

    def _recheck(self) -> None:
        self._recheck_soon = False
        self.answer_waiting_queries()

    def _arm_query_timer(self) -> None:
        """One timer, at the first waiting query's time (the earliest: they wait alike, in order), a little after
        it: a timer may fire a hair early (the loop's clock is coarser), and the query then waits on."""
        if self._query_timer is not None:
            self._query_timer.cancel()
        self._query_timer = None
        if self.waiting_queries:
            self._query_timer = asyncio.get_running_loop().call_at(self.waiting_queries[0][2] + 0.01,
                                                                   self.answer_waiting_queries)

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("internal error in a push", exc_info=task.exception())

    def stats(self) -> dict[str, Any]:
        data = self.aggregator.counters.as_dict()
        data["server"] = self.config.server_id
        data["connections"] = len(self.connections)
        data["workers"] = len(self.links)  # worker daemons connected (their main connections)
        data["pending_connections"] = self.admission.pending  # not handshaken yet
        data["refused_connections"] = self.admission.refused
        data["streams"] = len(self.streams)  # workers' extra connections (Hello.stream > 0)
        data["keys"] = len(self.aggregator.keys)
        data["rounds_open"] = sum(st.busy for st in self.aggregator.keys.values())  # pushed to, not yet answered
        data["async_keys"] = len(self.values.store.keys)
        data["async_deltas"] = self.values.deltas
        data["async_deltas_by_worker"] = {str(w): n for w, n in self.values.deltas_by_worker.items()}
        data["async_replays"] = self.values.store.replays
        data["fused_plans"] = self.fusion.plans
        data["fused_tensors"] = self.fusion.planned
        data["fused_waiting"] = len(self.fusion.waiting)  # fused names reported by some workers, not by all
        return data

    async def stop(self) -> None:
        """Stop accepting, let in-flight sums finish briefly, close every connection."""
        self.stopping = True
        self.values.stop()
        self.pulse.beat()  # readyz: 503 "stopping" from now on
        if self._silence_watch is not None:
            self._silence_watch.cancel()
        if self._server is not None:
            self._server.close()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=2.0)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.pulse.stop()
        if self._endpoint is not None:
            await asyncio.to_thread(self._endpoint.close)
        if self.timeline is not None:
            self.timeline.close()
