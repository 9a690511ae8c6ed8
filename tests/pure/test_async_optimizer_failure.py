"""bps_worker.torch_async without daemons: a failed push leaves the parameters at their last value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bps_worker.torch_async as ta
from bps_worker.errors import BPSError


def test_a_failed_push_puts_the_bucket_back_so_its_delta_is_never_pushed_twice(monkeypatch: pytest.MonkeyPatch):
    """The servers may have added the delta of a push whose answer failed; left in the parameters it would
    travel again inside the next step's new - old."""
    p = torch.nn.Parameter(torch.zeros(3))
    params = ta.AsyncParameters([("p", p)], bucket_bytes=1 << 20, staleness=None)
    (bucket,) = params.buckets
    bucket.old = np.array([1.0, 2.0, 3.0], np.float32)
    with torch.no_grad():
        p.copy_(torch.tensor([5.0, 5.0, 5.0]))  # the local step
    pushed: list[np.ndarray] = []
    monkeypatch.setattr(ta._adapter, "start_async", lambda delta, name: pushed.append(delta.copy()) or name)

    def fail(handle: object) -> np.ndarray:
        raise BPSError("worker 2 is gone (the delta was added)")

    monkeypatch.setattr(ta, "_synchronize", fail)
    with pytest.raises(BPSError, match="worker 2 is gone"):
        params.push()
    assert pushed[0].tolist() == [4.0, 3.0, 2.0]
    assert p.detach().tolist() == [1.0, 2.0, 3.0]  # back to the last value: the next push carries no old delta
