"""Reading saved chunks into place, verifying every checksum block they touch.

Each chunk is read in row pieces. A piece that covers whole rows of a contiguous
destination is read straight into it and hashed while still in the CPU cache. Any other
piece (a reshard) is read into a cache-sized scratch buffer and hashed in one call; when
the destination is on the CPU in the saved dtype, the piece's part is copied into its
strided place by one numpy copy. All three steps run without the GIL, so reader threads
share the cores. A destination on a device, or in another dtype, gets the piece through
``copy_``. No file is ever memory-mapped: a load's memory is its destination plus a few
MiB of scratch per reading thread, whatever the size of the files.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from ...spmd.layout import Box
from ._copy import copy_into, raw_array
from ._errors import CorruptCheckpointError
from ._format import ChunkMeta, num_rows, row_bytes
from ._planner import LoadPlanner, ReadItem
from ._storage import FileSystemReader, StorageReader

__all__ = ["LocalFiles", "chunk_label", "read_items"]

#: Bytes read per call when reading straight into the destination: each piece is hashed
#: while it is still in the CPU cache, instead of streaming the chunk through DRAM twice.
_PIECE_BYTES = 1 << 20
#: Bytes per scratch piece for a destination that ``copy_`` fills (a device, a dtype
#: change): larger pieces amortise the per-piece copy; about one checksum block.
_SCRATCH_PIECE_BYTES = 4 << 20
#: Bytes of one large chunk that one reader thread takes at a time.
_SPLIT_BYTES = 16 << 20
#: Bytes per piece placed into strided rows: read, hashed and copied while in the CPU
#: cache. 2 MiB measured best of 1-4 MiB (docs/performance.md).
_PLACE_PIECE_BYTES = 2 << 20

_scratch = threading.local()


def chunk_label(key: str, chunk: ChunkMeta) -> str:
    return (
        f"key {key!r} chunk offsets={list(chunk.box.offsets)} sizes={list(chunk.box.sizes)} "
        f"in file {chunk.file}"
    )


def _scratch_bytes(nbytes: int) -> torch.Tensor:
    """A small per-thread reusable byte buffer."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < nbytes:
        _scratch.buf = None  # free the old buffer first
        _scratch.buf = buf = torch.empty(max(nbytes, _SCRATCH_PIECE_BYTES), dtype=torch.uint8)
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


def _raw_destination(item: ReadItem, dest: torch.Tensor, dtype: torch.dtype) -> np.ndarray | None:
    """``dest`` as a raw numpy array when it is on the CPU in the saved dtype: each piece's
    overlap then goes into place by one strided numpy copy, whatever the strides; else
    None (a device or a dtype change, which ``copy_`` does)."""
    if not item.box.ndim or dest.device.type != "cpu" or dest.dtype != dtype:
        return None
    return raw_array(dest)


def _place(out: np.ndarray, src: np.ndarray) -> None:
    """Copy a hashed piece's part into its strided destination rows: one numpy copy, on
    this thread, without the GIL."""
    np.copyto(out, src, casting="no")


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
) -> Iterator[_Copy]:
    """Read the chunk rows covering ``item.box``, widened to whole checksum blocks, and
    yield each piece's overlap that was neither read nor copied into place here.

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
    placed = None if direct else _raw_destination(item, dest, dtype)
    if direct:
        step_bytes = _PIECE_BYTES
    else:
        step_bytes = _SCRATCH_PIECE_BYTES if placed is None else _PLACE_PIECE_BYTES
    step = max(1, step_bytes // max(1, rb))
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
            buf = _scratch_bytes((pe - ps) * rb)
            raw = buf.numpy()
            _read(files, item, chunk.offset + ps * rb, memoryview(raw))
            digest.update(raw)
            if lo >= hi:
                continue
            shape, take = (pe - ps, *chunk.box.sizes[1:]), (slice(lo - ps, hi - ps), *inner)
            if placed is not None:
                _place(placed[lo - r0 : hi - r0], raw.view(placed.dtype).reshape(shape)[take])
            else:
                yield _Copy(lo - r0, hi - r0, buf.view(dtype).reshape(shape)[take])
        if digest.hexdigest() != chunk.checksums[b]:
            raise CorruptCheckpointError(
                f"checksum mismatch in {chunk_label(item.key, chunk)}, rows "
                f"{bs}..{be}: stored {chunk.checksums[b]}, read {digest.hexdigest()}"
            )


def _destination(planner: LoadPlanner, item: ReadItem) -> torch.Tensor:
    dest = planner.resolve_tensor(item)
    return dest.reshape(1) if not item.box.ndim else dest


def _read_one(planner, item, dtype, files) -> None:
    dest = _destination(planner, item)
    with torch.no_grad():
        for piece in _pieces(item, dest, dtype, files):
            copy_into(dest[piece.lo : piece.hi], piece.src)


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
    """Read every item, each chunk on its own, on ``pool`` if given (a large chunk in
    row ranges, so all the pool's threads read it)."""
    parts = [
        part
        for item in sorted(items, key=lambda i: (i.chunk.file, i.chunk.offset))
        for part in _split(item, dtypes[item.key])
    ]

    def run(part: ReadItem) -> None:
        _read_one(planner, part, dtypes[part.key], files)

    if pool is None:
        for part in parts:
            run(part)
        return
    for fut in [pool.submit(run, part) for part in parts]:
        fut.result()
