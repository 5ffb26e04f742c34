"""Per-parameter dim-0 shard arithmetic and the flat-buffer layout of one FSDP unit.

Pure index math on shapes (plus small tensor copies), no ``torch.distributed``, so it is
unit-tested without processes.

Each parameter of shape ``(d0, *rest)`` is split along dim 0 like :func:`torch.chunk`:
every rank's slot holds ``c = ceil(d0 / world)`` rows (the last ranks fewer real rows,
possibly none); the rest of the slot is padding. A 0-d parameter cannot be split and is
replicated: every rank holds it whole. A unit lays its slots end to end in one per-rank
segment of ``segment_numel`` elements, so one all-gather / reduce-scatter moves the unit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..spmd.layout import chunk_bounds

__all__ = ["SlotLayout", "UnitLayout"]


@dataclass(frozen=True)
class SlotLayout:
    """Where one parameter lives in the unit's per-rank segment."""

    shape: tuple[int, ...]
    world: int
    offset: int  # start of this slot inside a rank's segment

    @property
    def replicated(self) -> bool:
        """0-d parameters cannot be split by rows: every rank holds them whole."""
        return len(self.shape) == 0

    @property
    def inner(self) -> int:
        """Elements per dim-0 row."""
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def rows_per_rank(self) -> int:
        """Padded rows in each rank's slot: ``ceil(d0 / world)``."""
        if self.replicated:
            return 1
        d0 = self.shape[0]
        return -(-d0 // self.world) if d0 else 0

    @property
    def padded_numel(self) -> int:
        """Elements of the slot in every rank's segment (data plus padding)."""
        return self.rows_per_rank * self.inner

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def rows(self, rank: int) -> tuple[int, int]:
        """First global row and number of real rows that ``rank`` holds."""
        if self.replicated:
            return 0, 1
        return chunk_bounds(self.shape[0], self.world, rank)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s shard (``torch.chunk`` semantics, unpadded)."""
        if self.replicated:
            return ()
        return (self.rows(rank)[1], *self.shape[1:])

    def local_numel(self, rank: int) -> int:
        return math.prod(self.local_shape(rank))

    def shard_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s rows of the full tensor (a view)."""
        if self.replicated:
            return full
        start, count = self.rows(rank)
        return full.narrow(0, start, count)

    # -- flat-buffer copies ------------------------------------------------------
    def _full_ranks(self) -> tuple[int, int]:
        """(ranks holding a full ``c``-row chunk, rows held by the next rank)."""
        c = self.rows_per_rank
        if c == 0:
            return 0, 0
        k = self.shape[0] // c
        return k, self.shape[0] - k * c

    def gather_out(self, gathered: torch.Tensor, full: torch.Tensor) -> None:
        """Copy this slot out of an all-gather result ``gathered`` (view ``[world, segment]``)."""
        if self.replicated:
            full.copy_(gathered[0, self.offset].view(()))
            return
        flat = full.view(-1)
        k, rem = self._full_ranks()
        pad = self.padded_numel
        if k:
            flat[: k * pad].view(k, pad).copy_(gathered[:k, self.offset : self.offset + pad])
        if rem:
            n = rem * self.inner
            flat[k * pad :].copy_(gathered[k, self.offset : self.offset + n])

    def scatter_in(self, buffer: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Copy a full gradient into a reduce-scatter input ``buffer`` (view ``[world, segment]``).

        A replicated slot gets the whole gradient in every rank's segment, so the
        reduced result each rank receives is the sum over ranks.
        """
        pad = self.padded_numel
        region = buffer[:, self.offset : self.offset + pad]
        if grad is None:
            region.zero_()
            return
        if self.replicated:
            region.copy_(grad.reshape(1, 1).expand(self.world, 1))
            return
        flat = grad.reshape(-1)
        k, rem = self._full_ranks()
        if k:
            region[:k].copy_(flat[: k * pad].view(k, pad))
        if rem:
            n = rem * self.inner
            region[k, :n].copy_(flat[k * pad :])
            region[k, n:].zero_()
            region[k + 1 :].zero_()
        elif k < self.world:
            region[k:].zero_()


@dataclass(frozen=True)
class UnitLayout:
    """Every slot of a unit, laid end to end in a per-rank segment."""

    slots: tuple[SlotLayout, ...]
    world: int
    segment_numel: int

    @classmethod
    def build(cls, shapes: Sequence[Sequence[int]], world: int) -> UnitLayout:
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        slots, offset = [], 0
        for shape in shapes:
            slot = SlotLayout(tuple(int(s) for s in shape), world, offset)
            slots.append(slot)
            offset += slot.padded_numel
        return cls(tuple(slots), world, offset)

    def pack_shards(self, shards: Sequence[torch.Tensor], out: torch.Tensor, rank: int) -> None:
        """Write this rank's shards into its segment ``out`` (padding left as is)."""
        for slot, shard in zip(self.slots, shards):
            n = slot.local_numel(rank)
            if n:
                out[slot.offset : slot.offset + n].copy_(shard.reshape(-1))

    def unpack_grads(self, segment: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Views of this rank's reduced gradient shards inside its segment."""
        return [
            segment[s.offset : s.offset + s.local_numel(rank)].view(s.local_shape(rank))
            for s in self.slots
        ]
