"""Hugging Face models under FSDP: ``save_pretrained`` must not write local shards."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

__all__ = ["guard_save_pretrained"]

_FIX = (
    "save_pretrained() on an FSDP-wrapped model would write this rank's shards (dim-0 rows), "
    "which from_pretrained cannot load. Either pass the full state dict, on every rank:\n"
    "    from shardkit.checkpoint.state_dict import StateDictOptions, get_model_state_dict\n"
    "    sd = get_model_state_dict(fsdp_model, options=StateDictOptions(full_state_dict=True, "
    "cpu_offload=True))\n"
    "    fsdp_model.module.save_pretrained(path, state_dict=sd, is_main_process=rank == 0)\n"
    "or save a checkpoint with shardkit.checkpoint.save and export it without gathering: "
    "shardkit.checkpoint.hf.to_hf(checkpoint, path, config=model.config) "
    "(or `shardkit ckpt convert CKPT DIR --to hf --config config.json`)"
)


def guard_save_pretrained(module: nn.Module) -> None:
    """Make ``module.save_pretrained`` (if it has one) refuse to write local shards.

    A call with an explicit ``state_dict=`` of full tensors goes through unchanged.
    """
    save = getattr(module, "save_pretrained", None)
    if not callable(save) or "save_pretrained" in vars(module):
        return

    @functools.wraps(save)
    def save_pretrained(*args: Any, **kwargs: Any) -> Any:
        state = kwargs.get("state_dict")
        if state is None:
            raise ValueError(_FIX)
        sharded = sorted(k for k, v in state.items() if _is_sharded(v))
        if sharded:
            raise ValueError(f"state_dict holds sharded values {sharded[:5]}. " + _FIX)
        return save(*args, **kwargs)

    module.save_pretrained = save_pretrained


def _is_sharded(value: Any) -> bool:
    return getattr(value, "_shardkit_sharded", False) or type(value).__name__ in (
        "ShardedTensor",
        "DTensor",
    )
