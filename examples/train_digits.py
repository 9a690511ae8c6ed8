"""Data-parallel training of a small CNN on scikit-learn's digits data set, over BytePS.

Run it on a one-box cluster (2 workers x 2 training processes, 3 servers)::

    bps-launch --config configs/local.toml -- python examples/train_digits.py

or with options::

    bps-launch --config configs/local.toml -- python examples/train_digits.py --epochs 5 --optimizer sgd --lr 0.1
    bps-launch --config configs/local.toml -- python examples/train_digits.py --compression bf16

Every training process (rank ``r`` of ``N``) trains on its own shard of the
training split: the split is re-shuffled each epoch with a seed that depends on
the epoch only (so every rank sees the same permutation) and rank ``r`` takes
every ``N``-th sample starting at ``r``. It uses BytePS's PyTorch layer
(``import bps_worker.torch as bps``) the way a Horovod user would::

    optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)   # every rank starts from rank 0's weights
    bps.broadcast_optimizer_state(optimizer, 0)                 # ... and rank 0's optimizer state

The wrapped optimizer starts the push_pull of each gradient as soon as backward
has produced it (communication overlaps the rest of backward, front layers
first), and its ``step()`` waits for the averages before updating the weights,
so the replicas stay identical; this is checked once per epoch. The loop calls
``optimizer.synchronize()`` itself and then ``step()`` inside
``optimizer.skip_synchronize()`` only to time the wait ("sync wait" in the
summary); a plain ``optimizer.step()`` does both. ``--compression fp16|bf16``
sends the gradients in half precision.

Rank 0 shows a progress bar, evaluates test accuracy after each epoch and prints
a summary at the end. The exit status is non-zero if the final test accuracy is
below 0.85. The data set ships with scikit-learn (1797 8x8 images); nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import bps_worker.torch as bps
from digits import MIN_ACCURACY, SEED, cluster_description, load_data, shard_indices

COMPRESSIONS = ("none", "fp16", "bf16")


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, one 2x2 max-pool, two fully connected layers (no buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


@dataclass
class TorchData:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_torch_data() -> TorchData:
    """The shared split (examples/digits.py) as tensors."""
    d = load_data()
    return TorchData(*(torch.from_numpy(a) for a in (d.x_train, d.y_train, d.x_test, d.y_test)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Data-parallel CNN training on the digits data set over BytePS.")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training split (default: 3)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step per process (default: 32)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: 0.1 for sgd, 0.01 for adam)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="adam",
                   help="SGD with momentum 0.9, or Adam (default: adam)")
    p.add_argument("--compression", choices=COMPRESSIONS, default="none",
                   help="gradients on the wire: none (float32), fp16 or bf16 (default: none)")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if args.lr is None:
        args.lr = 0.1 if args.optimizer == "sgd" else 0.01
    return args


def check_replicas(model: nn.Module, size: int) -> None:
    """Cheap consistency check: the cluster-wide sum of the parameter checksums is ``size`` times ours."""
    local = sum(float(p.detach().double().sum()) for p in model.parameters())
    total = float(bps.push_pull(torch.tensor([local], dtype=torch.float64), "check.param_sum", average=False)[0])
    if not np.isclose(total, size * local, rtol=1e-12, atol=1e-12):
        raise RuntimeError(f"replicas diverged: parameter checksum {local!r} x {size} != cluster sum {total!r}")


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    pred = model(x).argmax(dim=1)
    model.train()
    return float((pred == y).double().mean())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    np.random.seed(SEED)

    bps.init()
    try:
        return train(args)
    finally:
        bps.shutdown()


def train(args: argparse.Namespace) -> int:
    rank, size = bps.rank(), bps.size()
    data = load_torch_data()
    n_train = len(data.y_train)

    # Different seeds per rank on purpose: the broadcast must make the replicas identical.
    torch.manual_seed(SEED + rank)
    model = DigitsCNN()
    if args.optimizer == "sgd":
        base: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    else:
        base = torch.optim.Adam(model.parameters(), lr=args.lr)
    optimizer = bps.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                         compression=getattr(bps.Compression, args.compression))
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(optimizer, 0)
    check_replicas(model, size)
    torch.manual_seed(SEED)

    steps = 0
    samples = 0
    sync_s = 0.0
    epoch_loss = float("nan")
    test_acc = float("nan")
    t_start = time.perf_counter()
    for epoch in range(args.epochs):
        idx = torch.from_numpy(shard_indices(n_train, epoch, rank, size))
        batches = torch.split(idx, args.batch_size)
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", unit="step", disable=rank != 0,
                   file=sys.stderr, dynamic_ncols=True)
        loss_sum, loss_n = 0.0, 0
        for batch in bar:
            x, y = data.x_train[batch], data.y_train[batch]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # each gradient's push_pull starts as soon as backward has produced it
            t0 = time.perf_counter()
            optimizer.synchronize()  # what step() would do first: wait for the averages, write them to .grad
            sync_s += time.perf_counter() - t0
            with optimizer.skip_synchronize():
                optimizer.step()
            steps += 1
            samples += len(batch)
            loss_sum += loss.item() * len(batch)
            loss_n += len(batch)
            bar.set_postfix(loss=f"{loss.item():.4f}")
        bar.close()
        # Cluster-wide mean training loss of the epoch (every rank saw the same number of samples).
        epoch_loss = float(bps.push_pull(torch.tensor([loss_sum / loss_n], dtype=torch.float64),
                                         "stats.epoch_loss")[0])
        check_replicas(model, size)
        test_acc = accuracy(model, data.x_test, data.y_test)
        if rank == 0:
            print(f"epoch {epoch + 1}: train loss {epoch_loss:.4f}, test accuracy {test_acc:.4f}", flush=True)
    wall = time.perf_counter() - t_start

    # Every rank processed the same number of samples; still, sum the real counts.
    totals = bps.push_pull(torch.tensor([samples, steps], dtype=torch.int64), "stats.counts", average=False)
    sync_frac = float(bps.push_pull(torch.tensor([sync_s / wall], dtype=torch.float64), "stats.sync_fraction")[0])
    ok = test_acc >= MIN_ACCURACY
    if rank == 0:
        print("\n".join([
            "--- train_digits summary ---",
            f"cluster:        {cluster_description(size)}",
            f"optimizer:      {args.optimizer}, lr {args.lr:g}, batch {args.batch_size} per process "
            f"({args.batch_size * size} global), bps.DistributedOptimizer, compression {args.compression}",
            f"training set:   {n_train} samples ({n_train // size} per process per epoch), "
            f"test set: {len(data.y_test)} samples",
            f"epochs:         {args.epochs}",
            f"steps:          {steps} per process ({int(totals[1])} in all)",
            f"final loss:     {epoch_loss:.4f} (mean over the last epoch, all processes)",
            f"test accuracy:  {test_acc:.4f}" + ("" if ok else f"  (below {MIN_ACCURACY}: FAILED)"),
            f"throughput:     {int(totals[0]) / wall:.0f} samples/s ({int(totals[0])} samples in {wall:.2f} s)",
            f"sync wait:      {sync_s / wall:.1%} of training time on rank 0, {sync_frac:.1%} mean over processes "
            f"(time in optimizer.step()'s synchronization)",
        ]), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
