"""Shard a module's parameters in place from a plan of name patterns, keeping tied weights."""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Mapping
from fnmatch import fnmatchcase

import torch
import torch.distributed as dist
from torch import nn

from ..runtime._collective import ranks_differ
from ..runtime._fingerprint import value_fingerprint
from ._local_tp import apply_local, linear_role
from ._mesh import Mesh
from ._placement import Placement
from ._sharded_tensor import ShardedTensor, mark_sharding
from .layout import PartitionSpec

__all__ = ["check_across_ranks", "shard_module"]

_ACTIVATIONS = ("sharded", "local")


def _match(plan: Mapping[str, PartitionSpec], name: str) -> str | None:
    for pattern in plan:
        if fnmatchcase(name, pattern):
            return pattern
    return None


def shard_module(
    module: nn.Module,
    mesh: Mesh,
    plan: Mapping[str, PartitionSpec],
    *,
    strict: bool = True,
    activations: str = "sharded",
) -> nn.Module:
    """Replace every parameter of ``module`` by a sharded one, in place; returns ``module``.

    ``plan`` maps parameter-name patterns (``fnmatch`` style, matched against the full
    name, e.g. ``"*.q_proj.weight"`` or ``"layers.*.mlp.down_proj.weight"``) to partition
    specs; the first pattern in the plan's order that matches wins. Parameters no pattern
    matches are replicated over the mesh (they must be ShardedTensors too, so that their
    gradients and optimizer steps take part in the sharded program).

    A parameter shared by several modules (tied weights, such as GPT-2's ``lm_head`` and
    ``wte``) is sharded once and the one sharded parameter is set on every owner, so the
    tie holds. Its names must not match patterns with different specs.

    With ``strict`` (the default) a pattern that matches no parameter is a ValueError
    (a typo would otherwise silently leave a layer replicated). Build the optimizer after
    this call: it must see the new parameters.

    ``activations`` picks how the program runs:

    - ``"sharded"`` (default): every parameter, and so every activation, is a
      ShardedTensor; any op on any layout works, as on one big device.
    - ``"local"``: Megatron-style tensor parallelism on a 1-D mesh, for ``nn.Linear``
      layers only. A column-parallel linear (weight spec ``(axis, None)``; its bias is
      split with it) returns its local output columns as a plain tensor, and a
      row-parallel linear (``(None, axis)``) takes them and all-reduces its output.
      Parameters no pattern matches stay plain tensors, so only these layers pay for
      sharding. Code between the two must work on the local width (HF models reshape
      with ``-1`` heads, so they do). This is what torch's ``ColwiseParallel`` /
      ``RowwiseParallel`` do by default. See docs/spmd.md ("Local activations").
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard_module expects an nn.Module, got {type(module).__name__}")
    if activations not in _ACTIVATIONS:
        raise ValueError(f"activations must be one of {_ACTIVATIONS}, got {activations!r}")
    if activations == "local" and mesh.ndim != 1:
        raise ValueError(
            f"activations='local' runs tensor parallelism over a 1-D mesh, got mesh shape "
            f"{mesh.mesh_shape}; use activations='sharded' for a data x model mesh"
        )
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"plan must map parameter-name patterns to partition specs, got {type(plan).__name__}"
        )
    # every (owner, leaf) slot of every parameter, shared ones included
    slots: dict[int, list[tuple[str, nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for leaf, param in owner._parameters.items():
            if param is None:
                continue
            name = f"{owner_name}.{leaf}" if owner_name else leaf
            entries = slots.setdefault(id(param), [])
            if all(o is not owner or lf != leaf for _, o, lf in entries):
                entries.append((name, owner, leaf))
            params[id(param)] = param
    used: set[str] = set()
    # per parameter: its slots, the parameter, the plan's spec and its normalized form
    decided: list[tuple[list, nn.Parameter, PartitionSpec, tuple]] = []
    for key, entries in slots.items():
        param = params[key]
        chosen: dict[str, str] = {}
        for name, _, _ in entries:
            pattern = _match(plan, name)
            if pattern is not None:
                chosen[name] = pattern
        specs = {Placement.from_user(mesh, plan[p], param.ndim).spec for p in set(chosen.values())}
        if len(specs) > 1:
            detail = ", ".join(f"{n!r} -> {p!r} {plan[p]}" for n, p in chosen.items())
            raise ValueError(
                f"the tied parameter named {[n for n, _, _ in entries]} matches plan patterns "
                f"with different specs ({detail}); give its names one spec"
            )
        used.update(chosen.values())
        spec = plan[next(iter(chosen.values()))] if chosen else (None,) * param.ndim
        normalized = Placement.from_user(mesh, spec, param.ndim).spec
        if isinstance(param, ShardedTensor):
            if param.placement.spec != normalized or param.mesh != mesh:
                raise ValueError(
                    f"parameter {entries[0][0]!r} is already sharded as {param.partition_spec}; "
                    f"the plan asks for {spec}. Shard a module once"
                )
        decided.append((entries, param, spec, normalized))
    unused = [p for p in plan if p not in used]
    if strict and unused:
        names = [n for entries in slots.values() for n, _, _ in entries]
        raise ValueError(
            f"plan patterns {unused} match no parameter of {type(module).__name__}; "
            f"parameter names look like {names[:4]} (or pass strict=False)"
        )
    layout = [(entries[0][0], normalized) for entries, _, _, normalized in decided]
    check_across_ranks(
        [p for _, p, _, _ in decided if not isinstance(p, ShardedTensor)],
        "shard_module",
        layout=repr((activations, layout)),
    )
    if activations == "local":
        apply_local(module, mesh, _linear_roles(decided))
        return module
    for entries, param, spec, _ in decided:
        if not isinstance(param, ShardedTensor):
            sharded = mark_sharding(param, mesh, spec)
            for _, owner, leaf in entries:
                setattr(owner, leaf, sharded)
    return module


def check_across_ranks(params: list[torch.Tensor], what: str, *, layout: str) -> None:
    """Compare, across the ranks, how ``what`` lays the parameters out (``layout``: a
    canonical description, e.g. names and normalized specs) and their values; collective
    in a process group (one small all-reduce).

    A layout that differs (a plan whose column and row specs are swapped on one rank)
    gives wrong results on every rank without any error: ValueError on every rank.
    Values that differ (no common seed) are mixed slice by slice, since each rank keeps
    its slice of what it holds (torch's ``distribute_tensor`` scatters rank 0's): a
    warning, by :func:`value_fingerprint`, a heuristic; loading a checkpoint afterwards
    makes them equal.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    layout_differs, values_differ = ranks_differ(
        [zlib.crc32(layout.encode()), value_fingerprint(params)]
    )
    if layout_differs:
        raise ValueError(
            f"{what}: the ranks lay the parameters out differently (a plan, mesh axis or "
            "option that differs per rank), which computes wrong results on every rank; "
            "pass the same arguments on every rank"
        )
    if values_differ:
        warnings.warn(
            f"{what}: the ranks' parameters hold different values, so each rank keeps its "
            "slice of its own tensors and the sharded model mixes the ranks' "
            "initializations. Seed every rank identically (torch.manual_seed) before "
            "building the model; ignore this if a checkpoint is loaded afterwards",
            UserWarning,
            stacklevel=3,
        )


def _linear_roles(decided: list) -> dict[nn.Linear, str]:
    """The role (column or row parallel) of every linear the plan shards; a ValueError,
    before anything changed, for a parameter local activations cannot run."""
    roles: dict[nn.Linear, str] = {}
    for entries, _, _, normalized in decided:
        for name, owner, leaf in entries:
            try:
                role = linear_role(owner, leaf, normalized)
            except ValueError as exc:
                raise ValueError(f"parameter {name!r}: {exc}") from None
            if role is not None and roles.setdefault(owner, role) != role:
                raise ValueError(
                    f"parameter {name!r} makes its layer {role}-parallel, but the layer's "
                    f"other parameter made it {roles[owner]}-parallel"
                )
    return roles
