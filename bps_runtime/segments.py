"""POSIX shared-memory segments: created and owned by the worker daemon, attached by everyone else.

The worker creates every segment (owner-only permissions) and unlinks it when
the client that uses it disconnects, is killed, or the daemon stops; clients
only attach. The worker's segments stay registered with Python's resource
tracker, so even a SIGKILLed daemon's segments are unlinked by the tracker; a
client unregisters what it attaches, or its tracker would unlink segments it
does not own when it exits. The colocated Summation Service and the training
processes only attach (:func:`attach_segment`), and close the descriptor at once
(the mapping outlives it), or thousands of segments would exhaust the fd limit.
"""

from __future__ import annotations

import _posixshmem
import asyncio
import errno
import itertools
import mmap
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from multiprocessing import resource_tracker
from typing import Callable, Final

from protocol.config import MIN_ARENA_BYTES


__all__ = ["SEGMENT_PREFIX", "SHM_DIR", "Arena", "ArenaFullError", "SegmentOwnerError", "SegmentSizeError",
           "SegmentSpaceError", "Slot", "attach_owned", "attach_segment", "check_size", "create_segment",
           "default_arena_bytes", "owned_by", "reclaim_dead", "release", "segment_name", "slab_slot_bytes"]

SEGMENT_PREFIX: Final = "bps_"
SHM_DIR: Final = "/dev/shm"  # where Linux keeps POSIX shared memory (glibc's shm_open)


class SegmentSpaceError(OSError):
    """Shared memory cannot back a new segment: its file system (``/dev/shm``) has no room for it.

    Raised when the segment is created, so that a full ``/dev/shm`` is an error naming the size, never a
    SIGBUS in whichever process first touches a page that cannot be backed.
    """

    def __init__(self, nbytes: int, directory: str = SHM_DIR) -> None:
        try:
            st = os.statvfs(directory)
            free = f"{st.f_bavail * st.f_frsize} of {st.f_blocks * st.f_frsize} bytes free"
        except OSError:
            free = "free space unknown"
        super().__init__(errno.ENOSPC, f"no room for {nbytes} bytes of shared memory in {directory} ({free}); "
                                       f"give the machine (or container: docker --shm-size) a larger {directory}")
        self.nbytes = nbytes
        self.directory = directory


class SegmentOwnerError(PermissionError):
    """A segment belongs to another user than the one it must belong to (``owner``, ``expected``: uids).

    The colocated server maps only segments of the user whose probe proved the shared-memory offer, so
    that a peer cannot make it read or write another user's memory (issue 14, item 2)."""

    def __init__(self, name: str, owner: int, expected: int) -> None:
        super().__init__(errno.EACCES, f"shared memory {name!r} belongs to uid {owner}, not to uid {expected} "
                                       f"whose probe this connection offered")
        self.segment = name
        self.owner = owner
        self.expected = expected


class SegmentSizeError(OSError):
    """A mapped segment is smaller now than an access needs: someone truncated (or replaced) it.

    Every process that can write a segment can also shrink it (``ftruncate``), and touching a mapped
    page past the end of the file is a SIGBUS. So the daemons check the size right before each access
    of a segment (:func:`check_size`), and a shrunk segment fails that one operation (issue 14, item 3).
    ``size`` is the file's size now (0 when it is gone or another file took its name)."""

    def __init__(self, name: str, size: int, needed: int, tensor: str = "", replaced: bool = False,
                 backed: int | None = None) -> None:
        state = "was removed or replaced" if replaced else f"has {size} bytes now"
        why = ("removed from /dev/shm by something other than its worker daemon, e.g. a cleanup of /dev/shm or "
               "systemd-logind's RemoveIPC?" if replaced else "a process truncated it?")  # (a review: "truncated"
        # was said of a removed one too, where a script of its own was deleting every bps_ segment)
        if backed is not None:  # (a file's holes are unmapped pages as much as a truncated end)
            state = f"has only {backed} of its {size} bytes in memory"
            why = "a sparse file: made with ftruncate alone, or holes punched in it"
        of = f" of tensor {tensor!r}" if tensor else ""
        super().__init__(errno.EFAULT, f"shared memory {name!r}{of} {state}; {needed} bytes are needed ({why})")
        self.segment = name
        self.size = size
        self.needed = needed
        self.tensor = tensor


class ArenaFullError(OSError):
    """A tensor's shared memory cannot fit under its arena's cap (``arena_bytes``), even with every idle
    tensor's memory freed: the tensor itself is larger than the cap, or the rest is in flight."""

    def __init__(self, tensor: str, nbytes: int, held: int, cap: int, *, in_flight: tuple[int, int] = (0, 0),
                 what: str = "") -> None:
        self.what = what or f"tensor {tensor!r}"
        if nbytes > cap:
            why = "larger than the cap"
        elif in_flight[0]:
            why = (f"{held} bytes of its segments are held by {in_flight[0]} slots in use, {in_flight[1]} bytes of "
                   f"them: small ones share segments")
        else:
            why = f"{held} bytes are held by tensors in flight"
        super().__init__(errno.ENOSPC, f"{self.what} needs {nbytes} bytes of shared memory in {SHM_DIR}, but its "
                                       f"arena may hold {cap} bytes ({why}); raise cluster.arena_bytes")
        self.tensor = tensor
        self.nbytes = nbytes
        self.held = held
        self.cap = cap
        self.in_flight = in_flight  # (slots in use, their bytes) in the segments held

    def about(self, what: str) -> ArenaFullError:
        """The same error, saying ``what`` needed the memory (a fused tensor: the names in it)."""
        return ArenaFullError(self.tensor, self.nbytes, self.held, self.cap, in_flight=self.in_flight, what=what)


# The file each mapping was made from (st_dev, st_ino), read when it was mapped, and its path: check_size
# compares the identity with what the name points at now, so that a segment replaced under its name is not
# taken for the one mapped. Kept on the mapping object itself (check_size runs per piece on the hot path).
_IDENTITY_ATTR: Final = "_bps_identity"


def _remember(seg: SharedMemory, st: os.stat_result) -> None:
    setattr(seg, _IDENTITY_ATTR, (os.path.join(SHM_DIR, seg.name), st.st_dev, st.st_ino))


class _PassSizes(threading.local):
    """The size each mapping's file had at its first check in the current pass of this thread's event loop
    (check_size): the pieces one read of a connection brought name the same few segments, and a ``stat`` each cost
    a server more than its sums of small pieces (benchmarks/RESULTS.md). Per thread, and for one loop: emptied by
    a callback at the pass's end, or when a check finds another loop running (one that stopped before its
    callback ran)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sizes: dict[SharedMemory, int] = {}

    def end_of_pass(self) -> None:
        self.loop = None
        self.sizes.clear()


_pass = _PassSizes()


def check_size(seg: SharedMemory, needed: int, tensor: str = "") -> None:
    """Raise :class:`SegmentSizeError` unless the file ``seg`` maps still has ``needed`` bytes.

    One ``stat`` of the name (about a microsecond), compared with the file mapped, once per pass of the event
    loop per mapping (later checks in the pass compare with what it saw; off an event loop, every check reads
    it): call it right before each access of a segment, never per element. It narrows the window in which a
    shrinking process can crash a daemon to the time between that ``stat`` and the access, at most a pass of the
    loop (a process that truncates in that window still can: only a sealed memfd would close it)."""
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    memo = _pass
    size = memo.sizes.get(seg) if loop is not None and memo.loop is loop else None
    if size is None:
        size = _size_now(seg, needed, tensor)
        if loop is not None:
            if memo.loop is not loop:  # this pass's first check (or a loop that stopped mid-pass before it)
                memo.end_of_pass()
                memo.loop = loop
                loop.call_soon(memo.end_of_pass)
            memo.sizes[seg] = size
    if size < needed:
        raise SegmentSizeError(seg.name, size, needed, tensor)


def _size_now(seg: SharedMemory, needed: int, tensor: str) -> int:
    """The size of the file ``seg`` maps, from a ``stat`` of its name; SegmentSizeError if the name is gone or
    names another file now, or if the file has holes (pages no memory backs: touching one is a SIGBUS where
    ``/dev/shm`` is full, as past a truncated end)."""
    identity = getattr(seg, _IDENTITY_ATTR, None)
    try:
        st = os.stat(identity[0] if identity is not None else os.path.join(SHM_DIR, seg.name))
    except OSError:
        raise SegmentSizeError(seg.name, 0, needed, tensor, replaced=True) from None
    if identity is not None and (identity[1] != st.st_dev or identity[2] != st.st_ino):
        raise SegmentSizeError(seg.name, 0, needed, tensor, replaced=True)
    if st.st_blocks * 512 < st.st_size:  # every segment of ours is allocated whole (create_segment)
        raise SegmentSizeError(seg.name, st.st_size, needed, tensor, backed=st.st_blocks * 512)
    return st.st_size


def default_arena_bytes(directory: str = SHM_DIR) -> int:
    """The default cap of one arena: half the size of ``directory`` (1 GiB where it cannot be read)."""
    try:
        st = os.statvfs(directory)
        return max(st.f_blocks * st.f_frsize // 2, SLAB_BYTES)
    except OSError:
        return 1 << 30


def segment_name(worker_id: int) -> str:
    """A fresh segment name of worker ``worker_id``'s daemon: ``bps_w{id}_{pid}_{random}``."""
    return f"{SEGMENT_PREFIX}w{worker_id}_{os.getpid()}_{secrets.token_hex(6)}"


def owned_by(name: str, worker_id: int) -> bool:
    """Whether ``name`` follows :func:`segment_name`'s rule for worker ``worker_id``."""
    return name.startswith(f"{SEGMENT_PREFIX}w{worker_id}_")


def untrack(seg: SharedMemory) -> None:
    try:
        resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:
        pass


def close_fd(seg: SharedMemory) -> None:
    """The mapping outlives the descriptor: close it."""
    fd = getattr(seg, "_fd", -1)
    if fd >= 0:
        os.close(fd)
        seg._fd = -1  # type: ignore[attr-defined]


def attach_owned(name: str) -> tuple[SharedMemory, int]:
    """Map an existing segment; with the uid of its owner, read with ``fstat`` on the descriptor the
    mapping was made from (glibc's ``shm_open`` opens with ``O_NOFOLLOW``: a symlink is refused, and the
    file checked is the file mapped). OSError if it is gone, not a regular file, or not ours to read."""
    try:
        seg = _attach_untracked(name)
    except ValueError:  # mmap refuses an empty file: a segment truncated to 0 bytes, or never sized
        raise OSError(errno.EINVAL, f"shared memory {name!r} is empty") from None
    try:
        st = os.fstat(seg._fd)  # type: ignore[attr-defined]
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"shared memory {name!r} is not a regular file")
    except BaseException:
        close_fd(seg)
        release(seg, unlink=False)
        raise
    _remember(seg, st)
    close_fd(seg)
    return seg, st.st_uid


def _attach_untracked(name: str) -> SharedMemory:
    """``SharedMemory(name)``, without telling the resource tracker. The constructor registers every segment it
    maps (the tracker would unlink it at exit), so an attach had to unregister it at once; but processes
    started by one parent (``multiprocessing``'s spawn or forkserver, ``torch.multiprocessing.spawn``) share its
    tracker, and two of them mapping one segment could interleave register, register, unregister,
    unregister: the tracker then printed a ``KeyError`` traceback. (The constructor also unlinks a segment it
    fails to map, which no attach should do.)"""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    seg = SharedMemory.__new__(SharedMemory)  # the attributes its __init__ sets on POSIX, and its methods read
    seg._name, seg._fd, seg._mmap, seg._size = "/" + name, fd, mapping, size  # type: ignore[attr-defined]
    seg._buf = memoryview(mapping)  # type: ignore[attr-defined]
    return seg


def attach_segment(name: str, owner_uid: int | None = None) -> SharedMemory:
    """Map an existing segment (OSError if it is gone or not ours to read); with ``owner_uid``, only one
    that this uid owns (:class:`SegmentOwnerError`, nothing read or written, otherwise)."""
    seg, owner = attach_owned(name)
    if owner_uid is not None and owner != owner_uid:
        release(seg, unlink=False)
        raise SegmentOwnerError(name, owner, owner_uid)
    return seg


def release(seg: SharedMemory, unlink: bool) -> None:
    """Close our mapping (ignoring live exports) and optionally remove the name."""
    try:
        seg.close()
    except BufferError:
        # A view still uses the mapping: drop our references, so the mapping goes with the last view
        # (and SharedMemory.__del__ does not try, and fail, again).
        seg._buf = None  # type: ignore[attr-defined]
        seg._mmap = None  # type: ignore[attr-defined]
    if unlink:
        try:
            seg.unlink()
        except FileNotFoundError:
            pass


def create_segment(name: str, nbytes: int, mode: int = 0o600) -> SharedMemory:
    """A new segment of at least ``nbytes`` (a zero-size segment cannot be mapped, so at least 1).

    Created owner-only, then opened up to ``mode`` (e.g. 0o660 for a shared group).
    """
    seg = SharedMemory(name=name, create=True, size=max(nbytes, 1))
    try:
        # ftruncate alone makes a sparse file: its pages are found missing only when touched (SIGBUS).
        os.posix_fallocate(seg._fd, 0, seg.size)  # type: ignore[attr-defined]
    except OSError as exc:
        release(seg, unlink=True)
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise SegmentSpaceError(max(nbytes, 1)) from None
        raise
    if mode != 0o600:
        os.fchmod(seg._fd, mode)  # type: ignore[attr-defined]
    _remember(seg, os.fstat(seg._fd))  # type: ignore[attr-defined]
    close_fd(seg)
    return seg


def reclaim_dead(worker_id: int, directory: str = SHM_DIR) -> list[str]:
    """Unlink the segments of worker ``worker_id``'s daemons that are no longer alive; return their names.

    A daemon killed together with its resource tracker (a process-group or cgroup kill) leaves its segments
    behind; the next daemon of the same worker calls this at start-up. A segment whose creator's pid is
    alive (even if the pid was reused) is left alone.
    """
    pattern = re.compile(rf"{SEGMENT_PREFIX}w{worker_id}_(\d+)_[0-9a-f]+")
    reclaimed = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    for entry in sorted(entries):
        match = pattern.fullmatch(entry)
        if match is None or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, entry))
        except OSError:
            continue
        reclaimed.append(entry)
    return reclaimed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


# Tensors up to SLAB_ITEM_MAX_BYTES share SLAB_BYTES segments (one mapping and no fd for thousands of biases);
# a cluster file's arena_bytes is at least one slab. Under a cap of less than SLAB_CAPS slabs they are smaller
# (slab_bytes), at least MIN_SLAB_BYTES.
SLAB_BYTES: Final = MIN_ARENA_BYTES
SLAB_ITEM_MAX_BYTES: Final = 64 << 10
SLOT_ALIGN: Final = 64
SLAB_CAPS: Final = 16
MIN_SLAB_BYTES: Final = 4 * SLAB_ITEM_MAX_BYTES


def slab_bytes(cap_bytes: int | None) -> int:
    """The size of the slabs of an arena capped at ``cap_bytes`` (None or 0: no cap): SLAB_BYTES, or a
    SLAB_CAPS-th of a smaller cap (at least MIN_SLAB_BYTES). A slab is held while any tensor in it is in flight:
    under the 4 MiB minimum, one busy slab of 4 MiB left no room for anything else (a review's case: 200 tensors
    of 1 KiB in flight failed), where sixteen of 256 KiB leave fifteen."""
    if not cap_bytes or cap_bytes >= SLAB_CAPS * SLAB_BYTES:
        return SLAB_BYTES
    return max(MIN_SLAB_BYTES, cap_bytes // SLAB_CAPS // SLOT_ALIGN * SLOT_ALIGN)


def slab_slot_bytes(nbytes: int) -> int:
    """The room a small tensor of ``nbytes`` takes in a slab: at least one byte, rounded up to ``SLOT_ALIGN``
    (the daemon's arena and the client's own slabs, ``bps_worker.client.slots``, carve alike)."""
    return -(-max(nbytes, 1) // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in shared memory."""

    segment: str
    offset: int
    capacity: int
    dedicated: bool  # the segment holds only this tensor (freed when it moves)


class Arena:
    """Shared-memory slots for named tensors, created by this process (the worker daemon).

    Small tensors are carved from shared slabs, large ones get a segment of their own;
    a name keeps its slot while it fits (so rounds reuse it), and a dedicated segment
    outgrown by its tensor is freed at once. Everything goes with :meth:`release_all`.

    Bounded by ``cap_bytes`` (the sizes of its segments together; None: unbounded): a segment that
    would take the arena over it first frees the least recently used segments none of whose tensors
    is ``busy`` (in flight), and :class:`ArenaFullError` says so where that is not enough. Whoever
    else maps a freed segment must be told (the caller gets the names), and only unmaps it: the
    memory lives on until the last mapping goes.
    """

    def __init__(self, worker_id: int, mode: int = 0o600, cap_bytes: int | None = None) -> None:
        self.worker_id = worker_id
        self.mode = mode
        self.cap_bytes = cap_bytes
        self.slab_bytes = slab_bytes(cap_bytes)
        self.segments: dict[str, SharedMemory] = {}
        self.slots: dict[str, Slot] = {}  # changed only through _put and _take (they keep _living)
        self._living: dict[str, int] = {}  # segment -> how many slots live in it (whether it may go: O(1))
        self._slab: str | None = None
        self._slab_used = 0
        self._used: dict[str, int] = {}  # tensor name -> when it was last allocated or touched
        self._clock = itertools.count()
        self.before_release: Callable[[SharedMemory], None] | None = None  # e.g. undo cudaHostRegister
        # Segments freed by an alloc that then failed (no room, no memory): reported by the next alloc.
        self._unreported: list[str] = []

    @property
    def held_bytes(self) -> int:
        return sum(seg.size for seg in self.segments.values())

    def alloc(self, name: str, nbytes: int, busy: Callable[[str], bool] | None = None) -> tuple[Slot, list[str]]:
        """The slot of ``name`` with room for ``nbytes``, and the segments freed to make it.

        ``busy(tensor)``: whether a tensor's memory is in use (never freed for room). Raises OSError
        when shared memory is exhausted (:class:`ArenaFullError` at the cap)."""
        old = self.slots.get(name)
        self._used[name] = next(self._clock)
        if old is not None and old.capacity >= nbytes:
            return old, []
        freed, self._unreported = self._unreported, []
        try:
            slot = self._alloc_new(name, nbytes, old, freed, busy)
        except BaseException:
            self._unreported = freed  # (the caller hears of them with its next alloc)
            raise
        return slot, freed

    def _alloc_new(self, name: str, nbytes: int, old: Slot | None, freed: list[str],
                   busy: Callable[[str], bool] | None) -> Slot:
        """:meth:`alloc` of a slot that is not there or is outgrown; what it frees is added to ``freed``."""
        if old is not None and old.dedicated:
            freed += self.drop(name)
        elif old is not None:  # a slab slot outgrown: never reused; its slab goes with its last slot
            self._take(name)
            freed += self._release_if_empty(old.segment)
        if nbytes <= SLAB_ITEM_MAX_BYTES:
            need = slab_slot_bytes(nbytes)
            if self._slab is None or self._slab_used + need > self.slab_bytes:
                full = self._slab
                freed += self._empty_slab_for_room(self.slab_bytes)
                freed += self._make_room(name, self.slab_bytes, busy)
                self._slab = self._new_segment(self.slab_bytes).name
                self._slab_used = 0
                if full is not None:  # (its slots may all have gone while it was the one carved from)
                    freed += self._release_if_empty(full)
            slot = Slot(self._slab, self._slab_used, need, dedicated=False)
            self._slab_used += need
        else:
            freed += self._empty_slab_for_room(nbytes)
            freed += self._make_room(name, nbytes, busy)
            seg = self._new_segment(nbytes)
            slot = Slot(seg.name, 0, seg.size, dedicated=True)
        self._put(name, slot)
        self._used[name] = next(self._clock)
        return slot

    def _put(self, name: str, slot: Slot) -> None:
        self.slots[name] = slot
        self._living[slot.segment] = self._living.get(slot.segment, 0) + 1

    def _take(self, name: str) -> Slot | None:
        slot = self.slots.pop(name, None)
        if slot is not None:
            left = self._living[slot.segment] - 1
            if left:
                self._living[slot.segment] = left
            else:
                del self._living[slot.segment]
        return slot

    def _release_if_empty(self, segment: str, *, current: bool = False) -> list[str]:
        """Unlink ``segment`` if no slot lives in it any more; the slab we carve from only with ``current`` (a
        slot outgrown or abandoned there leaves it to be carved on). A count per segment, not a walk over every
        slot: a process freeing a thousand names in one Alloc made that a walk each."""
        if segment not in self.segments or segment in self._living:
            return []
        if segment == self._slab:
            if not current:
                return []
            self._slab = None
        self._release(self.segments.pop(segment))
        return [segment]

    def touch(self, name: str) -> None:
        """``name`` was used: it is the last to be freed for room."""
        if name in self.slots:
            self._used[name] = next(self._clock)

    def drop(self, name: str) -> list[str]:
        """Forget ``name``'s slot; its segment is freed (unlinked) once no slot lives in it: a dedicated one
        at once, a slab with its last slot. Returns the segments freed."""
        old = self._take(name)
        self._used.pop(name, None)
        return [] if old is None else self._release_if_empty(old.segment, current=True)

    def _empty_slab_for_room(self, nbytes: int) -> list[str]:
        """The slab we carve from, unlinked, if no slot lives in it any more (its tensors outgrew it, or were
        abandoned) and ``nbytes`` more would not fit under the cap beside it (it was never given up: a review's
        case, a sixteenth of the cap held by nothing)."""
        slab, cap = self._slab, self.cap_bytes
        if slab is None or slab in self._living or cap is None or self.held_bytes + nbytes <= cap:
            return []
        return self._release_if_empty(slab, current=True)

    def _make_room(self, name: str, nbytes: int, busy: Callable[[str], bool] | None) -> list[str]:
        """Free least recently used idle segments until ``nbytes`` more fit under the cap."""
        cap = self.cap_bytes
        if cap is None or self.held_bytes + nbytes <= cap:
            return []
        if nbytes > cap:
            raise ArenaFullError(name, nbytes, self.held_bytes, cap)
        by_segment: dict[str, list[str]] = {}
        for tensor, slot in self.slots.items():
            by_segment.setdefault(slot.segment, []).append(tensor)
        idle = sorted((max(self._used.get(t, -1) for t in tensors), seg, tensors)
                      for seg, tensors in by_segment.items() if not (busy is not None and any(map(busy, tensors))))
        in_use = self.held_bytes - sum(self.segments[seg].size for _, seg, _ in idle)
        if in_use + nbytes > cap:  # checked first: nothing is freed in vain
            flying = [slot.capacity for t, slot in self.slots.items() if busy is None or busy(t)]
            raise ArenaFullError(name, nbytes, in_use, cap, in_flight=(len(flying), sum(flying)))
        freed: list[str] = []
        for _, seg, tensors in idle:
            if self.held_bytes + nbytes <= cap:
                break
            for tensor in tensors:
                freed += self.drop(tensor)
        return freed

    def abandon(self, name: str) -> str | None:
        """Give ``name`` a fresh slot on its next :meth:`alloc`: something may still write into the
        current one (a stalled peer). A dedicated segment is unlinked (its memory lives on until the
        last mapping goes); a slab slot is simply never reused. Returns the segment unlinked, if any."""
        old = self._take(name)
        self._used.pop(name, None)
        if old is not None and old.dedicated:
            self._release(self.segments.pop(old.segment))
            return old.segment
        if old is not None:  # a slab slot: the slab goes if it was its last (the mappings keep its memory)
            gone = self._release_if_empty(old.segment)
            return gone[0] if gone else None
        return None

    def _release(self, seg: SharedMemory) -> None:
        if self.before_release is not None:
            self.before_release(seg)
        release(seg, unlink=True)

    def view(self, slot: Slot) -> memoryview:
        buf = self.segments[slot.segment].buf
        assert buf is not None  # typeshed: None only once closed, and the arena closes nothing it holds
        return buf[slot.offset:slot.offset + slot.capacity]

    def _new_segment(self, nbytes: int) -> SharedMemory:
        seg = create_segment(segment_name(self.worker_id), nbytes, self.mode)
        self.segments[seg.name] = seg
        return seg

    def release_all(self) -> list[str]:
        """Unlink every segment; returns their names."""
        names = list(self.segments)
        for seg in self.segments.values():
            self._release(seg)
        self.segments.clear()
        self.slots.clear()
        self._living.clear()
        self._used.clear()
        self._slab = None
        self._slab_used = 0
        return names
