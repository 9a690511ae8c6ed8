"""What each rank runs in the asynchronous-mode tests (top-level, so spawn can import them).

Deltas are integer-valued functions of (seed, rank, step), so every rank can compute the exact final value
of the whole cluster by itself.
"""

from __future__ import annotations

import os
import random
import time
import urllib.request
from typing import Any

import numpy as np

import bps_worker.client as bps
from bps_worker.client import NUMPY_DTYPES
from bps_worker.client import adapter as _adapter

SHAPE = (3, 5000)  # 60 KB in float32: several partitions on several servers with 64 KiB partitions


def initial(dtype: str, base: float) -> np.ndarray:
    return (np.arange(np.prod(SHAPE)).reshape(SHAPE) % 7 + base).astype(NUMPY_DTYPES[dtype])


def delta(dtype: str, seed: int, rank: int, step: int) -> np.ndarray:
    rng = np.random.default_rng((seed, rank, step))
    return rng.integers(-2, 3, size=SHAPE).astype(NUMPY_DTYPES[dtype])


def expected(dtype: str, seed: int, steps: int, base: float) -> np.ndarray:
    """The initial value plus every rank's every delta, summed exactly (in float64)."""
    total = initial(dtype, base).astype(np.float64)
    for rank in range(bps.size()):
        for step in range(steps):
            total += delta(dtype, seed, rank, step).astype(np.float64)
    return total


def barrier(tag: str) -> None:
    bps.push_pull(np.zeros(1, np.float32), f"barrier/{tag}")


def exact_run(name: str, dtype: str, steps: int, seed: int, base: float, max_sleep: float,
              staleness: int | None = None, slow: tuple[float, ...] = ()) -> dict[str, Any]:
    """async_init from rank 0, ``steps`` deltas at random intervals (up to ``max_sleep``, ``slow[w]`` times that
    on machine ``w``), a barrier, then the value (a zero delta's answer), which must hold every delta of every
    rank."""
    worker = bps.rank() // bps.local_size()
    factor = slow[worker] if worker < len(slow) else 1.0
    rng = random.Random(seed * 100 + bps.rank())
    first = bps.async_init(initial(dtype, base) if bps.rank() == 0 else np.zeros(SHAPE, NUMPY_DTYPES[dtype]), name,
                           staleness=staleness)
    assert np.array_equal(first, initial(dtype, base)), "the value starts as the root's array"
    barrier(f"{name}/init")  # an init answers the value as it is: no machine pushes before every one has it
    for step in range(steps):
        time.sleep(rng.random() * max_sleep * factor)
        value = bps.async_push_pull(delta(dtype, seed, bps.rank(), step), name)
        assert value.shape == SHAPE and value.dtype == NUMPY_DTYPES[dtype]
    barrier(name)
    final = bps.async_push_pull(np.zeros(SHAPE, NUMPY_DTYPES[dtype]), name)
    want = expected(dtype, seed, steps, base)
    return {"final": final.astype(np.float64), "want": want}


def steps_trace(name: str, staleness: int | None, slow_steps: int, sleeps: dict[int, float]) -> dict[str, Any]:
    """Each machine's delta adds 1 per process to its own entry, so every value answered says how many
    steps of every machine it holds (entry / local processes). The last machine makes ``slow_steps`` steps;
    the others push until an answer shows that it did (every process of a machine gets the same answers,
    so they stop together). Each sleeps ``sleeps[worker]`` a step. Returns, per answer, this machine's
    step and the value's entries."""
    workers = bps.size() // bps.local_size()
    worker = bps.rank() // bps.local_size()
    slow = workers - 1
    bps.async_init(np.zeros(workers, np.float32), name, staleness=staleness)
    one = np.zeros(workers, np.float32)
    one[worker] = 1
    trace: list[tuple[int, list[float]]] = []
    started = time.monotonic()
    step = 0
    while (step < slow_steps) if worker == slow else (not trace or trace[-1][1][slow] < slow_steps):
        time.sleep(sleeps.get(worker, 0.0))
        value = bps.async_push_pull(one, name)
        step += 1
        trace.append((step, (value / bps.local_size()).tolist()))
    return {"worker": worker, "steps": step, "trace": trace, "seconds": time.monotonic() - started}


def misuse(name: str) -> dict[str, Any]:
    """Worker 0's processes make ``name`` asynchronous, the others push it synchronously."""
    worker = bps.rank() // bps.local_size()
    try:
        if worker == 0:
            bps.async_init(np.ones(4, np.float32), name)
            bps.async_push_pull(np.ones(4, np.float32), name)
        else:
            time.sleep(0.5)  # after the init: the servers know the name as asynchronous
            bps.push_pull(np.ones(4, np.float32), name)
        outcome = "ok"
    except bps.BPSError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    try:  # the same process, both ways
        bps.push_pull(np.ones(4, np.float32), f"{name}/local")
        bps.async_init(np.ones(4, np.float32), f"{name}/local")
        local = "ok"
    except bps.BPSError as exc:
        local = f"{type(exc).__name__}: {exc}"
    try:
        bps.async_push_pull(np.ones(4, np.float32), f"{name}/never")
        never = "ok"
    except bps.BPSError as exc:
        never = f"{type(exc).__name__}: {exc}"
    bad = []
    for staleness in (-1, 1.5, True):
        try:
            bps.async_init(np.ones(4, np.float32), f"{name}/bad", staleness=staleness)  # type: ignore[arg-type]
        except bps.BPSError as exc:
            bad.append(str(exc))
    return {"outcome": outcome, "local": local, "never": never, "bad": bad}


def mismatch(name: str) -> dict[str, Any]:
    """Worker 1 initialises ``name`` with another shape; then (after a barrier: every init was answered) the
    machines whose init succeeded push two deltas."""
    worker = bps.rank() // bps.local_size()
    shape = (4,) if worker == 0 else (5,)

    def outcome(call: Any) -> Any:
        try:
            got = call()
            return "ok" if got is None else got.tolist()
        except bps.BPSMismatchError as exc:
            return f"{exc.name}|{exc.ours}|{exc.theirs}"
        except bps.BPSError as exc:
            return f"{type(exc).__name__}: {exc}"

    init = outcome(lambda: [bps.async_init(np.ones(shape, np.float32), name), None][1])
    bps.push_pull(np.zeros(1, np.float32), f"{name}.barrier")
    pushes = [outcome(lambda: bps.async_push_pull(np.full(shape, k + 1.0, np.float32), name)) for k in range(3)] \
        if init == "ok" else []
    return {"init": init, "pushes": pushes}


def push_until_error(name: str, staleness: int | None, seconds: float) -> dict[str, Any]:
    """Push 1s every 10 ms for ``seconds`` or until an error (the test kills a machine meanwhile)."""
    bps.async_init(np.zeros(4, np.float32), name, staleness=staleness)
    steps, times = 0, []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            bps.async_push_pull(np.ones(4, np.float32), name)
        except bps.BPSError as exc:
            at = time.time()
            after = 0
            try:  # the dead machine holds nobody back any more (unless it was our own daemon that died)
                for _ in range(5):
                    bps.async_push_pull(np.ones(4, np.float32), name)
                    after += 1
            except bps.BPSError:
                pass
            return {"steps": steps, "error": type(exc).__name__, "text": str(exc), "peer": getattr(exc, "peer", ""),
                    "at": at, "times": times, "after": after}
        steps += 1
        times.append(time.time())
        time.sleep(0.01)
    return {"steps": steps, "error": None, "at": time.time(), "times": times}


def torch_async_sgd(steps: int, staleness: int | None, device: str = "cpu") -> dict[str, Any]:
    """A linear model whose gradient is a constant per rank (loss = sum(w * c_rank)): with plain SGD every
    step's delta is -lr * c_rank exactly (lr a power of 2, integer c), so the servers' final value is rank 0's
    initial weights minus lr * steps * sum of every rank's c. Ranks start from different weights:
    broadcast_parameters must make the value rank 0's. The model is on ``device``."""
    import torch

    import bps_worker.torch as bt

    def start(rank: int) -> dict[str, torch.Tensor]:  # integer-valued: every step below is exact in float32
        gen = torch.Generator().manual_seed(rank)
        return {"weight": torch.randint(-8, 9, (2, 3), generator=gen).float(),
                "bias": torch.randint(-8, 9, (2,), generator=gen).float()}

    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start(bps.rank())[n])
    model.to(device)
    init0 = {n: t.to(device) for n, t in start(0).items()}
    t0 = time.monotonic()
    errors = []
    for bad in (dict(asynchronous=True, compression=bt.Compression.fp16), dict(staleness=2)):
        try:
            bt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.25), model.named_parameters(), **bad)
        except bt.BPSError as exc:
            errors.append(str(exc))
    # Names of this run's own: the module's cluster is shared, and a key the previous run's job left at the
    # servers (dropped only once every worker has reset) would answer this run's init with its old value.
    tag = f"sgd.{staleness}.{device}"
    opt = bt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.25),
                                  [(f"{tag}.{n}", p) for n, p in model.named_parameters()],
                                  asynchronous=True, staleness=staleness, bucket_bytes=16)
    bt.broadcast_parameters(model.state_dict(), root_rank=0)
    same = all(torch.equal(p, init0[n]) for n, p in model.named_parameters())
    # Every machine's init answered before any step: an init is answered with the value as it stands, and one
    # that arrives after another machine's first steps (no round barrier in asynchronous mode) holds them.
    barrier("torch_async_init")
    coef = {n: torch.full_like(p, float(bps.rank() + 1)) for n, p in model.named_parameters()}
    for _ in range(steps):
        opt.zero_grad()
        loss = sum((p * coef[n]).sum() for n, p in model.named_parameters())
        loss.backward()
        opt.step()
    barrier("torch_async")
    opt.zero_grad()
    opt.step()  # no gradient: a zero delta, the value back
    total = sum(r + 1 for r in range(bps.size()))
    want = {n: init0[n] - 0.25 * steps * total for n in init0}
    exact = all(torch.equal(p.detach(), want[n]) for n, p in model.named_parameters())
    value = bt.async_init(torch.full((3,), 2.0), f"{tag}/plain")  # the tensor functions
    value = bt.async_push_pull(torch.ones(3), f"{tag}/plain")
    plain = value.tolist()
    return {"same_after_broadcast": same, "exact": exact, "errors": errors, "seconds": time.monotonic() - t0,
            "plain": plain, "devices": sorted({str(p.device) for p in model.parameters()})}


def torch_async_after_reinit(steps: int, flags: str) -> dict[str, Any]:
    """``steps`` plain SGD steps (lr 1/4, each rank's gradient its rank + 1), then rank 0 (its machine's only
    process) leaves and comes back (``shutdown()``, ``init()``: a restarted worker daemon's process does so) while
    the others wait for ``flags``/back, then ``steps`` more. Rank 0's optimizer took its values for initialised on
    the new connection: every step failed ("async_push_pull before async_init") and broadcast_parameters was refused, for good (a review). Now its
    first step there initialises again (the job's value as it stands: a rejoin), and every step of every rank is
    in the value, exactly."""
    import torch

    import bps_worker.torch as bt

    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = bt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.25),
                                  [("reinit." + n, p) for n, p in model.named_parameters()], asynchronous=True)
    bt.broadcast_parameters(model.state_dict(), root_rank=0)
    barrier("reinit.start")

    def step() -> None:
        opt.zero_grad()
        (model.weight * float(bps.rank() + 1)).sum().backward()
        opt.step()

    for _ in range(steps):
        step()
    barrier("reinit.left")
    if bps.rank() == 0:
        settings = _adapter.settings()
        bps.shutdown()
        bps.init(socket=settings.socket, local_rank=settings.local_rank, timeout=settings.timeout)
        open(os.path.join(flags, "back"), "w").close()
    else:  # (a round of the others' open as its machine leaves would fail: that process left)
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(flags, "back")) and time.monotonic() < deadline:
            time.sleep(0.02)
    barrier("reinit.back")
    for _ in range(steps):
        step()
    barrier("reinit.end")
    opt.zero_grad()
    opt.step()  # no gradient: a zero delta, the value back
    total = sum(r + 1 for r in range(bps.size()))
    return {"weight": model.weight.detach().tolist(), "want": [[-0.25 * 2 * steps * total] * 3]}


REJOIN_STEADY_STEPS = 60
REJOIN_DELTAS = {"steady": 1.0, "first": 10.0, "again": 100.0}
REJOIN_TOTAL = REJOIN_STEADY_STEPS * 1.0 + 5 * 10.0 + 5 * 100.0


def rejoin(role: str) -> list[float]:
    """Machine 0 ("steady") pushes 1s for REJOIN_STEADY_STEPS steps, then zeros until the value holds every
    delta of the job; machine 1's processes come and go: "first" pushes 10s five times and leaves, "again"
    (a new process, the daemon's rounds counted from 0 again) initialises again and pushes 100s five times."""
    value = bps.async_init(np.zeros(4, np.float32), "rejoin")
    if role != "steady":
        for _ in range(5):
            value = bps.async_push_pull(np.full(4, REJOIN_DELTAS[role], np.float32), "rejoin")
            time.sleep(0.02)
        return value.tolist()
    for _ in range(REJOIN_STEADY_STEPS):
        value = bps.async_push_pull(np.ones(4, np.float32), "rejoin")
        time.sleep(0.02)
    deadline = time.monotonic() + 30
    while value[0] < REJOIN_TOTAL and time.monotonic() < deadline:
        time.sleep(0.05)
        value = bps.async_push_pull(np.zeros(4, np.float32), "rejoin")
    return value.tolist()


def rejoin_bounded(role: str, flags: str) -> dict[str, Any]:
    """:func:`rejoin` under ``staleness=1``: "steady" (machine 0) pushes 1s, and counts its pushes that returned
    while "again" (machine 1's second process, back after machine 0 went on alone) pushed its 100s, ten at 0.1 s
    apart; "first" pushed 10s three times before. Then zeros until the value holds every delta."""
    value = bps.async_init(np.zeros(4, np.float32), "rejoin.bounded", staleness=1)
    start, done = os.path.join(flags, "again.start"), os.path.join(flags, "again.done")
    if role != "steady":
        if role == "again":
            with open(start, "w") as f:
                f.write(repr(time.monotonic()))
        for _ in range(3 if role == "first" else 10):
            value = bps.async_push_pull(np.full(4, 10.0 if role == "first" else 100.0, np.float32), "rejoin.bounded")
            time.sleep(0.1 if role == "again" else 0.02)
        if role == "again":
            with open(done, "w") as f:
                f.write(repr(time.monotonic()))
        return {"value": value.tolist()}
    returned: list[float] = []
    while not os.path.exists(done):
        value = bps.async_push_pull(np.ones(4, np.float32), "rejoin.bounded")
        returned.append(time.monotonic())
        time.sleep(0.01)
    ones = len(returned)
    with open(start) as f, open(done) as g:
        window = (float(f.read()), float(g.read()))
    total = ones + 3 * 10.0 + 10 * 100.0
    deadline = time.monotonic() + 30
    while value[0] < total and time.monotonic() < deadline:
        time.sleep(0.05)
        value = bps.async_push_pull(np.zeros(4, np.float32), "rejoin.bounded")
    return {"value": value.tolist(), "total": total, "window": window[1] - window[0],
            "during": sum(window[0] <= t <= window[1] for t in returned)}


def scraped_while_live(name: str, steps: int, urls: list[str]) -> dict[str, Any]:
    """async_init and ``steps`` deltas of ``name``; then, while every process is still in the job (between two
    barriers), rank 0 reads every URL (the servers' metrics): what they say of a live asynchronous name."""
    first = bps.async_init(np.ones(SHAPE, np.float32) if bps.rank() == 0 else np.zeros(SHAPE, np.float32), name)
    barrier(f"{name}/init")
    for step in range(steps):
        bps.async_push_pull(np.full(SHAPE, step + 1, np.float32), name)
    barrier(f"{name}/pushed")
    texts = [urllib.request.urlopen(url, timeout=10).read().decode() for url in urls] if bps.rank() == 0 else []
    barrier(f"{name}/scraped")
    return {"first": float(first[0, 0]), "texts": texts}


def finished_then_restart(name: str, flags: str) -> dict[str, Any]:
    """Machine 1's processes push 3 deltas and end (its daemon resets); machine 0 goes on under staleness=1.
    Then every server restarts (the test's part): machine 0's next pushes must not wait for machine 1."""
    import os
    import threading

    def wait_file(path: str, limit: float) -> None:
        deadline = time.monotonic() + limit
        while not os.path.exists(path):
            assert time.monotonic() < deadline, f"no {path}"
            time.sleep(0.05)

    bps.async_init(np.zeros(4, np.float32), name, staleness=1)
    bps.push_pull(np.zeros(1, np.float32), "barrier/init")
    if bps.rank() == 1:
        for _ in range(3):
            bps.async_push_pull(np.ones(4, np.float32), name)
        return {"worker": 1}
    for _ in range(10):  # machine 1 leaves meanwhile: it holds nobody back
        time.sleep(0.3)
        bps.async_push_pull(np.ones(4, np.float32), name)
    open(os.path.join(flags, "ready"), "w").close()
    wait_file(os.path.join(flags, "restarted"), 60)
    got: list[Any] = []

    def push() -> None:
        try:
            for _ in range(3):
                got.append(float(bps.async_push_pull(np.ones(4, np.float32), name)[0]))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            got.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=push, daemon=True)
    thread.start()
    thread.join(30.0)
    return {"worker": 0, "after_restart": got, "still_waiting": thread.is_alive()}


def refused_delta_takes_no_step(name: str) -> dict[str, Any]:
    """``staleness=0``; machine 0's processes push one delta of another shape (refused), then every process
    pushes 5 good ones, then a barrier. The refused push used to take a step: machine 0 ran one step ahead of
    the others for good, and under the bound its last answer waited for a step the others never made (a hang)."""
    worker = bps.rank() // bps.local_size()
    bps.async_init(np.zeros(4, np.int64), name, staleness=0)
    barrier(f"{name}/init")
    refused = ""
    if worker == 0:
        try:
            bps.async_push_pull(np.ones(2, np.int64), name)
        except bps.BPSMismatchError as exc:
            refused = f"{exc.name}|{exc.ours}|{exc.theirs}"
    for _ in range(5):
        bps.async_push_pull(np.ones(4, np.int64), name)
    barrier(name)
    final = bps.async_push_pull(np.zeros(4, np.int64), name)
    return {"refused": refused, "final": final.tolist()}


def sync_side_of_a_misuse(name: str, n: int = 4) -> str:
    """Machine 0 sums ``name`` (``n`` elements: small ones fused, large ones not) synchronously; machine 1 then
    makes it asynchronous. Each side's BPSMismatchError says its own use as ``ours`` (the synchronous side heard
    the asynchronous side's)."""
    worker = bps.rank() // bps.local_size()
    try:
        if worker == 0:
            bps.push_pull(np.ones(n, np.float32), name)
        else:
            time.sleep(0.5)
            bps.async_init(np.ones(n, np.float32), name)
        return "ok"
    except bps.BPSMismatchError as exc:
        return f"{exc.ours}|{exc.theirs}"


def split_root_machine(name: str, n: int, everywhere: bool) -> dict[str, Any]:
    """The root's machine (worker 0; root rank 1) disagrees within itself about ``name`` (rank 0 has one element
    more; with ``everywhere`` every machine's local rank 0 does), ``n`` float32 each: every rank's error and how
    long it took; then every rank inits it again alike (a retry; the root's machine a second later), and reports
    the value it got."""
    shape = (n + 1,) if bps.local_rank() == 0 and (everywhere or bps.rank() == 0) else (n,)
    started = time.monotonic()
    try:
        bps.async_init(np.full(shape, float(bps.rank()), np.float32), name, root_rank=1)
        error = None
    except bps.BPSError as exc:
        error = {"class": type(exc).__name__, "message": str(exc),
                 **{key: getattr(exc, key) for key in ("name", "ours", "theirs") if hasattr(exc, key)}}
    waited = time.monotonic() - started
    barrier(f"{name}.retry")
    if bps.rank() < bps.local_size():
        time.sleep(1.0)  # (the other machines' retries reach the servers first)
    value = bps.async_init(np.full(n, float(bps.rank()), np.float32), name, root_rank=1)
    return {"error": error, "waited": waited, "value": sorted(set(value.tolist()))}


def last_job(name: str, linger: Any = None) -> dict[str, Any]:
    """A job's process: inits ``name`` to 1s (rank 0 the root) and adds one delta of 1s. ``linger``: an event
    to wait for before one more delta (after the next job began) and leaving; what that delta raised."""
    bps.async_init(np.ones(8, np.float32), name)
    out: dict[str, Any] = {"value": bps.async_push_pull(np.ones(8, np.float32), name).tolist()}
    if linger is not None:
        assert linger.wait(60), "the next job did not begin"
        try:
            out["late"] = bps.async_push_pull(np.ones(8, np.float32), name).tolist()
        except bps.BPSError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def next_job(name: str, base: float, hold: Any = None, said: Any = None) -> list[float]:
    """The next job's process: its async_init of ``name`` (``base`` where it is the root's); ``hold``: an event to
    wait for before leaving (its machine keeps the job's value alive meanwhile), after putting the value on queue
    ``said``."""
    value = bps.async_init(np.full(8, base, np.float32), name).tolist()
    if hold is not None:
        said.put(value)
        assert hold.wait(60), "the test did not release this process"
    return value


def synchronous_job(go: Any = None) -> dict[str, Any]:
    """A job of synchronous sums only; ``go``: an event to wait for (the next job began), then one async_init of
    a name of its own, and what it raised, and how long it took."""
    out: dict[str, Any] = {"sum": bps.push_pull(np.ones(8, np.float32), "jobs.sync").tolist()}
    if go is not None:
        assert go.wait(60), "the next job did not begin"
        began = time.monotonic()
        try:
            out["late"] = bps.async_init(np.ones(8, np.float32), "jobs.late").tolist()
        except bps.BPSError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["waited"] = time.monotonic() - began
    return out


def deltas_after(name: str, said: Any, go: Any) -> list[float]:
    """The next job's process: inits ``name`` to 100s (its root), adds 1s, says the value on ``said``; once ``go``
    is set, adds 1s again and returns the value."""
    bps.async_init(np.full(8, 100.0, np.float32), name)
    said.put(bps.async_push_pull(np.ones(8, np.float32), name).tolist())
    assert go.wait(60), "the test did not go on"
    return bps.async_push_pull(np.ones(8, np.float32), name).tolist()
