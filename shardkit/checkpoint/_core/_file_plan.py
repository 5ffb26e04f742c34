"""How a rank's share of a save is cut into data files: item pieces, file caps, names."""

from __future__ import annotations

from ...spmd.layout import Box
from ._format import is_int
from ._planner import WriteItem
from ._storage import StorageWriter

__all__ = ["assign_files", "cap_files", "cap_items", "max_file_bytes", "tensor_name"]


def assign_files(items: list[WriteItem], count: int) -> list[list[WriteItem]]:
    """``items`` spread over at most ``count`` files, largest first onto the lightest."""
    bins: list[list[WriteItem]] = [[] for _ in range(count)]
    load = [0] * count
    # empty items go last, by name: a reader rebuilds each file's header in this order
    for item in sorted(items, key=lambda i: (-i.nbytes, tensor_name(i))):
        k = min(range(count), key=lambda b: (load[b], b))
        bins[k].append(item)
        load[k] += item.nbytes
    return [b for b in bins if b]


def cap_items(items: list[WriteItem], cap: int | None) -> list[WriteItem]:
    """Items cut into row pieces of at most ``cap`` bytes (at least one row each)."""
    if cap is None:
        return items
    out = []
    for item in items:
        if item.nbytes <= cap or not item.box.ndim or item.box.sizes[0] < 2:
            out.append(item)
            continue
        rows = item.box.sizes[0]
        step = max(1, cap // max(1, item.nbytes // rows))
        for r in range(0, rows, step):
            offsets = (item.box.offsets[0] + r, *item.box.offsets[1:])
            sizes = (min(step, rows - r), *item.box.sizes[1:])
            out.append(WriteItem(item.key, Box(offsets, sizes), item.shape, item.dtype))
    return out


def cap_files(bins: list[list[WriteItem]], cap: int | None) -> list[list[WriteItem]]:
    """Each bin split, in order, into files of at most ``cap`` bytes of tensor data (a
    single item larger than ``cap``, a one-row tensor, keeps a file of its own)."""
    if cap is None:
        return bins
    files: list[list[WriteItem]] = []
    for items in bins:
        current, size = [], 0
        for item in items:
            if current and size + item.nbytes > cap:
                files.append(current)
                current, size = [], 0
            current.append(item)
            size += item.nbytes
        files.append(current)
    return [f for f in files if f]


def max_file_bytes(writer: StorageWriter) -> int | None:
    """The writer's cap on a data file's tensor bytes, checked; None for no cap."""
    cap = getattr(writer, "max_file_bytes", None)
    if cap is not None and (not is_int(cap) or cap < 1):
        raise ValueError(f"{writer!r}: max_file_bytes must be a positive int or None, got {cap!r}")
    return cap


def tensor_name(item: WriteItem) -> str:
    """The item's safetensors entry name: ``key@offsets``."""
    return f"{item.key}@{','.join(map(str, item.box.offsets))}"
