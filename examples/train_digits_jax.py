"""Data-parallel training of a small JAX MLP on scikit-learn's digits data set, over BytePS's numpy client.

Run it on a one-box cluster (2 workers x 2 training processes, 3 servers), with the venv active
(``. .venv/bin/activate``)::

    bps-launch --config configs/local.toml -- python examples/train_digits_jax.py

or with options::

    bps-launch --config configs/local.toml -- python examples/train_digits_jax.py --epochs 5 --optimizer sgd
    bps-launch --config configs/local.toml -- python examples/train_digits_jax.py --flatten --no-reference

The data, its split and standardization, and every rank's shard of each epoch are
those of ``examples/train_digits.py`` (the images are flattened to 64 features).
The model is a 64 -> 128 -> 64 -> 10 MLP with ReLUs in pure JAX: its parameters
are a pytree (a dict of dicts of arrays), the loss is softmax cross-entropy, the
gradients come from ``jax.value_and_grad`` (jitted), and the optimizer (Adam, or
SGD with momentum 0.9) is written out in a few lines of ``jax.tree_util.tree_map``.

JAX has no BytePS layer; the framework-free numpy client (``import
bps_worker.client as bps``) is all a data-parallel step needs::

    loss, grads = value_and_grad(params, x, y)          # this rank's shard batch
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
    handles = [bps.push_pull_async(np.asarray(leaf), f"grad.{name(path)}", average=True)
               for path, leaf in paths_leaves]           # all leaves in flight at once
    grads = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(bps.synchronize(h)) for h in handles])
    params, opt_state = update(params, grads, opt_state)

``--flatten`` instead concatenates every leaf into one float32 vector, pushes it
once (``grad.flat``) and splits the average back into the pytree. Every rank
initializes its parameters from its own key on purpose; rank 0's are then
broadcast to everyone leaf by leaf (``bps.broadcast(..., root_rank=0)``), and the
optimizer state starts at zeros everywhere, so the replicas are identical and stay
so (checked once per epoch with a cluster-wide parameter checksum).

Reference: unless ``--no-reference``, rank 0 afterwards trains the same model on its
own, without BytePS, from the same initial parameters (rank 0's), for the same
epochs, with the same optimizer, on the global batches (step ``s``'s global batch is
the concatenation of every rank's shard batch ``s``). The shard batches of a step
all have the same size, so the average of their mean-loss gradients is the global
batch's mean-loss gradient and both runs should end within float rounding of each
other. The summary prints both test accuracies and their difference.

Rank 0 shows a progress bar, evaluates test accuracy after each epoch and prints a
summary at the end. The exit status is non-zero if the final test accuracy is below
0.85, or if it differs from the reference's by more than 0.02 (every rank exits with
that verdict: the other ranks wait for it in a last push_pull while rank 0 trains
its reference, so the launcher does not stop rank 0 early). JAX runs on the CPU
only, with single-threaded Eigen (several processes share the machine's cores);
nothing is downloaded.
"""

from __future__ import annotations

import os

# Before JAX is imported: the CPU only (never probe for a GPU), and Eigen on one thread per process.
os.environ["JAX_PLATFORMS"] = "cpu"
_EIGEN_FLAG = "--xla_cpu_multi_thread_eigen=false"
if "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_EIGEN_FLAG}".strip()

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

import bps_worker.client as bps  # noqa: E402
from digits import MIN_ACCURACY, SEED, Data, cluster_description, load_data, shard_indices  # noqa: E402

jax.config.update("jax_platforms", "cpu")

MAX_REFERENCE_DIFFERENCE = 0.02
LAYERS = (64, 128, 64, 10)
MOMENTUM = 0.9
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8

Params = dict[str, dict[str, jax.Array]]


def load_flat_data() -> Data:
    """The shared split (examples/digits.py) with each image as 64 features and int32 labels, for the MLP."""
    d = load_data()
    return Data(d.x_train.reshape(len(d.x_train), -1), d.y_train.astype(np.int32),
                d.x_test.reshape(len(d.x_test), -1), d.y_test.astype(np.int32))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Data-parallel JAX MLP training on the digits data set over "
                                            "BytePS's numpy client.")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training split (default: 3)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step per process (default: 32)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: 0.1 for sgd, 0.01 for adam)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="adam",
                   help="SGD with momentum 0.9, or Adam (default: adam)")
    p.add_argument("--flatten", action="store_true",
                   help="push the gradients as one flat vector rather than leaf by leaf")
    p.add_argument("--no-reference", action="store_true",
                   help="skip rank 0's single-process reference training")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if args.lr is None:
        args.lr = 0.1 if args.optimizer == "sgd" else 0.01
    return args


# --- the model -------------------------------------------------------------------------------------------

def init_params(key: jax.Array) -> Params:
    """PyTorch's default init for linear layers: weights and biases uniform in +-1/sqrt(fan_in)."""
    params: Params = {}
    for i, (fan_in, fan_out) in enumerate(zip(LAYERS[:-1], LAYERS[1:])):
        key, kw, kb = jax.random.split(key, 3)
        bound = 1.0 / np.sqrt(fan_in)
        params[f"fc{i + 1}"] = {
            "w": jax.random.uniform(kw, (fan_in, fan_out), jnp.float32, -bound, bound),
            "b": jax.random.uniform(kb, (fan_out,), jnp.float32, -bound, bound),
        }
    return params


def forward(params: Params, x: jax.Array) -> jax.Array:
    n = len(params)
    for i in range(1, n + 1):
        layer = params[f"fc{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < n:
            x = jax.nn.relu(x)
    return x


def loss_fn(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of the batch."""
    logp = jax.nn.log_softmax(forward(params, x))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


value_and_grad = jax.jit(jax.value_and_grad(loss_fn))


@jax.jit
def _predict(params: Params, x: jax.Array) -> jax.Array:
    return jnp.argmax(forward(params, x), axis=1)


def accuracy(params: Params, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.asarray(_predict(params, x)) == y))


# --- the optimizer ---------------------------------------------------------------------------------------

Init = Callable[[Params], Any]
Update = Callable[[Params, Params, Any], tuple[Params, Any]]


def make_optimizer(name: str, lr: float) -> tuple[Init, Update]:
    """``(init, update)``: ``update(params, grads, state) -> (params, state)``, jitted (PyTorch's SGD / Adam)."""
    tm = jax.tree_util.tree_map
    if name == "sgd":
        def init(params: Params) -> Any:
            return tm(jnp.zeros_like, params)

        def update(params: Params, grads: Params, state: Any) -> tuple[Params, Any]:
            buf = tm(lambda b, g: MOMENTUM * b + g, state, grads)
            return tm(lambda p, b: p - lr * b, params, buf), buf
    else:
        b1, b2 = ADAM_BETAS

        def init(params: Params) -> Any:
            return jnp.zeros((), jnp.int32), tm(jnp.zeros_like, params), tm(jnp.zeros_like, params)

        def update(params: Params, grads: Params, state: Any) -> tuple[Params, Any]:
            step, m, v = state
            step = step + 1
            m = tm(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
            v = tm(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
            c1, c2 = 1 - b1 ** step, 1 - b2 ** step
            params = tm(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + ADAM_EPS), params, m, v)
            return params, (step, m, v)
    return init, jax.jit(update)


# --- BytePS ----------------------------------------------------------------------------------------------

def leaf_name(path: tuple[Any, ...]) -> str:
    """``fc1.w`` for the path ``(DictKey('fc1'), DictKey('w'))``."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def average_gradients(grads: Params, flatten: bool) -> tuple[Params, float]:
    """The mean of ``grads`` over every process of the cluster, and the seconds spent waiting for it."""
    if flatten:
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        flat = np.concatenate([np.asarray(leaf, dtype=np.float32).ravel() for leaf in leaves])
        handle = bps.push_pull_async(flat, "grad.flat", average=True)
        t0 = time.perf_counter()
        mean = bps.synchronize(handle)
        wait = time.perf_counter() - t0
        cuts = np.cumsum([leaf.size for leaf in leaves])[:-1]
        averaged = [jnp.asarray(part.reshape(leaf.shape)) for part, leaf in zip(np.split(mean, cuts), leaves)]
    else:
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
        handles = [bps.push_pull_async(np.asarray(leaf), f"grad.{leaf_name(path)}", average=True)
                   for path, leaf in paths_leaves]
        t0 = time.perf_counter()
        averaged = [jnp.asarray(bps.synchronize(h)) for h in handles]
        wait = time.perf_counter() - t0
    return jax.tree_util.tree_unflatten(treedef, averaged), wait


def broadcast_params(params: Params, root_rank: int) -> Params:
    """``root_rank``'s parameters on every process, leaf by leaf."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(bps.broadcast(np.asarray(leaf), root_rank=root_rank, name=f"init.{i}"))
                  for i, leaf in enumerate(leaves)])


def check_replicas(params: Params, size: int) -> None:
    """Cheap consistency check: the cluster-wide sum of the parameter checksums is ``size`` times ours."""
    local = sum(float(np.asarray(leaf, dtype=np.float64).sum()) for leaf in jax.tree_util.tree_leaves(params))
    total = float(bps.push_pull(np.array([local], dtype=np.float64), "check.param_sum", average=False)[0])
    if not np.isclose(total, size * local, rtol=1e-12, atol=1e-12):
        raise RuntimeError(f"replicas diverged: parameter checksum {local!r} x {size} != cluster sum {total!r}")


# --- training --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    np.random.seed(SEED)
    bps.init()
    try:
        return train(args)
    finally:
        bps.shutdown()


def train_reference(params: Params, data: Data, args: argparse.Namespace, size: int) -> tuple[float, float]:
    """Single-process training (no BytePS) on the global batches; its final test accuracy and last epoch's loss."""
    n_train = len(data.y_train)
    opt_init, opt_update = make_optimizer(args.optimizer, args.lr)
    state = opt_init(params)
    epoch_loss = float("nan")
    for epoch in range(args.epochs):
        shards = [shard_indices(n_train, epoch, r, size) for r in range(size)]
        starts = range(0, len(shards[0]), args.batch_size)
        loss_sum, loss_n = 0.0, 0
        for s in tqdm(starts, desc=f"reference {epoch + 1}/{args.epochs}", unit="step", file=sys.stderr,
                      dynamic_ncols=True):
            batch = np.concatenate([shard[s:s + args.batch_size] for shard in shards])
            loss, grads = value_and_grad(params, data.x_train[batch], data.y_train[batch])
            params, state = opt_update(params, grads, state)
            loss_sum += float(loss) * len(batch)
            loss_n += len(batch)
        epoch_loss = loss_sum / loss_n
    return accuracy(params, data.x_test, data.y_test), epoch_loss


def train(args: argparse.Namespace) -> int:
    rank, size = bps.rank(), bps.size()
    data = load_flat_data()
    n_train = len(data.y_train)

    # Different keys per rank on purpose: the broadcast must make the replicas identical.
    params = broadcast_params(init_params(jax.random.PRNGKey(SEED + rank)), root_rank=0)
    initial = params  # rank 0's; JAX arrays are immutable, the reference starts from these
    opt_init, opt_update = make_optimizer(args.optimizer, args.lr)
    opt_state = opt_init(params)  # zeros: the same on every rank without a broadcast
    check_replicas(params, size)

    steps = 0
    samples = 0
    sync_s = 0.0
    epoch_loss = float("nan")
    test_acc = float("nan")
    t_start = time.perf_counter()
    for epoch in range(args.epochs):
        idx = shard_indices(n_train, epoch, rank, size)
        batches = [idx[s:s + args.batch_size] for s in range(0, len(idx), args.batch_size)]
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", unit="step", disable=rank != 0,
                   file=sys.stderr, dynamic_ncols=True)
        loss_sum, loss_n = 0.0, 0
        for batch in bar:
            loss, grads = value_and_grad(params, data.x_train[batch], data.y_train[batch])
            grads, wait = average_gradients(grads, args.flatten)
            sync_s += wait
            params, opt_state = opt_update(params, grads, opt_state)
            steps += 1
            samples += len(batch)
            loss_sum += float(loss) * len(batch)
            loss_n += len(batch)
            bar.set_postfix(loss=f"{float(loss):.4f}")
        bar.close()
        # Cluster-wide mean training loss of the epoch (every rank saw the same number of samples).
        epoch_loss = float(bps.push_pull(np.array([loss_sum / loss_n], dtype=np.float64), "stats.epoch_loss")[0])
        check_replicas(params, size)
        test_acc = accuracy(params, data.x_test, data.y_test)
        if rank == 0:
            print(f"epoch {epoch + 1}: train loss {epoch_loss:.4f}, test accuracy {test_acc:.4f}", flush=True)
    wall = time.perf_counter() - t_start

    # Every rank processed the same number of samples; still, sum the real counts.
    totals = bps.push_pull(np.array([samples, steps], dtype=np.int64), "stats.counts", average=False)
    sync_frac = float(bps.push_pull(np.array([sync_s / wall], dtype=np.float64), "stats.sync_fraction")[0])
    ok = test_acc >= MIN_ACCURACY
    if rank == 0:
        ok = report(args, data, initial, size, steps, epoch_loss, test_acc, totals, wall, sync_s, sync_frac)
    # Every rank exits with the cluster's verdict, after rank 0 has trained its reference and printed the
    # summary: the launcher stops every process as soon as one fails, which would cut rank 0 short.
    failed = int(bps.push_pull(np.array([0 if ok else 1], dtype=np.int64), "stats.failed", average=False)[0])
    return 0 if failed == 0 else 1


def report(args: argparse.Namespace, data: Data, initial: Params, size: int, steps: int, epoch_loss: float,
           test_acc: float, totals: np.ndarray, wall: float, sync_s: float, sync_frac: float) -> bool:
    """Rank 0: the reference training (unless ``--no-reference``) and the summary; whether both passed."""
    n_train = len(data.y_train)
    n_leaves = len(jax.tree_util.tree_leaves(initial))
    n_params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(initial))
    ok = test_acc >= MIN_ACCURACY
    if args.no_reference:
        reference_lines = ["reference:      skipped (--no-reference)"]
    else:
        t_ref = time.perf_counter()
        ref_acc, ref_loss = train_reference(initial, data, args, size)
        ref_wall = time.perf_counter() - t_ref
        diff = abs(test_acc - ref_acc)
        ref_ok = diff <= MAX_REFERENCE_DIFFERENCE
        ok = ok and ref_ok
        reference_lines = [
            f"reference:      test accuracy {ref_acc:.4f}, final loss {ref_loss:.4f}: one process without BytePS, "
            f"same initial params, global batches of {args.batch_size * size} and optimizer ({ref_wall:.2f} s)",
            f"difference:     {diff:.4f} (|test accuracy - reference|, at most {MAX_REFERENCE_DIFFERENCE})"
            + ("" if ref_ok else "  FAILED"),
        ]
    comm = ("one flattened push_pull per step" if args.flatten
            else f"{n_leaves} push_pulls per step, leaf by leaf")
    print("\n".join([
        "--- train_digits_jax summary ---",
        f"cluster:        {cluster_description(size)}",
        f"model:          MLP {'-'.join(map(str, LAYERS))} (relu) in JAX {jax.__version__} "
        f"on {jax.default_backend()}, {n_params} parameters in {n_leaves} leaves",
        f"optimizer:      {args.optimizer}, lr {args.lr:g}, batch {args.batch_size} per process "
        f"({args.batch_size * size} global), bps_worker.client ({comm})",
        f"training set:   {n_train} samples ({n_train // size} per process per epoch), "
        f"test set: {len(data.y_test)} samples",
        f"epochs:         {args.epochs}",
        f"steps:          {steps} per process ({int(totals[1])} in all)",
        f"final loss:     {epoch_loss:.4f} (mean over the last epoch, all processes)",
        f"test accuracy:  {test_acc:.4f}" + ("" if test_acc >= MIN_ACCURACY else f"  (below {MIN_ACCURACY}: FAILED)"),
        *reference_lines,
        f"throughput:     {int(totals[0]) / wall:.0f} samples/s ({int(totals[0])} samples in {wall:.2f} s)",
        f"sync wait:      {sync_s / wall:.1%} of training time on rank 0, {sync_frac:.1%} mean over processes "
        f"(time in bps.synchronize of the gradients)",
    ]), flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
