"""Synchronous vs asynchronous vs bounded training with one process made slower (issue 17).

Runs ``examples/train_digits.py`` on a one-box cluster (bps-launch) three times, with ``--straggler
RANK:FACTOR``: synchronous, ``--async`` and ``--async --staleness S``; reads each run's ``--history`` and
prints, per mode, the samples/s of the processes that are not on the straggler's machine, their wall time,
the final test accuracy; plots rank 0's test accuracy against time (PNG). With ``--results`` the table goes
into benchmarks/RESULTS.md.

    python benchmarks/async_straggler.py --workers 4 --epochs 5 --plot benchmarks/async_straggler.png --results
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bps_worker.cluster_file import write_config  # noqa: E402
from protocol.config import load_config  # noqa: E402
from report import (  # noqa: E402
    append_section,
    cluster_line,
    machine,
    machine_line,
    markdown_table,
    section_head,
    text_table,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4, help="machines of the one-box cluster (default: 4)")
    p.add_argument("--local-size", type=int, default=1, help="processes per machine (default: 1)")
    p.add_argument("--epochs", type=int, default=5, help="epochs of every run (default: 5)")
    p.add_argument("--straggler", default="3:3", help="RANK:FACTOR (default: 3:3, the last process 3x slower)")
    p.add_argument("--staleness", type=int, default=2, help="the bounded run's staleness (default: 2)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per mode; the one with the median wall time of the fast processes is reported "
                        "(a loaded machine's noise is larger than these sub-second runs; default: 1)")
    p.add_argument("--plot", default=None, help="PNG of rank 0's test accuracy over time")
    p.add_argument("--results", action="store_true", help="append the table to benchmarks/RESULTS.md")
    return p.parse_args(argv)


def run(config: Path, epochs: int, straggler: str, extra: list[str], history: Path) -> dict[str, Any]:
    """One training run under bps-launch; its --history figures."""
    command = [sys.executable, "-m", "bps_worker.launch", "--config", str(config), "--", sys.executable,
               str(ROOT / "examples" / "train_digits.py"), "--epochs", str(epochs), "--straggler", straggler,
               "--history", str(history), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(extra) or 'sync'} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(done.stdout.split("--- train_digits summary ---")[-1].strip(), flush=True)
    figures: dict[str, Any] = json.loads(history.read_text())
    return figures


def plot(runs: list[dict[str, Any]], path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        t, acc = zip(*r["history"]) if r["history"] else ((), ())
        ax.plot(t, acc, label=f"{r['mode']} ({r['test_accuracy']:.3f})")
    ax.set_xlabel("seconds since training started (rank 0)")
    ax.set_ylabel("test accuracy of rank 0's weights")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.now(timezone.utc)
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(Path(tmp), [args.local_size] * args.workers, cpu_servers=1)
        cluster = cluster_line(load_config(str(config)), args.workers * args.local_size)
        modes = [("synchronous", []), ("asynchronous", ["--async"]),
                 (f"asynchronous, staleness {args.staleness}", ["--async", "--staleness", str(args.staleness)])]
        runs = []
        for i, (_, extra) in enumerate(modes):
            tries = sorted((run(config, args.epochs, args.straggler, extra, Path(tmp) / f"h{i}.{k}.json")
                            for k in range(args.repeat)), key=lambda r: r["fast_wall_s"])
            runs.append(tries[len(tries) // 2])
    header = ["mode", "fast processes' samples/s", "their wall time (s)", "the straggler's (s)", "final test accuracy"]
    rows = [[r["mode"], f"{r['fast_samples_per_s']:.0f}", f"{r['fast_wall_s']:.2f}", f"{r['straggler_wall_s']:.2f}",
             f"{r['test_accuracy']:.4f}"] for r in runs]
    print("\n" + text_table(header, rows, left=1))
    rank, factor = args.straggler.split(":")
    title = (f"digits CNN, {args.epochs} epochs, {args.workers} machines x {args.local_size} processes, "
             f"rank {rank} {factor}x slower")
    picture = plot(runs, args.plot, title) if args.plot else None
    if args.results:
        command = " ".join(["python benchmarks/async_straggler.py", *(argv if argv is not None else sys.argv[1:])])
        lines = section_head(started, "asynchronous training with a straggler (issue 17)", command,
                             machine_line(machine("numpy", "torch")))
        lines += [f"- cluster: {cluster}; straggler {args.straggler} (RANK:FACTOR), {args.epochs} epochs, the "
                  f"median of {args.repeat} runs per mode (by the fast processes' wall time)", "",
                  markdown_table(header, rows, left=1), ""]
        if picture:
            lines += [f"![accuracy over time]({Path(picture).name})", ""]
        append_section(ROOT / "benchmarks" / "RESULTS.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
