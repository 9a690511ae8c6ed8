"""Daemon supervision: start ``bps-server`` / ``bps-worker`` processes, know when they are ready, stop them.

Used by the launcher (``bps-launch``), the tests' and benchmarks' one-box clusters (:class:`Cluster`) and
the emulator's daemons inside network namespaces (``benchmarks/cluster/daemons.py``, through
:class:`Supervisor` with a command prefix).

Theory of operation:

- Readiness is the daemons' systemd protocol: a daemon sends ``READY=1`` to the datagram socket named by
  ``NOTIFY_SOCKET`` once it serves. :meth:`Supervisor.launch` binds one such socket in a directory of its
  owner's, starts a batch of daemons with it in their environment and counts ``READY=1`` datagrams until
  every daemon of the batch is in. A daemon of the batch that exits first, or the deadline, is a
  :class:`LaunchError` that names it. (``SCM_CREDENTIALS`` would name each sender; a count plus the
  exit check of every pending daemon is enough, as each daemon sends ``READY=1`` once.)
- :meth:`Supervisor.watch` waits for training processes: the first non-zero status ends the wait, so do a
  dead daemon and the deadline (:func:`judge` is that decision, without processes).
- :meth:`Supervisor.stop` sends SIGTERM layer by layer -- training processes, then worker daemons, then
  servers -- waiting for each layer before the next, so that each drains into the next (a worker tells
  the servers that its jobs ended before they stop), and SIGKILL after a grace period. Training processes
  the launcher started in process groups of their own (``Child.group``) are signalled as groups, so
  what they started (DataLoader workers, a wrapper script's children) stops with them.
- ``forkserver``: daemons it serves (``python -m bps_server|bps_worker``, no prefix) are forked from its
  helper, which imported them once, instead of started with ``exec`` (see ``bps_runtime.forkserver``): the
  tests' clusters (:attr:`Cluster.default_forkserver`), where start-up was most of the suite's CPU.
- ``BPS_FORKSERVER=1`` in the environment: a :class:`Cluster` made without :attr:`Cluster.default_forkserver`
  forks its daemons from one helper of this process (:func:`env_forkserver`), so that a script that starts
  clusters (the launcher, a benchmark) pays the daemons' imports once. The tests set it for the scripts they
  run; a user may, on a box where many one-box clusters start.
- ``interrupted``: a callable the launcher passes to learn of Ctrl-C from its own flag (see
  ``bps_worker.launch``); both waits check it and raise :class:`KeyboardInterrupt`, and the daemons start with
  SIGINT ignored, so that the terminal's Ctrl-C is the launcher's alone (which stops them in layers; see
  ``bps_runtime.commands``). Without it a Ctrl-C is Python's ordinary ``KeyboardInterrupt``, and the daemons
  get it too.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, ClassVar, Final, Mapping, Sequence

from protocol.config import ClusterConfig, load_config

from . import sockdir
from .cluster_file import free_ports
from bps_runtime.commands import LAUNCHER_ENV, sigint_ignored
from bps_runtime.orphans import PARENT_ENV, on_main_thread
from bps_runtime.forkserver import ForkedProcess, Forkserver, ForkserverError

__all__ = ["FORKSERVER_ENV", "READY_TIMEOUT_S", "STOP_GRACE_S", "Child", "Cluster", "DaemonCommand", "Ending",
           "LaunchError", "Supervisor", "daemon_argv", "env_forkserver", "judge", "stop_in_layers"]

READY_TIMEOUT_S: Final = 60.0
STOP_GRACE_S: Final = 10.0
READY_POLL_S: Final = 0.2   # how often the readiness wait looks for exited daemons
WATCH_POLL_S: Final = 0.05  # how often :meth:`Supervisor.watch` polls the training processes
FORKSERVER_ENV: Final = "BPS_FORKSERVER"

_env_forkserver: Forkserver | None = None


def env_forkserver() -> Forkserver | None:
    """This process's forkserver where ``BPS_FORKSERVER=1`` (one for the process's life, its helper started at
    the first daemon; see the module); None otherwise."""
    global _env_forkserver
    if os.environ.get(FORKSERVER_ENV, "") != "1":
        return None
    if _env_forkserver is None:
        _env_forkserver = Forkserver()
    return _env_forkserver


class LaunchError(Exception):
    """Daemons that did not come up: one exited during start-up (``label`` names it) or the deadline passed."""

    def __init__(self, message: str, label: str | None = None) -> None:
        super().__init__(message)
        self.label = label


@dataclass(frozen=True)
class DaemonCommand:
    """How to start one daemon: ``argv`` after ``prefix`` (e.g. ``ip netns exec NS``); ``where`` for messages."""

    label: str                      # server-N / worker-N
    argv: tuple[str, ...]
    prefix: tuple[str, ...] = ()
    where: str = ""                 # the machine it runs on, if not this one


@dataclass
class Child:
    """A process started for a cluster: a daemon (``server-N`` / ``worker-N``) or a training process."""

    label: str
    proc: subprocess.Popen[Any] | ForkedProcess
    daemon: bool
    where: str = ""
    command: DaemonCommand | None = field(default=None, repr=False)  # how to start it again (daemons)
    group: bool = False  # started in a process group of its own: signalled as that group, with what it started

    def describe(self) -> str:
        return f"{self.label} on {self.where}" if self.where else self.label

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process, or to its whole process group (``group``: even once the process itself
        has exited, to reach what it left running); nothing if it is gone."""
        if not self.group:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):  # the group is empty
            pass


@dataclass(frozen=True)
class Ending:
    """How a wait for training processes ended: the status to return, and why when it is not "all done"."""

    code: int
    reason: str | None = None       # None: every process exited 0
    culprit: Child | None = None    # the process that ended it, if one did


def daemon_argv(program: Sequence[str], config_path: str | Path, ident: int, *, log_level: str,
                extra: Sequence[str] = (), timeline: str | Path | None = None) -> tuple[str, ...]:
    """``program --config FILE --id N --log-level L [extra] [--timeline FILE]``."""
    argv = [*program, "--config", str(config_path), "--id", str(ident), "--log-level", log_level, *extra]
    return tuple(argv + (["--timeline", str(timeline)] if timeline else []))


def judge(ranks: Sequence[tuple[Child, int | None]], dead_daemon: Child | None, overdue: bool,
          timeout: float | None) -> Ending | None:
    """The end of a wait for ``ranks`` (each with its status, None while running), or None to go on.

    The first failed rank wins (its status, 1 for a signal), then "all exited 0", then a dead daemon, then
    the deadline.
    """
    for child, code in ranks:
        if code is not None and code != 0:
            return Ending(code if code > 0 else 1, f"{child.describe()} exited with status {code}", child)
    if all(code == 0 for _, code in ranks):
        return Ending(0)
    if dead_daemon is not None:
        return Ending(1, f"{dead_daemon.describe()} exited with status {dead_daemon.proc.returncode}", dead_daemon)
    if overdue:
        return Ending(1, f"ranks did not finish within {timeout:g} s")
    return None


class ExitOrder:
    """The order in which processes exit, as well as it can be seen: each one's pidfd (``pidfd_open``) wakes
    :meth:`wait` as it exits. A job's first failure makes its peers fail a moment later (their connections
    break), and judged by rank within one poll of their statuses the launcher named a peer, its status and all,
    about one run in six (a review). Processes that exit within one wake-up of ours are taken by rank, and so
    are those that exited before the watch began (first); one without a pidfd (an old kernel) is judged after
    those seen to exit."""

    def __init__(self, children: Sequence[Child]) -> None:
        self.children = list(children)
        self.seen: list[Child] = []  # exited, in the order their pidfds woke us
        self._fds: dict[int, Child] = {}
        self._poller = select.poll()
        for child in self.children:
            if child.proc.poll() is not None:  # exited before the watch began (reaped, maybe, by another wait)
                self.seen.append(child)
                continue
            try:
                fd = os.pidfd_open(child.proc.pid)
            except OSError:
                if child.proc.poll() is not None:
                    self.seen.append(child)
                continue
            self._fds[fd] = child
            self._poller.register(fd, select.POLLIN)

    def __enter__(self) -> "ExitOrder":
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def wait(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for one of them to exit; note those that did, in the order seen."""
        if not self._fds:
            time.sleep(timeout_s)
            return
        for fd, _ in self._poller.poll(timeout_s * 1000):
            child = self._fds.pop(fd, None)
            if child is not None:
                self._poller.unregister(fd)
                os.close(fd)
                self.seen.append(child)

    def statuses(self) -> list[tuple[Child, int | None]]:
        """Every process with its status (None while it runs): those seen to exit first, in that order."""
        seen = set(map(id, self.seen))
        return [(child, child.proc.poll()) for child in self.seen + [c for c in self.children if id(c) not in seen]]


def stop_in_layers(layers: list[list[Child]], grace_s: float = STOP_GRACE_S,
                   first_signal: int = signal.SIGTERM) -> None:
    """Signal each layer of processes and wait for it (SIGKILL after ``grace_s``) before the next: the first
    layer gets ``first_signal``, the others SIGTERM.

    A child in a process group of its own (``Child.group``) is signalled as that group, as torchrun stops its
    workers, and once it has exited (or been killed) what is left of its group is killed: a process it
    started that ignores the signal (a shell's background job ignores SIGINT) does not outlive the stop.
    """
    for n, layer in enumerate(layers):
        for child in layer:
            child.signal(first_signal if n == 0 else signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in layer:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
            if child.group:
                child.signal(signal.SIGKILL)


def _never() -> bool:
    return False


class Supervisor:
    """The processes of one cluster: daemons started in batches and awaited, training processes, all stopped.

    ``env``: the daemons' environment (default: ours at each start), ``NOTIFY_SOCKET`` added. ``log_dir``: each daemon's
    output goes to ``<label>.log`` there instead of our stderr. ``notify_dir``: where the readiness socket
    is bound (a directory of ours). ``children`` is public: callers add their training processes to it.
    """

    def __init__(self, notify_dir: str | Path, *, env: Mapping[str, str] | None = None,
                 log_dir: str | Path | None = None, ready_timeout_s: float = READY_TIMEOUT_S,
                 grace_s: float = STOP_GRACE_S, interrupted: Callable[[], bool] | None = None,
                 forkserver: Forkserver | None = None) -> None:
        self.forkserver = forkserver
        self.notify_dir = Path(notify_dir)
        self.env = dict(env) if env is not None else None  # None: ours as it is at each start
        self.log_dir = Path(log_dir) if log_dir else None
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.interrupted = interrupted or _never
        # A caller that learns of Ctrl-C itself (the launcher) stops the daemons: they start with SIGINT ignored
        # (bps_runtime.commands), where a Ctrl-C in their interpreters' start-up was a traceback from each.
        self.ignore_sigint = interrupted is not None
        self.children: list[Child] = []
        self._log_starts: dict[str, int] = {}  # each daemon's log's size when this start of it began (appended to)

    def launch(self, commands: Sequence[DaemonCommand]) -> None:
        """Start ``commands`` and return once every one has sent ``READY=1``; LaunchError if one exits first."""
        notify_path = self.notify_dir / f"notify-{os.urandom(4).hex()}"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        try:
            env = dict(os.environ if self.env is None else self.env, NOTIFY_SOCKET=str(notify_path))
            if self.ignore_sigint:
                env[LAUNCHER_ENV] = "1"
            pending = [self._spawn(command, env) for command in commands]
            self._wait_ready(notify, pending)
        finally:
            notify.close()
            notify_path.unlink(missing_ok=True)

    def _spawn(self, command: DaemonCommand, env: Mapping[str, str]) -> Child:
        out: IO[bytes] | None = None
        if self.log_dir:
            try:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                out = open(self.log_dir / f"{command.label}.log", "ab")
                self._log_starts[command.label] = out.seek(0, os.SEEK_END)
            except OSError as exc:
                raise LaunchError(f"{command.label}: cannot write its log in {self.log_dir}: {exc.strerror or exc}",
                                  command.label) from None
        proc: subprocess.Popen[Any] | ForkedProcess
        if self.ignore_sigint and not command.prefix and on_main_thread():
            # The launcher's end with it, however it ends (bps_runtime.orphans): not through a prefix, which may
            # fork (its child's parent would not be us), nor when started from another thread, whose end would
            # end them.
            env = {**env, PARENT_ENV: str(os.getpid())}
        try:
            if self.forkserver is not None and self.forkserver.serves(command.argv, command.prefix):
                try:
                    proc = self.forkserver.spawn(command.argv, env, None if out is None else out.fileno(),
                                                 ignore_sigint=self.ignore_sigint)
                except ForkserverError as exc:  # (its helper killed or stuck: a daemon that did not start)
                    raise LaunchError(f"{command.label} did not start: {exc}", command.label) from None
            else:
                argv = sigint_ignored(command.argv) if self.ignore_sigint else list(command.argv)
                try:
                    proc = subprocess.Popen([*command.prefix, *argv], env=env, stdin=subprocess.DEVNULL,
                                            stdout=out, stderr=out)  # (a closed fd 0 made uvloop abort)
                except OSError as exc:
                    raise LaunchError(f"{command.label} did not start: {exc}", command.label) from None
        finally:
            if out is not None:
                out.close()
        child = Child(command.label, proc, daemon=True, where=command.where, command=command)
        self.children.append(child)
        return child

    def _wait_ready(self, notify: socket.socket, pending: list[Child]) -> None:
        notify.settimeout(READY_POLL_S)
        deadline = time.monotonic() + self.ready_timeout_s
        ready = 0
        while ready < len(pending):
            if self.interrupted():
                raise KeyboardInterrupt
            for child in pending:
                code = child.proc.poll()
                if code is not None:
                    raise LaunchError(f"{child.describe()} exited with status {code} during start-up"
                                      f"{self.last_log_line(child.label)}", child.label)
            if time.monotonic() > deadline:
                raise LaunchError(f"the cluster was not ready within {self.ready_timeout_s:g} s "
                                  f"({ready} of {len(pending)} daemons ready)")
            try:
                data = notify.recv(4096)
            except socket.timeout:
                continue
            if b"READY=1" in data:
                ready += 1

    def daemon(self, label: str) -> Child:
        """The daemon called ``label`` (KeyError if there is none)."""
        for child in self.children:
            if child.daemon and child.label == label:
                return child
        raise KeyError(label)

    def kill(self, label: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to daemon ``label`` (e.g. ``server-2``) and, unless it is SIGSTOP/SIGCONT, reap it."""
        child = self.daemon(label)
        child.proc.send_signal(sig)
        if sig not in (signal.SIGSTOP, signal.SIGCONT):
            child.proc.wait()

    def restart(self, label: str) -> None:
        """Start daemon ``label`` again after it died (as systemd's Restart=on-failure would)."""
        old = self.daemon(label)
        if old.proc.poll() is None:
            raise LaunchError(f"{label} is still running", label)
        if old.command is None:
            raise LaunchError(f"{label} was not started by this supervisor", label)
        self.children.remove(old)
        self.launch([old.command])

    def dead_daemon(self) -> Child | None:
        """A daemon that has exited, if any."""
        for child in self.children:
            if child.daemon and child.proc.poll() is not None:
                return child
        return None

    def watch(self, ranks: Sequence[Child], timeout: float | None = None) -> Ending:
        """Wait until ``ranks`` have all exited 0, one failed, a daemon died or ``timeout`` passed (:func:`judge`,
        which meets the ranks in the order they exited: :class:`ExitOrder`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with ExitOrder(ranks) as exits:
            while True:
                if self.interrupted():
                    raise KeyboardInterrupt
                overdue = deadline is not None and time.monotonic() > deadline
                ending = judge(exits.statuses(), self.dead_daemon(), overdue, timeout)
                if ending is not None:
                    return ending
                exits.wait(WATCH_POLL_S)

    def last_log_line(self, label: str) -> str:
        """The last line of daemon ``label``'s log and where the log is, as a message suffix (empty without
        ``log_dir``: its stderr is ours, and its reason is on the terminal already). With ``--log-dir`` a daemon
        that failed to start was reported with no reason (a review)."""
        if not self.log_dir:
            return ""
        path = self.log_dir / f"{label}.log"
        try:  # (what this start wrote: the log is appended to, and an earlier run's last line is not this one's)
            lines = path.read_bytes()[self._log_starts.get(label, 0):][-4096:].decode(errors="replace").splitlines()
        except OSError:
            return ""
        lines = [line for line in lines if line.strip()]
        return f": {lines[-1].strip()} (its log: {path})" if lines else f" (its log: {path})"

    def log_tail(self, label: str, limit: int = 2000) -> str:
        """The end of daemon ``label``'s log as a message suffix (empty without ``log_dir``)."""
        if not self.log_dir:
            return ""
        path = self.log_dir / f"{label}.log"
        try:
            return f"; its log ({path}):\n" + path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def stop(self, rank_signal: int = signal.SIGTERM) -> None:
        """Stop training processes (with ``rank_signal``), then workers, then servers (each layer drains into
        the next)."""
        stop_in_layers([[c for c in self.children if not c.daemon],
                        [c for c in self.children if c.daemon and c.label.startswith("worker")],
                        [c for c in self.children if c.daemon and not c.label.startswith("worker")]],
                       self.grace_s, rank_signal)
        self.children.clear()


class Cluster:
    """The daemons of one cluster file, all on this box; a context manager that always stops them.

    Daemons run as ``python -m bps_server`` / ``python -m bps_worker`` (forked from
    :attr:`default_forkserver` where one is set, as in the tests, else from :func:`env_forkserver`'s). Each
    worker's socket is where the file says when that directory exists and is ours alone; else in this
    cluster's private run directory (:func:`bps_worker.sockdir.launch_socket_path`; ``moved`` says which and
    why). ``timeline_dir``: every daemon writes ``DIR/<label>.json``, every rank ``DIR/rank<N>.json``.
    ``interrupted``: see the module.
    """

    default_forkserver: ClassVar[Forkserver | None] = None  # set by the tests (conftest.py); else BPS_FORKSERVER

    def __init__(self, config_path: str, *, log_level: str = "warning", log_dir: str | None = None,
                 python: str = sys.executable, timeline_dir: str | None = None,
                 interrupted: Callable[[], bool] | None = None) -> None:
        self.timeline_dir = timeline_dir
        self.config_path = config_path
        self.config: ClusterConfig = load_config(config_path)
        self.log_level = log_level
        self.log_dir = log_dir
        self.python = python
        self._tmp = tempfile.TemporaryDirectory(prefix="bps-launch-", dir=sockdir.private_base())
        self.sockets: dict[int, str] = {}
        self.moved: dict[int, sockdir.Problem] = {}  # worker id -> why its socket is not where the file says
        for spec in self.config.worker_specs:
            self.sockets[spec.id], problem = sockdir.launch_socket_path(spec.socket, self._tmp.name, spec.id)
            if problem is not None:
                self.moved[spec.id] = problem
        self.supervisor = Supervisor(self._tmp.name, log_dir=log_dir, interrupted=interrupted,
                                     forkserver=self.default_forkserver or env_forkserver())
        self._rendezvous_port: int | None = None  # torch.distributed's, chosen when the first rank needs it

    @property
    def children(self) -> list[Child]:
        """Every process of the cluster (the supervisor's list: append training processes to it)."""
        return self.supervisor.children

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start every daemon and wait until all are ready; on any failure stop those already started.

        The servers first, the workers once every server listens: a server that cannot (its port taken, as by
        another launch of the same file) stops the start before any worker of ours connects to whoever holds
        that port (a second launch's workers were refused there as second daemons of their ids, a screenful of
        lines on both launches, before the one that said why), and every worker's links connect at their first
        try. Forked servers are ready in about 0.1 s."""
        try:
            self.supervisor.launch([self.command(f"server-{spec.id}") for spec in self.config.servers])
            self.supervisor.launch([self.command(f"worker-{w.id}") for w in self.config.worker_specs])
        except BaseException:
            self.stop()
            raise

    def command(self, label: str) -> DaemonCommand:
        """How to start daemon ``server-N`` / ``worker-N`` of this cluster."""
        kind, ident = label.split("-")
        module = "bps_server" if kind == "server" else "bps_worker"
        extra: list[str] = []
        if kind == "worker" and int(ident) in self.moved:
            extra = ["--socket", self.sockets[int(ident)]]
        timeline = os.path.join(self.timeline_dir, f"{label}.json") if self.timeline_dir else None
        return DaemonCommand(label, daemon_argv([self.python, "-m", module], self.config_path, int(ident),
                                                log_level=self.log_level, extra=extra, timeline=timeline))

    def kill(self, label: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to daemon ``label`` (e.g. ``server-2``) and, unless it is SIGSTOP/SIGCONT, reap it."""
        self.supervisor.kill(label, sig)

    def restart(self, label: str) -> None:
        """Start daemon ``label`` again after it died (as systemd's Restart=on-failure would)."""
        self.supervisor.restart(label)

    def dead_daemon(self) -> Child | None:
        return self.supervisor.dead_daemon()

    def socket_path(self, worker_id: int) -> str:
        """Where worker ``worker_id``'s daemon listens (the file's ``socket``, unless ``moved``)."""
        return self.sockets[worker_id]

    def env_for(self, worker_id: int, local_rank: int) -> dict[str, str]:
        """What a training process of worker ``worker_id`` gets: BPS_SOCKET, BPS_RANK, LOCAL_RANK, ..., and
        torch.distributed's RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT."""
        rank = self.config.rank_offset(worker_id) + local_rank
        env = dict(os.environ, BPS_SOCKET=self.socket_path(worker_id), BPS_LOCAL_RANK=str(local_rank),
                   LOCAL_RANK=str(local_rank), BPS_RANK=str(rank), BPS_SIZE=str(self.config.size),
                   BPS_WORKER_ID=str(worker_id), BPS_CONFIG=os.path.abspath(self.config_path))
        if self.timeline_dir:
            env["BPS_TIMELINE"] = self.timeline_dir
        # torch.distributed's env:// rendezvous, as torchrun sets it: a DDP script with bps.ddp_comm_hook still
        # makes a process group for DDP's own set-up. A MASTER_ADDR/MASTER_PORT given to the launcher wins.
        if self._rendezvous_port is None:
            self._rendezvous_port = free_ports(1)[0]
        env.update(RANK=str(rank), WORLD_SIZE=str(self.config.size),
                   LOCAL_WORLD_SIZE=str(self.config.worker(worker_id).local_size))
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(self._rendezvous_port))
        return env

    def stop(self, rank_signal: int = signal.SIGTERM) -> None:
        """Stop training processes (with ``rank_signal``), then workers, then servers (each layer drains into
        the next)."""
        self.supervisor.stop(rank_signal)
        self._tmp.cleanup()
