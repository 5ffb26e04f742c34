"""Shared machinery for sharding rules: unwrapping, cost-ranked redistribution, wrapping.

A rule runs below autograd (inside ``__torch_dispatch__``), so it works on plain local
tensors: it picks an output placement, moves each input to the placement that output
needs (:func:`local_under`), runs the op on the local shards and wraps the result.
Every choice is pure arithmetic on global shapes and specs, so all ranks agree on it
without talking.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch

from .._placement import Placement
from .._redistribute import redistribute_local
from .._sharded_tensor import ShardedTensor
from ..layout import NormalizedSpec

__all__ = [
    "ShardedTensor",
    "Placement",
    "is_st",
    "first_mesh",
    "local_under",
    "plain_local",
    "wrap",
    "move_cost",
    "partial_cost",
    "spec_axes",
    "disjoint",
    "resolve_inplace",
    "is_partial_leader",
    "norm_dim",
    "Memo",
]


class Memo(dict):
    """Plans keyed by operand layouts (a training step repeats a bounded set of calls),
    emptied when it holds ``limit`` entries so a changing workload cannot grow it."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key, value):
        """Store ``value`` under ``key`` (emptying a full memo first); returns ``value``."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


def is_st(x) -> bool:
    return isinstance(x, ShardedTensor)


def first_mesh(values: Sequence):
    for v in values:
        if is_st(v):
            return v._placement.mesh
    raise AssertionError("a rule ran without a ShardedTensor argument")


def norm_dim(dim: int, ndim: int) -> int:
    """A possibly negative dim as an index in ``0..ndim-1`` (0 for scalars)."""
    if ndim == 0:
        return 0
    return dim + ndim if dim < 0 else dim


def spec_axes(spec: NormalizedSpec) -> set[int]:
    return {a for axes in spec for a in axes}


def disjoint(*groups: Sequence[int]) -> bool:
    """Whether no mesh axis appears in two of ``groups`` (or twice in one)."""
    seen: list[int] = [a for g in groups for a in g]
    return len(seen) == len(set(seen))


def local_under(x, placement: Placement) -> torch.Tensor:
    """``x``'s local tensor under ``placement`` (communicating when it must).

    A plain tensor counts as replicated: it is sliced to this rank's box, no
    communication.
    """
    if is_st(x):
        src = x._placement
        if src == placement:
            return x._local_tensor
        keep = tuple(p for p in src.partial if p in placement.partial)
        if len(keep) != len(src.partial):
            # resolve pending reductions once and remember it: autograd saves this same
            # tensor for backward, which must not pay the all-reduce again
            resolved = Placement(src.mesh, src.spec, keep)
            x._local_tensor = redistribute_local(x._local_tensor, x.shape, src, resolved)
            x._placement = resolved
        return redistribute_local(x._local_tensor, x.shape, x._placement, placement)
    if x.ndim == 0 or all(not axes for axes in placement.spec):
        return x
    return x[placement.box(x.shape).slices()]


def plain_local(x, placement: Placement) -> torch.Tensor:
    """Like :func:`local_under`, for values that may also be Python scalars or None."""
    if isinstance(x, torch.Tensor):
        return local_under(x, placement)
    return x


def wrap(
    local: torch.Tensor,
    placement: Placement,
    shape: Sequence[int],
    strides: Sequence[int] | None = None,
) -> ShardedTensor:
    """``strides``: the global strides to report (a view's, from its input's), else
    derived from the local tensor's layout."""
    return ShardedTensor(local, placement, shape, strides=strides)


def _element_size(x) -> int:
    return x.element_size() if isinstance(x, torch.Tensor) else 4


def partial_cost(placement: Placement, shape: Sequence[int], elsize: int) -> int:
    """Bytes all ranks together receive when ``placement``'s pending sums are resolved.

    Counted like a reduce-scatter, ``(g - 1) / g`` of each rank's shard for a group of
    ``g``: the cheapest way a pending value is resolved (into a sharded layout, as FSDP
    gradients are); an all-reduce moves about twice that. Same unit as :func:`move_cost`.
    """
    if not placement.partial:
        return 0
    mesh = placement.mesh
    group = math.prod(mesh.mesh_shape[a] for a, _ in placement.partial)
    local = placement.box(shape, coord=(0,) * mesh.ndim).numel * elsize
    return (group - 1) * local * mesh.size() // group


def move_cost(x, dst: Placement) -> int:
    """Bytes all ranks together receive to bring ``x`` to ``dst`` (0 for local slicing).

    Pure arithmetic on boxes, so every rank ranks candidate strategies identically.
    """
    if not is_st(x):
        return 0
    return _move_cost(tuple(x.shape), _element_size(x), x._placement, dst)


@lru_cache(maxsize=16384)
def _move_cost(shape: tuple, elsize: int, src: Placement, dst: Placement) -> int:
    cost = 0
    if any(p not in dst.partial for p in src.partial):
        cost += partial_cost(src, shape, elsize)
    if any(p not in src.partial for p in dst.partial):
        # Turning a value into a partial one is free only for the axes rules handle;
        # make such a request look expensive so it is never chosen by accident.
        cost += 10 * math.prod(shape) * elsize + 1
    if src.spec == dst.spec:
        return cost
    mesh = src.mesh
    for rank in range(mesh.size()):
        coord = mesh.coord_of(rank)
        s, d = src.box(shape, coord=coord), dst.box(shape, coord=coord)
        overlap = s.intersect(d)
        have = 0 if overlap is None else overlap.numel
        cost += (d.numel - have) * elsize
    return cost


def resolve_inplace(st: ShardedTensor) -> None:
    """Apply ``st``'s pending reductions to its own local tensor (before mutating it)."""
    if st._placement.partial:
        target = st._placement.without_partial()
        st._local_tensor = local_under(st, target)
        st._placement = target


def is_partial_leader(placement: Placement) -> bool:
    """Whether this rank is coordinate 0 on every partial axis of ``placement``.

    Adding a replicated term to a pending sum is done on the leader only, so that the
    sum stays pending (no communication) and still adds the term once.
    """
    coord = placement.mesh.coord()
    return all(coord[a] == 0 for a, _ in placement.partial)


def with_spec(mesh, spec: NormalizedSpec, partial=()) -> Placement:
    return Placement(mesh, tuple(tuple(a) for a in spec), tuple(partial))
