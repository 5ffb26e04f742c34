"""Validated FSDP options, shared by a root unit and the units it auto-wraps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

__all__ = ["FSDPOptions", "cast_floats"]

#: the dtypes compute_dtype and buffer_dtype may name
_ALLOWED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True, kw_only=True)
class FSDPOptions:
    """Options of one FSDP unit (see :class:`FullyShardedDataParallel` for their meaning)."""

    process_group: Any = None
    reshard_after_forward: bool = True
    flatten_parameters: bool = False
    auto_wrap_policy: Callable | None = None
    auto_wrapper_callable: Callable | None = None
    compute_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    fp32_reduce_scatter: bool = False
    sync_module_states: bool = False
    forward_prefetch: bool = True
    backward_prefetch: bool = True
    param_init_fn: Callable | None = None

    def __post_init__(self) -> None:
        for name in (
            "reshard_after_forward",
            "flatten_parameters",
            "fp32_reduce_scatter",
            "sync_module_states",
            "forward_prefetch",
            "backward_prefetch",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"FSDP option {name}={value!r} must be True or False")
        if self.flatten_parameters:
            raise ValueError(
                "flatten_parameters=True is not supported: shardkit FSDP shards each "
                "parameter along dim 0 (see docs/fsdp.md); pass flatten_parameters=False"
            )
        for name in ("compute_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _ALLOWED_DTYPES:
                raise ValueError(
                    f"FSDP option {name}={value!r} must be one of torch.bfloat16, "
                    "torch.float16, torch.float32, torch.float64 or None"
                )
        for name in ("auto_wrap_policy", "auto_wrapper_callable", "param_init_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"FSDP option {name}={value!r} must be callable or None")
        group = self.process_group
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"FSDP option process_group={group!r} must be a torch.distributed "
                "ProcessGroup or None (the default group)"
            )

    def for_child(self) -> dict[str, Any]:
        """Keyword arguments for an auto-wrapped child unit (no further auto-wrapping)."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)}
        kwargs.pop("auto_wrap_policy")
        kwargs.pop("auto_wrapper_callable")
        return kwargs


def cast_floats(value: Any, dtype: torch.dtype | None) -> Any:
    """Every floating tensor in ``value`` (a pytree) in ``dtype``; None: unchanged."""
    if dtype is None:
        return value

    def cast(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    return tree_map(cast, value)
