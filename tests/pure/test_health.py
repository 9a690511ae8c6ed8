"""The probes' decisions and systemd's watchdog settings, with the time passed in; the pulse's STATUS= and
WATCHDOG=1 on a datagram socket."""

from __future__ import annotations

import socket
import time

import pytest

from bps_runtime.health import Health, Pulse, Verdict, livez, readyz, watchdog_period, watchdog_seconds

READY = Verdict(None, "serving 2 of 2 workers")
WAITING = Verdict("not connected to server 2 at 10.0.0.5:9100", "waiting for server 2")


def _drain(sock: socket.socket) -> list[str]:
    """Every datagram waiting on the non-blocking ``sock``."""
    got = []
    while True:
        try:
            got.append(sock.recv(100).decode())
        except BlockingIOError:
            return got


def test_livez_passes_while_the_loop_beats_within_the_limit():
    assert livez(Health(100.0, READY), 100.0, 10.0) == (200, "ok")
    assert livez(Health(100.0, WAITING), 110.0, 10.0) == (200, "ok")  # liveness ignores readiness


def test_livez_fails_once_the_last_beat_is_older_than_the_limit():
    assert livez(Health(100.0, READY), 110.5, 10.0) == (503, "event loop stalled: last beat 10.5 s ago (limit 10 s)")
    assert livez(None, 0.0, 10.0) == (503, "event loop has not started its pulse")


def test_readyz_gives_the_daemons_reason():
    assert readyz(Health(5.0, READY), 6.0, 10.0) == (200, "ready")
    assert readyz(Health(5.0, WAITING), 6.0, 10.0) == (503, "not connected to server 2 at 10.0.0.5:9100")


def test_readyz_of_a_stalled_loop_is_the_stall_not_its_stale_verdict():
    assert readyz(Health(5.0, READY), 20.0, 10.0) == (503, "event loop stalled: last beat 15.0 s ago (limit 10 s)")
    assert readyz(None, 0.0, 10.0)[0] == 503


def test_watchdog_period_from_systemds_variables():
    assert watchdog_seconds(None, None, 42) is None
    assert watchdog_seconds("", None, 42) is None
    assert watchdog_seconds("30000000", None, 42) == 30.0
    assert watchdog_seconds("500000", "42", 42) == 0.5
    assert watchdog_seconds("500000", "43", 42) is None  # another process's watchdog (e.g. a wrapper's)


@pytest.mark.parametrize("usec, pid, message", [
    ("30s", None, "WATCHDOG_USEC must be a positive number of microseconds, got '30s'"),
    ("0", None, "WATCHDOG_USEC must be a positive number of microseconds, got '0'"),
    ("-5", None, "WATCHDOG_USEC must be a positive number of microseconds, got '-5'"),
    ("1000", "me", "WATCHDOG_PID must be a process id, got 'me'"),
])
def test_malformed_watchdog_variables_are_named(usec, pid, message):
    with pytest.raises(ValueError) as info:
        watchdog_seconds(usec, pid, 42)
    assert str(info.value) == message


def test_stall_limit_must_be_positive():
    assert watchdog_period(10.0, "2000000", None, 1) == 2.0
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"--stall-limit must be > 0 seconds, got"):
            watchdog_period(bad, None, None, 1)


def test_a_verdict_that_raises_is_not_ready_but_alive():
    def broken() -> Verdict:
        raise KeyError("links")

    pulse = Pulse(broken)
    pulse.beat()
    assert pulse.latest is not None
    assert livez(pulse.latest, pulse.latest.beat, 10.0) == (200, "ok")
    assert readyz(pulse.latest, pulse.latest.beat, 10.0) == (503, "internal error in the health verdict: KeyError('links')")


def test_status_is_sent_when_it_changes_and_pings_every_half_period(tmp_path):
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.setblocking(False)
        verdicts = iter([READY, READY, WAITING])
        pulse = Pulse(lambda: next(verdicts), notify_socket=path, watchdog_s=3600.0)
        assert pulse.interval_s == 1.0 and pulse.ping_every_s == 1800.0
        for _ in range(3):
            pulse.beat()
        got = _drain(sock)
    # one ping (the next is due in half an hour), and a STATUS line per change only
    assert got == ["STATUS=serving 2 of 2 workers", "WATCHDOG=1", "STATUS=waiting for server 2"]
    assert Pulse(lambda: READY, watchdog_s=0.4).ping_every_s is None  # no socket: nothing to ping
    assert Pulse(lambda: READY, notify_socket=path, watchdog_s=0.4).interval_s == 0.2


@pytest.mark.timeout(30)
def test_a_status_line_dropped_on_a_full_socket_goes_at_a_later_beat(tmp_path):
    """STATUS= is sent without waiting, so a full queue drops it (a reader behind: a busy manager, a test); the
    pulse sends the current line again at every beat until it went, not only at the next change."""
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.setblocking(False)
        verdicts = iter([WAITING] + [READY] * 3)
        pulse = Pulse(lambda: next(verdicts), notify_socket=path)  # no watchdog: STATUS= lines only
        pulse.beat()
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        filler.setblocking(False)
        fill = 0
        while True:  # the queue full
            try:
                filler.sendto(b"X", path)
                fill += 1
            except BlockingIOError:
                break
        filler.close()
        pulse.beat()  # the change to READY: dropped
        got = _drain(sock)
        assert got == ["STATUS=waiting for server 2"] + ["X"] * fill
        pulse.beat()  # room again: the line goes now, once
        pulse.beat()
        assert sock.recv(100).decode() == "STATUS=serving 2 of 2 workers"
        with pytest.raises(BlockingIOError):
            sock.recv(100)


@pytest.mark.timeout(30)
def test_a_notify_socket_nobody_reads_drops_messages_and_never_blocks(tmp_path, caplog, monkeypatch):
    """The queue of a datagram socket holds a few messages (net.unix.max_dgram_qlen); once it is full, a
    blocking send would freeze the daemon's loop (it hung a server's stop in test_systemd_notify)."""
    from bps_runtime import lifecycle
    from bps_runtime.lifecycle import sd_notify

    monkeypatch.setattr(lifecycle, "_notify_dropped", False)  # the first drop of this process: a warning
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sent = [sd_notify("WATCHDOG=1", path) for _ in range(2000)]
        assert sent[0] and not sent[-1]  # the first went, the last did not fit
        sock.setblocking(False)
        got = 0
        while True:
            try:
                assert sock.recv(100) == b"WATCHDOG=1"
                got += 1
            except BlockingIOError:
                break
        assert got == sent.count(True) and 0 < got < 2000
        assert sd_notify("STOPPING=1", path)  # room again: it goes
    assert "is full (its reader is behind): 'WATCHDOG=1' dropped" in caplog.text


@pytest.mark.timeout(30)
def test_ready_waits_for_room_in_the_notify_socket_and_gives_up_after_a_bound(tmp_path, monkeypatch):
    """READY=1 comes once and systemd acts on it: on a full queue it waits for the reader (which here takes
    a message out after 0.3 s) instead of being dropped at once; with nobody reading it gives up."""
    import threading

    from bps_runtime import lifecycle
    from bps_runtime.lifecycle import sd_notify

    monkeypatch.setattr(lifecycle, "NOTIFY_ONCE_WAIT_S", 3.0)
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        while sd_notify("WATCHDOG=1", path):  # fill the queue
            pass
        reader = threading.Timer(0.3, lambda: sock.recv(100))
        reader.start()
        start = time.monotonic()
        assert sd_notify("READY=1", path)
        assert 0.2 < time.monotonic() - start < 3.0
        reader.join()
        start = time.monotonic()
        assert not sd_notify("STOPPING=1", path)  # nobody reads now: dropped after the bound
        assert 2.9 < time.monotonic() - start < 15.0
