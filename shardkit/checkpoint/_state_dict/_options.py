"""Options shared by the state-dict helpers."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["StateDictOptions"]


@dataclass(frozen=True, kw_only=True)
class StateDictOptions:
    """How :mod:`shardkit.checkpoint.state_dict` builds and applies state dicts.

    Args:
        full_state_dict: gather every sharded value (torch ``DTensor``, shardkit
            ``ShardedTensor``) into a plain tensor holding the whole value, on every rank.
            Off by default: sharded values stay sharded so a checkpoint saves only local
            bytes and reshards on load.
        cpu_offload: move plain tensors (and gathered ones) to CPU. Sharded values that are
            not gathered keep their device, since their mesh is bound to it.
        strict: when setting a model state dict, missing or unexpected keys raise
            ``ValueError`` listing them; otherwise they are skipped with a warning.
        ignore_frozen_params: leave out parameters with ``requires_grad=False`` when
            getting, and do not report them as missing when setting.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    strict: bool = True
    ignore_frozen_params: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"StateDictOptions.{f.name} must be a bool, got {value!r} "
                    f"({type(value).__name__})"
                )


def resolve_options(options: StateDictOptions | None) -> StateDictOptions:
    """``options`` or the defaults; anything else is a TypeError naming its type."""
    if options is None:
        return StateDictOptions()
    if not isinstance(options, StateDictOptions):
        raise TypeError(
            f"options must be a StateDictOptions, got {type(options).__name__}; build one with "
            "StateDictOptions(full_state_dict=..., cpu_offload=..., strict=..., "
            "ignore_frozen_params=...)"
        )
    return options
