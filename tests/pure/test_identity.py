"""A daemon's id from the scheduler's environment (bps_runtime.identity): the order, the offset, refusals."""

from __future__ import annotations

import pytest

from bps_runtime.identity import IdentityError, Resolved, daemon_id, resolve_id


def test_an_explicit_id_wins_and_reads_no_environment():
    assert daemon_id(3, {"BPS_ID": "not-a-number", "SLURM_NODEID": "x"}, "h") == Resolved(3, "--id")


def test_a_negative_explicit_id_is_refused():
    with pytest.raises(IdentityError, match="--id must be non-negative, got -1"):
        daemon_id(-1, {}, "h")


@pytest.mark.parametrize("env, expected", [
    ({"BPS_ID": "4"}, Resolved(4, "BPS_ID=4")),
    ({"BPS_ID": "4", "JOB_COMPLETION_INDEX": "1", "SLURM_NODEID": "2"}, Resolved(4, "BPS_ID=4")),
    ({"BPS_ID": "4", "BPS_ID_OFFSET": "2"}, Resolved(4, "BPS_ID=4")),  # an explicit id is the id itself
    ({"JOB_COMPLETION_INDEX": "1"}, Resolved(1, "JOB_COMPLETION_INDEX=1")),
    ({"JOB_COMPLETION_INDEX": "1", "BPS_ID_OFFSET": "2"}, Resolved(3, "JOB_COMPLETION_INDEX=1 + BPS_ID_OFFSET=2")),
    ({"SLURM_NODEID": "2", "SLURM_PROCID": "2"}, Resolved(2, "SLURM_NODEID=2")),
    ({"SLURM_NODEID": "2"}, Resolved(2, "SLURM_NODEID=2")),
    ({"SLURM_NODEID": "0", "BPS_ID_OFFSET": "3"}, Resolved(3, "SLURM_NODEID=0 + BPS_ID_OFFSET=3")),
    ({"JOB_COMPLETION_INDEX": "1", "SLURM_NODEID": "1"}, Resolved(1, "JOB_COMPLETION_INDEX=1")),
])
def test_the_first_variable_present_names_the_machine(env, expected):
    assert daemon_id(None, env, "node-9") == expected


@pytest.mark.parametrize("hostname, expected", [("bps-cpu-0", 0), ("bps-cpu-12", 12), ("a-1-7", 7)])
def test_bps_id_hostname_is_the_statefulset_ordinal(hostname, expected):
    assert resolve_id({"BPS_ID": "hostname"}, hostname) == Resolved(expected, f"BPS_ID=hostname ({hostname})")
    assert resolve_id({"BPS_ID": "hostname", "BPS_ID_OFFSET": "2"}, hostname).id == expected + 2


@pytest.mark.parametrize("env, hostname, message", [
    ({}, "h", "no --id given and none of BPS_ID, JOB_COMPLETION_INDEX, SLURM_NODEID is set"),
    ({"BPS_ID": "two"}, "h", "BPS_ID must be a non-negative integer, got 'two'"),
    ({"BPS_ID": "-1"}, "h", "BPS_ID must be a non-negative integer, got '-1'"),
    ({"JOB_COMPLETION_INDEX": ""}, "h", "JOB_COMPLETION_INDEX must be a non-negative integer, got ''"),
    ({"SLURM_NODEID": "1", "BPS_ID_OFFSET": "x"}, "h", "BPS_ID_OFFSET must be a non-negative integer, got 'x'"),
    ({"BPS_ID": "hostname"}, "worker", "BPS_ID=hostname, but the hostname 'worker' does not end in -N"),
    ({"SLURM_NODEID": "1", "SLURM_PROCID": "3"}, "h",
     "SLURM_PROCID=3 but SLURM_NODEID=1: this step runs several tasks on a node"),
    ({"JOB_COMPLETION_INDEX": "0", "SLURM_NODEID": "1"}, "h",
     "the environment names two machines: JOB_COMPLETION_INDEX=0 but SLURM_NODEID=1; pass --id or set BPS_ID"),
    ({"BPS_ID": "hostname", "JOB_COMPLETION_INDEX": "1"}, "pod-2", "BPS_ID=hostname (pod-2) but JOB_COMPLETION"),
])
def test_none_or_an_ambiguous_one_is_refused_naming_the_variables(env, hostname, message):
    with pytest.raises(IdentityError) as info:
        daemon_id(None, env, hostname)
    assert message in str(info.value)
