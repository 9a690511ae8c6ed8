"""``bps-launch``: a whole single-host cluster plus the training processes of a script.

For demos, tests and one-box users. Across machines use systemd units for the
daemons (``configs/systemd``) and torchrun for the training processes.

    bps-launch --config configs/local.toml -- python examples/train_digits.py --epochs 3

Every daemon reports readiness over a private ``NOTIFY_SOCKET`` (the systemd
protocol), so training starts only when the cluster is up. When every training
process has exited the daemons are stopped with SIGTERM; if any process fails
(or Ctrl-C arrives) everything is stopped and the launcher exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Sequence

from protocol.config import ClusterConfig, load_config
from protocol.errors import ConfigError

READY_TIMEOUT_S: Final = 60.0
STOP_GRACE_S: Final = 10.0



def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def toml_value(value: Any) -> str:
    """``value`` (bool, number or string) as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(directory: Path, local_sizes: list[int], *, colocated: bool = True, cpu_servers: int = 1,
                 extra_servers_per_worker: int = 0, cluster: dict[str, Any] | None = None,
                 metrics: bool = False, separate_hosts: bool = False) -> Path:
    """A one-box cluster file on free loopback ports: ``len(local_sizes)`` workers (sockets under
    ``directory``), one colocated server each, plus ``cpu_servers`` CPU-only ones; ``cluster`` adds
    ``[cluster]`` keys. With ``metrics`` every daemon also serves Prometheus metrics on a free port.
    With ``separate_hosts`` server ``i`` listens on 127.0.0.``i+1``: still this box, but the config looks
    like servers on several hosts (the finer partitions and the streams of ``bps_worker.placement``).
    Used by the tests and the benchmarks."""
    directory.mkdir(parents=True, exist_ok=True)
    n = len(local_sizes)
    n_servers = (n * (1 + extra_servers_per_worker) if colocated else 0) + cpu_servers
    ports = free_ports(n_servers + (n_servers + n if metrics else 0))
    metric_ports = iter(ports[n_servers:])
    lines = ["[cluster]", f"workers = {n}"]
    lines += [f"{key} = {toml_value(value)}" for key, value in (cluster or {}).items()]
    def host(sid: int) -> str:
        return f"127.0.0.{sid + 1}" if separate_hosts else "127.0.0.1"

    sid = 0
    if colocated:
        for w in range(n):
            for _ in range(1 + extra_servers_per_worker):
                lines += ["", "[[server]]", f"id = {sid}", f'address = "{host(sid)}:{ports[sid]}"', f"worker = {w}"]
                lines += [f'metrics = "127.0.0.1:{next(metric_ports)}"'] if metrics else []
                sid += 1
    for _ in range(cpu_servers):
        lines += ["", "[[server]]", f"id = {sid}", f'address = "{host(sid)}:{ports[sid]}"']
        lines += [f'metrics = "127.0.0.1:{next(metric_ports)}"'] if metrics else []
        sid += 1
    for w, local in enumerate(local_sizes):
        lines += ["", "[[worker]]", f"id = {w}", f"local_size = {local}", f'socket = "{directory}/w{w}.sock"']
        lines += [f'metrics = "127.0.0.1:{next(metric_ports)}"'] if metrics else []
    path = directory / "cluster.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Child:
    label: str
    proc: subprocess.Popen[bytes]
    daemon: bool


class LaunchError(Exception):
    pass


class Cluster:
    """The daemons of a one-box cluster; a context manager that always stops them."""

    def __init__(self, config_path: str, *, log_level: str = "warning", log_dir: str | None = None,
                 python: str = sys.executable, timeline_dir: str | None = None) -> None:
        self.timeline_dir = timeline_dir  # every daemon writes DIR/<label>.json, every rank DIR/rank<N>.json
        self.config_path = config_path
        self.config: ClusterConfig = load_config(config_path)
        self.log_level = log_level
        self.log_dir = log_dir
        self.python = python
        self.children: list[Child] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="bps-launch-")

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start every daemon and wait until all are ready; on any failure stop those already started."""
        try:
            self._launch([f"server-{spec.id}" for spec in self.config.servers]
                         + [f"worker-{w.id}" for w in self.config.worker_specs])
        except BaseException:
            self.stop()
            raise

    def _launch(self, labels: list[str]) -> None:
        """Start the daemons named ``server-N`` / ``worker-N`` and wait until they are all ready."""
        notify_path = os.path.join(self._tmp.name, f"notify-{os.urandom(4).hex()}")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(notify_path)
        try:
            pending = {}
            for label in labels:
                kind, ident = label.split("-")
                module = "bps_server" if kind == "server" else "bps_worker"
                pending[self._spawn_daemon(label, module, int(ident), notify_path).pid] = label
            self._wait_ready(notify, pending)
        finally:
            notify.close()
            os.unlink(notify_path)

    def kill(self, label: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to daemon ``label`` (e.g. ``server-2``) and, unless it is SIGSTOP, reap it."""
        child = next(c for c in self.children if c.daemon and c.label == label)
        child.proc.send_signal(sig)
        if sig not in (signal.SIGSTOP, signal.SIGCONT):
            child.proc.wait()

    def restart(self, label: str) -> None:
        """Start daemon ``label`` again after it died (as systemd's Restart=on-failure would)."""
        old = next(c for c in self.children if c.daemon and c.label == label)
        if old.proc.poll() is None:
            raise LaunchError(f"{label} is still running")
        self.children.remove(old)
        self._launch([label])

    def _spawn_daemon(self, label: str, module: str, ident: int, notify_path: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ, NOTIFY_SOCKET=notify_path)
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{label}.log"), "ab")
        cmd = [self.python, "-m", module, "--config", self.config_path, "--id", str(ident),
               "--log-level", self.log_level]
        if self.timeline_dir:
            cmd += ["--timeline", os.path.join(self.timeline_dir, f"{label}.json")]
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out or None)
        if out is not None:
            out.close()
        self.children.append(Child(label, proc, daemon=True))
        return proc

    def _wait_ready(self, notify: socket.socket, pending: dict[int, str]) -> None:
        # SCM_CREDENTIALS would name the sender; a per-daemon pid check on exit is enough here.
        notify.settimeout(0.2)
        deadline = time.monotonic() + READY_TIMEOUT_S
        ready = 0
        while ready < len(pending):
            for child in self.children:
                code = child.proc.poll() if child.proc.pid in pending else None
                if code is not None:
                    raise LaunchError(f"{child.label} exited with status {code} during start-up")
            if time.monotonic() > deadline:
                raise LaunchError(f"the cluster was not ready within {READY_TIMEOUT_S:g} s")
            try:
                data = notify.recv(4096)
            except socket.timeout:
                continue
            if b"READY=1" in data:
                ready += 1

    def env_for(self, worker_id: int, local_rank: int) -> dict[str, str]:
        spec = self.config.worker(worker_id)
        rank = self.config.rank_offset(worker_id) + local_rank
        env = dict(os.environ, BPS_SOCKET=spec.socket, BPS_LOCAL_RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                   BPS_RANK=str(rank), BPS_SIZE=str(self.config.size), BPS_WORKER_ID=str(worker_id),
                   BPS_CONFIG=os.path.abspath(self.config_path))
        if self.timeline_dir:
            env["BPS_TIMELINE"] = self.timeline_dir
        return env

    def dead_daemon(self) -> Child | None:
        for child in self.children:
            if child.daemon and child.proc.poll() is not None:
                return child
        return None

    def stop(self) -> None:
        """Stop training processes, then workers, then servers (each layer drains into the next)."""
        stop_in_layers([[c.proc for c in self.children if not c.daemon],
                        [c.proc for c in self.children if c.daemon and c.label.startswith("worker")],
                        [c.proc for c in self.children if c.daemon and not c.label.startswith("worker")]])
        self.children.clear()
        self._tmp.cleanup()


def stop_in_layers(layers: list[list[subprocess.Popen[Any]]], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM each layer of processes and wait for it (SIGKILL after ``grace_s``) before the next."""
    for group in layers:
        for proc in group:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in group:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def server_stats(cluster: "Cluster") -> dict[int, dict[str, Any]]:
    """Every server's counters (Stats), asked for over TCP as an observer (tests, benchmarks)."""
    from protocol import PROTOCOL_VERSION
    from protocol.config import read_token
    from protocol.frames import FrameReader, encode_header
    from protocol.messages import ROLE_OBSERVER, Challenge, Hello, Stats, StatsRequest, auth_digest, parse, to_header

    token = read_token(cluster.config)
    out = {}
    for spec in cluster.config.servers:
        with socket.create_connection((spec.host, spec.port), timeout=10) as s:
            reader = FrameReader()
            sent = False
            while spec.id not in out:
                data = s.recv(65536)
                if not data:
                    raise ConnectionError(f"server {spec.id} closed the stats connection")
                for message in (parse(f.header) for f in reader.receive_data(data)):
                    if isinstance(message, Challenge) and not sent:
                        auth = auth_digest(token, message.nonce, ROLE_OBSERVER, 0) if token else ""
                        s.sendall(encode_header(to_header(Hello(PROTOCOL_VERSION, ROLE_OBSERVER, 0, auth=auth)))
                                  + encode_header(to_header(StatsRequest(1))))
                        sent = True
                    elif isinstance(message, Stats):
                        out[spec.id] = message.stats
    return out


def run_training(cluster: Cluster, command: Sequence[str], *, timeout: float | None = None,
                 env_defaults: dict[str, str] | None = None, prog: str = "bps-launch") -> int:
    """Start ``command`` once per training process; return the first non-zero status, else 0.

    A daemon that dies, or ranks still running after ``timeout`` seconds, make it return 1.
    ``env_defaults`` are set in each rank's environment unless already there.
    """
    procs: list[Child] = []
    for w in cluster.config.worker_specs:
        for local in range(w.local_size):
            env = cluster.env_for(w.id, local)
            for key, value in (env_defaults or {}).items():
                env.setdefault(key, value)
            procs.append(Child(f"rank {env['BPS_RANK']}", subprocess.Popen(list(command), env=env), daemon=False))
    cluster.children.extend(procs)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [c.proc.poll() for c in procs]
        failed = [(c, code) for c, code in zip(procs, codes) if code not in (None, 0)]
        if failed:
            child, code = failed[0]
            print(f"{prog}: {child.label} exited with status {code}; stopping the cluster", file=sys.stderr)
            return code if isinstance(code, int) and code > 0 else 1
        if all(code == 0 for code in codes):
            return 0
        dead = cluster.dead_daemon()
        if dead is not None:
            print(f"{prog}: {dead.label} exited with status {dead.proc.returncode}; stopping", file=sys.stderr)
            return 1
        if deadline is not None and time.monotonic() > deadline:
            print(f"{prog}: ranks did not finish within {timeout:g} s; stopping", file=sys.stderr)
            return 1
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bps-launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.toml", help="cluster TOML file (default: configs/local.toml)")
    p.add_argument("--log-level", default="warning", help="daemons' log level (default: warning)")
    p.add_argument("--log-dir", default=None, help="write each daemon's log to DIR/<name>.log instead of stderr")
    p.add_argument("--timeline", default=None, metavar="DIR",
                   help="write Chrome-trace timelines of every daemon and rank into DIR (merge them with "
                        "`python -m bps_runtime.timeline merge OUT DIR/*.json`, open in https://ui.perfetto.dev)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="training command, after --")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no training command given (put it after --)")
    try:
        with Cluster(args.config, log_level=args.log_level, log_dir=args.log_dir,
                     timeline_dir=os.path.abspath(args.timeline) if args.timeline else None) as cluster:
            return run_training(cluster, command)
    except ConfigError as exc:
        print(f"bps-launch: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"bps-launch: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bps-launch: interrupted; cluster stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
