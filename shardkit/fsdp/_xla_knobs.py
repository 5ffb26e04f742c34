"""torch_xla FSDP keywords with no meaning here: accepted with one warning, or refused.

The rule: a knob that only tunes XLA compilation, tracing or padding (what runs is the
same) is accepted; a value other than torch_xla's default warns once per knob, naming what
it does on XLA. A knob that would change which ranks share data or what is computed is
refused with ValueError naming the fix.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["check_xla_knobs", "XLA_KNOBS"]

#: name -> (torch_xla default, what it does on XLA)
XLA_KNOBS: dict[str, tuple[Any, str]] = {
    "execute_sharding_on_init": (True, "runs xm.mark_step() after sharding to free full weights"),
    "optimization_barrier_in_forward": (
        True,
        "puts xm.optimization_barrier_ around each unit's forward inputs and outputs",
    ),
    "optimization_barrier_in_backward": (
        True,
        "puts xm.optimization_barrier_ around each unit's incoming gradients",
    ),
    "mark_step_on_finalization": (False, "runs xm.mark_step() when backward is finalized"),
    "disable_reshard_on_root": (
        True,
        "keeps the root unit's parameters gathered after forward (shardkit always does)",
    ),
    "shard_param_on_dim_0": (
        False,
        "shards each parameter on dim 0 instead of flattening it (shardkit always does)",
    ),
    "pin_layout_in_collective_ops": (True, "pins tensor layouts in XLA collectives"),
    "_shard_size_multiple": (128, "pads each shard to a multiple of this many elements"),
    "_use_xla_patched_linear": (True, "swaps in a Linear whose backward saves XLA memory"),
    "_debug_msg": ("xla_fsdp", "prefixes torch_xla's FSDP debug prints"),
    "_debug_print": (False, "prints torch_xla's FSDP debug messages"),
}

#: knobs that change what is computed: refused unless left at their default
_REFUSED = (
    "_debug_dummy_forward_pass",
    "_debug_dummy_all_gather_op",
    "_debug_dummy_all_reduce_op",
    "_debug_dummy_reduce_scatter_op",
    "_debug_dummy_optimization_barrier_op",
)

_WARNED: set[str] = set()


def check_xla_knobs(knobs: dict[str, Any], *, rank: int, world: int) -> None:
    """Validate torch_xla-only keywords; TypeError for a name neither torch_xla nor we know."""
    for name, value in knobs.items():
        if name in _REFUSED:
            if value:
                raise ValueError(
                    f"FSDP option {name}={value!r} replaces real work by a dummy on torch_xla; "
                    "shardkit has no such debug mode: remove the argument"
                )
            continue
        if name in ("sharding_groups", "sharding_rank", "sharding_world_size"):
            _check_sharding(name, value, rank=rank, world=world)
            continue
        if name not in XLA_KNOBS:
            raise TypeError(f"FullyShardedDataParallel got an unexpected keyword argument {name!r}")
        default, meaning = XLA_KNOBS[name]
        if value != default and name not in _WARNED:
            _WARNED.add(name)
            warnings.warn(
                f"FSDP option {name}={value!r} has no effect in shardkit: on torch_xla it "
                f"{meaning}; remove it to silence this warning",
                UserWarning,
                stacklevel=4,
            )


def _check_sharding(name: str, value: Any, *, rank: int, world: int) -> None:
    if value is None:
        return
    if name == "sharding_groups" and [list(g) for g in value] == [list(range(world))]:
        return
    if name == "sharding_rank" and value == rank:
        return
    if name == "sharding_world_size" and value == world:
        return
    raise ValueError(
        f"FSDP option {name}={value!r} asks for sharding groups other than the process "
        f"group (rank {rank} of {world}); shardkit shards over one group: pass "
        "process_group=torch.distributed.new_group(ranks) instead"
    )
