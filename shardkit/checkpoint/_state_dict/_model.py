"""Model state dicts keyed by the unwrapped model's FQNs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ... import runtime
from .._core._errors import StateDictMismatchError
from .._core._planner import on_rank
from ._broadcast import broadcast_from_rank0, dropped_here
from ._fqn import (
    clean_key,
    param_fqns,
    root_sharded_module,
    sharded_modules,
    strip_wrappers,
    under,
    unwrap,
)
from ._options import StateDictOptions, resolve_options
from ._values import check_compatible, export_value, import_value

__all__ = ["IncompatibleKeys", "get_model_state_dict", "set_model_state_dict"]


class IncompatibleKeys(NamedTuple):
    """Keys the model has but the state dict lacked, and keys the model does not have."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def submodule_prefixes(model: nn.Module, submodules: Iterable[nn.Module] | None) -> list[str]:
    """Clean FQNs of ``submodules`` inside ``model`` (``[""]`` for the whole model)."""
    if submodules is None:
        return [""]
    root = unwrap(model)
    names = {id(m): clean_key(root, raw) for raw, m in root.named_modules()}
    prefixes = []
    for module in submodules:
        if id(module) not in names:
            raise ValueError(
                f"submodule {type(module).__name__} is not part of the model; pass "
                "sub-modules reachable from the model's named_modules()"
            )
        prefixes.append(names[id(module)])
    return prefixes


def _live_entries(model: nn.Module) -> tuple[dict[str, tuple[str | None, Any]], dict]:
    """Clean key -> (raw key or None for a sharded-module entry, live value).

    The second result maps each sharded module's clean prefix to the module.
    """
    top = root_sharded_module(model)
    if top is not None:
        entries = {
            strip_wrappers(k): (None, v) for k, v in top._shardkit_sharded_state_dict().items()
        }
        return entries, {"": top}
    root = unwrap(model)
    nested = sharded_modules(root)
    entries: dict[str, tuple[str | None, Any]] = {}
    for raw, value in root.state_dict(keep_vars=True).items():
        key = clean_key(root, raw)
        if not under(key, nested):
            entries[key] = (raw, value)
    for prefix, module in nested.items():
        for k, v in module._shardkit_sharded_state_dict().items():
            entries[f"{prefix}.{strip_wrappers(k)}"] = (None, v)
    return entries, nested


def _without_wrapper_names(model: nn.Module, state_dict: Mapping, entries: dict) -> Mapping:
    """``state_dict`` with keys of the wrappers' own ``state_dict()`` (``module.`` of DDP
    and FSDP) renamed to the unwrapped FQNs this loads, as torch's DDP accepts them: a
    ``strict=False`` load would otherwise load nothing, silently."""
    if all(k in entries for k in state_dict):
        return state_dict
    out = {}
    for key, value in state_dict.items():
        if key not in entries and isinstance(key, str):
            try:
                clean = clean_key(model, key)
            except (AttributeError, KeyError, ValueError):
                clean = key
            if clean in entries and clean not in state_dict:
                key = clean
        out[key] = value
    return out


def _frozen(model: nn.Module) -> set[str]:
    """Clean FQNs of parameters with ``requires_grad=False`` (every name of a shared one)."""
    root = unwrap(model)
    frozen = {
        clean_key(root, raw)
        for raw, p in root.named_parameters(remove_duplicate=False)
        if not p.requires_grad
    }
    fqns, _ = param_fqns(model)  # names sharded modules give their own parameters
    frozen.update(fqns[id(p)] for p in root.parameters() if not p.requires_grad and id(p) in fqns)
    return frozen


def get_model_state_dict(
    model: nn.Module,
    *,
    submodules: Iterable[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The model's state dict keyed by unwrapped FQNs.

    Sharded parameters stay ``DTensor`` / ``ShardedTensor`` (so a checkpoint reshards
    them) unless ``options.full_state_dict``. With both ``full_state_dict`` and
    ``cpu_offload``, only rank 0 gets the state dict; other ranks get ``{}`` (as torch). Modules implementing
    ``_shardkit_sharded_state_dict()`` answer for themselves.

    Args:
        model: a plain module, or one wrapped by torch DDP, shardkit DDP/FSDP,
            ``torch.compile``, activation checkpointing or torch FSDP2.
        submodules: keep only the entries of these sub-modules (keys stay model-relative).
        options: see :class:`StateDictOptions`.
    """
    opts = resolve_options(options)
    runtime.init()  # join the world the environment describes (torchrun, SLURM)
    prefixes = submodule_prefixes(model, submodules)
    entries, _ = _live_entries(model)
    frozen = _frozen(model) if opts.ignore_frozen_params else set()
    drop = dropped_here(opts)
    out: dict[str, Any] = {}
    for key, (_, value) in entries.items():
        if key in frozen or not under(key, prefixes):
            continue
        if not opts.keep_submodule_prefixes and submodules is not None:
            prefix = max((p for p in prefixes if under(key, [p])), key=len)
            key = key[len(prefix) + 1 :] if prefix else key
        value = export_value(
            value, full=opts.full_state_dict, cpu=opts.cpu_offload and not drop, key=key
        )
        if not drop:  # gathered with the other ranks, then let go
            out[key] = value
    return out


def _report(what: str, missing: list[str], unexpected: list[str], strict: bool) -> None:
    if not strict or (not missing and not unexpected):
        return  # as torch: the caller gets them back in IncompatibleKeys
    parts = []
    if missing:
        parts.append(f"missing keys {missing}")
    if unexpected:
        parts.append(f"unexpected keys {unexpected}")
    raise StateDictMismatchError(
        f"{on_rank()}{what}: "
        + " and ".join(parts)
        + "; fix the state dict, or pass StateDictOptions(strict=False) to skip them"
    )


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: Mapping[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> IncompatibleKeys:
    """Load ``model_state_dict`` (keyed by unwrapped FQNs) into ``model`` in place.

    Full tensors are sliced into sharded parameters locally; sharded values (e.g. after an
    N->M resharding load) are copied shard to shard. Values are cast to the model's dtypes,
    as torch's ``load_state_dict`` does. Parameters on the meta device are materialised
    from the values (on the values' device), as torch does. An empty state dict changes
    nothing (as torch). With ``options.broadcast_from_rank0``, only rank 0's state dict is
    read: each tensor is broadcast and sliced one at a time.

    Raises:
        StateDictMismatchError: a shape mismatch, or missing / unexpected keys when
            ``options.strict`` (a ``RuntimeError`` as torch's, and a ``ValueError``).

    Returns:
        :class:`IncompatibleKeys` (empty lists unless ``options.strict`` is off).
    """
    opts = resolve_options(options)
    runtime.init()  # join the world the environment describes (torchrun, SLURM)
    if not isinstance(model_state_dict, Mapping):
        raise TypeError(
            f"model_state_dict must be a mapping of FQN -> value, got "
            f"{type(model_state_dict).__name__}"
        )
    entries, sharded = _live_entries(model)
    model_state_dict = _without_wrapper_names(model, model_state_dict, entries)
    done: set[str] = set()
    if opts.broadcast_from_rank0:
        model_state_dict, done = broadcast_from_rank0(model_state_dict, entries, unwrap(model))
        model_state_dict = {**model_state_dict, **{k: entries[k][1] for k in done}}
    if not model_state_dict:
        return IncompatibleKeys([], [])
    frozen = _frozen(model) if opts.ignore_frozen_params else set()
    missing = sorted(k for k in entries if k not in model_state_dict and k not in frozen)
    unexpected = sorted(k for k in model_state_dict if k not in entries)
    _report("set_model_state_dict", missing, unexpected, opts.strict)

    plain: dict[str, Any] = {}
    assign: dict[str, Any] = {}
    per_module: dict[str, dict[str, Any]] = {prefix: {} for prefix in sharded}
    for key, value in model_state_dict.items():
        if key not in entries or key in done:
            continue
        raw, target = entries[key]
        check_compatible(key, value, target, what="set_model_state_dict")
        value = import_value(value, target)
        if raw is not None:
            if isinstance(target, torch.Tensor) and target.is_meta:
                assign[raw] = value if value is not model_state_dict[key] else value.clone()
            else:
                plain[raw] = value
            continue
        per_module[_owner(key, sharded)][key] = value
    for key, (raw, current) in entries.items():
        # sharded modules load all their entries at once: skipped keys keep their values
        if raw is None and key not in model_state_dict:
            per_module[_owner(key, sharded)][key] = current

    root = unwrap(model)
    if plain:
        _load_plain(root, plain)
    if assign:
        _load_plain(root, assign, assign=True)
    for prefix, module in sharded.items():
        cut = len(prefix) + 1 if prefix else 0
        raw_keys = {strip_wrappers(k): k for k in module._shardkit_sharded_state_dict()}
        module._shardkit_load_sharded_state_dict(
            {raw_keys.get(k[cut:], k[cut:]): v for k, v in per_module[prefix].items()}
        )
    return IncompatibleKeys(missing, unexpected)


def _owner(key: str, sharded: dict[str, nn.Module]) -> str:
    """The clean prefix of the sharded module an entry belongs to."""
    return next(p for p in sharded if under(key, [p]))


def _load_plain(root: nn.Module, plain: dict[str, Any], *, assign: bool = False) -> None:
    """Copy values through ``load_state_dict`` so module hooks (FSDP2's) run; ``assign``
    replaces meta-device tensors by the values instead of copying into them."""
    result = root.load_state_dict(plain, strict=False, assign=assign)
    if result.unexpected_keys:  # plain holds only keys the model lists: an override did it
        raise StateDictMismatchError(
            f"{on_rank()}set_model_state_dict: {type(root).__name__}.load_state_dict "
            f"reported unexpected keys {sorted(result.unexpected_keys)}, which the model's "
            "own state_dict lists (does the module override load_state_dict?)"
        )
