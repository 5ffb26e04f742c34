"""Move a shard from one placement to another with the cheapest collective.

Order of preference, decided identically on every rank from pure arithmetic:
1. local slicing, when every rank's new box lies inside its old one (no communication);
2. all-gather over the axes being unsharded, when each group's old boxes cover the new ones;
3. all-to-all over the world, each rank sending exactly the overlap of its old box with
   every other rank's new box, from one replica only.
Pending partial reductions are resolved first: by one reduce-scatter when the new spec
splits exactly over the summed axes, otherwise by all-reduce over their axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import runtime
from . import _comm
from ._placement import Placement
from .layout import Box, replica_axes

__all__ = ["redistribute_local"]


def _resolve_partial(
    local: torch.Tensor, src: Placement, dst: Placement
) -> tuple[torch.Tensor, Placement]:
    keep = tuple(p for p in src.partial if p in dst.partial)
    todo = [p for p in src.partial if p not in dst.partial]
    if not todo:
        return local, src
    local = local.clone()
    for op in {op for _, op in todo}:
        axes = [a for a, o in todo if o == op]
        _comm.all_reduce(local, src.mesh, axes, op)
    return local, Placement(src.mesh, src.spec, keep)


def _reduce_scatter(
    local: torch.Tensor, global_shape: Sequence[int], src: Placement, dst: Placement
) -> tuple[torch.Tensor, Placement] | None:
    """Resolve a pending sum straight into shards when ``dst`` splits over the summed axes.

    One reduce-scatter moves half of what all-reduce-then-slice would (the FSDP gradient
    path). Only when ``dst`` keeps ``src``'s sharding and adds exactly the summed axes;
    otherwise None.
    """
    todo = [p for p in src.partial if p not in dst.partial]
    if not todo or any(op != "sum" for _, op in todo):
        return None
    axes = sorted(a for a, _ in todo)
    src_axes = {a for spec in src.spec for a in spec}
    dst_axes = {a for spec in dst.spec for a in spec}
    if dst_axes - src_axes != set(axes):
        return None
    if any(s and s != d for s, d in zip(src.spec, dst.spec)):
        return None
    mesh = src.mesh
    members = sorted(mesh.group_ranks(axes))  # process-group rank order
    mine = src.box(global_shape)
    pieces = [
        local[dst.box_of_rank(global_shape, r).relative_to(mine)].reshape(-1) for r in members
    ]
    slot = max(p.numel() for p in pieces)
    if slot == 0:  # an empty tensor: nothing to reduce
        return None
    buf = local.new_zeros(len(members) * slot)
    for i, piece in enumerate(pieces):
        buf[i * slot : i * slot + piece.numel()] = piece
    out = local.new_empty(slot)
    _comm.reduce_scatter(out, buf, mesh, axes)
    box = dst.box(global_shape)
    keep = tuple(p for p in src.partial if p in dst.partial)
    return out[: box.numel].reshape(box.sizes), Placement(mesh, dst.spec, keep)


def _from_bytes(buf: torch.Tensor, like: torch.Tensor, box: Box) -> torch.Tensor:
    if like.dtype == torch.bool:
        return buf.view(torch.uint8).to(torch.bool).reshape(box.sizes)
    return buf.view(like.dtype).reshape(box.sizes)


def _place(out: torch.Tensor, out_box: Box, piece: torch.Tensor, piece_box: Box) -> None:
    out[piece_box.relative_to(out_box)] = piece


def redistribute_local(
    local: torch.Tensor, global_shape: Sequence[int], src: Placement, dst: Placement
) -> torch.Tensor:
    """This rank's local tensor under ``dst``, given its local tensor under ``src``."""
    mesh = src.mesh
    if mesh != dst.mesh:
        from ._errors import MeshError

        raise MeshError(
            f"cannot move a tensor from mesh {src.mesh} to mesh {dst.mesh}: an op's sharded "
            "operands must share one mesh. Put them on one first, e.g. "
            "xs.mark_sharding(t.full_tensor(), other_mesh, spec)"
        )
    scattered = _reduce_scatter(local, global_shape, src, dst) if src.partial else None
    if scattered is not None:
        local, src = scattered
    local, src = _resolve_partial(local, src, dst)
    if src.spec == dst.spec:
        return local
    ranks = list(range(mesh.size()))
    src_boxes = {r: src.box_of_rank(global_shape, r) for r in ranks}
    dst_boxes = {r: dst.box_of_rank(global_shape, r) for r in ranks}
    me = runtime.global_ordinal()
    my_src, my_dst = src_boxes[me], dst_boxes[me]

    # 1. local slicing
    if all(src_boxes[r].contains(dst_boxes[r]) for r in ranks):
        if my_dst.is_empty():
            # an empty box has no position inside the old one: slicing could give the
            # wrong shape, e.g. (0, 0) for a (1, 0) shard
            return local.new_empty(my_dst.sizes)
        return local[my_dst.relative_to(my_src)].clone()

    out = torch.empty(my_dst.sizes, dtype=local.dtype, device=local.device)
    # 2. all-gather over the axes that stop sharding
    src_axes = {a for axes in src.spec for a in axes}
    dst_axes = {a for axes in dst.spec for a in axes}
    gather_axes = sorted(src_axes - dst_axes)
    if gather_axes and _gather_covers(mesh, gather_axes, src_boxes, dst_boxes):
        pieces = _comm.all_gather_bytes(local, mesh, gather_axes, _layout(global_shape, src))
        for rank, buf in pieces.items():
            overlap = src_boxes[rank].intersect(my_dst)
            if overlap is None or overlap.is_empty():
                continue
            full_piece = _from_bytes(buf, local, src_boxes[rank])
            _place(out, my_dst, full_piece[overlap.relative_to(src_boxes[rank])], overlap)
        return out

    # 3. all-to-all: each region of a new box comes from the one old replica that shares
    #    the receiver's coordinates on the old replica axes.
    reps = replica_axes(src.spec, mesh.ndim)
    coords = {r: mesh.coord_of(r) for r in ranks}

    def source_of(receiver: int, sender: int) -> bool:
        return all(coords[receiver][a] == coords[sender][a] for a in reps)

    sends, recv_sizes = [], []
    for peer in ranks:
        overlap = my_src.intersect(dst_boxes[peer]) if source_of(peer, me) else None
        if overlap is None or overlap.is_empty():
            sends.append(local.new_empty(0))
        else:
            sends.append(local[overlap.relative_to(my_src)])
        incoming = src_boxes[peer].intersect(my_dst) if source_of(me, peer) else None
        size = 0 if incoming is None else incoming.numel * local.element_size()
        recv_sizes.append(size)
    received = _comm.all_to_all_bytes(
        sends, recv_sizes, mesh, like=local, layout=_layout(global_shape, src)
    )
    for peer, buf in zip(ranks, received):
        if buf.numel() == 0:
            continue
        overlap = src_boxes[peer].intersect(my_dst)
        _place(out, my_dst, _from_bytes(buf, local, overlap), overlap)
    return out


def _layout(global_shape: Sequence[int], src: Placement) -> dict:
    """What the exchanged bytes are, compared across ranks by the collectives' headers."""
    return {"global shape": [int(s) for s in global_shape], "partition spec": str(src.user_spec)}


def _gather_covers(mesh, gather_axes, src_boxes, dst_boxes) -> bool:
    """Whether every rank's new box is exactly the union of its gather group's old boxes.

    Exactly: an all-gather hands each rank every member's shard, so it is only chosen when
    each received byte is kept; otherwise the all-to-all moves less.
    """
    for rank, dst_box in dst_boxes.items():
        covered = received = 0
        for member in mesh.group_ranks(gather_axes, coord=mesh.coord_of(rank)):
            overlap = src_boxes[member].intersect(dst_box)
            covered += 0 if overlap is None else overlap.numel
            received += src_boxes[member].numel
        if covered != dst_box.numel or received != dst_box.numel:
            return False
    return True
