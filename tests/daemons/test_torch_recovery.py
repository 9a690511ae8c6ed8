"""The PyTorch layer after a call that fails, or a use it cannot honour, with a real one-process cluster and the
client in this process: the process must stay usable (nothing left in flight), and what cannot be done is a
BPSError that says what to do, never a silent wrong result. Each test failed before its fix (a review of the
layer, session 31)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import nn

import bps_worker.torch as bps
from bps_worker.supervise import Cluster
from harness import start_cluster, write_config

MB = 1 << 20
ARENA = 8 * MB  # cluster.arena_bytes: what one process's slots may hold
BIG = 3 * MB // 4  # float32 elements of a 3 MiB tensor: two fit under the cap, three do not


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    made = start_cluster(write_config(tmp_path_factory.mktemp("torch_recovery"), [1], cpu_servers=0,
                                      cluster={"arena_bytes": ARENA}))
    try:
        yield made
    finally:
        made.stop()


@pytest.fixture
def client(cluster: Cluster) -> Iterator[None]:
    """This process connected to the cluster, as its one training process; every optimizer of the test gone
    after it (an asynchronous one left alive would be initialised by a later test's broadcast_parameters)."""
    bps.init(socket=cluster.socket_path(0), local_rank=0, timeout=5.0)
    try:
        yield
    finally:
        bps.shutdown()
        gc.collect()


def _still_usable(tag: str) -> None:
    """A sum and a broadcast work (they needed the room that operations left in flight held)."""
    assert bps.push_pull(torch.ones(3), f"{tag}.sum", average=False).tolist() == [1.0] * 3
    assert bps.broadcast(torch.ones(2), 0, f"{tag}.bcast").tolist() == [1.0] * 2


@pytest.mark.timeout(60)
def test_a_broadcast_that_fails_part_way_leaves_nothing_in_flight(client: None) -> None:
    big = {f"w{i}": torch.full((BIG,), float(i)) for i in range(4)}
    with pytest.raises(bps.BPSError, match="arena_bytes"):
        bps.broadcast_parameters(big, 0)  # the third start is over the cap; the first two had started
    _still_usable("bcast")
    for name in ("w0", "w1"):  # the names of broadcasts that had started, alone: they fit
        bps.broadcast_parameters({name: big[name]}, 0)
        assert big[name].eq(float(name[1])).all()


def _async_model(tag: str, elements: int) -> tuple[nn.ParameterList, bps.DistributedOptimizer]:
    """Four parameters at zero, each its own bucket, in an asynchronous optimizer (SGD, lr 1)."""
    model = nn.ParameterList([nn.Parameter(torch.zeros(elements)) for _ in range(4)])
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), asynchronous=True, bucket_bytes=0,
                                   named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()])
    return model, opt


def _async_step(model: nn.ParameterList, opt: bps.DistributedOptimizer) -> None:
    for p in model:
        p.grad = torch.ones_like(p)
    opt.step()


@pytest.mark.timeout(60)
def test_an_asynchronous_init_that_fails_part_way_leaves_nothing_in_flight(client: None) -> None:
    model, opt = _async_model("ainit", BIG)
    with pytest.raises(bps.BPSError, match="arena_bytes"):
        _async_step(model, opt)  # its init: the third bucket's start is over the cap
    _still_usable("ainit")
    with pytest.raises(bps.BPSError, match="arena_bytes"):
        _async_step(model, opt)  # the same cause again, not a name left in flight
    _still_usable("ainit2")


@pytest.mark.timeout(60)
def test_an_asynchronous_push_that_fails_part_way_loses_no_step(client: None) -> None:
    """The buckets pushed before the failed start take their values; the others keep their parameters, so their
    step goes with the next push: every step counts once."""
    model, opt = _async_model("apush", 3 * MB // 8)  # 1.5 MiB each: the init fits under the cap
    _async_step(model, opt)
    hog = bps.shared_tensor("apush.hog", (MB,))  # 4 MiB handed out: never given up for room while held
    with pytest.raises(bps.BPSError, match="arena_bytes"):
        _async_step(model, opt)
    bps.push_pull(hog, "apush.hog", out=hog)  # pushed, the hog's slot is idle again: room for every bucket
    del hog
    _still_usable("apush")
    _async_step(model, opt)
    assert [p.detach().unique().tolist() for p in model] == [[-3.0]] * 4
