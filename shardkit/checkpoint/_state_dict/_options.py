"""Options shared by the state-dict helpers."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .._core._planner import warn_once

__all__ = ["StateDictOptions"]


@dataclass(frozen=True, kw_only=True)
class StateDictOptions:
    """How :mod:`shardkit.checkpoint.state_dict` builds and applies state dicts.

    Args:
        full_state_dict: gather every sharded value (torch ``DTensor``, shardkit
            ``ShardedTensor``) into a plain tensor holding the whole value, on every rank
            (on rank 0 alone with ``cpu_offload``).
            Off by default: sharded values stay sharded so a checkpoint saves only local
            bytes and reshards on load.
        cpu_offload: move plain tensors (and gathered ones) to CPU. Sharded values that are
            not gathered keep their device, since their mesh is bound to it. With
            ``full_state_dict`` too, only rank 0 gets the state dict (other ranks get
            ``{}``, as in torch), so a host's ranks do not each hold a CPU copy.
        strict: when setting a model state dict, missing or unexpected keys raise
            :class:`~shardkit.checkpoint.StateDictMismatchError` (a ``RuntimeError``, as
            torch, and a ``ValueError``) listing them; otherwise they are skipped and
            returned in :class:`IncompatibleKeys`, as torch does.
        ignore_frozen_params: leave out parameters with ``requires_grad=False`` when
            getting, and do not report them as missing when setting.
        keep_submodule_prefixes: with ``submodules``, keep the keys model-relative
            (default) or make them relative to each submodule (torch's deprecated option).
        broadcast_from_rank0: when setting, rank 0 alone holds a full state dict (the
            others may pass ``{}``); each tensor is broadcast from rank 0 one at a time and
            sliced to the local shard, so a rank's peak memory is about its shard plus one
            tensor. Needs ``full_state_dict=True``, as in torch.
        flatten_optimizer_state_dict: optimizer state dicts as one flat mapping,
            ``state.<fqn>.<name>`` and ``param_groups.<fqn>.<hyperparameter>``, as torch's.
            ``set_optimizer_state_dict`` accepts this form whatever the option.
        dsd_fqn_modifiers: torch's hook name for modules that rename their FQNs; accepted,
            shardkit's wrappers need no such hook (another value warns once).
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    strict: bool = True
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False
    dsd_fqn_modifiers: str = "_fqn_modifiers"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "dsd_fqn_modifiers":
                if not isinstance(value, str):
                    raise TypeError(
                        f"StateDictOptions.dsd_fqn_modifiers must be a str, got {value!r}"
                    )
                if value != "_fqn_modifiers":
                    warn_once(
                        f"StateDictOptions(dsd_fqn_modifiers={value!r}) has no effect: shardkit "
                        "finds wrapper prefixes itself (docs/state-dict.md)"
                    )
                continue
            if not isinstance(value, bool):
                raise TypeError(
                    f"StateDictOptions.{f.name} must be a bool, got {value!r} "
                    f"({type(value).__name__})"
                )
        if self.broadcast_from_rank0 and not self.full_state_dict:
            raise ValueError(
                "StateDictOptions(broadcast_from_rank0=True) needs full_state_dict=True: rank 0 "
                "holds the full state dict that is broadcast"
            )


def resolve_options(options: StateDictOptions | None) -> StateDictOptions:
    """``options`` or the defaults; anything else is a TypeError naming its type."""
    if options is None:
        return StateDictOptions()
    if _is_torch_options(options):  # code moved over keeps torch's import: take its fields
        names = {f.name for f in fields(StateDictOptions)}
        return StateDictOptions(**{k: v for k, v in vars(options).items() if k in names})
    if not isinstance(options, StateDictOptions):
        raise TypeError(
            f"options must be a StateDictOptions, got {type(options).__name__}; build one with "
            "StateDictOptions(full_state_dict=..., cpu_offload=..., strict=..., "
            "ignore_frozen_params=..., broadcast_from_rank0=...)"
        )
    return options


def _is_torch_options(options: object) -> bool:
    cls = type(options)
    return cls.__name__ == "StateDictOptions" and cls.__module__.startswith(
        "torch.distributed.checkpoint"
    )
