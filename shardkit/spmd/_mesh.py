"""The device mesh: ranks arranged in an n-d grid with named axes."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch.distributed as dist

from .. import runtime
from .layout import mesh_coords

__all__ = ["Mesh"]

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
        device_ids: every rank of the world exactly once, in mesh order.
        mesh_shape: the grid's size along each axis; its product is the world size.
        axis_names: one unique name per axis (default ``"axis0"``, ``"axis1"``, ...).

    Process groups for an axis (or a tuple of axes) are created on first use and
    cached; creation is collective, so every rank must reach it in the same order,
    which SPMD programs do naturally.
    """

    def __init__(
        self,
        device_ids: Sequence[int] | np.ndarray,
        mesh_shape: Sequence[int],
        axis_names: Sequence[str] | None = None,
    ) -> None:
        ids = np.asarray(device_ids).reshape(-1)
        mesh_shape = tuple(int(s) for s in mesh_shape)
        if any(s <= 0 for s in mesh_shape):
            raise ValueError(f"mesh_shape {mesh_shape} must have only positive sizes")
        if int(np.prod(mesh_shape)) != ids.size:
            raise ValueError(
                f"mesh_shape {mesh_shape} holds {int(np.prod(mesh_shape))} devices but "
                f"{ids.size} device_ids were given"
            )
        runtime.init()  # join the world the environment describes (torchrun, SLURM)
        world = runtime.world_size()
        if ids.size != world:
            raise ValueError(
                f"the mesh has {ids.size} devices but the world has {world} ranks; "
                f"use a mesh_shape whose product is {world}"
            )
        if sorted(ids.tolist()) != list(range(world)):
            raise ValueError(
                f"device_ids {ids.tolist()} must be a permutation of the ranks 0..{world - 1}"
            )
        if axis_names is None:
            axis_names = tuple(f"axis{i}" for i in range(len(mesh_shape)))
        axis_names = tuple(axis_names)
        if len(axis_names) != len(mesh_shape):
            raise ValueError(
                f"axis_names {axis_names} must name each of the {len(mesh_shape)} mesh axes"
            )
        if len(set(axis_names)) != len(axis_names) or not all(
            isinstance(n, str) for n in axis_names
        ):
            raise ValueError(f"axis_names {axis_names} must be unique strings")
        self.device_ids = ids.reshape(mesh_shape)
        self.mesh_shape = mesh_shape
        self.axis_names = axis_names
        self._groups: dict[tuple[int, ...], object] = {}
        # rank -> coordinate and the hash are asked for on every op: compute them once
        self._coords = {
            int(r): tuple(int(c) for c in idx) for idx, r in np.ndenumerate(self.device_ids)
        }
        self._hash = hash((self.axis_names, self.mesh_shape, self.device_ids.tobytes()))
        _meshes[id(self)] = self

    # -- geometry --------------------------------------------------------
    def shape(self) -> OrderedDict[str, int]:
        """Axis name -> size, in axis order."""
        return OrderedDict(zip(self.axis_names, self.mesh_shape))

    @property
    def ndim(self) -> int:
        return len(self.mesh_shape)

    @property
    def size(self) -> int:
        return int(self.device_ids.size)

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
        return int(self.device_ids[tuple(coord)])

    def axis_index(self, axis: str | int) -> int:
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise ValueError(f"unknown mesh axis {axis!r}; the axes are {self.axis_names}")
            return self.axis_names.index(axis)
        if not 0 <= axis < self.ndim:
            raise ValueError(f"mesh axis index {axis} out of range for {self.ndim} axes")
        return axis

    def group_ranks(self, axes: Sequence[int], coord: Sequence[int] | None = None) -> list[int]:
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
                    ranks = sorted(self.group_ranks(key, coord))
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
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.mesh_shape))
        return f"Mesh({axes}, device_ids={self.device_ids.reshape(-1).tolist()})"

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        return (
            isinstance(other, Mesh)
            and self.axis_names == other.axis_names
            and self.mesh_shape == other.mesh_shape
            and np.array_equal(self.device_ids, other.device_ids)
        )

    def __hash__(self) -> int:
        return self._hash
