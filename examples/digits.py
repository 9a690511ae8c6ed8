"""What the two digits examples share: the data set, each rank's shard of it, and the cluster's description.

``train_digits.py`` (PyTorch, bps_worker.torch) and ``train_digits_jax.py`` (JAX, the numpy client) train
on the same fixed split, cut the same way into per-rank shards, and print the same summary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from protocol.config import load_config

SEED = 1234
SPLIT_SEED = 42
MIN_ACCURACY = 0.85


@dataclass
class Data:
    """The split as numpy arrays: images ``(N, 1, 8, 8)`` float32, standardized; labels int64."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_data() -> Data:
    """The fixed 80/20 split of the digits data set, standardized with the training split's mean and std."""
    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=SPLIT_SEED, stratify=y)
    mean, std = x_tr.mean(), x_tr.std()
    return Data((x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te)


def shard_indices(n_train: int, epoch: int, rank: int, size: int) -> np.ndarray:
    """This rank's sample indices for ``epoch``: every ``size``-th of an epoch-seeded permutation.

    Every shard is cut to ``n_train // size`` samples so that all ranks run the
    same number of steps (a rank with one step more would wait forever).
    """
    perm = np.random.default_rng(SEED + 1000 * (epoch + 1)).permutation(n_train)
    return perm[rank::size][: n_train // size]


def cluster_description(size: int) -> str:
    """The cluster of ``BPS_CONFIG`` (set by bps-launch) in one line."""
    path = os.environ.get("BPS_CONFIG")
    if not path:
        return f"{size} processes (BPS_CONFIG not set)"
    cfg = load_config(path)
    cpu_only = sum(1 for s in cfg.servers if s.worker is None)
    per_worker = "+".join(str(w.local_size) for w in cfg.worker_specs)
    return (f"{size} processes on {cfg.workers} workers ({per_worker}), {len(cfg.servers)} servers "
            f"({cpu_only} CPU-only)")
