"""Save and load planning: which rank writes which box, which bytes each rank reads.

Plans travel between ranks as JSON (never pickle), so items are plain data.
"""

from __future__ import annotations

import abc
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...spmd.layout import Box
from ._comm import world_of_many
from ._errors import StateDictMismatchError
from ._flatten import Flat, TensorLeaf
from ._format import ChunkMeta, Metadata, dtype_from_name, dtype_name
from ._validate import find_overlap

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
        """Bytes of the box in the tensor's dtype."""
        return self.box.numel * self.dtype.itemsize

    def to_json(self) -> list:
        """``[key, offsets, sizes, shape, dtype name]``: what ranks exchange while planning."""
        return [self.key, list(self.box.offsets), list(self.box.sizes), list(self.shape),
                dtype_name(self.dtype, self.key)]  # fmt: skip

    @classmethod
    def from_json(cls, doc: list) -> WriteItem:
        """The item :meth:`to_json` described."""
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
        """The plan as JSON (the ranks exchange plans as JSON, never pickles)."""
        return {"items": [i.to_json() for i in self.items], "extra": self.extra}

    @classmethod
    def from_json(cls, doc: dict) -> SavePlan:
        """The plan :meth:`to_json` described."""
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
    def set_up_planner(self, flat: Flat, metadata: Metadata, *, strict: bool | None) -> None:
        """Receive the caller's flattened state and the checkpoint's metadata.

        ``strict`` is ``load(strict=...)``: True raises on missing or unexpected keys,
        False skips both with a warning, None leaves it to the planner.
        """

    @abc.abstractmethod
    def create_local_plan(self) -> LoadPlan:
        """The chunk reads that fill this rank's tensors."""

    @abc.abstractmethod
    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        """The destination region for ``item.box`` (a view of the caller's tensor)."""


def check_flag(where: str, name: str, value: Any, *, none_ok: bool = False) -> bool | None:
    """``value`` if it is a bool (or None where allowed), else a TypeError: a string such
    as ``"no"`` is truthy and would silently turn the option on (pickling, a partial
    load)."""
    if (none_ok and value is None) or isinstance(value, bool):
        return value
    raise TypeError(f"{where}({name}=...) must be True or False, got {value!r}")


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
        dedup_save_to_lowest_rank: write every replicated box from the lowest rank that
            holds it (as torch's option) instead of spreading the bytes over the holders.
        flatten_state_dict, flatten_sharded_tensors, dedup_replicated_tensors,
            enable_plan_caching: accepted for torch code. shardkit always addresses
            nested values by dotted keys and always writes a replicated box once, so
            these change nothing; a non-default value warns once.
    """

    def __init__(
        self,
        *,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        dedup_replicated_tensors: bool | None = None,
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
        allow_pickle: bool = False,
    ) -> None:
        for name, value in (("flatten_state_dict", flatten_state_dict),
                            ("flatten_sharded_tensors", flatten_sharded_tensors),
                            ("dedup_save_to_lowest_rank", dedup_save_to_lowest_rank),
                            ("enable_plan_caching", enable_plan_caching),
                            ("allow_pickle", allow_pickle)):  # fmt: skip
            check_flag("DefaultSavePlanner", name, value)
        check_flag("DefaultSavePlanner", "dedup_replicated_tensors", dedup_replicated_tensors,
                   none_ok=True)  # fmt: skip
        ignored = {
            "flatten_state_dict": (flatten_state_dict, True),
            "flatten_sharded_tensors": (flatten_sharded_tensors, True),
            "dedup_replicated_tensors": (dedup_replicated_tensors, None),
            "enable_plan_caching": (enable_plan_caching, False),
        }
        for name, (value, default) in ignored.items():
            if value != default:
                warn_once(
                    f"DefaultSavePlanner({name}={value!r}) has no effect in shardkit: "
                    "nested values are always saved under dotted keys, each replicated box "
                    "is written once, and plans are cheap to recompute"
                )
        self.dedup_save_to_lowest_rank = bool(dedup_save_to_lowest_rank)
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
        first = first_items(plans)
        holders: dict[tuple[str, Box], list[int]] = {}
        for rank, plan in enumerate(plans):
            for item in plan.items:
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
        _refuse_overlaps(holders)
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
            if self.dedup_save_to_lowest_rank:
                rank = min(ranks)
            else:
                rank = min(ranks, key=lambda r: (load[r], r))
            out[rank].items.append(item)
            load[rank] += item.nbytes
        return out

    def resolve_data(self, item: WriteItem) -> torch.Tensor:
        assert self.flat is not None
        return _region(self.flat.tensors[item.key], item.box)


def first_items(plans: list[SavePlan]) -> dict[str, tuple[int, WriteItem]]:
    """Each key's first ``(rank, item)``, after checking that every rank gives the key the
    same global shape and dtype (ValueError naming both ranks otherwise)."""
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
    return first


def _refuse_overlaps(holders: dict[tuple[str, Box], list[int]]) -> None:
    """Distinct shards of one key that share elements: the ranks disagree on the layout
    (a mesh or spec that differs per rank). An overlap with a gap of the same size passes
    the element count, and the loader would call the committed checkpoint corrupt."""
    by_key: dict[str, list] = {}
    for key, box in holders:
        if box.numel:
            by_key.setdefault(key, []).append((tuple(box.offsets), tuple(box.ends)))
    for key, boxes in by_key.items():
        if len(boxes) < 2:
            continue
        try:
            pair = find_overlap(len(boxes[0][0]), boxes)
        except OverflowError:  # no layout shardkit makes is this tangled; the count held
            continue
        if pair is not None:
            (a, _), (b, _) = pair
            ranks = {r for (k, box), rs in holders.items() if k == key for r in rs
                     if tuple(box.offsets) in (a, b)}  # fmt: skip
            raise ValueError(
                f"key {key!r}: the shards at offsets {list(a)} and {list(b)} overlap (held by "
                f"ranks {sorted(ranks)}): the ranks disagree on how the tensor is laid out; "
                "build the mesh and partition spec the same way on every rank"
            )


def unwrapped(key: str) -> str:
    """``key`` without the segments wrappers add (DDP / FSDP ``module.``, activation
    checkpointing, ``torch.compile``)."""
    parts = key.split(".")
    skip = {"module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}
    return ".".join(p for p in parts if p not in skip)


def wrapped_pairs(wanted: Iterable[str], saved: Iterable[str]) -> list[tuple[str, str]]:
    """``(wanted key, saved key)`` for each wanted key that a saved key equals once both
    lose the segments wrappers add: the two sides came from differently wrapped models."""
    by_plain = {unwrapped(k): k for k in saved}
    return [(k, by_plain[u]) for k in wanted if (u := unwrapped(k)) in by_plain]


def _wrapper_hint(missing: list[str], saved: Any) -> str:
    """A sentence for keys the checkpoint holds under a wrapper's names, else ''."""
    pairs = wrapped_pairs(missing, saved)
    if not pairs:
        return ""
    want, have = pairs[0]
    return (
        f"the checkpoint holds {have!r} where {want!r} is wanted ({len(pairs)} such key(s)): "
        "the keys differ only by a wrapper's names (DDP and FSDP add 'module.'), so one side "
        "is a wrapped model's state_dict(). Use shardkit.checkpoint.state_dict."
        "get_model_state_dict(model), whose keys carry no wrapper names, to save and to load "
        "(or save and load the same wrapping); else "
    )


def dict_differences(given: Any, saved: Any, key: str) -> tuple[list[str], list[str]]:
    """The dotted entries of a non-empty dict value ``given`` that ``saved`` lacks, and
    those only ``saved`` has (torch flattens such dicts into one key per entry). An empty
    dict, or a value that is not a dict on both sides, is replaced whole."""
    if not (isinstance(given, dict) and given and isinstance(saved, dict)):
        return [], []
    lacking = [f"{key}.{k}" for k in given if k not in saved]
    extra = [f"{key}.{k}" for k in saved if k not in given]
    for k, value in given.items():
        if k in saved:
            more, rest = dict_differences(value, saved[k], f"{key}.{k}")
            lacking += more
            extra += rest
    return lacking, extra


def fill_dict(given: dict, saved: dict) -> None:
    """``saved``'s entries into ``given`` in place (keeping its type: a ``Counter`` stays
    one), for the keys ``given`` has; an empty ``given`` takes every entry."""
    if not given:
        for k, value in saved.items():
            given[k] = value
        return
    for k, value in given.items():
        if k not in saved:
            continue  # a partial load leaves it
        if isinstance(value, dict) and value and isinstance(saved[k], dict):
            fill_dict(value, saved[k])
        else:
            given[k] = saved[k]


class DefaultLoadPlanner(LoadPlanner):
    """Reads, for each local tensor, only the saved chunks' overlap with its box.

    The defaults follow ``torch.distributed.checkpoint``: the state dict you pass is
    what is loaded, keys the checkpoint has beyond it are ignored (load only the model
    out of a model + optimizer checkpoint), a key missing from the checkpoint raises
    :class:`StateDictMismatchError` unless ``allow_partial_load``, and a saved dtype
    is cast to the destination's dtype as ``Tensor.copy_`` does.

    Args:
        allow_partial_load: leave state-dict keys the checkpoint lacks as they are,
            instead of raising (as torch's ``DefaultLoadPlanner``).
        allow_pickle: load values that were saved with ``allow_pickle=True``. Only opt in
            for checkpoints you trust: unpickling runs code.
        strict: shardkit's stricter check: also raise when the checkpoint holds keys
            the state dict lacks.
        strict_dtype: shardkit's stricter check: raise ``TypeError`` on a dtype
            mismatch instead of casting.
        flatten_state_dict, flatten_sharded_tensors: accepted for torch code; shardkit
            always addresses nested values by dotted keys, so these change nothing
            (False warns once).
    """

    def __init__(
        self,
        *,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        allow_partial_load: bool = False,
        allow_pickle: bool = False,
        strict: bool = False,
        strict_dtype: bool = False,
    ) -> None:
        flags = {
            "flatten_state_dict": flatten_state_dict,
            "flatten_sharded_tensors": flatten_sharded_tensors,
            "allow_partial_load": allow_partial_load,
            "allow_pickle": allow_pickle,
            "strict": strict,
            "strict_dtype": strict_dtype,
        }
        for name, value in flags.items():
            check_flag("DefaultLoadPlanner", name, value)
        for name in ("flatten_state_dict", "flatten_sharded_tensors"):
            if not flags[name]:
                warn_once(
                    f"DefaultLoadPlanner({name}=False) has no effect in shardkit: nested "
                    "values are always addressed by dotted keys"
                )
        self.flatten_state_dict = bool(flatten_state_dict)
        self.flatten_sharded_tensors = bool(flatten_sharded_tensors)
        self.allow_partial_load = bool(allow_partial_load)
        self.allow_pickle = bool(allow_pickle)
        self.strict = bool(strict)
        self.strict_dtype = bool(strict_dtype)
        self.flat: Flat | None = None
        self.load_strict: bool | None = None

    def set_up_planner(self, flat: Flat, metadata: Metadata, *, strict: bool | None) -> None:
        """``strict``: ``load(strict=...)``; None keeps this planner's own settings."""
        self.flat, self.metadata, self.load_strict = flat, metadata, strict

    def _check_keys(self) -> None:
        flat, md = self.flat, self.metadata
        wanted = set(flat.tensors) | set(flat.slots) | flat.absent
        missing = [k for k in wanted if k not in md.tensors and k not in md.values
                   and k not in md.objects]  # fmt: skip
        nested_unexpected = []
        for key, value in flat.values.items():  # a dict value is filled entry by entry
            if key in md.values:
                lacking, extra = dict_differences(value, md.values[key], key)
                missing += lacking
                nested_unexpected += extra
        missing.sort()
        if self.load_strict is False:  # load(strict=False): skip both sides, say so
            unexpected = sorted([*(set(md.keys()) - wanted), *nested_unexpected])
            if missing or unexpected:
                warnings.warn(
                    f"load(strict=False) skips keys missing from the checkpoint {missing} and "
                    f"unexpected keys {unexpected}",
                    stacklevel=5,
                )
            return
        if self.load_strict or self.strict:
            unexpected = sorted([*(set(md.keys()) - wanted), *nested_unexpected])
            if missing or unexpected:
                raise StateDictMismatchError(
                    f"{on_rank()}state dict and checkpoint keys differ: missing from the "
                    f"checkpoint {missing}, unexpected in the checkpoint {unexpected} (strict "
                    "load); drop strict to ignore the checkpoint's extra keys"
                )
            return
        if missing and not self.allow_partial_load:
            raise StateDictMismatchError(
                f"{on_rank()}Missing key in checkpoint state_dict: {missing}; "
                f"{_wrapper_hint(missing, md.keys())}load a checkpoint that has them, remove "
                "them from the state dict, or pass planner=DefaultLoadPlanner("
                "allow_partial_load=True) to shardkit.checkpoint.load to leave them as they are "
                "(CheckpointManager.restore loads every key: load the step's directory with "
                "shardkit.checkpoint.load for that)"
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
            if saved.dtype != leaf.dtype and self.strict_dtype:
                raise TypeError(
                    f"key {key!r}: dtype mismatch, checkpoint has {saved.dtype} but the state "
                    f"dict has {leaf.dtype} (strict_dtype=True; without it the value is cast)"
                )
            if tuple(saved.shape) != tuple(leaf.shape):
                raise StateDictMismatchError(
                    f"{on_rank()}key {key!r}: shape mismatch, checkpoint has "
                    f"{list(saved.shape)} but the state dict has {list(leaf.shape)}"
                )
            for chunk in saved.chunks:
                overlap = chunk.box.intersect(leaf.box)
                if overlap is not None and not overlap.is_empty():
                    plan.items.append(ReadItem(key, overlap, chunk))
        return plan

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        assert self.flat is not None
        return _region(self.flat.tensors[item.key], item.box)


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Warn with ``message`` the first time this process sees it."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def on_rank() -> str:
    """``"rank R: "`` in a multi-rank run, else nothing."""
    import torch.distributed as dist

    if world_of_many():
        return f"rank {dist.get_rank()}: "
    return ""


class SPMDSavePlanner(DefaultSavePlanner):
    """The save planner for SPMD states (ShardedTensor); the default already handles them."""


class SPMDLoadPlanner(DefaultLoadPlanner):
    """The load planner for SPMD states (ShardedTensor); the default already handles them."""
