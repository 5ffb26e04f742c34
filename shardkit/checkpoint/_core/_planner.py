"""Save and load planning: which rank writes which box, which bytes each rank reads.

Plans travel between ranks as JSON (never pickle), so items are plain data.
"""

from __future__ import annotations

import abc
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ...spmd.layout import Box
from ._errors import CheckpointError
from ._flatten import Flat, TensorLeaf
from ._format import ChunkMeta, Metadata, dtype_from_name, dtype_name

__all__ = [
    "WriteItem",
    "ReadItem",
    "SavePlan",
    "LoadPlan",
    "SavePlanner",
    "LoadPlanner",
    "DefaultSavePlanner",
    "DefaultLoadPlanner",
    "SPMDSavePlanner",
    "SPMDLoadPlanner",
]

_MIN_PIECE = 1 << 20


@dataclass(frozen=True)
class WriteItem:
    """A box of one tensor that a rank holds (local plan) or must write (global plan)."""

    key: str
    box: Box
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.dtype.itemsize

    def to_json(self) -> list:
        return [self.key, list(self.box.offsets), list(self.box.sizes), list(self.shape),
                dtype_name(self.dtype, self.key)]  # fmt: skip

    @classmethod
    def from_json(cls, doc: list) -> WriteItem:
        key, offsets, sizes, shape, dtype = doc
        return cls(
            key, Box(tuple(offsets), tuple(sizes)), tuple(shape), dtype_from_name(dtype, key)
        )


@dataclass(frozen=True)
class ReadItem:
    """Read ``box`` (global index space) of ``key`` from one saved chunk."""

    key: str
    box: Box
    chunk: ChunkMeta


@dataclass
class SavePlan:
    """The tensor boxes of one rank; ``extra`` is free JSON for custom planners."""

    items: list[WriteItem] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"items": [i.to_json() for i in self.items], "extra": self.extra}

    @classmethod
    def from_json(cls, doc: dict) -> SavePlan:
        return cls([WriteItem.from_json(i) for i in doc["items"]], doc.get("extra", {}))


@dataclass
class LoadPlan:
    """The reads one rank performs."""

    items: list[ReadItem] = field(default_factory=list)


class SavePlanner(abc.ABC):
    """Decides what each rank writes. Called on every rank in this order:
    ``set_up_planner``, ``create_local_plan``, ``create_global_plan`` (with every rank's
    local plan, in rank order; it must be deterministic, since each rank runs it), then
    ``resolve_data`` for each item assigned to this rank.
    """

    #: Store values that need pickle (apart, loadable only with the same opt-in).
    allow_pickle: bool = False

    @abc.abstractmethod
    def set_up_planner(self, flat: Flat, *, rank: int, world_size: int) -> None:
        """Receive this rank's flattened state."""

    @abc.abstractmethod
    def create_local_plan(self) -> SavePlan:
        """Every box this rank could write."""

    @abc.abstractmethod
    def create_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Assign each distinct box to exactly one rank; returns one plan per rank."""

    @abc.abstractmethod
    def resolve_data(self, item: WriteItem) -> torch.Tensor:
        """The local tensor region holding ``item.box``."""


class LoadPlanner(abc.ABC):
    """Decides what each rank reads: ``set_up_planner``, ``create_local_plan``, then
    ``resolve_tensor`` for each read item."""

    allow_pickle: bool = False

    @abc.abstractmethod
    def set_up_planner(self, flat: Flat, metadata: Metadata, *, strict: bool) -> None:
        """Receive the caller's flattened state and the checkpoint's metadata."""

    @abc.abstractmethod
    def create_local_plan(self) -> LoadPlan:
        """The chunk reads that fill this rank's tensors."""

    @abc.abstractmethod
    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        """The destination region for ``item.box`` (a view of the caller's tensor)."""


def _region(leaf: TensorLeaf, box: Box) -> torch.Tensor:
    return leaf.local[box.relative_to(leaf.box)]


def _split_rows(box: Box, pieces: int) -> list[Box]:
    rows = box.sizes[0]
    step = -(-rows // pieces)
    return [
        Box((box.offsets[0] + r, *box.offsets[1:]), (min(step, rows - r), *box.sizes[1:]))
        for r in range(0, rows, step)
    ]


class DefaultSavePlanner(SavePlanner):
    """Writes each distinct box once and spreads replicated bytes evenly over ranks.

    Boxes held by several ranks (plain tensors, replicated shards) are cut into row
    pieces and each piece goes to the least-loaded holder, so every rank writes about
    the same number of bytes.

    Args:
        allow_pickle: store values that are neither tensors nor JSON with pickle instead
            of refusing them. Loading them needs ``DefaultLoadPlanner(allow_pickle=True)``.
    """

    def __init__(self, *, allow_pickle: bool = False) -> None:
        self.allow_pickle = bool(allow_pickle)
        self.flat: Flat | None = None

    def set_up_planner(self, flat: Flat, *, rank: int, world_size: int) -> None:
        self.flat, self.rank, self.world_size = flat, rank, world_size

    def create_local_plan(self) -> SavePlan:
        assert self.flat is not None
        for leaf in self.flat.tensors.values():
            dtype_name(leaf.dtype, leaf.key)  # refuse unsupported dtypes before any I/O
        return SavePlan(
            [WriteItem(t.key, t.box, t.shape, t.dtype) for t in self.flat.tensors.values()]
        )

    def create_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        holders: dict[tuple[str, Box], list[int]] = {}
        first: dict[str, tuple[int, WriteItem]] = {}
        for rank, plan in enumerate(plans):
            for item in plan.items:
                seen = first.setdefault(item.key, (rank, item))
                if (seen[1].shape, seen[1].dtype) != (item.shape, item.dtype):
                    raise ValueError(
                        f"key {item.key!r} is {seen[1].dtype} {list(seen[1].shape)} on rank "
                        f"{seen[0]} but {item.dtype} {list(item.shape)} on rank {rank}; every "
                        "rank must save the same global tensor under one key"
                    )
                holders.setdefault((item.key, item.box), []).append(rank)
        covered: dict[str, int] = {}
        for key, box in holders:
            covered[key] = covered.get(key, 0) + box.numel
        for key, (_, item) in first.items():
            if covered[key] != math.prod(item.shape):
                raise ValueError(
                    f"key {key!r}: the ranks' shards cover {covered[key]} elements of "
                    f"{math.prod(item.shape)} in shape {list(item.shape)} (gaps or overlaps)"
                )
        total = sum(first[k][1].dtype.itemsize * b.numel for k, b in holders)
        target = max(_MIN_PIECE, total // max(1, 4 * len(plans)))
        load = [0] * len(plans)
        out = [SavePlan() for _ in plans]
        pieces: list[tuple[WriteItem, list[int]]] = []
        for (key, box), ranks in holders.items():
            item = WriteItem(key, box, first[key][1].shape, first[key][1].dtype)
            if len(ranks) == 1:
                out[ranks[0]].items.append(item)
                load[ranks[0]] += item.nbytes
                continue
            n = min(math.ceil(item.nbytes / target), box.sizes[0] if box.sizes else 1)
            for sub in _split_rows(box, n) if n > 1 else [box]:
                pieces.append((WriteItem(key, sub, item.shape, item.dtype), ranks))
        pieces.sort(key=lambda p: -p[0].nbytes)  # stable: ties keep plan order
        for item, ranks in pieces:
            rank = min(ranks, key=lambda r: (load[r], r))
            out[rank].items.append(item)
            load[rank] += item.nbytes
        return out

    def resolve_data(self, item: WriteItem) -> torch.Tensor:
        assert self.flat is not None
        return _region(self.flat.tensors[item.key], item.box)


class DefaultLoadPlanner(LoadPlanner):
    """Reads, for each local tensor, only the saved chunks' overlap with its box.

    Args:
        allow_pickle: load values that were saved with ``allow_pickle=True``. Only opt in
            for checkpoints you trust: unpickling runs code.
    """

    def __init__(self, *, allow_pickle: bool = False) -> None:
        self.allow_pickle = bool(allow_pickle)
        self.flat: Flat | None = None

    def set_up_planner(self, flat: Flat, metadata: Metadata, *, strict: bool) -> None:
        self.flat, self.metadata, self.strict = flat, metadata, strict

    def _check_keys(self) -> None:
        flat, md = self.flat, self.metadata
        wanted = set(flat.tensors) | set(flat.slots) | flat.absent
        missing = sorted(k for k in wanted if k not in md.tensors and k not in md.values
                         and k not in md.objects)  # fmt: skip
        unexpected = sorted(set(md.keys()) - wanted)
        if self.strict and (missing or unexpected):
            raise CheckpointError(
                f"state dict and checkpoint keys differ: missing from the checkpoint {missing}, "
                f"unexpected in the checkpoint {unexpected}; pass strict=False to skip them"
            )
        if missing or unexpected:
            warnings.warn(
                f"load(strict=False) skips keys missing from the checkpoint {missing} and "
                f"unexpected keys {unexpected}",
                stacklevel=4,
            )

    def create_local_plan(self) -> LoadPlan:
        assert self.flat is not None
        self._check_keys()
        plan = LoadPlan()
        for key, leaf in self.flat.tensors.items():
            saved = self.metadata.tensors.get(key)
            if saved is None:
                if key in self.metadata.values or key in self.metadata.objects:
                    raise TypeError(
                        f"key {key!r} is a tensor in the state dict but a non-tensor value "
                        "in the checkpoint"
                    )
                continue
            if saved.dtype != leaf.dtype:
                raise TypeError(
                    f"key {key!r}: dtype mismatch, checkpoint has {saved.dtype} but the state "
                    f"dict has {leaf.dtype}"
                )
            if tuple(saved.shape) != tuple(leaf.shape):
                raise ValueError(
                    f"key {key!r}: shape mismatch, checkpoint has {list(saved.shape)} but the "
                    f"state dict has {list(leaf.shape)}"
                )
            for chunk in saved.chunks:
                overlap = chunk.box.intersect(leaf.box)
                if overlap is not None and not overlap.is_empty():
                    plan.items.append(ReadItem(key, overlap, chunk))
        return plan

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        assert self.flat is not None
        return _region(self.flat.tensors[item.key], item.box)


class SPMDSavePlanner(DefaultSavePlanner):
    """The save planner for SPMD states (ShardedTensor); the default already handles them."""


class SPMDLoadPlanner(DefaultLoadPlanner):
    """The load planner for SPMD states (ShardedTensor); the default already handles them."""
