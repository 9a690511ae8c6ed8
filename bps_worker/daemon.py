"""The Communication Service: one daemon per machine, and the wiring of its rooms.

Training processes connect over a Unix socket (control messages only), each as a
:class:`~bps_worker.session.ClientSession`; their tensors live in shared-memory segments
that this daemon creates for them. For each tensor name the daemon collects all
``local_size`` processes' ops into a *local round* (:mod:`bps_worker.local_rounds`, which
also numbers the rounds), then runs the round as an :mod:`bps_worker.operation`: local sum,
pushes of the partitions chosen by :mod:`bps_worker.placement` on the server links
(:mod:`bps_worker.link`), the global sums received in place and handed back.

``WorkerDaemon`` holds what these share: the config, the links, the sessions, the staging
and results arenas, the heartbeats, the job's reset and epoch, the metrics and health, start and stop.
It carries out the local rounds' decisions (``_execute``) and learns each name's round
base from the servers (``RoundQuery``), so that a machine that comes back joins the round
the other machines are in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import stat
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Container, Coroutine, Final, cast

import numpy as np

from bps_runtime import cuda, kernels, metrics
from bps_runtime.loglimit import failed_rounds_log
from bps_runtime.health import STALL_LIMIT_S, Pulse, Verdict
from bps_runtime.stalls import Notices
from bps_runtime import segments as shm
from bps_runtime.timeline import Timeline
from protocol.config import ClusterConfig, placement_items
from protocol.messages import (ASYNC_KINDS, FUSED_PREFIX, KIND_ASYNC_INIT, Abort, Done, Notice, Op, Ping, Spec, Why,
                               describe_spec)

from .async_operation import AsyncName, AsyncOperation
from .errors import BPSError
from .fused_driver import FusedSums
from .fusion import Decisions
from .link import ServerLink
from .local_rounds import Action, Failed, LocalRound, LocalRounds, Opened, Ready, Refused, describe, failure_for
from .operation import run_operation, segment_buffer
from .placement import Placement
from .result_holds import ResultHolds
from .session import ClientSession, client_admission
from .sockdir import absolute, ensure_socket_dir
from .stalls import WorkerStalls

log = logging.getLogger("bps.worker")

# The daemon pings its training processes this often, so that they can tell a stalled daemon.
CLIENT_PING_INTERVAL_S: Final = 1.0


@dataclass
class WorkerCounters:
    """What the worker exposes as metrics."""

    ops: int = 0  # local rounds completed
    ops_failed: int = 0
    fused_tensors: int = 0  # small tensors summed in fused operations (each one op of ``ops`` per plan group)
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    op_seconds: metrics.Histogram = field(default_factory=metrics.Histogram)  # all processes in -> all done


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker daemon needs, built once from the cluster file and the command line."""

    cluster: ClusterConfig
    worker_id: int
    socket_path: str | None = None  # overrides the path in the cluster file
    socket_mode: int = 0o600
    segment_mode: int = 0o600
    token: bytes | None = None  # from cluster.token_file
    threads: int = 2
    timeline: str | None = None  # Chrome-trace file of every tensor's stages (bps_runtime.timeline)
    notify_socket: str | None = None  # systemd's NOTIFY_SOCKET: STATUS= lines and watchdog pings go there
    watchdog_s: float | None = None  # systemd's watchdog period (bps_runtime.health.watchdog_seconds)
    stall_limit_s: float = STALL_LIMIT_S  # /livez fails once the event loop has not beaten for this long

    @property
    def socket(self) -> str:
        return self.socket_path or self.cluster.worker(self.worker_id).socket

    @property
    def local_size(self) -> int:
        return self.cluster.worker(self.worker_id).local_size


class WorkerDaemon:
    """Server-wide state of one worker daemon."""

    _cuda: cuda.CudaBridge | None  # made when the first CUDA tensor arrives...
    _cuda_starting: asyncio.Future[cuda.CudaBridge] | None  # ... in a thread (cuda_bridge)

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        cluster = config.cluster
        self.worker_id = config.worker_id
        self.timeline = Timeline(config.timeline, f"bps-worker {config.worker_id}") if config.timeline else None
        self.rank_offset = cluster.rank_offset(config.worker_id)
        self.placement = Placement(cluster)
        self.streams = self._server_links()
        self.links = {sid: streams[0] for sid, streams in self.streams.items()}
        self.all_links = [link for streams in self.streams.values() for link in streams]
        # Stall lines for our processes, told once a look: ours, and those our servers send about rounds that wait
        # with our pushes in them (every local rank is in such a round: each hears them).
        self.notices = Notices()
        for link in self.all_links:
            link.on_notice = partial(self.notices.add, None)
            link.numbering_fresh = partial(self.numbering_fresh, link.spec.id)
            link.has_processes = self.has_processes
            link.job_now = self.job_now
        self._new_epoch()
        # Tensors of at most this many bytes are fused (Welcome.fusion_bytes; bps_worker.fusion).
        self.fusion_bytes = self.placement.small_tensor_bytes
        self._start_fusion()
        self.executor = ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="bps-local")
        self.sessions: dict[int, ClientSession] = {}
        self.connections: set[ClientSession] = set()
        self.admission = client_admission(config.worker_id)  # connections before their Hello
        # Per name, the local rounds still collecting local processes, and the round numbering.
        self.rounds: LocalRounds[ClientSession] = LocalRounds(config.local_size, config.worker_id, self.rank_offset)
        # Rounds that wait for a stalled process are logged after the timeout, then every timeout (see .stalls).
        self.stalls = WorkerStalls(cluster.timeout, config.worker_id, self.rank_offset)
        # When each local rank last submitted a name another had opened a round of here: one catching up on its
        # peers is not stalled (cluster.stall_timeout), one that moved on to names of its own is no busier for
        # a round that waits for it (see the servers' RoundTable.joined_at)
        self.submitted_at: dict[int, float] = {}
        # Failed local rounds are logged a few at a time: a rank gone with thousands of names in flight failed
        # one round per name, each a line (a review's flood: 175,000 lines in 30 s). The count of the rest
        # follows, from the heartbeat.
        self.failures_log = failed_rounds_log()
        # Per name, the query of the servers' round number (RoundQuery) that learns the name's round base.
        self.round_queries: dict[str, asyncio.Future[int]] = {}
        # Per asynchronous name, its steps and bound as this machine's init learned them (bps_worker.async_operation).
        self.async_names: dict[str, AsyncName] = {}
        self.job, self.job_since = "", 0.0  # our processes' job (Hello.job) and when they came: see job_now
        # Per name, the machine's local sum (pushed) and the global sum (where results land), in shared memory for a
        # colocated server to read and write in place; apart, so that a contribution stays intact until its result
        # is complete and a result until the next one (both for a restarted server), and, for room, until
        # its processes mapped it (.holds). Each arena (these, every process's slots) is capped: cluster.arena_bytes.
        self.arena_bytes = config.cluster.arena_bytes or shm.default_arena_bytes()
        self.staging = shm.Arena(config.worker_id, config.segment_mode, self.arena_bytes)
        self.results = shm.Arena(config.worker_id, config.segment_mode, self.arena_bytes)
        self.holds = ResultHolds(cluster.timeout)  # answered results not yet mapped (bps_worker.result_holds)
        self.running: Counter[str] = Counter()  # names whose operation runs: their buffers are not freed for room
        self.tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.AbstractServer | None = None
        self._heartbeat: asyncio.Future[None] | None = None
        self._endpoint: metrics.Endpoint | None = None
        self.pulse = Pulse(self.verdict, notify_socket=config.notify_socket, watchdog_s=config.watchdog_s)
        self.counters = WorkerCounters()
        self.stopping = False
        self._cuda = self._cuda_starting = None

    def _server_links(self) -> dict[int, list[ServerLink]]:
        """Each server's connections: placement.streams(id) of them (see bps_worker.placement); the first one also
        carries control messages (resets, aborts, round queries, releases) and alone may use shared memory. A
        server on this host is offered shared memory (see ServerLink): the one the config puts here (``worker =
        <our id>``), and any other whose address is one of this host's own."""
        config, cluster = self.config, self.config.cluster
        per_link_credit = max(1 << 16, cluster.credit_bytes // len(cluster.servers))
        window = self.placement.stream_window(cluster.window_pieces)  # of every connection
        # One record of the rounds given up per server (ServerLink.given_up): a part's aborts go on stream 0, its
        # sums come on its own stream.
        given_up: dict[int, dict[tuple[str, int], Abort]] = {s.id: {} for s in cluster.servers}
        return {
            s.id: [ServerLink(s, config.worker_id, credit_bytes=per_link_credit, window_pieces=window,
                              stream=stream, timeout=cluster.timeout,
                              max_payload_bytes=cluster.max_payload_bytes, token=config.token,
                              shm_mode=config.segment_mode
                              if stream == 0 and cluster.colocated_shm
                              and (s.worker == config.worker_id or is_local_address(s.host))
                              else None,
                              timeline=self.timeline, config_items=placement_items(cluster), given_up=given_up[s.id])
                   for stream in range(self.placement.streams(s.id))]
            for s in cluster.servers
        }

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        spec = self.config.cluster.worker(self.worker_id)
        if spec.metrics is not None:  # first: a busy metrics port leaves no socket file behind
            self._endpoint = metrics.Endpoint(*spec.metrics, loop=loop, families=self.metric_families,
                                              health=lambda: self.pulse.latest, stall_limit_s=self.config.stall_limit_s)
        path = self.config.socket
        _claim_socket_path(path)
        # A daemon of this worker killed with its resource tracker left its segments behind (issue 14, 12).
        reclaimed = shm.reclaim_dead(self.worker_id)
        if reclaimed:
            log.warning("reclaimed %d shared-memory segments of dead daemons of worker %d: %s", len(reclaimed),
                        self.worker_id, ", ".join(reclaimed))
        old_umask = os.umask(0o077)
        try:
            self._server = await loop.create_unix_server(lambda: ClientSession(self), path)
        finally:
            os.umask(old_umask)
        os.chmod(path, self.config.socket_mode)
        self._heartbeat = asyncio.ensure_future(self._heartbeats())
        for link in self.links.values():
            link.keep_connected()  # readiness is being connected to every server, before any push
        self.pulse.start()
        log.info("worker %d serving %d local processes on %s (%d workers, %d servers)", self.worker_id,
                 self.config.local_size, path, self.config.cluster.workers, len(self.links))
        log.info("%s", self.placement.split_note)  # (not before: a daemon that cannot start says only why)

    def verdict(self) -> Verdict:
        """Ready once connected (handshake done) to every server; the 503 and the status name the others."""
        if self.stopping:
            return Verdict("stopping", "stopping")
        missing = [link.spec for link in self.links.values() if not link.connected]
        if missing:
            ids = ", ".join(str(spec.id) for spec in missing)
            servers = f"server{'s' if len(missing) > 1 else ''}"
            return Verdict(f"not connected to {servers} " + ", ".join(f"{s.id} at {s.address}" for s in missing),
                           f"waiting for {servers} {ids}")
        n = len(self.links)
        return Verdict(None, f"connected to {n} server{'s' if n > 1 else ''}, {len(self.sessions)} of "
                             f"{self.config.local_size} processes")

    def metric_families(self) -> list[metrics.Family]:
        c = self.counters
        label = {"worker": str(self.worker_id)}
        queued = sum(link.queued_bytes() for link in self.all_links)
        return [
            metrics.Family("bps_worker_ops_total", "counter", "Collective operations completed (one per local round)",
                           ((label, float(c.ops)),)),
            metrics.Family("bps_worker_ops_failed_total", "counter",
                           "Collective operations that failed (a small tensor's fused round that failed before its "
                           "plan is one)",
                           ((label, float(c.ops_failed)),)),
            metrics.Family("bps_worker_fused_tensors_total", "counter",
                           "Small tensors summed fused, many per operation (each tensor's round on this machine)",
                           ((label, float(c.fused_tensors)),)),
            metrics.Family("bps_worker_bytes_pushed_total", "counter", "Tensor bytes pushed to servers",
                           ((label, float(c.bytes_pushed)),)),
            metrics.Family("bps_worker_bytes_pulled_total", "counter", "Tensor bytes of sums pulled from servers",
                           ((label, float(c.bytes_pulled)),)),
            metrics.Family("bps_worker_processes_connected", "gauge", "Training processes connected",
                           ((label, float(len(self.sessions))),)),
            metrics.Family("bps_worker_send_backlog_bytes", "gauge",
                           "Bytes queued or buffered towards servers (bounded by the credit)",
                           ((label, float(queued)),)),
            metrics.Family("bps_worker_op_seconds", "histogram",
                           "From the last local process's request to the result handed back",
                           ((label, c.op_seconds.copy()),)),
        ]

    async def _heartbeats(self) -> None:
        """Keep every server link provably alive, both ways (see ServerLink.heartbeat), and show the
        training processes that this daemon is alive (a client gives up after its own timeout of silence)."""
        loop = asyncio.get_running_loop()
        link_interval = self.config.cluster.timeout / 4
        next_link_beat = loop.time() + link_interval
        seq = 0
        while not self.stopping:
            await asyncio.sleep(min(link_interval, CLIENT_PING_INTERVAL_S))
            seq += 1
            for session in list(self.sessions.values()):
                session.send(Ping(seq))
            for link in self.links.values():
                link.keep_connected()
            for link in self.all_links:
                link.keep_trying()
            try:  # (a bug there must not end the heartbeats: pings, reconnects and this watch)
                cluster = self.config.cluster
                self._execute(self.rounds.overdue_rounds(self.sessions.keys(), loop.time(), cluster.timeout,
                                                         cluster.stall_timeout, self.submitted_at))
            except Exception:
                log.exception("internal error in the watch of open rounds")
            self.notices.say(self.stalls.warnings(loop.time(), self.rounds, self.all_links), "rounds have waited as long",
                             log)
            self.failures_log.flush(log)
            self.fusion.watch(loop.time())
            self.tell_stalls()
            if loop.time() >= next_link_beat:
                next_link_beat = loop.time() + link_interval
                for link in self.all_links:
                    link.heartbeat()

    def tell_stalls(self) -> None:
        """Each process's stall lines of this look, ours and its servers' (at most a few: ``Notices``)."""
        for local_rank, lines in self.notices.take(self.sessions.keys()).items():
            session = self.sessions[local_rank]
            if not session.closed:
                session.send(Notice(lines))

    async def stop(self) -> None:
        self.stopping = True
        for link in self.all_links:
            link.stopping = True
        self.pulse.beat()  # readyz: 503 "stopping" from now on
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._server is not None:
            self._server.close()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=2.0)
        for session in list(self.connections):
            session.close()
        for session in list(self.sessions.values()):
            session.release_segments()
        for link in self.all_links:
            link.close()
        await asyncio.gather(*(link.wait_closed() for link in self.all_links))
        self.staging.release_all()
        self.results.release_all()
        if self.timeline is not None:
            self.timeline.close()
        if self._server is not None:
            await self._server.wait_closed()
        try:
            os.unlink(self.config.socket)
        except FileNotFoundError:
            pass
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.pulse.stop()
        if self._endpoint is not None:
            await asyncio.to_thread(self._endpoint.close)

    def spawn(self, coro: Any) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("internal error", exc_info=task.exception())

    # -- local rounds ----------------------------------------------------------------
    def submit(self, session: ClientSession, op: Op) -> None:
        """A handshaken process asks for ``op`` (checked against its memory by the session)."""
        assert session.local_rank is not None  # sessions submit only after their handshake
        if op.name in self.rounds.open:  # (it catches up on its peers: see submitted_at)
            self.submitted_at[session.local_rank] = asyncio.get_running_loop().time()
        late = self.fusion.rounds.late_unfused(op.name, session.local_rank)
        if late is not None:  # its step's fused round failed before it came: it hears why (as a fused entry would)
            session.send(failure_for(late, op))
            return
        fused = self.fusion.rounds.collecting.get(op.name) or self.fusion.rounds.reported.get(op.name)
        if fused is not None:  # the other processes issued it small enough to fuse
            self._execute(self.rounds.submit(session, session.local_rank, op))  # its round, numbered, to fail
            self._paths_differ(op.name, describe_spec(fused.spec), describe(op), session.local_rank,
                               {e.member.local_rank for e in fused.members() if e.member.local_rank is not None})
            return
        self._execute(self.rounds.submit(session, session.local_rank, op))

    def submit_batch(self, session: ClientSession, entries: list[tuple[int, str, Spec, str, int, int]]) -> None:
        """A handshaken process issued small sums to fuse (checked against its memory by the session)."""
        assert session.local_rank is not None
        collecting = self.fusion.rounds.collecting
        if collecting and any(entry[1] in collecting for entry in entries):  # (it catches up: see submitted_at)
            self.submitted_at[session.local_rank] = asyncio.get_running_loop().time()
        if self.rounds.open:
            kept = []
            for entry in entries:
                rounds = self.rounds.open.get(entry[1])
                if rounds:  # the other processes issued it too large to fuse
                    ours = describe_spec(entry[2])
                    why = rounds[0].why
                    if why is None:
                        why = self._paths_differ(entry[1], ours, describe(rounds[0].first), session.local_rank,
                                                 {session.local_rank})
                    else:  # failed already, and said so everywhere: this rank hears it and is not waited for
                        self._execute(self.rounds.fail_name(entry[1], why, {session.local_rank}))
                    session.send(why.heard_by(ours).failure(entry[0]))
                else:
                    kept.append(entry)
            entries = kept
        self.fusion.submit(session, entries)

    def _paths_differ(self, name: str, fused: str, unfused: str, local_rank: int, fused_ranks: set[int]) -> Why:
        """Processes of this machine issued ``name`` with sizes on both sides of the fusion limit (``fused`` and
        ``unfused`` describe each side): a mismatch, for every process of every machine, whichever path it
        took. The fused round here (if any) fails and its entries hear why; the unfused rounds fail without
        waiting for ``fused_ranks`` (they heard it through their fused entries), and are aborted at the anchor
        server for the peers that pushed the name unfused; a FuseAbort tells the anchor's planner for those that
        fused it. Returns the mismatch (a fused entry not yet in a round is answered by the caller)."""
        own, other = (fused, unfused) if local_rank in fused_ranks else (unfused, fused)
        if fused == unfused:  # the same tensor: a process whose fusion is off (fusion_bytes=0) beside others
            path = "fused" if local_rank in fused_ranks else "unfused"
            detail = (f"rank {self.rank_offset + local_rank} issued it {path} but other processes of worker "
                      f"{self.worker_id} did not: every process of a job must use "
                      f"the same fusion setting (init(fusion_bytes=...), BPS_FUSION_BYTES)")
        else:
            detail = (f"rank {self.rank_offset + local_rank} issued it as {own} but other processes of worker "
                      f"{self.worker_id} as {other}")  # (not "one is fused, at most 64 bytes": ours, not the user's)
        why = Why.mismatch(name, fused, unfused, detail)
        decisions = self.fusion.rounds.fail_name(name, why, set(range(self.config.local_size)) - fused_ranks,
                                                 unfused=True)
        if self.rounds.open.get(name):  # one operation of the processes failed: counted as the unfused round's
            decisions.failed = 0
        self.fusion.carry_out(decisions)
        if decisions.aborts:  # the fused round here told the planner; else the unfused one does (_failed)
            for lr in self.rounds.open.get(name, ()):
                lr.planner_told = True
        self._execute(self.rounds.fail_name(name, why, fused_ranks))
        return why

    def _execute(self, actions: list[Action[ClientSession]]) -> None:
        """Carry out the local rounds' decisions, in order."""
        for action in actions:
            if isinstance(action, (Opened, Ready)):  # it waits for local ranks, or at the servers, from now
                now = asyncio.get_running_loop().time()
                self.stalls.began(action.round, now)
            if isinstance(action, Opened):
                action.round.opened_at = now  # watched for absent processes from now (_heartbeats)
                if not self.fusion.rounds.busy(action.round.name):  # one round of the name: it takes its index
                    action.round.fused_index = self.fusion.rounds.skip(action.round.name)
                if action.round.first.kind not in ASYNC_KINDS:  # asynchronous names have no rounds to learn
                    self.round_base(action.round.name, action.round.round)
            elif isinstance(action, Refused):
                action.member.send(action.failure())
            elif isinstance(action, Failed):
                self._failed(action)
            elif isinstance(action, Ready):
                self.spawn(self._run(action.round, self.epoch))

    async def _run(self, lr: LocalRound[ClientSession], epoch: str) -> None:
        """Run ready round ``lr`` of job ``epoch``: not once that job ended here (every process left before the
        task started; its Leave and its last op read together). Run, it took the next job's numbering for its own
        and pushed the old job's round behind our Reset: the next job's first rounds met it as stale (a review's
        case: shutdown() with a sum in flight on another thread, init() again)."""
        if epoch != self.epoch:
            self.stalls.ended(lr)
            why = Why(f"tensor {lr.name!r}: every training process of worker {self.worker_id} left: its job ended "
                      f"here", "connection")
            for session, op in lr.ordered():
                session.send(failure_for(why, op))
            return
        try:
            if lr.first.kind in ASYNC_KINDS:
                await self.run_tracked(lr.name, AsyncOperation(self, lr, self.async_names).run())
            else:
                await self.run_tracked(lr.name, run_operation(self, lr))
        finally:
            self.stalls.ended(lr)

    async def run_tracked(self, name: str, operation: Any) -> None:
        """Await ``name``'s operation; meanwhile its staging and results buffers are not freed for room."""
        self.running[name] += 1
        try:
            await operation
        finally:
            self.running[name] -= 1
            if not self.running[name]:
                del self.running[name]

    def _busy(self, name: str) -> bool:
        """Whether ``name``'s staging and results buffers are in use (its operation runs, or its round is open)."""
        return name in self.running or name in self.rounds.open

    def _result_busy(self, name: str) -> bool:
        """Whether ``name``'s results buffer is in use: as :meth:`_busy`, or a process has yet to map it."""
        return self._busy(name) or self.holds.held(name)

    def _failed(self, action: Failed[ClientSession]) -> None:
        """A local round failed: the peers hear why (at the anchor server), and then its members. Peers on
        other machines wait for this round at the anchor: it is told now (before anything else this daemon
        says, e.g. a Reset, so they learn the real reason), or as soon as the name's round base is known. The
        members hear it after that, so that nothing they issue next (a fused report of the name's next step,
        on the same connection) reaches the anchor before the abort: it would meet the peers' pushes of this
        round there, as a step of its own."""
        lr = action.round
        self.counters.ops_failed += 1
        self.failures_log.log(log, logging.WARNING, "%s", action.reason)
        self.stalls.ended(lr)
        root = self._root_of_init(action.members)
        if root is not None:  # the other machines' inits wait for our value at the servers
            for link in self.links.values():
                link.init_failed(lr.name, root, lr.round, action.why)
        if lr.first.kind in ASYNC_KINDS:  # no round waits for us at the servers
            self._answer_failed(action)
            return
        if lr.fused_index >= 0 and not lr.planner_told and self.sessions:
            # Peers that issued the name fused in this step wait at the anchor's planner: it hears first (the
            # Abort below would fail only the round table's round, which a fused peer never pushes).
            lr.planner_told = True
            told: Decisions[ClientSession] = Decisions()
            told.abort(lr.name, action.why, False, lr.fused_index)
            self.fusion.carry_out(told)
        if action.server_round is None:
            self.spawn(self.abort_when_known(lr.name, lr.round, self.round_base(lr.name, lr.round), action.why,
                                             lambda: self._answer_failed(action)))
            return
        self.abort_at_anchor(lr.name, action.server_round, action.why)
        self._answer_failed(action)

    def _root_of_init(self, members: tuple[tuple[ClientSession, Op], ...]) -> int | None:
        """The root rank, one of this machine's, that an ``async_init`` among ``members`` names (its value is ours
        to push: see InitFailed); None if none does."""
        local = range(self.rank_offset, self.rank_offset + self.config.local_size)
        return next((op.root for _, op in members if op.kind == KIND_ASYNC_INIT and op.root in local), None)

    @staticmethod
    def _answer_failed(action: Failed[ClientSession]) -> None:
        for session, op in action.members:
            session.send(action.failure(op))

    def _anchor_link(self, name: str) -> ServerLink:
        """The link to the server of ``name``'s partition 0, where every peer meets."""
        return self.links[self.placement.server_ids[self.placement.anchor(name)]]

    def abort_at_anchor(self, name: str, server_round: int, why: Why) -> None:
        """Fail round ``server_round`` of ``name`` at the server of its partition 0, where every peer meets: each
        hears ``why`` (its code and facts: a mismatch, each its own side of it)."""
        self._anchor_link(name).abort(name, 0, server_round, why)

    def abort_when_known(self, name: str, local_round: int, base: asyncio.Future[int], why: Why,
                         then: Callable[[], None] = lambda: None) -> Coroutine[Any, Any, None]:
        """Abort our round ``local_round`` of ``name`` (of the job running now) at its anchor once the base is
        known; ``then``, in any case (to be spawned)."""
        return self._abort_when_known(name, local_round, base, why, then, self.epoch)

    async def _abort_when_known(self, name: str, local_round: int, base: asyncio.Future[int], why: Why,
                                then: Callable[[], None], epoch: str) -> None:
        try:
            offset = await base
        except (BPSError, asyncio.CancelledError):
            return  # the anchor is unreachable, or the job is gone: the peers' rounds fail there anyway
        else:
            # Not once the job is over (every process left meanwhile: our Reset failed its rounds there): the
            # abort would fail the next job's round of that number, whose first step then failed with this one's
            # error (shutdown() with a sum in flight, then init() on every process: a review's case).
            if self.epoch == epoch:
                self.abort_at_anchor(name, local_round + offset, why)
        finally:
            then()

    def unfused_step(self, name: str) -> None:
        """A fused round of ``name`` failed with no unfused round of its step here: the step takes an unfused
        round number all the same, as it does on a peer that pushed the name unfused in that step (see
        ``bps_worker.fusion``, "Each round has an index"), and that round is given up at the anchor, so that
        its round table counts the step too (a machine that rejoins is placed by it)."""
        why = Why(f"tensor {name!r}: the fused round of this step failed on worker {self.worker_id}", "round_failed")
        self.spawn(self.give_up_failed_round(name, self.rounds.numbers.take(name), why))

    def give_up_failed_round(self, name: str, local_round: int, why: Why) -> Coroutine[Any, Any, None]:
        """Give up our round ``local_round`` of ``name``, which failed here before it was pushed (to be spawned):
        at its anchor once its base is known.

        Where it is not, a machine that rejoins the others cannot tell which of the peers' rounds this one
        would have been: asked as a failed round's (``RoundQuery.failed``) it is answered -1 and gives up
        nothing, and its next round of the name is placed at the peers' (a machine back while the servers were
        down fails its first steps in every name). Placed as a round to join, such a round failed the peers'
        in some names and not others, where their state differed at each anchor's answer (a name a step off
        the others for the rest of the job, or a hang: ``benchmarks/double_fault.py``). But where another
        name's round of the same number went to the servers (its anchor answered, this one's did not), the
        step is the peers' current one, and this name's round of it is given up at the peers' current round
        (``RoundQuery.given_up``: open, or failed by the same fault as ours; not the next one): left alone, the
        peers' step would have had the other names' sums and waited for this one's, which then came from our
        next step. Which of the two is decided once the other names' queries of the step are answered or failed
        (decided at once, a name whose answer was a moment late went to the servers beside a round already given
        up as void: a review's case)."""
        return self._give_up_after_step(name, local_round, self.epoch, why)

    async def _give_up_after_step(self, name: str, local_round: int, epoch: str, why: Why) -> None:
        numbers = self.rounds.numbers
        asked = [query for other, query in self.round_queries.items() if other != name and not query.done()
                 and numbers.base(other) is None and numbers.issued(other, local_round)]
        if asked:
            await asyncio.wait(asked)  # (each ends within the timeout: answered, or the link gave up)
        await self._give_up_step(name, local_round, epoch, why, beside=numbers.placed_beside(name, local_round))

    async def _give_up_step(self, name: str, local_round: int, epoch: str, why: Why, beside: bool = False) -> None:
        """See :meth:`give_up_failed_round`; ``epoch``: the job whose step it is (void once that job is over, even
        before this first runs: the last process's leaving fails its rounds, then resets at once)."""
        if self.epoch != epoch:
            return
        base = self.rounds.numbers.base(name)
        if base is None:  # the name's first numbered step in this job: learned here unless we rejoined
            try:
                server_round = await self._anchor_link(name).query_round(name, 0, local_round, failed=not beside,
                                                                         given_up=beside)
            except (BPSError, asyncio.CancelledError):
                return  # the anchor is unreachable, or the job is gone
            if server_round < 0 or self.epoch != epoch:
                return  # we rejoined (learned at our next round of the name), or the job is over
            base = self.rounds.numbers.base(name)  # learned meanwhile (another step's query, or a round's)
            if base is None:
                base = self.rounds.numbers.learn(name, local_round, server_round)
        self.abort_at_anchor(name, local_round + base, why)

    def round_base(self, name: str, local_round: int) -> asyncio.Future[int]:
        """The offset from our round numbers of ``name`` to the servers' (asked once per job, and
        again after a failed attempt: placed again at the peers' round, rather than by a base a round given up
        learned meanwhile, whose answer may be of a round long past). 0 for a fused tensor: every worker numbers
        a lane generation's rounds from 0 (``bps_worker.fused_driver``), so none is placed among the peers' by
        asking."""
        if name.startswith(FUSED_PREFIX):
            known: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            known.set_result(0)
            return known
        query = self.round_queries.get(name)
        if query is None or (query.done() and (query.cancelled() or query.exception() is not None)):
            query = self.round_queries[name] = asyncio.ensure_future(self._ask_round(name, local_round))
        return query

    async def _ask_round(self, name: str, local_round: int) -> int:
        server_round = await self._anchor_link(name).query_round(name, 0, local_round)
        return self.rounds.numbers.learn(name, local_round, server_round)

    def session_lost(self, session: ClientSession) -> None:
        self._session_ended(session, "disconnected")
        self.holds.drop(session)
        session.release_segments()

    def session_left(self, session: ClientSession, req: int) -> None:
        """The process said Leave (shutdown()): its leave takes effect now, as at a disconnect, and it hears Done
        once it did: where it was our last process, once every connected server answered a Ping sent after our
        Reset on each connection (so a barrier of the job's after every shutdown starts the next init() clean
        everywhere; see Leave).
        Its memory is freed when it closes the connection, as ever."""
        if self._session_ended(session, "left (shutdown)"):
            self.spawn(self._answer_leave(session, req, [link.acknowledged() for link in self.all_links]))
        else:
            session.send(Done(req))

    async def _answer_leave(self, session: ClientSession, req: int, acks: list[asyncio.Future[None]]) -> None:
        if acks:  # (a daemon always has a link to every server; asyncio.wait refuses an empty list)
            await asyncio.wait(acks, timeout=self.config.cluster.timeout)  # (a server that answers nothing: not ours)
        session.send(Done(req))

    def _session_ended(self, session: ClientSession, how: str) -> bool:
        """``session``'s process is gone (``how``): the rounds that awaited it fail, and where it was our last, the
        job ended here (_reset). Whether that reset happened now."""
        if session.local_rank is None or self.sessions.get(session.local_rank) is not session:
            return False  # (not handshaken, or its leave was taken already)
        del self.sessions[session.local_rank]
        if not self.stopping:
            log.info("client %r %s", session, how)
        self._execute(self.rounds.leave(session.local_rank, session.pid))
        self.fusion.carry_out(self.fusion.rounds.leave(session.local_rank, session.pid))
        if self.sessions or self.stopping:
            return False
        self._reset()
        return True

    def _reset(self) -> None:
        """No training process is connected: the job ended or died. Start the next one clean.

        Round numbers restart at 0 and staging buffers are freed; the servers drop what this
        worker had pending (and all key state once every worker has reset), so a new job
        never meets the old one's rounds, and the peers of a job whose processes here died
        get an error instead of waiting for them.
        """
        log.info("no training processes connected: resetting rounds and freeing %d staging buffers",
                 len(self.staging.slots) + len(self.results.slots))
        self._execute(self.rounds.reset())
        self.fusion.reset()
        for query in self.round_queries.values():
            query.cancel()
        self.round_queries.clear()
        self.async_names.clear()  # (self.job stays: its next processes of the same job rejoin it, see job_now)
        self._new_epoch()
        self.reset_since = True
        for link in self.all_links:
            link.reset()  # drops its references into the buffers freed next
        self.holds.clear()
        self.segments_freed(self.staging.release_all() + self.results.release_all())

    def _start_fusion(self) -> None:
        """The fused sums (they hook every server's stream-0 link), and our hook around theirs (_link_ready)."""
        self.fusion = FusedSums(self)
        # Whether every process of ours left (a reset) and none came since: a server that restarted must hear it
        # again (its new run takes every worker that connects for one with processes, and waits for them).
        self.reset_since = False
        for link in self.links.values():
            link.on_ready = partial(self._link_ready, link, link.on_ready)

    def _link_ready(self, link: ServerLink, then: Callable[[bool], None] | None, restarted: bool) -> None:
        """Server ``link`` is connected (``restarted``: a new run of it); ``then``: the fused sums' own hook."""
        if restarted and self.reset_since and not self.sessions:
            link.tell_reset()
        if then is not None:
            then(restarted)

    def has_processes(self) -> bool:
        """Whether a training process of ours is connected (Hello.processes)."""
        return bool(self.sessions)

    def job_now(self) -> tuple[str, float]:
        """Our processes' job and how long ago its first processes came here, in seconds, counted through rejoins
        (processes of the same job after all of ours left): Hello.job and .job_age_s, Joined. A restarted server
        compares jobs by it; ("", 0.0) without processes."""
        return (self.job, max(0.0, time.monotonic() - self.job_since)) if self.sessions else ("", 0.0)

    def processes_joined(self) -> None:
        """Our first training process connected while we had none (since we started, or since a reset): the servers
        hear it (Joined), having heard we had none (a hello said so, or our Reset)."""
        for link in self.links.values():
            link.tell_joined()

    def numbering_fresh(self, server: int) -> bool:
        """Whether our processes numbered no round of this epoch against server ``server`` yet (Hello.fresh): no
        link to it carried a push, an abort or a fused report, nor learned a round from it. Per server: a machine
        that came back while every server restarted learns its first names' rounds from the servers that came
        back first, and is still new to the others (a review's case)."""
        return not any(link.numbered for link in self.streams[server])

    def _new_epoch(self) -> None:
        """Our round numbering (re)starts at 0: servers learn it from the epoch (see RoundQuery)."""
        self.epoch = epoch = secrets.token_hex(8)
        for link in self.all_links:
            link.epoch = epoch
            link.numbered = False

    def forget_sums(self, names: Container[str]) -> None:
        """Tensors ``names`` are never pushed again (an ended lane generation's fused keys): no link keeps
        their last sums for a restarted server (``bps_worker.window``)."""
        for link in self.all_links:
            link.forget_sums(names)

    def segments_freed(self, names: list[str]) -> None:
        """Shared memory we unlinked: the colocated server must unmap it too, or it stays allocated."""
        if names:
            for link in self.all_links:  # pushes by reference travel on every stream, and each maps
                link.release_segments(names)

    # -- helpers ---------------------------------------------------------------------
    async def cuda_bridge(self) -> cuda.CudaBridge:
        """The GPU side, made when the first CUDA tensor arrives (BPSError where this daemon has none). It is
        made in a thread: importing torch and starting CUDA take seconds, and the loop goes on serving (the
        servers' heartbeats among the rest) meanwhile."""
        if self._cuda is None:
            if self._cuda_starting is None:
                self._cuda_starting = asyncio.get_running_loop().run_in_executor(self.executor, cuda.CudaBridge)
            try:
                bridge = await asyncio.shield(self._cuda_starting)  # one op's cancellation is not the others'
            except cuda.CudaUnavailableError as exc:
                raise BPSError(str(exc)) from None
            if self._cuda is None:
                self._cuda = bridge
                log.info("CUDA tensors from local processes: summing on the GPU, staging in page-locked memory")
                for arena in (self.staging, self.results):
                    arena.before_release = bridge.unpin
        return self._cuda

    def staging_buffer(self, arena: shm.Arena, name: str, nbytes: int, dtype: str, count: int
                       ) -> tuple[np.ndarray, str, int]:
        """The array of ``name`` in ``arena``, its segment and its byte offset there."""
        slot, freed = arena.alloc(name, nbytes, busy=self._result_busy if arena is self.results else self._busy)
        self.segments_freed(freed)
        if self._cuda is not None:
            self._cuda.pin(arena.segments[slot.segment])  # copies from and to the GPU are DMA transfers
        # A training process can shrink our segments too (same user): checked before every use (issue 14, 3).
        shm.check_size(arena.segments[slot.segment], slot.offset + nbytes, name)
        buf = np.frombuffer(segment_buffer(arena, slot.segment), dtype=kernels.STORAGE[dtype], count=count,
                            offset=slot.offset)
        return buf, slot.segment, slot.offset

    async def results_buffer(self, name: str, nbytes: int, dtype: str, count: int) -> tuple[np.ndarray, str, int]:
        """:meth:`staging_buffer` of the results arena. Where it is at its cap, results that processes have yet
        to map (``holds``) are not freed for room: this waits for them to be taken or to run out (at most the
        cluster's timeout), then tries again; ArenaFullError (naming the cap) if there is still no room."""
        until = time.monotonic() + self.holds.hold_s
        while True:
            try:
                return self.staging_buffer(self.results, name, nbytes, dtype, count)
            except shm.ArenaFullError:
                for session in self.holds.holders():  # a process tells what it took when it reads a Ping
                    cast(ClientSession, session).send(Ping(0))
                if not await self.holds.ended(until):
                    raise


def is_local_address(host: str) -> bool:
    """Whether ``host`` is an address of this host (network namespace): one can bind to it."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0))
            return True
        except OSError:
            continue
    return False


def _claim_socket_path(path: str) -> None:
    """Refuse a socket directory that another user could write (bps_worker.sockdir); remove a stale socket
    file; refuse if a live daemon still listens there, or if what is there is no socket (a typo'd path must
    not cost a file: it was taken for a stale socket and removed)."""
    ensure_socket_dir(os.path.dirname(absolute(path)))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        # (no errno: lifecycle.describe_bind_error shows this text)
        raise OSError(f"{path} exists and is not a socket; not removed (is the worker's socket path right?)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a leftover from a crashed daemon
        return
    finally:
        probe.close()
    raise OSError(98, f"{path} is in use by another process")
