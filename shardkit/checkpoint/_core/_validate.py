"""Checks that make reading a checkpoint from anyone safe: the metadata file's own
checksum and size bound, plain file names, chunks that tile their tensors exactly, byte
ranges inside their files, and safetensors headers that match the metadata.

Everything here runs on the metadata alone (or on file sizes and header bytes), before any
tensor byte is read or any tensor allocated. See docs/checkpoint-format.md, "What a reader
refuses".
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections import defaultdict
from typing import Any

import xxhash

from ._errors import CorruptCheckpointError
from ._format import (
    FORMAT_NAME,
    LINKED_VERSION,
    READ_VERSIONS,
    Metadata,
    num_rows,
    safetensors_dtype,
    safetensors_header,
)
from ._storage import JSONNestingError, parse_json

__all__ = [
    "MAX_METADATA_BYTES",
    "MAX_NESTING",
    "INT64_MAX",
    "check_name",
    "check_shape",
    "load_json",
    "seal_metadata",
    "parse_metadata",
    "validate",
    "check_files",
    "attach_links",
    "where",
]

#: Largest metadata.json accepted (bytes); ``SHARDKIT_MAX_METADATA_BYTES`` overrides it.
#: 64 MiB holds about 250,000 chunks; parsing it takes about 10x its size in memory.
MAX_METADATA_BYTES = int(os.environ.get("SHARDKIT_MAX_METADATA_BYTES", 64 << 20))
#: Deepest JSON nesting accepted anywhere in metadata.json (the values included).
MAX_NESTING = 64
#: Longest safetensors header shardkit reads in a file it did not check (bytes).
MAX_HEADER_BYTES = 100 << 20
#: Largest dim (and product of dims) a stored shape may have: torch's sizes are int64.
INT64_MAX = (1 << 63) - 1

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_SEAL_KEY = b',"metadata_xxh3_64":"'
_SEAL_TAIL = len(_SEAL_KEY) + 16 + 2  # key, 16 hex digits, '"}'


def where(reader: Any) -> str:
    """How messages name a store: its path or URL, never an internal class name."""
    url = getattr(reader, "url", None)
    return str(url) if isinstance(url, str) else repr(reader)


def check_name(name: Any, what: str = "file name") -> str:
    """``name`` if it is a plain file name inside the checkpoint directory, else raise.

    Plain: 1-255 characters of ``A-Z a-z 0-9 _ . -``, not starting with a dot. So no
    ``/``, no ``..``, no absolute path, no URL or protocol, no hidden file.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise CorruptCheckpointError(
            f"{what} {name!r:.80} is not a plain file name inside the checkpoint directory "
            "(no '/', '..', absolute paths or URLs; letters, digits, '_', '.', '-' only)"
        )
    return name


# -- the metadata file ---------------------------------------------------------------------
def seal_metadata(body: bytes) -> bytes:
    """Append the metadata's own checksum as its last JSON member.

    The file stays plain JSON; ``metadata_xxh3_64`` is the XXH3-64 of every byte before
    ``,"metadata_xxh3_64":"``.
    """
    assert body.endswith(b"}") and len(body) > 2, body[-10:]
    prefix = body[:-1]
    return prefix + _SEAL_KEY + xxhash.xxh3_64_hexdigest(prefix).encode() + b'"}'


def _unseal(raw: bytes, source: str) -> bool:
    """Whether ``raw`` carries a checksum; raise if it does and the checksum is wrong."""
    tail = raw[-_SEAL_TAIL:]
    if len(raw) <= _SEAL_TAIL or not (tail.startswith(_SEAL_KEY) and tail.endswith(b'"}')):
        return False
    stored = tail[len(_SEAL_KEY) : -2]
    actual = xxhash.xxh3_64_hexdigest(raw[:-_SEAL_TAIL]).encode()
    if stored != actual:
        raise CorruptCheckpointError(
            f"{source}: checksum mismatch (stored {stored.decode(errors='replace')!r}, "
            f"computed {actual.decode()!r}): the metadata file is damaged"
        )
    return True


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not strict JSON")


def load_json(
    raw: bytes | str,
    source: str,
    what: str = "",
    *,
    max_depth: int = MAX_NESTING,
) -> Any:
    """Parse JSON from a file shardkit did not write (through ``_storage.parse_json``);
    CorruptCheckpointError naming ``source`` (and ``what``, e.g. "safetensors header") on
    any fault.

    Strict JSON (no NaN / Infinity); refused: arrays and objects nested more than
    ``max_depth`` deep (measured before parsing), invalid UTF-8, numbers with more digits than
    Python converts. So callers may walk the result recursively. The caller bounds the size
    of ``raw`` (each file kind has its own limit).
    """
    label = f"{source}: {what}" if what else source
    try:
        return parse_json(raw, max_depth=max_depth, parse_constant=_no_constants)
    except JSONNestingError as exc:
        raise CorruptCheckpointError(f"{label}: {exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, too many digits
        raise CorruptCheckpointError(f"{label}: not valid JSON ({exc})") from None


def check_shape(shape: Any, label: str) -> None:
    """CorruptCheckpointError naming ``label`` unless torch can hold a tensor of ``shape``:
    every dim 0..2**63-1 and the dims (zeros counted as 1, as torch's strides do) multiply
    to at most 2**63-1. A zero-element shape is no exception: torch.empty([10**30, 0])
    overflows too."""
    if any(s < 0 for s in shape):
        raise CorruptCheckpointError(f"{label}: negative shape {list(shape)}")
    if any(s > INT64_MAX for s in shape) or math.prod(max(s, 1) for s in shape) > INT64_MAX:
        raise CorruptCheckpointError(
            f"{label}: shape {list(shape)!s:.200} is larger than torch allows (each dim and "
            "their product at most 2**63-1)"
        )


def parse_metadata(raw: bytes, source: str) -> Metadata:
    """Parse ``metadata.json`` and run :func:`validate`; CorruptCheckpointError on any fault."""
    if len(raw) > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(
            f"{source}: {len(raw)} bytes, more than the {MAX_METADATA_BYTES} a metadata file "
            "may have (SHARDKIT_MAX_METADATA_BYTES raises the limit)"
        )
    sealed = _unseal(raw, source)
    doc = load_json(raw, source)  # so Metadata.from_doc may recurse into the values
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{source}: not a shardkit checkpoint metadata file")
    version = doc.get("version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise CorruptCheckpointError(
            f"{source}: unknown format version {version!r}; this shardkit reads versions "
            f"{list(READ_VERSIONS)}. Upgrade shardkit to load it"
        )
    if version >= 2 and not sealed:
        raise CorruptCheckpointError(
            f"{source}: its checksum (metadata_xxh3_64, the last member) is missing or damaged"
        )
    doc.pop("metadata_xxh3_64", None)
    md = Metadata.from_doc(doc, source)
    validate(md, source)
    return md


# -- structure -----------------------------------------------------------------------------
def _fail(source: str, what: str, why: str) -> None:
    raise CorruptCheckpointError(f"{source}: {what}: {why}")


def _label(key: str, c: Any) -> str:
    return f"key {key!r} chunk offsets={list(c.box.offsets)} sizes={list(c.box.sizes)}"


# Box pairs the overlap sweep may compare per tensor (seconds of work). Real layouts, grids
# of shards along one or two dims, need about chunks x sqrt(chunks): 2 million for 16,384
# chunks of one tensor. Only a crafted layout (staircases) comes near.
MAX_OVERLAP_PAIRS = 5_000_000


def find_overlap(ndim: int, boxes: list, max_pairs: int | None = None) -> tuple | None:
    """The first two of ``boxes`` (``(offsets, ends)``, non-empty) that share an element,
    or None. Sorts ``boxes``; raises OverflowError past ``max_pairs`` comparisons
    (default :data:`MAX_OVERLAP_PAIRS`)."""
    # sweep along the dim the chunks split most: compare only chunks overlapping along it
    d = max(range(ndim), key=lambda i: len({b[0][i] for b in boxes})) if ndim else 0
    boxes.sort(key=lambda b: b[0][d] if ndim else 0)
    active: list = []
    max_pairs = MAX_OVERLAP_PAIRS if max_pairs is None else max_pairs
    budget = max_pairs
    for lo, hi in boxes:
        budget -= len(active)
        if budget < 0:
            raise OverflowError(f"more than {max_pairs} comparisons")
        if ndim:
            active = [b for b in active if b[1][d] > lo[d]]
        for olo, ohi in active:
            if all(max(a, b) < min(c, e) for a, b, c, e in zip(lo, olo, hi, ohi)):
                return (olo, ohi), (lo, hi)
        active.append((lo, hi))
    return None


def _check_overlaps(source: str, key: str, ndim: int, boxes: list) -> None:
    """No two of ``boxes`` (``(offsets, ends)``, non-empty) share an element."""
    try:
        pair = find_overlap(ndim, boxes)
    except OverflowError:
        _fail(
            source,
            f"key {key!r}",
            f"checking its {len(boxes)} chunks for overlaps takes more than "
            f"{MAX_OVERLAP_PAIRS} comparisons (no saved layout does): a crafted or "
            "corrupt metadata file",
        )
    if pair is not None:
        (olo, _), (lo, _) = pair
        _fail(
            source, f"key {key!r}", f"chunks at offsets={list(olo)} and offsets={list(lo)} overlap"
        )


def check_tiling(source: str, key: str, shape: tuple, total: int, boxes: list) -> None:
    """In-bounds chunks of tensor ``key`` tile its ``shape``: they cover ``total`` elements,
    and ``boxes`` (``(offsets, ends)`` of the non-empty ones) do not overlap."""
    # The count first: it is linear, and in-bounds chunks that cover exactly the tensor's
    # element count tile it unless two overlap (then some element is missing).
    numel = math.prod(shape)
    if total != numel:
        _fail(
            source,
            f"key {key!r}",
            f"its chunks cover {total} of its {numel} elements (shape {list(shape)}): "
            + ("a chunk is missing" if total < numel else "chunks overlap"),
        )
    if len(boxes) > 1:
        _check_overlaps(source, key, len(shape), boxes)


def _shown(n: int) -> str:
    """A number from a hostile file, short enough for an error message."""
    return str(n) if abs(n) < 10**30 else f"of {len(str(abs(n)))} digits"


def validate(md: Metadata, source: str) -> None:
    """Check a parsed metadata's structure; fills ``md.headers`` for version 2.

    File names are plain; every chunk tiles its tensor exactly (in bounds, no gaps, no
    overlaps), has ``nbytes`` = its elements x itemsize, ``block_rows`` >= 1, one checksum
    per block, and a byte range inside its file; byte ranges in one file do not overlap.
    Version 2: each data file is exactly its safetensors header (rebuilt here from the
    metadata) followed by its chunks, and each objects file exactly its pickles.
    """
    if md.world_size < 1:
        _fail(source, "world_size", f"{md.world_size} is not a positive rank count")
    for name, size in md.files.items():
        check_name(name, f"{source}: file")
        if not 0 <= size <= INT64_MAX:
            _fail(source, f"file {name}", f"size {_shown(size)} is not a file size (0..2**63-1)")
    _validate_links(md, source)
    files = {**{n: link.size for n, link in md.linked.items()}, **md.files}
    ranges: dict[str, list[tuple[int, int, Any]]] = defaultdict(list)
    for key, t in md.tensors.items():
        shape, ndim = t.shape, len(t.shape)
        check_shape(shape, f"{source}: key {key!r}")
        itemsize = t.dtype.itemsize
        total, boxes = 0, []
        for c in t.chunks:
            offsets, sizes = c.box.offsets, c.box.sizes
            if len(sizes) != ndim:
                _fail(source, _label(key, c), f"has {len(sizes)} dims, the tensor {ndim}")
            ends = tuple(o + n for o, n in zip(offsets, sizes))
            if any(e > n for e, n in zip(ends, shape)):
                _fail(source, _label(key, c), f"lies outside the tensor's shape {list(shape)}")
            numel = math.prod(sizes)
            total += numel
            if numel:
                boxes.append((offsets, ends))
            if c.file not in files:  # names in `files` were checked above
                check_name(c.file, f"{source}: {_label(key, c)}: file")
                _fail(source, _label(key, c), f"file {c.file} is not listed in 'files' or 'linked'")
            if c.offset < 0 or c.nbytes < 0:
                _fail(source, _label(key, c), f"negative offset {c.offset} or nbytes {c.nbytes}")
            if c.nbytes != numel * itemsize:
                _fail(
                    source,
                    _label(key, c),
                    f"nbytes {c.nbytes} but {numel} {t.dtype} elements take {numel * itemsize}",
                )
            if c.offset + c.nbytes > files[c.file]:
                _fail(
                    source,
                    _label(key, c),
                    f"bytes {c.offset}..{c.offset + c.nbytes} run past the end of file "
                    f"{c.file} ({files[c.file]} bytes)",
                )
            if c.block_rows < 1:
                _fail(source, _label(key, c), f"block_rows {c.block_rows} must be >= 1")
            blocks = -(-num_rows(sizes) // c.block_rows) if c.nbytes else 0
            if len(c.checksums) != blocks:
                _fail(source, _label(key, c), f"{len(c.checksums)} checksums for {blocks} blocks")
            if not all(_HEX16.fullmatch(h) for h in c.checksums):
                _fail(source, _label(key, c), "a checksum is not 16 lowercase hex digits")
            ranges[c.file].append((c.offset, c.nbytes, (c.name, t.dtype, sizes, c.nbytes)))
        check_tiling(source, key, shape, total, boxes)
    object_files = set()
    for key, o in md.objects.items():
        check_name(o.file, f"{source}: object {key!r}: file")
        if o.file not in md.files:  # pickles are never shared: only this directory's files
            _fail(source, f"object {key!r}", f"file {o.file} is not listed in 'files'")
        if o.offset < 0 or o.nbytes < 0 or o.offset + o.nbytes > md.files[o.file]:
            _fail(
                source,
                f"object {key!r}",
                f"bytes {o.offset}..{o.offset + o.nbytes} are not inside file {o.file} "
                f"({md.files[o.file]} bytes)",
            )
        if not _HEX16.fullmatch(o.checksum):
            _fail(source, f"object {key!r}", "its checksum is not 16 lowercase hex digits")
        ranges[o.file].append((o.offset, o.nbytes, None))
        object_files.add(o.file)
    headers: dict[str, bytes] = {}
    link_chunks: dict[str, list] = {}
    for name, spans in ranges.items():
        # file order; empty chunks sit at the end of their file, by name (see save)
        spans.sort(key=lambda s: (s[0], s[1] == 0, s[2][0] if s[2] else ""))
        if name in object_files and any(s[2] is not None for s in spans):
            _fail(source, f"file {name}", "holds both tensor chunks and pickled objects")
        for (a, n, _), (b, _, _) in zip(spans, spans[1:]):
            if b < a + n:
                _fail(source, f"file {name}", f"byte ranges at {a} and {b} overlap")
        if name in md.linked:  # only some of its chunks are ours: checked against its header
            link = md.linked[name]
            if spans[0][0] < link.header_nbytes:
                _fail(source, f"linked file {name}", "a chunk starts inside its header")
            link_chunks[name] = [(*s[2][:3], s[0], s[1]) for s in spans]
            continue
        if md.version < 2:
            continue
        start = 0
        if name not in object_files:
            header = safetensors_header([s[2] for s in spans])
            headers[name] = header
            start = len(header)
        pos = start
        for off, n, _ in spans:
            if off != pos:
                _fail(source, f"file {name}", f"bytes {pos}..{off} belong to no chunk")
            pos += n
        if pos != md.files[name]:
            _fail(
                source,
                f"file {name}",
                f"its chunks end at byte {pos} but the file is {md.files[name]} bytes",
            )
    if md.version >= 2:
        for name in md.file_names():
            if name not in ranges:
                _fail(source, f"file {name}", "is listed in 'files' or 'linked' but holds nothing")
    md.headers = headers
    md.link_chunks = link_chunks


def _validate_links(md: Metadata, source: str) -> None:
    """References to files of sibling directories (version 3): plain names only.

    A linked file is ``<parent>/<dir>/<name>`` where ``<parent>`` is the directory holding
    this checkpoint; both ``dir`` and ``name`` must be plain names, so a reference can
    never leave the parent directory (no ``..``, ``/``, absolute path or URL).
    """
    if md.linked and md.version < LINKED_VERSION:
        _fail(source, "linked", f"references need format version {LINKED_VERSION}")
    for name, link in md.linked.items():
        check_name(name, f"{source}: linked file")
        check_name(link.dir, f"{source}: linked file {name}: directory")
        if name in md.files:
            _fail(source, f"linked file {name}", "is also listed in 'files'")
        if link.size > INT64_MAX:
            _fail(source, f"linked file {name}", f"size {_shown(link.size)} is not a file size")
        if not 8 <= link.header_nbytes <= min(link.size, MAX_HEADER_BYTES):
            _fail(
                source,
                f"linked file {name}",
                f"header of {link.header_nbytes} bytes does not fit a {link.size}-byte file",
            )
        if not _HEX16.fullmatch(link.header_xxh3_64):
            _fail(source, f"linked file {name}", "its checksum is not 16 lowercase hex digits")


def _check_linked_header(reader: Any, md: Metadata, name: str, holds: str) -> None:
    """A linked file starts with the header its link recorded, and that header places
    every chunk read from it exactly where the metadata says (name, dtype, shape, range)."""
    link = md.linked[name]
    buf = bytearray(link.header_nbytes)
    try:
        reader.read_into(name, 0, memoryview(buf))
    except (FileNotFoundError, EOFError) as exc:
        raise CorruptCheckpointError(f"{where(reader)}: linked file {name}: {exc}") from None
    if xxhash.xxh3_64_hexdigest(buf) != link.header_xxh3_64:
        raise CorruptCheckpointError(
            f"{where(reader)}: linked file {link.dir}/{name}: its safetensors header does not "
            f"match the checksum recorded for it (damaged or replaced); it holds {holds}"
        )
    (length,) = struct.unpack("<Q", bytes(buf[:8]))
    try:
        if length != link.header_nbytes - 8:
            raise ValueError(f"header length {length}")
        header = parse_json(bytes(buf[8:]), parse_constant=_no_constants)
        for chunk_name, dtype, sizes, offset, nbytes in md.link_chunks.get(name, []):
            start = offset - link.header_nbytes
            entry = header[chunk_name]
            if entry != {
                "dtype": safetensors_dtype(dtype),
                "shape": list(sizes),
                "data_offsets": [start, start + nbytes],
            }:
                raise ValueError(f"entry {chunk_name!r} is {entry!r:.200}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(
            f"{where(reader)}: linked file {link.dir}/{name}: its header does not hold the "
            f"chunks the metadata reads from it ({exc})"
        ) from None


def attach_links(reader: Any, md: Metadata) -> None:
    """Tell ``reader`` where the linked files of ``md`` live (sibling directories)."""
    if not md.linked:
        return
    set_links = getattr(reader, "set_links", None)
    if set_links is None:
        raise CorruptCheckpointError(
            f"{where(reader)} is an incremental checkpoint (it reads files of "
            f"{sorted({link.dir for link in md.linked.values()})}), which "
            f"{type(reader).__name__} cannot resolve; load it with a FileSystemReader, or "
            "make it self-contained first (shardkit ckpt materialize)"
        )
    set_links({name: link.dir for name, link in md.linked.items()})


def check_files(reader: Any, md: Metadata, names: set[str], why: dict[str, str]) -> None:
    """Each file exists as a regular file with its recorded size, and (version 2) starts with
    exactly the safetensors header the metadata implies. No tensor byte is read.

    Linked files (an incremental checkpoint's references) are found in their sibling
    directories, and must start with the header recorded for them."""
    attach_links(reader, md)
    for name in sorted(names):
        link = md.linked.get(name)
        expected = link.size if link is not None else md.files.get(name)
        holds = why.get(name, "data")
        # a linked file lives in a sibling directory (the base of an incremental save)
        place = f"file {name}" if link is None else f"file ../{link.dir}/{name} (shared data)"
        try:
            size = reader.file_size(name)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{where(reader)}: {place} is missing; it holds {holds}"
            ) from None
        if size != expected:
            raise CorruptCheckpointError(
                f"{where(reader)}: {place} is {size} bytes but the metadata says "
                f"{expected} (truncated or replaced); it holds {holds}"
            )
        if link is not None:
            _check_linked_header(reader, md, name, holds)
            continue
        header = md.headers.get(name)
        if header is None:
            continue
        buf = bytearray(len(header))
        try:
            reader.read_into(name, 0, memoryview(buf))
        except (FileNotFoundError, EOFError) as exc:
            raise CorruptCheckpointError(f"{where(reader)}: file {name}: {exc}") from None
        if bytes(buf) != header:
            at = next(i for i, (a, b) in enumerate(zip(buf, header)) if a != b)
            raise CorruptCheckpointError(
                f"{where(reader)}: file {name}: its safetensors header differs from the "
                f"metadata at byte {at} (damaged); it holds {holds}"
            )
