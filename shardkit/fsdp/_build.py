"""Building a unit: which parameters and buffers it owns, and replacing parameters by shards."""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..runtime._collective import collective_device, ranks_differ
from ..runtime._fingerprint import value_fingerprint
from ..runtime._json_gather import all_gather_json
from ._errors import FSDPUsageError, ModelMismatchError
from ._layout import SlotLayout
from ._options import FSDPOptions
from ._unit import ManagedParam

__all__ = [
    "step_options",
    "own_modules",
    "own_named",
    "prepare_buffers",
    "shard_parameters",
    "verify_same_parameters",
]


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


def _signature(root: nn.Module) -> list[list]:
    """[fqn, shape, dtype, requires_grad] of every parameter the unit owns (every path to
    a tied one), in registration order; nested units' parameters are theirs."""
    out = []
    for prefix, mod in own_named(root):
        for name, p in mod._parameters.items():
            if p is not None:
                dtype = str(p.dtype).removeprefix("torch.")
                out.append([prefix + name, list(p.shape), dtype, bool(p.requires_grad)])
    return out


def step_options(opts: FSDPOptions) -> dict[str, str]:
    """The options every rank must share, because they decide what a step communicates
    (and in which dtype): one rank computing in fp16 and another in bf16 summed the two
    formats' bits silently; a different resharding or module-state sync left a rank in
    a collective the others never made."""
    return {
        "compute_dtype": str(opts.compute_dtype),
        "buffer_dtype": str(opts.buffer_dtype),
        "fp32_reduce_scatter": str(opts.fp32_reduce_scatter),
        "reshard_after_forward": str(opts.reshard_after_forward),
        "sync_module_states": str(opts.sync_module_states),
    }


def verify_same_parameters(
    root: nn.Module, group, world: int, *, values: bool, options: dict[str, str] | None = None
) -> None:
    """Raise :class:`ModelMismatchError` on every rank unless every rank's ``root`` holds
    the same parameters: names, registration order, shapes, dtypes and requires_grad.

    Without it a different order or an unseeded extra layer shards silently wrong (each
    rank keeps its rows of a different tensor) and other differences abort the process
    in gloo. With ``values`` (no ``sync_module_states``) a fingerprint of the values
    (each parameter's first and last element) rides along and a difference warns: each
    rank keeps its own rows, so the model mixes the ranks' inits. Cost: crc32s and one
    all-reduce of four int64s; the names of a difference are gathered (JSON) only when
    there is one.
    """
    if world <= 1:
        return
    mine = [type(root).__name__, _signature(root), sorted((options or {}).items())]
    crc = zlib.crc32(repr(mine).encode())  # not hash(): str hashes differ per process
    fingerprint = _value_fingerprint(root) if values else 0
    device = collective_device(group)
    layout_differs, values_differ = ranks_differ([crc, fingerprint], group, device=device)
    if layout_differs:
        every = all_gather_json(mine, group, device=device)  # only on a mismatch
        differ = _options_differ([entry[2] for entry in every])
        if differ and all(entry[:2] == every[0][:2] for entry in every):
            raise ValueError(
                f"FSDP: {differ}; pass the same options on every rank (they decide what "
                "each step communicates, and in which dtype)"
            )
        raise ModelMismatchError(
            f"FSDP: the ranks wrap different parameters: {_first_difference([entry[:2] for entry in every])}; build "
            "the same model on every rank (same layers, registration order, shapes, dtypes "
            "and requires_grad) before wrapping it"
        )
    if values_differ:
        warnings.warn(
            f"FSDP: the ranks' {type(root).__name__} parameters hold different values and "
            "sync_module_states=False, so each rank keeps its rows of its own tensors and "
            "the sharded model mixes the ranks' initializations. Seed every rank "
            "identically, or pass sync_module_states=True (broadcasts rank 0's); ignore "
            "this if a checkpoint is loaded after wrapping",
            UserWarning,
            stacklevel=3,
        )


def _value_fingerprint(root: nn.Module) -> int:
    """:func:`value_fingerprint` of the parameters the unit owns."""
    return value_fingerprint(
        p for _, mod in own_named(root) for p in mod._parameters.values() if p is not None
    )


def _options_differ(every: list) -> str:
    """Each option whose value differs between the ranks, with every rank's value."""
    by_rank = [dict(items) for items in every]
    return "; ".join(
        f"{name} differs between the ranks ("
        + ", ".join(f"rank {r}: {values.get(name)}" for r, values in enumerate(by_rank))
        + ")"
        for name in by_rank[0]
        if any(values.get(name) != by_rank[0][name] for values in by_rank)
    )


def _first_difference(every: list) -> str:
    """The first parameter that differs between the ranks' signatures, by rank."""

    def show(entry: list) -> str:
        fqn, shape, dtype, grad = entry
        return f"{fqn} {tuple(shape)} {dtype}{'' if grad else ' frozen'}"

    classes = [cls for cls, _ in every]
    lists = [params for _, params in every]
    if any(cls != classes[0] for cls in classes):
        by_rank = ", ".join(
            f"rank {r}: {cls} with {len(params)} parameters"
            for r, (cls, params) in enumerate(every)
        )
        where = f"the wrapped modules differ ({by_rank})"
    else:
        where = f"in {classes[0]}"
    for index in range(min(len(params) for params in lists)):
        entries = [params[index] for params in lists]
        if any(entry != entries[0] for entry in entries):
            by_rank = ", ".join(f"rank {r}: {show(e)}" for r, e in enumerate(entries))
            return f"{where}, parameter {index} differs ({by_rank})"
    if any(len(params) != len(lists[0]) for params in lists):
        shortest = min(len(params) for params in lists)
        extra = [
            f"rank {r}: {len(params)} ({', '.join(show(e) for e in params[shortest:][:3])})"
            if len(params) > shortest
            else f"rank {r}: {len(params)}"
            for r, params in enumerate(lists)
        ]
        return f"{where}, the number of parameters differs ({', '.join(extra)})"
    return where


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
