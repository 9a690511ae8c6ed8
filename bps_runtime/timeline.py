"""Timelines of what happened to each tensor, as Chrome-trace JSON (open in https://ui.perfetto.dev).

Both daemons (``--timeline FILE``) and the client library (``BPS_TIMELINE``) can
record one; each writes its own file, and ``python -m bps_runtime.timeline merge
OUT IN...`` puts several into one view (timestamps are wall-clock microseconds,
comparable across the processes of one host).

Lanes: one per tensor name for whole-tensor stages (the client's operation, the
worker's local sum and hand-back), one per partition for the stages of each
piece (worker: queued, push on the wire, waiting for the sum, pull; server:
receiving the round's pushes and summing, answering). A slow step shows as a
long bar; a gap between bars is time nobody worked on that tensor.

The file is written as it goes in the Trace Event "JSON Array Format", whose
closing bracket is optional, so a daemon that dies still leaves a readable trace: an event
is written at most ``FLUSH_S`` after it happened (a timer, also when nothing follows it: a
stalled job's trace shows what it did until the stall), and the file is closed at the
interpreter's exit (also one by an exception, without ``shutdown()``). A process that opens
its timeline again after closing it (``shutdown()``, then ``init()``) goes on in the same
file, on the same lanes, rather than starting it over. A process that opens a file that a
process which died left (it does not end as :meth:`Timeline.close` ends it: a daemon killed, then
restarted by its supervisor with the same ``--timeline``) first moves it aside, as
``NAME.crashed-YYYYmmddTHHMMSS.json`` (its last write's time), rather than write over the trace
of the crash.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import threading
import time
from typing import Any, BinaryIO, Final, TextIO

from .commands import say
from .locks import OwnedLock

# Bytes of events buffered before a write (a trace costs little when off and not much when on), and the longest
# an event waits to be written (so that a daemon killed, or an OOM kill, leaves what happened until then).
FLUSH_BYTES: Final = 1 << 16
FLUSH_S: Final = 1.0


def now_us() -> int:
    """Wall-clock time in microseconds: the same clock in every process of a host."""
    return time.time_ns() // 1000


# What :meth:`Timeline.close` writes last (an empty event keeps the array valid after the trailing comma).
_END: Final = "{}]\n"

# The timelines this process closed, by absolute path: (pid, their lanes, the file's identity as it left it:
# inode, size, modification time), so that one opened again goes on; a file changed since is started over.
_CLOSED: dict[str, tuple[int, dict[str, int], tuple[int, int, int]]] = {}

log = logging.getLogger("bps.timeline")


def _line(event: dict[str, Any]) -> str:
    """One event as the file holds it: compact JSON, a comma, a line of its own."""
    return json.dumps(event, separators=(",", ":")) + ",\n"


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class TimelineError(OSError):
    """The trace file cannot be made (its directory, or the file itself); says which and why."""

    def __init__(self, path: str, cause: OSError) -> None:
        reason = cause.strerror or str(cause)
        if isinstance(cause, FileExistsError):  # (os.makedirs: a component of the directory is a file)
            reason = f"{os.path.dirname(os.path.abspath(path))} is not a directory"
        super().__init__(cause.errno, reason)
        self.path = path

    def __str__(self) -> str:
        return f"cannot write the timeline {self.path}: {self.strerror}"


def _ends_closed(f: BinaryIO, size: int) -> bool:
    """Whether the trace open as ``f`` (``size`` bytes) ends as :meth:`Timeline.close` ends it."""
    end = _END.encode()
    return size >= len(end) and (f.seek(size - len(end)), f.read())[1] == end


def _keep_crashed(path: str) -> None:
    """Move aside the trace at ``path`` if a process that died left it (not ended by :meth:`Timeline.close`),
    under a name no other trace has (a crash loop leaves several within a second); one that cannot be read or
    moved is written over, as before, with a word in the log."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0 or _ends_closed(f, size):
                return
            stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(os.fstat(f.fileno()).st_mtime))
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("timeline %s cannot be read (%s): written over", path, exc.strerror or exc)
        return
    root, ext = os.path.splitext(path)
    for n in range(1000):
        kept = f"{root}.crashed-{stamp}{f'-{n}' if n else ''}{ext}"
        try:
            os.link(path, kept)  # (never over another: a rename would replace it)
        except FileExistsError:
            continue
        except OSError as exc:
            log.warning("timeline %s was left by a process that died; cannot keep it as %s (%s): written over",
                        path, kept, exc.strerror or exc)
            return
        try:
            os.unlink(path)  # (the new trace is a new file: opened with "w" here, it would empty the kept one)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(kept)
            log.warning("timeline %s was left by a process that died; cannot keep it (%s): written over", path,
                        exc.strerror or exc)
            return
        log.warning("timeline %s was left by a process that died: kept as %s", path, kept)
        return


class Timeline:
    """A trace file being written by one process; thread-safe. :class:`TimelineError` if it cannot be made."""

    def __init__(self, path: str, process: str) -> None:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._start(path, process)
        except OSError as exc:
            raise TimelineError(path, exc) from None
        atexit.register(self.close)

    def _start(self, path: str, process: str) -> None:
        self.path = os.path.abspath(path)  # (where it is, whatever the working directory later)
        self.pid = os.getpid()
        self._lock = OwnedLock()
        self._pending: list[str] = []
        self._pending_bytes = 0
        self._flushed_at = time.monotonic()
        self._timer: threading.Timer | None = None
        self._lanes: dict[str, int] = {}
        self._file: TextIO | None = self._reopen(self.path)
        if self._file is None:
            _keep_crashed(self.path)
            self._file = open(path, "w", encoding="utf-8")
            self._file.write("[\n")
            self._emit({"name": "process_name", "ph": "M", "pid": self.pid, "args": {"name": process}})
        self.flush()

    def _reopen(self, where: str) -> TextIO | None:
        """The file this process closed at ``where`` (its lanes kept), opened to go on after its last event;
        None if it closed none there, or the file is not as it left it."""
        closed = _CLOSED.pop(where, None)
        if closed is None or closed[0] != self.pid:
            return None
        try:
            with open(where, "rb+") as f:
                size = f.seek(0, os.SEEK_END)
                if _identity(os.fstat(f.fileno())) != closed[2] or not _ends_closed(f, size):
                    return None
                f.truncate(size - len(_END.encode()))
            reopened = open(where, "a", encoding="utf-8")
        except OSError:
            return None
        self._lanes = closed[1]
        return reopened

    def lane(self, name: str) -> int:
        """The thread id that shows as the lane called ``name``."""
        tid = self._lanes.get(name)
        if tid is not None:
            return tid
        with self._lock:  # (made and named at once: a close() meanwhile keeps no lane whose name was not written)
            tid = self._lanes.get(name)
            if tid is None and self._file is not None:
                tid = self._lanes[name] = len(self._lanes) + 1
                self._add_locked(_line({"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid,
                                        "args": {"name": name}}))
                self._add_locked(_line({"name": "thread_sort_index", "ph": "M", "pid": self.pid, "tid": tid,
                                        "args": {"sort_index": tid}}))
        return tid or 0

    def span(self, lane: str, name: str, start_us: int, end_us: int, **args: Any) -> None:
        """A bar called ``name`` from ``start_us`` to ``end_us`` in lane ``lane``."""
        event = {"name": name, "ph": "X", "ts": start_us, "dur": max(0, end_us - start_us), "pid": self.pid,
                 "tid": self.lane(lane)}
        if args:
            event["args"] = args
        self._emit(event)

    def _emit(self, event: dict[str, Any]) -> None:
        text = _line(event)
        with self._lock:
            self._add_locked(text)

    def _add_locked(self, text: str) -> None:
        """One event's line, written within FLUSH_S (under the lock); nothing once the file is closed."""
        if self._file is not None:
            self._pending.append(text)
            self._pending_bytes += len(text)
            if self._pending_bytes >= FLUSH_BYTES or time.monotonic() - self._flushed_at >= FLUSH_S:
                self._flush_locked()
            elif self._timer is None:  # written within FLUSH_S even if no event follows
                self._timer = threading.Timer(FLUSH_S, self._flush_due)
                self._timer.daemon = True
                self._timer.start()

    def _flush_due(self) -> None:
        with self._lock:
            self._timer = None
            self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._file is not None and self._pending:
            try:
                self._file.write("".join(self._pending))
                self._file.flush()
            except OSError as exc:  # (a full disk, a size limit): the trace ends here, the program goes on
                self._give_up(exc)
        self._pending.clear()
        self._pending_bytes = 0
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        """Write what is pending and end the file (a valid JSON array); once (also called at exit). A forked
        child's exit leaves its parent's file alone."""
        atexit.unregister(self.close)
        if os.getpid() != self.pid:
            return
        if self._lock.mine():
            # A signal handler's shutdown() that interrupted this thread inside a span (its lock held): at exit, then.
            atexit.register(self.close)
            return
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._flush_locked()
            if self._file is not None:
                try:
                    self._file.write(_END)
                    self._file.close()
                    identity = _identity(os.stat(self.path))
                except OSError as exc:
                    self._give_up(exc)
                    return
                self._file = None
                _CLOSED[os.path.abspath(self.path)] = (self.pid, dict(self._lanes), identity)

    def _give_up(self, exc: OSError) -> None:
        """Stop tracing after a write failed (under the lock): one warning, and nothing raised into the program."""
        log.warning("timeline %s: cannot write it (%s); tracing stops", self.path, exc.strerror or exc)
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass


def load(path: str) -> list[dict[str, Any]]:
    """The events of a trace file, also of one whose writer died before closing it: what it had written, up to
    a last event cut short (one per line, as :class:`Timeline` writes them), or of a merged one (Chrome's object
    form, ``{"traceEvents": [...]}``, as :func:`merge` writes it); ValueError if it is no trace."""
    return _read(path)[0]


def _read(path: str) -> tuple[list[dict[str, Any]], bool]:
    """:func:`load`'s events, and whether the file is a merged one (its process names say their pids already)."""
    text = open(path, encoding="utf-8").read().rstrip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
            raise ValueError(f"{path} is not a trace file (a JSON array of events, or an object of traceEvents)")
        return [e for e in data["traceEvents"] if isinstance(e, dict) and e], True
    return _read_array(path, text), False


def _read_array(path: str, text: str) -> list[dict[str, Any]]:
    """The events of a trace in :class:`Timeline`'s array form (see :func:`load`)."""
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    try:
        return [e for e in json.loads(text) if e]
    except json.JSONDecodeError:
        pass
    lines = text.splitlines()
    if not lines or lines[0].strip() not in ("[", "[]", "]"):
        raise ValueError(f"{path} is not a trace file (a JSON array of events)")
    events = []
    for n, line in enumerate(lines[1:], 2):
        line = line.strip().rstrip("]").rstrip(",")
        if not line:
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines):
                raise ValueError(f"{path}, line {n}: not a trace event") from None
    return [e for e in events if e]


def merge(out: str, inputs: list[str]) -> tuple[int, list[str]]:
    """Write the events of ``inputs`` into ``out``; (the number of events, one problem per input skipped).

    Each process gets a pid of its own (in the order of the inputs, from 1), and a process file's name says the
    pid it had. Processes in containers often have the same pid (1 in a pod's containers), and two processes with
    one pid would share their lanes. A merged file (an earlier ``all.json``) keeps its processes apart as they were.
    Nothing is written where every input was skipped (a typo must not empty an earlier merge)."""
    events: list[dict[str, Any]] = []
    skipped = []
    pids = 0
    for path in inputs:
        try:
            loaded, merged = _read(path)
        except (OSError, ValueError) as exc:
            skipped.append(f"{path}: {exc}")
            continue
        mine: dict[Any, int] = {}
        for event in loaded:
            pid = mine.get(event.get("pid"))
            if pid is None:
                pids += 1
                pid = mine[event.get("pid")] = pids
            if (not merged and event.get("name") == "process_name" and isinstance(event.get("args"), dict)
                    and "pid" in event):
                event["args"] = dict(event["args"], name=f"{event['args'].get('name', '')} (pid {event['pid']})")
            event["pid"] = pid
        events.extend(loaded)
    if inputs and len(skipped) == len(inputs):
        return 0, skipped
    with open(out, "w", encoding="utf-8") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)
    return len(events), skipped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bps_runtime.timeline", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge trace files into one (for Perfetto)")
    m.add_argument("out")
    m.add_argument("inputs", nargs="+")
    args = p.parse_args(argv)
    count, skipped = merge(args.out, args.inputs)
    for problem in skipped:
        say(f"skipped {problem}")
    print(f"{args.out}: {count} events from {len(args.inputs) - len(skipped)} files")
    return 1 if skipped and len(skipped) == len(args.inputs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
