"""One FSDP unit's parameters: shards, gathered full tensors, gradient reduction.

The optimizer sees ``ManagedParam.shard`` (a plain ``nn.Parameter`` holding this rank's
rows). For compute, the unit gathers every shard into one persistent full tensor per
parameter; freeing resizes that tensor's storage to zero and re-gathering resizes it
back, so tensors autograd saved during forward see the re-gathered values in backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ._comm import all_gather_flat, all_reduce_flat, reduce_scatter_flat
from ._errors import FSDPUsageError
from ._layout import SlotLayout, UnitLayout

__all__ = ["ManagedParam", "UnitState", "GatherStats", "GATHER_STATS"]


@dataclass
class ManagedParam:
    """A unique parameter of a unit and every (module, attribute) that refers to it."""

    shard: nn.Parameter
    owners: list[tuple[nn.Module, str]]
    fqns: list[str]  # relative to the unit's wrapped module
    layout: SlotLayout
    full: torch.Tensor | None = None


@dataclass
class GatherStats:
    """How many units hold gathered (or in-flight) parameters; for tests and benchmarks."""

    current: set = field(default_factory=set)
    peak: int = 0
    peak_non_root: int = 0
    non_root: set = field(default_factory=set)
    gathers: int = 0  # all-gathers issued
    prefetched: int = 0  # of which were issued ahead of need and waited for later

    def reset(self) -> None:
        self.peak = len(self.current)
        self.peak_non_root = len(self.non_root)
        self.gathers = self.prefetched = 0

    def add(self, unit: UnitState) -> None:
        self.current.add(id(unit))
        if not unit.is_root:
            self.non_root.add(id(unit))
        self.peak = max(self.peak, len(self.current))
        self.peak_non_root = max(self.peak_non_root, len(self.non_root))

    def discard(self, unit: UnitState) -> None:
        self.current.discard(id(unit))
        self.non_root.discard(id(unit))


GATHER_STATS = GatherStats()


class _PendingReduce:
    """An in-flight gradient reduce-scatter; ``finish`` accumulates into ``.grad``."""

    def __init__(self, unit, works, segment, replicated, post_div: float, source) -> None:
        self.unit, self.works, self.post_div = unit, works, post_div
        self.segment, self.replicated = segment, replicated
        self._source = source  # the input must outlive the collective

    def finish(self) -> None:
        for work in self.works:
            work.wait()
        unit = self.unit
        pairs = []
        if unit.sharded_trainable:
            if self.post_div != 1.0:
                self.segment.div_(self.post_div)
            pairs += zip(
                unit.sharded_trainable, unit.grad_layout.unpack_grads(self.segment, unit.rank)
            )
        if unit.replicated_trainable:
            if self.post_div != 1.0:
                self.replicated.div_(self.post_div)
            pairs += zip(unit.replicated_trainable, self.replicated.unbind())
        for param, view in pairs:
            shard = param.shard
            if shard.grad is None:
                shard.grad = view.to(shard.dtype, copy=True)
            else:
                shard.grad.add_(view.to(shard.dtype))


class UnitState:
    """Gather / free / reduce for the parameters of one unit."""

    def __init__(
        self,
        params: Sequence[ManagedParam],
        *,
        group,
        rank: int,
        world: int,
        compute_dtype: torch.dtype | None,
        fp32_reduce_scatter: bool,
    ) -> None:
        self.params = list(params)
        self.group, self.rank, self.world = group, rank, world
        self.layout = UnitLayout(
            tuple(p.layout for p in self.params),
            world,
            sum(p.layout.padded_numel for p in self.params),
        )
        self.accumulated: list[torch.Tensor | None] | None = None  # no_sync gradients
        self._shown: list[tuple | None] = []  # (.grad, its version) each sum was shown as
        self._trainable_flags: tuple[bool, ...] | None = None
        self.refresh_trainable()
        dtypes = {p.shard.dtype for p in self.params}
        if compute_dtype is None and len(dtypes) > 1:
            raise ValueError(
                f"an FSDP unit holds parameters of several dtypes {sorted(map(str, dtypes))}; "
                "cast the module to one dtype, or set compute_dtype"
            )
        base = next(iter(dtypes)) if dtypes else torch.float32
        self.compute_dtype = compute_dtype or base
        self.reduce_dtype = torch.float32 if fp32_reduce_scatter else self.compute_dtype
        self.device = self.params[0].shard.device if self.params else torch.device("cpu")
        self.is_root = False
        self.gathered = False
        self._pending_gather = None  # (work, out buffer)

    def refresh_trainable(self) -> None:
        """Follow ``requires_grad`` as it is now: a parameter frozen or unfrozen after
        wrapping gets no gradient, or a gradient, from the next forward on (as torch)."""
        flags = tuple(p.shard.requires_grad for p in self.params)
        if flags == self._trainable_flags:
            return
        if self.accumulated is not None:
            raise FSDPUsageError(
                "requires_grad of an FSDP parameter changed while no_sync() gradients were "
                "accumulating; change it before no_sync() or after the synced backward"
            )
        self._trainable_flags = flags
        self.trainable = [p for p in self.params if p.shard.requires_grad]
        # 0-d parameters are replicated: an all-reduce keeps them bitwise equal on every
        # rank (a reduce-scatter sums each rank's copy in a different order)
        self.sharded_trainable = [p for p in self.trainable if not p.layout.replicated]
        self.replicated_trainable = [p for p in self.trainable if p.layout.replicated]
        shapes = [p.layout.shape for p in self.sharded_trainable]
        self.grad_layout = UnitLayout.build(shapes, self.world)

    # -- gathering -------------------------------------------------------------
    @property
    def materialized(self) -> bool:
        """Whether full parameters are held or on their way."""
        return self.gathered or self._pending_gather is not None

    def issue_gather(self) -> None:
        """Start the all-gather of this unit (asynchronously) unless done or in flight."""
        if self.materialized or not self.params:
            return
        seg = self.layout.segment_numel
        send = torch.empty(seg, dtype=self.compute_dtype, device=self.device)
        with torch.no_grad():
            self.layout.pack_shards([p.shard for p in self.params], send, self.rank)
        out = torch.empty(self.world * seg, dtype=self.compute_dtype, device=self.device)
        work = all_gather_flat(out, send, self.group, self.world)
        self._pending_gather = (work, out, send)
        GATHER_STATS.add(self)
        GATHER_STATS.gathers += 1

    def ensure_gathered(self) -> None:
        """Make the full parameters available, waiting for a prefetch if one is in flight."""
        if self.gathered or not self.params:
            return
        if self._pending_gather is not None:
            GATHER_STATS.prefetched += 1
        self.issue_gather()
        work, out, _send = self._pending_gather
        work.wait()
        gathered = out.view(self.world, self.layout.segment_numel)
        with torch.no_grad():
            for p in self.params:
                if p.full is None:
                    p.full = torch.empty(
                        p.layout.shape, dtype=self.compute_dtype, device=self.device
                    )
                else:
                    storage = p.full.untyped_storage()
                    nbytes = p.full.numel() * p.full.element_size()
                    if storage.nbytes() != nbytes:
                        storage.resize_(nbytes)
                # .data: autograd must not see a version bump on tensors it saved.
                p.layout.gather_out(gathered, p.full.data)
        self._pending_gather = None
        self.gathered = True

    def fulls(self) -> list[torch.Tensor]:
        self.ensure_gathered()
        return [p.full for p in self.params]

    def free(self) -> None:
        """Release the full parameters' memory (their tensors stay, with empty storage)."""
        if self._pending_gather is not None:
            self._pending_gather[0].wait()
            self._pending_gather = None
        if self.gathered:
            for p in self.params:
                p.full.untyped_storage().resize_(0)
            self.gathered = False
        GATHER_STATS.discard(self)

    # -- gradients -------------------------------------------------------------
    def full_grads(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The trainable parameters' full gradients, plus any no_sync accumulation."""
        by_id = {id(p): g for p, g in zip(self.params, grads)}
        out = [by_id[id(p)] for p in self.trainable]
        if self.accumulated is not None:
            out = [
                a if g is None else (g if a is None else a + g)
                for g, a in zip(out, self._kept_accumulation())
            ]
            self.accumulated = None
        return out

    def accumulate(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Keep full gradients locally (inside ``no_sync``) for the next synced backward.

        Each shard's ``.grad`` shows this rank's rows of the unreduced sum, as DDP's
        ``no_sync`` leaves the local sum in ``.grad``; so ``zero_grad()`` discards the
        accumulation here too (see :meth:`_kept_accumulation`).
        """
        full = self.full_grads(grads)
        self.accumulated = [None if g is None else g.to(self.reduce_dtype, copy=True) for g in full]
        self._shown = []
        for p, acc in zip(self.trainable, self.accumulated):
            if acc is None:
                self._shown.append(None)
                continue
            rows = p.layout.shard_of(acc, self.rank)
            p.shard.grad = rows if rows.dtype == p.shard.dtype else rows.to(p.shard.dtype)
            self._shown.append((p.shard.grad, p.shard.grad._version))

    def _kept_accumulation(self) -> list[torch.Tensor | None]:
        """The no_sync sums still wanted: one whose ``.grad`` was set to None or zeroed
        (``zero_grad()``, a skipped micro-batch) is dropped, as DDP drops it; the shown
        ``.grad`` makes way for the synced gradient."""
        kept = []
        for p, acc, shown in zip(self.trainable, self.accumulated, self._shown):
            if acc is None:
                kept.append(None)
                continue
            grad, version = shown
            current = p.shard.grad
            if current is not None and (current is not grad or current._version != version):
                if current is not grad or current.any():
                    raise FSDPUsageError(
                        f"the .grad of FSDP parameter {p.fqns[0]!r} was replaced or changed "
                        "in place after a no_sync() backward; FSDP keeps no_sync gradients "
                        "unsharded until the synced backward, so only zero_grad() may touch "
                        "them before it (scale the loss instead of the gradients)"
                    )
                current = None  # zeroed in place: zero_grad(set_to_none=False)
            p.shard.grad = None
            kept.append(None if current is None else acc)
        return kept

    def reduce_grads(self, grads: Sequence[torch.Tensor | None]) -> _PendingReduce | None:
        """Start the averaged reduce-scatter of full gradients into the shards' ``.grad``."""
        if not self.trainable:
            return None
        by_param = dict(zip(map(id, self.trainable), self.full_grads(grads)))
        # fp16 overflows easily when summed: divide first; otherwise divide the result.
        pre_div = self.reduce_dtype == torch.float16 and self.world > 1
        post_div = 1.0 if pre_div else float(self.world)
        works, out, rep, buf = [], None, None, None
        if self.sharded_trainable:
            seg = self.grad_layout.segment_numel
            buf = torch.empty(self.world * seg, dtype=self.reduce_dtype, device=self.device)
            view = buf.view(self.world, seg)
            for slot, p in zip(self.grad_layout.slots, self.sharded_trainable):
                slot.scatter_in(view, by_param[id(p)])
            if pre_div:
                buf.div_(self.world)
            out = torch.empty(seg, dtype=self.reduce_dtype, device=self.device)
            works.append(reduce_scatter_flat(out, buf, self.group, self.world))
        if self.replicated_trainable:
            rep = torch.stack(
                [
                    torch.zeros((), dtype=self.reduce_dtype, device=self.device)
                    if by_param[id(p)] is None
                    else by_param[id(p)].to(self.reduce_dtype)
                    for p in self.replicated_trainable
                ]
            )
            if pre_div:
                rep.div_(self.world)
            works.append(all_reduce_flat(rep, self.group, self.world))
        return _PendingReduce(self, works, out, rep, post_div, buf)
