"""systemd's notify protocol from real daemons, on a datagram socket of the test's as NOTIFY_SOCKET: READY=1,
STATUS= lines that say what each waits for, and WATCHDOG=1 every WATCHDOG_USEC/2 from the event loop (none while
the process is stopped)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from bps_worker.supervise import daemon_argv
from harness import write_config

WATCHDOG_USEC = 300_000  # pings every 0.15 s


class Notified:
    """A daemon started with our NOTIFY_SOCKET and a watchdog, and every datagram it sent us."""

    def __init__(self, tmp_path: Path, config: Path, module: str, watchdog: bool = True) -> None:
        path = tmp_path / f"notify-{module}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[tuple[float, str]] = []  # (when it came, what)
        self._next = 0  # of messages: the first that until() has not looked at
        env = dict(os.environ, NOTIFY_SOCKET=str(path))
        if watchdog:
            env["WATCHDOG_USEC"] = str(WATCHDOG_USEC)
        self.log = open(tmp_path / f"{module}.log", "w")
        self.proc = subprocess.Popen(daemon_argv([sys.executable, "-m", module], config, 0, log_level="info"),
                                     env=env, stderr=self.log)

    def read(self, seconds: float) -> list[str]:
        """What arrives within ``seconds`` (kept in ``messages`` too)."""
        got: list[str] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                got.append(self.sock.recv(4096).decode())
            except socket.timeout:
                break
        self.messages += [(time.monotonic(), m) for m in got]
        return got

    def until(self, want: Callable[[str], bool], timeout: float = 60.0) -> str:
        """The first message not looked at yet that is wanted (those before it are passed over)."""
        deadline = time.monotonic() + timeout
        while True:
            while self._next < len(self.messages):
                self._next += 1
                if want(self.messages[self._next - 1][1]):
                    return self.messages[self._next - 1][1]
            assert time.monotonic() < deadline, \
                f"nothing wanted came within {timeout} s; had {[m for _, m in self.messages if m != 'WATCHDOG=1']}"
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-3000:]
            self.read(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.sock.close()
        self.log.close()


@pytest.mark.timeout(120)
def test_status_lines_and_watchdog_pings_from_both_daemons(tmp_path):
    config = write_config(tmp_path, [1], cpu_servers=0)  # worker 0 and its colocated server 0
    worker = Notified(tmp_path, config, "bps_worker")
    server = None
    try:
        # The worker starts before its server: it says what it waits for, and is ready (it serves its socket).
        worker.until(lambda m: m == "STATUS=waiting for server 0")
        worker.until(lambda m: m == "READY=1")
        worker.read(0.2)
        pings = [m for m in worker.read(1.0) if m == "WATCHDOG=1"]
        assert 3 <= len(pings) <= 8, pings  # every 0.15 s (fewer where the machine is loaded, never more)
        server = Notified(tmp_path, config, "bps_server")
        server.until(lambda m: m == "READY=1")
        # the worker connects on its own (no push needed), and both say so
        worker.until(lambda m: m == "STATUS=connected to 1 server, 0 of 1 processes")
        server.until(lambda m: m == "STATUS=serving 1 of 1 workers")
        statuses = [m for _, m in server.messages if m.startswith("STATUS=")]
        assert statuses[0] == "STATUS=serving 0 of 1 workers, waiting for worker 0"  # its first beat: as it listens
        server.until(lambda m: m == "WATCHDOG=1")

        # A stopped process sends no ping (systemd would kill it after WatchdogSec); continued, it pings again.
        worker.proc.send_signal(signal.SIGSTOP)
        worker.read(0.2)  # what was sent before it stopped
        assert worker.read(1.0) == []
        worker.proc.send_signal(signal.SIGCONT)
        worker._next = len(worker.messages)
        worker.until(lambda m: m == "WATCHDOG=1", timeout=5)
        # Both stop on SIGTERM, though nobody read the server's notify socket for seconds: more pings than its
        # queue holds (net.unix.max_dgram_qlen, 10 by default). A blocking send there hung the server's stop.
        time.sleep(2.0)
        for daemon in (worker, server):
            daemon.proc.terminate()
            assert daemon.proc.wait(timeout=15) == 0, Path(daemon.log.name).read_text()[-3000:]
    finally:
        worker.close()
        if server is not None:
            server.close()


@pytest.mark.timeout(60)
def test_no_watchdog_pings_without_watchdog_usec(tmp_path):
    config = write_config(tmp_path, [1], cpu_servers=0)
    server = Notified(tmp_path, config, "bps_server", watchdog=False)
    try:
        server.until(lambda m: m == "READY=1")
        assert "WATCHDOG=1" not in server.read(1.0)
        assert any(m.startswith("STATUS=serving 0 of 1 workers") for _, m in server.messages)
    finally:
        server.close()
