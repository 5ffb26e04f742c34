"""Flatten a state dict into keyed leaves: tensor shards, JSON values, Stateful objects.

Every tensor kind reduces to the one shared abstraction: a global shape, a dtype, and the
local piece with its :class:`Box` in the global index space.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch.nn import Parameter

from ...spmd import ShardedTensor
from ...spmd.layout import Box, chunk_bounds
from ._format import is_json_value, is_named_tuple

__all__ = ["Stateful"]


@runtime_checkable
class Stateful(Protocol):
    """An object saved through its ``state_dict()`` and restored by ``load_state_dict()``.

    ``torch.nn.Module`` and ``torch.optim.Optimizer`` qualify as they are.
    """

    def state_dict(self) -> dict[str, Any]:
        """The object's state, saved as a nested state dict."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any:
        """Restore the object from what :meth:`state_dict` returned (loaded in place)."""
        ...


@dataclass
class TensorLeaf:
    """One rank's piece of a tensor value."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    box: Box
    local: torch.Tensor


@dataclass
class Slot:
    """Where a non-tensor value lives in the caller's containers (to replace it on load)."""

    container: Any
    index: Any


@dataclass
class Flat:
    """A flattened state dict."""

    tensors: dict[str, TensorLeaf]
    values: dict[str, Any]
    objects: dict[str, Any]
    slots: dict[str, Slot]
    #: Stateful objects and their state, inner before outer, siblings in sorted key order
    statefuls: list[tuple[Stateful, dict]]
    #: tensor keys this rank holds no piece of (a DTensor whose mesh excludes this rank)
    absent: set[str] = field(default_factory=set)
    #: load only: meta tensors of the state dict, read into these CPU tensors instead,
    #: which replace them in their containers once the load succeeded (as torch's load)
    materialized: list[tuple[Slot, torch.Tensor]] = field(default_factory=list)
    #: key -> each optimizer state dict in the state dict (an optimizer given as a
    #: Stateful, or its ``state_dict()``): ``{"state": {index: ...}, "param_groups": [...]}``
    optimizers: dict[str, dict] = field(default_factory=dict)


def _dtensor_types():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def _dtensor_leaf(key: str, dt: Any, for_save: bool) -> TensorLeaf | None:
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(dt.placements)
    if any(p.is_partial() for p in placements):
        if not for_save:
            raise ValueError(f"key {key!r}: cannot load into a DTensor with Partial placements")
        placements = tuple(Replicate() if p.is_partial() else p for p in placements)
        dt = dt.redistribute(dt.device_mesh, placements)
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    shape = tuple(int(s) for s in dt.shape)
    if coord is None:  # this rank is not in the tensor's mesh
        return None
    offsets, sizes = [0] * len(shape), list(shape)
    for mesh_dim, p in enumerate(placements):
        if type(p) is Shard:
            d = p.dim if p.dim >= 0 else p.dim + len(shape)
            off, size = chunk_bounds(sizes[d], mesh.size(mesh_dim), coord[mesh_dim])
            offsets[d] += off
            sizes[d] = size
        elif not isinstance(p, Replicate):
            raise TypeError(
                f"key {key!r}: DTensor placement {p!r} is not supported; redistribute to "
                "Shard/Replicate placements before saving"
            )
    local = dt._local_tensor.detach()
    if tuple(local.shape) != tuple(sizes):
        raise ValueError(
            f"key {key!r}: DTensor local shape {tuple(local.shape)} differs from the "
            f"expected shard shape {tuple(sizes)}; uneven DTensor layouts are not supported"
        )
    return TensorLeaf(key, shape, dt.dtype, Box(tuple(offsets), tuple(sizes)), local)


def tensor_leaf(key: str, t: torch.Tensor, for_save: bool) -> TensorLeaf | None:
    """The leaf of any supported tensor kind (None when this rank holds no piece)."""
    if isinstance(t, ShardedTensor):
        if t.placement.partial:
            if not for_save:
                raise ValueError(
                    f"key {key!r}: cannot load into a ShardedTensor with a pending reduction"
                )
            t = t.redistribute(t.partition_spec)
        return TensorLeaf(key, tuple(t.shape), t.dtype, t.local_box(), t._local_tensor.detach())
    dtensor = _dtensor_types()
    if dtensor is not None and isinstance(t, dtensor):
        return _dtensor_leaf(key, t, for_save)
    if t.layout != torch.strided:
        raise TypeError(f"key {key!r}: {t.layout} tensors are not supported; call .to_dense()")
    if all(hasattr(t, name) for name in _SELF_DESCRIBED):
        raise TypeError(
            f"key {key!r}: a tensor carrying {', '.join(_SELF_DESCRIBED)} (torch 2.14's "
            "CheckpointableTensor protocol) would be taken for a whole tensor of its local "
            "shape; shardkit does not read that protocol. Describe the shard with "
            "shardkit.spmd.mark_sharding, a ShardedTensor or a DTensor instead"
        )
    return TensorLeaf(key, tuple(t.shape), t.dtype, Box.full(t.shape), t.detach())


#: The attributes of torch 2.14's ``CheckpointableTensor`` protocol (a plain tensor that
#: names the global shards it holds), which shardkit refuses rather than misread
_SELF_DESCRIBED = ("global_shape", "global_offsets", "local_offsets", "local_sizes")


def _join(prefix: str, k: Any) -> str:
    return f"{prefix}.{k}" if prefix else str(k)


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(value, Stateful):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def _is_optimizer_state(value: Any) -> bool:
    """Whether ``value`` is a torch optimizer's ``state_dict()`` (states by index) or
    ``get_optimizer_state_dict``'s (by parameter name)."""
    return (
        isinstance(value, dict)
        and isinstance(value.get("state"), dict)
        and isinstance(value.get("param_groups"), list)
        and all(isinstance(i, (int, str)) for i in value["state"])
    )


def flatten(
    state_dict: dict, *, for_save: bool, saved_parents: Container[str] = frozenset()
) -> Flat:
    """Flatten ``state_dict`` into dotted keys.

    A JSON container (no tensor, no Stateful inside) is one value, so a list may change
    length between save and load; other containers are walked. On load,
    ``saved_parents`` (``Metadata.key_parents``: the checkpoint keys' dotted prefixes) also walks JSON
    containers the checkpoint stored per entry. Stateful objects are replaced by their
    ``state_dict()``. Dicts are walked in sorted key order, so Stateful objects whose
    ``state_dict`` / ``load_state_dict`` run collectives are visited in one order on every
    rank whatever order each rank's dict has (as torch's ``dcp.load``).
    """
    parents = saved_parents
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    flat = Flat({}, {}, {}, {}, [])
    seen: dict[str, str] = {}

    def claim(key: str, what: str) -> None:
        if key in seen:
            raise ValueError(
                f"two entries flatten to the same key {key!r} ({seen[key]} and {what}); "
                "rename one so dotted paths are unique"
            )
        seen[key] = what

    def walk(value: Any, key: str, container: Any, index: Any) -> None:
        if isinstance(value, torch.Tensor):
            claim(key, "a tensor")
            if not for_save and value.is_meta and type(value) in (torch.Tensor, Parameter):
                if not isinstance(container, (dict, list)):
                    raise TypeError(
                        f"key {key!r}: a meta tensor in a {type(container).__name__} cannot "
                        "be replaced by the loaded one; put it in a dict or a list"
                    )
                value = torch.empty_like(value, device="cpu")
                flat.materialized.append((Slot(container, index), value))
            leaf = tensor_leaf(key, value, for_save)
            if leaf is None:
                flat.absent.add(key)
            else:
                flat.tensors[key] = leaf
            return
        if isinstance(value, Stateful) and not isinstance(value, (dict, list, tuple)):
            inner = value.state_dict()
            if not isinstance(inner, dict):
                raise TypeError(
                    f"key {key!r}: {type(value).__name__}.state_dict() returned "
                    f"{type(inner).__name__}, expected a dict"
                )
            if _is_optimizer_state(inner):
                flat.optimizers[key] = inner
            walk_container(inner, key)
            flat.statefuls.append((value, inner))
            return
        if _is_optimizer_state(value):
            flat.optimizers[key] = value
        if isinstance(value, (dict, list, tuple)) and (
            _has_tensor(value)
            or key in parents
            or not (is_json_value(value) or is_named_tuple(value))
        ):
            walk_container(value, key)
            return
        claim(key, "a value")
        flat.slots[key] = Slot(container, index)
        if is_json_value(value):
            flat.values[key] = value
        else:
            flat.objects[key] = value

    def walk_container(value: Any, prefix: str) -> None:
        if isinstance(value, dict):  # sorted: every rank calls state_dict() in one order
            items = sorted(value.items(), key=lambda kv: str(kv[0]))
        else:
            items = enumerate(value)
        for k, v in items:
            walk(v, _join(prefix, k), value, k)

    walk_container(state_dict, "")
    return flat
