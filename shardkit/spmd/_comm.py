"""Mesh-axis collectives, with accounting for :func:`count_collectives`.

Every collective shardkit's SPMD layer issues goes through here, so tests and users
can assert exactly what a program communicates.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ._mesh import Mesh

__all__ = [
    "CollectiveCounts",
    "count_collectives",
    "all_reduce",
    "reduce_scatter",
    "all_gather_bytes",
    "all_to_all_bytes",
]


@dataclass
class CollectiveCounts:
    """What ran inside a :func:`count_collectives` block.

    ``calls[(kind, axes)]`` and ``bytes[(kind, axes)]`` are keyed by the collective kind
    (``"all_reduce"``, ``"all_gather"``, ``"all_to_all"``, ``"reduce_scatter"``) and the
    tuple of mesh-axis names it ran over. ``bytes`` counts what this rank sent.
    ``fallbacks`` counts ops that ran through the gather fallback, by op name.
    """

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)

    def total_calls(self, kind: str | None = None) -> int:
        """Collective calls counted, of one ``kind`` (e.g. ``"all_gather"``) or all."""
        return sum(n for (k, _), n in self.calls.items() if kind in (None, k))

    def total_bytes(self, kind: str | None = None) -> int:
        """Bytes this rank sent through collectives, of one ``kind`` or all."""
        return sum(n for (k, _), n in self.bytes.items() if kind in (None, k))


_active: list[CollectiveCounts] = []


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count the SPMD collectives (and gather fallbacks) issued inside the block."""
    counts = CollectiveCounts()
    _active.append(counts)
    try:
        yield counts
    finally:
        _active.remove(counts)


def record(kind: str, axis_names: tuple[str, ...], num_bytes: int) -> None:
    for counts in _active:
        counts.calls[(kind, axis_names)] += 1
        counts.bytes[(kind, axis_names)] += int(num_bytes)


def record_fallback(op_name: str) -> None:
    for counts in _active:
        counts.fallbacks[op_name] += 1


def _names(mesh: Mesh, axes: Sequence[int]) -> tuple[str, ...]:
    return tuple(mesh.axis_labels[a] for a in sorted(axes))


def _group_size(mesh: Mesh, axes: Sequence[int]) -> int:
    n = 1
    for a in axes:
        n *= mesh.mesh_shape[a]
    return n


def all_reduce(
    tensor: torch.Tensor, mesh: Mesh, axes: Sequence[int], op: str = "sum"
) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over the mesh ``axes``; returns it."""
    if _group_size(mesh, axes) == 1:
        return tensor
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    record("all_reduce", _names(mesh, axes), tensor.numel() * tensor.element_size())
    dist.all_reduce(tensor, op=reduce_op, group=mesh.group(axes))
    return tensor


def reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, mesh: Mesh, axes: Sequence[int]
) -> torch.Tensor:
    """Sum ``inp`` (one equal-sized slot per group member, in rank order) over the mesh
    ``axes`` and keep this rank's slot in ``out``. Counts the bytes bound for other ranks."""
    size = _group_size(mesh, axes)
    if size == 1:
        return out.copy_(inp)
    record("reduce_scatter", _names(mesh, axes), (size - 1) * out.numel() * out.element_size())
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, inp, op=dist.ReduceOp.SUM, group=mesh.group(axes))
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    if t.numel() <= 1 and t.stride() != (1,):  # torch calls a 0/1-element view of any
        t = t.clone(memory_format=torch.contiguous_format)  # stride contiguous
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8)


def _code(text: str) -> int:
    return zlib.crc32(text.encode())  # not hash(): str hashes differ per process


# What the caller is exchanging (a state-dict key...), compared with the layout
_label: contextvars.ContextVar[tuple[dict, str] | None] = contextvars.ContextVar(
    "shardkit_exchange_label", default=None
)


@contextlib.contextmanager
def exchange_label(label: dict, hint: str) -> Iterator[None]:
    """Fold ``label`` (JSON: what the caller exchanges, e.g. ``{"key": "0.weight"}``) into
    the cross-rank check of the gathers and all-to-alls inside the block, so ranks that
    exchange different things of the same shape raise instead of swapping values; ``hint``
    ends the error (how to fix the call). No extra collective: the label rides in the
    header code."""
    token = _label.set((label, hint))
    try:
        yield
    finally:
        _label.reset(token)


def _described(layout: dict | None) -> dict:
    """``layout`` and the active :func:`exchange_label`: what the ranks compare."""
    labelled = _label.get()
    return {**(layout or {}), **(labelled[0] if labelled else {})}


def _check_words(local: torch.Tensor, layout: dict | None) -> list[int]:
    """``[dtype code, layout code]``: what a rank's bytes mean, for the cross-rank check."""
    return [_code(str(local.dtype)), _code(json.dumps(_described(layout), sort_keys=True))]


def _raise_disagreement(local: torch.Tensor, layout: dict | None, group, ranks: list[int]):
    """Every rank of ``group`` saw that the ranks' words differ: name the difference.

    Only reached on a mismatch that every member saw, so the extra exchange is safe.
    """
    from ..runtime._json_gather import all_gather_json

    mine = {"dtype": str(local.dtype), **_described(layout)}
    every = all_gather_json(mine, group, device=torch.device("cpu"))
    # the codes differed, so some description differs from the first member's
    other = next((i for i, v in enumerate(every) if v != every[0]), 1)
    what = "; ".join(
        f"{k}: rank {ranks[0]} has {every[0].get(k)}, rank {ranks[other]} has {every[other].get(k)}"
        for k in sorted(set(every[0]) | set(every[other]))
        if every[0].get(k) != every[other].get(k)
    )
    labelled = _label.get()
    fix = (
        labelled[1]
        if labelled and any(every[0].get(k) != every[other].get(k) for k in labelled[0])
        else "every rank must hold the same dtype, global shape and partition spec (check "
        "from_local's global_shape and each rank's mark_sharding spec and dtype)"
    )
    raise ValueError(
        "full_tensor/redistribute: the ranks disagree on the sharded tensor they exchange "
        f"({what}); {fix}"
    )


def all_gather_bytes(
    local: torch.Tensor, mesh: Mesh, axes: Sequence[int], layout: dict | None = None
) -> dict[int, torch.Tensor]:
    """Gather every group member's raw bytes; returns ``{global rank: uint8 tensor}``.

    The size header every member sends first also carries a code of ``local``'s dtype
    and of ``layout`` (a JSON description of what the bytes are: global shape, spec), so
    members that disagree raise ValueError on every rank instead of reading each other's
    bytes as something else; no extra collective.
    """
    payload = _as_bytes(local)
    group_ranks = sorted(mesh.group_ranks(axes))
    if len(group_ranks) == 1:
        return {group_ranks[0]: payload}
    group = mesh.group(axes)
    header = torch.tensor([payload.numel(), *_check_words(local, layout)], dtype=torch.int64)
    headers = [torch.zeros_like(header) for _ in group_ranks]
    dist.all_gather(headers, header, group=group)
    if any(not torch.equal(h[1:], header[1:]) for h in headers):
        _raise_disagreement(local, layout, group, group_ranks)
    sizes = [h[0] for h in headers]
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=payload.device)
    padded[: payload.numel()] = payload
    out = [torch.empty_like(padded) for _ in group_ranks]
    record("all_gather", _names(mesh, axes), payload.numel())
    dist.all_gather(out, padded, group=group)
    return {r: buf[: int(s.item())] for r, buf, s in zip(group_ranks, out, sizes)}


_HEADER_BYTES = 16  # two int64 words; a multiple of every dtype's size keeps alignment


def all_to_all_bytes(
    chunks: Sequence[torch.Tensor],
    recv_sizes: Sequence[int],
    mesh: Mesh,
    like: torch.Tensor | None = None,
    layout: dict | None = None,
) -> list[torch.Tensor]:
    """Send ``chunks[r]`` (raw bytes) to every world rank r; receive ``recv_sizes[r]`` bytes from each.

    Each chunk travels behind a 16-byte header with the codes of ``like``'s dtype and of
    ``layout`` (as :func:`all_gather_bytes`), inside the same all-to-all, so ranks that
    disagree raise ValueError on every rank. Ranks that disagree on the byte counts
    themselves fail in the transport instead (gloo raises or aborts).
    """
    like = chunks[0] if like is None else like
    words = torch.tensor(_check_words(like, layout), dtype=torch.int64)
    header = words.view(torch.uint8)
    pieces = []
    for c in chunks:
        pieces += [header.to(c.device), _as_bytes(c)]
    send = torch.cat(pieces) if chunks else torch.empty(0, dtype=torch.uint8)
    sizes = [_HEADER_BYTES + int(s) for s in recv_sizes]
    recv = torch.empty(sum(sizes), dtype=torch.uint8, device=send.device)
    me = dist.get_rank()
    record(
        "all_to_all",
        tuple(mesh.axis_labels),
        sum(c.numel() * c.element_size() for i, c in enumerate(chunks) if i != me),
    )
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=sizes,
        input_split_sizes=[_HEADER_BYTES + c.numel() * c.element_size() for c in chunks],
    )
    received = torch.split(recv, sizes)
    theirs = torch.stack([buf[:_HEADER_BYTES] for buf in received]).cpu().view(torch.int64)
    if not bool((theirs == words).all()):  # then every rank sees some peer differ
        _raise_disagreement(like, layout, None, list(range(len(chunks))))
    return [buf[_HEADER_BYTES:] for buf in received]
