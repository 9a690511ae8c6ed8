"""Chrome-trace timelines from the daemons (--timeline) and the ranks (BPS_TIMELINE)."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bps_runtime.timeline import Timeline, load, merge
from harness import write_config

REPO = Path(__file__).resolve().parents[2]
PROGRAM = """
import numpy as np, bps_worker.client as bps
bps.init()
for step in range(3):
    bps.push_pull(np.full(300_000, float(bps.rank()), np.float32), "w", average=False)
    bps.push_pull(np.ones(3, np.float32), "b")
bps.broadcast(np.ones(3, np.float32), 0, "bc")
bps.push_pull_group([np.ones(2, np.float32), np.ones(5, np.float32)], ["g1", "g2"])
rank, size = bps.rank(), bps.size()
bps.shutdown()
import os, time  # every process left before any starts again (see shutdown()'s docstring): a barrier of files
open(os.path.join(os.environ["BARRIER"], str(rank)), "w").close()
while len(os.listdir(os.environ["BARRIER"])) < size:
    time.sleep(0.005)
bps.init()
bps.push_pull(np.ones(3, np.float32), "again")
bps.shutdown()
"""


def test_a_trace_is_valid_json_even_if_its_writer_died(tmp_path):
    t = Timeline(str(tmp_path / "t.json"), "test")
    t.span("lane a", "work", 10, 30, bytes=4)
    t.flush()  # no close(): as if the process died here
    events = load(str(tmp_path / "t.json"))
    assert [e["name"] for e in events if e["ph"] == "X"] == ["work"]
    t.close()
    assert json.loads((tmp_path / "t.json").read_text())[-1] == {}


def test_a_timeline_opened_again_by_its_process_goes_on_where_it_ended(tmp_path):
    """shutdown() then init() opened the rank's timeline again with "w": everything traced before was lost."""
    path = str(tmp_path / "t.json")
    first = Timeline(path, "rank 0")
    first.span("a", "one", 10, 20)
    first.close()
    again = Timeline(path, "rank 0")
    again.span("a", "two", 30, 40)
    again.span("b", "three", 50, 60)
    again.close()
    events = json.loads(Path(path).read_text())  # strict JSON: the first close's end is gone
    spans = {e["name"]: e["tid"] for e in events if e.get("ph") == "X"}
    assert list(spans) == ["one", "two", "three"] and spans["one"] == spans["two"] != spans["three"]
    assert [e["args"]["name"] for e in events if e.get("name") == "thread_name"] == ["a", "b"]
    assert sum(e.get("name") == "process_name" for e in events) == 1 and events[-1] == {}
    again.span("late", "after close", 70, 80)  # (dropped, and its lane is not kept unnamed for the next opening)
    foreign = Timeline(str(tmp_path / "other.json"), "someone else")  # another trace written over ours...
    foreign.span("theirs", "x", 1, 2)
    foreign.close()
    os.replace(foreign.path, path)
    other = Timeline(path, "rank 0")  # ... is not gone on from: started over, named
    other.span("late", "four", 90, 95)
    other.close()
    events = json.loads(Path(path).read_text())
    assert [e["name"] for e in events if e.get("ph") in ("X", "M") and e["name"] != "thread_sort_index"] == \
        ["process_name", "thread_name", "four"]
    assert [e["args"]["name"] for e in events if e.get("ph") == "M" and "args" in e and "name" in e["args"]] == \
        ["rank 0", "late"]


def test_a_timeline_opened_by_a_relative_path_is_where_it_was_opened(tmp_path, monkeypatch, caplog):
    """A training script that changes directory after init(): close() looked for the file in the new one and
    warned that it could not write it (a review)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    t = Timeline("trace.json", "rank 0")
    t.span("lane", "one", 1, 2)
    monkeypatch.chdir(tmp_path / "b")
    with caplog.at_level("WARNING", logger="bps.timeline"):
        t.close()
        again = Timeline(str(tmp_path / "a" / "trace.json"), "rank 0")  # the same file: gone on from
        again.span("lane", "two", 3, 4)
        again.close()
    assert caplog.records == []
    assert [e["name"] for e in load(str(tmp_path / "a" / "trace.json")) if e["ph"] == "X"] == ["one", "two"]


def test_lanes_made_while_another_thread_closes_are_named_or_not_kept(tmp_path):
    """A lane was numbered outside the lock: a close() between its number and its name kept it for the next
    opening, where its spans had no name (a review; one run in a few)."""
    path = str(tmp_path / "t.json")
    for trial in range(40):
        if os.path.exists(path):
            os.remove(path)
        t = Timeline(path, "rank 0")
        stop = threading.Event()

        def spans(k: int, t: Timeline = t, stop: threading.Event = stop) -> None:
            i = 0
            while not stop.is_set():
                t.span(f"l{k}.{i}", "op", 1, 2)
                i += 1

        threads = [threading.Thread(target=spans, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        t.close()
        stop.set()
        for thread in threads:
            thread.join()
        again = Timeline(path, "rank 0")
        named = {e["tid"] for e in load(path) if e.get("name") == "thread_name"}
        assert set(again._lanes.values()) <= named, trial
        again.close()


def test_a_timeline_that_cannot_be_written_any_more_stops_with_one_warning(tmp_path, caplog):
    """A full disk or a size limit: the timer's thread and the exit printed tracebacks (a review)."""
    path = tmp_path / "t.json"
    t = Timeline(str(path), "rank 0")
    assert t._file is not None
    t._file.close()  # (what a failing write does: an OSError from write or flush)
    t._file = open("/dev/full", "w")
    with caplog.at_level("WARNING", logger="bps.timeline"):
        t.span("lane", "work", 1, 2)
        t.flush()
        t.span("lane", "more", 3, 4)  # nothing raised into the program
        t.close()
    assert [r.getMessage() for r in caplog.records] == \
        [f"timeline {path}: cannot write it (No space left on device); tracing stops"]
    with pytest.raises(OSError, match="cannot write the timeline /etc/hostname/t.json: /etc/hostname is not a "
                                      "directory"):
        Timeline("/etc/hostname/t.json", "x")


STALLED_WRITER = """
import os, signal, sys, time
from bps_runtime.timeline import Timeline
t = Timeline(sys.argv[1], "stalled")
t.span("lane", "only", 10, 20)
if sys.argv[2] == "raise":
    raise SystemExit("an exception, no close()")
time.sleep(2.5)  # a stalled job: nothing follows the last event (then killed)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["stall", "raise"])
def test_the_last_event_is_written_within_a_second_and_the_file_ends_at_exit(tmp_path, end):
    """The writer flushed only when a later event came a second after: a stalled job's trace lacked what it did
    last, and a program that ended by an exception (no shutdown()) left no spans at all (a review)."""
    path = tmp_path / "t.json"
    subprocess.run([sys.executable, "-c", STALLED_WRITER, str(path), end], timeout=30)
    assert [e["name"] for e in load(str(path)) if e["ph"] == "X"] == ["only"]
    if end == "raise":
        assert json.loads(path.read_text())[-1] == {}  # closed at exit: strict JSON


KILLED_WRITER = """
import os, signal, sys, time
from bps_runtime.timeline import Timeline
t = Timeline(sys.argv[1], "doomed")
for i in range(100):
    t.span("lane", "work", i * 10, i * 10 + 5)
time.sleep(1.2)
t.span("lane", "last", 2000, 2005)
time.sleep(1.5)  # (each event is written within a second: a timer)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(60)
def test_a_killed_writer_leaves_its_events_and_merge_reads_them(tmp_path):
    """A daemon killed (an OOM kill) used to leave an empty file: its events waited for 64 KiB, and merge then
    stopped at it with a JSONDecodeError. Now its events are written within a second, a last line cut short is
    skipped, a file that is no trace is skipped with a word, and the others are merged."""
    path = tmp_path / "doomed.json"
    subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path)], timeout=30)
    assert [e["name"] for e in load(str(path)) if e["ph"] == "X"] == ["work"] * 100 + ["last"]
    torn = tmp_path / "torn.json"
    torn.write_text(path.read_text() + '{"name":"cut sh')
    assert len(load(str(torn))) == len(load(str(path)))
    (tmp_path / "junk.json").write_text("not a trace")
    other = Timeline(str(tmp_path / "other.json"), "other")
    other.span("lane", "work", 1, 2)
    other.close()
    inputs = [str(path), str(tmp_path / "junk.json"), str(other.path)]
    count, skipped = merge(str(tmp_path / "all.json"), inputs)
    assert count == len(load(str(path))) + len(load(other.path)) and len(skipped) == 1 and "junk.json" in skipped[0]
    result = subprocess.run([sys.executable, "-m", "bps_runtime.timeline", "merge", str(tmp_path / "m.json"),
                             *inputs], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "skipped" in result.stderr and "from 2 files" in result.stdout


def test_a_trace_a_killed_writer_left_is_kept_when_the_next_run_opens_its_file(tmp_path, caplog):
    """A daemon killed, then restarted by its supervisor with the same ``--timeline``: the new run opened the file
    with "w" and the crash's trace was gone (a review: 54,965 events, then 1). Now it is moved aside first; a trace
    its writer ended (closed) is written over, as before."""
    path = tmp_path / "worker.json"
    subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path)], timeout=30)
    died = path.read_bytes()
    with caplog.at_level("WARNING", logger="bps.timeline"):
        again = Timeline(str(path), "restarted")
    again.span("lane", "new", 1, 2)
    again.close()
    [kept] = tmp_path.glob("worker.crashed-*.json")
    assert re.fullmatch(r"worker\.crashed-\d{8}T\d{6}\.json", kept.name) and kept.read_bytes() == died
    assert [e["name"] for e in load(str(kept)) if e["ph"] == "X"] == ["work"] * 100 + ["last"]
    assert [e["name"] for e in json.loads(path.read_text()) if e.get("ph") == "X"] == ["new"]
    assert f"kept as {kept}" in caplog.text
    subprocess.run([sys.executable, "-c", "import sys; from bps_runtime.timeline import Timeline; "
                    "Timeline(sys.argv[1], 'a third run').close()", str(path)], timeout=30, check=True, cwd=REPO)
    assert len(list(tmp_path.glob("worker.crashed-*.json"))) == 1
    assert [e for e in json.loads(path.read_text()) if e.get("ph") == "X"] == []
    # A crash loop: two more traces cut short within one second (the same stamp) are each kept, none over another.
    for _ in range(2):
        subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path)], timeout=30)
        os.utime(path, (kept.stat().st_mtime, kept.stat().st_mtime))
        Timeline(str(path), "restarted again").close()
    stamp = kept.name[len("worker.crashed-"):-len(".json")]
    assert {p.name for p in tmp_path.glob("worker.crashed-*.json")} == \
        {f"worker.crashed-{stamp}{n}.json" for n in ("", "-1", "-2")}
    assert all(len(load(str(p))) > 100 for p in tmp_path.glob("worker.crashed-*.json"))


def test_merge_keeps_processes_with_the_same_pid_apart(tmp_path, monkeypatch):
    """Two processes with one pid (the daemons of a pod's containers are each pid 1) used to share their lanes."""
    monkeypatch.setattr("os.getpid", lambda: 1)  # as in a container
    for name in ("server", "worker"):
        t = Timeline(str(tmp_path / f"{name}.json"), name)
        t.span(f"{name} lane", "work", 1, 2)
        t.close()
    merge(str(tmp_path / "all.json"), [str(tmp_path / "server.json"), str(tmp_path / "worker.json")])
    events = json.loads((tmp_path / "all.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "server (pid 1)", 2: "worker (pid 1)"}
    assert {e["pid"] for e in events if e["ph"] == "X"} == {1, 2}


@pytest.mark.timeout(120)
def test_launch_timeline_records_every_stage(tmp_path):
    config = write_config(tmp_path, [2, 1], cluster={"partition_bytes": 256 * 1024})
    out = tmp_path / "trace"
    (tmp_path / "barrier").mkdir()
    result = subprocess.run([sys.executable, "-m", "bps_worker.launch", "--config", str(config), "--timeline",
                             str(out), "--", sys.executable, "-c", PROGRAM], cwd=REPO, capture_output=True, text=True,
                            timeout=100, env={**os.environ, "BARRIER": str(tmp_path / "barrier")})
    assert result.returncode == 0, result.stderr
    files = sorted(p.name for p in out.iterdir())
    assert files == ["rank0.json", "rank1.json", "rank2.json", "server-0.json", "server-1.json", "server-2.json",
                     "worker-0.json", "worker-1.json"]
    merged = tmp_path / "all.json"
    count, skipped = merge(str(merged), [str(p) for p in sorted(out.iterdir())])
    events = json.loads(merged.read_text())["traceEvents"]
    assert count == len(events) and skipped == []
    assert len({e["pid"] for e in events}) == len(files)  # one process each
    processes = sorted(e["args"]["name"] for e in events if e["name"] == "process_name")
    assert [re.sub(r" \(pid \d+\)$", "", name) for name in processes] == [
        "bps-server 0", "bps-server 1", "bps-server 2", "bps-worker 0", "bps-worker 1", "rank 0", "rank 1", "rank 2"], \
        processes  # (each pid once: a rank's name held its pid already, and merge added it again)
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    # client: copy in / waiting / copy out; worker: local sum, per-partition queue/server/pull, hand-back;
    # server: each worker's add and the round.
    for stage in ("push_pull", "copy in", "worker daemon", "copy out", "local sum", "queued", "push, server sum",
                  "hand-back", "add worker 0", "add worker 1", "round 2", "broadcast", "push_pull_group"):
        assert stage in names, (stage, sorted(names))
    # each call is named as such on its lane (a broadcast and a group's were "push_pull" and nothing), and a
    # rank's second session (shutdown, init) goes on in its file: its first session's lanes are still there
    rank0 = json.loads((out / "rank0.json").read_text())
    calls = {(lanes[e["tid"]], e["name"]) for lanes in [{e["tid"]: e["args"]["name"] for e in rank0
                                                          if e.get("name") == "thread_name"}]
             for e in rank0 if e.get("ph") == "X" and e["name"] in ("push_pull", "broadcast", "push_pull_group")}
    assert calls == {("w", "push_pull"), ("b", "push_pull"), ("bc", "broadcast"), ("g1", "push_pull_group"),
                     ("g2", "push_pull_group"), ("again", "push_pull")}, calls
    # one box: every server shares the host, so sums come back through shared memory (no "pull" over TCP)
    assert all(e["args"]["shm"] for e in spans if e["name"] == "push, server sum")
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in spans)
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "w" in lanes and any(lane.startswith("w p") and "server" in lane for lane in lanes)


def test_merge_reads_its_own_output_and_keeps_its_processes_apart(tmp_path):
    """A merged file (Chrome's object form, merge's own) merged again with one more process: it was "not a trace
    file", and the output was overwritten with nothing (a review's case)."""
    for name in ("server", "worker", "rank"):
        t = Timeline(str(tmp_path / f"{name}.json"), name)
        t.span(f"{name} lane", "work", 1, 2)
        t.close()
    merge(str(tmp_path / "ab.json"), [str(tmp_path / "server.json"), str(tmp_path / "worker.json")])
    count, skipped = merge(str(tmp_path / "all.json"), [str(tmp_path / "ab.json"), str(tmp_path / "rank.json")])
    events = json.loads((tmp_path / "all.json").read_text())["traceEvents"]
    assert not skipped and count == len(events)
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    pid = os.getpid()
    assert names == {1: f"server (pid {pid})", 2: f"worker (pid {pid})", 3: f"rank (pid {pid})"}
    assert {e["pid"] for e in events if e["ph"] == "X"} == {1, 2, 3}
    before = (tmp_path / "all.json").read_text()
    count, skipped = merge(str(tmp_path / "all.json"), [str(tmp_path / "missing.json")])
    assert count == 0 and len(skipped) == 1 and (tmp_path / "all.json").read_text() == before  # (left as it was)
