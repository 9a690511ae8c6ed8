"""``bps-server --config FILE --id N``: run Summation Service N in the foreground."""

from __future__ import annotations

import argparse
import logging
import os
import socket

from protocol.config import load_config, read_token
from protocol.errors import ConfigError

from bps_runtime.commands import INTERRUPTED_STATUS, say
from .server import ServerConfig, SummationServer
from bps_runtime.health import STALL_LIMIT_S, from_environment
from bps_runtime.lifecycle import (new_event_loop, open_standard_fds, prepare_to_serve, serve_until_signalled,
                                   setup_logging)
from bps_runtime.timeline import TimelineError

log = logging.getLogger("bps.server")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bps-server", description="BytePS Summation Service")
    p.add_argument("--config", required=True, help="cluster TOML file")
    p.add_argument("--id", type=int, default=None,
                   help="id of the [[server]] table to run (default: from BPS_ID, JOB_COMPLETION_INDEX or "
                        "SLURM_NODEID, plus BPS_ID_OFFSET; see configs/README.md)")
    p.add_argument("--threads", type=int, default=2, help="summation threads (default: 2)")
    p.add_argument("--bind", default=None, help="bind to this host instead of the one in the cluster file")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-file", default=None, help="log to this file instead of stderr (reopened on SIGHUP)")
    p.add_argument("--timeline", default=None,
                   help="write a Chrome-trace timeline of every tensor's stages to this file (open in Perfetto)")
    p.add_argument("--stall-limit", type=float, default=STALL_LIMIT_S, metavar="SECONDS",
                   help=f"GET /livez fails once the event loop has not beaten for this long (default: {STALL_LIMIT_S:g})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    open_standard_fds()  # (started with one closed: uvloop aborted at the stop)
    args = parse_args(argv)
    try:
        setup_logging(args.log_level, args.log_file)
        settings = from_environment(args.id, args.stall_limit, os.environ, socket.gethostname(), os.getpid())
    except ValueError as exc:
        say(f"bps-server: {exc}")
        return 2
    ident = settings.ident
    if ident.source != "--id":
        log.info("server id %d, from %s", ident.id, ident.source)
    try:
        cluster = load_config(args.config)
        cluster.server(ident.id)
        token = read_token(cluster)
    except ConfigError as exc:
        say(f"bps-server: {exc}")
        return 2
    notify_socket, watchdog_s = settings.notify_socket, settings.watchdog_s
    if args.threads < 1:
        say("bps-server: --threads must be >= 1")
        return 2
    config = ServerConfig(cluster, ident.id, threads=args.threads, host=args.bind, token=token,
                          timeline=args.timeline, notify_socket=notify_socket, watchdog_s=watchdog_s,
                          stall_limit_s=args.stall_limit)
    if not prepare_to_serve():
        return INTERRUPTED_STATUS
    loop = new_event_loop()
    try:
        try:
            server = SummationServer(config)
        except TimelineError as exc:
            say(f"bps-server: {exc}")
            return 1
        host, port = config.bind
        return loop.run_until_complete(serve_until_signalled(
            server.start, server.stop, prog="bps-server", listen_on=f"{host}:{port}",
            notify_socket=notify_socket))
    finally:
        loop.close()
