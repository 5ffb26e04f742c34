"""Checkpoint-facing views of an FSDP model: sharded state dicts, shard metadata, clipping."""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .. import runtime
from ..checkpoint._core._planner import wrapped_pairs
from ..spmd import Mesh, ShardedTensor
from ._errors import FSDPUsageError

__all__ = [
    "sharded_state_dict",
    "load_sharded_state_dict",
    "param_fqns",
    "shard_metadata",
    "clip_grad_norm",
    "iter_entries",
]

MESH_AXIS = "fsdp"
#: the attribute torch's ``checkpoint_wrapper`` keeps the wrapped module in; torch strips
#: it from state-dict keys, and so do we (keys load into the unwrapped model)
_CKPT_WRAPPED = "_checkpoint_wrapped_module"


def _root(model):
    model._lazy_init()
    if not model._is_root:
        raise FSDPUsageError("call this on the outermost FSDP module, not on a nested unit")
    return model


def iter_entries(model) -> Iterator[tuple[str, str, str, Any]]:
    """(kind, unwrapped fqn, state_dict key, target) in ``state_dict()`` order.

    ``target`` is ``(unit, ManagedParam)`` for a parameter, ``(module, name)`` for a buffer.
    """
    from ._fsdp import FullyShardedDataParallel as FSDP

    root = _root(model)
    owner = {id(mp.shard): (u, mp) for u in root._units for mp in u._state.params}

    def visit(mod, up: str, sp: str):
        if isinstance(mod, FSDP):
            yield from visit(mod.module, up, sp + "module.")
            return
        for name, p in mod._parameters.items():
            if p is not None:
                if id(p) not in owner:
                    raise RuntimeError(
                        f"parameter {up + name!r} is not a shard: its unit still holds the "
                        "gathered parameters. State dicts of an FSDP model cannot be taken "
                        "inside its forward or backward; after a finished step this means a "
                        "unit ran inside torch's checkpoint_wrapper (apply_activation_"
                        "checkpointing before wrapping): apply it after wrapping instead"
                    )
                yield "param", up + name, sp + name, owner[id(p)]
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                yield "buffer", up + name, sp + name, (mod, name)
        for name, child in mod._modules.items():
            if child is None:
                continue
            if name == _CKPT_WRAPPED:  # torch's checkpoint_wrapper: not part of any name
                yield from visit(child, up, sp)
            else:
                yield from visit(child, f"{up}{name}.", f"{sp}{name}.")

    yield from visit(root, "", "")


def _mesh(root) -> Mesh:
    mesh = getattr(root, "_shardkit_mesh", None)
    if mesh is None:
        if root.world_size != runtime.world_size():
            raise ValueError(
                f"sharded state dicts need FSDP over the whole world ({runtime.world_size()} "
                f"ranks), but this model shards over a group of {root.world_size}"
            )
        # the same on every rank by construction: no cross-rank check (a collective)
        world = root.world_size
        mesh = Mesh(list(range(world)), (world,), (MESH_AXIS,), _check_ranks=False)
        root._shardkit_mesh = mesh
    return mesh


def _spec(ndim: int) -> tuple:
    return (MESH_AXIS,) + (None,) * (ndim - 1) if ndim else ()


def sharded_state_dict(model) -> dict[str, ShardedTensor]:
    """Every parameter and persistent buffer as a ShardedTensor, keyed by unwrapped FQN.

    Parameters are dim-0 sharded on a 1-D mesh ``("fsdp",)`` over the ranks
    (``torch.chunk`` semantics; 0-d parameters replicated); buffers are replicated. The
    local tensors are views of the live shards, so loading in place updates the model.
    """
    mesh = _mesh(model)
    out: dict[str, ShardedTensor] = {}
    for kind, fqn, _key, target in iter_entries(model):
        if kind == "param":
            mp = target[1]
            shape = mp.layout.shape
            out[fqn] = ShardedTensor.from_local(mp.shard.detach(), mesh, _spec(len(shape)), shape)
        else:
            buf = getattr(target[0], target[1]).detach()
            out[fqn] = ShardedTensor.from_local(buf, mesh, (None,) * buf.ndim, buf.shape)
    return out


def _local_part(value: Any, fqn: str, shape: tuple, spec: tuple, box_of) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"state dict entry {fqn!r} must be a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"state dict entry {fqn!r} has shape {tuple(value.shape)}, but the model's "
            f"parameter has shape {tuple(shape)}"
        )
    if isinstance(value, ShardedTensor):
        if value.partition_spec == spec and value.mesh.size() == runtime.world_size():
            return value.local_tensor().detach()
        value = value.full_tensor().detach()
    return box_of(value)


def load_sharded_state_dict(model, state: dict[str, Any]) -> None:
    """Copy ``state`` (ShardedTensors or full tensors, unwrapped FQNs) into the shards."""
    entries = list(iter_entries(model))
    expected = {fqn for _, fqn, _, _ in entries}
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise KeyError(
            f"FSDP state dict mismatch: missing keys {missing}, unexpected keys {unexpected}"
        )
    rank = model.rank
    with torch.no_grad():
        for kind, fqn, _key, target in entries:
            if kind == "param":
                mp = target[1]
                shape = mp.layout.shape
                local = _local_part(
                    state[fqn],
                    fqn,
                    shape,
                    _spec(len(shape)),
                    lambda t, lay=mp.layout: lay.shard_of(t, rank),
                )
                mp.shard.copy_(local)
            else:
                buf = getattr(target[0], target[1])
                full = _local_part(state[fqn], fqn, buf.shape, (None,) * buf.ndim, lambda t: t)
                buf.copy_(full)


def param_fqns(model) -> dict[int, str]:
    """``id(shard parameter)`` -> the unwrapped FQN (the first, for tied parameters)."""
    out: dict[int, str] = {}
    for kind, fqn, _key, target in iter_entries(model):
        if kind == "param":
            out.setdefault(id(target[1].shard), fqn)
    return out


def shard_metadata(model) -> dict:
    """Where each ``state_dict()`` entry of this rank sits in the unwrapped model."""
    params: dict[str, dict] = {}
    buffers: dict[str, str] = {}
    slots: dict[int, int] = {}
    for kind, fqn, key, target in iter_entries(model):
        if kind == "buffer":
            buffers[key] = fqn
            continue
        mp = target[1]
        layout = mp.layout
        start, rows = layout.rows(model.rank)
        params[key] = {
            "fqn": fqn,
            "shape": list(layout.shape),
            "slot": slots.setdefault(id(mp.shard), len(slots)),
            "replicated": layout.replicated,
            "start": start,
            "rows": rows,
        }
    return {
        "version": 1,
        "world_size": model.world_size,
        "rank": model.rank,
        "params": params,
        "buffers": buffers,
    }


def clip_grad_norm(model, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """The true global gradient norm over every rank's shards; scales grads to ``max_norm``."""
    root = _root(model)
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not max_norm > 0 or math.isnan(max_norm):
        raise ValueError(f"max_norm must be a positive number, got {max_norm}")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    grads, device = [], None
    for unit in root._units:
        for mp in unit._state.params:
            g = mp.shard.grad
            if g is None:
                continue
            device = g.device
            # a replicated parameter's gradient is the same everywhere: count it once
            counted = not mp.layout.replicated or root.rank == 0
            grads.append((g, counted))
    device = device or torch.device("cpu")
    if math.isinf(norm_type):
        local = max((g.detach().abs().max().float() for g, _ in grads if g.numel()), default=None)
        total = torch.zeros((), device=device) if local is None else local.to(device)
        op = dist.ReduceOp.MAX
    else:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for g, counted in grads:
            if counted:
                total += g.detach().double().abs().pow(norm_type).sum()
        op = dist.ReduceOp.SUM
    if root.world_size > 1:
        dist.all_reduce(total, op=op, group=root._group)
    if not math.isinf(norm_type):
        total = total.pow(1.0 / norm_type)
    # in the gradients' dtype, as torch's clip_grad_norm_ computes and returns it
    dtypes = {g.dtype for g, _ in grads}
    total = total.to(functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g, _ in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total


def with_wrapper_names(model, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict`` with keys that lack the wrapper's names renamed to this model's.

    torch FSDP1 and a plain model name a parameter ``0.weight``; this wrapper names it
    ``module.0.weight``. Code moved over from FSDP1 loads the former, and with
    ``strict=False`` would silently load nothing. Only keys this model lacks are renamed,
    and only to keys it expects that the state dict lacks."""
    wanted = model.state_dict(keep_vars=True).keys()  # the names only: no row wrapping
    missing = [k for k in wanted if k not in state_dict]
    extra = [k for k in state_dict if k not in wanted]
    pairs = wrapped_pairs(missing, extra) if missing and extra else []
    if not pairs:
        return state_dict
    renamed = {have: want for want, have in pairs}
    out = OrderedDict((renamed.get(k, k), v) for k, v in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # module versions, by module prefix: rename those too
        modules = {_module_of(have): _module_of(want) for have, want in renamed.items()}
        out._metadata = OrderedDict(  # type: ignore[attr-defined]
            (modules.get(prefix, prefix), v) for prefix, v in metadata.items()
        )
    return out


def _module_of(key: str) -> str:
    return key.rpartition(".")[0]
