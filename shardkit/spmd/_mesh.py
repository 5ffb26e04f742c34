"""The device mesh: ranks arranged in an n-d grid with named axes."""

from __future__ import annotations

import ast
import numbers
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch.distributed as dist

from .. import runtime
from ..runtime._collective import collective_device, ranks_differ
from ..runtime._json_gather import all_gather_json
from ..runtime._runtime import _env_int
from ._errors import MeshError
from .layout import mesh_coords

__all__ = ["Mesh", "HybridMesh", "get_1d_mesh", "get_global_mesh", "set_global_mesh"]

_meshes: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> Mesh


@runtime.at_teardown
def _drop_groups() -> None:
    """At exit, forget every mesh's axis groups: a group Python still references keeps its
    gloo threads running into interpreter finalization, where they abort the process."""
    for mesh in list(_meshes.values()):
        mesh._groups.clear()


class Mesh:
    """Ranks arranged as ``np.array(device_ids).reshape(mesh_shape)`` with named axes.

    Args:
        device_ids: every rank of the world exactly once, in mesh order (kept as given).
        mesh_shape: the grid's size along each axis; its product is the world size.
        axis_names: one unique name per axis, or None: then ``axis_names`` stays None,
            axes are referred to by index and :meth:`shape` is keyed by axis index,
            as in torch_xla.

    Every rank must build the same mesh: in a world of more than one rank the
    constructor compares a checksum of (device ids, mesh shape, axis names) across the
    ranks (one 16-byte all-reduce) and raises :class:`MeshError` on every rank, naming
    what differs, when they disagree. Construction is therefore collective.

    Mistakes raise :class:`MeshError` (a ValueError and an AssertionError, as torch_xla
    asserts). Process groups for an axis (or a tuple of axes) are created on first use
    and cached; creation is collective, so every rank must reach it in the same order,
    which SPMD programs do naturally.
    """

    device_ids: np.ndarray
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...] | None

    def __init__(
        self,
        device_ids: Sequence[int] | np.ndarray,
        mesh_shape: Sequence[int],
        axis_names: Sequence[str] | None = None,
        *,
        _check_ranks: bool = True,
    ) -> None:
        try:
            given, ids, mesh_shape, axis_names, world = _validated(
                device_ids, mesh_shape, axis_names
            )
        except (MeshError, TypeError) as exc:
            if _check_ranks:  # the others may be valid, and wait in the check for this rank
                _tell_other_ranks(exc)
            raise
        if _check_ranks and world > 1:
            _check_same_on_every_rank(
                {
                    "device_ids": ids.tolist(),
                    "mesh_shape": list(mesh_shape),
                    "axis_names": axis_names,
                }
            )
        self.device_ids = given
        self.mesh_shape = mesh_shape
        self.axis_names = axis_names
        self._grid = ids.reshape(mesh_shape)
        self._groups: dict[tuple[int, ...], object] = {}
        # rank -> coordinate and the hash are asked for on every op: compute them once
        self._coords = {int(r): tuple(int(c) for c in idx) for idx, r in np.ndenumerate(self._grid)}
        self._hash = hash((self.axis_names, self.mesh_shape, self._grid.tobytes()))
        _meshes[id(self)] = self

    # -- geometry --------------------------------------------------------
    def shape(self) -> OrderedDict[str | int, int]:
        """Axis name -> size in axis order (axis index -> size when the axes have no names)."""
        return OrderedDict(zip(self.axis_labels, self.mesh_shape))

    @property
    def axis_labels(self) -> tuple[str, ...] | tuple[int, ...]:
        """The keys of :meth:`shape`: the axis names, or the axis indices without names."""
        if self.axis_names is None:
            return tuple(range(len(self.mesh_shape)))
        return self.axis_names

    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return len(self.mesh_shape)

    def size(self) -> int:
        """Number of devices (ranks) in the mesh: the product of ``mesh_shape``."""
        return int(self._grid.size)

    def get_logical_mesh(self) -> np.ndarray:
        """The device ids laid out in the mesh's shape."""
        return self.device_ids.reshape(self.mesh_shape)

    def get_axis_name_idx(self, name: str) -> int | None:
        """Index of the axis called ``name``, or None when no axis has that name."""
        if self.axis_names is None or name not in self.axis_names:
            return None
        return self.axis_names.index(name)

    def __str__(self) -> str:
        return (
            f"{{'device_ids': {self.device_ids.tolist()}, "
            f"'mesh_shape': {self.mesh_shape}, 'axis_names': {self.axis_names}}}"
        )

    @classmethod
    def from_str(cls, mesh_str: str) -> Mesh | None:
        """The mesh ``str(mesh)`` describes; None when the text cannot be parsed.

        A parsed mesh that does not fit this world still raises :class:`MeshError`.
        """
        try:
            fields = ast.literal_eval(mesh_str.replace("Mesh", "", 1))
            ids, shape, names = fields["device_ids"], fields["mesh_shape"], fields["axis_names"]
        except (ValueError, SyntaxError, KeyError, TypeError, AttributeError):
            return None
        return cls(np.array(ids), shape, names)

    def coord_of(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinate of ``rank``."""
        found = self._coords.get(int(rank))
        if found is None:
            raise ValueError(f"rank {rank} is not in this mesh")
        return found

    def coord(self) -> tuple[int, ...]:
        """This process's mesh coordinate."""
        return self.coord_of(runtime.global_ordinal())

    def rank_at(self, coord: Sequence[int]) -> int:
        """The rank at mesh coordinate ``coord``."""
        return int(self._grid[tuple(coord)])

    def axis_index(self, axis: str | int) -> int:
        """Index of a mesh axis given by name or index."""
        if isinstance(axis, str):
            index = self.get_axis_name_idx(axis)
            if index is None:
                raise MeshError(f"unknown mesh axis {axis!r}; the axes are {self.axis_labels}")
            return index
        if not 0 <= axis < self.ndim:
            raise MeshError(f"mesh axis index {axis} out of range for {self.ndim} axes")
        return axis

    def group_ranks(self, axes: Sequence[int], *, coord: Sequence[int] | None = None) -> list[int]:
        """Ranks that differ from ``coord`` only along ``axes``, in chunk order (first axis major)."""
        coord = list(self.coord() if coord is None else coord)
        ranks = []
        for sub in mesh_coords([self.mesh_shape[a] for a in axes]):
            for axis, value in zip(axes, sub):
                coord[axis] = value
            ranks.append(self.rank_at(coord))
        return ranks

    # -- process groups --------------------------------------------------
    def group(self, axes: Sequence[int | str] | int | str) -> object | None:
        """The process group spanning ``axes`` that contains this rank (None in a world of one)."""
        if isinstance(axes, (int, str)):
            axes = (axes,)
        key = tuple(sorted(self.axis_index(a) for a in axes))
        if not runtime.is_initialized():
            return None
        if key not in self._groups:
            if len(key) == self.ndim:
                self._groups[key] = dist.group.WORLD
            else:
                mine = None
                others = [a for a in range(self.ndim) if a not in key]
                for fixed in mesh_coords([self.mesh_shape[a] for a in others]):
                    coord = [0] * self.ndim
                    for axis, value in zip(others, fixed):
                        coord[axis] = value
                    ranks = sorted(self.group_ranks(key, coord=coord))
                    group = dist.new_group(ranks)
                    if runtime.global_ordinal() in ranks:
                        mine = group
                # gloo sets up a new group's connections through the world's store; wait
                # until every group is up, so no rank can finish (and take the store down)
                # while another is still connecting
                dist.barrier()
                self._groups[key] = mine
        return self._groups[key]

    def __getstate__(self) -> dict:
        # process groups belong to this process; a copy re-creates its own on first use
        state = dict(self.__dict__)
        state["_groups"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _meshes[id(self)] = self

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_labels, self.mesh_shape))
        return f"Mesh({axes}, device_ids={self.device_ids.reshape(-1).tolist()})"

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        return (
            isinstance(other, Mesh)
            and self.axis_names == other.axis_names
            and self.mesh_shape == other.mesh_shape
            and np.array_equal(self._grid, other._grid)
        )

    def __hash__(self) -> int:
        return self._hash


def _check_same_on_every_rank(mine: dict | None, error: str | None = None) -> None:
    """Raise :class:`MeshError` on every rank unless all ranks built this very mesh.

    A mesh that differs per rank gives wrong results silently (permuted device ids: two
    ranks own the same box) or hangs in the first collective (a different shape or axis
    names). One all-reduce of ``[c, -c]`` with MAX, ``c`` a crc32 of the mesh's canonical
    repr (not ``hash()``, which differs per process; -1 where the mesh was invalid,
    ``error``), tells every rank whether all agree; only on a mismatch does one more
    exchange fetch each rank's mesh to name the difference. A mesh spans the whole
    world, so this runs on the world group.
    """
    crc = -1 if error is not None else zlib.crc32(repr(sorted(mine.items())).encode())
    device = collective_device()
    if not ranks_differ([crc], device=device)[0]:
        return  # all agree (or all failed: each raises its own error)
    every = all_gather_json({"error": error} if error is not None else mine, None, device=device)
    if error is not None:
        return  # the caller raises its own error
    failed = {r: v["error"] for r, v in enumerate(every) if "error" in v}
    if failed:
        rank, why = next(iter(failed.items()))
        raise MeshError(
            f"rank(s) {sorted(failed)} could not build the mesh (rank {rank}: {why}); every "
            "rank must construct the same Mesh(device_ids, mesh_shape, axis_names)"
        )
    other = next(r for r, v in enumerate(every) if v != every[0])
    what = "; ".join(
        f"{k}: rank 0 has {every[0][k]}, rank {other} has {every[other][k]}"
        for k in mine
        if every[0][k] != every[other][k]
    )
    raise MeshError(
        f"the ranks built different meshes ({what}); every rank must construct the same "
        "Mesh(device_ids, mesh_shape, axis_names), in the same order"
    )


def _tell_other_ranks(exc: BaseException) -> None:
    """This rank's mesh is invalid: take part in the check, so that ranks whose mesh is
    valid raise too instead of waiting in it (only in a world already joined)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        _check_same_on_every_rank(None, f"{type(exc).__name__}: {exc}")


def _validated(device_ids, mesh_shape, axis_names) -> tuple:
    """``(given, ids, mesh_shape, axis_names, world)`` of a valid mesh on this rank, after
    joining the world; MeshError or TypeError naming the mistake otherwise."""
    given = device_ids if isinstance(device_ids, np.ndarray) else np.array(device_ids)
    ids = given.reshape(-1)
    if isinstance(mesh_shape, int):
        raise MeshError(
            f"mesh_shape must be a tuple of sizes, got {mesh_shape!r}; write ({mesh_shape},)"
        )
    bad = [s for s in mesh_shape if isinstance(s, bool) or not isinstance(s, numbers.Integral)]
    if bad:  # int(2.5) would quietly make it 2
        raise TypeError(f"mesh_shape {tuple(mesh_shape)!r} must hold ints, got {bad[0]!r}")
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if any(s <= 0 for s in mesh_shape):
        raise MeshError(f"mesh_shape {mesh_shape} must have only positive sizes")
    if int(np.prod(mesh_shape)) != ids.size:
        raise MeshError(
            f"mesh_shape {mesh_shape} holds {int(np.prod(mesh_shape))} devices but "
            f"{ids.size} device_ids were given"
        )
    runtime.init()  # join the world the environment describes (torchrun, SLURM)
    world = runtime.world_size()
    if ids.size != world:
        raise MeshError(
            f"the mesh has {ids.size} devices but the world has {world} ranks; "
            f"use a mesh_shape whose product is {world}"
        )
    if sorted(ids.tolist()) != list(range(world)):
        raise MeshError(
            f"device_ids {ids.tolist()} must be a permutation of the ranks 0..{world - 1}"
        )
    if axis_names is not None:
        if isinstance(axis_names, str):
            raise MeshError(
                f"axis_names must be a tuple of names, got the string {axis_names!r}; "
                f"write ({axis_names!r},)"
            )
        axis_names = tuple(axis_names)
        if len(axis_names) != len(mesh_shape):
            raise MeshError(
                f"axis_names {axis_names} must name each of the {len(mesh_shape)} mesh axes"
            )
        if len(set(axis_names)) != len(axis_names) or not all(
            isinstance(n, str) for n in axis_names
        ):
            raise MeshError(f"axis_names {axis_names} must be unique strings")
    return given, ids, mesh_shape, axis_names, world


_GLOBAL_MESH: Mesh | None = None


def set_global_mesh(mesh: Mesh | None) -> None:
    """Remember ``mesh`` as this process's global mesh (None forgets it)."""
    global _GLOBAL_MESH
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"set_global_mesh expects a Mesh, got {type(mesh).__name__}")
    _GLOBAL_MESH = mesh


def get_global_mesh() -> Mesh | None:
    """The mesh given to :func:`set_global_mesh`, or None."""
    return _GLOBAL_MESH


def get_1d_mesh(axis_name: str | None = None) -> Mesh:
    """A mesh of every rank along one axis (named ``axis_name``, or unnamed)."""
    runtime.init()  # the world's size is the mesh's: join it first
    num_devices = runtime.global_runtime_device_count()
    names = None if axis_name is None else (axis_name,)
    return Mesh(np.arange(num_devices), (num_devices,), names)


class HybridMesh(Mesh):
    """A mesh whose axes each span machines (DCN) and ranks within a machine (ICI).

    Axis ``i`` has ``ici_mesh_shape[i] * dcn_mesh_shape[i]`` ranks. The world is cut
    into ``prod(dcn_mesh_shape)`` consecutive blocks of ``prod(ici_mesh_shape)`` ranks,
    which under torchrun are the machines when ``prod(ici_mesh_shape)`` is the number of
    ranks per machine (LOCAL_WORLD_SIZE). The blocks sit on a grid of shape
    ``dcn_mesh_shape`` and each block is laid out row-major in ``ici_mesh_shape``, so a
    collective over an axis with ``dcn_mesh_shape[i] == 1`` stays within a machine.
    """

    ici_mesh_shape: tuple[int, ...]
    dcn_mesh_shape: tuple[int, ...]

    def __init__(
        self,
        *,
        ici_mesh_shape: Sequence[int],
        dcn_mesh_shape: Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
    ) -> None:
        ici = tuple(int(s) for s in ici_mesh_shape)
        dcn = (1,) * len(ici) if dcn_mesh_shape is None else tuple(int(s) for s in dcn_mesh_shape)
        if len(ici) != len(dcn):
            raise MeshError(
                f"ici_mesh_shape {ici} and dcn_mesh_shape {dcn} must have one size per axis"
            )
        if any(s <= 0 for s in ici + dcn):
            raise MeshError(f"ici_mesh_shape {ici} / dcn_mesh_shape {dcn} must be positive")
        num_blocks, block = int(np.prod(dcn)), int(np.prod(ici))
        local = _env_int("LOCAL_WORLD_SIZE")  # a bad value: ValueError naming it
        if num_blocks > 1 and local is not None and local != block:
            raise MeshError(
                f"dcn_mesh_shape {dcn} asks for {num_blocks} machines of "
                f"prod(ici_mesh_shape) = {block} ranks, but each machine runs "
                f"LOCAL_WORLD_SIZE={local} ranks; make prod(ici_mesh_shape) {local}"
            )
        self.ici_mesh_shape = ici
        self.dcn_mesh_shape = dcn
        grid = _hybrid_grid(ici, dcn)
        super().__init__(grid.reshape(-1), grid.shape, axis_names)


def _hybrid_grid(ici: tuple[int, ...], dcn: tuple[int, ...]) -> np.ndarray:
    """Ranks on the hybrid mesh: block ``b`` (row-major in ``dcn``) holds ranks
    ``b * prod(ici) ...``, laid out row-major in ``ici`` inside its tile of the grid."""
    block = int(np.prod(ici))
    grid = np.empty(tuple(i * d for i, d in zip(ici, dcn)), dtype=np.int64)
    for coord in np.ndindex(*grid.shape):
        outer = tuple(c // i for c, i in zip(coord, ici))
        inner = tuple(c % i for c, i in zip(coord, ici))
        grid[coord] = int(np.ravel_multi_index(outer, dcn)) * block + int(
            np.ravel_multi_index(inner, ici)
        )
    return grid
