"""bps_runtime.segments: reserved pages, a clear error when /dev/shm is full, dead daemons' segments reclaimed."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from bps_runtime import segments

REPO = Path(__file__).resolve().parents[2]


def test_a_new_segment_has_its_pages_reserved():
    """Not sparse: every page is backed when the segment is made (a sparse one SIGBUSes when /dev/shm fills)."""
    seg = segments.create_segment(segments.segment_name(901), (3 << 20) + 5)
    try:
        st = os.stat(os.path.join(segments.SHM_DIR, seg.name))
        assert st.st_size == seg.size
        assert st.st_blocks * 512 >= (3 << 20) + 5
    finally:
        segments.release(seg, unlink=True)


def test_the_segment_name_rule_is_one_rule():
    name = segments.segment_name(12)
    assert segments.owned_by(name, 12)
    assert not segments.owned_by(name, 1)
    assert not segments.owned_by("bps_w1_2_ab", 12)
    assert name.startswith(f"bps_w12_{os.getpid()}_")


def test_dead_daemons_segments_are_reclaimed_and_live_ones_kept(tmp_path: Path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    live_pid = os.getppid()  # alive for the whole test
    names = {
        f"bps_w3_{dead_pid}_0a1b2c": True,       # worker 3, dead creator: reclaimed
        f"bps_w3_{live_pid}_0a1b2c": False,      # worker 3, live creator
        f"bps_w3_{os.getpid()}_0a1b2c": False,   # our own
        f"bps_w4_{dead_pid}_0a1b2c": False,      # another worker's
        "unrelated_file": False,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    reclaimed = segments.reclaim_dead(3, str(tmp_path))
    assert reclaimed == [n for n, gone in names.items() if gone]
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, gone in names.items() if not gone)


def test_reclaim_ignores_a_missing_directory(tmp_path: Path):
    assert segments.reclaim_dead(0, str(tmp_path / "nope")) == []


SMALL_SHM = textwrap.dedent("""
    import errno, os, sys
    sys.path.insert(0, sys.argv[1])
    from bps_runtime import segments
    arena = segments.Arena(5)
    slot, _ = arena.alloc("fits", 2 << 20)
    try:
        arena.alloc("too-big", 20 << 20)
    except segments.SegmentSpaceError as exc:
        assert exc.errno == errno.ENOSPC and exc.nbytes == 20 << 20, exc
        print("refused:", exc)
    else:
        raise SystemExit("a 20 MiB segment was made in an 8 MiB /dev/shm")
    left = [n for n in os.listdir("/dev/shm") if n.startswith("bps_w5_")]
    assert len(left) == 1, left  # the refused segment was removed, the first one is intact
    arena.view(slot)[:] = b"\\1" * slot.capacity  # every page of the first one is backed: no SIGBUS
    arena.release_all()
    print("ok")
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_full_dev_shm_is_an_error_naming_the_size_not_a_sigbus():
    """A small /dev/shm (Docker's default is 64 MiB) in a private mount namespace."""
    script = (f"mount -t tmpfs -o size=8m tmpfs {segments.SHM_DIR} && "
              f"exec {sys.executable} -c '{SMALL_SHM}' {REPO}")
    result = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"no room for {20 << 20} bytes of shared memory in /dev/shm" in result.stdout, result.stdout
    assert result.stdout.strip().endswith("ok")


def test_an_empty_segment_is_an_oserror_naming_it():
    """A push naming a 0-byte segment must fail that push (OSError), not drop the link (ValueError from mmap)."""
    name = segments.segment_name(902)
    fd = os.open(os.path.join(segments.SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    try:
        with pytest.raises(OSError, match=f"shared memory '{name}' is empty"):
            segments.attach_segment(name)
    finally:
        os.unlink(os.path.join(segments.SHM_DIR, name))


def test_an_attach_maps_the_segment_without_telling_the_resource_tracker(monkeypatch: pytest.MonkeyPatch):
    """Processes started by one parent share its resource tracker: an attach that registered and unregistered
    each segment could interleave with a sibling's and make the tracker print a KeyError traceback. An attach
    sends it nothing; the mapping reads and writes the creator's bytes, and closes cleanly."""
    from multiprocessing import resource_tracker

    made = segments.create_segment(segments.segment_name(903), 4096)
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(resource_tracker, "register", lambda name, rtype: calls.append(("register", name)))
    monkeypatch.setattr(resource_tracker, "unregister", lambda name, rtype: calls.append(("unregister", name)))
    try:
        made.buf[:4] = b"bps!"
        seg = segments.attach_segment(made.name, owner_uid=os.getuid())
        assert calls == []
        assert seg.name == made.name and seg.size == made.size and bytes(seg.buf[:4]) == b"bps!"
        seg.buf[4:6] = b"ok"
        assert bytes(made.buf[4:6]) == b"ok"
        segments.release(seg, unlink=False)
        assert calls == [] and os.path.exists(os.path.join(segments.SHM_DIR, made.name))
    finally:
        monkeypatch.undo()
        segments.release(made, unlink=True)


def test_a_segment_is_stated_once_per_pass_of_the_event_loop_and_a_truncation_is_seen_at_the_next(
        monkeypatch: pytest.MonkeyPatch):
    """check_size reads a mapping's size at its first check in a pass of the loop; later checks in the pass (the
    pieces of one read name the same few segments) compare with it, the next pass reads it again. Off the event
    loop every check reads it."""

    stats: list[str] = []
    real_stat = os.stat

    def counting(path, *args, **kw):  # type: ignore[no-untyped-def]
        stats.append(str(path))
        return real_stat(path, *args, **kw)

    seg = segments.create_segment(segments.segment_name(903), 8192)
    other = segments.create_segment(segments.segment_name(903), 4096)
    monkeypatch.setattr(segments.os, "stat", counting)

    async def passes() -> None:
        for _ in range(3):
            segments.check_size(seg, 8192)
            segments.check_size(other, 100)
        assert len(stats) == 2  # one per mapping
        with pytest.raises(segments.SegmentSizeError, match="has 8192 bytes now; 9000 bytes are needed"):
            segments.check_size(seg, 9000)  # (compared with the size seen)
        os.truncate(os.path.join(segments.SHM_DIR, seg.name), 1024)  # a process shrinks it
        await asyncio.sleep(0)  # the next pass
        with pytest.raises(segments.SegmentSizeError, match="has 1024 bytes now; 8192 bytes are needed"):
            segments.check_size(seg, 8192)
        assert len(stats) == 3

    try:
        asyncio.run(passes())
        stats.clear()
        segments.check_size(other, 100)
        segments.check_size(other, 100)
        assert len(stats) == 2  # no loop: no pass to keep a size for
    finally:
        for s in (seg, other):
            s.close()
            s.unlink()


def _memo_seg(size: int = 8192):
    return segments.create_segment(segments.segment_name(904), size)


def _memo_drop(seg) -> None:
    seg.close()
    seg.unlink()


def test_a_check_off_the_loop_reads_the_size_even_while_the_loop_holds_a_memo():
    """The docstring: 'off the event loop every check reads it'. A thread's check while the loop thread is in a
    pass (after its own check of the mapping) is answered from the loop's memo: a truncation is missed."""
    seg = _memo_seg()
    errors: list[BaseException] = []

    def off_loop() -> None:
        try:
            segments.check_size(seg, 8192)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    async def main() -> None:
        segments.check_size(seg, 8192)  # the loop's check: memo 8192 for this pass
        os.truncate(os.path.join(segments.SHM_DIR, seg.name), 1024)
        t = threading.Thread(target=off_loop)
        t.start()
        t.join()  # (still in the same pass of the loop)

    try:
        asyncio.run(main())
        assert errors and isinstance(errors[0], segments.SegmentSizeError), "the thread's check missed the truncation"
    finally:
        _memo_drop(seg)


def test_the_memo_does_not_outlive_the_loop_that_kept_it():
    """A loop that stops in the pass of a check never runs the clear it scheduled (close() drops it): the memo
    then outlives every pass. From then on no clear is ever scheduled again (only the first entry schedules one),
    so every later check in the process, on any loop or thread, is answered from a size read once."""
    seg = _memo_seg()
    loop = asyncio.new_event_loop()
    try:
        loop.call_soon(loop.stop)
        loop.call_soon(segments.check_size, seg, 8192)  # the same pass as the stop
        loop.run_forever()
        loop.close()
        os.truncate(os.path.join(segments.SHM_DIR, seg.name), 1024)
        with pytest.raises(segments.SegmentSizeError):
            segments.check_size(seg, 8192)  # off any loop: must read the size
    finally:
        segments._pass.end_of_pass()
        _memo_drop(seg)
