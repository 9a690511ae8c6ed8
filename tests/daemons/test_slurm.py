"""configs/slurm/bps.sbatch on a real Slurm: Debian's slurmctld, two slurmd and munged, all on this host.

The job is the script's heterogeneous form: component 0 (worker 0, its colocated server, 2 ranks) and
component 1 (one CPU-only server). Backfill, the only scheduler that starts het jobs, reserves whole nodes
for a component it plans, so two components never share one node (tried: OverSubscribe=YES and FORCE,
bf_hetjob_immediate). The host therefore runs two slurmd as two nodes (``slurmd -N``): one named after the
host, one ``localhost``; both names resolve here, as a real cluster's node names do.

Slurm is installed with apt-get where it is missing (root only); the test skips, saying why, only where
that cannot be done. Slow by nature: about 55 s for both jobs on a busy 2-core box once installed
(apt-get adds up to a minute); every daemon and the training import torch, numba and numpy.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bps_worker.cluster_file import free_ports
from protocol.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "configs" / "slurm" / "bps.sbatch"
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
PROGRAMS = ["slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel", "scontrol", "munged"]
JOB_TIMEOUT_S = 200


def install_slurm() -> str | None:
    """None once Slurm's programs are here; else why they cannot be (the skip message)."""
    if os.geteuid() != 0:  # and slurmd, which runs every job step as its user, must be root anyway
        return f"installing and running Slurm needs root (apt-get install {' '.join(PACKAGES)}; slurmd)"
    if all(shutil.which(p) for p in PROGRAMS):
        return None
    if not shutil.which("apt-get"):
        return "Slurm is not installed and there is no apt-get to install it"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        if done.returncode != 0:
            return f"cannot install Slurm: {' '.join(cmd)} exited {done.returncode}: {done.stderr[-500:]}"
    missing = [p for p in PROGRAMS if not shutil.which(p)]
    return f"Slurm installed but {missing} not found" if missing else None


def consecutive_free_ports(n: int) -> int:
    """A base port whose ``n`` ports from it were all free a moment ago (the script numbers ports from one base)."""
    for _ in range(100):
        base = random.randrange(20000, 40000)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


SLURM_CONF = """\
ClusterName=bpstest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.sock
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
# No cgroups: processes tracked by their parentage, tasks not bound, nothing accounted.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Het jobs are started by backfill only; every second instead of every 30 s.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
ReturnToService=2
SlurmdParameters=config_overrides
NodeName={host} NodeHostname={host} NodeAddr=127.0.0.1 Port={d0_port} CPUs=2 State=UNKNOWN
NodeName=localhost NodeHostname={host} NodeAddr=127.0.0.1 Port={d1_port} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={host},localhost Default=YES MaxTime=10 State=UP
"""


@dataclass
class Slurm:
    dir: Path
    env: dict[str, str]

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.dir / "log").glob("*")))


def start_slurm(directory: Path, procs: list[subprocess.Popen[bytes]]) -> Slurm:
    """munged, slurmctld and two slurmd in the foreground (``procs`` gets each as it starts)."""
    host = socket.gethostname().split(".")[0]
    socket.gethostbyname(host)  # the node's name must resolve, as on a real cluster
    directory.mkdir()
    for sub in ("munge", "state", "spool", "log"):
        (directory / sub).mkdir(mode=0o700)
    key = directory / "munge" / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o400)
    ctld_port, d0_port, d1_port = free_ports(3)
    conf = directory / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, dir=directory, ctld_port=ctld_port, d0_port=d0_port,
                                      d1_port=d1_port))
    env = dict(os.environ, SLURM_CONF=str(conf))
    munge = directory / "munge"

    def start(*cmd: str) -> None:
        with open(directory / "log" / f"{cmd[0]}-{len(procs)}.out", "wb") as out:
            procs.append(subprocess.Popen(list(cmd), env=env, stdout=out, stderr=out))

    start("munged", "-F", "-f", f"--socket={munge}/munge.sock", f"--key-file={key}",  # -f: root, under /tmp
          f"--pid-file={munge}/pid", f"--log-file={munge}/munged.log", f"--seed-file={munge}/seed")
    wait_until(lambda: (munge / "munge.sock").exists(), 10, "munged's socket")
    start("slurmctld", "-D", "-i", "-f", str(conf))
    for node in (host, "localhost"):
        start("slurmd", "-D", "-N", node, "-f", str(conf))
    slurm = Slurm(directory, env)

    def idle() -> bool:
        nodes = slurm.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")
        return sum(line.endswith(" idle") for line in nodes) == 2
    wait_until(idle, 60, "both nodes idle", slurm.logs)
    return slurm


def wait_until(ok: Callable[[], bool], timeout: float, what: str, explain: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout} s\n{explain()}")
        time.sleep(0.2)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(procs):  # slurmd before slurmctld before munged
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def slurm(host_network: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    reason = install_slurm()
    if reason:
        pytest.skip(reason)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        cluster = start_slurm(tmp_path_factory.mktemp("slurm") / "conf", procs)
        yield cluster
        cluster.run("scancel", "--user=root")
        wait_until(lambda: not cluster.run("squeue", "-h").stdout.strip(), 40, "jobs gone")
    finally:
        stop(procs)


@dataclass
class Job:
    status: int
    out: str
    dir: Path  # the script's BPS_JOB_DIR: cluster file, logs, the token while it runs


# Component sizes on the command line replace the script's (8 GPUs a node there; none here).
HET = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", ":",
       "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1"]
PLAIN = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]


def submit(slurm: Slurm, tmp_path: Path, script: Path, sizes: list[str], *command: str) -> Job:
    """``script`` as a job of ``sizes`` (1 node with 2 ranks, and 1 CPU-only node for HET), run to its end."""
    work = tmp_path / "submit"
    work.mkdir()
    env = dict(slurm.env, BPS_PYTHON=sys.executable, PYTHONPATH=str(ROOT),
               BPS_PORT=str(consecutive_free_ports(5)), BPS_SOCKET_DIR=str(tmp_path / "sock"))
    cmd = ["sbatch", "--parsable", "--output=job.out", *sizes, str(script), *command]
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=60)
    job_id = done.stdout.strip().split(";")[0]
    assert done.returncode == 0 and job_id.isdigit(), f"sbatch: {done.stdout} {done.stderr}"
    status = wait_for_job(slurm, job_id)
    out = (work / "job.out").read_text() if (work / "job.out").exists() else "(no job.out)"
    return Job(status, f"{done.stderr}\n{out}", work / f"bps-{job_id}")


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}


def wait_for_job(slurm: Slurm, job_id: str) -> int:
    """The exit status of job ``job_id``'s batch script once every component of it ended (``scontrol``, every
    0.2 s: ``sbatch --wait`` polls at 2 s, then 8 s, which cost each job here up to 8 s of nothing)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        shown = slurm.run("scontrol", "-o", "show", "job", job_id)
        records = [dict(field.split("=", 1) for field in line.split() if "=" in field)
                   for line in shown.stdout.splitlines() if line.strip()]
        if shown.returncode == 0 and records and all(r.get("JobState") in ENDED for r in records):
            first = next((r for r in records if r.get("HetJobOffset", "0") == "0"), records[0])
            code, signal_number = (int(n) for n in first["ExitCode"].split(":"))
            return code if not signal_number else 128 + signal_number
        time.sleep(0.2)
    pytest.fail(f"job {job_id} not done after {JOB_TIMEOUT_S} s\n{slurm.logs()}")


def assert_stopped_cleanly(job: Job, tmp_path: Path, daemons: list[str]) -> dict[str, str]:
    """Each of ``daemons`` stopped on SIGTERM, and the job's token and sockets are gone; the daemons' logs."""
    logs = {p.name.removesuffix(".log"): p.read_text() for p in (job.dir / "logs").iterdir()}
    assert sorted(logs) == daemons
    for name, text in logs.items():
        assert "stopping" in text, f"{name}:\n{text[-2000:]}"
    assert "a daemon step exited with status" not in job.out
    assert not (job.dir / "token").exists() and not (tmp_path / "sock").exists()
    return logs


@pytest.mark.timeout(420)  # apt-get on a fresh machine and Slurm's start, then the job (about 40 s)
def test_the_sbatch_script_trains_digits_on_a_het_job(slurm: Slurm, tmp_path: Path) -> None:
    job = submit(slurm, tmp_path, SCRIPT, HET,
                 sys.executable, str(ROOT / "examples" / "train_digits.py"), "--epochs", "1")
    assert job.status == 0, f"{job.out}\n{slurm.logs()}"
    assert "--- train_digits summary ---" in job.out
    assert "2 processes on 1 workers (2), 2 servers (1 CPU-only)" in job.out
    assert float(job.out.split("test accuracy:")[1].split()[0]) >= 0.85
    assert "bps: training exited with status 0" in job.out

    config = load_config(job.dir / "cluster.toml")  # the file the script wrote from the allocation
    assert [(s.id, s.worker) for s in config.servers] == [(0, 0), (1, None)]
    host = socket.gethostname().split(".")[0]
    assert {s.host for s in config.servers} == {host, "localhost"}
    assert [(w.id, w.local_size, w.socket) for w in config.worker_specs] == [
        (0, 2, f"{tmp_path}/sock/worker-0.sock")]
    logs = assert_stopped_cleanly(job, tmp_path, ["cpu-server-0", "server-0", "worker-0"])
    # No --id in the script: each daemon numbered itself from its step
    assert "server id 0, from SLURM_NODEID=0" in logs["server-0"]
    assert "worker id 0, from SLURM_NODEID=0" in logs["worker-0"]
    assert "server id 1, from SLURM_NODEID=0 + BPS_ID_OFFSET=1" in logs["cpu-server-0"]


@pytest.mark.timeout(240)
def test_a_plain_job_fails_with_its_training_and_still_stops_the_daemons(slurm: Slurm, tmp_path: Path) -> None:
    # The script without its second component: one node, no CPU-only server.
    lines = SCRIPT.read_text().splitlines(keepends=True)
    het = lines.index("#SBATCH hetjob\n")
    plain = tmp_path / "plain.sbatch"
    plain.write_text("".join(lines[:het] + lines[het + 2:]))
    job = submit(slurm, tmp_path, plain, PLAIN, sys.executable, "-c", "raise SystemExit(3)")
    assert job.status == 3, f"{job.out}\n{slurm.logs()}"
    assert "bps: 1 GPU machines" in job.out and "0 CPU-only (none)" in job.out
    assert "bps: every daemon is ready" in job.out and "bps: training exited with status 3" in job.out
    assert [s.worker for s in load_config(job.dir / "cluster.toml").servers] == [0]
    assert_stopped_cleanly(job, tmp_path, ["server-0", "worker-0"])
