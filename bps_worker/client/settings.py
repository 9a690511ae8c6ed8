"""The client's settings, resolved once by ``init()`` from its arguments and the environment's defaults.

:func:`resolve` is pure: ``init()`` passes it ``os.environ`` (the one place the client reads the environment),
tests pass a dict. An argument given to ``init()`` wins over the environment:

==================  =========================================  ==============================================
setting             environment default                        meaning
==================  =========================================  ==============================================
``socket``          ``BPS_SOCKET``                             the worker daemon's Unix socket
``local_rank``      ``BPS_LOCAL_RANK``, else ``LOCAL_RANK``    this process's rank on its machine (torchrun
                                                               sets ``LOCAL_RANK``)
``timeline``        ``BPS_TIMELINE``                           a directory (``DIR/rank<N>.json``) or
                                                               ``FILE.json`` (``FILE.rank<N>.json``) for the
                                                               process's Chrome trace; unset: none
``cuda_ipc``        ``BPS_CUDA_IPC`` (``0`` turns it off)      CUDA tensors reach the daemon through CUDA IPC
                                                               (else through host copies)
``fusion_bytes``    ``BPS_FUSION_BYTES`` (64 MiB)              small sums issued close together go to the
                                                               daemon as one message once this many bytes
                                                               wait (``0``: each alone, no fusion)
``cycle_time_ms``   ``BPS_CYCLE_TIME_MS`` (1)                  ... or once the first waited this long (a
                                                               synchronize sends at once)
``job``             ``BPS_JOB`` (``bps-launch`` sets one)      the job this process belongs to, the same on
                                                               every machine of it: a job's asynchronous
                                                               values are its own (another job's async_init
                                                               begins them anew); empty: not known
==================  =========================================  ==============================================
"""

from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass
from typing import Final, Mapping

from protocol.messages import MAX_JOB_CHARS

from ..errors import BPSError

__all__ = ["DEFAULT_TIMEOUT_S", "Settings", "job_from", "resolve", "timeline_path"]

DEFAULT_TIMEOUT_S: Final = 30.0
DEFAULT_FUSION_BYTES: Final = 64 << 20  # as Horovod's fusion threshold
DEFAULT_CYCLE_TIME_MS: Final = 1.0  # as Horovod's cycle time


@dataclass(frozen=True, slots=True)
class Settings:
    """What ``init()`` was asked for, with every default filled in."""

    socket: str
    local_rank: int
    timeout: float  # seconds: the daemon's appearance, its answers, its silence while an operation is pending
    timeline: str | None = None
    cuda_ipc: bool = True
    fusion_bytes: int = DEFAULT_FUSION_BYTES
    cycle_time_ms: float = DEFAULT_CYCLE_TIME_MS
    job: str = ""


def resolve(socket: str | None, local_rank: int | None, timeout: float, timeline: str | None,
            cuda_ipc: bool | None, environ: Mapping[str, str], fusion_bytes: int | None = None,
            cycle_time_ms: float | None = None) -> Settings:
    """The settings from ``init()``'s arguments, each missing one from ``environ``; BPSError naming what is
    missing or malformed."""
    path = socket or environ.get("BPS_SOCKET")
    if not path:
        raise BPSError("no worker socket: pass init(socket=...) or set BPS_SOCKET")
    if local_rank is None:
        text = environ.get("BPS_LOCAL_RANK", environ.get("LOCAL_RANK"))
        if text is None:
            raise BPSError("no local rank: pass init(local_rank=...) or set BPS_LOCAL_RANK or LOCAL_RANK")
        try:
            local_rank = int(text)
        except ValueError:
            raise BPSError(f"local rank must be an integer, got {text!r}") from None
    elif isinstance(local_rank, bool):
        raise BPSError(f"local rank must be an integer, got {local_rank!r}")
    else:
        try:  # any integer type, numpy's too (it failed the handshake's type check: no BPSError, a socket left open)
            local_rank = operator.index(local_rank)
        except TypeError:
            raise BPSError(f"local rank must be an integer, got {local_rank!r}") from None
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < math.inf:
        raise BPSError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if timeline is None:
        timeline = environ.get("BPS_TIMELINE") or None
    if cuda_ipc is None:
        cuda_ipc = environ.get("BPS_CUDA_IPC", "1") != "0"
    fusion = _number("fusion_bytes", fusion_bytes, environ, "BPS_FUSION_BYTES", DEFAULT_FUSION_BYTES, int)
    cycle = _number("cycle_time_ms", cycle_time_ms, environ, "BPS_CYCLE_TIME_MS", DEFAULT_CYCLE_TIME_MS, float)
    return Settings(path, local_rank, float(timeout), timeline, bool(cuda_ipc), int(fusion), float(cycle),
                    job_from(environ))


def job_from(environ: Mapping[str, str]) -> str:
    """The job this process belongs to (``BPS_JOB``); "" where none is named.

    Only a name that every machine of the job is given: not torchrun's run id, which a single-node torchrun on
    each machine (this project's way of starting a machine's processes) makes at random, a different job on
    every machine (a review's find); nor Slurm's ids (a heterogeneous job's components have their own, and the
    daemons of the Slurm recipe end with their allocation anyway)."""
    job = environ.get("BPS_JOB", "")
    if len(job) > MAX_JOB_CHARS:
        raise BPSError(f"BPS_JOB is {len(job)} characters; at most {MAX_JOB_CHARS}")
    return job


def _number(what: str, value: float | None, environ: Mapping[str, str], variable: str, default: float,
            kind: type) -> float:
    """A finite, non-negative setting: the argument, else the environment's, else ``default``."""
    source = what
    if value is None:
        text = environ.get(variable)
        if text is None:
            return default
        source = variable
        try:
            value = kind(text)
        except ValueError:
            raise BPSError(f"{variable} must be a non-negative {kind.__name__}, got {text!r}") from None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf \
            or (kind is int and value != int(value)):
        raise BPSError(f"{source} must be a non-negative {kind.__name__}, got {value!r}")
    return value


def timeline_directory(target: str) -> str:
    """Made now if need be, the directory where ``init(timeline=target)`` will write this process's trace (its
    name needs the rank, which the daemon says): BPSError naming it where it cannot be made or written to. Checked
    before connecting: a process that connects and then leaves fails every round its peers opened meanwhile."""
    where = os.path.dirname(os.path.abspath(target)) if target.endswith(".json") else target
    try:
        os.makedirs(where, exist_ok=True)
    except OSError as exc:
        raise BPSError(f"cannot write the timeline in {where!r}: {exc.strerror or exc}") from None
    if not os.access(where, os.W_OK | os.X_OK):
        raise BPSError(f"cannot write the timeline in {where!r}: permission denied")
    return where


def timeline_path(target: str, rank: int) -> str:
    """Where rank ``rank`` writes its trace: ``FILE.json`` is numbered, anything else is a directory."""
    return f"{target[:-5]}.rank{rank}.json" if target.endswith(".json") else os.path.join(target, f"rank{rank}.json")
