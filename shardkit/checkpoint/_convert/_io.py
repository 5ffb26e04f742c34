"""Building blocks for the format conversions: paths, progress bars, per-key reads from a
shardkit checkpoint, and a streaming single-file safetensors writer / mmap reader."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import torch
from tqdm import tqdm

from .._core._errors import CheckpointError, CorruptCheckpointError
from .._core._format import (
    SAFETENSORS_DTYPES,
    Metadata,
    decode_value,
    is_int,
    safetensors_dtype,
)
from .._core._load import load, load_with_metadata
from .._core._planner import DefaultLoadPlanner
from .._core._storage import FileSystemReader, NotRegularFileError, open_regular
from .._core._validate import MAX_HEADER_BYTES, check_files, check_shape, load_json

__all__ = [
    "check_progress",
    "progress_bar",
    "is_local",
    "require_file",
    "checkpoint_metadata",
    "TensorArena",
    "read_full",
    "read_objects",
    "SafetensorsStreamWriter",
    "read_safetensors",
    "decode_values",
    "VALUES_KEY",
    "safetensors_values",
]

#: The safetensors ``__metadata__`` entry holding the checkpoint's non-tensor values (JSON).
VALUES_KEY = "shardkit.values"
_ST_DTYPES = SAFETENSORS_DTYPES


def check_progress(progress: object) -> None:
    """TypeError unless ``progress`` is a bool."""
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {progress!r}")


def progress_bar(total: int, desc: str, progress: bool) -> tqdm:
    """A tqdm bar on stderr, shown only when asked for and stderr is a terminal."""
    check_progress(progress)
    return tqdm(
        total=total, desc=desc, unit="tensor", disable=not (progress and sys.stderr.isatty())
    )


def is_local(path: str | os.PathLike) -> bool:
    text = os.fspath(path)
    return "://" not in text or text.startswith("file://")


def _local(path: str | os.PathLike) -> str:
    return os.fspath(path).removeprefix("file://")


def require_file(path: str | os.PathLike, what: str) -> None:
    """FileNotFoundError naming ``path`` unless a file is there."""
    if is_local(path):
        exists = os.path.isfile(_local(path))
    else:
        fs, p = fsspec.core.url_to_fs(os.fspath(path))
        exists = fs.isfile(p)
    if not exists:
        raise FileNotFoundError(f"{what} {os.fspath(path)!r} does not exist (or is not a file)")


class _CachedReader(FileSystemReader):
    """A reader that fetches the metadata file once for many per-key loads."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._metadata: bytes | None = None

    def read_metadata(self) -> bytes:
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata


def checkpoint_metadata(checkpoint_id: str | os.PathLike) -> tuple[Metadata, _CachedReader]:
    """The metadata of a committed shardkit checkpoint; FileNotFoundError naming the path."""
    reader = _CachedReader(checkpoint_id)
    try:
        raw = reader.read_metadata()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no committed shardkit checkpoint at {os.fspath(checkpoint_id)!r} (its "
            "metadata.json is missing: wrong path, or the save never committed)"
        ) from None
    metadata = Metadata.from_json(raw, f"{os.fspath(checkpoint_id)}/metadata.json")
    # every declared byte must be backed by a file of the recorded size (and header) before
    # anything is allocated or written from the declared shapes
    check_files(reader, metadata, metadata.file_names(), {})
    return metadata, reader


_ALIGN = 64


def _padded(meta) -> int:
    nbytes = math.prod(meta.shape) * meta.dtype.itemsize
    return -(-nbytes // _ALIGN) * _ALIGN


class _KnownKeysPlanner(DefaultLoadPlanner):
    """Loads a few keys taken from the checkpoint's own metadata.

    The other keys are left out on purpose, so there is nothing to report as missing or
    unexpected, and skipping that check keeps each streaming step independent of the
    checkpoint's size.
    """

    def _check_keys(self) -> None:
        return None


class TensorArena:
    """One reusable byte buffer that successive tensors are carved from.

    Memory stays at one tensor however many pass through, even while something
    still references the previous tensor (``load()`` keeps views of them until
    Python's cyclic garbage collector runs).
    """

    def __init__(self, nbytes: int) -> None:
        self._buf = torch.empty(max(nbytes, 0), dtype=torch.uint8)

    def carve(self, specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor]:
        """Fresh (uninitialized) tensors of these shapes and dtypes, overwriting the last."""
        out, pos = [], 0
        for shape, dtype in specs:
            nbytes = math.prod(shape) * dtype.itemsize
            assert pos + nbytes <= self._buf.numel(), (pos, nbytes, self._buf.numel())
            out.append(self._buf[pos : pos + nbytes].view(dtype).reshape(tuple(shape)))
            pos += -(-nbytes // _ALIGN) * _ALIGN
        return out


def read_full(
    reader: FileSystemReader, metadata: Metadata, keys: Sequence[str], *, reuse: bool
) -> Iterator[dict[str, torch.Tensor]]:
    """Full CPU tensors for ``keys``, one tensor per step (checksums verified by load).

    Each step is a ``{key: tensor}`` dict. With ``reuse``, every tensor lives in the same
    buffer: the caller must be done with one before asking for the next.
    """
    batches = [[key] for key in keys]
    arena = None
    if reuse and batches:
        arena = TensorArena(max(_padded(metadata.tensors[k]) for k in keys))
    for batch in batches:
        specs = [(metadata.tensors[k].shape, metadata.tensors[k].dtype) for k in batch]
        if arena is not None:
            tensors = arena.carve(specs)
        else:
            tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
        out = dict(zip(batch, tensors))
        del tensors
        load_with_metadata(out, reader, metadata, planner=_KnownKeysPlanner(), strict=False)
        yield out
        del out


def read_objects(reader: FileSystemReader, keys: Sequence[str]) -> dict[str, Any]:
    """Values saved with pickle (the caller opted in with allow_pickle)."""
    out: dict[str, Any] = dict.fromkeys(keys)
    if keys:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"load\(strict=False\)")
            load(
                out,
                storage_reader=reader,
                planner=DefaultLoadPlanner(allow_pickle=True),
                strict=False,
                no_dist=True,  # a conversion may run on one rank of a job
            )
    return out


class SafetensorsStreamWriter:
    """Writes one safetensors file tensor by tensor, so only one tensor is in memory.

    The safetensors library writes from a complete dict; the format itself (an 8-byte
    header length, a JSON header of dtypes, shapes and byte ranges, then the bytes) allows
    streaming once every shape is known, which a checkpoint's metadata tells up front.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: dict[str, str],
    ) -> None:
        header: dict[str, Any] = {"__metadata__": dict(metadata)}
        pos = 0
        self._order: list[tuple[str, int]] = []
        for key, dtype, shape in entries:
            if key == "__metadata__":
                raise ValueError("a tensor named '__metadata__' cannot be stored in safetensors")
            nbytes = math.prod(shape) * dtype.itemsize
            header[key] = {
                "dtype": safetensors_dtype(dtype),
                "shape": [int(s) for s in shape],
                "data_offsets": [pos, pos + nbytes],
            }
            self._order.append((key, nbytes))
            pos += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(len(raw) + 8) % 8)
        self._file = fsspec.open(os.fspath(path), "wb").open()
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Append ``key``'s bytes; keys must come in the order given to the constructor."""
        want, nbytes = self._order[self._next]
        assert key == want, (key, want)
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert data.numel() == nbytes, (key, data.numel(), nbytes)
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        """Finish the file; every tensor must have been written."""
        try:
            if self._next != len(self._order):
                raise CheckpointError(
                    f"safetensors file incomplete: {self._next} of {len(self._order)} tensors"
                )
        finally:
            self._file.close()

    def abort(self) -> None:
        """Close the file after a failure, without an error of its own (the caller's error
        is the one to report; the caller removes the partial file)."""
        self._file.close()


def _open_regular(path: str):
    """Open a local file for reading: never blocks on a FIFO, refuses anything but a
    regular file (a FIFO, a device such as /dev/zero, a directory)."""
    try:
        fd = open_regular(path)
    except NotRegularFileError:
        raise CorruptCheckpointError(f"{path} is not a regular file (a FIFO or device?)") from None
    return os.fdopen(fd, "rb")


def _entry(name: str, key: str, info: Any) -> tuple:
    """``(shape, dtype, start, end)`` of one header entry, every field checked."""

    def ints(value: Any) -> bool:
        return isinstance(value, list) and all(is_int(v) and v >= 0 for v in value)

    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{name}: key {key!r}: header entry is not an object")
    dtype = _ST_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
        raise CorruptCheckpointError(
            f"{name}: key {key!r} has unsupported dtype {info.get('dtype')!r:.40}"
        )
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not ints(shape) or not ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CorruptCheckpointError(
            f"{name}: key {key!r}: bad shape {shape!r:.60} or data_offsets {offsets!r:.60}"
        )
    check_shape(shape, f"{name}: key {key!r}")
    return tuple(shape), dtype, offsets[0], offsets[1]


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file, and its ``__metadata__``.

    Local files are memory-mapped read-only and shared, so the tensors cost page cache,
    not heap nor committed memory (a private map is charged in full and fails for a file
    larger than RAM); the tensors must not be written to. Remote files are read whole.
    """
    if is_local(path):
        with _open_regular(_local(path)) as f:
            buf: Any = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                if os.fstat(f.fileno()).st_size
                else b""
            )
    else:
        with fsspec.open(os.fspath(path), "rb") as f:
            buf = bytearray(f.read())
    name = os.fspath(path)
    if len(buf) < 8:
        raise CorruptCheckpointError(f"{name}: too short to be a safetensors file")
    (hlen,) = struct.unpack("<Q", buf[:8])
    if hlen > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(
            f"{name}: header length {hlen} is more than the {MAX_HEADER_BYTES} bytes allowed"
        )
    if 8 + hlen > len(buf):
        raise CorruptCheckpointError(f"{name}: header length {hlen} runs past the end of the file")
    header = load_json(bytes(buf[8 : 8 + hlen]), name, "safetensors header")
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{name}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(
            f"{name}: safetensors __metadata__ is not an object of strings"
        )
    base, tensors, spans = 8 + hlen, {}, []
    for key, info in header.items():
        shape, dtype, start, end = _entry(name, key, info)
        if end - start != math.prod(shape) * dtype.itemsize or base + end > len(buf):
            raise CorruptCheckpointError(
                f"{name}: key {key!r} byte range {start}..{end} is inconsistent"
            )
        spans.append((start, end, key))
        if start == end:
            tensors[key] = torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():  # read-only bytes: torch warns, nothing writes them
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=end - start, offset=base + start)
        if (base + start) % dtype.itemsize:
            raw = raw.clone()  # keep element access aligned
        tensors[key] = raw.view(dtype).reshape(shape)
    spans.sort()
    for (_, a_end, a_key), (b_start, _, b_key) in zip(spans, spans[1:]):
        if b_start < a_end:  # shared bytes would multiply what a conversion writes
            raise CorruptCheckpointError(f"{name}: keys {a_key!r} and {b_key!r} overlap")
    return tensors, meta


def decode_values(stored: Any, name: str) -> dict[str, Any]:
    """The non-tensor values a safetensors file's ``__metadata__["shardkit.values"]`` holds
    (written by ``to_safetensors``); CorruptCheckpointError naming ``name`` if the entry is
    not a JSON string of a key -> value object in docs/checkpoint-format.md's encoding."""
    what = f"__metadata__[{VALUES_KEY!r}]"
    if not isinstance(stored, str):
        raise CorruptCheckpointError(f"{name}: {what} is not a string")
    doc = load_json(stored, name, what)
    try:  # the depth is bounded by load_json, so the recursive decode cannot overflow
        values = decode_value(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"{name}: {what} is not in shardkit's value encoding ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise CorruptCheckpointError(f"{name}: {what} is not an object of key -> value")
    return values


def safetensors_values(meta: dict, tensor_keys: Any, name: str) -> dict[str, Any]:
    """The values of a safetensors file's ``__metadata__`` (``{}`` if it has none), checked
    by :func:`decode_values` and against the file's tensors: a key cannot be both."""
    if VALUES_KEY not in meta:
        return {}
    values = decode_values(meta[VALUES_KEY], name)
    clash = sorted(set(values) & set(tensor_keys))
    if clash:
        raise CorruptCheckpointError(
            f"{name}: keys {clash[:5]} are both tensors and, in __metadata__[{VALUES_KEY!r}], "
            "values"
        )
    return values
