"""Reading saved chunks into place, verifying every checksum block they touch.

Each chunk is read in row pieces. A piece that covers whole destination rows is read
straight into a contiguous destination and hashed while still in the CPU cache. Otherwise
(resharding) the piece is read into a cache-sized scratch buffer, hashed, and its overlap
is copied into place. No file is ever memory-mapped: a load's memory is its destination
plus a few MiB of scratch per reading thread, whatever the size of the files.

When several chunks fill one band of destination rows side by side (a shard that was
split along a later dim when saved), their pieces are read in lockstep and written
one band of rows at a time. The destination is then written front to back, which
is markedly faster than one strided pass per chunk.
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import xxhash

from ...spmd.layout import Box
from ._copy import copy_into
from ._errors import CorruptCheckpointError
from ._format import ChunkMeta, num_rows, row_bytes
from ._planner import LoadPlanner, ReadItem
from ._storage import FileSystemReader, StorageReader

__all__ = ["LocalFiles", "chunk_label", "read_items"]

#: Bytes read per call when reading straight into the destination: each piece is hashed
#: while it is still in the CPU cache, instead of streaming the chunk through DRAM twice.
_PIECE_BYTES = 1 << 20
#: Bytes per piece when resharding out of a memory map or a scratch buffer: larger pieces
#: amortise the per-piece strided copy; measured best at about one checksum block.
_SCRATCH_PIECE_BYTES = 4 << 20
#: Bytes per band of rows, all chunks of the band together, so the band's pieces stay
#: in the CPU cache between hashing and copying.
_BAND_PIECE_BYTES = 1 << 20
#: Bytes of one large chunk that one reader thread takes at a time.
_SPLIT_BYTES = 16 << 20
#: Smallest chunk row (bytes) read by scattering rows straight into a strided destination;
#: below it, the per-row cost of the I/O vector outweighs the copy it saves.
_SCATTER_MIN_ROW = 2048
#: Rows per scattered read (the kernel takes at most IOV_MAX = 1024 vectors per call).
_SCATTER_MAX_ROWS = 512

_scratch = threading.local()


def chunk_label(key: str, chunk: ChunkMeta) -> str:
    return (
        f"key {key!r} chunk offsets={list(chunk.box.offsets)} sizes={list(chunk.box.sizes)} "
        f"in file {chunk.file}"
    )


def _scratch_bytes(nbytes: int, slot: int = 0) -> torch.Tensor:
    """A small per-thread reusable byte buffer; ``slot`` tells apart the buffers of chunks
    read in lockstep (a band)."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        _scratch.bufs = bufs = {}
    buf = bufs.get(slot)
    if buf is None or buf.numel() < nbytes:
        bufs[slot] = None  # free the old buffer first
        size = max(nbytes, _SCRATCH_PIECE_BYTES) if slot == 0 else nbytes
        bufs[slot] = buf = torch.empty(size, dtype=torch.uint8)
    return buf[:nbytes]


class LocalFiles:
    """Open descriptors of the local data files one load touches, opened once each.

    Bytes are only ever read (``preadv``) into the destination or into a small scratch
    buffer: no file is ever memory-mapped, so a load costs at most its destination plus
    ``thread_count`` scratch buffers (a few MiB each), whatever the size of the files, and
    works under an address-space limit or strict overcommit. Each file gets the kernel
    hint that it is read front to back (larger readahead).
    """

    def __init__(self, reader: StorageReader) -> None:
        self.reader = reader
        self.usable = (
            isinstance(reader, FileSystemReader)
            and reader.local
            and type(reader).read_into is FileSystemReader.read_into  # respect an override
        )
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _fd(self, name: str) -> int:
        with self._lock:
            if name not in self._fds:
                fd = self.reader.open_local(name)  # no symlink, no FIFO
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                self._fds[name] = fd
            return self._fds[name]

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from ``name`` at ``offset``; EOFError if the file ends early."""
        if not self.usable:
            self.reader.read_into(name, offset, out)
            return
        fd, done = self._fd(name), 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                raise EOFError(
                    f"{name}: file ends at byte {offset + done}, {len(out) - done} short"
                )
            done += n

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


def _scatter_view(item: ReadItem, dest: torch.Tensor, dtype: torch.dtype) -> memoryview | None:
    """The bytes spanned by ``dest`` when every chunk row of ``item`` lands in one
    contiguous run of it (each destination row's inner part is contiguous and the item
    takes whole chunk rows), so rows can be read straight into place; else None."""
    chunk, box = item.chunk, item.box
    if (
        box.ndim < 2
        or tuple(box.sizes[1:]) != tuple(chunk.box.sizes[1:])
        or dest.device.type != "cpu"
        or dest.dtype != dtype
        or row_bytes(chunk.box.sizes, dtype.itemsize) < _SCATTER_MIN_ROW
        or dest.shape[0] < 1
        or dest[0].numel() == 0
        or not dest[0].is_contiguous()
        or dest.stride(0) < dest[0].numel()
    ):
        return None
    span = (dest.shape[0] - 1) * dest.stride(0) + dest[0].numel()
    flat = dest.as_strided((span,), (1,), dest.storage_offset())
    return memoryview(flat.view(torch.uint8).numpy())


def _read_rows(
    files: LocalFiles, item: ReadItem, offset: int, vecs: list[memoryview], total: int, digest
) -> None:
    """Read ``total`` bytes of consecutive chunk rows from ``offset`` into the ``vecs``
    views (one vector per row) and hash them in file order."""
    got = os.preadv(files._fd(item.chunk.file), vecs, offset)
    if got < total:  # a short read: finish row by row
        done = 0
        for vec in vecs:
            if done + len(vec) > got:
                skip = max(0, got - done)
                _read(files, item, offset + done + skip, vec[skip:])
            done += len(vec)
    deque(map(digest.update, vecs), maxlen=0)


def _read(files: LocalFiles, item: ReadItem, offset: int, view: memoryview) -> None:
    try:
        files.read_into(item.chunk.file, offset, view)
    except (FileNotFoundError, EOFError) as exc:
        raise CorruptCheckpointError(
            f"cannot read {chunk_label(item.key, item.chunk)}: {exc}"
        ) from None


@dataclass(frozen=True)
class _Copy:
    """Rows ``lo:hi`` of an item's destination still to be filled from ``src``."""

    lo: int
    hi: int
    src: torch.Tensor


def _pieces(
    item: ReadItem,
    dest: torch.Tensor,
    dtype: torch.dtype,
    files: LocalFiles,
    step_bytes: int | None = None,
    slot: int = 0,
) -> Iterator[_Copy]:
    """Read the chunk rows covering ``item.box``, widened to whole checksum blocks, and
    yield each piece's overlap that was not read in place.

    The consumer copies a yielded piece before asking for the next one: a scratch
    buffer is reused. A block's checksum is checked once its last piece was hashed.
    """
    chunk, box = item.chunk, item.box
    rb = row_bytes(chunk.box.sizes, dtype.itemsize)
    rows = num_rows(chunk.box.sizes)
    r0 = box.offsets[0] - chunk.box.offsets[0] if box.ndim else 0
    r1 = r0 + box.sizes[0] if box.ndim else 1
    inner = tuple(
        slice(o - co, o - co + s)
        for o, s, co in zip(box.offsets[1:], box.sizes[1:], chunk.box.offsets[1:])
    )
    direct = (
        tuple(box.sizes[1:]) == tuple(chunk.box.sizes[1:])
        and dest.device.type == "cpu"
        and dest.is_contiguous()
    )
    out = memoryview(dest.reshape(-1).view(torch.uint8).numpy()) if direct else None
    scatter = None if direct or not files.usable else _scatter_view(item, dest, dtype)
    if step_bytes is None:
        step_bytes = _PIECE_BYTES if direct or scatter is not None else _SCRATCH_PIECE_BYTES
    step = max(1, step_bytes // max(1, rb))
    if scatter is not None:
        step = min(step, _SCATTER_MAX_ROWS)
        pitch = dest.stride(0) * dtype.itemsize
    block = chunk.block_rows
    for b in range(r0 // block, math.ceil(r1 / block)):
        if b >= len(chunk.checksums):
            raise CorruptCheckpointError(
                f"{chunk_label(item.key, chunk)}: block {b} has no checksum"
            )
        digest = xxhash.xxh3_64()
        bs, be = b * block, min((b + 1) * block, rows)
        for ps in range(bs, be, step):
            pe = min(ps + step, be)
            lo, hi = max(ps, r0), min(pe, r1)
            if direct and (lo, hi) == (ps, pe):
                view = out[(ps - r0) * rb : (pe - r0) * rb]
                _read(files, item, chunk.offset + ps * rb, view)
                digest.update(view)
                continue
            if scatter is not None and (lo, hi) == (ps, pe):
                first = (ps - r0) * pitch
                vecs = [scatter[o : o + rb] for o in range(first, first + (pe - ps) * pitch, pitch)]
                _read_rows(files, item, chunk.offset + ps * rb, vecs, (pe - ps) * rb, digest)
                continue
            buf = _scratch_bytes((pe - ps) * rb, slot)
            _read(files, item, chunk.offset + ps * rb, memoryview(buf.numpy()))
            digest.update(memoryview(buf.numpy()))
            if lo < hi:
                src = buf.view(dtype).reshape((pe - ps, *chunk.box.sizes[1:]))
                yield _Copy(lo - r0, hi - r0, src[(slice(lo - ps, hi - ps), *inner)])
        if digest.hexdigest() != chunk.checksums[b]:
            raise CorruptCheckpointError(
                f"checksum mismatch in {chunk_label(item.key, chunk)}, rows "
                f"{bs}..{be}: stored {chunk.checksums[b]}, read {digest.hexdigest()}"
            )


def _destination(planner: LoadPlanner, item: ReadItem) -> torch.Tensor:
    dest = planner.resolve_tensor(item)
    return dest.reshape(1) if not item.box.ndim else dest


def _read_one(planner, item, dtype, files, dest=None) -> None:
    dest = _destination(planner, item) if dest is None else dest
    with torch.no_grad():
        for piece in _pieces(item, dest, dtype, files):
            copy_into(dest[piece.lo : piece.hi], piece.src)


def _band(items: list[ReadItem], dests: list[torch.Tensor]) -> tuple[torch.Tensor, int] | None:
    """The destination rows ``items`` fill side by side along one dim, as one contiguous
    view, and that dim; None when they do not tile such a view exactly."""
    first = items[0].box
    if len(items) < 2 or first.ndim < 2:
        return None
    differ = {d for i in items for d in range(first.ndim) if i.box.offsets[d] != first.offsets[d]}
    if len(differ) != 1 or 0 in differ:
        return None
    (dim,) = differ
    if any(i.box.sizes[d] != first.sizes[d] for i in items for d in range(first.ndim) if d != dim):
        return None
    d0 = dests[0]
    if any(
        d.device.type != "cpu"
        or d.dtype != d0.dtype
        or d.stride() != d0.stride()
        or d.untyped_storage().data_ptr() != d0.untyped_storage().data_ptr()
        or d.storage_offset()
        != d0.storage_offset() + (i.box.offsets[dim] - first.offsets[dim]) * d0.stride(dim)
        for i, d in zip(items, dests)
    ):
        return None
    offsets = [i.box.offsets[dim] for i in items]
    if any(b != a + i.box.sizes[dim] for a, b, i in zip(offsets, offsets[1:], items)):
        return None  # gaps or overlaps along the dim
    sizes = list(first.sizes)
    sizes[dim] = sum(i.box.sizes[dim] for i in items)
    band = d0.as_strided(sizes, d0.stride(), d0.storage_offset())
    return (band, dim) if band.is_contiguous() else None


def _write_band(out: torch.Tensor, dim: int, parts: list[torch.Tensor]) -> None:
    """``torch.cat(parts, dim, out=out)``, written as one single-threaded copy per part
    into its slot (``torch.cat`` with ``out=`` measured far slower on small bands)."""
    start = 0
    for part in parts:
        copy_into(out.narrow(dim, start, part.shape[dim]), part)
        start += part.shape[dim]


def _read_band(planner, items, dtypes, files) -> None:
    """Read chunks that fill the same destination rows side by side, in lockstep."""
    items = sorted(items, key=lambda i: i.box.offsets)
    dests = [_destination(planner, i) for i in items]
    found = _band(items, dests)
    if found is None or any(dtypes[i.key] != d.dtype for i, d in zip(items, dests)):
        for item, dest in zip(items, dests):
            _read_one(planner, item, dtypes[item.key], files, dest)
        return
    band, dim = found
    step = max(1, _BAND_PIECE_BYTES // len(items))
    pieces = [
        _pieces(i, d, d.dtype, files, step, slot=k) for k, (i, d) in enumerate(zip(items, dests))
    ]
    pending = [next(p, None) for p in pieces]
    with torch.no_grad():
        while any(p is not None for p in pending):
            spans = {(p.lo, p.hi) for p in pending if p is not None}
            if len(spans) == 1 and None not in pending:  # aligned: one front-to-back write
                lo, hi = spans.pop()
                _write_band(band[lo:hi], dim, [p.src for p in pending])
                pending = [next(p, None) for p in pieces]
                continue
            first = min(p.lo for p in pending if p is not None)
            for k, p in enumerate(pending):  # misaligned pieces: copy the earliest ones
                if p is not None and p.lo == first:
                    copy_into(dests[k][p.lo : p.hi], p.src)
                    pending[k] = next(pieces[k], None)


def _split(item: ReadItem, dtype: torch.dtype) -> list[ReadItem]:
    """``item`` cut into row ranges of about ``_SPLIT_BYTES`` on its chunk's checksum
    block grid, so reader threads share one large chunk and hash no block twice."""
    box, chunk = item.box, item.chunk
    rb = row_bytes(box.sizes, dtype.itemsize)
    if not box.ndim or rb * box.sizes[0] < 2 * _SPLIT_BYTES:
        return [item]
    block = max(1, chunk.block_rows)
    step = max(1, _SPLIT_BYTES // max(1, rb))
    step = -(-step // block) * block
    start, end, c0 = box.offsets[0], box.offsets[0] + box.sizes[0], chunk.box.offsets[0]
    cuts = [start]
    cut = c0 + ((start - c0) // step + 1) * step
    while cut < end:
        cuts.append(cut)
        cut += step
    cuts.append(end)
    return [
        ReadItem(item.key, Box((a, *box.offsets[1:]), (b - a, *box.sizes[1:])), chunk)
        for a, b in zip(cuts, cuts[1:])
    ]


def read_items(planner, items: list[ReadItem], dtypes: dict, files: LocalFiles, pool):
    """Read every item, a band of side-by-side chunks at a time, on ``pool`` if given
    (a large single chunk in row ranges, so all the pool's threads read it)."""
    bands: dict[tuple, list[ReadItem]] = {}
    for item in sorted(items, key=lambda i: (i.chunk.file, i.chunk.offset)):
        rows = (item.box.offsets[:1], item.box.sizes[:1])
        bands.setdefault((item.key, rows), []).append(item)

    def run(group: list[ReadItem]) -> None:
        if len(group) == 1:
            _read_one(planner, group[0], dtypes[group[0].key], files)
        else:
            _read_band(planner, group, dtypes, files)

    if pool is None:
        for group in bands.values():
            run(group)
        return
    groups: list[list[ReadItem]] = []
    for group in bands.values():
        if (
            len(group) > 1
            and files.usable
            and all(
                _scatter_view(i, _destination(planner, i), dtypes[i.key]) is not None for i in group
            )
        ):  # rows are read straight into place: no band to write, share the chunks out
            groups += [[part] for i in group for part in _split(i, dtypes[i.key])]
        elif len(group) == 1:
            groups += [[part] for part in _split(group[0], dtypes[group[0].key])]
        else:
            groups.append(group)
    for fut in [pool.submit(run, group) for group in groups]:
        fut.result()
