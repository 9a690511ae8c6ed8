"""PyTorch DDP, its buckets summed by our daemons: ``model.register_comm_hook(state=None, hook=bps.ddp_comm_hook)``.

``DistributedDataParallel`` keeps everything it does: its buckets, ``no_sync()``, ``find_unused_parameters``,
the parameter broadcast at construction and the bucket rebuild after the first iteration (those go through its
process group, gloo on CPU, NCCL on GPU). Only the reduction of each bucket is ours: the hook starts a
push_pull of the bucket and returns a future that completes with the mean over every process of the bps job,
what DDP's default all-reduce hook returns.

Theory of operation:

* Names. A bucket's name is ``[prefix.]ddp.b<index>.<k>``, where ``k`` numbers the layouts (dtype, elements)
  that bucket index has had, in the order this process met them. DDP's buckets are the same on every rank, and
  so is the order in which their layouts appear (DDP rebuilds its buckets once, after the first iteration, the
  same on every rank), so every process gives a bucket the same name; a name never names two shapes, as a
  rebuilt bucket of another size gets the next ``k``. Ranks whose buckets do differ (another ``bucket_cap_mb``)
  name differently shaped buckets alike, and get a :class:`BPSMismatchError` naming both shapes, not a hang.
  Several DDP models in one job need a prefix each: ``state="encoder"`` or ``DDPHookState("encoder")``;
  two that share a state in one backward meet a name claimed twice in that backward (or still in flight) and
  get a BPSError that says so, on every rank alike: the check does not depend on whether the first push_pull
  of the name has ended by the time the second model's hook runs.
* Not blocking backward. The hook copies the bucket into its shared slot (or hands a CUDA bucket over by CUDA
  IPC, as :func:`bps_worker.torch.push_pull_async` does) and returns at once; one thread per process waits for
  the push_pulls in the order the hooks started them (DDP's own order of waiting) and completes their futures.
* Errors. A failed push_pull fails its future with the :class:`BPSError`. DDP waits on the futures in C++,
  which would report it as a ``RuntimeError`` ("Unable to cast ... to Tensor"), so the hook also queues an
  autograd callback that waits for the future and raises the error itself: queued before DDP's finalizing
  callback, it makes ``backward()`` raise the ``BPSError`` as it is. DDP's step is then unfinished, as after
  any failed all-reduce: the model cannot be used for another step. One exception: with ``static_graph=True``
  DDP reduces the first iteration's buckets inside its own final callback and waits on them there, before
  ours runs, so a failure in that iteration reaches the user as DDP's ``RuntimeError`` ("Unable to cast ...
  to Tensor") whose text carries the BPSError's.
"""

from __future__ import annotations

import atexit
import queue
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch.autograd import Variable

from .client import BPSError, size

if TYPE_CHECKING:
    from .torch import Handle

__all__ = ["DDPHookState", "ddp_comm_hook", "register_ddp_hook"]


class DDPHookState:
    """The hook's state for one DDP model: the prefix of its bucket names, the process group whose size must be
    the job's (None: the default group), and the names given so far."""

    def __init__(self, prefix: str = "", process_group: Any = None) -> None:
        if not isinstance(prefix, str):
            raise BPSError(f"the DDP hook's prefix must be a str, got {type(prefix).__name__}")
        self.prefix = prefix
        self.process_group = process_group
        self._names: dict[tuple[int, torch.dtype, int], str] = {}
        self._layouts: dict[int, int] = {}  # bucket index -> layouts met
        self._inflight: set[str] = set()
        self._claimed_in: dict[str, int] = {}  # name -> the backward (autograd graph task) that claimed it last
        self._checked = False
        self._lock = threading.Lock()  # autograd may run hooks of models sharing a state on several threads

    def claim(self, index: int, dtype: torch.dtype, numel: int, task: int = -1) -> str:
        """The name of bucket ``index`` holding ``numel`` elements of ``dtype`` (see the module docstring), now
        in flight until :meth:`release`. ``task`` is the backward pass (autograd graph task id) the hook runs
        in, -1 outside one. Claimed already in this backward, or still in flight: two DDP models share this
        state. The backward's claim decides alone, whatever the timing: had the first model's push_pull ended
        before the second model's hook ran on one rank only, that rank would push the name a second time and
        wait for ever for peers that raised."""
        key = (index, dtype, numel)
        with self._lock:
            name = self._names.get(key)
            if name is None:
                k = self._layouts.get(index, 0)
                self._layouts[index] = k + 1
                name = self._names[key] = f"{self.prefix}.ddp.b{index}.{k}" if self.prefix else f"ddp.b{index}.{k}"
            if name in self._inflight or (task != -1 and self._claimed_in.get(name) == task):
                raise BPSError(f"DDP bucket {index} ({numel} x {dtype}) is named {name!r}, and another DDP model's "
                               f"bucket of that name, with the same hook state, is summed in the same backward: "
                               f"give each DDP model its own prefix, register_comm_hook(state='<model>', "
                               f"hook=bps.ddp_comm_hook)")
            self._inflight.add(name)
            if task != -1:
                self._claimed_in[name] = task
        return name

    def release(self, name: str) -> None:
        """``name``'s push_pull ended."""
        with self._lock:
            self._inflight.discard(name)

    def bucket_names(self) -> dict[str, tuple[int, torch.dtype, int]]:
        """Every name given so far, with its bucket's index, dtype and elements."""
        with self._lock:
            return {name: key for key, name in self._names.items()}

    def check_world(self) -> None:
        """Refuse a DDP process group whose size is not the job's (checked once, when it holds)."""
        if self._checked or not (dist.is_available() and dist.is_initialized()):
            return
        world, ours = dist.get_world_size(self.process_group), size()
        if world != ours:
            raise BPSError(f"DDP's process group has {world} processes but the bps job has {ours}: the hook "
                           f"averages over the whole job, so DDP must span it (one DDP rank per bps process)")
        self._checked = True

    def __repr__(self) -> str:
        return f"DDPHookState(prefix={self.prefix!r})"


_STATES: dict[str, DDPHookState] = {}  # the states of state=None ("") and of prefixes given as a str
_STATES_LOCK = threading.Lock()


def _state_of(state: DDPHookState | str | None) -> DDPHookState:
    if isinstance(state, DDPHookState):
        return state
    if state is not None and not isinstance(state, str):
        raise BPSError(f"the DDP hook's state must be None, a prefix (str) or a DDPHookState, got "
                       f"{type(state).__name__}")
    prefix = state or ""
    with _STATES_LOCK:
        found = _STATES.get(prefix)
        if found is None:
            found = _STATES[prefix] = DDPHookState(prefix)
        return found


# A push_pull in flight: its handle, the future DDP waits on, and the state and name to release at its end.
_Item = tuple["Handle", torch.futures.Future[torch.Tensor], DDPHookState, str]


class _Completer:
    """One thread that waits for the hook's push_pulls in the order they started and completes their futures.

    FIFO costs nothing: DDP launches buckets in index order and waits for them in that order at the end of
    backward. Every handle ends (the client bounds failures by its timeout), so every future completes.

    Stopped and joined at the interpreter's exit (``atexit``, see :func:`_stop_completer`): a daemon thread
    still inside torch's C++ (``future.set_result`` runs DDP's callbacks, and the thread may still be in it
    when backward has returned) when Python finalizes is ended by ``pthread_exit`` as it takes the GIL back;
    that unwinding through C++ ends the process with "terminate called without an active exception"
    (SIGABRT) after the script had finished (pytorch/pytorch#38228, CPython gh-87135)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bps-ddp-hook", daemon=True)
        self._thread.start()

    def add(self, item: _Item) -> None:
        self._queue.put(item)

    def stop(self, timeout: float) -> None:
        """Complete what was added, then end the thread (waiting at most ``timeout`` seconds for it)."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        from .torch import synchronize  # not at import: bps_worker.torch re-exports this module

        while (item := self._queue.get()) is not None:
            _complete(synchronize, *item)


def _complete(synchronize: Callable[[Handle], torch.Tensor], handle: Handle,
              future: torch.futures.Future[torch.Tensor], state: DDPHookState, name: str) -> None:
    try:
        result = synchronize(handle)
    except Exception as exc:  # anything: a future left pending would hang DDP
        state.release(name)
        _fail(future, exc)
    else:
        state.release(name)  # before DDP, woken by the future, can start the next round of the name
        future.set_result(result)


def _fail(future: torch.futures.Future[torch.Tensor], error: Exception) -> None:
    future.set_exception(error)  # type: ignore[arg-type]  # torch types its argument as the result's type


_completer: _Completer | None = None
_completer_lock = threading.Lock()


def _complete_later(item: _Item) -> None:
    global _completer
    with _completer_lock:
        if _completer is None:
            _completer = _Completer()
            atexit.register(_stop_completer)
        _completer.add(item)


# At exit the handles still pending end within the client's timeout at most (its connection is closing too).
_STOP_TIMEOUT_S: float = 5.0


def _stop_completer() -> None:
    """End the completer thread (see :class:`_Completer`); a later hook call starts a new one."""
    global _completer
    with _completer_lock:
        completer, _completer = _completer, None
    if completer is not None:
        atexit.unregister(_stop_completer)
        completer.stop(_STOP_TIMEOUT_S)


def _graph_task() -> int:
    """The id of the backward pass (autograd graph task) running this hook; -1 outside backward or on a torch
    that does not tell."""
    current_task = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current_task is None else int(current_task())


def _raise_after_backward(future: torch.futures.Future[torch.Tensor]) -> None:
    """Inside backward: have the engine wait for ``future`` and raise its error as it is (module docstring)."""
    def check() -> None:
        future.wait()  # raises the BPSError the future failed with

    current_task = getattr(torch._C, "_current_graph_task_id", None)
    if current_task is not None and current_task() == -1:
        return  # called outside backward (a wrapper's test, a user's call): the future carries the error
    try:
        Variable._execution_engine.queue_callback(check)
    except RuntimeError:  # outside backward, on a torch without _current_graph_task_id
        pass


def register_ddp_hook(model: Any, prefix: str = "") -> DDPHookState:
    """``model.register_comm_hook`` with :func:`ddp_comm_hook` and a state that knows DDP's own process group, so
    that a DDP on a subgroup of the job is refused (a BPSError names both sizes). The hook alone cannot see that
    group (``state=None`` or a prefix checks the default one), and a DDP on a subgroup would have its buckets
    averaged with other groups' of the same names, silently. ``prefix``: as a ``state`` string."""
    group = getattr(model, "process_group", None)
    if group is None or not hasattr(model, "register_comm_hook"):
        raise BPSError(f"register_ddp_hook takes a DistributedDataParallel model, got {type(model).__name__}")
    state = DDPHookState(prefix, group)
    model.register_comm_hook(state=state, hook=ddp_comm_hook)
    return state


def ddp_comm_hook(state: DDPHookState | str | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the mean of ``bucket`` over every process of the job, summed by our daemons.

    ``model.register_comm_hook(state=None, hook=bps_worker.torch.ddp_comm_hook)`` after ``bps.init()``; for
    several DDP models in one job give each its own prefix: ``state="encoder"`` (or a :class:`DDPHookState`).
    DDP's process group must span the whole job (the default group's size is checked against ``bps.size()``;
    :func:`register_ddp_hook` checks DDP's own group, where it is a subgroup). Failures
    (a mismatch, a dead peer, no ``init()``) fail the future and make ``backward()`` raise the BPSError.
    """
    from .torch import push_pull_async  # not at import: bps_worker.torch re-exports this module

    buffer = bucket.buffer()
    # A CUDA bucket needs a CUDA-aware future: it takes a tensor of its devices only, and syncs DDP's stream.
    devices: list[int | str | torch.device] | None = [buffer.device] if buffer.device.type == "cuda" else None
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
    try:
        hook_state = _state_of(state)
        hook_state.check_world()
        index = bucket.index()
        if buffer.layout != torch.strided:
            shapes = ", ".join("x".join(map(str, p.shape)) for p in bucket.parameters())
            raise BPSError(f"DDP bucket {index} holds {buffer.layout} gradients (of the parameters of shapes "
                           f"{shapes}, e.g. an nn.Embedding(sparse=True)): ddp_comm_hook sums dense ones only "
                           f"(sparse gradients need DDP's own all-reduce)")
        name = hook_state.claim(index, buffer.dtype, buffer.numel(), _graph_task())
        try:
            # DDP's last buckets hold the first layers, whose sums the next forward pass needs first.
            handle = push_pull_async(buffer, name, average=True, priority=index, out=buffer)
        except BaseException:
            hook_state.release(name)
            raise
    except BPSError as exc:
        _fail(future, exc)
    else:
        _complete_later((handle, future, hook_state, name))
    _raise_after_backward(future)
    return future


# DDP's register_comm_hook compares the hook's annotations with the objects themselves, not with their names
# (which is what ``from __future__ import annotations`` leaves in them).
ddp_comm_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})
