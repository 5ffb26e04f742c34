"""load(): read only the saved bytes that overlap each local box, verifying checksums."""

from __future__ import annotations

import math
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ... import runtime
from ...spmd.layout import Box
from ._comm import Comm
from ._errors import CheckpointError, CorruptCheckpointError
from ._flatten import Flat, flatten
from ._format import METADATA_FILE, Metadata
from ._planner import DefaultLoadPlanner, LoadPlanner, ReadItem, check_flag, fill_dict
from ._read_chunks import LocalFiles, chunk_label, read_items
from ._storage import FileSystemReader, StorageReader, resolve_storage
from ._validate import check_files, where
from ._zero_stall import wait_for_staging

__all__ = ["load", "read_metadata", "is_committed"]

#: The metadata file of a ``torch.distributed.checkpoint`` checkpoint.
TORCH_METADATA_FILE = ".metadata"


def resolve_reader(checkpoint_id: Any, storage_reader: StorageReader | None) -> StorageReader:
    return resolve_storage(checkpoint_id, storage_reader, StorageReader, "storage_reader")


def _metadata(reader: StorageReader) -> Metadata:
    try:
        raw = reader.read_metadata()
    except (FileNotFoundError, NotADirectoryError):
        if _has_torch_metadata(reader):
            raise CheckpointError(
                f"{reader!r} is a torch.distributed.checkpoint checkpoint (it has torch's "
                f".metadata, not shardkit's {METADATA_FILE}); torch's metadata is a pickle, so "
                "import it once, and only if you trust it: "
                "shardkit.checkpoint.format_utils.import_torch_dcp(src, dst), or "
                "`shardkit ckpt convert SRC DST --from torch-dcp --to shardkit`; then load dst"
            ) from None
        raise CheckpointError(
            f"no committed checkpoint at {where(reader)}: {_why_missing(reader)}"
        ) from None
    return Metadata.from_json(raw, f"{where(reader)}/{METADATA_FILE}")


def _why_missing(reader: StorageReader) -> str:
    """Why a directory has no metadata: a file given for a directory, a CheckpointManager
    run directory given for one of its steps (named), or a save never committed."""
    missing = (
        f"{METADATA_FILE} is missing (never saved, or the save was interrupted before its commit)"
    )
    if not (isinstance(reader, FileSystemReader) and reader.local):
        return missing
    root = reader.root
    if os.path.isfile(root):
        return "it is a file; a checkpoint is a directory (the checkpoint_id given to save)"
    try:
        steps = sorted(
            name for name in os.listdir(root)
            if name.startswith("step_") and os.path.isfile(os.path.join(root, name, METADATA_FILE))
        )  # fmt: skip
    except OSError:
        return missing
    if not steps:
        return missing
    return (
        f"it is a CheckpointManager run directory ({len(steps)} committed step(s)); load one "
        f"step, e.g. {os.path.join(root, steps[-1])}, or use CheckpointManager.restore"
    )


def _has_torch_metadata(reader: StorageReader) -> bool:
    """Whether a file-system checkpoint directory holds torch DCP's ``.metadata`` (a hidden
    name, which the reader itself refuses to open, so it is looked up directly)."""
    if not isinstance(reader, FileSystemReader):
        return False
    try:
        if reader.local:
            return os.path.isfile(os.path.join(reader.root, TORCH_METADATA_FILE))
        return bool(reader.fs.isfile(f"{reader.root}/{TORCH_METADATA_FILE}"))
    except Exception:  # noqa: BLE001 - any failure means "not recognisably torch's"
        return False


def read_metadata(
    checkpoint_id: str | os.PathLike, *, storage_options: dict | None = None
) -> Metadata:
    """The metadata of the committed checkpoint at ``checkpoint_id`` (parsed JSON only)."""
    return _metadata(FileSystemReader(checkpoint_id, storage_options=storage_options))


def _check_files(reader: StorageReader, metadata: Metadata, names: set[str], why: dict) -> None:
    check_files(reader, metadata, names, why)


def is_committed(checkpoint_id: str | os.PathLike, *, storage_options: dict | None = None) -> bool:
    """Whether a complete, committed checkpoint is at ``checkpoint_id``.

    True iff its metadata parses and passes every structural check (its own checksum,
    chunk tiling, plain file names, bounds), and every file it names is a regular file with
    the recorded size and safetensors header (data checksums are verified on load, not
    here). A damaged or hostile checkpoint is not committed.
    """
    return why_not_committed(checkpoint_id, storage_options=storage_options) is None


def why_not_committed(
    checkpoint_id: str | os.PathLike, *, storage_options: dict | None = None
) -> str | None:
    """None for a committed checkpoint (see :func:`is_committed`), else why it is not:
    the first check it fails, naming the file (malformed metadata, a missing or cut-short
    data file...)."""
    try:
        committed_metadata(checkpoint_id, storage_options=storage_options)
    except CheckpointError as exc:
        return str(exc)
    return None


def committed_metadata(
    checkpoint_id: str | os.PathLike, *, storage_options: dict | None = None
) -> Metadata:
    """The metadata of the checkpoint at ``checkpoint_id`` once it passed every check of
    :func:`is_committed`; else ``CheckpointError`` naming the first it fails."""
    reader = FileSystemReader(checkpoint_id, storage_options=storage_options)
    metadata = _metadata(reader)
    _check_files(reader, metadata, metadata.file_names(), {})
    return metadata


def _load_object(reader: StorageReader, key: str, metadata: Metadata) -> Any:
    return pickle.loads(object_bytes(reader, key, metadata))


def object_bytes(reader: StorageReader, key: str, metadata: Metadata) -> bytes:
    """The pickled bytes of value ``key``, checked against their checksum."""
    meta = metadata.objects[key]
    buf = bytearray(meta.nbytes)
    try:
        reader.read_into(meta.file, meta.offset, memoryview(buf))
    except (FileNotFoundError, EOFError) as exc:
        raise CorruptCheckpointError(f"cannot read key {key!r} from {meta.file}: {exc}") from None
    if xxhash.xxh3_64_hexdigest(buf) != meta.checksum:
        raise CorruptCheckpointError(f"checksum mismatch for key {key!r} in file {meta.file}")
    return bytes(buf)


def _check_value_slots(flat: Flat, metadata: Metadata, planner: LoadPlanner) -> None:
    """Before anything is read: every non-tensor entry can take what the checkpoint holds
    for it, so a refused load changes nothing of the state dict."""
    for key, slot in flat.slots.items():
        saved = key in metadata.values or key in metadata.objects
        if key in metadata.objects and key not in metadata.values and not planner.allow_pickle:
            raise CheckpointError(
                f"key {key!r} was saved with pickle; loading it would run code from the "
                "checkpoint. Only if you trust it: planner=DefaultLoadPlanner(allow_pickle=True)"
            )
        if not saved and key in metadata.tensors:
            raise TypeError(
                f"key {key!r} is a non-tensor value in the state dict but a tensor in the "
                "checkpoint; put a tensor of the right shape there to load it"
            )
        if saved and isinstance(slot.container, tuple):
            raise TypeError(
                f"key {key!r} sits in a tuple, which cannot be updated in place; use a list"
            )


def _apply_values(reader: StorageReader, flat: Flat, metadata: Metadata) -> None:
    """Set the non-tensor entries (checked by ``_check_value_slots``)."""
    for key, slot in flat.slots.items():
        if key in metadata.values:
            given, saved = flat.values.get(key), metadata.values[key]
            if isinstance(given, dict) and isinstance(saved, dict):
                fill_dict(given, saved)  # entry by entry, as torch's flattened keys
            else:
                slot.container[slot.index] = saved
        elif key in metadata.objects:
            slot.container[slot.index] = _load_object(reader, key, metadata)
        # missing: reported by the planner


def load(
    state_dict: dict,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_reader: StorageReader | None = None,
    planner: LoadPlanner | None = None,
    process_group: Any = None,
    no_dist: bool = False,
    strict: bool | None = None,
) -> None:
    """Load a checkpoint in place into ``state_dict``, resharding to its layout.

    Tensors (plain, ShardedTensor and DTensor local shards) are filled with ``copy_``;
    each rank reads only the saved bytes overlapping its own boxes, and verifies their
    checksums. JSON values are replaced in the caller's containers (a dict entry by
    entry) and Stateful objects get ``load_state_dict``. Any saved layout loads into any
    layout on any world size.

    As torch's ``dcp.load``: every rank of ``process_group`` calls it, and a failure on
    any rank raises on every rank (two small agreements: after checking the state dict
    against the checkpoint, before anything is read; and after reading, before values
    are set and Stateful objects loaded). ``no_dist=True`` loads on this rank alone. The
    keys of ``state_dict`` are what is loaded, keys the checkpoint has beyond them are
    ignored, a key the checkpoint lacks raises unless
    ``planner=DefaultLoadPlanner(allow_partial_load=True)``, a saved dtype is cast to
    the destination's, and a meta tensor is replaced by the loaded one. Stateful objects
    are visited in sorted key order on every rank.

    Args:
        state_dict: the state to fill, allocated by the caller.
        checkpoint_id: a directory path or fsspec URL.
        storage_reader: a custom StorageReader instead of ``FileSystemReader(checkpoint_id)``.
            Given with ``checkpoint_id``, it is pointed there first (its ``reset``), as
            in torch.
        planner: defaults to :class:`DefaultLoadPlanner`.
        process_group: the ranks loading together (default: the world).
        no_dist: load on this rank alone, with no collectives (as torch's).
        strict: None (default) follows the planner. True (shardkit's stricter check):
            raise on missing or unexpected keys. False: skip both with a warning.

    Raises:
        StateDictMismatchError: a key missing from the checkpoint, a shape mismatch.
        CorruptCheckpointError: checksum mismatch, truncated or missing file, unknown version.
        CheckpointError: on the other ranks, naming the rank that failed and its error.
    """
    check_flag("load", "strict", strict, none_ok=True)  # before any I/O or collective
    if not no_dist:
        runtime.init()  # join the world the environment describes (torchrun, SLURM)
    comm = Comm(process_group, local=bool(no_dist))
    reader = resolve_reader(checkpoint_id, storage_reader)
    if comm.world_size == 1:
        load_with_metadata(state_dict, reader, _metadata(reader), planner=planner, strict=strict)
        return
    job, error, save_id = None, None, None
    try:
        metadata = _metadata(reader)
        save_id = metadata.save_id
        job = _plan_load(state_dict, reader, metadata, planner, strict)
    except Exception as exc:
        error = exc
    save_ids = comm.agree(error, "checking the checkpoint against the state dict", save_id)
    if len(set(save_ids)) > 1:  # every rank sees the same list, so all raise alike
        raise ValueError(
            f"the ranks are loading different checkpoints (save ids by rank: {save_ids}); "
            f"this rank read {reader!r}. Every rank must load the same checkpoint, or "
            "pass no_dist=True to load one on a rank alone"
        )
    try:
        _read(job)
    except Exception as exc:
        error = exc
    comm.agree(error, "reading the checkpoint")
    _apply(job)


def load_with_metadata(
    state_dict: dict,
    reader: StorageReader,
    metadata: Metadata,
    *,
    planner: LoadPlanner | None = None,
    strict: bool | None = None,
) -> None:
    """:func:`load` on this rank alone, with the checkpoint's metadata already parsed.

    For callers that load one checkpoint in many small steps (the format conversions
    stream it tensor by tensor), so the metadata is parsed once, not once per step.
    """
    job = _plan_load(state_dict, reader, metadata, planner, strict)
    _read(job)
    _apply(job)


@dataclass
class _LoadJob:
    reader: StorageReader
    metadata: Metadata
    planner: LoadPlanner
    flat: Flat
    items: list[ReadItem]


def _leave_fresh_optimizer_state(flat: Flat, metadata: Metadata) -> None:
    """A parameter that had no optimizer state when the checkpoint was saved (it never
    got a gradient: an unused pooler, an expert no token was routed to) gets none now.

    An optimizer primed before the load (``prime_optimizer``, the manager's resume recipe)
    holds state for every parameter; the checkpoint's lack of one parameter's entries
    then means that parameter's state was fresh, not that the checkpoint is incomplete.
    Applies only where the checkpoint holds that optimizer's state at all."""
    parents = metadata.key_parents
    for key, inner in flat.optimizers.items():
        state = inner.get("state")
        if not isinstance(state, dict) or f"{key}.state" not in parents:
            continue
        for index in [i for i in state if f"{key}.state.{i}" not in parents]:
            del state[index]
            prefix = f"{key}.state.{index}."
            for leaves in (flat.tensors, flat.slots, flat.values, flat.objects):
                for name in [n for n in leaves if n.startswith(prefix)]:
                    del leaves[name]
            flat.absent = {n for n in flat.absent if not n.startswith(prefix)}


def _plan_load(state_dict, reader, metadata, planner, strict) -> _LoadJob:
    """Everything checked before anything is read or changed."""
    planner = planner if planner is not None else DefaultLoadPlanner()
    if not isinstance(planner, LoadPlanner):
        raise TypeError(f"planner must be a LoadPlanner, got {type(planner).__name__}")
    wait_for_staging()  # an async save may still be copying the tensors loaded into
    flat = flatten(state_dict, for_save=False, saved_parents=metadata.key_parents)
    _leave_fresh_optimizer_state(flat, metadata)
    planner.set_up_planner(
        flat, metadata, strict=check_flag("load", "strict", strict, none_ok=True)
    )
    plan = planner.create_local_plan()
    why = {}
    for item in plan.items:
        why.setdefault(item.chunk.file, chunk_label(item.key, item.chunk))
    _check_value_slots(flat, metadata, planner)
    wanted_objects = [k for k in flat.slots if k in metadata.objects]
    for key in wanted_objects:
        why.setdefault(metadata.objects[key].file, f"key {key!r}")
    _check_files(reader, metadata, set(why), why)
    return _LoadJob(reader, metadata, planner, flat, list(plan.items))


def _read(job: _LoadJob) -> None:
    """Read every planned item into place, verifying checksums."""
    reader, planner, flat = job.reader, job.planner, job.flat
    dtypes = {i.key: job.metadata.tensors[i.key].dtype for i in job.items}
    same = [i for i in job.items if flat.tensors[i.key].dtype == dtypes[i.key]]
    cast = [i for i in job.items if flat.tensors[i.key].dtype != dtypes[i.key]]
    files = LocalFiles(reader)
    try:
        if reader.thread_count > 1 and same:  # one large chunk is shared too
            with ThreadPoolExecutor(reader.thread_count) as pool:
                read_items(planner, same, dtypes, files, pool)
        else:
            read_items(planner, same, dtypes, files, None)
        for item in cast:
            _read_cast(planner, item, dtypes[item.key], files)
    finally:
        files.close()


def _apply(job: _LoadJob) -> None:
    """Set the values, swap meta tensors for the loaded ones, load Stateful objects."""
    _apply_values(job.reader, job.flat, job.metadata)
    for slot, tensor in job.flat.materialized:  # meta tensors: now the loaded ones
        slot.container[slot.index] = tensor
    for obj, inner in job.flat.statefuls:  # post-order in sorted keys: one order on every rank
        obj.load_state_dict(inner)


class _Into:
    """A planner stand-in that resolves every item into one scratch tensor."""

    def __init__(self, scratch: torch.Tensor) -> None:
        self.scratch = scratch

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.scratch


#: Most bytes of the saved dtype held at once while casting a piece into place.
_CAST_PIECE_BYTES = 16 << 20


def _cast_pieces(item: ReadItem, saved: torch.dtype) -> list[ReadItem]:
    """``item`` cut into row bands of at most about ``_CAST_PIECE_BYTES`` each."""
    box = item.box
    if box.ndim == 0 or box.sizes[0] == 0:
        return [item]
    row = math.prod(box.sizes[1:]) * saved.itemsize
    step = max(1, _CAST_PIECE_BYTES // max(1, row))
    if step >= box.sizes[0]:
        return [item]
    out = []
    for r in range(0, box.sizes[0], step):
        n = min(step, box.sizes[0] - r)
        sub = Box((box.offsets[0] + r, *box.offsets[1:]), (n, *box.sizes[1:]))
        out.append(ReadItem(item.key, sub, item.chunk))
    return out


def _read_cast(planner, item: ReadItem, saved: torch.dtype, files: LocalFiles) -> None:
    """Read one item into a scratch of the saved dtype, a row band at a time, and cast each
    band into place (as torch's ``copy_``). Peak extra memory: one band (about 16 MiB)."""
    for piece in _cast_pieces(item, saved):
        scratch = torch.empty(piece.box.sizes, dtype=saved)
        read_items(_Into(scratch), [piece], {piece.key: saved}, files, None)
        dest = planner.resolve_tensor(piece)
        with torch.no_grad():
            dest.copy_(scratch.reshape(dest.shape))
