"""``bps-worker --config FILE --id N``: run the worker daemon (Communication Service) of machine N."""

from __future__ import annotations

import argparse
import logging
import os
import socket

from bps_runtime.commands import INTERRUPTED_STATUS, say
from bps_runtime.health import STALL_LIMIT_S, from_environment
from bps_runtime.lifecycle import (new_event_loop, open_standard_fds, prepare_to_serve, serve_until_signalled,
                                   setup_logging)
from bps_runtime.timeline import TimelineError
from protocol.config import load_config, read_token, socket_path_too_long
from protocol.errors import ConfigError

from .daemon import WorkerConfig, WorkerDaemon

log = logging.getLogger("bps.worker")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bps-worker", description="BytePS Communication Service (worker daemon)")
    p.add_argument("--config", required=True, help="cluster TOML file")
    p.add_argument("--id", type=int, default=None,
                   help="id of the [[worker]] table to run (default: from BPS_ID, JOB_COMPLETION_INDEX or "
                        "SLURM_NODEID, plus BPS_ID_OFFSET; see configs/README.md)")
    p.add_argument("--socket", default=None, help="Unix socket path (default: the worker's `socket` key)")
    p.add_argument("--socket-mode", default="600", help="octal permissions of the socket (default: 600)")
    p.add_argument("--shm-mode", default="600",
                   help="octal permissions of shared-memory segments (default: 600; 660 to share with a group)")
    p.add_argument("--threads", type=int, default=2, help="threads for local sums and copies (default: 2)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-file", default=None, help="log to this file instead of stderr (reopened on SIGHUP)")
    p.add_argument("--timeline", default=None,
                   help="write a Chrome-trace timeline of every tensor's stages to this file (open in Perfetto)")
    p.add_argument("--stall-limit", type=float, default=STALL_LIMIT_S, metavar="SECONDS",
                   help=f"GET /livez fails once the event loop has not beaten for this long (default: {STALL_LIMIT_S:g})")
    return p.parse_args(argv)


def _octal(socket_mode: str, shm_mode: str) -> tuple[int, int]:
    """The two modes' values; ConfigError unless both are octal (only theirs: a ValueError of the cluster file's
    reading was blamed on them)."""
    try:
        return int(socket_mode, 8), int(shm_mode, 8)
    except ValueError:
        raise ConfigError(f"--socket-mode and --shm-mode must be octal, got {socket_mode!r}, {shm_mode!r}") from None


def main(argv: list[str] | None = None) -> int:
    open_standard_fds()  # (started with one closed: uvloop aborted at the stop)
    args = parse_args(argv)
    try:
        setup_logging(args.log_level, args.log_file)
        settings = from_environment(args.id, args.stall_limit, os.environ, socket.gethostname(), os.getpid())
    except ValueError as exc:
        say(f"bps-worker: {exc}")
        return 2
    ident = settings.ident
    if ident.source != "--id":
        log.info("worker id %d, from %s", ident.id, ident.source)
    try:
        cluster = load_config(args.config)
        cluster.worker(ident.id)
        if args.socket is not None and (too_long := socket_path_too_long(args.socket)) is not None:
            raise ConfigError(f"--socket {args.socket!r} {too_long}")
        token = read_token(cluster)
        socket_mode, shm_mode = _octal(args.socket_mode, args.shm_mode)
    except ConfigError as exc:
        say(f"bps-worker: {exc}")
        return 2
    notify_socket, watchdog_s = settings.notify_socket, settings.watchdog_s
    config = WorkerConfig(cluster, ident.id, socket_path=args.socket, socket_mode=socket_mode,
                          segment_mode=shm_mode, threads=max(1, args.threads), token=token, timeline=args.timeline,
                          notify_socket=notify_socket, watchdog_s=watchdog_s, stall_limit_s=args.stall_limit)
    if not prepare_to_serve():
        return INTERRUPTED_STATUS
    loop = new_event_loop()
    try:
        try:
            daemon = WorkerDaemon(config)
        except TimelineError as exc:
            say(f"bps-worker: {exc}")
            return 1
        return loop.run_until_complete(serve_until_signalled(
            daemon.start, daemon.stop, prog="bps-worker", listen_on=config.socket,
            notify_socket=notify_socket))
    finally:
        loop.close()
