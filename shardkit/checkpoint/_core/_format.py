"""The on-disk format: metadata JSON, value encoding, safetensors headers, chunk checksums.

See docs/checkpoint-format.md for the specification this module implements.
"""

from __future__ import annotations

import bisect
import enum
import functools
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...spmd.layout import Box
from ._errors import CorruptCheckpointError

__all__ = ["Metadata", "TensorMeta", "ChunkMeta", "ObjectMeta", "LinkMeta"]

FORMAT_NAME = "shardkit.checkpoint"
FORMAT_VERSION = 2
#: The version of an incremental checkpoint (one whose chunks reference data files of a
#: sibling checkpoint directory, ``linked``); full saves keep writing FORMAT_VERSION.
LINKED_VERSION = 3
#: Versions this shardkit reads: 1 (no metadata checksum), 2 (sealed metadata, checked
#: safetensors headers) and 3 (2 plus references to sibling directories' files).
READ_VERSIONS = (1, 2, 3)
METADATA_FILE = "metadata.json"
#: Target bytes covered by one checksum: a partial read verifies whole blocks only.
BLOCK_BYTES = 4 << 20
_MAX_HEADER = 100 << 20

# torch dtype <-> (metadata name, safetensors name)
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_BY_NAME = {str(d).removeprefix("torch."): d for d in _DTYPES}
#: torch dtype -> safetensors dtype name, and back: the one table every module uses.
SAFETENSORS_NAMES: dict[torch.dtype, str] = _DTYPES
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype, key: str) -> str:
    """The metadata name of a dtype (``"float32"``); refuses dtypes safetensors cannot hold."""
    if dtype not in _DTYPES:
        how = (
            "save torch.view_as_real(t) and load it back with torch.view_as_complex"
            if dtype.is_complex
            else f"save t.view(torch.uint8) and .view({dtype}) it back after loading"
            if dtype.itemsize == 1
            else "convert the tensor to a supported dtype"
        )
        raise TypeError(
            f"key {key!r}: dtype {dtype} cannot be stored in safetensors; supported: "
            f"{sorted(_BY_NAME)}. To save it, {how}"
        )
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, source: str) -> torch.dtype:
    if name not in _BY_NAME:
        raise CorruptCheckpointError(f"{source}: unknown dtype {name!r}")
    return _BY_NAME[name]


def safetensors_dtype(dtype: torch.dtype) -> str:
    return _DTYPES[dtype]


# -- chunk checksums ----------------------------------------------------------------------
def row_bytes(sizes: Sequence[int], itemsize: int) -> int:
    """Bytes of one dim-0 row of a chunk (a 0-d chunk is one row of one element)."""
    return math.prod(sizes[1:]) * itemsize if sizes else itemsize


def num_rows(sizes: Sequence[int]) -> int:
    return int(sizes[0]) if sizes else 1


def block_rows_for(sizes: Sequence[int], itemsize: int) -> int:
    """Rows per checksum block: about BLOCK_BYTES, at least one row."""
    return max(1, BLOCK_BYTES // max(1, row_bytes(sizes, itemsize)))


# -- safetensors header -------------------------------------------------------------------
def safetensors_header(entries: Sequence[tuple[str, torch.dtype, Sequence[int], int]]) -> bytes:
    """The 8-byte length plus JSON header for tensors laid out back to back.

    Args:
        entries: ``(name, dtype, shape, nbytes)`` in file order.
    """
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT_NAME}}
    pos = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": [int(s) for s in shape],
            "data_offsets": [pos, pos + nbytes],
        }
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


# -- JSON values --------------------------------------------------------------------------
_TAG = "__shardkit__"


def is_named_tuple(value: Any) -> bool:
    """A tuple subclass other than ``torch.Size`` (a named tuple): JSON would bring it
    back a plain tuple, so it is a value that needs pickle, not entries to walk."""
    return isinstance(value, tuple) and type(value) not in (tuple, torch.Size)


def is_json_value(value: Any) -> bool:
    """Whether ``value`` round-trips through :func:`encode_value` without pickle.

    An enum member and a tuple subclass other than ``torch.Size`` (a named tuple) are not:
    they would come back a plain int or tuple, and code reading ``.name`` or a field
    breaks. Other subclasses of int, float and str (``numpy.float64``) come back plain.
    """
    if isinstance(value, enum.Enum):
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if is_named_tuple(value):
        return False
    if isinstance(value, (list, tuple)):
        return all(is_json_value(v) for v in value)
    if isinstance(value, dict):
        return all(
            (k is None or isinstance(k, (bool, int, float, str))) and is_json_value(v)
            for k, v in value.items()
        )
    return False


def encode_value(value: Any) -> Any:
    """A strict-JSON form of a JSON-like value; tuples, non-string keys and nan/inf are tagged."""
    if isinstance(value, float) and not math.isfinite(value):
        return {_TAG: "float", "repr": repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Size):
        return {_TAG: "size", "items": [int(v) for v in value]}
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: encode_value(v) for k, v in value.items()}
        return {
            _TAG: "dict",
            "items": [[encode_value(k), encode_value(v)] for k, v in value.items()],
        }
    raise TypeError(f"{type(value).__name__} is not a JSON value")


_NON_FINITE = ("nan", "inf", "-inf")


def decode_value(value: Any) -> Any:
    """Inverse of :func:`encode_value`."""
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if isinstance(value, dict):
        tag = value.get(_TAG)
        if tag == "float":  # only what encode_value writes: a number here is hostile
            if value["repr"] not in _NON_FINITE:
                raise ValueError(f"a tagged float is {value['repr']!r:.40}, not nan or +-inf")
            return float(value["repr"])
        if tag == "tuple":
            return tuple(decode_value(v) for v in value["items"])
        if tag == "size":
            items = value["items"]
            if not all(is_int(v) and 0 <= v < 1 << 63 for v in items):
                raise ValueError(f"a torch.Size holds {items!r:.60}, not sizes")
            return torch.Size(items)
        if tag == "dict":
            return {decode_value(k): decode_value(v) for k, v in value["items"]}
        return {k: decode_value(v) for k, v in value.items()}
    return value


# -- metadata -----------------------------------------------------------------------------
class DottedParents:
    """``prefix in parents``: whether a key starts with ``prefix + "."``.

    A binary search over the sorted keys, not a set of every prefix: one key of m
    dotted parts has m prefixes of up to its whole length, so a set would take memory
    quadratic in the key (a hostile metadata file of 1 MB would ask for hundreds of GB).
    """

    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = sorted(keys)

    def __contains__(self, prefix: object) -> bool:
        if not isinstance(prefix, str):
            return False
        start = prefix + "."
        i = bisect.bisect_left(self._keys, start)
        return i < len(self._keys) and self._keys[i].startswith(start)


@dataclass(frozen=True)
class ChunkMeta:
    """One stored piece of a tensor: its box and where its bytes are."""

    box: Box
    file: str
    name: str
    offset: int
    nbytes: int
    block_rows: int
    checksums: tuple[str, ...]


@dataclass(frozen=True)
class TensorMeta:
    """A saved tensor: global dtype and shape, and the chunks that tile it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...]


@dataclass(frozen=True)
class ObjectMeta:
    """A value stored with pickle (only with an explicit opt-in)."""

    file: str
    offset: int
    nbytes: int
    checksum: str


@dataclass(frozen=True)
class LinkMeta:
    """A data file of a sibling checkpoint directory that an incremental checkpoint reads.

    ``dir`` is the sibling directory's plain name (same parent directory), ``size`` the
    file's size, and the file starts with ``header_nbytes`` bytes of safetensors header
    whose XXH3-64 is ``header_xxh3_64``.
    """

    dir: str
    size: int
    header_nbytes: int
    header_xxh3_64: str


@dataclass
class Metadata:
    """What a committed checkpoint holds; stored as JSON, never pickle.

    Attributes:
        save_id: unique id of the save that wrote it (part of every data file name).
        world_size: number of ranks that saved it.
        tensors: key -> :class:`TensorMeta`.
        values: key -> JSON value, already decoded.
        objects: key -> :class:`ObjectMeta` of values saved with ``allow_pickle=True``.
        files: data file name -> size in bytes (files in this directory).
        linked: data file name -> :class:`LinkMeta` of files in sibling directories that
            chunks of an incremental checkpoint reference (empty for a full checkpoint).
    """

    save_id: str
    world_size: int
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    objects: dict[str, ObjectMeta] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    linked: dict[str, LinkMeta] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    created: str = ""
    #: data file name -> the exact safetensors header bytes it must start with (version 2;
    #: filled by the reader's validation, never written).
    headers: dict[str, bytes] = field(default_factory=dict, repr=False, compare=False)
    #: linked file name -> ``(chunk name, dtype, sizes, offset, nbytes)`` of the chunks read
    #: from it (filled by validation; checked against the file's header before reading).
    link_chunks: dict[str, list] = field(default_factory=dict, repr=False, compare=False)

    def file_names(self) -> set[str]:
        """Every data file a full read needs: this directory's and the linked ones."""
        return {*self.files, *self.linked}

    def shared_bytes(self) -> int:
        """Bytes of tensor chunks read from linked files (0 for a full checkpoint)."""
        return sum(
            c.nbytes for t in self.tensors.values() for c in t.chunks if c.file in self.linked
        )

    def keys(self) -> list[str]:
        """Every saved key: tensors, JSON values and pickled objects."""
        return sorted([*self.tensors, *self.values, *self.objects])

    @functools.cached_property
    def key_parents(self) -> DottedParents:
        """The proper dotted prefixes of the saved keys ("a.b.c" has "a" and "a.b").

        Computed once per metadata: streaming loads reuse it for every step.
        """
        return DottedParents(self.keys())

    def to_json(self) -> bytes:
        """The metadata file's bytes."""
        doc = {
            "format": FORMAT_NAME,
            "version": self.version,
            "save_id": self.save_id,
            "created": self.created,
            "world_size": self.world_size,
            "files": self.files,
            **(
                {
                    "linked": {
                        name: {
                            "dir": link.dir,
                            "size": link.size,
                            "header_nbytes": link.header_nbytes,
                            "header_xxh3_64": link.header_xxh3_64,
                        }
                        for name, link in self.linked.items()
                    }
                }
                if self.linked
                else {}
            ),
            "tensors": {
                key: {
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "chunks": [
                        {
                            "offsets": list(c.box.offsets),
                            "sizes": list(c.box.sizes),
                            "file": c.file,
                            "name": c.name,
                            "offset": c.offset,
                            "nbytes": c.nbytes,
                            "block_rows": c.block_rows,
                            "xxh3_64": list(c.checksums),
                        }
                        for c in t.chunks
                    ],
                }
                for key, t in self.tensors.items()
            },
            "values": {key: encode_value(v) for key, v in self.values.items()},
            "objects": {
                key: {"file": o.file, "offset": o.offset, "nbytes": o.nbytes, "xxh3_64": o.checksum}
                for key, o in self.objects.items()
            },
        }
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        if self.version < 2:
            return body
        from ._validate import seal_metadata

        return seal_metadata(body)

    @classmethod
    def from_json(cls, raw: bytes, source: str = METADATA_FILE) -> Metadata:
        """Parse and validate a metadata file (checksum, bounds, chunk tiling, file names);
        any malformed content is a CorruptCheckpointError naming the file and the key."""
        from ._validate import parse_metadata

        return parse_metadata(raw, source)

    @classmethod
    def from_doc(cls, doc: dict, source: str) -> Metadata:
        """Build from a parsed JSON document whose format and version were checked."""
        where = "the header"
        try:
            tensors = {}
            for key, t in doc["tensors"].items():
                where = f"key {key!r}"
                chunks = tuple(
                    ChunkMeta(
                        box=Box(
                            tuple(_int(o) for o in c["offsets"]), tuple(_int(s) for s in c["sizes"])
                        ),
                        file=_str(c["file"]),
                        name=_str(c["name"]),
                        offset=_int(c["offset"]),
                        nbytes=_int(c["nbytes"]),
                        block_rows=_int(c["block_rows"]),
                        checksums=tuple(_str(h) for h in c["xxh3_64"]),
                    )
                    for c in t["chunks"]
                )
                tensors[key] = TensorMeta(
                    dtype_from_name(t["dtype"], f"{source} key {key!r}"),
                    tuple(_int(s) for s in t["shape"]),
                    chunks,
                )
            objects = {}
            for key, o in doc["objects"].items():
                where = f"object {key!r}"
                objects[key] = ObjectMeta(
                    _str(o["file"]), _int(o["offset"]), _int(o["nbytes"]), _str(o["xxh3_64"])
                )
            where = "values"
            values = {k: decode_value(v) for k, v in doc["values"].items()}
            where = "files"
            files = {_str(k): _int(v) for k, v in doc["files"].items()}
            where = "linked"
            linked = {
                _str(k): LinkMeta(
                    _str(v["dir"]),
                    _int(v["size"]),
                    _int(v["header_nbytes"]),
                    _str(v["header_xxh3_64"]),
                )
                for k, v in doc.get("linked", {}).items()
            }
            where = "the header"
            return cls(
                save_id=_str(doc["save_id"]),
                world_size=_int(doc["world_size"]),
                tensors=tensors,
                values=values,
                objects=objects,
                files=files,
                linked=linked,
                version=doc["version"],
                created=str(doc.get("created", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptCheckpointError(
                f"{source}: malformed metadata at {where} ({type(exc).__name__}: {exc})"
            ) from None


def is_int(value: Any) -> bool:
    """An int and not a bool: JSON and pickles give both, and True is no rank or size."""
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: Any) -> int:
    if not is_int(value):
        raise TypeError(f"expected an integer, got {value!r:.40}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r:.40}")
    return value
