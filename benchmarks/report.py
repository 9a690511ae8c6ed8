"""What the benchmark scripts print about the machine, and their tables (plain text and markdown)."""

from __future__ import annotations

import importlib
import os
import platform
from datetime import datetime
from pathlib import Path
from typing import Any


def machine(*modules: str) -> dict[str, str]:
    """nproc, CPU model, Python version, the versions of those of `modules` that import, and the Linux kernel."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"nproc": str(os.cpu_count()), "cpu": model, "python": platform.python_version()}
    for name in modules:
        try:
            info[name] = importlib.import_module(name).__version__
        except Exception:  # not installed: not reported
            pass
    info["kernel"] = platform.release()
    return info


def text_table(header: list[str], rows: list[list[str]], left: int = 0) -> str:
    """Columns two spaces apart under a dashed rule; the first `left` columns left-aligned, the others right."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def markdown_table(header: list[str], rows: list[list[str]], left: int = 0) -> str:
    """A markdown table; the first `left` columns left-aligned, the others right."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < left else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def section_head(started: datetime, title: str, command_line: str, machine_line: str) -> list[str]:
    """The first lines of a dated RESULTS.md section: its heading, the command (and where it ran), the machine."""
    return ["", f"### {started.strftime('%Y-%m-%d %H:%M %Z')}: {title}", "",
            f"- command: `{command_line.strip()}` (in `{os.getcwd()}`)",
            f"- machine: {machine_line}"]


def append_section(target: Path, lines: list[str]) -> None:
    """Append a section's lines to ``target`` (RESULTS.md or --output) and say so."""
    with target.open("a") as f:
        f.write("\n".join(lines))
    print(f"\nappended to {target}")


def cluster_line(config: Any, ranks: int) -> str:
    """One line on the cluster a benchmark ran on: its ranks per worker, its servers, its partitions."""
    shape = ", ".join(f"worker {w.id}: {w.local_size} processes" for w in config.worker_specs)
    colocated = sum(1 for s in config.servers if s.worker is not None)
    return (f"N = {ranks} ranks ({shape}); {len(config.servers)} servers ({colocated} colocated, "
            f"{len(config.servers) - colocated} CPU-only); partition_bytes = {config.partition_bytes}")


def machine_line(info: dict[str, str]) -> str:
    """One line on the machine (``machine("numpy", "torch")``'s answer)."""
    return (f"nproc {info['nproc']}, CPU {info['cpu']}; Python {info['python']}, numpy {info['numpy']}, "
            f"torch {info['torch']}, Linux {info['kernel']}")
