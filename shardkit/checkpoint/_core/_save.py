"""save(): plan, write every rank's files in parallel, agree, commit the metadata last."""

from __future__ import annotations

import datetime
import os
import pickle
import threading
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ... import runtime
from ...spmd.layout import Box
from ._comm import Comm
from ._errors import CheckpointError, ReplicaMismatchWarning
from ._flatten import Flat, flatten
from ._format import (
    METADATA_FILE,
    ChunkMeta,
    Metadata,
    ObjectMeta,
    TensorMeta,
    block_rows_for,
    decode_value,
    dtype_from_name,
    dtype_name,
    encode_value,
    row_bytes,
    safetensors_header,
)
from ._incremental import linked_version, links_from_replies
from ._planner import DefaultSavePlanner, SavePlan, SavePlanner, WriteItem
from ._storage import FileSystemWriter, StorageWriter
from ._torch_args import check_no_dist

__all__ = ["save"]

_OWN_PREFIXES = ("data-", "objects-", f"{METADATA_FILE}.tmp-")
_PIECE_BYTES = 1 << 20
_inflight_lock = threading.Lock()
_inflight: Future | None = None


def set_inflight(future: Future) -> None:
    """Record this process's running async save."""
    global _inflight
    with _inflight_lock:
        _inflight = future


def wait_for_inflight() -> None:
    """Wait for this process's running async save, if any (its errors stay in its Future).

    Saves run one at a time per process: a save's cleanup could otherwise delete the
    files of an async save still writing into the same directory.
    """
    with _inflight_lock:
        previous = _inflight
    if previous is not None and threading.current_thread().name != "shardkit-async-save":
        previous.exception()


@dataclass
class SaveJob:
    """One rank's share of a save after planning: what it writes and where."""

    save_id: str
    rank: int
    world_size: int
    flat: Flat
    planner: SavePlanner
    files: list[tuple[str, list[WriteItem]]] = field(default_factory=list)
    #: an incremental save's base checkpoint (a sibling directory's reader), else None
    base: Any = None
    #: An error to report on every rank at the write agreement instead of writing
    #: (a ReplicaMismatchWarning promoted to an error on this rank).
    error: BaseException | None = None
    #: most tensor bytes per data file (``max_file_bytes`` of the writer), None: no cap
    file_cap: int | None = None

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0


def resolve_writer(checkpoint_id: Any, storage_writer: StorageWriter | None) -> StorageWriter:
    if storage_writer is not None:
        if not isinstance(storage_writer, StorageWriter):
            raise TypeError(
                f"storage_writer {storage_writer!r} does not implement StorageWriter "
                "(thread_count, write_file, commit, list_files, remove_files)"
            )
        return storage_writer
    if checkpoint_id is None:
        raise ValueError("pass checkpoint_id (a path or fsspec URL) or a storage_writer")
    return FileSystemWriter(checkpoint_id)


def bytes_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _refuse_pickle(flat: Flat, planner: SavePlanner) -> None:
    if flat.objects and not planner.allow_pickle:
        key, value = next(iter(flat.objects.items()))
        raise TypeError(
            f"key {key!r}: a {type(value).__name__} is neither a tensor nor a JSON value, so "
            "saving it needs pickle (and loading it would run code). Convert it to tensors/JSON, "
            "or opt in with planner=DefaultSavePlanner(allow_pickle=True)"
        )


def _assign_files(items: list[WriteItem], count: int) -> list[list[WriteItem]]:
    bins: list[list[WriteItem]] = [[] for _ in range(count)]
    load = [0] * count
    # empty items go last, by name: a reader rebuilds each file's header in this order
    for item in sorted(items, key=lambda i: (-i.nbytes, _tensor_name(i))):
        k = min(range(count), key=lambda b: (load[b], b))
        bins[k].append(item)
        load[k] += item.nbytes
    return [b for b in bins if b]


def _cap_items(items: list[WriteItem], cap: int | None) -> list[WriteItem]:
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


def _cap_files(bins: list[list[WriteItem]], cap: int | None) -> list[list[WriteItem]]:
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
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"{writer!r}: max_file_bytes must be a positive int or None, got {cap!r}")
    return cap


_HASH_SPAN = 32 << 20


def replica_digests(flat: Flat) -> dict[str, str]:
    """xxh3-64 of every tensor this rank holds whole (plain tensors: replicated copies).

    Spans of 32 MiB are hashed on up to 8 threads (xxhash releases the GIL; at most
    this rank's share of the host's cores), so on a many-core host the check takes a
    fraction of the time one thread would. Tensors already in contiguous CPU memory are
    hashed in place; any other (a GPU tensor, a strided view) is copied to the host one
    at a time, so the check never holds more than one extra tensor.
    """
    in_place: dict[str, memoryview] = {}
    copied: list[tuple[str, torch.Tensor]] = []
    for key, leaf in flat.tensors.items():
        if tuple(leaf.box.sizes) == tuple(leaf.shape) and not any(leaf.box.offsets):
            t = leaf.local.detach()
            if t.device.type == "cpu" and t.is_contiguous():
                in_place[key] = bytes_view(t) if t.numel() else memoryview(b"")
            else:
                copied.append((key, t))
    if not in_place and not copied:
        return {}
    cores = (os.cpu_count() or 1) // max(1, _env_int("LOCAL_WORLD_SIZE", 1))
    with ThreadPoolExecutor(max(1, min(8, cores)), "shardkit-replica-hash") as pool:
        out = _hash_views(in_place, pool)
        for key, t in copied:
            t = t.to("cpu").contiguous()
            out.update(_hash_views({key: bytes_view(t) if t.numel() else memoryview(b"")}, pool))
    return out


def _hash_views(views: dict[str, memoryview], pool: ThreadPoolExecutor) -> dict[str, str]:
    spans = [
        (k, v[i : i + _HASH_SPAN]) for k, v in views.items() for i in range(0, len(v), _HASH_SPAN)
    ]
    sums = pool.map(lambda span: xxhash.xxh3_64_hexdigest(span[1]), spans)
    out = {key: "" for key in views}
    for (key, _), value in zip(spans, sums):
        out[key] += value
    return out


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def replica_mismatches(digests: list[dict[str, str]]) -> dict[str, list[list[int]]]:
    """Keys whose whole copies differ between ranks -> the ranks grouped by equal copy."""
    groups: dict[str, dict[str, list[int]]] = {}
    for rank, mine in enumerate(digests):
        for key, digest in mine.items():
            groups.setdefault(key, {}).setdefault(digest, []).append(rank)
    return {
        key: sorted(by_digest.values())
        for key, by_digest in sorted(groups.items())
        if len(by_digest) > 1
    }


def _keep_one_copy(plans: list[SavePlan], mismatched: dict[str, list[list[int]]]) -> None:
    """Let only the lowest rank holding a differing replica write it (whole)."""
    for key, by_copy in mismatched.items():
        keeper = min(r for ranks in by_copy for r in ranks)
        for rank, plan in enumerate(plans):
            if rank != keeper:
                plan.items = [
                    i for i in plan.items if not (i.key == key and i.box.sizes == i.shape)
                ]


def _warn_mismatches(mismatched: dict[str, list[list[int]]]) -> BaseException | None:
    """Warn on this rank; a warning the caller's filters turn into an error is returned."""
    if not mismatched:
        return None
    shown = "; ".join(
        f"{key!r}: " + " vs ".join(f"ranks {ranks}" for ranks in by_copy)
        for key, by_copy in list(mismatched.items())[:5]
    )
    more = f" (and {len(mismatched) - 5} more)" if len(mismatched) > 5 else ""
    keepers = sorted({min(r for g in v for r in g) for v in mismatched.values()})
    try:
        warnings.warn(
            f"{len(mismatched)} replicated (plain) tensor(s) differ between ranks: {shown}"
            f"{more}. Saved the copy of rank(s) {keepers} whole. Make the copies equal "
            "(broadcast or all-reduce them), or save per-rank shards as a ShardedTensor/"
            "DTensor with their global offsets",
            ReplicaMismatchWarning,
            stacklevel=4,
        )
    except ReplicaMismatchWarning as exc:
        return exc
    return None


def prepare(
    state_dict: dict,
    planner: SavePlanner,
    comm: Comm,
    thread_count: int,
    file_cap: int | None = None,
    *,
    flat_fn: Callable[[], Flat] | None = None,
) -> SaveJob:
    """Flatten (or call ``flat_fn``), plan locally, exchange plans, plan globally (collective).

    The same exchange carries a checksum of every tensor a rank holds whole, so copies
    of a replicated tensor that differ between ranks are found (and saved from one rank
    only, with a :class:`ReplicaMismatchWarning`) at no extra collective.
    """
    error, payload, flat = None, None, None
    try:
        flat = flat_fn() if flat_fn is not None else flatten(state_dict, for_save=True)
        _refuse_pickle(flat, planner)
        planner.set_up_planner(flat, rank=comm.rank, world_size=comm.world_size)
        payload = {"plan": planner.create_local_plan().to_json()}
        if comm.world_size > 1:
            payload["replicas"] = replica_digests(flat)
        if comm.rank == 0:
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
            payload["save_id"] = f"{stamp}-{uuid.uuid4().hex[:12]}"
    except Exception as exc:
        error = exc
    replies = comm.agree(error, "planning the save", payload)
    plans = [SavePlan.from_json(r["plan"]) for r in replies]
    mismatched = replica_mismatches([r.get("replicas", {}) for r in replies])
    _keep_one_copy(plans, mismatched)
    save_id = replies[0]["save_id"]
    mine = planner.create_global_plan(plans)[comm.rank]
    job = SaveJob(save_id, comm.rank, comm.world_size, flat, planner)
    job.error = _warn_mismatches(mismatched)
    job.file_cap = file_cap
    bins = _assign_files(_cap_items(mine.items, file_cap), thread_count)
    job.files = _name_files(job, _cap_files(bins, file_cap))
    return job


def _name_files(job: SaveJob, bins: list[list[WriteItem]]) -> list[tuple[str, list[WriteItem]]]:
    return [
        (f"data-{job.save_id}-{job.rank:05d}-{k:03d}.safetensors", items)
        for k, items in enumerate(bins)
    ]


def _reuse_base(job: SaveJob, writer: StorageWriter, data: Callable) -> tuple[list, dict]:
    """Incremental save: keep only changed chunks in ``job.files``; records of the rest."""
    from ._incremental import open_base, reuse_chunks

    base = open_base(job.base)
    if base is None:
        return [], {}
    items = [i for _, items in job.files for i in items]
    try:
        to_write, records, linked = reuse_chunks(base, items, data, bytes_view)
    finally:
        base.close()
    job.files = _name_files(
        job, _cap_files(_assign_files(to_write, writer.thread_count), job.file_cap)
    )
    return records, linked


def _tensor_name(item: WriteItem) -> str:
    return f"{item.key}@{','.join(map(str, item.box.offsets))}"


def _write_file(
    writer: StorageWriter, name: str, items: list[WriteItem], data: Callable
) -> tuple[list[dict], int]:
    tensors = [data(item) for item in items]
    header = safetensors_header([(_tensor_name(i), i.dtype, i.box.sizes, i.nbytes) for i in items])
    records, views, pos = [], [], len(header)
    for item, t in zip(items, tensors):
        view = bytes_view(t)
        assert len(view) == item.nbytes, (item, len(view))
        records.append(
            {
                "key": item.key,
                "dtype": dtype_name(item.dtype, item.key),
                "shape": list(item.shape),
                "offsets": list(item.box.offsets),
                "sizes": list(item.box.sizes),
                "file": name,
                "name": _tensor_name(item),
                "offset": pos,
                "nbytes": item.nbytes,
                "block_rows": block_rows_for(item.box.sizes, item.dtype.itemsize),
            }
        )
        views.append(view)
        pos += item.nbytes

    def pieces():
        # each piece is hashed just before it is written, while it is cache-hot
        yield memoryview(header)
        for item, rec, view in zip(items, records, views):
            block = max(1, rec["block_rows"] * row_bytes(item.box.sizes, item.dtype.itemsize))
            sums = []
            for start in range(0, len(view), block):
                digest = xxhash.xxh3_64()
                block_view = view[start : start + block]
                for p in range(0, len(block_view), _PIECE_BYTES):
                    piece = block_view[p : p + _PIECE_BYTES]
                    digest.update(piece)
                    yield piece
                sums.append(digest.hexdigest())
            rec["xxh3_64"] = sums

    writer.write_file(name, pieces())
    if any("xxh3_64" not in rec for rec in records):
        raise CheckpointError(f"{writer!r}.write_file({name!r}) did not consume all its parts")
    return records, pos


def live_data(planner: SavePlanner) -> Callable[[WriteItem], torch.Tensor]:
    """Item -> contiguous CPU tensor read straight from the caller's state."""

    def get(item: WriteItem) -> torch.Tensor:
        return planner.resolve_data(item).detach().to("cpu").contiguous()

    return get


def write_and_commit(job: SaveJob, writer: StorageWriter, comm: Comm, data: Callable) -> Metadata:
    """Write this rank's files, agree that every rank succeeded, commit (collective)."""
    error, payload = None, None
    try:
        if job.error is not None:
            raise job.error
        records, sizes, linked = [], {}, {}
        if job.base is not None:
            records, linked = _reuse_base(job, writer, data)
        with ThreadPoolExecutor(max(1, min(len(job.files), writer.thread_count))) as pool:
            futures = [pool.submit(_write_file, writer, n, i, data) for n, i in job.files]
            for (name, _), fut in zip(job.files, futures):
                recs, size = fut.result()
                records += recs
                sizes[name] = size
        payload = {"chunks": records, "files": sizes, "linked": linked}
        if job.is_coordinator:
            payload["values"] = {k: encode_value(v) for k, v in job.flat.values.items()}
            payload["objects"] = _write_objects(job, writer, sizes)
    except Exception as exc:
        error = exc
    try:
        replies = comm.agree(error, "writing the checkpoint", payload)
    except BaseException:
        # Nothing gets committed: this rank's partial files go now, so a full disk
        # (ENOSPC) is not kept full by them until some later save succeeds.
        _remove_own_files(writer, job)
        raise
    metadata = _build_metadata(job, replies)
    error = None
    if job.is_coordinator:
        try:
            writer.commit(metadata.to_json())
        except Exception as exc:
            error = exc
    comm.agree(error, "committing the checkpoint metadata")
    if job.is_coordinator:
        _remove_superseded(writer, metadata)
    return metadata


def _remove_own_files(writer: StorageWriter, job: SaveJob) -> None:
    names = [name for name, _ in job.files]
    if job.is_coordinator and job.flat is not None and job.flat.objects:
        names.append(f"objects-{job.save_id}.bin")
    try:
        writer.remove_files(names)
    except Exception as exc:  # the save's own error is the one to report
        warnings.warn(f"could not remove the files of the failed save: {exc}", stacklevel=3)


def _write_objects(job: SaveJob, writer: StorageWriter, sizes: dict[str, int]) -> dict:
    if not job.flat.objects:
        return {}
    name, parts, out, pos = f"objects-{job.save_id}.bin", [], {}, 0
    for key, value in job.flat.objects.items():
        blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        out[key] = {"offset": pos, "nbytes": len(blob), "xxh3_64": xxhash.xxh3_64_hexdigest(blob)}
        parts.append(memoryview(blob))
        pos += len(blob)
    writer.write_file(name, parts)
    sizes[name] = pos
    return {k: {"file": name, **v} for k, v in out.items()}


def _build_metadata(job: SaveJob, replies: list[dict]) -> Metadata:
    coord = replies[0]
    md = Metadata(
        save_id=job.save_id,
        world_size=job.world_size,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    chunks: dict[str, list[ChunkMeta]] = {}
    shapes: dict[str, tuple] = {}
    for reply in replies:
        md.files.update(reply["files"])
        for c in reply["chunks"]:
            shapes[c["key"]] = (dtype_from_name(c["dtype"], c["key"]), tuple(c["shape"]))
            chunks.setdefault(c["key"], []).append(
                ChunkMeta(
                    box=_box(c),
                    file=c["file"],
                    name=c["name"],
                    offset=c["offset"],
                    nbytes=c["nbytes"],
                    block_rows=c["block_rows"],
                    checksums=tuple(c["xxh3_64"]),
                )
            )
    for key in sorted(chunks):
        dtype, shape = shapes[key]
        ordered = sorted(chunks[key], key=lambda c: c.box.offsets)
        md.tensors[key] = TensorMeta(dtype, shape, tuple(ordered))
    md.linked = links_from_replies(replies)
    md.version = linked_version(md.linked) or md.version
    md.values = {k: decode_value(v) for k, v in coord.get("values", {}).items()}
    md.objects = {
        k: ObjectMeta(o["file"], o["offset"], o["nbytes"], o["xxh3_64"])
        for k, o in coord.get("objects", {}).items()
    }
    return md


def _box(c: dict) -> Box:
    return Box(tuple(c["offsets"]), tuple(c["sizes"]))


_cleanups: list[threading.Thread] = []


def join_cleanups() -> None:
    """Wait for background deletions of superseded files started by earlier saves."""
    while _cleanups:
        _cleanups.pop().join()


def _remove_superseded(writer: StorageWriter, metadata: Metadata) -> None:
    """Delete the files the new metadata does not name, in the background.

    The list is taken now, right after the commit, so it can only hold files of older
    saves (never of a later save into the same directory); deleting ~1 GiB takes a
    noticeable part of a save on ext4, and nothing needs to wait for it.
    """

    def remove(stale: list[str]) -> None:
        try:
            writer.remove_files(stale)
        except Exception as exc:  # the new checkpoint is committed; leftovers are harmless
            warnings.warn(f"could not remove files of superseded saves: {exc}", stacklevel=2)

    try:
        stale = [
            n
            for n in writer.list_files()
            if n.startswith(_OWN_PREFIXES) and n not in metadata.files
        ]
    except Exception as exc:
        warnings.warn(f"could not list files of superseded saves: {exc}", stacklevel=3)
        return
    if stale:
        thread = threading.Thread(target=remove, args=(stale,), name="shardkit-ckpt-cleanup")
        thread.start()
        _cleanups[:] = [t for t in _cleanups if t.is_alive()] + [thread]


def save(
    state_dict: dict,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: Any = None,
    incremental_base: str | os.PathLike | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Metadata:
    """Save a (sharded) state dict; every rank of ``process_group`` must call it.

    Each rank writes its own safetensors files in parallel; replicated data is written
    once, spread evenly over the ranks. After every rank has succeeded, rank 0 writes the
    JSON metadata as the atomic commit, then deletes files of the checkpoint it replaced.
    An error on any rank makes every rank raise, and nothing is committed.

    Args:
        state_dict: nested dicts/lists of tensors (plain = replicated, ShardedTensor,
            DTensor), Stateful objects and JSON values.
        checkpoint_id: a directory path or fsspec URL.
        storage_writer: a custom StorageWriter instead of ``FileSystemWriter(checkpoint_id)``.
        planner: defaults to :class:`DefaultSavePlanner`.
        process_group: the ranks saving together (default: the world; none needed
            in a single process).
        incremental_base: a committed checkpoint in a sibling directory (same parent).
            Chunks whose bytes equal the base's (same key and box) are not written: the
            new metadata references the base's files, which must then outlive this
            checkpoint (``CheckpointManager(incremental=True)`` reference-counts them).
            Off (None) by default; see docs/checkpoint.md.
        no_dist: save as a world of one with no collectives, even in a process group
            (as torch's; each rank then needs its own ``checkpoint_id``).
        use_collectives: torch's; only True (or a world of one) is supported.

    Returns:
        The committed :class:`Metadata` (the same on every rank).
    """
    writer = resolve_writer(checkpoint_id, storage_writer)
    planner = planner if planner is not None else DefaultSavePlanner()
    if not isinstance(planner, SavePlanner):
        raise TypeError(f"planner must be a SavePlanner, got {type(planner).__name__}")
    wait_for_inflight()
    if not no_dist:
        runtime.init()  # join the world the environment describes (torchrun, SLURM)
    comm = Comm(process_group, local=check_no_dist(no_dist, use_collectives))
    base = base_reader(writer, incremental_base)
    job = prepare(state_dict, planner, comm, writer.thread_count, max_file_bytes(writer))
    job.base = base
    return write_and_commit(job, writer, comm, live_data(planner))


def base_reader(writer: StorageWriter, incremental_base: Any) -> Any:
    """The base's reader (validated as a sibling of ``writer``'s directory), or None."""
    if incremental_base is None:
        return None
    from ._incremental import check_sibling

    return check_sibling(writer, incremental_base)


# exit: an async save in flight finishes (and commits) before the process ends
runtime.drain_at_exit(wait_for_inflight)
runtime.drain_at_exit(join_cleanups)
