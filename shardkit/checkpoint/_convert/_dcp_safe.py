"""Reading a ``torch.distributed.checkpoint`` directory without running code from it.

torch stores its metadata (``.metadata``) as a pickle and loads it with plain
``pickle.load``; a crafted file runs any code on load. We read it with a restricted
unpickler that can build only torch DCP's metadata classes, torch dtypes, layouts and
``torch.Size``, a ``pathlib`` path and plain Python values; anything else (``os.system``,
``builtins.eval``, ``torch.load`` ...) is refused before it is called. Non-tensor values
inside the data files (torch.save'd bytes) are read with ``torch.load(weights_only=True)``,
not torch's default ``weights_only=False``.

Every data file the metadata names must be a plain file name of a regular file inside the
directory (no symlink, FIFO, device, ``..`` or absolute path), and each tensor's declared
size must be backed by the bytes of those files before anything is allocated. Every field
the import uses must have the type torch writes (string keys, ``TensorProperties`` with a
torch dtype, sizes and offsets of non-negative integers that fit torch's 64-bit sizes), and
each tensor's chunks must tile it exactly (in bounds, no gaps, no overlaps), each non-empty
chunk with an entry in ``storage_data``: else torch would leave part of the tensor
unwritten and the import would store whatever memory held.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import stat
from typing import Any

import torch

from ...spmd.layout import Box
from .._core._errors import CorruptCheckpointError, damage_is_corruption
from .._core._format import is_int
from .._core._storage import NotRegularFileError, open_regular
from .._core._validate import MAX_METADATA_BYTES, check_name, check_shape, check_tiling
from ._torch_file import torch_load

__all__ = ["load_dcp_metadata", "safe_dcp_reader", "safe_dcp_planner"]

_DCP_MODULE = "torch.distributed.checkpoint.metadata"
_DCP_CLASSES = {
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # returns torch.layout objects only
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits only the globals torch DCP metadata needs; see the module docstring."""

    def __init__(self, file, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == _DCP_MODULE and name in _DCP_CLASSES:
            return super().find_class(module, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CorruptCheckpointError(
            f"{self.source}: refers to {module}.{name}, which torch DCP metadata never "
            "holds; refused (a pickle that names it could run code)"
        )


def _open_regular(path: str, what: str) -> int:
    try:
        return open_regular(path, follow_symlinks=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path!r} does not exist") from None
    except NotRegularFileError:
        raise CorruptCheckpointError(f"{path} is not a regular file (a FIFO or device?)") from None
    except OSError as exc:
        if os.path.islink(path):
            raise CorruptCheckpointError(f"{path} is a symbolic link; refused") from None
        raise CorruptCheckpointError(f"{path}: cannot open ({exc.strerror})") from None


def _dims(value: Any, what: str) -> tuple[int, ...]:
    """``value`` (a ``torch.Size``, tuple or list) as a tuple of non-negative ints, else raise."""
    if not isinstance(value, (tuple, list)) or not all(is_int(v) and v >= 0 for v in value):
        raise CorruptCheckpointError(f"{what} {value!r:.80} is not a list of non-negative integers")
    return tuple(value)


def _shape_dtype(source: str, key: str, m: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the tensor entry ``m``, checked: types, and sizes torch can hold."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    what = f"{source}: key {key!r}"
    props = getattr(m, "properties", None)
    if not isinstance(props, TensorProperties):
        raise CorruptCheckpointError(
            f"{what}: properties is a {type(props).__name__}, not torch's TensorProperties"
        )
    dtype = getattr(props, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{what}: dtype {dtype!r:.80} is not a torch dtype")
    shape = _dims(getattr(m, "size", None), f"{what}: size")
    check_shape(shape, what)
    return shape, dtype


def _check_chunks(source: str, key: str, m: Any, shape: tuple[int, ...], storage: dict) -> None:
    """The chunks of tensor entry ``m`` tile its ``shape`` exactly (in bounds, no gaps, no
    overlaps), each non-empty one with an entry in ``storage``; else torch's load would leave
    part of the tensor unwritten."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    what = f"{source}: key {key!r}"
    chunks = getattr(m, "chunks", None)
    if not isinstance(chunks, list):
        raise CorruptCheckpointError(f"{what}: chunks is a {type(chunks).__name__}, not a list")
    ndim, total, boxes = len(shape), 0, []
    for i, c in enumerate(chunks):
        if not isinstance(c, ChunkStorageMetadata):
            raise CorruptCheckpointError(
                f"{what}: chunk {i} is a {type(c).__name__}, not torch's ChunkStorageMetadata"
            )
        offsets = _dims(getattr(c, "offsets", None), f"{what}: chunk {i}: offsets")
        sizes = _dims(getattr(c, "sizes", None), f"{what}: chunk {i}: sizes")
        label = f"{what} chunk offsets={list(offsets)} sizes={list(sizes)}"
        if len(offsets) != ndim or len(sizes) != ndim:
            raise CorruptCheckpointError(
                f"{label}: has {len(offsets)}/{len(sizes)} dims, the tensor {ndim}"
            )
        box = Box(offsets, sizes)
        if any(e > n for e, n in zip(box.ends, shape)):
            raise CorruptCheckpointError(f"{label}: lies outside the tensor's size {list(shape)}")
        if box.is_empty():  # torch reads nothing for it
            continue
        if MetadataIndex(key, offsets) not in storage:
            raise CorruptCheckpointError(
                f"{label}: has no entry in storage_data (no data file holds its bytes)"
            )
        total += box.numel
        boxes.append((box.offsets, box.ends))
    check_tiling(source, key, shape, total, boxes)


def load_dcp_metadata(directory: str) -> Any:
    """torch DCP's ``Metadata`` of ``directory``, unpickled with the restricted unpickler and
    checked: field types, chunks that tile their tensors, plain data file names of regular
    files, sizes backed by their bytes."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    source = os.path.join(directory, ".metadata")
    with os.fdopen(_open_regular(source, "torch DCP metadata file"), "rb") as f:
        raw = f.read(MAX_METADATA_BYTES + 1)
    if len(raw) > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{source}: more than {MAX_METADATA_BYTES} bytes")
    with damage_is_corruption(f"{source}: not a readable torch DCP metadata file"):
        md = _RestrictedUnpickler(io.BytesIO(raw), source).load()
    if not isinstance(md, Metadata) or not isinstance(
        getattr(md, "state_dict_metadata", None), dict
    ):
        raise CorruptCheckpointError(f"{source}: holds a {type(md).__name__}, not DCP Metadata")
    storage = getattr(md, "storage_data", None)
    if storage is None:
        storage = {}
    if not isinstance(storage, dict):
        raise CorruptCheckpointError(
            f"{source}: storage_data is a {type(storage).__name__}, not a dict of data file entries"
        )
    sizes: dict[str, int] = {}
    stored: dict[str, int] = {}
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(index, MetadataIndex) or not isinstance(fqn, str):
            raise CorruptCheckpointError(
                f"{source}: storage_data key {index!r:.80} is not a MetadataIndex naming a key"
            )
        name = getattr(info, "relative_path", None)
        check_name(name, f"{source}: data file of {fqn!r}")
        if name not in sizes:
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{directory}: data file {name} is missing") from None
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(
                    f"{directory}: {name} is not a regular file (a symlink, FIFO or device)"
                )
            sizes[name] = st.st_size
        offset, length = getattr(info, "offset", -1), getattr(info, "length", -1)
        if not (is_int(offset) and is_int(length)) or offset < 0 or length < 0:
            raise CorruptCheckpointError(
                f"{source}: {name} (key {fqn!r}): bad offset {offset!r:.40} / length {length!r:.40}"
            )
        if offset + length > sizes[name]:
            raise CorruptCheckpointError(
                f"{source}: bytes {offset}..{offset + length} run past the end of {name} "
                f"({sizes[name]} bytes)"
            )
        if not getattr(info, "transform_descriptors", None):
            stored[fqn] = stored.get(fqn, 0) + length
    for key, m in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"{source}: key {key!r:.80} is not a string")
        if isinstance(m, BytesStorageMetadata):
            if MetadataIndex(key) not in storage:
                raise CorruptCheckpointError(
                    f"{source}: key {key!r}: a value with no entry in storage_data"
                )
            continue
        if not isinstance(m, TensorStorageMetadata):
            raise CorruptCheckpointError(
                f"{source}: key {key!r}: a {type(m).__name__}, not torch's TensorStorageMetadata "
                "or BytesStorageMetadata"
            )
        shape, dtype = _shape_dtype(source, key, m)
        nbytes = math.prod(shape) * dtype.itemsize
        if key in stored and nbytes > stored[key]:
            raise CorruptCheckpointError(
                f"{source}: key {key!r}: shape {list(shape)} needs {nbytes} bytes but its data "
                f"files hold {stored[key]}"
            )
        if nbytes > sum(sizes.values()):
            raise CorruptCheckpointError(
                f"{source}: key {key!r}: shape {list(shape)} needs {nbytes} bytes, more than "
                f"all data files hold ({sum(sizes.values())})"
            )
        _check_chunks(source, key, m, shape, storage)
    return md


def safe_dcp_reader(directory: str, metadata: Any):
    """torch's FileSystemReader, handing out the already checked ``metadata``."""
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(tdcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _Reader(directory)


def safe_dcp_planner():
    """torch's DefaultLoadPlanner, reading non-tensor values with ``weights_only=True``."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch_load(value, f"torch DCP value {read_item.dest_index.fqn!r}")
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return _Planner(allow_partial_load=True)
