"""Started by torchrun in test_torch.py: bps.init() from the environment (BPS_SOCKET, LOCAL_RANK)."""

from __future__ import annotations

import json
import os
import sys

import torch

import bps_worker.torch as bps


def main() -> None:
    torch.set_num_threads(1)
    bps.init()
    rank = bps.rank()
    y = bps.push_pull(torch.full((4,), float(rank + 1)), "torchrun.sum", average=False)
    z = bps.push_pull(torch.arange(3, dtype=torch.float64) * (rank + 1), "torchrun.mean")
    result = {"rank": rank, "size": bps.size(), "local_rank": bps.local_rank(), "local_size": bps.local_size(),
              "env_local_rank": os.environ.get("LOCAL_RANK"), "sum": y.tolist(), "mean": z.tolist()}
    bps.shutdown()
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
