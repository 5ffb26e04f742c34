"""Sharding rules for the common aten ops; importing this package registers them."""

from __future__ import annotations

import torch

from .._dispatch import _SPECIAL_OPERANDS, UNIFORM_RULES, register_class_rule
from . import _fold, _index, _matmul, _nn, _optim, _pointwise, _reduce, _views  # noqa: F401

_EXTRA_POINTWISE = {"masked_fill_", "masked_fill", "where", "clamp_", "clamp_min_", "clamp_max_"}


def _is_pointwise(func) -> bool:
    return torch.Tag.pointwise in func.tags or func.overloadpacket.__name__ in _EXTRA_POINTWISE


register_class_rule(_is_pointwise, _pointwise.pointwise_rule)
UNIFORM_RULES.add(_pointwise.pointwise_rule)
register_class_rule(_optim.is_foreach, _optim.foreach_rule)
_SPECIAL_OPERANDS.append((_fold.has_folded, _fold.dispatch_folded))

__all__: list[str] = []
