"""Making a cluster token: 32 random bytes as hex in a new file of mode 600.

``bps-launch`` makes the token its cluster file names when that file does not exist yet (so the one-box
demo runs authenticated), ``bps-launch --make-token PATH`` makes one to copy to every machine of a real
cluster, and the tests' cluster files (:func:`bps_worker.cluster_file.write_config`) get one each.

The file appears whole or not at all: the secret is written to a fresh temporary file (``O_CREAT |
O_EXCL``, mode 600, never a file that was already there) in the same directory, which is then hard-linked
to ``path`` -- a link never replaces an existing file, so of two launchers racing, one wins and both use
its token, and no reader ever sees a half-written one. Missing parent directories are created mode 700.
Reading and checking a token is :func:`protocol.config.read_token`'s.
"""

from __future__ import annotations

import errno
import os
import secrets
from typing import Final

from protocol.config import ClusterConfig, token_path
from protocol.errors import ConfigError

__all__ = ["TOKEN_BYTES", "ensure_token", "make_token"]

TOKEN_BYTES: Final = 32
FILE_MODE: Final = 0o600
DIR_MODE: Final = 0o700


def _write_new(path: str, data: bytes) -> None:
    """Create ``path`` (FileExistsError if it exists), mode 600, holding ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def make_token(path: str) -> bool:
    """Write a new token to ``path`` unless a file is there already; whether this call made it.

    OSError when the directory cannot be created or written.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), directory)
    os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
    data = secrets.token_hex(TOKEN_BYTES).encode() + b"\n"
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    _write_new(temporary, data)
    try:
        os.link(temporary, path, follow_symlinks=False)
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: create it in place (O_EXCL still never replaces)
        try:
            _write_new(path, data)
        except FileExistsError:
            return False
    finally:
        os.unlink(temporary)
    return True


def ensure_token(config: ClusterConfig) -> str | None:
    """Make the token ``config`` names if it does not exist yet; its path (None: the cluster has none).

    The file is not checked here: the daemons (and the launcher, before it starts them) read it with
    :func:`protocol.config.read_token`, which refuses one that others could read or change. ConfigError
    naming both files when it cannot be made.
    """
    path = token_path(config)
    if path is not None and not os.path.lexists(path):
        try:
            make_token(path)
        except OSError as exc:
            raise ConfigError(f"{config.source}: cluster.token_file {path!r} cannot be created: "
                              f"{exc.strerror}") from None
    return path
