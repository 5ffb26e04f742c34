"""Optimizer state dicts keyed by parameter FQN, so they reshard N->M ranks."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ... import runtime
from ...spmd import ShardedTensor
from .._core._comm import world_of_many
from .._core._errors import StateDictMismatchError, UsageError
from .._core._planner import on_rank
from ._broadcast import broadcast_items, dropped_here
from ._fqn import param_fqns, strip_wrappers, under
from ._model import submodule_prefixes
from ._options import StateDictOptions, resolve_options
from ._values import export_value, import_value, is_sharded

__all__ = ["get_optimizer_state_dict", "set_optimizer_state_dict", "as_optimizers"]


def as_optimizers(optimizers: Any, caller: str | None = None) -> list[torch.optim.Optimizer]:
    """One optimizer or an iterable of them, as a list. Empty is allowed unless ``caller``
    (a function that handles optimizers only) is named: torch refuses it there with a
    ``RuntimeError``, and :class:`UsageError` is one."""
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    try:
        optims = list(optimizers)
    except TypeError:
        optims = None
    if optims is None or not all(isinstance(o, torch.optim.Optimizer) for o in optims):
        raise TypeError(
            "optimizers must be a torch.optim.Optimizer or an iterable of them, got "
            f"{type(optimizers).__name__}"
        )
    if not optims and caller is not None:
        raise UsageError(
            f"{caller}: optimizers is empty; pass the optimizer(s) whose state you want "
            "(get_model_state_dict / set_model_state_dict handle a model alone)"
        )
    return optims


def _params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in the order ``Optimizer.state_dict()`` numbers them."""
    return [p for group in optim.param_groups for p in group["params"]]


def prime_state(optim: torch.optim.Optimizer) -> None:
    """Allocate an untouched optimizer's state so a checkpoint can load into it in place.

    Runs one step at learning rate 0 (with zero gradients where a parameter has none), then
    zeroes every state tensor it created, which is what a fresh optimizer would start from
    (step 0, zero moments). Optimizers whose ``step`` needs a closure (LBFGS) are not
    supported.
    """
    if optim.state:
        return
    params = [p for p in _params(optim) if p.requires_grad]
    if not params:
        return
    made_grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
            made_grads.append(p)
    lrs = []
    for group in optim.param_groups:
        lrs.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p in made_grads:
            p.grad = None
    with torch.no_grad():
        for state in optim.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    value.zero_()


def _layouts(
    owners: dict[int, tuple[nn.Module, str]], fqns: dict[int, str]
) -> dict[int, ShardedTensor]:
    """For plain local parameters a sharded module answers for, its ShardedTensor layout."""
    cache: dict[int, dict[str, Any]] = {}
    out: dict[int, ShardedTensor] = {}
    for pid, (module, prefix) in owners.items():
        if id(module) not in cache:
            cache[id(module)] = {
                strip_wrappers(k): v for k, v in module._shardkit_sharded_state_dict().items()
            }
        name = fqns[pid][len(prefix) + 1 :] if prefix else fqns[pid]
        value = cache[id(module)].get(name)
        if isinstance(value, ShardedTensor):
            out[pid] = value
    return out


def _wrap_like(value: Any, param: torch.Tensor, layout: ShardedTensor | None) -> Any:
    """A state tensor of a plain local shard, re-described as its global sharded value."""
    if layout is None or not torch.is_tensor(value) or is_sharded(value) or value.ndim == 0:
        return value
    if tuple(value.shape) != tuple(param.shape):
        return value
    with torch.no_grad():
        return ShardedTensor.from_local(value, layout.mesh, layout.partition_spec, layout.shape)


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: Iterable[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``.

    State of a sharded parameter stays sharded like the parameter (unless
    ``options.full_state_dict``), so the checkpoint core reshards it. With both
    ``full_state_dict`` and ``cpu_offload``, only rank 0 gets it; other ranks get ``{}``. An optimizer that
    has not stepped yet gets its state allocated first (see :func:`prime_state`).
    """
    opts = resolve_options(options)
    runtime.init()  # join the world the environment describes (torchrun, SLURM)
    optims = as_optimizers(optimizers, "get_optimizer_state_dict")
    prefixes = submodule_prefixes(model, submodules)
    fqns, owners = param_fqns(model)
    layouts = _layouts(owners, fqns)
    drop = dropped_here(opts)
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for n, optim in enumerate(optims):
        prime_state(optim)
        params = _params(optim)
        names = _names(params, fqns, n)
        osd = optim.state_dict()
        for i, entry in osd["state"].items():
            if not under(names[i], prefixes):
                continue
            param = params[i]
            exported = {
                k: export_value(
                    _wrap_like(v, param, layouts.get(id(param))),
                    full=opts.full_state_dict,
                    cpu=opts.cpu_offload and not drop,
                    key=f"state.{names[i]}.{k}",
                )
                for k, v in entry.items()
            }
            if not drop:  # gathered with the other ranks, then let go
                state[names[i]] = exported
        for group in osd["param_groups"]:
            kept = [names[i] for i in group["params"] if under(names[i], prefixes)]
            if kept or not group["params"]:  # an empty group is kept, as torch
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": kept})
    if drop:
        return {}
    out = {"state": state, "param_groups": groups}
    return flatten_optim(out) if opts.flatten_optimizer_state_dict else out


def _names(params: list[torch.Tensor], fqns: dict[int, str], n: int) -> list[str]:
    """The FQN of each of optimizer ``n``'s parameters; ValueError for a stranger."""
    for i, p in enumerate(params):
        if id(p) not in fqns:
            raise ValueError(
                f"optimizer {n} parameter {i} (shape {tuple(p.shape)}) is not a parameter "
                "of the model; build the optimizer from model.parameters()"
            )
    return [fqns[id(p)] for p in params]


def _saved_group(saved: list[dict[str, Any]], names: list[str]) -> dict[str, Any] | None:
    """The saved group holding any of ``names``; the last one when several do, as torch."""
    wanted = set(names)
    for group in reversed(saved):
        if wanted & set(group.get("params", ())):
            return group
    return None


def _import_for(value: Any, param: torch.Tensor, layout: ShardedTensor | None) -> Any:
    if layout is not None and torch.is_tensor(value) and value.ndim > 0:
        if tuple(value.shape) == tuple(layout.shape) and tuple(value.shape) != tuple(param.shape):
            value = import_value(value, layout)
        if isinstance(value, ShardedTensor):
            if value.partition_spec != layout.partition_spec:
                value = value.redistribute(layout.partition_spec)
            return value.local_tensor().detach()
    if torch.is_tensor(value) and value.ndim > 0 and tuple(value.shape) == tuple(param.shape):
        return import_value(value, param)
    return value


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: Mapping[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load an optimizer state dict into ``optimizers`` in place.

    Takes what :func:`get_optimizer_state_dict` returns (FQN-keyed, nested or flattened)
    and, as torch does, a raw ``Optimizer.state_dict()`` keyed by parameter ids, which
    are matched to ``optimizers``' parameters in order. Hyperparameters come from the
    saved group holding the same parameters; an empty group takes the saved empty group
    at the same position. Full state tensors are sliced like their (sharded) parameter.
    Saved state for parameters none of ``optimizers`` holds is skipped with a warning, so
    one merged state dict can be loaded into several optimizers one call at a time. With
    ``options.broadcast_from_rank0`` only rank 0's state dict is read.
    """
    opts = resolve_options(options)
    runtime.init()  # join the world the environment describes (torchrun, SLURM)
    optims = as_optimizers(optimizers, "set_optimizer_state_dict")
    fqns, owners = param_fqns(model)
    for n, optim in enumerate(optims):  # validate every optimizer before changing any
        _names(_params(optim), fqns, n)
    layouts = _layouts(owners, fqns)
    if opts.broadcast_from_rank0 and world_of_many():
        optim_state_dict = _broadcast_optim(optim_state_dict, optims, fqns, layouts)
    # torch checks only FQN-keyed state, and none at all when it is empty (no key then
    # is a str: its check is skipped as for a raw id-keyed Optimizer.state_dict())
    saved_by_fqn = any(isinstance(k, str) for k in _state_keys(optim_state_dict))
    optim_state_dict = _fqn_keyed(optim_state_dict, optims, fqns)
    saved_state, saved_groups = optim_state_dict["state"], optim_state_dict["param_groups"]
    if opts.strict and saved_by_fqn:  # as torch, and before any optimizer changes
        missing = [
            fqns[id(p)]
            for optim in optims
            for p in _params(optim)
            if p.requires_grad and fqns[id(p)] not in saved_state
        ]
        if missing:
            raise StateDictMismatchError(
                f"{on_rank()}set_optimizer_state_dict: no saved optimizer state for "
                f"parameter(s) {missing}, which require gradients; the optimizers are "
                "unchanged. Pass StateDictOptions(strict=False) to load the rest (their "
                "state is then dropped, as torch does)"
            )
    if not saved_groups and any(optim.param_groups for optim in optims):
        raise ValueError(  # else every optimizer would silently lose its state
            f"{on_rank()}set_optimizer_state_dict: optim_state_dict has no param_groups, but "
            "the optimizers have some; the optimizers are unchanged. Pass the state dict "
            "get_optimizer_state_dict returned"
        )
    if opts.strict:  # a group no saved group knows: the state dict of another optimizer
        strangers = [
            names
            for n, optim in enumerate(optims)
            for group in optim.param_groups
            if (names := _names(list(group["params"]), fqns, n))
            and _saved_group(saved_groups, names) is None
        ]
        if strangers:
            shown = [*strangers[0][:3], "..."] if len(strangers[0]) > 3 else strangers[0]
            raise ValueError(
                f"{on_rank()}set_optimizer_state_dict: no saved param group holds any of the "
                f"parameters {shown} of an optimizer group ({len(saved_groups)} saved "
                "group(s)): the state dict of another model or optimizer? The optimizers "
                "are unchanged. Pass "
                "StateDictOptions(strict=False) to keep such groups' own hyperparameters "
                "(their state is then dropped, as torch does)"
            )
    empty_saved = [g for g in saved_groups if not g.get("params")]
    used: set[str] = set()
    for n, optim in enumerate(optims):
        new_state: dict[int, dict[str, Any]] = {}
        new_groups: list[dict[str, Any]] = []
        index = 0
        for group in optim.param_groups:
            names = _names(list(group["params"]), fqns, n)
            if names:
                saved = _saved_group(saved_groups, names)
            else:
                saved = empty_saved.pop(0) if empty_saved else None
            base = {  # a tuple (Adam's betas) that came back as a JSON list stays a tuple
                k: tuple(v) if isinstance(v, list) and isinstance(group.get(k), tuple) else v
                for k, v in (saved or group).items()
                if k != "params"
            }
            new_groups.append({**base, "params": list(range(index, index + len(names)))})
            for p, name in zip(group["params"], names):
                if name in saved_state:
                    used.add(name)
                    layout = layouts.get(id(p))
                    new_state[index] = {
                        k: _import_for(v, p, layout) for k, v in saved_state[name].items()
                    }
                index += 1
        optim.load_state_dict({"state": new_state, "param_groups": new_groups})
    extra = sorted(set(saved_state) - used)
    if extra:
        warnings.warn(
            f"set_optimizer_state_dict: state for {extra} matches no parameter of the given "
            "optimizers; skipped",
            stacklevel=2,
        )


def _state_keys(osd: Any) -> list:
    """The parameter keys of a nested or flattened optimizer state dict (ints for a raw
    ``Optimizer.state_dict()``); none for anything else (``_fqn_keyed`` refuses it)."""
    if not isinstance(osd, Mapping):
        return []
    state = osd.get("state")
    if isinstance(state, Mapping):
        return list(state)
    return [k for k in osd if isinstance(k, str) and k.startswith(_FLAT)]


def _fqn_keyed(osd: Any, optims: list, fqns: dict[int, str]) -> dict[str, Any]:
    """``osd`` as ``{"state": {fqn: ...}, "param_groups": [{"params": [fqn]}]}``, from
    any of: that form, torch's flattened form, or a raw id-keyed ``Optimizer.state_dict()``."""
    if not isinstance(osd, Mapping):
        raise TypeError(
            f"optim_state_dict must be a mapping, got {type(osd).__name__}; pass what "
            "get_optimizer_state_dict or Optimizer.state_dict() returns"
        )
    if not {"state", "param_groups"} <= set(osd):
        if osd and all(isinstance(k, str) and k.startswith(_FLAT) for k in osd):
            return unflatten_optim(osd, optims, fqns)
        raise StateDictMismatchError(
            "optim_state_dict must be a mapping with 'state' and 'param_groups' keys (as "
            "get_optimizer_state_dict or Optimizer.state_dict() return) or torch's flattened "
            f"form; got keys {sorted(map(str, osd))[:5]}"
        )
    groups = osd["param_groups"]
    ids = [i for g in groups for i in g.get("params", ())]
    if not ids or all(isinstance(i, str) for i in ids):
        return osd
    if not all(isinstance(i, int) for i in ids):
        raise TypeError("optim_state_dict param_groups mix parameter ids and FQNs")
    params = [p for o in optims for p in _params(o)]
    if len(ids) != len(params):
        raise StateDictMismatchError(
            f"optim_state_dict (an Optimizer.state_dict() keyed by ids) holds {len(ids)} "
            f"parameters but the optimizers hold {len(params)}; they must match in order"
        )
    name_of = {i: fqns[id(p)] for i, p in zip(ids, params)}
    return {
        "state": {name_of[i]: v for i, v in osd["state"].items()},
        "param_groups": [
            {**g, "params": [name_of[i] for i in g.get("params", ())]} for g in groups
        ],
    }


_FLAT = ("state.", "param_groups.")


def flatten_optim(osd: dict[str, Any]) -> dict[str, Any]:
    """torch's flattened optimizer state dict: ``state.<fqn>.<name>`` and
    ``param_groups.<fqn>.<hyperparameter>``."""
    out: dict[str, Any] = {}
    for fqn, entry in osd["state"].items():
        for name, value in entry.items():
            out[f"state.{fqn}.{name}"] = value
    for group in osd["param_groups"]:
        for fqn in group["params"]:
            for name, value in group.items():
                if name != "params":
                    out[f"param_groups.{fqn}.{name}"] = value
    return out


def unflatten_optim(flat: Mapping[str, Any], optims: list, fqns: dict[int, str]) -> dict:
    """The nested form of :func:`flatten_optim`'s output, grouped like ``optims``."""
    names = sorted({fqns[id(p)] for o in optims for p in _params(o)}, key=len, reverse=True)

    def split(rest: str) -> tuple[str, str] | None:
        for fqn in names:  # longest first: an FQN may contain dots
            if rest.startswith(fqn + "."):
                return fqn, rest[len(fqn) + 1 :]
        return None

    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        kind, rest = key.split(".", 1)
        found = split(rest)
        if found is None:
            continue
        fqn, name = found
        (state if kind == "state" else hyper).setdefault(fqn, {})[name] = value
    groups = []
    for o in optims:
        for group in o.param_groups:
            members = [fqns[id(p)] for p in group["params"]]
            first = next((hyper[m] for m in members if m in hyper), None)
            if first is not None:
                groups.append({**first, "params": members})
    return {"state": state, "param_groups": groups}


def _broadcast_optim(osd: Any, optims: list, fqns: dict[int, str], layouts: dict) -> dict:
    """Rank 0's optimizer state dict on every rank, each state tensor sliced like its
    parameter as it arrives (see :mod:`._broadcast`)."""
    params = {fqns[id(p)]: p for o in optims for p in _params(o)}

    def make_items() -> list[tuple[str, Any]]:
        nested = _fqn_keyed(osd, optims, fqns)
        items = [(f"state.{fqn}.{k}", v) for fqn, e in nested["state"].items()
                 for k, v in e.items()]  # fmt: skip
        groups = []
        for i, group in enumerate(nested["param_groups"]):
            # a tensor hyperparameter (lr=torch.tensor(0.01)) travels as a tensor item
            tensors = {k: v for k, v in group.items() if isinstance(v, torch.Tensor)}
            items.extend((f"param_groups.{i}.{k}", v) for k, v in tensors.items())
            groups.append({k: v for k, v in group.items() if k not in tensors})
        items.append(("param_groups", groups))
        return items

    keys: dict[str, tuple[str, str]] = {}

    def localize(key: str, full: torch.Tensor) -> Any:
        rest = key[len("state.") :]
        fqn = max((f for f in params if rest.startswith(f + ".")), key=len, default=None)
        if fqn is None:
            return full.clone()
        keys[key] = (fqn, rest[len(fqn) + 1 :])
        p = params[fqn]
        return _import_for(full, p, layouts.get(id(p)))

    got = broadcast_items(make_items, localize)
    state: dict[str, dict[str, Any]] = {}
    groups = got["param_groups"]
    for key, value in got.items():
        if key.startswith("param_groups."):
            _, i, name = key.split(".", 2)
            groups[int(i)][name] = value
            continue
        if key == "param_groups":
            continue
        if key not in keys:  # a JSON value (e.g. a step count kept as a number)
            rest = key[len("state.") :]
            fqn = max((f for f in params if rest.startswith(f + ".")), key=len, default=None)
            if fqn is None:
                continue
            keys[key] = (fqn, rest[len(fqn) + 1 :])
        fqn, name = keys[key]
        state.setdefault(fqn, {})[name] = value
    return {"state": state, "param_groups": groups}
