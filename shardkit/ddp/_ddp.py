"""DistributedDataParallel: replicate a module, average its gradients over ranks."""

from __future__ import annotations

import inspect
import numbers
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .. import runtime
from ._reducer import Reducer
from .comm_hooks import _comm

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module):
    """Data parallel training: each rank runs the whole module on its own batch.

    Construction broadcasts rank 0's parameters and buffers. Each synced backward
    averages the gradients over the group, bucket by bucket, while backward still
    runs. ``state_dict()`` keys carry the ``module.`` prefix exactly as torch's DDP;
    shardkit's checkpoint helpers strip it (``_shardkit_wrapper`` protocol).

    Options are keyword-only: torch's positional order differs (``device_ids`` comes
    second there), so a positional call could not mean the same thing in both.

    Args:
        module: the model; every rank must build it with the same parameters.
        process_group: the group to average over; default: the world.
        bucket_cap_mb: size of each gradient bucket (the first one is 1 MiB).
        find_unused_parameters: allow forwards that leave some parameters out.
        gradient_as_bucket_view: make ``.grad`` views into the buckets (saves a copy
            and a gradient-sized allocation).
        broadcast_buffers: broadcast rank 0's buffers at every forward.
    """

    _shardkit_wrapper = True

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group=None,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
        device_ids: list | None = None,
        output_device=None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"DistributedDataParallel wraps a torch.nn.Module, got {type(module).__name__}"
            )
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real):
            raise TypeError(f"bucket_cap_mb must be a number of MiB, got {bucket_cap_mb!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        for name, flag in (
            ("find_unused_parameters", find_unused_parameters),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("broadcast_buffers", broadcast_buffers),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if device_ids is not None and len(device_ids) != 1:
            raise ValueError(
                f"device_ids must be None or name this rank's one device, got {device_ids!r}"
            )
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None (the world), "
                f"got {process_group!r}"
            )
        self.module = module
        runtime.init()  # join the world the environment describes (torchrun, SLURM)
        self.process_group = _comm.resolve_group(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_cap_mb = bucket_cap_mb
        self.require_backward_grad_sync = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "DistributedDataParallel needs a module with at least one parameter that "
                "requires grad; there is nothing to average"
            )
        self._world = _comm.group_size(self.process_group)
        if self._world > 1:
            self._verify_same_parameters([p for _, p in named])
            self._broadcast([*module.parameters(), *module.buffers()])
        self.reducer = Reducer(
            [p for _, p in named],
            [n for n, _ in named],
            cap_bytes=max(1, int(bucket_cap_mb * (1 << 20))),
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
            process_group=self.process_group,
        )
        self._hook_registered = False

    # -- setup -------------------------------------------------------------------

    def _verify_same_parameters(self, params: list[torch.Tensor]) -> None:
        """Every rank must hold the same parameter shapes, or buckets would mismatch."""
        signature = [len(params), sum(p.numel() for p in params)]
        shapes = repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode()
        signature.append(zlib.crc32(shapes))  # not hash(): str hashes differ per process
        dev = params[0].device
        both = torch.tensor(signature + [-s for s in signature], dtype=torch.int64, device=dev)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.process_group)
        highest, lowest = both[:3].tolist(), [-v for v in both[3:].tolist()]
        if highest != lowest:
            raise ValueError(
                "DistributedDataParallel: ranks hold different parameters (count, sizes or "
                "dtypes differ); build the same model on every rank before wrapping it"
            )

    @torch.no_grad()
    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values to every rank, one collective per dtype and device."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for group in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            _comm.broadcast(flat, self.process_group)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    # -- training ----------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        if self.broadcast_buffers and self._world > 1:
            buffers = list(self.module.buffers())
            if buffers:
                self._broadcast(buffers)
        outputs = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.reducer.prepare(outputs)
        return outputs

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards of forwards run inside only accumulate local gradients.

        The first synced backward after it averages the accumulated sum.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Let ``hook(state, bucket) -> Future`` communicate each bucket.

        Allowed once, before the first backward. The hook averages (DDP does not
        divide its result) and its future's value is the bucket's new flat tensor.
        """
        if self._hook_registered:
            raise ValueError(
                "register_comm_hook may be called only once per DDP module; combine the "
                "hooks into one (e.g. fp16_compress_wrapper(powerSGD_hook))"
            )
        if self.reducer.backwards_done:
            raise ValueError(
                "register_comm_hook must be called before the first backward; register "
                "it right after wrapping the model"
            )
        if not callable(hook):
            raise TypeError(
                f"register_comm_hook: hook must be callable as hook(state, bucket), got {hook!r}"
            )
        try:
            sig = inspect.signature(hook)
        except (TypeError, ValueError):
            sig = None
        if sig is not None:
            try:
                sig.bind(state, None)
            except TypeError:
                raise TypeError(
                    f"register_comm_hook: hook {getattr(hook, '__name__', hook)!r} must take "
                    f"two arguments (state, bucket); its signature is {sig}"
                ) from None
            ret = sig.return_annotation
            if ret is not inspect.Signature.empty and not _is_future_annotation(ret):
                raise TypeError(
                    f"register_comm_hook: hook {getattr(hook, '__name__', hook)!r} is annotated "
                    f"to return {ret!r}; a hook must return a torch.futures.Future"
                )
        self.reducer.hook = hook
        self.reducer.hook_state = state
        self._hook_registered = True


def _is_future_annotation(ret) -> bool:
    if isinstance(ret, str):
        return "Future" in ret
    origin = getattr(ret, "__origin__", ret)
    return isinstance(origin, type) and issubclass(origin, torch._C.Future)
