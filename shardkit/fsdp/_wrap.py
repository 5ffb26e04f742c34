"""Auto-wrap policies and the recursive wrapping pass."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

__all__ = [
    "always_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "lambda_auto_wrap_policy",
    "auto_wrap",
]

#: Containers are never worth a unit of their own: they have no forward of note.
_EXCLUDED = (nn.ModuleList, nn.ModuleDict)
#: Modules whose children are never units of their own (their forward reads the
#: children's parameters directly).
_LEAVES = (nn.MultiheadAttention,)


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every submodule (as torch's and torch_xla's ``always_wrap_policy``; any
    arguments, positional or by name)."""
    return True


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: Iterable[type] | None = None,
    exclude_wrap_modules: Iterable[type] | None = None,
) -> bool:
    """Wrap a submodule once it holds at least ``min_num_params`` not-yet-wrapped parameters.

    Use with ``functools.partial(size_based_auto_wrap_policy, min_num_params=...)``. As
    torch's: only modules that large are descended into; ``force_leaf_modules`` (default
    ``MultiheadAttention``) never are; ``exclude_wrap_modules`` (default ``ModuleList`` /
    ``ModuleDict``) are never units themselves.
    """
    if isinstance(min_num_params, bool) or not isinstance(min_num_params, (int, float)):
        raise TypeError(
            f"size_based_auto_wrap_policy: min_num_params must be a number of parameters, "
            f"got {type(min_num_params).__name__} {min_num_params!r}: "
            "partial(size_based_auto_wrap_policy, min_num_params=1_000_000)"
        )
    large = nonwrapped_numel >= min_num_params
    if recurse:
        leaves = size_based_auto_wrap_policy.FORCE_LEAF_MODULES
        leaves = tuple(force_leaf_modules if force_leaf_modules is not None else leaves)
        return large and not isinstance(module, leaves)
    excluded = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES
    excluded = tuple(exclude_wrap_modules if exclude_wrap_modules is not None else excluded)
    return large and not isinstance(module, excluded)


# The defaults, as torch_xla keeps them on the function ("easy to be imported"); changing
# these sets changes every later call that does not pass its own.
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = set(_EXCLUDED)  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = set(_LEAVES)  # type: ignore[attr-defined]


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: Iterable[type],
) -> bool:
    """Wrap every instance of the given layer classes (e.g. a transformer block).

    Use with ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``.
    """
    if isinstance(transformer_layer_cls, type) or not isinstance(transformer_layer_cls, Iterable):
        raise TypeError(
            "transformer_auto_wrap_policy: transformer_layer_cls must be a set of module "
            f"classes, got {transformer_layer_cls!r}: "
            "partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})"
        )
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable
) -> bool:
    """Wrap every submodule for which ``lambda_fn(module)`` is true."""
    if recurse:
        return True
    return bool(lambda_fn(module))


def _param_counts(module: nn.Module) -> Counter:
    """How many (module, attribute) slots refer to each parameter, by id."""
    counts: Counter = Counter()
    for mod in module.modules(remove_duplicate=False):
        for p in mod._parameters.values():
            if p is not None and not getattr(p, "_shardkit_fsdp_shard", False):
                counts[id(p)] += 1
    return counts


def _numel(module: nn.Module, wrapper_cls: type) -> int:
    seen, total = set(), 0
    for mod in module.modules():
        if isinstance(mod, wrapper_cls):
            continue
        for p in mod._parameters.values():
            if p is not None and id(p) not in seen and not getattr(p, "_shardkit_fsdp_shard", 0):
                seen.add(id(p))
                total += p.numel()
    return total


def _has_forward(module: nn.Module) -> bool:
    """Containers with no forward (ModuleList, ModuleDict) cannot be units: none runs."""
    return type(module).forward is not nn.Module.forward


def auto_wrap(
    root: nn.Module,
    policy: Callable,
    wrapper: Callable,
    kwargs: dict[str, Any],
    wrapper_cls: type,
) -> None:
    """Replace, bottom-up, each child of ``root`` the policy selects by ``wrapper(child, **kwargs)``.

    A submodule whose parameters are also used outside it (tied weights) is left to its
    parent's unit, so a tied parameter is always sharded once.
    """
    total = _param_counts(root)

    def self_contained(module: nn.Module) -> bool:
        inner = _param_counts(module)
        return all(total[pid] == n for pid, n in inner.items())

    def visit(module: nn.Module, is_root: bool) -> tuple[nn.Module, int]:
        if isinstance(module, wrapper_cls):
            return module, 0
        numel = _numel(module, wrapper_cls)
        if not policy(module, True, numel):
            return module, 0
        wrapped = 0
        for name, child in list(module.named_children()):
            new_child, n = visit(child, False)
            if new_child is not child:
                setattr(module, name, new_child)
            wrapped += n
        remainder = numel - wrapped
        if (
            not is_root
            and _has_forward(module)
            and policy(module, False, remainder)
            and self_contained(module)
        ):
            return wrapper(module, **kwargs), numel
        return module, wrapped

    visit(root, True)
