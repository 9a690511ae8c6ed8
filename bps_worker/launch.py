"""``bps-launch``: a whole single-host cluster plus the training processes of a script.

For demos, tests and one-box users. Across machines use systemd units for the
daemons (``configs/systemd``) and torchrun for the training processes.

    bps-launch --config configs/local.toml -- python examples/train_digits.py --epochs 3

The cluster's token (``cluster.token_file``, ``~/.config/bps/token`` in ``configs/local.toml``) is made
on the first start when that file does not exist yet (32 random bytes as hex, mode 600), and checked
before any daemon starts; ``bps-launch --make-token PATH`` only makes one, to copy to every machine.

Every daemon reports readiness over a private ``NOTIFY_SOCKET`` (the systemd
protocol), so training starts only when the cluster is up. When every training
process has exited the daemons are stopped with SIGTERM; if any process fails
(or Ctrl-C arrives) everything is stopped and the launcher exits non-zero.

Each training process runs in a process group of its own: it is stopped as a group, as torchrun stops its
workers, so what it started (DataLoader workers, a wrapper script's children) does not outlive the launcher.
A terminal's Ctrl-C therefore reaches the launcher alone, which passes it on: the ranks get the SIGINT (or
SIGTERM, SIGHUP) that stopped it, then SIGKILL after the grace period. A group, not a session of its own:
where the kernel shares the CPU out by session (autogroup), a rank in a session of its own had as much CPU
as all of the box's daemons together, and its sums waited for them. A launcher killed outright (SIGKILL, the OOM
killer) can stop nothing: so each rank, daemon and forkserver helper it starts ends when it does
(``bps_runtime.orphans``), and a rank ignores SIGTTOU, so that its output reaches a ``stty tostop`` terminal
instead of stopping it in the background.

The launcher's standard input goes to rank 0 alone, through a pipe, as ``mpirun`` and ``srun`` do; the other
ranks read an empty one (``/dev/null``). So ``breakpoint()`` or ``input()`` on rank 0 reads what is typed at the
launcher's terminal. A rank in a background process group that read the terminal itself would be stopped
(SIGTTIN) and the job would freeze without a word; on another rank ``input()`` raises EOFError. The launcher
reads its terminal only while it is the terminal's foreground job.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":  # python -m: a Ctrl-C while the imports below run ends it at once and quietly, as
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # bps-launch's guard does (bps_runtime.commands); main() takes over

import argparse
import os
import secrets
import select
import subprocess
import sys
import threading
from types import FrameType
from typing import Any, Callable, Sequence

from bps_runtime.commands import INTERRUPTED_STATUS, exit_with, say
from bps_runtime.lifecycle import open_standard_fds
from bps_runtime.orphans import start_rank
from protocol.config import load_config, read_token
from protocol.errors import ConfigError

from . import stragglers
from .observer import server_stats
from .supervise import Child, Cluster, LaunchError
from .token_file import ensure_token, make_token


def run_training(cluster: Cluster, command: Sequence[str], *, timeout: float | None = None,
                 env_defaults: dict[str, str] | None = None, prog: str = "bps-launch") -> int:
    """Start ``command`` once per training process; return the first non-zero status, else 0.

    A daemon that dies, or ranks still running after ``timeout`` seconds, make it return 1.
    ``env_defaults`` are set in each rank's environment unless already there. Each start is a job of its own
    (``BPS_JOB``, unless set: a job's asynchronous values are its own, see bps_worker.client.settings).
    """
    procs: list[Child] = []
    job = secrets.token_hex(8)
    for w in cluster.config.worker_specs:
        for local in range(w.local_size):
            env = cluster.env_for(w.id, local)
            env.setdefault("BPS_JOB", job)
            for key, value in (env_defaults or {}).items():
                env.setdefault(key, value)
            first = not procs and sys.stdin is not None  # (None: the launcher was started without one)
            try:
                # (through a step that makes it end with us, and write to a tostop terminal: bps_runtime.orphans)
                proc = start_rank(command, env, process_group=0,
                                  stdin=subprocess.PIPE if first else subprocess.DEVNULL)
            except OSError as exc:  # (the ranks started already are the cluster's children: stopped with it)
                raise LaunchError(f"cannot start the training command {command[0]!r}: "
                                  f"{exc.strerror or exc}") from None
            if first:
                forward_stdin(proc)
            procs.append(Child(f"rank {env['BPS_RANK']}", proc, daemon=False, group=True))
            cluster.children.append(procs[-1])
    ending = cluster.supervisor.watch(procs, timeout)
    if ending.reason is not None:
        rank_failed = ending.culprit is not None and not ending.culprit.daemon
        say(f"{prog}: {ending.reason}; {'stopping the cluster' if rank_failed else 'stopping'}")
    return ending.code


def forward_stdin(proc: subprocess.Popen[Any], source: int = 0) -> threading.Thread:
    """Copy what comes on ``source`` (the launcher's standard input) to ``proc``'s, in a daemon thread, until
    either ends; ``proc``'s then reads end of file. A terminal is read only while the launcher is its
    foreground job (a background job that read it would be stopped, SIGTTIN)."""
    assert proc.stdin is not None
    sink = proc.stdin.fileno()

    def copy() -> None:
        try:
            terminal = os.isatty(source)
            while proc.poll() is None:
                if not select.select([source], [], [], 0.5)[0]:
                    continue
                if terminal and os.tcgetpgrp(source) != os.getpgrp():
                    select.select([], [], [], 0.5)  # in the background: wait to be brought back
                    continue
                data = os.read(source, 65536)
                if not data:
                    break
                while data:
                    data = data[os.write(sink, data):]
        except OSError:
            pass  # no standard input (closed), or the rank is gone (a broken pipe): nothing more to pass on
        finally:
            try:
                proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass

    thread = threading.Thread(target=copy, name="bps-launch stdin", daemon=True)
    thread.start()
    return thread


def print_stragglers(cluster: Cluster, prog: str = "bps-launch") -> None:
    """The servers' push lag per worker (:mod:`bps_worker.stragglers`), on stderr, read before they stop."""
    try:
        lines = stragglers.report(server_stats(cluster))
    except (OSError, ValueError) as exc:
        lines = [f"cannot read the servers' push lag: {exc}"]
    for line in lines:
        say(f"{prog}: {line}")


class SigintFlag:
    """SIGINT (and SIGTERM, SIGHUP) recorded in a flag for as long as it is installed (a context manager),
    instead of a ``KeyboardInterrupt`` raised wherever the main thread happens to be (or, for SIGTERM and
    SIGHUP, the launcher dying at once and leaving every daemon and rank running: ``kill``, ``timeout``, a CI
    job's time limit, ``docker stop``, a closed ssh session).

    Why: a terminal's Ctrl-C reached the launcher, its daemons and its ranks at once (now the ranks have
    process groups of their own and the daemons ignore SIGINT: the launcher signals them), so a rank or daemon
    may be seen exiting from it before the launcher's own ``KeyboardInterrupt`` is raised: the status then
    depended on that order (1 or 130), and an exception raised inside the stop could cut it short. With the
    flag, the waits (:class:`~bps_worker.supervise.Supervisor`) end at their next poll, the stop always
    runs whole, and the status is decided after it: 130 whenever SIGINT came, whoever exited first.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received = False
        self.signum = 0  # the first one received
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def is_set(self) -> bool:
        return self.received

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            self.signum = signum
        self.received = True

    def __enter__(self) -> "SigintFlag":
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            if previous is not None:  # None: a handler not set from Python; ours stays (nothing to restore)
                signal.signal(signum, previous)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bps-launch", description=(__doc__ or "").split("\n\n")[0].replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.toml", help="cluster TOML file (default: configs/local.toml)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="daemons' log level (default: warning)")
    p.add_argument("--log-dir", default=None, help="write each daemon's log to DIR/<name>.log instead of stderr")
    p.add_argument("--timeline", default=None, metavar="DIR",
                   help="write Chrome-trace timelines of every daemon and rank into DIR (merge them with "
                        "`python -m bps_runtime.timeline merge OUT DIR/*.json`, open in https://ui.perfetto.dev)")
    p.add_argument("--stragglers", action="store_true",
                   help="when the training ends, print each worker's push lag at the servers (who the rounds "
                        "waited for)")
    p.add_argument("--make-token", default=None, metavar="PATH",
                   help="write a new cluster token (32 random bytes as hex, mode 600) to PATH and exit; "
                        "copy it to every machine and name it in cluster.token_file")
    p.add_argument("command", nargs=argparse.REMAINDER, help="training command, after --")
    return p


def _prepare_token(config_path: str) -> None:
    """Make the token the cluster file names on the first start, then check it as the daemons will
    (ConfigError, before any daemon starts: one that others could read is refused here already)."""
    config = load_config(config_path)
    ensure_token(config)
    read_token(config)


def _make_token_only(path: str) -> int:
    """``--make-token PATH``: 0 once a new token is there; 1, leaving it alone, if PATH exists."""
    try:
        made = make_token(path)
    except OSError as exc:
        say(f"bps-launch: cannot create token file {path}: {exc.strerror}")
        return 1
    if not made:
        say(f"bps-launch: {path} already exists; not replaced (remove it first to make a new token)")
        return 1
    say(f"bps-launch: wrote a new cluster token to {path} (mode 600); copy it to every machine")
    return 0


def main(argv: list[str] | None = None) -> int:
    open_standard_fds()  # (bps-launch ... <&- or >&-: every daemon and rank inherited a closed one)
    p = _parser()
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.make_token is not None:
        return _make_token_only(args.make_token)
    if not command:
        p.error("no training command given (put it after --)")
    failure: str | None = None
    with SigintFlag() as interrupted:
        try:
            _prepare_token(args.config)
            cluster = Cluster(args.config, log_level=args.log_level, log_dir=args.log_dir,
                              timeline_dir=os.path.abspath(args.timeline) if args.timeline else None,
                              interrupted=interrupted.is_set)
            for worker_id, problem in cluster.moved.items():
                if problem.kind != "missing":
                    say(f"bps-launch: worker {worker_id}'s socket directory "
                        f"{os.path.dirname(cluster.config.worker(worker_id).socket)} {problem.text}; using "
                        f"{cluster.socket_path(worker_id)}")
            cluster.start()
            try:
                code = run_training(cluster, command)
                if args.stragglers:
                    print_stragglers(cluster)
            finally:  # the ranks get the signal that stopped us, as under torchrun (Ctrl-C: KeyboardInterrupt)
                cluster.stop(interrupted.signum or signal.SIGTERM)
        except ConfigError as exc:
            failure, code = str(exc), 2
        except LaunchError as exc:
            failure, code = str(exc), 1
        except KeyboardInterrupt:
            code = INTERRUPTED_STATUS
        if interrupted.is_set():  # decided after the stop: whatever a rank or daemon did when Ctrl-C came
            name = signal.Signals(interrupted.signum).name
            say(f"bps-launch: interrupted ({name}); cluster stopped")
            return 128 + interrupted.signum
    if failure is not None:
        say(f"bps-launch: {failure}")
    return code


if __name__ == "__main__":
    exit_with(main)
