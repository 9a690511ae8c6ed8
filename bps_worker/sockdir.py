"""Whether a directory may hold a daemon's Unix socket, and where the launcher puts sockets instead.

A Unix socket is found by its path, so whoever can write the directory that holds it can put their own
socket there (before the daemon starts, or in place of a stale one) and receive the training processes'
connections and shared-memory names. A worker daemon therefore uses a socket directory only when it is
owned by us (or by root, who can do anything anyway) and writable by neither its group nor others; a
directory that another user pre-created in ``/tmp``, or ``/tmp`` itself, is refused with one line. So is one
inside a directory that another user owns, or that others may write without the sticky bit (they could
rename ours away and put theirs in its place), unless that directory is a volume's mount point: a pod's
emptyDir is 0777, written by the pod's own containers.

The launcher (``bps-launch``) keeps a worker's socket where the cluster file says when that directory
already exists and passes the check; otherwise (the demo's ``/tmp/bps`` on a fresh box, or one squatted
by someone else) it puts it in its own private run directory: under ``$XDG_RUNTIME_DIR`` where that is
set and safe, else a fresh mode-700 directory of the system's temporary directory.

Decisions only look at ``os.lstat``/``os.stat`` and ``/proc/self/mountinfo``; nothing here binds a socket.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from typing import Final, Literal, Mapping

__all__ = ["Problem", "UnsafeSocketDirError", "absolute", "ensure_socket_dir", "launch_socket_path", "mount_points",
           "private_base", "socket_dir_problem"]

#: Mode of a socket directory the worker daemon creates: others may reach the socket (its own mode,
#: ``--socket-mode``, decides who may connect), nobody else may add or replace files.
CREATE_MODE: Final = 0o755
ROOT_UID: Final = 0

ProblemKind = Literal["missing", "not_a_directory", "foreign_link", "foreign_owner", "writable"]


@dataclass(frozen=True)
class Problem:
    """Why a directory may not hold our socket: ``kind`` for code, ``text`` for the message."""

    kind: ProblemKind
    text: str


class UnsafeSocketDirError(PermissionError):
    """A socket directory that another user could write: the daemon refuses to listen there."""

    def __init__(self, path: str, problem: Problem) -> None:
        # no errno: lifecycle.describe_bind_error then shows this text rather than strerror(EACCES)
        super().__init__(f"socket directory {path} {problem.text}")
        self.path = path
        self.problem = problem


def socket_dir_problem(path: str, *, uid: int | None = None, mounts: frozenset[str] | None = None
                       ) -> Problem | None:
    """None if ``path`` is a directory we may put a socket in; else what is wrong with it.

    ``uid``: the user the socket is for (default: our effective uid). Owned by ``uid`` or root, and
    writable by neither group nor others; so is every directory above it (:func:`_ancestor_problem`). A
    symbolic link is followed only if ``uid`` or root owns it (a link in ``/tmp`` that someone else owns
    could be pointed elsewhere after the check). ``mounts``: the mount points (default: this process's,
    from ``/proc/self/mountinfo``).
    """
    me = os.geteuid() if uid is None else uid
    trusted = (me, ROOT_UID)
    try:
        link = os.lstat(path)
        st = os.stat(path)
    except FileNotFoundError:
        return Problem("missing", "does not exist")
    except OSError as exc:  # (a component that is a file, a loop of links: one line, not a traceback)
        return Problem("not_a_directory", f"cannot be reached: {exc.strerror or exc}")
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in trusted:
        return Problem("foreign_link", f"is a symbolic link owned by uid {link.st_uid}, not by this user "
                                       f"(uid {me})")
    if not stat.S_ISDIR(st.st_mode):
        return Problem("not_a_directory", "is not a directory")
    if st.st_uid not in trusted:
        return Problem("foreign_owner", f"is owned by uid {st.st_uid}, not by this user (uid {me}); another "
                                        "user could replace the socket")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "others" if st.st_mode & stat.S_IWOTH else "its group"
        return Problem("writable", f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}); they could "
                                   "replace the socket")
    try:
        return _ancestor_problem(path, trusted, me, mount_points() if mounts is None else mounts)
    except OSError as exc:  # (the path changed under the walk)
        return Problem("not_a_directory", f"cannot be reached: {exc.strerror or exc}")


def _ancestor_problem(path: str, trusted: tuple[int, ...], me: int, mounts: frozenset[str]) -> Problem | None:
    """What lets another user rename the directory away and put theirs in its place: a directory it is looked
    up in (or one above) owned by someone else, or one that others may write without the sticky bit (``/tmp``'s
    1777 protects it); or point the path elsewhere: a symbolic link on the way that someone else owns.

    The path is resolved as the kernel resolves it (:func:`_lookups`): a textual normalisation would hide a
    link followed by ``..``, which leads out of the link's target, not back to where the link is.

    A mount point that others may write is not refused: a volume mounted to be shared, such as a Kubernetes
    pod's emptyDir (0777, or 2777 with fsGroup), may be written by whom it was mounted for (the pod's own
    containers), which is its mounter's decision; a directory a user made writable for all is not."""
    looked_in, problem = _lookups(path, trusted, me)
    if problem is not None:
        return problem
    for directory in looked_in:
        st = os.stat(directory)
        if st.st_uid not in trusted:
            return Problem("foreign_owner", f"is in {directory}, owned by uid {st.st_uid}, not by this user "
                                            f"(uid {me}); it could replace the directory")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX and directory not in mounts:
            who = "others" if st.st_mode & stat.S_IWOTH else "its group"
            return Problem("writable", f"is in {directory}, writable by {who} without the sticky bit (mode "
                                       f"{stat.S_IMODE(st.st_mode):o}); they could replace the directory")
    return None


MAX_LINKS: Final = 40  # symbolic links followed in one path, as Linux's limit (then ELOOP)


def _lookups(path: str, trusted: tuple[int, ...], me: int) -> tuple[list[str], Problem | None]:
    """The directories (real paths, from ``/`` down) in which resolving ``path`` looks a name up, resolved as the
    kernel does, component by component; or, with them so far, the first symbolic link on the way that someone
    other than ``trusted`` owns. The last component may be missing (a directory about to be made)."""
    whole = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    pending = [c for c in reversed(whole.split("/")) if c and c != "."]  # a stack: the next component last
    current, looked_in, links = "/", [], 0
    while pending:
        name = pending.pop()
        if name == "..":
            current = os.path.dirname(current)
            continue
        if current not in looked_in:
            looked_in.append(current)
        entry = os.path.join(current, name)
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            if pending:
                raise
            break
        if not stat.S_ISLNK(st.st_mode):
            current = entry
            continue
        if st.st_uid not in trusted:
            return looked_in, Problem("foreign_link", f"is reached through {entry}, a symbolic link owned by uid "
                                                      f"{st.st_uid}, not by this user (uid {me}); it could be "
                                                      "pointed elsewhere")
        links += 1
        if links > MAX_LINKS:
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
        target = os.readlink(entry)
        if target.startswith("/"):
            current = "/"
        pending.extend(c for c in reversed(target.split("/")) if c and c != ".")
    return looked_in, None


def mount_points(mountinfo: str = "/proc/self/mountinfo") -> frozenset[str]:
    """This process's mount points (the fifth field of each line, its octal escapes undone); none if the file
    cannot be read (then no directory above a socket's is taken for a volume)."""
    try:
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return frozenset()
    unescape = re.compile(r"\\([0-7]{3})")
    return frozenset(unescape.sub(lambda m: chr(int(m.group(1), 8)), line.split(" ")[4])
                     for line in lines if line.count(" ") >= 4)


def absolute(path: str) -> str:
    """``path`` made absolute from the working directory, not normalised (``os.path.abspath`` would drop
    ``link/..`` as text, where the kernel follows the link first)."""
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def ensure_socket_dir(path: str) -> None:
    """Create socket directory ``path`` (mode 755) if it is missing; refuse it unless it is safe.

    For the worker daemon before it binds its socket. Raises :class:`UnsafeSocketDirError`.
    """
    missing = []
    head = absolute(path)  # (not normalised: the kernel resolves a ``..`` after a link, see _lookups)
    while not os.path.lexists(head):  # (each made 755 whatever the umask: a parent too is checked, below)
        missing.append(head)
        head = os.path.dirname(head)
    if missing:  # nothing made where it would be refused: the directories it is made in, checked first
        me = os.geteuid()
        problem = _ancestor_problem(missing[-1], (me, ROOT_UID), me, mount_points())
        if problem is not None:
            raise UnsafeSocketDirError(path, problem)
    for made in reversed(missing):
        try:
            os.mkdir(made, CREATE_MODE)
        except FileExistsError:
            continue  # (made meanwhile: judged below as any other)
        os.chmod(made, CREATE_MODE)
    problem = socket_dir_problem(path)
    if problem is not None:
        raise UnsafeSocketDirError(path, problem)


def private_base(environ: Mapping[str, str] = os.environ) -> str | None:
    """``$XDG_RUNTIME_DIR`` where it is set and safe (the user's own, mode 700 by the spec), else None."""
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and socket_dir_problem(runtime) is None:
        return runtime
    return None


def launch_socket_path(configured: str, private_dir: str, worker_id: int) -> tuple[str, Problem | None]:
    """Where the launcher puts the socket of worker ``worker_id`` that the cluster file places at ``configured``.

    ``configured`` itself when its directory exists and is safe; else ``worker-<id>.sock`` in ``private_dir``
    (the launcher's own, mode 700). The second value is the problem that moved it, or None.
    """
    problem = socket_dir_problem(os.path.dirname(absolute(configured)))
    if problem is None:
        return configured, None
    return os.path.join(private_dir, f"worker-{worker_id}.sock"), problem
