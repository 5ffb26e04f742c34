"""Zero-stall staging: copy the state in the background while training goes on.

Parameters and optimizer state change only inside ``optimizer.step()``. So
:func:`async_save` keeps references to the tensors an optimizer owns and copies them on
its background thread, while the caller runs the next forward and backward; a step
(of any optimizer) that starts before the copy is done waits for it.

- A global optimizer step pre-hook, registered when this module is imported, records
  every optimizer that steps (a weak set) and makes ``step()`` wait while a save stages.
- At the call, a tensor is *protected* when its storage is a parameter or a state
  tensor of a known optimizer: its ``_version`` counter is recorded and it is copied
  later. Every other tensor (buffers, which forward may change in place; a model no
  optimizer trains) is cloned in the call, as are mutable JSON values.
- After copying each protected piece, the tensor's ``_version`` is compared with the
  one recorded at the call. Any in-place change through torch (``p.add_()``, ``copy_``,
  ``load_state_dict``) bumps it, so a change made outside ``optimizer.step()`` before
  the piece was copied makes the save fail on every rank; nothing is committed.
  Writes that bypass the counter (``p.data.add_()``, through numpy) are not detected.
- torch bumps a version when an in-place op *ends*, so an op still running while its
  tensor is copied is not yet visible then, and the copy may hold some old and some new
  values. Every protected key is therefore checked once more: at the first
  ``optimizer.step()`` after the call, before it changes anything (every op the caller
  made before that step has ended by then), or, if no step comes first, just before the
  save commits. A change seen then fails the save too.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._errors import CheckpointError
from ._flatten import Flat

__all__ = ["Snapshot", "Staging", "STATS", "protect", "wait_for_staging"]

STAGING_THREAD = "shardkit-async-save"

_lock = threading.Condition()
_known: weakref.WeakSet = weakref.WeakSet()
_active: Staging | None = None


@dataclass
class StallStats:
    """Counters for tests and benchmarks (per process, cumulative)."""

    staged_saves: int = 0  # saves that staged in the background
    blocking_saves: int = 0  # saves that staged in the call (nothing protected)
    steps_waited: int = 0  # optimizer steps that waited for staging
    wait_s: float = 0.0  # total time those steps waited
    waiting: int = 0  # steps waiting right now


STATS = StallStats()


class Staging:
    """One save's background staging; ``optimizer.step()`` waits until it is finished."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def start(self) -> None:
        global _active
        with _lock:
            assert _active is None or _active._done.is_set(), "two saves staging at once"
            _active = self

    def finish(self) -> None:
        """Release waiting steps (after success or failure alike)."""
        global _active
        self._done.set()
        with _lock:
            if _active is self:
                _active = None

    def wait(self) -> None:
        self._done.wait()


def wait_for_staging() -> None:
    """Wait until no save of this process is staging (its tensors may then change).

    Called before the caller changes state (a load, a restore, another save's staging),
    so, as at an optimizer step, every save called before it gets its final check first:
    the caller's earlier in-place ops have ended, and its own changes then do not count.
    """
    if threading.current_thread().name == STAGING_THREAD:
        return
    staging = _active
    if staging is not None:
        staging.wait()
    _check_awaiting()


def _pre_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    _known.add(optimizer)
    staging = _active
    if staging is not None and not staging._done.is_set():
        _wait_for(staging)
    _check_awaiting()
    return None


def _wait_for(staging) -> None:
    """Block this step until ``staging`` copied what it protects, counted in ``STATS``."""
    start = time.perf_counter()
    with _lock:
        STATS.waiting += 1
        _lock.notify_all()
    staging.wait()
    with _lock:
        STATS.waiting -= 1
        STATS.steps_waited += 1
        STATS.wait_s += time.perf_counter() - start


def _check_awaiting() -> None:
    """Before a step changes anything: every save called before it gets its final check
    (every in-place op the caller made before this step has ended)."""
    if _awaiting:
        with _lock:
            pending = list(_awaiting)
        for snapshot in pending:
            snapshot.check_all()


_hook = register_optimizer_step_pre_hook(_pre_step)


def _storage_key(t: torch.Tensor) -> tuple | None:
    inner = getattr(t, "_local_tensor", None)  # ShardedTensor / DTensor: their local piece
    if isinstance(inner, torch.Tensor):
        t = inner
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return None
    return (t.device, ptr) if ptr else None


def _owners() -> dict[tuple, torch.Tensor]:
    """Storage -> the tensor a known optimizer holds there (a parameter or a state tensor)."""
    out: dict[tuple, torch.Tensor] = {}
    for opt in list(_known):
        tensors = [p for group in opt.param_groups for p in group["params"]]
        for state in opt.state.values():
            if isinstance(state, dict):
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            key = _storage_key(t)
            if key is not None:
                out.setdefault(key, t)
    return out


@dataclass(eq=False)
class Snapshot:
    """What a zero-stall save checks: each protected key's tensors and their versions.

    Two counters per key: the state dict's tensor and the optimizer's tensor on the same
    storage. They differ when the state dict's tensor was made below autograd (a
    ShardedTensor's ``detach`` runs in ``__torch_dispatch__`` and gets a new counter), so
    an in-place change through either one is seen.
    """

    versions: dict[str, tuple[tuple[torch.Tensor, int], ...]]
    _checked: bool = False
    _error: CheckpointError | None = None

    def check(self, key: str) -> None:
        """Raise if ``key``'s tensor changed in place since the call."""
        if any(t._version != v for t, v in self.versions.get(key, ())):
            raise _changed(key, "before it was copied to the staging buffer")

    def check_all(self) -> None:
        """Check every key once (the first caller wins); keep the first change found."""
        with _lock:
            if self._checked:
                return
            self._checked = True
            self.forget()
            for key, pairs in self.versions.items():
                if any(t._version != v for t, v in pairs):
                    self._error = _changed(key, "while the save was in progress")
                    return

    def forget(self) -> None:
        """Take no part in later steps' checks (the save is over, or failed)."""
        with _lock:
            if self in _awaiting:
                _awaiting.remove(self)

    def final(self) -> None:
        """Raise if a change was seen at the first step after the call, or is seen now
        (no step came first). Called just before the save commits."""
        self.check_all()
        if self._error is not None:
            raise self._error


def _changed(key: str, when: str) -> CheckpointError:
    return CheckpointError(
        f"key {key!r} was changed in place after the save was called, {when}: something "
        "other than optimizer.step() changed it (optimizer steps wait for staging). Nothing "
        "was committed. Change tensors outside optimizer.step() only once the save is done "
        "(future.result(), CheckpointManager.join()), or pass zero_stall=False (to "
        "async_save or CheckpointManager), which copies the whole state in the call"
    )


#: Snapshots whose final check is still to come (see :meth:`Snapshot.final`).
_awaiting: list[Snapshot] = []


def protect(flat: Flat) -> Snapshot | None:
    """Prepare ``flat`` for background staging: clone what is not protected.

    Returns None (and changes nothing) when no tensor is protected: staging in the
    background would then only add a copy.
    """
    for obj, _ in flat.statefuls:
        if isinstance(obj, torch.optim.Optimizer):
            _known.add(obj)
    owners = _owners()
    versions: dict[str, tuple[tuple[torch.Tensor, int], ...]] = {}
    others = []
    for key, leaf in flat.tensors.items():
        owner = owners.get(_storage_key(leaf.local))
        if owner is not None:
            watched = [(leaf.local, leaf.local._version), (owner, owner._version)]
            # a ShardedTensor's (or DTensor's) own shard: a write to it (p.local_tensor()
            # .add_(), p[0] = 0) bumps only its counter, not the wrapper's or the leaf's
            inner = getattr(owner, "_local_tensor", None)
            if isinstance(inner, torch.Tensor):
                watched.append((inner, inner._version))
            versions[key] = tuple(watched)
        else:
            others.append(leaf)
    if not versions:
        return None
    snapshot = Snapshot(versions)
    with _lock:
        _awaiting.append(snapshot)
    with torch.no_grad():
        for leaf in others:
            leaf.local = leaf.local.clone(memory_format=torch.contiguous_format)
    copy_values(flat)
    return snapshot


def copy_values(flat: Flat) -> None:
    """Take the state dict's non-tensor values as they are now: they are encoded or
    pickled later, on the background thread, after training has gone on (a list
    appended to, a tuple holding a list, a pickled set changed)."""
    flat.values = {k: copy.deepcopy(v) for k, v in flat.values.items()}
    flat.objects = {k: copy.deepcopy(v) for k, v in flat.objects.items()}
