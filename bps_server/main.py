"""``bps-server --config FILE --id N``: run Summation Service N in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from protocol.config import load_config, read_token
from protocol.errors import ConfigError

from . import kernels
from .server import ServerConfig, SummationServer
from .service import (describe_bind_error, install_stop_signals, keep_freed_memory, new_event_loop, sd_notify,
                      setup_logging)

log = logging.getLogger("bps.server")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bps-server", description="BytePS Summation Service")
    p.add_argument("--config", required=True, help="cluster TOML file")
    p.add_argument("--id", type=int, required=True, help="id of the [[server]] table to run")
    p.add_argument("--threads", type=int, default=2, help="summation threads (default: 2)")
    p.add_argument("--bind", default=None, help="bind to this host instead of the one in the cluster file")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


async def serve(config: ServerConfig, notify_socket: str | None) -> int:
    server = SummationServer(config)
    stop = asyncio.Event()
    install_stop_signals(asyncio.get_running_loop(), stop.set)
    try:
        await server.start()
    except OSError as exc:
        host, port = config.bind
        print(f"bps-server: {describe_bind_error(exc, f'{host}:{port}')}", file=sys.stderr)
        return 1
    sd_notify("READY=1", notify_socket)
    await stop.wait()
    log.info("stopping")
    sd_notify("STOPPING=1", notify_socket)
    await server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    try:
        cluster = load_config(args.config)
        cluster.server(args.id)
        token = read_token(cluster)
    except ConfigError as exc:
        print(f"bps-server: {exc}", file=sys.stderr)
        return 2
    if args.threads < 1:
        print("bps-server: --threads must be >= 1", file=sys.stderr)
        return 2
    config = ServerConfig(cluster, args.id, threads=args.threads, host=args.bind, token=token)
    keep_freed_memory()
    kernels.warm_up()  # compile before reporting ready, never on a job's first tensor
    loop = new_event_loop()
    try:
        return loop.run_until_complete(serve(config, os.environ.get("NOTIFY_SOCKET")))
    finally:
        loop.close()
