"""Programs for the security tests (top-level, so spawn can import them): one sum, and what came of it."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

import bps_worker.client as bps


def one_sum(n: int, name: str) -> dict[str, Any]:
    """Push ``rank + 1`` in ``n`` floats; report the error (type and text) or whether the sum is right."""
    rank, size = bps.rank(), bps.size()
    start = time.monotonic()
    try:
        y = bps.push_pull(np.full(n, rank + 1, np.float32), name, average=False)
    except bps.BPSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    expected = size * (size + 1) / 2
    return {"error": None, "wrong": int((y != expected).sum()), "seconds": time.monotonic() - start}


def one_sum_hearing(n: int, name: str) -> dict[str, Any]:
    """:func:`one_sum`, plus every line the client logged meanwhile (the stall notices its daemon passed on)."""
    heard: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            heard.append(record.getMessage())

    handler = Keep()
    logging.getLogger("bps_worker.client").addHandler(handler)
    try:
        return dict(one_sum(n, name), heard=heard)
    finally:
        logging.getLogger("bps_worker.client").removeHandler(handler)
