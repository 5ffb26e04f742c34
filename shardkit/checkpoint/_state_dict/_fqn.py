"""Unwrapping and fully qualified names (FQNs) for the state-dict helpers.

Keys must be the *unwrapped* model's FQNs so a checkpoint written under one wrapper
(torch DDP, shardkit DDP/FSDP, torch.compile, activation checkpointing, FSDP1) loads
under another, or under none. A wrapper contributes no name component: we walk a key's
components down the module tree and drop the one that names a wrapper's inner module.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = [
    "wrapped_child",
    "unwrap",
    "wrapper_chain",
    "clean_key",
    "sharded_modules",
    "root_sharded_module",
    "param_fqns",
    "under",
    "strip_wrappers",
]

#: Attribute names under which well-known wrappers keep the module they wrap:
#: torch.compile, activation-checkpoint wrappers and FSDP1.
_INNER_NAMES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")

_SAVE = "_shardkit_sharded_state_dict"
_LOAD = "_shardkit_load_sharded_state_dict"
_FQNS = "_shardkit_param_fqns"


def wrapped_child(module: nn.Module) -> tuple[str, nn.Module] | None:
    """``(name, inner)`` when ``module`` only wraps ``inner``; ``None`` otherwise."""
    if isinstance(module, nn.parallel.DistributedDataParallel) or getattr(
        type(module), "_shardkit_wrapper", False
    ):
        inner = getattr(module, "module", None)
        if isinstance(inner, nn.Module):
            return "module", inner
    for name in _INNER_NAMES:
        inner = module._modules.get(name)
        if inner is not None:
            return name, inner
    return None


def wrapper_chain(model: nn.Module) -> list[nn.Module]:
    """``model`` and every module it wraps, outermost first, ending at the real model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    chain = [model]
    while (step := wrapped_child(chain[-1])) is not None:
        chain.append(step[1])
    return chain


def unwrap(model: nn.Module) -> nn.Module:
    """The model under every outer wrapper."""
    return wrapper_chain(model)[-1]


def clean_key(root: nn.Module, raw: str) -> str:
    """``raw`` (a key relative to ``root``) with every wrapper component removed.

    Wrappers whose state-dict hooks already removed their component (checkpoint
    wrappers do) are stepped through transparently.
    """
    parts = raw.split(".") if raw else []
    out: list[str] = []
    module: nn.Module | None = root
    i = 0
    while i < len(parts):
        while module is not None and (step := wrapped_child(module)) is not None:
            if parts[i] == step[0]:
                i += 1
            module = step[1]
            if i == len(parts):
                break
        if i == len(parts):
            break
        child = module._modules.get(parts[i]) if module is not None else None
        out.append(parts[i])
        module = child
        i += 1
    return ".".join(out)


def strip_wrappers(name: str) -> str:
    """``name`` without wrapper components (``_checkpoint_wrapped_module``, ``_orig_mod``,
    ``_fsdp_wrapped_module``): for keys a sharded module reports for itself, e.g. after
    torch's ``apply_activation_checkpointing`` under shardkit FSDP."""
    if not any(w in name for w in _INNER_NAMES):
        return name
    return ".".join(p for p in name.split(".") if p not in _INNER_NAMES)


def under(key: str, prefixes: Iterable[str]) -> bool:
    """Whether ``key`` is one of ``prefixes`` or lies below one ("" is the root)."""
    return any(p == "" or key == p or key.startswith(p + ".") for p in prefixes)


def root_sharded_module(model: nn.Module) -> nn.Module | None:
    """The outermost module of the wrapper chain implementing the sharded protocol."""
    for module in wrapper_chain(model):
        if callable(getattr(module, _SAVE, None)):
            if not callable(getattr(module, _LOAD, None)):
                raise TypeError(
                    f"{type(module).__name__} implements {_SAVE}() but not {_LOAD}(state); "
                    "a sharded module must implement both"
                )
            return module
    return None


def sharded_modules(root: nn.Module) -> dict[str, nn.Module]:
    """Outermost sub-modules of ``root`` implementing the sharded protocol, by clean FQN."""
    found: dict[str, nn.Module] = {}
    raw_found: list[str] = []
    for raw, module in root.named_modules():
        if raw == "" or under(raw, raw_found):
            continue
        if callable(getattr(module, _SAVE, None)):
            raw_found.append(raw)
            found[clean_key(root, raw)] = module
    return found


def _module_param_fqns(module: nn.Module, prefix: str) -> dict[int, str]:
    out: dict[int, str] = {}
    fqns = getattr(module, _FQNS, None)
    if callable(fqns):
        for pid, name in fqns().items():
            name = strip_wrappers(str(name))
            out[int(pid)] = f"{prefix}.{name}" if prefix else name
    return out


def param_fqns(model: nn.Module) -> tuple[dict[int, str], dict[int, tuple[nn.Module, str]]]:
    """``id(param) -> clean FQN`` for every parameter of the model (first name if shared).

    Sharded modules may answer for their own parameters (e.g. flat shards) through the
    optional ``_shardkit_param_fqns() -> {id(param): fqn}`` protocol method; the second
    map records which sharded module (and its clean prefix) answered for a parameter.
    """
    root = unwrap(model)
    fqns: dict[int, str] = {}
    for raw, param in root.named_parameters(remove_duplicate=False):
        fqns.setdefault(id(param), clean_key(root, raw))
    owners: dict[int, tuple[nn.Module, str]] = {}
    top = root_sharded_module(model)
    sources = [("", top)] if top is not None else list(sharded_modules(root).items())
    for prefix, module in sources:
        for pid, name in _module_param_fqns(module, prefix).items():
            fqns[pid] = name
            owners[pid] = (module, prefix)
    if top is None:
        for module in wrapper_chain(model):
            for pid, name in _module_param_fqns(module, "").items():
                fqns[pid] = name
    return fqns, owners
