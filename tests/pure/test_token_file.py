"""bps_worker.token_file and the token of generated cluster files (issue 14, item 2: a token by default)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from bps_worker.cluster_file import write_config
from bps_worker.token_file import TOKEN_BYTES, ensure_token, make_token
from protocol.config import load_config, read_token
from protocol.errors import ConfigError


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_make_token_writes_32_random_bytes_as_hex_mode_600(tmp_path):
    path = tmp_path / "new" / "dir" / "token"
    assert make_token(str(path)) is True
    text = path.read_text()
    assert text.endswith("\n") and len(text.strip()) == 2 * TOKEN_BYTES and int(text, 16) >= 0
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert os.listdir(path.parent) == ["token"]  # no temporary file left
    other = tmp_path / "other"
    make_token(str(other))
    assert other.read_text() != text


def test_make_token_never_replaces_a_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("mine")
    assert make_token(str(path)) is False
    assert path.read_text() == "mine" and os.listdir(tmp_path) == ["token"]
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    assert make_token(str(link)) is False and not (tmp_path / "elsewhere").exists()


def test_racing_makers_agree_on_one_whole_token(tmp_path):
    path = tmp_path / "token"
    made: list[bool] = []
    threads = [threading.Thread(target=lambda: made.append(make_token(str(path)))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made.count(True) == 1 and len(path.read_text().strip()) == 2 * TOKEN_BYTES
    assert os.listdir(tmp_path) == ["token"]


def test_ensure_token_makes_the_configured_one_once(tmp_path):
    path = write_config(tmp_path, [1], cpu_servers=0, cluster={"token_file": str(tmp_path / "t" / "token")})
    config = load_config(path)
    assert ensure_token(config) == str(tmp_path / "t" / "token")
    first = read_token(config)
    assert first is not None and len(first) == 2 * TOKEN_BYTES
    ensure_token(config)
    assert read_token(config) == first
    assert ensure_token(load_config(write_config(tmp_path / "none", [1], cpu_servers=0, token=False))) is None


def test_ensure_token_that_cannot_be_made_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = load_config(write_config(tmp_path, [1], cpu_servers=0, cluster={"token_file": f"{blocker}/token"}))
    with pytest.raises(ConfigError, match=f"cluster.token_file '{blocker}/token' cannot be created: Not a directory"):
        ensure_token(config)


def test_generated_cluster_files_have_a_private_token(tmp_path):
    path = write_config(tmp_path, [1, 1], cpu_servers=1)
    config = load_config(path)
    assert config.token_file == str(tmp_path / "token") and _mode(tmp_path / "token") == 0o600
    token = read_token(config)
    assert token is not None and len(token) == 2 * TOKEN_BYTES
    assert read_token(load_config(write_config(tmp_path, [1, 1], cpu_servers=1))) == token  # rewritten: kept


def test_generated_cluster_files_without_a_token_or_with_the_callers(tmp_path):
    assert load_config(write_config(tmp_path / "a", [1], cpu_servers=0, token=False)).token_file is None
    assert not (tmp_path / "a" / "token").exists()
    theirs = str(tmp_path / "theirs")
    assert load_config(write_config(tmp_path / "b", [1], cpu_servers=0,
                                    cluster={"token_file": theirs})).token_file == theirs
    assert not (tmp_path / "b" / "token").exists()
