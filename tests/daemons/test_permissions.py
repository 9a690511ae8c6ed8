"""The worker daemon's socket and shared-memory segments get the permissions its command line asks for."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from harness import SHM_DIR, write_config

PY = sys.executable
CLIENT = """
import sys, numpy as np, bps_worker.client as bps
bps.init(socket=sys.argv[1], local_rank=0)
bps.push_pull(np.ones(1 << 20, np.float32), "big")     # a segment of its own, staging and result buffers
bps.push_pull(np.ones(10, np.float32), "small")        # a slab
print("pushed", flush=True)
sys.stdin.readline()
bps.shutdown()
"""


def _ready(tmp_path: Path, name: str) -> tuple[socket.socket, str]:
    path = str(tmp_path / name)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    return sock, path


@pytest.mark.timeout(90)
@pytest.mark.parametrize("socket_mode,shm_mode", [("600", "600"), ("660", "640")])
def test_socket_and_segments_have_the_configured_modes(tmp_path, socket_mode, shm_mode):
    config = write_config(tmp_path, [1], cpu_servers=0)
    notify, notify_path = _ready(tmp_path, "notify")
    env = dict(os.environ, NOTIFY_SOCKET=notify_path)
    server = subprocess.Popen([PY, "-m", "bps_server", "--config", str(config), "--id", "0"], env=env,
                              stderr=subprocess.DEVNULL)
    worker = subprocess.Popen([PY, "-m", "bps_worker", "--config", str(config), "--id", "0", "--socket-mode",
                               socket_mode, "--shm-mode", shm_mode], env=env, stderr=subprocess.DEVNULL)
    client = None
    try:
        ready = 0
        while ready < 2:  # both daemons; STATUS= lines come too
            ready += notify.recv(4096) == b"READY=1"
        sock_path = tmp_path / "w0.sock"
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == int(socket_mode, 8)
        client = subprocess.Popen([PY, "-c", CLIENT, str(sock_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        assert client.stdout.readline().strip() == "pushed"
        segments = [p for p in SHM_DIR.iterdir() if p.name.startswith(f"bps_w0_{worker.pid}_")]
        assert len(segments) >= 4, segments  # the client's two, staging, results
        for seg in segments:
            assert stat.S_IMODE(seg.stat().st_mode) == int(shm_mode, 8), seg
            assert seg.stat().st_uid == os.getuid()
        client.stdin.write("\n")
        client.stdin.flush()
        assert client.wait(timeout=20) == 0
    finally:
        for proc in (client, worker, server):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=15)
        notify.close()
    assert not [p for p in SHM_DIR.iterdir() if p.name.startswith(f"bps_w0_{worker.pid}_")]
