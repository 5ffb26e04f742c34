"""``st[key] = value`` for a ShardedTensor with a key of ints and slices.

torch writes ``t[0:2] = v`` as a slice view of ``t`` followed by an in-place copy into
the view. A slice of a sharded dim is not a view of this rank's shard (its rows may live
on another rank), so the copy never reached the tensor: the write was silently lost.
Here each rank instead writes the part of the selection that falls in its own shard,
straight into its local tensor: along every dim, the selected indices are an arithmetic
progression, and those inside the shard are again one, so both the shard's part and the
value's part are plain slices. No communication, unless ``value`` is itself sharded (it
is gathered) or the tensor holds a pending sum (it is reduced first).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["basic_key", "write_basic"]


def basic_key(key: Any, shape: torch.Size) -> list[int | slice] | None:
    """``key`` as one int or step > 0 slice per dim, or None if it is not made only of
    ints, slices and one ``...`` (tensors, lists, bools and None take torch's path)."""
    items = list(key) if isinstance(key, tuple) else [key]
    if any(
        not (isinstance(k, (int, slice)) or k is Ellipsis) or isinstance(k, bool) for k in items
    ):
        return None
    if sum(k is Ellipsis for k in items) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (len(shape) - len(items) + 1)
    if len(items) > len(shape):
        raise IndexError(f"too many indices for a tensor of dimension {len(shape)}")
    items += [slice(None)] * (len(shape) - len(items))
    out: list[int | slice] = []
    for dim, (k, size) in enumerate(zip(items, shape)):
        if isinstance(k, slice):
            start, stop, step = k.indices(size)
            if step <= 0:
                raise ValueError("step must be greater than zero")
            out.append(slice(start, max(start, stop), step))
        else:
            if not -size <= k < size:
                raise IndexError(f"index {k} is out of bounds for dimension {dim} with size {size}")
            out.append(k % size)
    return out


def write_basic(st, key: list[int | slice], value: Any) -> None:
    """Write ``value`` into the entries of ``st`` that ``key`` (from :func:`basic_key`)
    selects, each rank into its own shard."""
    from ._redistribute import redistribute_local
    from ._sharded_tensor import ShardedTensor

    if st._placement.partial:  # reduce the pending sum first: the write replaces values
        placement = st._placement.without_partial()
        st._local_tensor = redistribute_local(st._local_tensor, st.shape, st._placement, placement)
        st._placement = placement
    if isinstance(value, ShardedTensor):
        value = value.full_tensor()
    selected = [len(range(k.start, k.stop, k.step)) for k in key if isinstance(k, slice)]
    value = torch.as_tensor(value, dtype=st.dtype, device=st._local_tensor.device)
    value = value.broadcast_to(selected)
    box = st._placement.box(st.shape)
    local_key, value_key = [], []
    for k, lo, hi in zip(key, box.offsets, box.ends):
        if isinstance(k, int):
            if not lo <= k < hi:
                return  # the selected entries live on other ranks
            local_key.append(k - lo)
            continue
        first = max(0, -(-(lo - k.start) // k.step))  # first selected position inside
        last = len(range(k.start, k.stop, k.step))
        last = min(last, -(-(hi - k.start) // k.step))  # one past the last inside
        if first >= last:
            return
        begin = k.start + first * k.step - lo
        local_key.append(slice(begin, begin + (last - first - 1) * k.step + 1, k.step))
        value_key.append(slice(first, last))
    st._local_tensor[tuple(local_key)] = value[tuple(value_key)]
