"""The house's import rules, read from the source (no module is imported):

- ``protocol`` imports nothing of ours (it is the wire contract, sans-IO);
- ``bps_runtime`` imports only ``protocol``;
- neither daemon package imports the other (``bps_server`` <-> ``bps_worker``);
- the client package and the torch layer (with its DDP hook and asynchronous mode) import no daemon module: only ``protocol``,
  ``bps_runtime``, ``bps_worker.errors`` and the client package itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OURS = ("protocol", "bps_runtime", "bps_server", "bps_worker")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    base = REPO.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module of ours that ``path`` imports (absolute names; relative imports resolved)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # ``from bps_worker import client`` imports the submodule too
            found.extend((node.lineno, f"{target}.{alias.name}") for alias in node.names
                         if _is_module(f"{target}.{alias.name}"))
    return [(line, name) for line, name in found if name.split(".")[0] in OURS]


def _is_client(module: str) -> bool:
    return (module == "bps_worker.client" or module.startswith("bps_worker.client.")
            or module in ("bps_worker.torch", "bps_worker.torch_ddp", "bps_worker.torch_async"))


def _allowed(module: str, target: str) -> bool:
    top = target.split(".")[0]
    if module.startswith("protocol"):
        return top == "protocol"
    if module.startswith("bps_runtime"):
        return top in ("protocol", "bps_runtime")
    if _is_client(module):
        if top in ("protocol", "bps_runtime"):
            return True
        return target in ("bps_worker", "bps_worker.errors") or _is_client(target)
    if module.startswith("bps_server"):
        return top != "bps_worker"
    if module.startswith("bps_worker"):
        return top != "bps_server"
    return True


def _package_files() -> list[Path]:
    return sorted(p for top in OURS for p in (REPO / top).rglob("*.py"))


def test_every_package_file_is_checked():
    names = {_module_name(p) for p in _package_files()}
    assert {"protocol.frames", "bps_runtime.kernels", "bps_server.main", "bps_worker.main",
            "bps_worker.torch"} <= names
    assert any(_is_client(n) for n in names)


@pytest.mark.parametrize("path", _package_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_follow_the_data_path(path: Path):
    module = _module_name(path)
    bad = [f"{path.relative_to(REPO)}:{line} imports {target}" for line, target in _imports(path)
           if not _allowed(module, target)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module, target, allowed", [
    ("protocol.frames", "bps_runtime.kernels", False),
    ("protocol.frames", "protocol.errors", True),
    ("bps_runtime.segments", "bps_worker.errors", False),
    ("bps_runtime.segments", "protocol.config", True),
    ("bps_server.server", "bps_worker.placement", False),
    ("bps_worker.daemon", "bps_server.aggregator", False),
    ("bps_worker.daemon", "bps_runtime.kernels", True),
    ("bps_worker.client", "bps_worker.daemon", False),
    ("bps_worker.client.connection", "bps_worker.link", False),
    ("bps_worker.torch", "bps_worker.launch", False),
    ("bps_worker.torch", "bps_worker.client.adapter", True),
    ("bps_worker.torch", "bps_worker.errors", True),
    ("bps_worker.torch", "bps_worker.torch_ddp", True),
    ("bps_worker.torch", "bps_worker.torch_async", True),
    ("bps_worker.torch_async", "bps_worker.operation", False),
    ("bps_worker.torch_ddp", "bps_worker.daemon", False),
    ("bps_worker.client", "bps_server.timeline", False),
])
def test_the_rule_itself(module: str, target: str, allowed: bool):
    """The rule refuses what it must (so the test above can fail)."""
    assert _allowed(module, target) is allowed


def test_relative_imports_are_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pkg = tmp_path / "bps_worker" / "client"
    pkg.mkdir(parents=True)
    (pkg / "connection.py").write_text("from ..daemon import WorkerDaemon\nfrom . import handle\n")
    (pkg / "handle.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    names = [t for _, t in _imports(pkg / "connection.py")]
    assert "bps_worker.daemon" in names and "bps_worker.client.handle" in names
    assert not _allowed("bps_worker.client.connection", "bps_worker.daemon")
