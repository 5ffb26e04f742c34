"""Rows that know where they sit: FSDP state-dict values described as shards.

``model.state_dict()`` and ``optim.state_dict()`` of an FSDP model hold each rank's rows.
Described as plain tensors, a checkpoint would take them for replicated values; here
they become :class:`RowShard` values, ShardedTensors on a 1-D mesh ``("fsdp",)`` with
spec ``("fsdp", None, ...)`` (``torch.chunk`` rows), whose local tensor *is* the live
shard or optimizer state. ``shardkit.checkpoint`` then saves and reshards them, loads in
place, and ``torch.save`` still writes just the local rows (what per-rank files and
:func:`consolidate_sharded_model_checkpoints` expect).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .. import runtime
from ..spmd import Mesh, Placement, ShardedTensor
from ._errors import FSDPUsageError
from ._state import _CKPT_WRAPPED, MESH_AXIS

__all__ = [
    "RowShard",
    "row_mesh",
    "row_entries",
    "describe_rows",
    "local_rows",
    "split_rows",
    "install_optimizer_hooks",
]

_MESHES: dict[int, Mesh] = {}
_WARNED_GROUP = False


class RowShard(ShardedTensor):
    """A ShardedTensor of FSDP rows that pickles as its local rows (plain ``torch.save``)."""

    def __reduce_ex__(self, protocol):
        return self._local_tensor.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        out = RowShard(self._local_tensor.clone(), self._placement, self.shape)
        memo[id(self)] = out
        return out


def row_mesh(group_world: int) -> Mesh | None:
    """The ``("fsdp",)`` mesh over every rank, or None when FSDP shards over a subgroup."""
    global _WARNED_GROUP
    if group_world != runtime.world_size():
        if not _WARNED_GROUP:
            _WARNED_GROUP = True
            warnings.warn(
                f"FSDP shards over a group of {group_world} of {runtime.world_size()} ranks: "
                "its state_dict() values are plain per-rank rows, which shardkit.checkpoint "
                "cannot tell from replicated values; save them per rank with torch.save, or "
                "shard over the whole world",
                stacklevel=3,
            )
        return None
    mesh = _MESHES.get(group_world)
    if mesh is None:
        # the same on every rank by construction, and built lazily from a state_dict()
        # that one rank may take alone: no cross-rank check (it is a collective)
        mesh = _MESHES[group_world] = Mesh(
            list(range(group_world)), (group_world,), (MESH_AXIS,), _check_ranks=False
        )
    return mesh


def spec(ndim: int) -> tuple:
    """Partition spec of a dim-0 sharded value with ``ndim`` dims."""
    return (MESH_AXIS,) + (None,) * (ndim - 1) if ndim else ()


def describe(local: torch.Tensor, layout, group_world: int) -> torch.Tensor:
    """``local`` (this rank's rows of ``layout``) as a RowShard; unchanged when it cannot be."""
    if layout.replicated or not isinstance(local, torch.Tensor) or isinstance(local, ShardedTensor):
        return local
    mesh = row_mesh(group_world)
    if mesh is None:
        return local
    placement = Placement.from_user(mesh, spec(len(layout.shape)), len(layout.shape))
    return RowShard(local, placement, layout.shape)


def local_rows(value: Any, layout, rank: int) -> Any:
    """This rank's rows of ``value`` (a RowShard / ShardedTensor, a full tensor or rows)."""
    if layout.replicated or not isinstance(value, torch.Tensor):
        return value
    shape = tuple(layout.shape)
    if isinstance(value, ShardedTensor):
        if tuple(value.shape) != shape:
            return value  # the caller's size check reports it
        if value.partition_spec == spec(len(shape)) and value.mesh.size() == layout.world:
            return value._local_tensor
        return layout.shard_of(value.full_tensor().detach(), rank)
    if tuple(value.shape) == shape and tuple(layout.local_shape(rank)) != shape:
        return layout.shard_of(value, rank)  # a full tensor: take this rank's rows
    return value


def _kind(value: Any, layout, rank: int) -> str:
    """What ``value`` is for a sharded parameter: "full" (its global shape only),
    "local" (this rank's rows only), "either" (both shapes agree) or "bad" (neither)."""
    if not isinstance(value, torch.Tensor):
        return "either"  # nn.Module's own check reports it
    shape, local = tuple(layout.shape), tuple(layout.local_shape(rank))
    given = tuple(value.shape)
    if isinstance(value, ShardedTensor):
        return "full" if given == shape else "bad"
    if given == shape:
        return "either" if given == local else "full"
    return "local" if given == local else "bad"


def split_rows(state_dict: dict, entries: list[tuple[str, Any]], rank: int) -> dict[str, str]:
    """Replace each sharded entry of ``state_dict`` by this rank's rows, in place.

    Returns torch's size-mismatch message for each entry that fits neither the parameter
    nor this rank's rows, and removes it. A state dict holding any full tensor holds only
    full tensors: an entry there that only fits this rank's rows is a full tensor of
    another size (a head for another ``num_labels``), not rows, and is refused on every
    rank, though on this rank its size happens to equal its rows'.
    """
    present = [(key, layout) for key, layout in entries if key in state_dict]
    kinds = {key: _kind(state_dict[key], layout, rank) for key, layout in present}
    holds_full = "full" in kinds.values()
    bad = {}
    for key, layout in present:
        if kinds[key] == "bad" or (kinds[key] == "local" and holds_full):
            given = state_dict.pop(key).shape
            bad[key] = (
                f"size mismatch for {key}: copying a param with shape {given} from "
                f"checkpoint, the shape in current model is {torch.Size(layout.shape)}."
            )
        else:
            state_dict[key] = local_rows(state_dict[key], layout, rank)
    return bad


def row_entries(root, prefix: str) -> list[tuple[str, Any]]:
    """(state_dict key, layout) of every sharded parameter under ``root``.

    Walks the module tree as ``state_dict()`` does, without marking ``root`` as the
    root unit (a unit may still be nested later).
    """
    from ._fsdp import FullyShardedDataParallel

    layouts = {
        id(mp.shard): mp.layout
        for unit in root.modules()
        if isinstance(unit, FullyShardedDataParallel)
        for mp in unit._state.params
        if not mp.layout.replicated
    }
    out = []
    for name, param in root.named_parameters(remove_duplicate=False):
        layout = layouts.get(id(param))
        if layout is not None:  # torch's checkpoint_wrapper strips its attribute from keys
            out.append((prefix + name.replace(_CKPT_WRAPPED + ".", ""), layout))
    return out


def describe_rows(root, out: dict, prefix: str) -> None:
    """Replace ``out``'s sharded parameter entries (plain rows) by RowShards, in place."""
    for key, layout in row_entries(root, prefix):
        if key in out:
            out[key] = describe(out[key], layout, root.world_size)


# -- optimizers ------------------------------------------------------------------------
_HOOKED = False


def _rows_info(param) -> tuple | None:
    return getattr(param, "_shardkit_fsdp_rows", None)


def _params(optim) -> list:
    return [p for group in optim.param_groups for p in group["params"]]


def _state_post_hook(optim, state_dict: dict) -> dict:
    params = _params(optim)
    state = {}
    for index, entry in state_dict["state"].items():
        info = _rows_info(params[index]) if isinstance(index, int) else None
        if info is None:
            state[index] = entry
            continue
        layout, _rank, world = info
        shape = tuple(params[index].shape)
        state[index] = {  # a new dict: the optimizer's own state must stay plain
            k: describe(v, layout, world)
            if isinstance(v, torch.Tensor) and v.ndim and tuple(v.shape) == shape
            else v
            for k, v in entry.items()
        }
    state_dict["state"] = state
    return state_dict


def _load_pre_hook(optim, state_dict: dict) -> dict:
    params = _params(optim)
    state = {}
    for index, entry in state_dict.get("state", {}).items():
        info = _rows_info(params[index]) if isinstance(index, int) and index < len(params) else None
        if info is None or not isinstance(entry, dict):
            state[index] = entry
            continue
        layout, rank, _world = info
        state[index] = {
            k: local_rows(v, layout, rank) if isinstance(v, torch.Tensor) and v.ndim else v
            for k, v in entry.items()
        }
    return {**state_dict, "state": state}


#: torch optimizers whose update of a parameter is not element by element (whole-tensor
#: norms, row and column statistics, line searches): on rows of a parameter they compute
#: a different update on each rank, silently. torch's FSDP2 refuses them too.
_NOT_ELEMENTWISE = tuple(
    cls for cls in (getattr(torch.optim, n, None) for n in ("Adafactor", "LBFGS")) if cls
)


def _refuse_not_elementwise(optim) -> None:
    if isinstance(optim, _NOT_ELEMENTWISE) and any(
        _rows_info(p) is not None for p in _params(optim)
    ):
        raise FSDPUsageError(
            f"{type(optim).__name__} updates each parameter from statistics of the whole "
            "tensor (norms, row and column means, a line search), but under FSDP each rank "
            "holds only some rows, so every rank would compute a different, wrong update. "
            "Use an optimizer whose update is element by element (AdamW, Adam, SGD, "
            "RMSprop, ...), or shardkit.ddp for this model"
        )


def _step_pre_hook(optim, args, kwargs) -> None:
    _refuse_not_elementwise(optim)  # every rank raises alike, at the same step
    seen = getattr(optim, "_shardkit_fsdp_groups", None)
    if seen == len(optim.param_groups):
        return
    optim._shardkit_fsdp_groups = len(optim.param_groups)
    if getattr(optim, "_shardkit_fsdp_hooked", False):
        return
    if any(_rows_info(p) is not None for p in _params(optim)):
        optim.register_state_dict_post_hook(_state_post_hook)
        optim.register_load_state_dict_pre_hook(_load_pre_hook)
        optim._shardkit_fsdp_hooked = True
        _take_rows_of_loaded_state(optim)


def _take_rows_of_loaded_state(optim) -> None:
    """State loaded before the first step, without the load hook (build the optimizer,
    ``load_state_dict`` a full one, step): each full tensor becomes this rank's rows."""
    for param in _params(optim):
        info, entry = _rows_info(param), optim.state.get(param)
        if info is None or not entry:
            continue
        layout, rank, _world = info
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v.ndim and tuple(v.shape) != tuple(param.shape):
                rows = local_rows(v, layout, rank)
                if rows is not v:
                    entry[k] = rows.clone()  # not a view: the full tensor is freed


def install_optimizer_hooks() -> None:
    """Once per process: an optimizer over FSDP shards describes its state as RowShards.

    Its ``state_dict()`` and ``load_state_dict()`` get hooks at its first ``step()``
    (``prime_optimizer`` counts); before that it holds no state to describe.
    """
    global _HOOKED
    if not _HOOKED:
        _HOOKED = True
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_step_pre_hook)
