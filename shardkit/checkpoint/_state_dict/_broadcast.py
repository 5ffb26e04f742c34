"""``StateDictOptions(broadcast_from_rank0=True)``: rank 0 reads a full state dict, every
rank receives it one tensor at a time and keeps only its own shard.

Peak memory per rank is about its shard of the state plus one full tensor: each tensor
is broadcast into a fresh buffer, sliced to the local layout (a copy when the slice
would keep the buffer alive), and the buffer is dropped before the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ...runtime._collective import collective_device
from ...runtime._json_broadcast import broadcast_json
from ...spmd import ShardedTensor
from .._core._comm import world_of_many
from .._core._errors import StateDictMismatchError
from .._core._format import is_json_value
from ._values import check_compatible, import_value, is_sharded

__all__ = ["broadcast_from_rank0", "broadcast_items", "compact"]


def dropped_here(opts: Any) -> bool:
    """Whether this rank lets go of what it gathers: with ``full_state_dict`` and
    ``cpu_offload`` only rank 0 keeps the full state dict, as in torch, so the ranks of a
    host do not each hold a whole CPU copy. Every rank still takes part in the gathers."""
    return opts.full_state_dict and opts.cpu_offload and world_of_many() and dist.get_rank() != 0


def compact(value: Any) -> Any:
    """``value`` holding no more memory than its own elements (a sharded value sliced out
    of a full buffer would otherwise keep the whole buffer alive)."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor):
        local = value._local_tensor
        if local.untyped_storage().nbytes() > local.nbytes:
            return DTensor.from_local(
                local.clone(), value.device_mesh, value.placements,
                shape=value.shape, stride=value.stride(), run_check=False,
            )  # fmt: skip
        return value
    if isinstance(value, ShardedTensor):
        local = value._local_tensor
        if local.untyped_storage().nbytes() > local.nbytes:
            return ShardedTensor.from_local(
                local.detach().clone(), value.mesh, value.partition_spec, value.shape
            )
        return value
    if value.untyped_storage().nbytes() > value.nbytes:
        return value.clone()
    return value


def _header(items: list[tuple[str, Any]]) -> list[list[Any]]:
    """``[key, shape, dtype]`` per tensor and ``[key, None, value]`` per JSON value."""
    header = []
    for key, value in items:
        if isinstance(value, torch.Tensor):
            if is_sharded(value):
                raise TypeError(
                    f"broadcast_from_rank0: key {key!r} on rank 0 is sharded; pass a full "
                    "state dict (plain tensors) on rank 0"
                )
            header.append([key, list(value.shape), str(value.dtype).removeprefix("torch.")])
        elif is_json_value(value):
            header.append([key, None, value])
        else:
            raise TypeError(
                f"broadcast_from_rank0: key {key!r} on rank 0 is a {type(value).__name__}; "
                "only tensors and JSON values can be broadcast"
            )
    return header


def broadcast_items(
    make_items: Callable[[], list[tuple[str, Any]]],
    localize: Callable[[str, torch.Tensor], Any],
) -> dict[str, Any]:
    """Rank 0's ``(key, value)`` pairs (``make_items()``, called on rank 0 only) on every
    rank. An error making them on rank 0 is raised there and named on the other ranks.

    Tensors travel one at a time and each goes through ``localize(key, full)`` at once,
    which returns what the rank keeps (its shard), or ``None`` to keep nothing.
    """
    device = collective_device(bulk=True)  # the tensors; the header takes the CPU if it can
    header: Any = None
    items: list[tuple[str, Any]] = []
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            items = make_items()
            header = {"items": _header(items)}
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others know
            failure, header = exc, {"error": f"{type(exc).__name__}: {exc}"}
    header = broadcast_json(header)
    if "error" in header:  # every rank raises, none waits for a broadcast
        if failure is not None:
            raise failure
        raise StateDictMismatchError(
            f"broadcast_from_rank0: rank 0 could not send its state dict: {header['error']}"
        )
    values = dict(items)
    out: dict[str, Any] = {}
    for key, shape, extra in header["items"]:
        if shape is None:
            out[key] = extra
            continue
        if dist.get_rank() == 0:
            buf = values[key].detach().to(device=device).contiguous()
        else:
            buf = torch.empty(shape, dtype=getattr(torch, extra), device=device)
        dist.broadcast(buf, 0)
        kept = localize(key, buf)
        del buf
        if kept is not None:
            out[key] = compact(kept)
    return out


def broadcast_from_rank0(
    state_dict: Mapping[str, Any],
    entries: dict[str, tuple[str | None, Any]],
    root: torch.nn.Module,
) -> tuple[dict[str, Any], set[str]]:
    """A model state dict read on rank 0 only, as every rank's local values.

    Returns the values still to load and the keys already loaded: plain and DTensor
    targets are filled as each tensor arrives (copied into, or assigned where they are on
    the meta device), so no second copy of them is held. A key the model lacks keeps a
    meta-device placeholder, so it is still reported as unexpected.
    """
    if not world_of_many():
        return dict(state_dict), set()
    done: set[str] = set()

    def localize(key: str, full: torch.Tensor) -> Any:
        if key not in entries:
            return torch.empty(full.shape, dtype=full.dtype, device="meta")
        raw, target = entries[key]
        check_compatible(key, full, target, what="set_model_state_dict")
        value = import_value(full, target)
        if raw is not None and isinstance(target, torch.Tensor):
            if target.is_meta:
                root.load_state_dict({raw: compact(value)}, strict=False, assign=True)
            else:
                with torch.no_grad():
                    target.copy_(value)
            done.add(key)
            return None
        return value

    out = broadcast_items(lambda: list(state_dict.items()), localize)
    return out, done
