"""Pure shard arithmetic: partition spec + mesh shape + global shape -> each rank's box.

No ``torch.distributed`` here, so every rule is unit-testable without processes.

A *partition spec* has one entry per tensor dim. An entry is ``None`` (that dim is
replicated), a mesh axis given by name or index, or a tuple of axes (the dim is split
over the product of their sizes, the first axis major). Mesh axes a spec does not name
hold replicas. Uneven dims follow :func:`torch.chunk`: chunks of ``ceil(n / k)``
elements, so the last chunks are smaller or empty.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import product

from ._errors import PartitionSpecError, PartitionSpecTypeError

__all__ = [
    "Box",
    "SpecEntry",
    "PartitionSpec",
    "NormalizedSpec",
    "normalize_spec",
    "spec_to_user",
    "chunk_bounds",
    "shard_index",
    "shard_box",
    "mesh_coords",
    "replica_axes",
]

SpecEntry = None | str | int | tuple[str | int, ...]
PartitionSpec = Sequence[SpecEntry]
#: One tuple of mesh-axis indices per tensor dim; ``()`` means replicated.
NormalizedSpec = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Box:
    """A shard: ``sizes`` elements starting at ``offsets`` in the global index space."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"Box offsets {self.offsets} and sizes {self.sizes} differ in rank")
        if any(s < 0 for s in self.sizes) or any(o < 0 for o in self.offsets):
            raise ValueError(f"Box offsets {self.offsets} / sizes {self.sizes} must be >= 0")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        """The box covering a whole tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        """Number of tensor dims."""
        return len(self.sizes)

    @property
    def numel(self) -> int:
        """Number of elements in the box."""
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        """Exclusive end of the box along each dim (offsets + sizes)."""
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def is_empty(self) -> bool:
        """Whether the box holds no element (a rank past the end of an uneven split)."""
        return self.numel == 0

    def intersect(self, other: Box) -> Box | None:
        """The overlap of two boxes, or ``None`` when they share no element."""
        if self.ndim != other.ndim:
            raise ValueError(f"cannot intersect a {self.ndim}-d box with a {other.ndim}-d box")
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a, b) for a, b in zip(self.ends, other.ends))
        if any(h <= low for low, h in zip(lo, hi)) and self.ndim > 0:
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi)))

    def contains(self, other: Box) -> bool:
        """Whether ``other`` lies entirely inside this box (empty boxes always do)."""
        if other.is_empty():
            return True
        return all(
            so <= oo and oe <= se
            for so, se, oo, oe in zip(self.offsets, self.ends, other.offsets, other.ends)
        )

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """Slices selecting this box inside a tensor that holds ``outer``."""
        return tuple(
            slice(o - oo, o - oo + s) for o, s, oo in zip(self.offsets, self.sizes, outer.offsets)
        )

    def slices(self) -> tuple[slice, ...]:
        """Slices selecting this box inside the global tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


def _axis_index(entry: str | int, axis_names: Sequence[str | int], spec: PartitionSpec) -> int:
    if isinstance(entry, bool) or not isinstance(entry, (str, int)):
        raise PartitionSpecTypeError(
            f"partition spec {tuple(spec)!r}: entry {entry!r} of type {type(entry).__name__} "
            "is not allowed; use a mesh axis name, an axis index, None or a tuple of axes"
        )
    if isinstance(entry, str):
        if entry not in axis_names:
            hint = (
                "the mesh has no axis names: give Mesh(..., axis_names=...) or use axis indices"
                if all(isinstance(n, int) for n in axis_names)
                else f"the mesh axes are {tuple(axis_names)}"
            )
            raise PartitionSpecError(
                f"partition spec {tuple(spec)!r} names unknown mesh axis {entry!r}; {hint}"
            )
        return list(axis_names).index(entry)
    if not 0 <= entry < len(axis_names):
        raise PartitionSpecError(
            f"partition spec {tuple(spec)!r} uses mesh axis index {entry}, but the mesh has "
            f"{len(axis_names)} axes {tuple(axis_names)}; use an index in 0..{len(axis_names) - 1}"
        )
    return entry


def normalize_spec(
    spec: PartitionSpec, axis_names: Sequence[str | int], ndim: int
) -> NormalizedSpec:
    """Validate a user partition spec and turn it into mesh-axis indices per dim.

    ``axis_names`` are the mesh's axis labels (its names, or its axis indices when it
    has none). Mistakes raise :class:`PartitionSpecError` (a ValueError and an
    AssertionError, as torch_xla raises one or the other).
    """
    if isinstance(spec, (str, int)) or spec is None:
        raise PartitionSpecTypeError(
            f"partition spec must be a tuple with one entry per dim, got {spec!r}; "
            f"e.g. ({spec!r}, None) for a 2-d tensor"
        )
    spec = tuple(spec)
    if len(spec) != ndim:
        raise PartitionSpecError(
            f"partition spec {spec!r} has {len(spec)} entries but the tensor has {ndim} dims; "
            "give one entry per dim (None for a replicated dim)"
        )
    out: list[tuple[int, ...]] = []
    seen: dict[int, int] = {}
    for dim, entry in enumerate(spec):
        if entry is None:
            out.append(())
            continue
        entries = entry if isinstance(entry, tuple) else (entry,)
        if isinstance(entry, tuple) and any(isinstance(e, tuple) for e in entry):
            raise PartitionSpecError(
                f"partition spec {spec!r}: entry {entry!r} nests tuples; a dim's entry is one "
                "axis or a flat tuple of axes"
            )
        axes = tuple(_axis_index(e, axis_names, spec) for e in entries)
        for axis in axes:
            if axis in seen:
                raise PartitionSpecError(
                    f"partition spec {spec!r} uses mesh axis {axis_names[axis]!r} twice "
                    f"(dims {seen[axis]} and {dim}); a mesh axis can shard at most one dim"
                )
            seen[axis] = dim
        out.append(axes)
    return tuple(out)


def spec_to_user(spec: NormalizedSpec, axis_names: Sequence[str | int]) -> tuple[SpecEntry, ...]:
    """The readable form of a normalized spec: names, ``None`` and tuples."""
    user: list[SpecEntry] = []
    for axes in spec:
        if not axes:
            user.append(None)
        elif len(axes) == 1:
            user.append(axis_names[axes[0]])
        else:
            user.append(tuple(axis_names[a] for a in axes))
    return tuple(user)


def chunk_bounds(dim_size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Offset and size of chunk ``index`` when ``dim_size`` is split like torch.chunk."""
    if num_chunks <= 0 or not 0 <= index < num_chunks:
        raise ValueError(f"chunk index {index} out of range for {num_chunks} chunks")
    chunk = -(-dim_size // num_chunks) if dim_size else 0
    offset = min(index * chunk, dim_size)
    return offset, max(0, min(chunk, dim_size - offset))


def shard_index(
    axes: Sequence[int], coord: Sequence[int], mesh_shape: Sequence[int]
) -> tuple[int, int]:
    """This coordinate's chunk index and the chunk count for a dim split over ``axes``."""
    index, count = 0, 1
    for axis in axes:
        index = index * mesh_shape[axis] + coord[axis]
        count *= mesh_shape[axis]
    return index, count


def shard_box(
    global_shape: Sequence[int],
    spec: NormalizedSpec,
    mesh_shape: Sequence[int],
    coord: Sequence[int],
) -> Box:
    """The box held by the rank at mesh coordinate ``coord``."""
    offsets, sizes = [], []
    for dim_size, axes in zip(global_shape, spec):
        if axes:
            index, count = shard_index(axes, coord, mesh_shape)
            offset, size = chunk_bounds(int(dim_size), count, index)
        else:
            offset, size = 0, int(dim_size)
        offsets.append(offset)
        sizes.append(size)
    return Box(tuple(offsets), tuple(sizes))


def mesh_coords(mesh_shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every coordinate of a mesh, row-major (the order of ``device_ids``)."""
    return product(*(range(s) for s in mesh_shape))


def replica_axes(spec: NormalizedSpec, num_axes: int) -> tuple[int, ...]:
    """Mesh axes over which the shards are replicated (named by no dim)."""
    used = {a for axes in spec for a in axes}
    return tuple(a for a in range(num_axes) if a not in used)
