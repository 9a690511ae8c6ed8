"""bps_worker.sockdir: a socket directory that another user could write is refused; the launcher's way round it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bps_worker import sockdir

NOBODY = 65534
ME = os.geteuid()


def _dir(tmp_path: Path, name: str, mode: int = 0o700, owner: int | None = None) -> str:
    path = tmp_path / name
    path.mkdir()
    os.chmod(path, mode)
    if owner is not None:
        os.chown(path, owner, -1)
    return str(path)


def test_a_private_directory_of_ours_is_accepted(tmp_path):
    assert sockdir.socket_dir_problem(_dir(tmp_path, "mine", 0o700)) is None
    assert sockdir.socket_dir_problem(_dir(tmp_path, "readable", 0o755)) is None  # others may reach, not replace
    sockdir.ensure_socket_dir(str(tmp_path / "mine"))


@pytest.mark.parametrize("mode,who", [(0o777, "others"), (0o1777, "others"), (0o770, "its group")])
def test_a_directory_writable_by_others_is_refused(tmp_path, mode, who):
    path = _dir(tmp_path, "shared", mode)
    problem = sockdir.socket_dir_problem(path)
    assert problem is not None and problem.kind == "writable"
    assert f"writable by {who}" in problem.text and f"{mode:o}" in problem.text
    with pytest.raises(sockdir.UnsafeSocketDirError) as info:
        sockdir.ensure_socket_dir(path)
    assert info.value.path == path and info.value.problem == problem
    assert isinstance(info.value, OSError) and info.value.errno is None  # the daemon's one line shows this text
    assert str(info.value) == f"socket directory {path} {problem.text}"


@pytest.mark.parametrize("mode", [0o777, 0o2777])
def test_the_kubernetes_recipes_socket_directory_in_an_empty_dir_is_accepted(tmp_path, monkeypatch, mode):
    """configs/kubernetes: the socket is in run/bps/sock, made by the worker in a pod's emptyDir (a volume mounted
    at /run/bps, mode 0777, or 2777 with fsGroup; writable only by the pod's own containers). A check of the
    directories above must not refuse it (one did, in session 29, and was reverted)."""
    empty_dir = _dir(tmp_path, "bps-run", mode)
    monkeypatch.setattr(sockdir, "mount_points", lambda: frozenset({empty_dir}))
    sockdir.ensure_socket_dir(os.path.join(empty_dir, "sock"))
    assert oct(os.stat(os.path.join(empty_dir, "sock")).st_mode & 0o7777) == oct(sockdir.CREATE_MODE)


def test_a_safe_directory_in_one_that_others_may_write_is_refused_unless_that_one_is_sticky(tmp_path):
    """Whoever may write a directory above ours can rename ours away and put theirs in its place (a parent
    of mode 777 that is no volume's mount point); the sticky bit (``/tmp``'s 1777) lets only the owner rename it."""
    shared = _dir(tmp_path, "shared", 0o777)
    inner = _dir(Path(shared), "run", 0o700)
    problem = sockdir.socket_dir_problem(inner, mounts=frozenset())
    assert problem is not None and problem.kind == "writable"
    assert f"is in {shared}, writable by others without the sticky bit (mode 777)" in problem.text
    with pytest.raises(sockdir.UnsafeSocketDirError):
        sockdir.ensure_socket_dir(os.path.join(shared, "made", "here"))  # (created, then refused)
    assert sockdir.socket_dir_problem(inner, mounts=frozenset({shared})) is None  # a volume's mount point
    os.chmod(shared, 0o1777)
    assert sockdir.socket_dir_problem(inner, mounts=frozenset()) is None


@pytest.mark.skipif(ME != 0, reason="chown to another uid needs root")
def test_a_safe_directory_in_one_another_user_owns_is_refused(tmp_path):
    theirs = _dir(tmp_path, "theirs", 0o755, owner=NOBODY)
    os.chown(theirs, ME, -1)
    inner = _dir(Path(theirs), "run", 0o700)
    os.chown(theirs, NOBODY, -1)
    problem = sockdir.socket_dir_problem(inner)
    assert problem is not None and problem.kind == "foreign_owner" and f"is in {theirs}, owned by uid {NOBODY}" \
        in problem.text


def test_the_mount_points_are_read_with_their_escapes(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text("22 1 0:21 / / rw - overlay overlay rw\n"
                    "46 22 0:40 / /run/bps rw,relatime - tmpfs none rw,mode=777\n"
                    "47 22 0:41 / /mnt/with\\040space rw - tmpfs none rw\n")
    assert sockdir.mount_points(str(info)) == {"/", "/run/bps", "/mnt/with space"}
    assert sockdir.mount_points(str(tmp_path / "missing")) == frozenset()
    assert "/" in sockdir.mount_points()


@pytest.mark.skipif(ME != 0, reason="mounting a tmpfs needs root")
def test_a_real_volume_of_mode_777_holds_the_socket_directory(tmp_path):
    """As in a pod: a tmpfs of mode 777 mounted for the purpose (skipped where this box may not mount)."""
    volume = _dir(tmp_path, "volume", 0o755)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0777,size=1m", "none", volume],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        sockdir.ensure_socket_dir(os.path.join(volume, "sock"))
        beside = _dir(tmp_path, "beside", 0o777)  # the same mode, but no volume: refused
        with pytest.raises(sockdir.UnsafeSocketDirError, match="without the sticky bit"):
            sockdir.ensure_socket_dir(os.path.join(beside, "sock"))
    finally:
        subprocess.run(["umount", volume], check=True)


@pytest.mark.skipif(ME != 0, reason="chown to another uid needs root")
def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    """What the issue saw: another user pre-created the directory (here mode 755, so not writable by us either)."""
    path = _dir(tmp_path, "squatted", 0o755, owner=NOBODY)
    problem = sockdir.socket_dir_problem(path)
    assert problem is not None and problem.kind == "foreign_owner"
    assert f"uid {NOBODY}" in problem.text and f"uid {ME}" in problem.text
    with pytest.raises(sockdir.UnsafeSocketDirError, match=f"{path} is owned by uid {NOBODY}"):
        sockdir.ensure_socket_dir(path)


@pytest.mark.skipif(ME != 0, reason="chown to another uid needs root")
def test_the_owner_is_judged_for_the_uid_given(tmp_path):
    path = _dir(tmp_path, "theirs", 0o700, owner=NOBODY)
    assert sockdir.socket_dir_problem(path, uid=NOBODY) is None
    assert sockdir.socket_dir_problem(str(tmp_path), uid=NOBODY) is None  # root's: trusted by everyone


@pytest.mark.skipif(ME != 0, reason="lchown to another uid needs root")
def test_a_symbolic_link_owned_by_another_user_is_refused_even_to_our_directory(tmp_path):
    target = _dir(tmp_path, "target", 0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    assert sockdir.socket_dir_problem(str(link)) is None  # our own link to our own directory
    os.lchown(link, NOBODY, -1)
    problem = sockdir.socket_dir_problem(str(link))
    assert problem is not None and problem.kind == "foreign_link"


@pytest.mark.skipif(ME != 0, reason="lchown to another uid needs root")
def test_a_symbolic_link_of_another_user_higher_up_the_path_is_refused(tmp_path):
    """Another user's link in /tmp pointing at a safe directory of ours: the socket directory below it was
    taken (the directories above it were judged by the real path only), then the link's owner pointed it at
    a directory of theirs, and the training processes connected to their socket (a review's reproducer)."""
    safe = _dir(tmp_path, "real", 0o755)
    os.mkdir(os.path.join(safe, "run"), 0o755)
    link = tmp_path / "link"
    link.symlink_to(safe)
    assert sockdir.socket_dir_problem(str(link / "run")) is None  # our own link: followed
    os.lchown(link, NOBODY, -1)
    problem = sockdir.socket_dir_problem(str(link / "run"))
    assert problem is not None and problem.kind == "foreign_link", problem
    assert problem.text == (f"is reached through {link}, a symbolic link owned by uid {NOBODY}, not by this user "
                            f"(uid {ME}); it could be pointed elsewhere")
    with pytest.raises(sockdir.UnsafeSocketDirError, match="is reached through"):
        sockdir.ensure_socket_dir(str(link / "run" / "deeper"))


@pytest.mark.skipif(ME != 0, reason="lchown to another uid needs root")
def test_a_foreign_link_followed_by_dot_dot_is_resolved_as_the_kernel_does(tmp_path):
    """``link/..`` is the parent of the link's target, not the directory the link is in: a textual normalisation
    (os.path.abspath) dropped both, and the foreign link (and the directory it leads to) went unchecked; a
    socket at ``link2/../w0.sock`` was bound in another user's directory (a review's reproducer)."""
    safe = _dir(tmp_path, "safe", 0o755)
    os.mkdir(os.path.join(safe, "run"), 0o755)
    os.mkdir(os.path.join(safe, "sockdir"), 0o755)
    link = tmp_path / "link"
    link.symlink_to(os.path.join(safe, "run"))
    assert sockdir.socket_dir_problem(f"{link}/../sockdir") is None  # our own link: followed
    os.lchown(link, NOBODY, -1)
    problem = sockdir.socket_dir_problem(f"{link}/../sockdir")
    assert problem is not None and problem.kind == "foreign_link" and f"through {link}," in problem.text, problem
    evil = _dir(tmp_path, "evil", 0o755, owner=NOBODY)
    os.mkdir(os.path.join(evil, "sub"), 0o755)
    os.chown(os.path.join(evil, "sub"), NOBODY, -1)
    theirs = tmp_path / "theirs"
    theirs.symlink_to(os.path.join(evil, "sub"))
    os.lchown(theirs, NOBODY, -1)
    with pytest.raises(sockdir.UnsafeSocketDirError, match="a symbolic link owned by uid 65534"):
        sockdir.ensure_socket_dir(f"{theirs}/../made")
    assert os.listdir(evil) == ["sub"]  # nothing made there before the refusal
    os.lchown(theirs, ME, -1)  # our link now, to their directory: the directory is theirs
    with pytest.raises(sockdir.UnsafeSocketDirError, match=f"owned by uid {NOBODY}"):
        sockdir.ensure_socket_dir(f"{theirs}/..")


def test_a_link_of_ours_in_a_directory_others_may_write_is_refused(tmp_path):
    """Our own link, but in a directory anyone may write without the sticky bit: they could replace it."""
    safe = _dir(tmp_path, "real", 0o755)
    shared = _dir(tmp_path, "shared", 0o777)
    link = Path(shared) / "link"
    link.symlink_to(safe)
    problem = sockdir.socket_dir_problem(str(link / "."), mounts=frozenset())
    assert problem is not None and problem.kind == "writable" and f"is in {shared}," in problem.text, problem
    sticky = _dir(tmp_path, "sticky", 0o1777)
    (Path(sticky) / "link").symlink_to(safe)
    assert sockdir.socket_dir_problem(str(Path(sticky) / "link" / "."), mounts=frozenset()) is None


def test_a_directory_that_cannot_be_reached_is_a_problem_not_an_exception(tmp_path):
    """A component that is a file, a loop of links: the launcher printed a traceback (a review)."""
    (tmp_path / "file").write_text("")
    problem = sockdir.socket_dir_problem(str(tmp_path / "file" / "sub"))
    assert problem is not None and problem.kind == "not_a_directory" and problem.text == \
        "cannot be reached: Not a directory", problem
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    problem = sockdir.socket_dir_problem(str(tmp_path / "loop" / "sub"))
    assert problem is not None and "Too many levels of symbolic links" in problem.text, problem
    moved, why = sockdir.launch_socket_path(str(tmp_path / "file" / "sub" / "w0.sock"), str(tmp_path), 0)
    assert moved == str(tmp_path / "worker-0.sock") and why is not None and why.kind == "not_a_directory"


def test_missing_and_not_a_directory(tmp_path):
    missing = sockdir.socket_dir_problem(str(tmp_path / "nope"))
    assert missing is not None and missing.kind == "missing"
    (tmp_path / "file").write_text("")
    not_dir = sockdir.socket_dir_problem(str(tmp_path / "file"))
    assert not_dir is not None and not_dir.kind == "not_a_directory"


def test_the_daemon_creates_a_missing_directory_not_writable_by_others(tmp_path):
    path = str(tmp_path / "run" / "bps")
    old = os.umask(0o002)  # a umask that would leave it group-writable
    try:
        sockdir.ensure_socket_dir(path)
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o755
    assert sockdir.socket_dir_problem(path) is None


def test_private_base_is_a_safe_xdg_runtime_dir_only(tmp_path):
    safe = _dir(tmp_path, "runtime", 0o700)
    assert sockdir.private_base({"XDG_RUNTIME_DIR": safe}) == safe
    assert sockdir.private_base({"XDG_RUNTIME_DIR": _dir(tmp_path, "open", 0o777)}) is None
    assert sockdir.private_base({"XDG_RUNTIME_DIR": "relative/dir"}) is None
    assert sockdir.private_base({}) is None


def test_the_launcher_keeps_a_safe_socket_and_moves_the_others(tmp_path):
    private = _dir(tmp_path, "private", 0o700)
    mine = _dir(tmp_path, "mine", 0o700)
    assert sockdir.launch_socket_path(f"{mine}/w0.sock", private, 0) == (f"{mine}/w0.sock", None)
    path, problem = sockdir.launch_socket_path(str(tmp_path / "missing" / "w1.sock"), private, 1)
    assert path == f"{private}/worker-1.sock" and problem is not None and problem.kind == "missing"
    shared = _dir(tmp_path, "shared", 0o1777)
    path, problem = sockdir.launch_socket_path(f"{shared}/w0.sock", private, 0)
    assert path == f"{private}/worker-0.sock" and problem is not None and problem.kind == "writable"
