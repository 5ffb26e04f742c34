"""Make an incremental checkpoint self-contained: copy it with its linked chunks inlined."""

from __future__ import annotations

import dataclasses
import os

import xxhash

from .._core._errors import CorruptCheckpointError
from .._core._format import FORMAT_VERSION, METADATA_FILE, Metadata, row_bytes, safetensors_header
from .._core._load import object_bytes, read_metadata
from .._core._storage import FileSystemReader, FileSystemWriter
from .._core._validate import check_files

__all__ = ["materialize"]

_PIECE = 4 << 20


def _copy_parts(reader: FileSystemReader, name: str, size: int):
    for start in range(0, size, _PIECE):
        buf = bytearray(min(_PIECE, size - start))
        reader.read_into(name, start, memoryview(buf))
        yield memoryview(buf)


def _chunk_parts(reader: FileSystemReader, chunk, itemsize: int, label: str):
    """The chunk's bytes, each checksum block verified as it is copied."""
    block = max(1, chunk.block_rows * row_bytes(chunk.box.sizes, itemsize))
    for i, start in enumerate(range(0, chunk.nbytes, block)):
        n = min(block, chunk.nbytes - start)
        digest = xxhash.xxh3_64()
        for p in range(0, n, _PIECE):
            buf = bytearray(min(_PIECE, n - p))
            reader.read_into(chunk.file, chunk.offset + start + p, memoryview(buf))
            digest.update(buf)
            yield memoryview(buf)
        if digest.hexdigest() != chunk.checksums[i]:
            raise CorruptCheckpointError(f"{label}: checksum mismatch in block {i}")


def _verify_objects(reader: FileSystemReader, md: Metadata, src) -> None:
    """Every pickled value's bytes against its checksum (they are copied as they are)."""
    for key in md.objects:
        try:
            object_bytes(reader, key, md)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{src}: {exc}") from None


def materialize(
    src: str | os.PathLike, dst: str | os.PathLike, *, storage_options: dict | None = None
) -> Metadata:
    """Copy checkpoint ``src`` to a new directory ``dst`` that references nothing outside it.

    Every data file, of ``src``'s own directory or linked by an incremental checkpoint
    from a sibling one, is rewritten holding only the chunks it is read for, each
    checksum verified on the way, so copying a damaged checkpoint fails
    (:class:`CorruptCheckpointError`) instead of archiving the damage. The copy is a version 2
    checkpoint that can be moved anywhere; ``dst`` must not hold a checkpoint yet.
    A full checkpoint is copied as it is.

    Returns:
        The metadata of the copy.
    """
    md = read_metadata(src, storage_options=storage_options)
    reader = FileSystemReader(src, storage_options=storage_options)
    check_files(reader, md, md.file_names(), {})
    writer = FileSystemWriter(dst, storage_options=storage_options)
    if METADATA_FILE in writer.list_files():
        raise FileExistsError(f"{os.fspath(dst)!r} already holds a checkpoint; pick a new path")
    data_files = sorted({c.file for t in md.tensors.values() for c in t.chunks})
    _verify_objects(reader, md, src)
    for name, size in md.files.items():
        if name not in data_files:  # an objects file, verified above
            writer.write_file(name, _copy_parts(reader, name, size))
    files = dict(md.files)
    moved: dict[tuple[str, str, tuple], int] = {}

    # every data file, its own or linked, is rebuilt from its chunks, each checksum
    # block verified on the way: a copy of a damaged step must fail, not archive it
    for name in data_files:
        spans = sorted(
            (
                (c.offset, c.nbytes == 0, c.name, key, c)
                for key, t in md.tensors.items()
                for c in t.chunks
                if c.file == name
            ),
            key=lambda s: s[:3],
        )
        entries = [(c.name, md.tensors[k].dtype, c.box.sizes, c.nbytes) for *_, k, c in spans]
        header = safetensors_header(entries)

        def parts(header=header, spans=spans):
            yield memoryview(header)
            for *_, key, c in spans:
                label = f"{src}: key {key!r} chunk offsets={list(c.box.offsets)}"
                yield from _chunk_parts(reader, c, md.tensors[key].dtype.itemsize, label)

        writer.write_file(name, parts())
        pos = len(header)
        for *_, key, c in spans:
            moved[(key, c.file, c.box.offsets)] = pos
            pos += c.nbytes
        files[name] = pos
    tensors = {
        key: dataclasses.replace(
            t,
            chunks=tuple(
                dataclasses.replace(c, offset=moved[(key, c.file, c.box.offsets)]) for c in t.chunks
            ),
        )
        for key, t in md.tensors.items()
    }
    out = Metadata(
        save_id=md.save_id,
        world_size=md.world_size,
        tensors=tensors,
        values=md.values,
        objects=md.objects,
        files=files,
        version=FORMAT_VERSION if md.linked else md.version,
        created=md.created,
    )
    writer.commit(out.to_json())
    return out
