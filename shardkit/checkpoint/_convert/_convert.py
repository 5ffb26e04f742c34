"""Conversions between shardkit checkpoints, ``torch.save`` files, single safetensors
files and checkpoints written by ``torch.distributed.checkpoint``."""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from typing import Any

import fsspec

from .._core._errors import damage_is_corruption
from .._core._format import encode_value, is_json_value
from .._core._save import save
from ._dcp_safe import load_dcp_metadata, safe_dcp_planner, safe_dcp_reader
from ._io import (
    VALUES_KEY,
    SafetensorsStreamWriter,
    TensorArena,
    check_progress,
    checkpoint_metadata,
    is_local,
    progress_bar,
    read_full,
    read_objects,
    read_safetensors,
    require_file,
    safetensors_values,
)
from ._legacy import check_legacy
from ._torch_file import TorchFile, check_views, records, torch_load
from ._torch_write import write_torch_file

__all__ = [
    "dcp_to_torch_save",
    "torch_save_to_dcp",
    "to_safetensors",
    "from_safetensors",
    "import_torch_dcp",
]


def dcp_to_torch_save(
    dcp_checkpoint_dir: str | os.PathLike,
    torch_save_path: str | os.PathLike,
    *,
    allow_pickle: bool = False,
    progress: bool = True,
) -> None:
    """Write a shardkit checkpoint as one ``torch.save`` file of full tensors.

    Keys are the checkpoint's flat dotted keys. Tensors are read one at a time into
    the output dict (``torch.save`` needs the whole dict, so the output is the memory
    bound). Values saved with pickle are refused unless ``allow_pickle``.

    Args:
        dcp_checkpoint_dir: the shardkit checkpoint (path or fsspec URL).
        torch_save_path: the file to write (path or fsspec URL).
        allow_pickle: load pickled values too (only for checkpoints you trust).
        progress: show a progress bar (only on a terminal).
    """
    check_progress(progress)
    metadata, reader = checkpoint_metadata(dcp_checkpoint_dir)
    _refuse_objects(metadata, allow_pickle, "dcp_to_torch_save")
    out: dict[str, Any] = {}
    with progress_bar(len(metadata.keys()), "dcp_to_torch_save", progress) as bar:
        for batch in read_full(reader, metadata, list(metadata.tensors), reuse=False):
            out.update(batch)
            bar.update(len(batch))
        out.update(metadata.values)
        out.update(read_objects(reader, list(metadata.objects)))
        bar.update(len(metadata.values) + len(metadata.objects))
    # a full disk raises OSError naming the file (torch's own writer would turn it into
    # an "unexpected pos" RuntimeError), and a local file is never left half-written
    write_torch_file({k: out[k] for k in metadata.keys()}, torch_save_path)


def _refuse_objects(metadata, allow_pickle: bool | None, what: str) -> None:
    """``allow_pickle=None``: the target format cannot hold pickled values at all."""
    if not metadata.objects or allow_pickle:
        return
    keys = sorted(metadata.objects)
    if allow_pickle is None:
        raise ValueError(
            f"{what}: keys {keys} were saved with pickle and a safetensors file cannot hold "
            "them; use dcp_to_torch_save(..., allow_pickle=True) for a trusted checkpoint"
        )
    raise ValueError(
        f"{what}: keys {keys} were saved with pickle; loading them runs code from the "
        "checkpoint. Pass allow_pickle=True only if you trust it"
    )


def torch_save_to_dcp(
    torch_save_path: str | os.PathLike,
    dcp_checkpoint_dir: str | os.PathLike,
    *,
    progress: bool = True,
) -> None:
    """Write a ``torch.save`` file of a (nested) dict as a shardkit checkpoint.

    The file is read with ``weights_only=True`` (no arbitrary unpickling) and, for the
    zip format, mapped read-only and shared, so tensors cost page cache rather than a copy
    or committed memory. Nested dicts
    become dotted keys, exactly as :func:`shardkit.checkpoint.save` flattens them.
    """
    check_progress(progress)
    require_file(torch_save_path, "torch.save file")
    with progress_bar(2, "torch_save_to_dcp", progress) as bar:
        state = _torch_load(torch_save_path)
        if not isinstance(state, dict):
            raise TypeError(
                f"{os.fspath(torch_save_path)!r} holds a {type(state).__name__}; only a dict "
                "(a state dict) can become a checkpoint"
            )
        bar.update(1)
        save(state, checkpoint_id=dcp_checkpoint_dir)
        bar.update(1)


def _torch_load(path: str | os.PathLike) -> Any:
    """The file's state; a local zip-format file's tensors are views of a read-only shared
    map (page cache, never a private map charged against committed memory)."""
    name = os.fspath(path)
    if not is_local(path):
        fs, remote = fsspec.core.url_to_fs(name)
        with fs.open(remote, "rb") as f:
            return _load_whole(f, name, fs.size(remote))
    local = name.removeprefix("file://")
    with open(local, "rb") as f:
        if f.read(4) != b"PK\x03\x04":  # pre-zip torch.save format: read it whole
            return _load_whole(f, local, os.fstat(f.fileno()).st_size)
    with TorchFile(local) as f:
        return f.materialize(f.obj, mapped=True)


def _load_whole(f: Any, name: str, size: int) -> Any:
    """``torch.load`` of an open file, once what it would allocate is checked against the
    file's ``size``: zip records inside the file, a legacy file's declared storages
    followed by their bytes; views checked before ``save`` writes them."""
    f.seek(0)
    if f.read(4) == b"PK\x03\x04":
        records(f, name, size)
    else:
        f.seek(0)
        check_legacy(f, name, size)
    f.seek(0)
    state = torch_load(f, name, map_location="cpu")
    check_views(state, name, size)
    return state


def to_safetensors(
    checkpoint_id: str | os.PathLike,
    path: str | os.PathLike,
    *,
    progress: bool = True,
) -> None:
    """Write a shardkit checkpoint as one safetensors file of full tensors.

    Streams: tensors are read one at a time into one reused buffer, so memory stays at
    the largest tensor.
    Non-tensor values go into the header's ``__metadata__`` under ``"shardkit.values"``
    as a JSON object (the checkpoint format's JSON encoding). Pickled values cannot be
    stored and raise ``ValueError`` naming them.
    """
    check_progress(progress)
    metadata, reader = checkpoint_metadata(checkpoint_id)
    _refuse_objects(metadata, None, "to_safetensors")
    keys = list(metadata.tensors)
    entries = [(k, metadata.tensors[k].dtype, metadata.tensors[k].shape) for k in keys]
    header = {"format": "pt", VALUES_KEY: json.dumps(encode_value(dict(metadata.values)))}
    writer = SafetensorsStreamWriter(path, entries, header)
    try:
        with progress_bar(len(keys), "to_safetensors", progress) as bar:
            for batch in read_full(reader, metadata, keys, reuse=True):
                for key, tensor in batch.items():
                    writer.write(key, tensor)
                bar.update(len(batch))
                del batch  # its buffer is reused for the next batch
    except BaseException:
        writer.abort()  # report the real cause (a checksum error...), not "incomplete"
        raise
    writer.close()


def from_safetensors(
    path: str | os.PathLike,
    checkpoint_id: str | os.PathLike,
    *,
    progress: bool = True,
) -> None:
    """Write a safetensors file (ours or anyone's) as a shardkit checkpoint.

    Local files are memory-mapped, so no tensor is copied into memory before it is saved.
    Values stored by :func:`to_safetensors` in ``__metadata__`` come back as JSON values;
    other ``__metadata__`` entries are ignored.
    """
    check_progress(progress)
    require_file(path, "safetensors file")
    with progress_bar(2, "from_safetensors", progress) as bar:
        state: dict[str, Any] = {}
        tensors, meta = read_safetensors(path)
        state.update(tensors)
        state.update(safetensors_values(meta, tensors, os.fspath(path)))
        bar.update(1)
        save(state, checkpoint_id=checkpoint_id)
        bar.update(1)


def import_torch_dcp(
    torch_dcp_dir: str | os.PathLike,
    checkpoint_id: str | os.PathLike,
    *,
    progress: bool = True,
) -> None:
    """Convert a checkpoint written by ``torch.distributed.checkpoint`` to a shardkit one.

    torch's metadata file is a pickle: it is read with a restricted unpickler that builds
    only DCP's metadata classes and plain values, so no code from the file runs (anything
    else raises CorruptCheckpointError); non-tensor values are read with
    ``torch.load(weights_only=True)``. Tensors are read full, one at a time,
    with torch's own ``FileSystemReader`` (local directories only) and streamed into a
    temporary local safetensors file, which is then saved from its memory map; keys stay
    torch's (nested dicts as dotted keys). Non-tensor
    values must be JSON values (numbers, strings, lists, dicts), else ``TypeError`` names
    the key.
    """
    check_progress(progress)
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source = os.fspath(torch_dcp_dir)
    if not is_local(source):
        raise ValueError(
            f"import_torch_dcp reads local directories only, got {source!r}; copy the torch "
            "checkpoint to a local directory first (the shardkit output may be any URL)"
        )
    source = source.removeprefix("file://")
    if os.path.isfile(source):  # a torch.save file is not damage: say what it is
        raise ValueError(
            f"{source!r} is a file; import_torch_dcp reads a torch.distributed.checkpoint "
            "directory. For a torch.save file use "
            "shardkit.checkpoint.format_utils.torch_save_to_dcp(src, dst)"
        )
    md = load_dcp_metadata(source)  # restricted unpickler: no code from the file runs
    reader = safe_dcp_reader(source, md)
    tensor_keys = [
        k for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)
    ]
    other_keys = [k for k in md.state_dict_metadata if k not in set(tensor_keys)]

    def read(state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        keys = ", ".join(map(repr, list(state)[:3]))
        # the metadata is checked, so a failure here means damaged data files
        with damage_is_corruption(f"{source}: reading {keys} failed"):
            try:
                with warnings.catch_warnings():  # no_dist is ours: each rank reads it all
                    warnings.filterwarnings("ignore", "torch.distributed is disabled")
                    tdcp.load(
                        state, storage_reader=reader, planner=safe_dcp_planner(), no_dist=True
                    )
            except CheckpointException as exc:  # a BaseException: unwrap the rank's own error
                for inner, _ in exc.failures.values():
                    raise inner from None
                raise

    values: dict[str, Any] = {}
    if other_keys:
        read(values := dict.fromkeys(other_keys))
        for key, value in values.items():
            if not is_json_value(value):
                raise TypeError(
                    f"{os.fspath(torch_dcp_dir)!r} key {key!r} holds a {type(value).__name__}, "
                    "which a shardkit checkpoint stores only as JSON; convert it first"
                )
    with tempfile.TemporaryDirectory(prefix="shardkit-import-") as tmp:
        staged = os.path.join(tmp, "tensors.safetensors")
        entries = [
            (k, md.state_dict_metadata[k].properties.dtype, tuple(md.state_dict_metadata[k].size))
            for k in tensor_keys
        ]
        header = {"format": "pt", VALUES_KEY: json.dumps(encode_value(values))}
        writer = SafetensorsStreamWriter(staged, entries, header)
        largest = max((math.prod(shape) * dtype.itemsize for _, dtype, shape in entries), default=0)
        arena = TensorArena(largest)  # one tensor's memory, whatever torch's load retains
        try:
            with progress_bar(len(tensor_keys), "import_torch_dcp", progress) as bar:
                for key, dtype, shape in entries:
                    one = dict(zip([key], arena.carve([(shape, dtype)])))
                    read(one)
                    writer.write(key, one[key])
                    del one
                    bar.update(1)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        from_safetensors(staged, checkpoint_id, progress=False)
