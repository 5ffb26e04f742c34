"""Internal placement state of a ShardedTensor: which dims are split over which axes,
and which axes hold a pending (partial) reduction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._mesh import Mesh
from .layout import Box, NormalizedSpec, PartitionSpec, normalize_spec, shard_box, spec_to_user

__all__ = ["Placement"]

_REDUCE_OPS = ("sum", "max", "min")


@dataclass(frozen=True)
class Placement:
    """How a global tensor is laid out over a mesh.

    ``spec`` holds, per tensor dim, the mesh axes it is split over (first major).
    ``partial`` holds ``(axis, op)`` pairs: along that axis every rank holds an addend
    (or a candidate for max/min) and the true value is the reduction over the axis.
    """

    mesh: Mesh
    spec: NormalizedSpec
    partial: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        for axis, op in self.partial:
            assert op in _REDUCE_OPS, op
            assert all(axis not in axes for axes in self.spec), (axis, self.spec)
        # asked on every dispatched op (the replicated fast path): compute it once; not a
        # field, so equality and hashing ignore it
        object.__setattr__(
            self, "_replicated", not self.partial and all(not axes for axes in self.spec)
        )

    @classmethod
    def from_user(cls, mesh: Mesh, spec: PartitionSpec, ndim: int) -> Placement:
        """The placement of a user partition spec (axis names, ``None``, tuples) on ``mesh``."""
        if not isinstance(mesh, Mesh):  # a name or a torch DeviceMesh: an AttributeError
            raise TypeError(
                f"mesh must be a shardkit.spmd.Mesh, got {type(mesh).__name__} {mesh!r:.80}; "
                "build one with xs.Mesh(device_ids, mesh_shape, axis_names)"
            )
        return cls(mesh, normalize_spec(spec, mesh.axis_labels, ndim))

    @classmethod
    def replicated(cls, mesh: Mesh, ndim: int) -> Placement:
        """Every dim whole on every rank of ``mesh``."""
        return cls(mesh, ((),) * ndim)

    @property
    def user_spec(self) -> tuple:
        """The spec in user form: axis names (or indices), ``None`` and tuples."""
        return spec_to_user(self.spec, self.mesh.axis_labels)

    def is_replicated(self) -> bool:
        """Whether every rank holds the whole tensor (no dim sharded, nothing pending)."""
        return self._replicated

    def without_partial(self) -> Placement:
        """The same layout with no pending sum over any mesh axis."""
        return Placement(self.mesh, self.spec)

    def with_spec(self, spec: NormalizedSpec) -> Placement:
        """The same mesh and pending sums, laid out by the normalized ``spec``."""
        return Placement(self.mesh, spec, self.partial)

    def box(self, global_shape: Sequence[int], *, coord: Sequence[int] | None = None) -> Box:
        """The box of the rank at ``coord`` (default: this rank)."""
        coord = self.mesh.coord() if coord is None else coord
        return shard_box(global_shape, self.spec, self.mesh.mesh_shape, coord)

    def box_of_rank(self, global_shape: Sequence[int], rank: int) -> Box:
        """The box global rank ``rank`` holds of a tensor of ``global_shape``."""
        return self.box(global_shape, coord=self.mesh.coord_of(rank))
