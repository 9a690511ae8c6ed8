"""Real clusters for integration tests: config files with free ports, daemons, rank processes.

Nothing here is mocked: the daemons are the real ``bps-server``/``bps-worker``
processes, started by the launcher's supervision (``bps_worker.supervise.Cluster``)
on loopback and temporary Unix sockets in files of ``bps_worker.cluster_file``,
and every rank is a separate process using the real client library.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import BaseContext
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from bps_worker.cluster_file import free_ports, write_config
from bps_worker.observer import server_stats
from bps_worker.supervise import Cluster

__all__ = ["SHM_DIR", "daemon_logs", "free_ports", "rank_context", "restart_mid_run", "run_ranks",
           "run_through_restart", "server_stats", "shm_segments", "start_cluster", "wait_linked", "write_config"]

SHM_DIR = Path("/dev/shm")
# What every rank process imports, loaded once into the forkserver (see rank_context). Not the rank programs
# of tests/: pytest puts that directory on its own sys.path only, and a forkserver of Python 3.11 does not take
# its parent's path (each child does, and imports them itself: cheap once these are loaded). torch._dynamo: a
# process's first torch.optim optimizer imports it (torch 2.13), 1.5 CPU-s in every rank that made one; loaded
# here, the PyTorch tests' files took 72 CPU-s in all instead of 232 (benchmarks/RESULTS.md, session 51).
RANK_PRELOAD = ["numpy", "bps_worker.client", "torch", "torch.distributed", "torch.optim", "torch._dynamo",
                "bps_worker.torch"]


def rank_context() -> BaseContext:
    """The multiprocessing context of rank processes: ``forkserver``. Each rank is forked from one server
    process that imported the client library and torch once per test session (``RANK_PRELOAD``; nothing
    of them is initialised there). A spawned rank spent 0.4 CPU-s importing numpy and the client, 2.5 with
    torch, in every process of every test. The server is a clean single-threaded process, not pytest's
    (which runs the daemons' supervision threads). Its environment, and so every rank's, is pytest's when the
    session's first rank started: a variable set later does not reach the ranks."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def start_cluster(config_path: Path, log_dir: Path | None = None) -> Cluster:
    cluster = Cluster(str(config_path), log_level="info", log_dir=str(log_dir or config_path.parent / "logs"))
    cluster.start()
    return cluster


def wait_linked(cluster: Cluster, server: int, timeout: float = 30.0) -> None:
    """Wait until every worker daemon is connected to ``server``. The daemons are ready before their links
    are: a link whose first try met a server not yet listening connects at its next try, up to a second
    later. A test that speaks as a worker must wait, or its hello takes the id of one not yet connected."""
    deadline = time.monotonic() + timeout
    while (stats := server_stats(cluster, only=server)[server])["workers"] < len(cluster.config.worker_specs):
        assert time.monotonic() < deadline, f"the workers did not all connect to server {server}: {stats}"
        time.sleep(0.05)


def restart_mid_run(cluster: Cluster, victim: str, after_rounds: int, counter: str = "rounds_completed",
                    held: tuple[str, ...] = ("rounds_open",), ended: threading.Event | None = None
                    ) -> tuple[threading.Thread, threading.Event, list[BaseException]]:
    """A started thread that freezes server ``victim`` (SIGSTOP, so that pushes are surely in flight) once it
    completed ``after_rounds`` rounds (or its ``counter`` statistic reached that: ``async_deltas``) and, for
    rounds, holds something of the workers' (a statistic of ``held`` above 0: ``rounds_open``, rounds pushed to
    by a worker and not answered, what the workers must push again to the new server; ``fused_waiting``, fused
    names reported by some workers, what they must report again), kills it (-9) half a second later and
    restarts it, as systemd would; the event is set once restarted, the list holds what went wrong in the
    thread. Only the victim's statistics are asked for, every 10 ms.

    Frozen with fused names waiting and no round open, a job whose steps wait for those names pushes nothing
    more to the victim: a test that counts the partitions pushed again holds out for ``rounds_open``.
    ``ended``: set by the caller once its job is over; a thread still waiting to freeze then fails at once
    (what it saw last), instead of polling to its deadline."""
    restarted = threading.Event()
    failure: list[BaseException] = []
    ended = ended or threading.Event()  # never set: poll to the deadline

    def due(stats: dict[str, Any]) -> bool:
        return stats[counter] >= after_rounds and (counter != "rounds_completed" or any(stats[h] for h in held))

    def kill_and_restart() -> None:
        try:
            sid = int(victim.split("-")[1])
            deadline = time.monotonic() + 60
            while not due(stats := server_stats(cluster, only=sid)[sid]):  # well into the run, mid-round
                assert time.monotonic() < deadline, f"{victim} never was due to be frozen in 60 s: {stats}"
                if ended.wait(0.01):
                    raise AssertionError(f"the job ended before {victim} was due: {stats}")
            cluster.kill(victim, signal.SIGSTOP)
            time.sleep(0.5)
            cluster.kill(victim)
            time.sleep(0.3)  # systemd's RestartSec, shortened
            cluster.restart(victim)
            restarted.set()
        except BaseException as exc:  # reported by the test
            failure.append(exc)

    chaos = threading.Thread(target=kill_and_restart)
    chaos.start()
    return chaos, restarted, failure


def run_through_restart(cluster: Cluster, victim: str, after: int, counter: str, target: Callable[..., Any],
                        *args: Any, held: tuple[str, ...] = ("rounds_open",), **kwargs: Any
                        ) -> tuple[list[Any], str, dict[int, Any]]:
    """:func:`run_ranks` while :func:`restart_mid_run` kills and restarts ``victim``; the results, the daemons'
    logs and the servers' statistics. The cluster is stopped at the end, whatever happened."""
    ended = threading.Event()
    chaos, restarted, failure = restart_mid_run(cluster, victim, after, counter, held, ended)
    try:
        try:
            results = run_ranks(cluster, target, *args, **kwargs)
        finally:
            ended.set()
        chaos.join()
        logs = daemon_logs(cluster)
        stats = server_stats(cluster)
    finally:
        chaos.join()
        cluster.stop()
    assert not failure and restarted.is_set(), failure
    return results, logs, stats


def reap(procs: list[Any], timeout: float = 10.0) -> None:
    """Join rank processes started by hand (``_rank_main``), killing those still alive after ``timeout``."""
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()


def daemon_logs(cluster: Cluster) -> str:
    if not cluster.log_dir:
        return ""
    out = []
    for name in sorted(os.listdir(cluster.log_dir)):
        out.append(f"--- {name}\n" + Path(cluster.log_dir, name).read_text(errors="replace")[-4000:])
    return "\n".join(out)


def shm_segments(cluster: Cluster | None = None) -> set[str]:
    """Our shared-memory segments; with ``cluster``, only those its worker daemons created."""
    names = {p.name for p in SHM_DIR.iterdir() if p.name.startswith("bps_")}
    if cluster is None:
        return names
    pids = {str(c.proc.pid) for c in cluster.children if c.daemon and c.label.startswith("worker")}
    return {n for n in names if n.split("_")[2] in pids}


def _rank_main(queue: Any, sock: str, local_rank: int, rank: int, target: Callable[..., Any],
               args: tuple[Any, ...], client_timeout: float, settings: dict[str, str] | None = None,
               together: Any = None) -> None:
    import bps_worker.client as bps

    # ``settings``: the test's BPS_ variables as they were when it started the rank (a monkeypatch.setenv): the
    # forkserver's environment is pytest's when it started, and a test that had set BPS_FUSION_BYTES=0 then made
    # it every later test's (their small sums went unfused).
    if settings is not None:
        for key in [k for k in os.environ if k.startswith("BPS_")]:
            del os.environ[key]
        os.environ.update(settings)
    try:
        bps.init(socket=sock, local_rank=local_rank, timeout=client_timeout)
        if together is not None:
            together.wait(60)
        result = target(*args)
        queue.put((rank, "ok", result))
    except BaseException as exc:  # report everything to the test
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        bps.shutdown()


def collect_reports(queue: Any, want: set[int], timeout: float, cluster: Cluster, *,
                    allow_errors: bool = False) -> dict[int, Any]:
    """The reports of ranks ``want`` (as ``_rank_main`` puts them: each one's result, or with ``allow_errors`` its
    error's text), within ``timeout`` seconds; an error report, or one missing, fails the test with the daemons'
    logs."""
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while want - set(out):
        try:
            rank, status, value = queue.get(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            raise TimeoutError(f"ranks {sorted(want - set(out))} did not report\n{daemon_logs(cluster)}") from None
        assert status == "ok" or allow_errors, f"rank {rank}: {value}"
        out[rank] = value
    return out


def run_ranks(cluster: Cluster, target: Callable[..., Any], *args: Any, timeout: float = 60.0,
              per_rank_args: Callable[[int], tuple[Any, ...]] | None = None,
              may_die: frozenset[int] = frozenset(), client_timeout: float = 20.0,
              start_together: bool = False) -> list[Any]:
    """Run ``target(*args)`` in one process per rank (after ``init``); return the results in rank order.

    Ranks in ``may_die`` are expected to kill themselves; their result is None. ``start_together``: every rank
    waits for all to have connected before it starts: a test whose cluster ``timeout`` is short (1 s) fails its
    first round where one machine's processes start later than that (on a loaded box), as documented.
    """
    ctx = rank_context()
    queue = ctx.Queue()
    procs = []
    together = ctx.Barrier(sum(w.local_size for w in cluster.config.worker_specs)) if start_together else None
    settings = {k: v for k, v in os.environ.items() if k.startswith("BPS_")}
    for w in cluster.config.worker_specs:
        for local in range(w.local_size):
            rank = cluster.config.rank_offset(w.id) + local
            rank_args = per_rank_args(rank) if per_rank_args else args
            p = ctx.Process(target=_rank_main, args=(queue, cluster.socket_path(w.id), local, rank, target, rank_args,
                                                     client_timeout, settings, together), daemon=True)
            p.start()
            procs.append(p)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < len(procs) - len(may_die):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(len(procs))) - set(results) - set(errors))} did not "
                                   f"finish within {timeout:g} s\n{daemon_logs(cluster)}")
            try:
                rank, status, value = queue.get(timeout=min(remaining, 1.0))
            except Exception:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    raise RuntimeError(f"rank processes died without reporting\n{daemon_logs(cluster)}")
                continue
            (results if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("rank failures:\n" + "\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
                             + f"\n{daemon_logs(cluster)}")  # (what a failure seen once under load needs)
    return [results.get(r) for r in range(len(procs))]
