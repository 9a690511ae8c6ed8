"""A daemon's ``--id`` when the command line leaves it out: taken from the scheduler that started it.

Schedulers already number the machines of a job; a unit file or pod spec should not have to. The order,
first present wins:

1. ``BPS_ID``: an integer (the id itself), or ``hostname``: the trailing ``-N`` of the host's name, a
   StatefulSet pod's ordinal (``bps-cpu-3`` -> 3).
2. ``JOB_COMPLETION_INDEX``: a Kubernetes indexed Job's pod index.
3. ``SLURM_NODEID``: the node's index in a Slurm job step. One daemon per node: where the step runs several
   tasks on a node (``SLURM_PROCID`` differs from ``SLURM_NODEID``) the index does not say which daemon a task
   is, and that is refused.

``BPS_ID_OFFSET`` (default 0) is added to every index that is not an explicit integer ``BPS_ID``, so that a
second set of machines numbered from 0 by its scheduler (CPU-only servers in their own Job, StatefulSet or
het-job component) maps onto the ids after the first set's.

A scheduler index also present beside the one used (a pod of an indexed Job inside a Slurm allocation)
must give the same id, or neither is trusted. Everything here is pure: the caller passes the environment and
the host's name, and gets the id with a one-line account of where it came from, or an :class:`IdentityError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Mapping

__all__ = ["ENV_ORDER", "IdentityError", "Resolved", "daemon_id", "resolve_id"]

ENV_ORDER: Final = ("BPS_ID", "JOB_COMPLETION_INDEX", "SLURM_NODEID")
OFFSET_VAR: Final = "BPS_ID_OFFSET"
_ORDINAL: Final = re.compile(r"-(\d+)$")


class IdentityError(ValueError):
    """No id, or one that cannot be trusted; the message is the one line the daemon prints (exit 2)."""


@dataclass(frozen=True)
class Resolved:
    """The id and where it came from, e.g. ``JOB_COMPLETION_INDEX=1 + BPS_ID_OFFSET=2``."""

    id: int
    source: str


def _index(var: str, text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise IdentityError(f"{var} must be a non-negative integer, got {text!r}")
    return int(text)


def _from_hostname(hostname: str) -> tuple[int, str]:
    match = _ORDINAL.search(hostname)
    if match is None:
        raise IdentityError(f"BPS_ID=hostname, but the hostname {hostname!r} does not end in -N "
                            "(a StatefulSet ordinal)")
    return int(match.group(1)), f"BPS_ID=hostname ({hostname})"


def _scheduler_indexes(env: Mapping[str, str]) -> list[tuple[int, str]]:
    """Every scheduler index present, in :data:`ENV_ORDER`."""
    found: list[tuple[int, str]] = []
    if "JOB_COMPLETION_INDEX" in env:
        value = _index("JOB_COMPLETION_INDEX", env["JOB_COMPLETION_INDEX"])
        found.append((value, f"JOB_COMPLETION_INDEX={value}"))
    if "SLURM_NODEID" in env:
        node = _index("SLURM_NODEID", env["SLURM_NODEID"])
        proc = env.get("SLURM_PROCID")
        if proc is not None and _index("SLURM_PROCID", proc) != node:
            raise IdentityError(f"SLURM_PROCID={proc} but SLURM_NODEID={node}: this step runs several tasks on "
                                "a node, so the node's index names no single daemon; start one per node "
                                "(srun --ntasks-per-node=1) or set BPS_ID")
        found.append((node, f"SLURM_NODEID={node}"))
    return found


def resolve_id(env: Mapping[str, str], hostname: str) -> Resolved:
    """The daemon's id from ``env`` (see the module); :class:`IdentityError` where there is none or two."""
    offset = _index(OFFSET_VAR, env[OFFSET_VAR]) if OFFSET_VAR in env else 0
    explicit = env.get("BPS_ID")
    if explicit is not None and explicit != "hostname":
        value = _index("BPS_ID", explicit)
        return Resolved(value, f"BPS_ID={value}")
    indexes = _scheduler_indexes(env)
    if explicit == "hostname":
        indexes.insert(0, _from_hostname(hostname))
    if not indexes:
        raise IdentityError(f"no --id given and none of {', '.join(ENV_ORDER)} is set")
    value, source = indexes[0]
    for other, other_source in indexes[1:]:
        if other != value:
            raise IdentityError(f"no --id given and the environment names two machines: {source} but "
                                f"{other_source}; pass --id or set BPS_ID")
    if offset:
        return Resolved(value + offset, f"{source} + {OFFSET_VAR}={offset}")
    return Resolved(value, source)


def daemon_id(given: int | None, env: Mapping[str, str], hostname: str) -> Resolved:
    """``--id`` when the command line gave one (the environment is then not read), else :func:`resolve_id`."""
    if given is not None:
        if given < 0:
            raise IdentityError(f"--id must be non-negative, got {given}")
        return Resolved(given, "--id")
    return resolve_id(env, hostname)
