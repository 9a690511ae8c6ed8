"""bps_server.jobs: which workers' processes are of a later job than those whose end the server just heard."""

from __future__ import annotations

from bps_server.jobs import Jobs


def test_a_job_begun_on_one_machine_while_the_last_one_lingers_on_another_is_later_than_it():
    jobs = Jobs()
    jobs.ended(0, alive=[1], now=0.0)  # machine 0 left; its next job began beside machine 1
    assert jobs.pending
    spared = jobs.ended(1, alive=[0], now=0.0)  # machine 1's of the last job leaves
    assert spared({0})
    assert not spared({1}) and not spared({0, 1}) and not spared(set())  # (it pushed there: that job's)


def test_processes_that_met_are_one_job():
    """Machine 1's trainer of the next job began while machine 0's lived (the same job): once they summed a round
    together, the end of either spares nothing of the other's (a peer that dies mid-job fails the step at once)."""
    jobs = Jobs()
    jobs.ended(0, alive=[1], now=0.0)
    jobs.ended(1, alive=[0], now=0.0)
    jobs.met({0, 1})
    assert not jobs.pending
    assert not jobs.ended(0, alive=[1], now=0.0)({1})
    jobs = Jobs()
    jobs.ended(0, alive=[1], now=0.0)
    jobs.ended(1, alive=[0], now=0.0)  # (not met yet: machine 1's next trainer has summed nothing with machine 0's)
    assert jobs.ended(0, alive=[1], now=0.0)({1})


def test_the_processes_of_one_job_are_not_later_than_each_other():
    jobs = Jobs()
    spared = jobs.ended(2, alive=[0, 1], now=0.0)  # three machines began together; one of them dies
    assert not spared({0}) and not spared({0, 1})
    jobs.met({0, 1, 2})  # its new processes rejoined
    assert not jobs.ended(2, alive=[0, 1], now=0.0)({0, 1}) and not jobs.ended(0, alive=[], now=0.0)({1})
    assert Jobs().ended(0, alive=[], now=0.0)({1}) is False and not Jobs().pending


def test_the_relation_lasts_a_window_after_the_later_processes_began():
    """Past the window (the timeout) a round that waits for a machine without processes fails anyway (the sweep):
    a spare would only delay a real failure, e.g. on a server where the two jobs' processes never meet."""
    jobs = Jobs(window=10.0)
    jobs.ended(0, alive=[1], now=100.0)
    assert jobs.ended(1, alive=[0], now=109.0)({0})
    jobs = Jobs(window=10.0)
    jobs.ended(0, alive=[1], now=100.0)
    assert not jobs.ended(1, alive=[0], now=110.0)({0})
