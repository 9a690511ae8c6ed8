"""What the two digits examples share: the data set, each rank's shard of it, and the cluster's description.

``train_digits.py`` (PyTorch, bps_worker.torch) and ``train_digits_jax.py`` (JAX, the numpy client) train
on the same fixed split, cut the same way into per-rank shards, and print the same summary.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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
    """The fixed 80/20 split of the digits data set (stratified: each digit's fifth in the test split), standardized
    with the training split's mean and std."""
    images, labels = _digits()
    x = (images.astype(np.float32) / 16.0)[:, None, :, :]
    y = labels.astype(np.int64)
    rng = np.random.default_rng(SPLIT_SEED)
    test = np.zeros(len(y), dtype=bool)
    for digit in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == digit))
        test[members[:round(0.2 * len(members))]] = True
    x_tr, y_tr, x_te, y_te = x[~test], y[~test], x[test], y[test]
    mean, std = x_tr.mean(), x_tr.std()
    return Data((x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te)


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: 1,797 images of 8x8 values 0-16 and their labels, read from the file scikit-learn
    ships, without importing scikit-learn (about 2 CPU-s in every process, scipy.stats and more: most of each
    rank's start beside torch's, where the README's four processes share two cores). Its own loader where the
    file is not where it keeps it."""
    spec = importlib.util.find_spec("sklearn")  # (finds the package without running it)
    where = spec.submodule_search_locations if spec is not None else None
    path = Path(list(where)[0], "datasets", "data", "digits.csv.gz") if where else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.images, digits.target
    table = np.loadtxt(path, delimiter=",")  # (decompressed as it reads: a .gz name)
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1]


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
