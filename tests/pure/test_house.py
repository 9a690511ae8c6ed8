"""House rules that a reviewer would otherwise check by eye (STYLE.md, issue 13)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "bps_runtime", "bps_server", "bps_worker")
MAX_FUNCTION_LINES = 60
REASON = "Long because"  # a longer function says why in its docstring, in these words


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES and REASON not in (ast.get_docstring(node) or ""):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} has {lines} lines")
    return found


def _package_files() -> list[Path]:
    return sorted(p for top in PACKAGES for p in (REPO / top).rglob("*.py"))


@pytest.mark.parametrize("path", _package_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_function_over_60_lines_without_a_reason(path: Path):
    bad = _long_functions(path)
    assert not bad, "\n".join(bad)


def test_the_rule_finds_a_long_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n\ndef g():\n    '''{REASON} it must.'''\n{body}\n")
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    assert _long_functions(tmp_path / "m.py") == [f"m.py:1 f has {MAX_FUNCTION_LINES + 1} lines"]


def test_no_dated_notes_in_package_docstrings():
    """Measurements with dates belong in benchmarks/RESULTS.md, not in docstrings."""
    bad = []
    for path in _package_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "2026-" in line or "2025-" in line:
                bad.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_test_files_have_distinct_names():
    """The tiers have no ``__init__.py`` (pytest's rootdir imports): two test files of one basename in two
    tiers stop the whole run at collection ("import file mismatch")."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(REPO)} and {path.relative_to(REPO)}")
        seen.setdefault(path.name, path)
    assert not clashes, clashes
