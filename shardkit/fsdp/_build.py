"""Building a unit: which parameters and buffers it owns, and replacing parameters by shards."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ._errors import FSDPUsageError
from ._layout import SlotLayout
from ._options import FSDPOptions
from ._unit import ManagedParam

__all__ = ["own_modules", "own_named", "prepare_buffers", "shard_parameters"]


def _is_unit(module: nn.Module) -> bool:
    return getattr(type(module), "_shardkit_fsdp_unit", False)


def own_modules(root: nn.Module) -> Iterator[nn.Module]:
    """Modules of a unit: the wrapped tree minus nested FSDP subtrees (each once)."""
    stack, seen = [root], set()
    while stack:
        mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        yield mod
        stack.extend(c for c in mod._modules.values() if c is not None and not _is_unit(c))


def own_named(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(prefix, module) pairs of a unit, every path to a shared module included."""

    def visit(mod: nn.Module, prefix: str):
        yield prefix, mod
        for name, child in mod._modules.items():
            if child is not None and not _is_unit(child):
                yield from visit(child, f"{prefix}{name}.")

    yield from visit(root, "")


def _src(group) -> int:
    return dist.get_global_rank(group, 0)


def prepare_buffers(root: nn.Module, opts: FSDPOptions, group, world: int) -> None:
    """Sync buffers from rank 0 (if asked); cast floating ones only to an explicit
    ``buffer_dtype`` (by default they keep their dtype, as in FSDP2: RoPE's ``inv_freq``
    must stay fp32)."""
    dtype = opts.buffer_dtype
    for mod in own_modules(root):
        for name, buf in mod._buffers.items():
            if buf is None:
                continue
            if opts.sync_module_states and world > 1:
                dist.broadcast(buf, _src(group), group=group)
            if dtype is not None and buf.is_floating_point() and buf.dtype != dtype:
                mod._buffers[name] = buf.to(dtype)


def shard_parameters(
    root: nn.Module, opts: FSDPOptions, group, rank: int, world: int
) -> list[ManagedParam]:
    """Replace every parameter the unit owns by this rank's dim-0 rows (one per tied group)."""
    found: dict[int, tuple[nn.Parameter, list, list]] = {}
    for prefix, mod in own_named(root):
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse and mod._parameters:
            raise FSDPUsageError(
                f"module {prefix.rstrip('.') or type(root).__name__!r} "
                f"({type(mod).__name__}(sparse=True)) gives sparse gradients, which FSDP "
                "cannot reduce-scatter into shards; build it with sparse=False"
            )
        for name, p in mod._parameters.items():
            if p is None:
                continue
            fqn = prefix + name
            if getattr(p, "_shardkit_fsdp_claimed", False) or getattr(
                p, "_shardkit_fsdp_shard", False
            ):
                raise ValueError(
                    f"parameter {fqn!r} is shared with a nested FSDP unit; put every "
                    "module that uses a tied parameter in the same unit (leave them "
                    "unwrapped, or wrap their common parent)"
                )
            entry = found.setdefault(id(p), (p, [], []))
            if not any(m is mod and n == name for m, n in entry[1]):
                entry[1].append((mod, name))
            entry[2].append(fqn)
    params, offset = [], 0
    for p, owners, fqns in found.values():
        layout = SlotLayout(tuple(p.shape), world, offset)
        offset += layout.padded_numel
        with torch.no_grad():
            if opts.sync_module_states and world > 1:
                dist.broadcast(p.data, _src(group), group=group)
            local = layout.shard_of(p.detach(), rank).clone()
        shard = nn.Parameter(local, requires_grad=p.requires_grad)
        shard._shardkit_fsdp_shard = True
        shard._shardkit_fsdp_rows = (layout, rank, world)  # read by optimizer state hooks
        p._shardkit_fsdp_claimed = True
        for mod, name in owners:
            mod._parameters[name] = shard
        params.append(ManagedParam(shard, owners, fqns, layout))
    return params
