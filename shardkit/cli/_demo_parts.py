"""Building blocks of the demo worker: data, model, parallel strategies, byte counting.

Kept apart from the training loop in ``_demo_worker`` so each piece reads on its own.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DIGITS_MISSING",
    "CommCounter",
    "Strategy",
    "accuracy",
    "batch_indices",
    "build_strategy",
    "digits_csv_path",
    "load_digits_split",
    "make_mlp",
]

# Collective -> name of the argument whose bytes this rank hands to the network.
_COLLECTIVES = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",
    "reduce_scatter_single": "input",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CommCounter:
    """Counts the bytes this rank passes to ``torch.distributed`` collectives.

    Every collective in ``torch.distributed`` (and ``distributed_c10d``) is wrapped, so
    it sees whatever DDP, FSDP, comm hooks or SPMD redistributions send, provided they
    call torch's Python collectives. Only calls made by the training thread inside
    :meth:`step` count, so checkpoint traffic (on its own threads and groups) does not.
    The figure is the payload handed to each collective (input tensor bytes), not the
    wire bytes of the backend's algorithm.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self._thread = threading.get_ident()
        self._active = False
        self._installed: list[tuple[object, str, Callable]] = []

    def install(self) -> CommCounter:
        """Wrap the collectives; call before building the model wrappers."""
        modules = [dist, dist.distributed_c10d]
        for name, arg in _COLLECTIVES.items():
            original = getattr(dist.distributed_c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(original, arg)
            for module in modules:
                if getattr(module, name, None) is original:
                    self._installed.append((module, name, original))
                    setattr(module, name, wrapper)
        return self

    def uninstall(self) -> None:
        """Put the original collectives back."""
        for module, name, original in reversed(self._installed):
            setattr(module, name, original)
        self._installed.clear()

    def _wrap(self, original: Callable, arg: str) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self._active and threading.get_ident() == self._thread:
                try:
                    bound = signature.bind_partial(*args, **kwargs)
                    self.bytes += _nbytes(bound.arguments.get(arg))
                    self.calls += 1
                except TypeError:
                    pass  # let the real call report the bad arguments
            return original(*args, **kwargs)

        return counted

    @contextmanager
    def step(self):
        """Count the collectives issued inside the block (one training step)."""
        self._active = True
        try:
            yield
        finally:
            self._active = False


DIGITS_MISSING = (
    "the demo trains on scikit-learn's digits dataset and scikit-learn is not installed: "
    "pip install 'shardkit[demo]'"
)


def digits_csv_path() -> str | None:
    """Where scikit-learn keeps the digits table, or None when its layout differs (then
    only ``load_digits`` knows). Raises ImportError when scikit-learn is not installed.

    Looked up without importing scikit-learn: that import costs about a second of CPU.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(DIGITS_MISSING)
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    return path if os.path.exists(path) else None


def _digits_table():
    """The 1797 x 65 table (64 pixels, then the label) that scikit-learn ships.

    Read straight from scikit-learn's package data, which is what ``load_digits`` reads,
    so that no rank pays for importing scikit-learn.
    """
    import numpy as np

    path = digits_csv_path()
    if path is not None:
        return np.loadtxt(path, delimiter=",")
    from sklearn.datasets import load_digits  # another layout: ask scikit-learn

    digits = load_digits()
    return np.concatenate([digits.data, digits.target[:, None]], axis=1)


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """scikit-learn's bundled 8x8 digits (no download), scaled to [0, 1], split once.

    Returns ``(x_train, y_train, x_test, y_test)``; the split depends only on ``seed``,
    so every rank and every phase sees the same held-out set.
    """
    data = _digits_table()
    x = torch.tensor(data[:, :-1], dtype=torch.float32) / 16.0
    y = torch.tensor(data[:, -1], dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def make_mlp(seed: int, hidden: int = 128) -> nn.Sequential:
    """The demo model, 64-hidden-10, initialised identically on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> torch.Tensor:
    """The global batch of ``step``: a function of the step alone, so a resumed run
    sees exactly the batches the uninterrupted run would have seen."""
    per_epoch = max(1, n // batch_size)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return perm[i * batch_size : (i + 1) * batch_size]


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` that ``model`` classifies as ``y``."""
    model.eval()
    return (model(x).argmax(dim=1) == y).float().mean().item()


@dataclass
class Strategy:
    """A model prepared for one parallel strategy.

    ``module`` is what the training loop calls and checkpoints; ``shard_batch`` turns
    this rank's slice of the global batch into the model's input and target.
    """

    name: str
    module: nn.Module
    optimizer: torch.optim.Optimizer
    shard_batch: Callable[[torch.Tensor, torch.Tensor, int], tuple]
    scalar: Callable[[torch.Tensor], float]
    hook_state: object = None


def _local_batch(x, y, global_batch):
    return x, y


def _ddp(model: nn.Module, hook: str, lr: float) -> Strategy:
    from ..ddp import DistributedDataParallel
    from ..ddp.comm_hooks import default_hooks

    ddp = DistributedDataParallel(model)
    state = None
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        from ..ddp.comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=10
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=lr)
    return Strategy("ddp", ddp, optimizer, _local_batch, lambda t: t.item(), state)


def _fsdp(model: nn.Module, lr: float) -> Strategy:
    from ..fsdp import FullyShardedDataParallel

    fsdp = FullyShardedDataParallel(model)
    optimizer = torch.optim.Adam(fsdp.parameters(), lr=lr)
    return Strategy("fsdp", fsdp, optimizer, _local_batch, lambda t: t.item())


def _spmd(model: nn.Module, lr: float) -> Strategy:
    """Data parallel written the SPMD way: the batch is sharded over the mesh's
    ``data`` axis, the parameters are replicated ShardedTensors, and the sharding
    rules (or the gather fallback) decide what to communicate."""
    from .. import runtime as xr
    from .. import spmd as xs

    xr.use_spmd()
    world = xr.world_size()
    mesh = xs.Mesh(list(range(world)), (world,), ("data",))
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = xs.mark_sharding(param.detach(), mesh, (None,) * param.ndim)
            setattr(module, name, nn.Parameter(replicated))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)

    def shard_batch(x, y, global_batch):
        xs_ = xs.ShardedTensor.from_local(x, mesh, ("data", None), (global_batch, x.shape[1]))
        ys_ = xs.ShardedTensor.from_local(y, mesh, ("data",), (global_batch,))
        return xs_, ys_

    def scalar(t):
        return xs.clear_sharding(t).item()

    return Strategy("spmd", model, optimizer, shard_batch, scalar)


def build_strategy(strategy: str, hook: str, model: nn.Module, lr: float) -> Strategy:
    """Wrap ``model`` for ``strategy`` (fsdp, ddp or spmd) and build its optimizer."""
    if hook != "none" and strategy != "ddp":
        raise ValueError(f"--hook {hook} applies to --strategy ddp only, not {strategy}")
    if strategy == "ddp":
        return _ddp(model, hook, lr)
    if strategy == "fsdp":
        return _fsdp(model, lr)
    if strategy == "spmd":
        return _spmd(model, lr)
    raise ValueError(f"unknown strategy {strategy!r}; choose fsdp, ddp or spmd")
