"""Operations of one process: start (fill the name's slot, send the Op), finish (wait, hand the result back).

:class:`Operations` is the state behind ``import bps_worker.client as bps``: the :class:`Connection`, the
:class:`SlotMap`, the table of names in flight (a name is pushed at most once at a time per process) and the
process's timeline. Framework layers reach it through :mod:`bps_worker.client.adapter`.

The timeline (``init(timeline=...)``, default ``BPS_TIMELINE``) records each operation's spans: the whole,
copy in, the daemon's part, copy out.

An operation's life: ``start_filled`` gets the name's slot, lets the caller write the input straight into it,
and submits the ``Op``; the reader thread completes the :class:`Handle`; ``finish`` waits for it and returns
``out``, a copy of the result, or (``view``) the shared memory that holds it.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import operator
import os
import threading
import time
import weakref
from collections import Counter
from functools import partial
from math import prod
from typing import Any, Callable, Final, Iterable, NamedTuple, Sequence, SupportsIndex

import numpy as np
import numpy.typing as npt

from protocol.messages import (ASYNC_KINDS, KIND_ASYNC, KIND_ASYNC_INIT, KIND_BROADCAST, KIND_SUM, MAX_LAYOUT_CHARS, Op,
                               Spec)

from bps_runtime.timeline import Timeline, now_us

from ..errors import BPSError, BPSTimeoutError
from .arguments import (INPUT_PREFIX, check_average, check_dtype, check_layout, check_name, check_out,
                        check_priority, check_shape, check_staleness)
from . import group
from .arrays import NUMPY_DTYPES, same_memory, view_of
from .connection import Connection
from .fusion import Entry, FusionBuffer
from .handle import Handle, checked
from .settings import Settings, timeline_directory, timeline_path
from .slots import Slot, SlotMap

__all__ = ["Checked", "Fill", "Operations"]

# Writes an operation's input into the view of its shared slot (framework layers assemble inputs in place).
Fill = Callable[[np.ndarray], None]
# Argument sets whose checks are remembered (Operations._checked): a model's tensors, many times over.
MAX_CHECKED = 1 << 16
# The most names whose mode (synchronous or asynchronous) the process keeps: past it, the quarter of them that it
# fixed first are forgotten (names that never repeat kept an entry each for good, a review). A name forgotten is
# fixed again at its next use; the daemons still refuse a name used both ways across the job (but for one only
# ever packed in a push_pull_group), and a delta before its name's init (their own words then).
MAX_MODES = 1 << 18


class Checked(NamedTuple):
    """An operation's arguments, checked (:meth:`Operations.checked`), and what follows from them."""

    name: str
    dtype: np.dtype
    wire: str  # the dtype's name on the wire
    shape: tuple[int, ...]
    average: bool
    priority: int
    layout: str
    nbytes: int
    spec: Spec  # (wire, shape, average, layout): the operation in an OpBatch


# The timeline's name for an operation of each kind: the call that starts it.
_CALLS: Final = {KIND_SUM: "push_pull", KIND_BROADCAST: "broadcast", KIND_ASYNC_INIT: "async_init",
                 KIND_ASYNC: "async_push_pull"}

# push_pull_group sends its small sums in batches of this many as it copies them in, so that the daemon's work
# overlaps the copying of the rest (one batch at the end would leave the daemon idle until then).
GROUP_SEND_EVERY = 256


def _timeline(path: str, rank: int) -> Timeline:
    """The process's timeline file (``init(timeline=...)``); BPSError naming the path if it cannot be made."""
    where = timeline_path(path, rank)
    try:
        return Timeline(where, f"rank {rank}")  # (merge adds the pid to every process's name)
    except OSError as exc:
        raise BPSError(f"cannot write the timeline {where!r}: {exc.strerror or exc}") from None


class Operations:
    """The process's connection to its worker daemon and its operations (one per process)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pid = os.getpid()  # the process that connected (a fork of it cannot use the connection)
        if settings.timeline is not None:
            timeline_directory(settings.timeline)
        self.conn = Connection(settings.socket, settings.local_rank, settings.timeout, settings.job)
        try:
            self._set_up(settings)
        except BaseException:  # the daemon must not keep this local rank connected: init() may be retried
            self.conn.close()
            raise

    def _set_up(self, settings: Settings) -> None:
        self.timeout = settings.timeout
        welcome = self.conn.welcome
        self.rank, self.size = welcome.rank, welcome.size
        self.local_rank, self.local_size = welcome.local_rank, welcome.local_size
        self.worker = welcome.worker
        self.lock = threading.Lock()  # guards inflight
        self.inflight: dict[str, Handle] = {}
        # push_pull_group's agreements in flight, and how stall notices should name them (client.group).
        self.group_votes: dict[str, str] = {}
        # Each name's mode in this process (True: asynchronous), fixed by its first use: a name is either
        # synchronous or asynchronous for the life of a job (the daemons check it across processes too).
        self.modes: dict[str, bool] = {}
        self._modes_forgotten = False  # some were (MAX_MODES): an unknown name's delta may have had its init
        # Names in flight keep their slots when others are given up for room (cluster.arena_bytes).
        # Names whose slot was handed out (shared_array) and not pushed since: the slot may be being filled in
        # place (a framework's gradient bucket, then start_filled with no fill), so it is never given up either.
        self.handed_out: set[str] = set()
        # Names given out by the user's shared_array, with how many of those arrays are alive: the user's array
        # is that memory, which the same name gives again while the size fits (its docstring). Held while one
        # lives (given up for room after its first sum, a second shared_array gave new, zeroed memory, a
        # review). An array's end appends its name to ``_released`` (a finalizer may run in any thread, at any
        # allocation: a list's append, no lock), which ``_pins`` drains.
        self.pinned: Counter[str] = Counter()
        self._released: list[str] = []
        self._pin_lock = threading.Lock()
        self._input_of: dict[str, str] = {}  # the slot of our own that a shared array's fused sum reads -> its name
        self.slots = SlotMap(self.conn.allocate, welcome.arena_bytes, self._holds)
        self.conn.describe_notice = partial(group.described, self.group_votes)
        self.conn.map_result = self.slots.result_segment
        self.conn.mapped_result = self.slots.results.get
        self.timeline = None if settings.timeline is None else _timeline(settings.timeline, self.rank)
        # Small sums wait here to go with others in one OpBatch (bps_worker.client.fusion); the daemon says
        # how small (0: an older daemon, or fusion off).
        self._known: dict[tuple[Any, ...], Checked] = {}
        self.fuse_max = welcome.fusion_bytes if settings.fusion_bytes > 0 else 0
        self.fusion = FusionBuffer(self.conn.submit_many, settings.fusion_bytes, settings.cycle_time_ms / 1000.0) \
            if self.fuse_max else None

    # -- starting --------------------------------------------------------------------
    def check_root(self, root_rank: object) -> int:
        """``root_rank`` as an int, if it names a process of the cluster (any integer type, as numpy's; not a bool)."""
        try:
            root = operator.index(root_rank)  # type: ignore[arg-type]
        except TypeError:
            root = -1
        if isinstance(root_rank, bool) or not 0 <= root < self.size:
            raise BPSError(f"root_rank must be an integer in 0..{self.size - 1}, got {root_rank!r}")
        return root

    def start_broadcast_bytes(self, raw: np.ndarray, name: str, root: int, what: str) -> Handle:
        """Start a broadcast of the bytes ``raw`` (1-d uint8) as whole int32 words, zero-padded: a dtype the wire
        does not carry (bool, the small and unsigned integers, complex, float8, records, another byte order)
        travels bit for bit, where a cast would wrap or drop its parts. ``what`` (its dtype and shape) is the
        operation's layout: a process whose array differs gets a mismatch naming both. The result is the words;
        :func:`.arrays.bytes_of` reads the bytes back."""
        nbytes = raw.size

        def fill(view: np.ndarray) -> None:
            into = view.view(np.uint8)
            into[:nbytes] = raw
            into[nbytes:] = 0

        what = f"bytes of {what}"
        if len(what) > MAX_LAYOUT_CHARS:  # (a record dtype's description, a long shape)
            what = f"bytes of {hashlib.blake2b(what.encode(), digest_size=12).hexdigest()}"
        return self._start(name, KIND_BROADCAST, np.dtype(np.int32), ((nbytes + 3) // 4,), fill, False, 0, root,
                           None, what, -1, False)

    def start_async_init(self, array: np.ndarray, name: str, root_rank: int, staleness: int | None) -> Handle:
        """Start ``async_init`` (see :func:`bps_worker.client.async_init`)."""
        return self.start(array, name, KIND_ASYNC_INIT, average=False, priority=0, root=self.check_root(root_rank),
                          out=None, staleness=check_staleness(staleness))

    def start_async(self, delta: np.ndarray, name: str) -> Handle:
        """Start ``async_push_pull`` (see :func:`bps_worker.client.async_push_pull`)."""
        return self.start(delta, name, KIND_ASYNC, average=False, priority=0, root=-1, out=None)

    def claim_mode(self, name: str, kind: str) -> None:
        """Fix ``name``'s mode on its first use; BPSError for the other mode, or a delta before its init."""
        asynchronous = kind in ASYNC_KINDS
        mode = self.modes.get(name)
        if mode is None:
            if asynchronous and kind != KIND_ASYNC_INIT:
                if not self._modes_forgotten:
                    raise BPSError(f"tensor {name!r}: async_push_pull before async_init; call async_init first")
                return  # (its mode may be among those forgotten: the daemon judges, and nothing is fixed here on
                #        a delta it may refuse, which left the name unusable synchronously, a review)
            self.modes[name] = asynchronous
            if len(self.modes) > MAX_MODES:
                self._forget_modes()
        elif mode != asynchronous:
            used, now = ("asynchronously", "synchronously") if mode else ("synchronously", "asynchronously")
            raise BPSError(f"tensor {name!r} was used {used} in this process and now {now}; a name is either "
                           f"synchronous or asynchronous for the life of a job")

    def _forget_modes(self) -> None:
        """Forget the modes this process fixed first, a quarter of MAX_MODES of them (from then on a delta of a
        name it knows no mode of goes to the daemon, which refuses it if it has no init). Every mode may go, so
        each walk frees a quarter: one walk per MAX_MODES // 4 new names."""
        for name in list(self.modes)[:MAX_MODES // 4]:  # (a copy: other threads may fix modes meanwhile)
            self.modes.pop(name, None)
        self._modes_forgotten = True

    def start(self, array: np.ndarray, name: str, kind: str, *, average: bool, priority: int, root: int,
              out: np.ndarray | None, staleness: int = -1, internal: bool = False, waited: bool = False) -> Handle:
        """Copy ``array`` into its slot (unless it is the slot: a shared array) and start the operation;
        ``waited``: the caller synchronizes it at once (a small sum is sent now, not left for the cycle)."""
        array = np.asarray(array)
        return self._start(name, kind, array.dtype, array.shape, array, average, priority, root, out, "", staleness,
                           internal, waited)

    def shared_array(self, name: str, shape: Iterable[SupportsIndex] | SupportsIndex, dtype: npt.DTypeLike, *,
                     pinned: bool = True) -> np.ndarray:
        """The slot of ``name`` as an array of ``shape`` and ``dtype`` (see ``bps.shared_array``): held while the
        array (or a view of it) lives (``pinned``), or until the name is next pushed (a framework's slot filled in
        place each step)."""
        name = check_name(name)
        dtype, _ = check_dtype(dtype)
        shape = check_shape(name, shape, dtype)
        with self.lock:
            self._check_free(name)
            self.handed_out.add(name)  # (before slot_for: no other thread gives it up from now on)
            if pinned:
                with self._pin_lock:
                    self.pinned[name] += 1
        try:
            slot = self.slots.slot_for(name, prod(shape) * dtype.itemsize)
        except BaseException:
            if pinned:
                self._released.append(name)
            raise
        array = view_of(slot.segment.buf, dtype, shape, slot.offset)  # the user's own array (see Slot.view)
        if pinned:
            weakref.finalize(array, self._released.append, name)  # (its views keep it alive)
        return array

    def _pins(self, name: str) -> bool:
        """Whether a shared array of ``name`` is alive (the ended ones counted out first)."""
        with self._pin_lock:
            while self._released:
                ended = self._released.pop()
                self.pinned[ended] -= 1
                if self.pinned[ended] <= 0:
                    del self.pinned[ended]
            return name in self.pinned

    def _holds(self, name: str) -> bool:
        """Whether ``name``'s slot must stay where it is (SlotMap's ``busy``): in flight (but for an operation
        a failed group gave up, once it ended: see :meth:`_check_free`), handed out and not pushed since, or
        pinned (a shared array of it is alive). A copy's slot of a shared array (:meth:`_fill`) is held while its name is in
        flight."""
        held = self.inflight.get(self._input_of.get(name, name))
        return (held is not None and not (held.abandoned and held.done())) or name in self.handed_out \
            or self._pins(name)

    def _fill(self, name: str, nbytes: int, dtype: np.dtype, shape: tuple[int, ...], source: np.ndarray | Fill,
              out: np.ndarray | None, fused: bool) -> tuple[Slot, np.ndarray, bool]:
        """The slot the operation reads, with its input in it (copied, unless the input is the slot itself; or
        ``source(view)``), that slot's view, and whether the sum goes to ``out`` in place (``out`` is the slot).

        A fused sum comes back into the slot it read (the daemon hands every fused sum back). Where that slot is
        the name's shared array and the sum is not wanted there, the input goes through a slot of our own
        instead (``INPUT_PREFIX``): a shared array passed without ``out`` is left unchanged, as any input. So does
        a part of it (a slice: copied into the slot, it was written over by its own copy, then by the sum)."""
        slot = self.slots.slot_for(name, nbytes)
        view = slot.view(dtype, shape)
        in_place = out is not None and same_memory(view, out)
        if not isinstance(source, np.ndarray):
            source(view)
        elif not same_memory(view, source):
            if np.may_share_memory(view, source):  # a part of the name's shared array, not the slot: a copy into
                # it wrote over it. The sum then comes into the copy's slot, not into ``out`` (were it the shared
                # array): it is copied there, as into any out (it came back unchanged, a review's case).
                return self._input_copy(name, nbytes, dtype, shape, source) + (False,)
            view[...] = source  # np.copyto's dispatch costs more than this copy of a small tensor
        elif fused and not in_place:
            return self._input_copy(name, nbytes, dtype, shape, source) + (in_place,)
        return slot, view, in_place

    def _input_copy(self, name: str, nbytes: int, dtype: np.dtype, shape: tuple[int, ...], source: np.ndarray
                    ) -> tuple[Slot, np.ndarray]:
        """``source`` copied into a slot of our own for ``name`` (see :meth:`_fill`), and that slot's view."""
        key = INPUT_PREFIX + hashlib.blake2b(name.encode(), digest_size=16).hexdigest()
        self._input_of[key] = name
        slot = self.slots.slot_for(key, nbytes)
        view = slot.view(dtype, shape)
        view[...] = source
        return slot, view

    def start_filled(self, name: str, kind: str, dtype: np.dtype, shape: tuple[int, ...], fill: Fill, *,
                     average: bool, priority: int, root: int, out: np.ndarray | None, layout: str = "",
                     staleness: int = -1, internal: bool = False) -> Handle:
        """Start an operation whose input ``fill(view)`` writes straight into the shared slot.

        Framework layers use it to assemble an input in place (no staging copy), and give a fused tensor its
        ``layout`` (``Op.layout``). Every argument is checked before the slot is touched (:mod:`.arguments`);
        ``internal``: the name may be one of the client's own (``arguments.GROUP_PREFIX``).
        """
        return self._start(name, kind, dtype, shape, fill, average, priority, root, out, layout, staleness, internal)

    def _start(self, name: Any, kind: str, dtype: Any, shape: Any, source: np.ndarray | Fill, average: Any,
               priority: Any, root: int, out: np.ndarray | None, layout: Any, staleness: int, internal: bool,
               waited: bool = False) -> Handle:
        """:meth:`start` (``source`` an array, copied into the slot unless it is the slot) and
        :meth:`start_filled` (``source`` a :data:`Fill`)."""
        name, dtype, wire, shape, average, priority, layout, nbytes, spec = self._checked(
            name, dtype, shape, average, priority, layout, internal)
        out = check_out(name, out, shape, dtype)
        if self.modes.get(name) is not (kind in ASYNC_KINDS):
            self.claim_mode(name, kind)
        handle = Handle(self.conn.next_req(), name, dtype, shape, out)
        self._reserve(handle)
        try:
            t_start = now_us() if self.timeline is not None else 0
            fused = self.fusion is not None and kind == KIND_SUM and nbytes <= self.fuse_max
            slot, handle.view, handle.in_place = self._fill(name, nbytes, dtype, shape, source, out, fused)
            if self.timeline is not None:
                handle.times = [t_start, now_us(), 0]
                handle.call = _CALLS.get(kind, kind)
            if fused:
                assert self.fusion is not None
                handle.queued = True
                self.fusion.add(handle, spec, slot.segment_name, slot.offset, priority, nbytes, now=waited)
                return handle
            self.conn.submit(handle, Op(handle.req, name, kind, wire, list(shape), slot.segment_name,
                                        average=average, priority=priority, root=root, offset=slot.offset,
                                        handback=handle.in_place, layout=layout, staleness=staleness))
        except BaseException:
            self._unreserve(handle)
            raise
        return handle

    def start_group(self, arrays: Sequence[Any], names: Sequence[Any], *, average: bool, priority: int
                    ) -> list[Handle]:
        """Start summing every ``arrays[i]`` as ``names[i]``: the path of :meth:`start`, once for the group.

        Every argument is checked and every name claimed (one lock) before any slot is touched, so a bad entry
        or a name in flight starts nothing. The small sums go to the fusion buffer together and are sent at
        once; the others go as their own ``Op``. A failure part-way (a slot that cannot be had) waits for those
        already sent, so that no name of the group stays in flight, and raises.
        """
        if len(arrays) != len(names):
            raise BPSError(f"push_pull_group: {len(arrays)} arrays but {len(names)} names")
        prepared = []
        for array, name in zip(arrays, names):
            array = np.asarray(array)
            checked = self._checked(name, array.dtype, array.shape, average, priority, "")
            if self.modes.get(checked[0]) is not False:
                self.claim_mode(checked[0], KIND_SUM)
            prepared.append((array, checked, Handle(self.conn.next_req(), checked[0], checked[1], checked[3], None)))
        handles = [h for _, _, h in prepared]
        self._reserve_all(handles)
        sent = 0
        try:
            queued: list[Entry] = []
            for array, (name, dtype, wire, shape, avg, prio, layout, nbytes, spec), handle in prepared:
                t_start = now_us() if self.timeline is not None else 0
                fused = self.fusion is not None and nbytes <= self.fuse_max
                slot, handle.view, _ = self._fill(name, nbytes, dtype, shape, array, None, fused)
                if self.timeline is not None:
                    handle.times, handle.call = [t_start, now_us(), 0], "push_pull_group"
                if fused:
                    assert self.fusion is not None
                    handle.queued = True
                    queued.append((handle, spec, slot.segment_name, slot.offset, prio))
                    if len(queued) == GROUP_SEND_EVERY:  # the daemon starts on these while we copy the next
                        self.fusion.add_many(queued)
                        queued = []
                else:
                    self.conn.submit(handle, Op(handle.req, name, KIND_SUM, wire, list(shape), slot.segment_name,
                                                average=avg, priority=prio, offset=slot.offset, handback=False))
                sent += 1
            if queued:
                assert self.fusion is not None
                self.fusion.add_many(queued)
        except BaseException:
            unsent = [entry[0] for entry in queued]  # copied in, never handed to the fusion buffer: not sent
            for handle in handles[sent:] + unsent:
                handle.queued = False
                self._unreserve(handle)
            if self.fusion is not None:
                self.fusion.flush()
            self._settle([h for h in handles[:sent] if not any(h is u for u in unsent)])
            raise
        return handles

    def finish_group(self, handles: list[Handle]) -> list[np.ndarray]:
        """Every handle's result (copies), in order; once all ended, the first failure is raised (the other
        names of the group still completed, and none stays in flight)."""
        if self.fusion is not None:
            self.fusion.flush()
        results: list[np.ndarray] = []
        first: BaseException | None = None
        for handle in handles:
            try:
                results.append(self.finish(handle, None))
            except BPSError as exc:
                first = first or exc
        if first is not None:
            raise first
        return results

    def _settle(self, handles: list[Handle], within: float | None = None) -> None:
        """Wait, within one timeout (or ``within`` seconds) for them all, for operations that were sent, and forget
        them, whatever they ended in. One that has not ended by then is given up (``abandoned``): nobody will
        synchronize it, so its name is free again once it ends (:meth:`_check_free`)."""
        limit = self.timeout if within is None else within
        deadline = None if limit is None else time.monotonic() + limit
        for handle in handles:
            if handle.wait(None if deadline is None else deadline - time.monotonic()):
                try:
                    self.finish(handle, 0)
                except BPSError:
                    pass
            else:
                handle.abandoned = True

    def checked(self, name: Any, dtype: Any, shape: Any, average: Any, priority: Any) -> Checked:
        """A sum's arguments checked, as :meth:`start` checks them; BPSError naming the first that is wrong."""
        return self._checked(name, dtype, shape, average, priority, "")

    def _checked(self, name: Any, dtype: Any, shape: Any, average: Any, priority: Any, layout: Any,
                 internal: bool = False) -> Checked:
        """The arguments checked (:mod:`.arguments`). The same arguments again (every step, for every tensor)
        are checked once: their answer is kept (for up to MAX_CHECKED argument sets)."""
        try:
            # (with the types: 1.0 == 1 and True == 1 hash alike, and a refused priority=1.0 or shape (3.0,) was
            # taken once priority=1 or shape (3,) had been checked; a shape that is no tuple is checked each time)
            key = (name, type(name), dtype, shape, tuple(map(type, shape)), average, type(average), priority,
                   type(priority), layout, internal) if type(shape) is tuple else None
            known = None if key is None else self._known.get(key)
        except TypeError:  # an unhashable argument: checked every time
            key, known = None, None
        if known is not None:
            return known
        name = check_name(name, internal=internal)
        dtype, wire = check_dtype(dtype)
        shape = check_shape(name, shape, dtype)
        average = check_average(name, average, wire)
        priority = check_priority(name, priority)
        layout = check_layout(name, layout)
        checked = Checked(name, dtype, wire, shape, average, priority, layout, prod(shape) * dtype.itemsize,
                          (wire, shape, average, layout))
        if key is not None and len(self._known) < MAX_CHECKED:
            self._known[key] = checked
        return checked

    def start_cuda(self, name: str, kind: str, wire: str, shape: tuple[int, ...], description: list[Any], *,
                   average: bool, priority: int, root: int) -> Handle:
        """Start an operation on a CUDA tensor that the daemon opens through CUDA IPC and writes in place
        (``description`` from :func:`bps_runtime.cuda.describe`); its result is the tensor itself."""
        name = check_name(name)
        self.claim_mode(name, kind)
        if wire not in NUMPY_DTYPES:
            raise BPSError(f"tensor {name!r}: unsupported wire dtype {wire!r}; supported: {', '.join(NUMPY_DTYPES)}")
        shape = check_shape(name, shape, NUMPY_DTYPES[wire])
        average = check_average(name, average, wire)
        priority = check_priority(name, priority)
        handle = Handle(self.conn.next_req(), name, NUMPY_DTYPES[wire], shape, None, in_place=True)
        self._reserve(handle)
        try:
            self.conn.submit(handle, Op(handle.req, name, kind, wire, list(shape), "", average=average,
                                        priority=priority, root=root, cuda=description))
        except BaseException:
            self._unreserve(handle)
            raise
        return handle

    def _reserve(self, handle: Handle) -> None:
        """Claim ``handle``'s name for it, before its slot is touched: one operation per name at a time in this
        process, whichever thread starts it (a second thread would overwrite the first one's input in the
        shared slot, and each would read the other's result)."""
        with self.lock:
            self.conn.check()
            self._check_free(handle.name)
            self.inflight[handle.name] = handle
            handle.owner = self
            self.handed_out.discard(handle.name)  # (its slot is held as in flight from now on)

    def _check_free(self, name: str) -> None:
        """BPSError unless no operation holds ``name`` (under the lock). One that a failed group call gave up
        (:meth:`_settle`) holds it until it ends, then no longer."""
        held = self.inflight.get(name)
        if held is None:
            return
        if held.abandoned and held.done():
            del self.inflight[name]
            return
        if held.abandoned:
            raise BPSError(f"tensor {name!r} is still in flight from a push_pull_group that failed (its peers "
                           "have not finished it yet); try again later")
        raise BPSError(f"tensor {name!r} is already in flight in this process; synchronize it first")

    def check_free(self, names: Iterable[str]) -> None:
        """BPSError unless no operation of this process holds any of ``names`` (a group's packed names, which
        are never claimed one by one: the daemons never see them)."""
        with self.lock:
            for name in names:
                self._check_free(name)

    def _reserve_all(self, handles: list[Handle]) -> None:
        """:meth:`_reserve` for a group, all or none: a name in flight, or twice in the group, claims none."""
        with self.lock:
            self.conn.check()
            seen: set[str] = set()
            for handle in handles:
                self._check_free(handle.name)
                if handle.name in seen:
                    raise BPSError(f"tensor {handle.name!r} appears twice in one push_pull_group")
                seen.add(handle.name)
            for handle in handles:
                self.inflight[handle.name] = handle
                handle.owner = self
                self.handed_out.discard(handle.name)

    def _unreserve(self, handle: Handle) -> None:
        """Give the name back after a start that failed before its operation was sent."""
        with self.lock:
            if self.inflight.get(handle.name) is handle:
                del self.inflight[handle.name]

    # -- finishing -------------------------------------------------------------------
    def finish(self, handle: Handle, timeout: float | None, view: bool = False) -> np.ndarray:
        """Wait for ``handle``; its result (``out``, a copy, or with ``view`` the shared memory that holds it,
        read-only and valid until the next operation on the same name)."""
        self._check_ours(handle, "synchronize")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                    or math.isnan(timeout) or timeout < 0):
            raise BPSError(f"synchronize of {handle.name!r}: timeout must be a number of seconds >= 0 or None, "
                           f"got {timeout!r}")
        if handle.consumed:
            raise BPSError(f"handle of {handle.name!r} was already synchronized")
        if handle.queued and self.fusion is not None:
            self.fusion.flush()
        if not handle.wait(timeout):
            raise BPSTimeoutError(what=f"tensor {handle.name!r}", timeout_s=timeout)
        with self.lock:  # two threads may synchronize one handle: one gets the result
            if handle.consumed:
                raise BPSError(f"handle of {handle.name!r} was already synchronized")
            handle.consumed = True
        try:
            return self._result(handle, view)
        finally:  # the name is free once its result is read (a new operation on it would overwrite the slot)
            with self.lock:
                if self.inflight.get(handle.name) is handle:
                    del self.inflight[handle.name]

    def _result(self, handle: Handle, view: bool) -> np.ndarray:
        """The result of ``handle`` (ended, consumed by this thread): see :meth:`finish`."""
        if handle.error is not None:
            raise handle.error
        t_copy = now_us() if handle.times is not None else 0
        held = handle.view  # where the result is: the slot, ...
        if handle.result_at is not None:  # ... or the worker's results segment, mapped as the Done arrived
            segment, offset = handle.result_at
            try:
                mapped = self.slots.result_segment(handle.name, segment)
            except BPSError:
                if self.conn.closing:  # shutdown() on another thread unmapped it, and the daemon freed it
                    raise self.conn.cut() from None
                raise
            held = view_of(mapped.buf, handle.dtype, handle.shape, offset)
        result: Any
        if handle.in_place:  # `out` is the slot itself (or a CUDA tensor): the daemon wrote the result there
            result = handle.out
        else:
            assert held is not None, "a CUDA operation's result is its tensor"
            if handle.out is not None:
                np.copyto(handle.out, held)
                result = handle.out
            elif view:
                result = held.view()  # not the slot's own array; the results segment: read it, never write it
            else:
                result = held.copy()
        if handle.times is not None and self.timeline is not None:
            self._trace(handle, t_copy)
        return result

    def _trace(self, handle: Handle, t_copy: int) -> None:
        """The operation's spans on the timeline: the whole, copy in, the daemon's part, copy out."""
        assert self.timeline is not None and handle.times is not None
        start, filled, done = handle.times
        nbytes = prod(handle.shape) * handle.dtype.itemsize
        self.timeline.span(handle.name, handle.call, start, now_us(), bytes=nbytes, in_place=handle.in_place)
        self.timeline.span(handle.name, "copy in", start, filled)
        self.timeline.span(handle.name, "worker daemon", filled, done)
        self.timeline.span(handle.name, "copy out", t_copy, now_us())

    def _check_ours(self, handle: Handle, call: str) -> None:
        """BPSError unless ``handle`` is one this connection started (one from before a shutdown() and init() read
        another connection's memory: a later round's result, or a segment already freed)."""
        if checked(handle, call).owner is not self:
            raise BPSError(f"handle of {handle.name!r} belongs to a connection to the worker daemon that was "
                           "shut down (shutdown(), then init() again): its result went with it; start the "
                           "operation again")

    def poll(self, handle: Handle) -> bool:
        """Whether ``handle``'s operation finished (a waiting fused one is sent now)."""
        self._check_ours(handle, "poll")
        if handle.queued and self.fusion is not None:
            self.fusion.flush()
        return handle.done()

    def close(self) -> None:
        """Disconnect and unmap every segment; the daemon frees this process's shared memory."""
        if self.fusion is not None:
            self.fusion.close()
        self.conn.close()
        self.slots.close()
        if self.timeline is not None:
            self.timeline.close()

