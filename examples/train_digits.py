"""Data-parallel training of a small CNN on scikit-learn's digits data set, over BytePS.

Run it on a one-box cluster (2 workers x 2 training processes, 3 servers), with the venv active
(``. .venv/bin/activate``; ``make demo`` runs the first line)::

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

Asynchronous (parameter-server) training: ``--async`` wraps the optimizer with
``asynchronous=True``: each process steps on its own gradients and pushes the
change of its weights; the servers add every process's change as it arrives and
send back the weights, so nobody waits for anybody (``--staleness S``: no machine
more than S steps ahead of the slowest). Every process's step counts, so the
learning rate is divided by the number of processes (a round of steps then moves
the weights as far as one synchronous step). ``--straggler RANK:FACTOR`` makes one
process FACTOR times slower (it sleeps after each step's computation), to see
the difference::

    bps-launch --config configs/local.toml -- python examples/train_digits.py --async --straggler 3:3

``--history FILE`` writes rank 0's test accuracy over time and the summary's
figures as JSON (``benchmarks/async_straggler.py`` reads it).

Rank 0 shows a progress bar, evaluates test accuracy after each epoch and prints
a summary at the end. The exit status is non-zero if the final test accuracy is
below 0.85. The data set ships with scikit-learn (1797 8x8 images); nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

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


def load_torch_data(device: torch.device | str = "cpu") -> TorchData:
    """The shared split (examples/digits.py) as tensors on ``device``."""
    d = load_data()
    return TorchData(*(torch.from_numpy(a).to(device) for a in (d.x_train, d.y_train, d.x_test, d.y_test)))


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
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="asynchronous (parameter-server) training; the learning rate is divided by the processes")
    p.add_argument("--staleness", type=int, default=None,
                   help="with --async: no machine more than this many steps ahead of the slowest (default: none)")
    p.add_argument("--straggler", type=_straggler, default=None, metavar="RANK:FACTOR",
                   help="make process RANK FACTOR times slower (it sleeps after each step's computation)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: each process trains on GPU (its local rank modulo the GPUs), and its gradients go "
                        "to the worker daemon by CUDA IPC (default: cpu)")
    p.add_argument("--history", default=None, metavar="FILE",
                   help="rank 0 writes its test accuracy over time and the summary's figures to FILE (JSON)")
    args = p.parse_args(argv)
    if args.staleness is not None and (not args.asynchronous or args.staleness < 0):
        p.error("--staleness needs --async and a value >= 0")
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device (a CPU build of torch, or no GPU)")
    if args.lr is None:
        args.lr = 0.1 if args.optimizer == "sgd" else 0.01
    return args


def _straggler(text: str) -> tuple[int, float]:
    try:
        rank, factor = text.split(":")
        result = int(rank), float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--straggler takes RANK:FACTOR, e.g. 3:3, not {text!r}") from None
    if result[0] < 0 or result[1] < 1:
        raise argparse.ArgumentTypeError(f"--straggler {text}: RANK must be >= 0 and FACTOR >= 1")
    return result


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


@dataclass
class Progress:
    """What one process measured while training."""

    steps: int = 0
    samples: int = 0
    sync_s: float = 0.0
    epoch_loss: float = float("nan")
    wall: float = 0.0
    history: list[tuple[float, float]] = field(default_factory=list)  # rank 0: (seconds, test accuracy)


def make_optimizer(args: argparse.Namespace, model: nn.Module, size: int) -> bps.DistributedOptimizer:
    lr = args.lr / size if args.asynchronous else args.lr
    if args.optimizer == "sgd":
        base: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        base = torch.optim.Adam(model.parameters(), lr=lr)
    return bps.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    compression=getattr(bps.Compression, args.compression),
                                    asynchronous=args.asynchronous, staleness=args.staleness)


def train(args: argparse.Namespace) -> int:
    rank, size = bps.rank(), bps.size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", bps.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    data = load_torch_data(device)
    # Different seeds per rank on purpose: the broadcast must make the replicas identical.
    torch.manual_seed(SEED + rank)
    model = DigitsCNN().to(device)
    optimizer = make_optimizer(args, model, size)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)  # asynchronous: the servers' values start here
    if not args.asynchronous:
        bps.broadcast_optimizer_state(optimizer, 0)
    check_replicas(model, size)
    torch.manual_seed(SEED)
    progress = run_epochs(args, model, optimizer, data)
    if args.asynchronous:
        bps.push_pull(torch.zeros(1), "stats.done")  # everyone finished: the servers' value is final
        optimizer.zero_grad()
        optimizer.step()  # no gradient: a zero change, the final value back
        check_replicas(model, size)
    test_acc = accuracy(model, data.x_test, data.y_test)
    return summary(args, progress, test_acc, len(data.y_train), len(data.y_test))


def run_epochs(args: argparse.Namespace, model: nn.Module, optimizer: bps.DistributedOptimizer,
               data: TorchData) -> Progress:
    """Every epoch over this rank's shard; the straggler sleeps (FACTOR - 1) x its computation each step."""
    rank, size = bps.rank(), bps.size()
    slow = args.straggler[1] - 1 if args.straggler and args.straggler[0] == rank else 0.0
    progress = Progress()
    t_start = time.perf_counter()
    for epoch in range(args.epochs):
        idx = torch.from_numpy(shard_indices(len(data.y_train), epoch, rank, size)).to(data.y_train.device)
        bar = tqdm(torch.split(idx, args.batch_size), desc=f"epoch {epoch + 1}/{args.epochs}", unit="step",
                   disable=rank != 0, file=sys.stderr, dynamic_ncols=True)
        loss_sum, loss_n = 0.0, 0
        for batch in bar:
            t0 = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data.x_train[batch]), data.y_train[batch])
            loss.backward()  # each gradient's push_pull starts as soon as backward has produced it
            if slow:
                time.sleep(slow * (time.perf_counter() - t0))
            t0 = time.perf_counter()
            optimizer.synchronize()  # what step() would do first: wait for the averages, write them to .grad
            progress.sync_s += time.perf_counter() - t0
            with optimizer.skip_synchronize():
                optimizer.step()  # asynchronous: also the push of the weights' change, and the value back
            progress.steps += 1
            progress.samples += len(batch)
            loss_sum += loss.item() * len(batch)
            loss_n += len(batch)
            bar.set_postfix(loss=f"{loss.item():.4f}")
            if rank == 0 and args.history and progress.steps % 5 == 0:
                progress.history.append((time.perf_counter() - t_start, accuracy(model, data.x_test, data.y_test)))
        bar.close()
        progress.epoch_loss = end_of_epoch(args, model, epoch, loss_sum / loss_n, data)
    progress.wall = time.perf_counter() - t_start
    return progress


def end_of_epoch(args: argparse.Namespace, model: nn.Module, epoch: int, loss: float, data: TorchData) -> float:
    """The epoch's training loss: the cluster's mean (synchronous: a barrier anyway), this rank's (asynchronous:
    no process waits for another). Rank 0 prints it with the test accuracy of its weights."""
    if not args.asynchronous:
        loss = float(bps.push_pull(torch.tensor([loss], dtype=torch.float64), "stats.epoch_loss")[0])
        check_replicas(model, bps.size())
    if bps.rank() == 0:
        print(f"epoch {epoch + 1}: train loss {loss:.4f}, test accuracy "
              f"{accuracy(model, data.x_test, data.y_test):.4f}", flush=True)
    return loss


def summary(args: argparse.Namespace, progress: Progress, test_acc: float, n_train: int, n_test: int) -> int:
    """Every rank's counts summed; rank 0 prints the summary (and writes --history)."""
    rank, size = bps.rank(), bps.size()
    straggler = args.straggler[0] if args.straggler else -1
    totals = bps.push_pull(torch.tensor([progress.samples, progress.steps], dtype=torch.int64), "stats.counts",
                           average=False)
    fast = straggler < 0 or rank // bps.local_size() != straggler // bps.local_size()  # not on its machine
    rates = bps.push_pull(torch.tensor([progress.samples / progress.wall if fast else 0.0, float(fast),
                                        progress.wall if fast else 0.0, progress.sync_s / progress.wall],
                                       dtype=torch.float64), "stats.rates", average=False).tolist()
    walls = bps.push_pull(torch.tensor([progress.wall, progress.wall if rank == straggler else 0.0],
                                       dtype=torch.float64), "stats.wall", average=False)
    ok = test_acc >= MIN_ACCURACY
    figures = {"mode": mode(args), "test_accuracy": test_acc, "fast_samples_per_s": rates[0] / rates[1],
               "fast_wall_s": rates[2] / rates[1], "mean_wall_s": float(walls[0]) / size,
               "straggler_wall_s": float(walls[1]),
               "samples": int(totals[0]), "history": progress.history}
    if rank == 0:
        print("\n".join([
            "--- train_digits summary ---",
            f"cluster:        {cluster_description(size)}",
            f"mode:           {mode(args)}" + (f", rank {straggler} {args.straggler[1]:g}x slower" if args.straggler else ""),
            f"optimizer:      {args.optimizer}, lr {args.lr:g}{f' / {size}' if args.asynchronous else ''}, batch "
            f"{args.batch_size} per process ({args.batch_size * size} global), bps.DistributedOptimizer, "
            f"compression {args.compression}",
            f"training set:   {n_train} samples ({n_train // size} per process per epoch), test set: {n_test} samples",
            f"epochs:         {args.epochs}, on {device_description(args)}",
            f"steps:          {progress.steps} per process ({int(totals[1])} in all)",
            f"final loss:     {progress.epoch_loss:.4f} (mean over the last epoch, "
            f"{'rank 0' if args.asynchronous else 'all processes'})",
            f"test accuracy:  {test_acc:.4f}" + ("" if ok else f"  (below {MIN_ACCURACY}: FAILED)"),
            f"throughput:     {int(totals[0]) / progress.wall:.0f} samples/s ({int(totals[0])} samples in "
            f"{progress.wall:.2f} s); {figures['fast_samples_per_s']:.0f} samples/s per process that is not a "
            f"straggler, which finish in {figures['fast_wall_s']:.2f} s"
            + (f" (the straggler in {figures['straggler_wall_s']:.2f} s)" if args.straggler else ""),
            f"sync wait:      {progress.sync_s / progress.wall:.1%} of training time on rank 0, {rates[3] / size:.1%} "
            f"mean over processes (time in optimizer.step()'s synchronization)",
        ]), flush=True)
        if args.history:
            with open(args.history, "w") as f:
                json.dump(figures, f)
    return 0 if ok else 1


def device_description(args: argparse.Namespace) -> str:
    if args.device == "cpu":
        return "the CPU"
    gpus = torch.cuda.device_count()
    return f"CUDA ({torch.cuda.get_device_name(0)}; {gpus} GPU{'s' if gpus > 1 else ''} on this machine)"


def mode(args: argparse.Namespace) -> str:
    if not args.asynchronous:
        return "synchronous"
    return "asynchronous" + ("" if args.staleness is None else f", staleness {args.staleness}")


if __name__ == "__main__":
    sys.exit(main())
