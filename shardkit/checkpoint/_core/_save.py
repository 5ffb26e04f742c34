"""save(): plan, write every rank's files in parallel, agree, commit the metadata last."""

from __future__ import annotations

import datetime
import os
import pickle
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ... import runtime
from ._comm import Comm
from ._errors import CheckpointError
from ._file_plan import assign_files as _assign_files
from ._file_plan import cap_files as _cap_files
from ._file_plan import cap_items as _cap_items
from ._file_plan import max_file_bytes
from ._file_plan import tensor_name as _tensor_name
from ._flatten import Flat, flatten
from ._format import (
    METADATA_FILE,
    Metadata,
    block_rows_for,
    dtype_name,
    encode_value,
    row_bytes,
    safetensors_header,
)
from ._fs_rules import refuse_per_process
from ._planner import DefaultSavePlanner, SavePlan, SavePlanner, WriteItem, first_items
from ._replicas import (
    ReplicaPlan,
    Shadows,
    check_verify_replicas,
    holder_box,
    keep_one_copy,
    mismatches_after_write,
    plan_replicas,
    replica_digests,
    replica_mismatches,
    value_digests,
    warn_mismatches,
    warn_value_mismatches,
)
from ._save_metadata import build_metadata, entries
from ._storage import FileSystemWriter, StorageWriter, resolve_storage
from ._superseded import join_cleanups, remove_superseded
from ._torch_args import check_no_dist

__all__ = ["save"]

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
    #: data files written in parallel (the writer's ``thread_count``)
    thread_count: int = 1
    #: this rank's items, cut by ``file_cap`` (before an incremental save drops any)
    items: list[WriteItem] = field(default_factory=list)
    #: the after-write replica check (``save``); None: none
    replicas: ReplicaPlan | None = None
    #: called once the data is written, before the write agreement: raises to fail the
    #: save on every rank (a zero-stall save's last check of its sources)
    before_commit: Callable[[], None] | None = None
    #: ``time.time()`` when planning began (see ``_superseded.remove_superseded``)
    started: float = field(default_factory=time.time)
    #: the checkpoint directory did not exist when the save was planned: a failed save
    #: removes it again (once empty), leaving nothing behind
    new_dir: bool = False
    #: this rank holds plain values under keys rank 0 lacks (or under fewer keys): it
    #: sends them with the write agreement, so they are saved as torch saves them
    other_values: bool = False
    #: keys of pickled values this rank writes: those no lower rank holds (the lowest
    #: rank holding a value wins, as for plain values)
    object_keys: list[str] = field(default_factory=list)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0


def resolve_writer(checkpoint_id: Any, storage_writer: StorageWriter | None) -> StorageWriter:
    return resolve_storage(checkpoint_id, storage_writer, StorageWriter, "storage_writer")


def bytes_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _refuse_pickle(flat: Flat, planner: SavePlanner) -> None:
    if flat.objects and not planner.allow_pickle:
        key, value = next(iter(flat.objects.items()))
        raise TypeError(
            f"key {key!r}: a {type(value).__name__} is neither a tensor nor a JSON value, so "
            "saving it needs pickle (and loading it would run code). Convert it to tensors/JSON "
            "(or make it a Stateful: state_dict() / load_state_dict()), or opt in with "
            "shardkit.checkpoint.save(..., planner=DefaultSavePlanner(allow_pickle=True)); "
            "CheckpointManager never pickles"
        )


def prepare(
    state_dict: dict,
    planner: SavePlanner,
    comm: Comm,
    thread_count: int,
    file_cap: int | None = None,
    *,
    flat_fn: Callable[[], Flat] | None = None,
    replicas: str = "after",
    writer: StorageWriter | None = None,
) -> SaveJob:
    """Flatten (or call ``flat_fn``), plan locally, exchange plans, plan globally (collective).

    ``replicas`` is when copies of replicated boxes are compared between ranks (see
    ``_replicas``): ``"after"`` the write (``save``), ``"before"`` it, with checksums of
    the plain tensors in this exchange (``async_save``), or ``"off"``. ``writer``, when
    given, lets rank 0 tell every rank whether the save creates its directory.
    """
    assert replicas in ("after", "before", "off"), replicas
    started = time.time()
    error, payload, flat = None, None, None
    try:
        flat = flat_fn() if flat_fn is not None else flatten(state_dict, for_save=True)
        _refuse_pickle(flat, planner)
        planner.set_up_planner(flat, rank=comm.rank, world_size=comm.world_size)
        payload = {"plan": planner.create_local_plan().to_json()}
        payload["value_keys"] = xxhash.xxh3_64_hexdigest(
            repr(sorted(entries(flat.values))).encode()
        )
        payload["object_keys"] = sorted(flat.objects)
        if comm.world_size > 1 and replicas != "off":
            payload["value_digests"] = value_digests(flat.values)
        if comm.world_size > 1 and replicas == "before":
            payload["replicas"] = replica_digests(flat)
        if comm.rank == 0:
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
            payload["save_id"] = f"{stamp}-{uuid.uuid4().hex[:12]}"
            if isinstance(writer, FileSystemWriter):
                payload["new_dir"] = not writer.directory_exists()
    except Exception as exc:
        error = exc
    replies = comm.agree(error, "planning the save", payload)
    plans = [SavePlan.from_json(r["plan"]) for r in replies]
    first_items(plans)  # shapes / dtypes that differ per rank: before copies are dropped
    mismatched = replica_mismatches([r.get("replicas", {}) for r in replies])
    keep_one_copy(plans, mismatched)
    save_id = replies[0]["save_id"]
    global_plans = planner.create_global_plan(plans)
    job = SaveJob(save_id, comm.rank, comm.world_size, flat, planner, started=started)
    job.new_dir = bool(replies[0].get("new_dir"))
    job.other_values = replies[comm.rank]["value_keys"] != replies[0]["value_keys"]
    if flat is not None:
        lower = {k for r in replies[: comm.rank] for k in r["object_keys"]}
        job.object_keys = [k for k in flat.objects if k not in lower]
    keepers = {k: {min(r for g in v for r in g)} for k, v in mismatched.items()}
    job.error = warn_mismatches(mismatched, keepers)
    if "value_digests" in replies[0]:
        job.error = warn_value_mismatches([r["value_digests"] for r in replies]) or job.error
    job.file_cap = file_cap
    job.thread_count = thread_count
    job.items = _cap_items(global_plans[comm.rank].items, file_cap)
    if comm.world_size > 1 and replicas == "after":
        job.replicas = plan_replicas(
            plans, global_plans, comm.rank, lambda items: _cap_items(items, file_cap)
        )
    job.files = _name_files(job, _cap_files(_assign_files(job.items, thread_count), file_cap))
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


def _write_file(
    writer: StorageWriter,
    name: str,
    items: list[WriteItem],
    data: Callable,
    handed_over: Callable[[], None] | None = None,
) -> tuple[list[dict], int]:
    """Write one data file; ``handed_over`` is called once the writer has all its bytes
    (it then syncs or uploads them)."""
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
        if handed_over is not None:
            handed_over()

    writer.write_file(name, pieces())
    if any("xxh3_64" not in rec for rec in records):
        raise CheckpointError(f"{writer!r}.write_file({name!r}) did not consume all its parts")
    return records, pos


def live_data(planner: SavePlanner) -> Callable[[WriteItem], torch.Tensor]:
    """Item -> contiguous CPU tensor read straight from the caller's state."""

    def get(item: WriteItem) -> torch.Tensor:
        return planner.resolve_data(item).detach().to("cpu").contiguous()

    return get


def _write_data(
    job: SaveJob, writer: StorageWriter, data: Callable, handed_over: Callable | None = None
) -> tuple[list, dict, dict]:
    """Write this rank's data files: (chunk records, file sizes, linked files)."""
    records, sizes, linked = [], {}, {}
    if job.base is not None:
        records, linked = _reuse_base(job, writer, data)
    with ThreadPoolExecutor(max(1, min(len(job.files), writer.thread_count))) as pool:
        futures = [pool.submit(_write_file, writer, n, i, data, handed_over) for n, i in job.files]
        for (name, _), fut in zip(job.files, futures):
            recs, size = fut.result()
            records += recs
            sizes[name] = size
    return records, sizes, linked


def write_and_commit(job: SaveJob, writer: StorageWriter, comm: Comm, data: Callable) -> Metadata:
    """Write this rank's files, agree that every rank succeeded, commit (collective).

    With the after-write replica check, this rank's copies of the pieces other ranks
    write are hashed on another thread while it writes (or while its writer syncs, see
    ``Shadows``); the digests go with the write agreement, to be compared with the
    writers' block checksums.
    """
    error, payload, shadows = None, None, None
    try:
        if job.error is not None:
            raise job.error
        if job.replicas is not None and job.replicas.shadows:
            shadows = Shadows(job.replicas.shadows, data)
        start = shadows.start if shadows is not None else None
        records, sizes, linked = _write_data(job, writer, data, start)
        payload = {"chunks": records, "files": sizes, "linked": linked}
        if shadows is not None:
            payload["replicas"] = shadows.result()
        if job.is_coordinator or job.other_values:
            payload["values"] = {k: encode_value(v) for k, v in job.flat.values.items()}
        payload["objects"] = _write_objects(job, writer, sizes)
        if job.before_commit is not None:
            job.before_commit()
    except Exception as exc:
        error = exc
        if shadows is not None:
            shadows.cancel()
    try:
        replies = comm.agree(error, "writing the checkpoint", payload)
        if job.replicas is not None:
            replies = _settle_replicas(job, writer, comm, data, replies)
    except BaseException:
        # Nothing gets committed: this rank's partial files go now, so a full disk
        # (ENOSPC) is not kept full by them until some later save succeeds.
        _discard(writer, job)
        raise
    metadata = build_metadata(job.save_id, job.world_size, replies)
    error = None
    if job.is_coordinator:
        encoded = metadata.to_json()
        try:
            _refuse_unseen_files(writer, replies)
            writer.commit(encoded)
        except Exception as exc:
            error = exc
            _discard_uncommitted(writer, job, replies, encoded)
    try:
        comm.agree(error, "committing the checkpoint metadata")
    except BaseException:
        if not job.is_coordinator:  # rank 0 removed what it sees; files it cannot see
            _discard_unseen(writer, job)
        raise
    if job.is_coordinator:
        remove_superseded(writer, metadata, job.started)
    return metadata


def _refuse_unseen_files(writer: StorageWriter, replies: list[dict]) -> None:
    """Coordinator, before the commit: every file the ranks wrote is in its directory.

    Ranks given different ``checkpoint_id``s (a per-rank timestamp in the path), or a
    path on storage the coordinator does not share, would otherwise commit metadata
    naming files elsewhere; the load would then report them missing, as if damaged.
    One listing of the directory; a name the listing lacks is looked up on its own
    before it counts as missing, since a listing may be stale where a lookup is not (an
    NFS client caches directory contents for up to a minute; a lookup by name asks the
    server).
    """
    if not isinstance(writer, FileSystemWriter):
        return
    written = {name: rank for rank, reply in enumerate(replies) for name in reply["files"]}
    if not written:
        return
    if not writer.local:  # a listing cached before the ranks wrote would miss their files
        writer.fs.invalidate_cache(writer.root)
    present = set(writer.list_files())
    unseen: dict[int, list[str]] = {}
    for name, rank in written.items():
        if name not in present and not writer.has_file(name):
            unseen.setdefault(rank, []).append(name)
    if unseen:
        shown = "; ".join(f"rank {r}: {names[:2]}" for r, names in sorted(unseen.items()))
        raise CheckpointError(
            f"files the ranks wrote are not in {writer.url} as rank 0 sees it ({shown}): "
            "the ranks were given different checkpoint_id paths, or the path is on storage "
            "rank 0 does not share. Give every rank the same path on shared storage; "
            "nothing was committed"
        )


def _settle_replicas(
    job: SaveJob, writer: StorageWriter, comm: Comm, data: Callable, replies: list[dict]
) -> list[dict]:
    """Compare the copies of replicated boxes; if any differ, warn and make sure one rank's
    copy of each is saved whole (collective, only then). Returns the final replies."""
    assert job.replicas is not None
    mismatched, keepers, rewrite = mismatches_after_write(job.replicas, replies)
    if not mismatched:
        return replies
    error, payload = None, replies[job.rank]
    try:
        by_key: dict[str, set[int]] = {}
        for (key, _), rank in keepers.items():
            by_key.setdefault(key, set()).add(rank)
        promoted = warn_mismatches(mismatched, by_key)
        if promoted is not None:
            raise promoted
        if rewrite:
            payload = _rewrite_with_whole_copies(job, writer, data, rewrite, keepers, payload)
    except Exception as exc:
        error = exc
    return comm.agree(error, "saving one copy of each differing replica", payload)


def _rewrite_with_whole_copies(
    job: SaveJob, writer: StorageWriter, data: Callable, rewrite: set, keepers: dict, mine: dict
) -> dict:
    """Rewrite this rank's data files without the pieces of the boxes in ``rewrite``; their
    keeper adds each such box whole, from its own copy."""
    assert job.replicas is not None
    old = [name for name, _ in job.files]
    items = []
    for item in job.items:
        found = holder_box(job.replicas, item.key, item.box)
        if found is None or (item.key, found[0]) not in rewrite:
            items.append(item)
    kept = [slot for slot in rewrite if keepers[slot] == job.rank]
    if len(items) == len(job.items) and not kept:
        return mine  # none of this rank's files holds a piece of those boxes
    for key, box in sorted(kept, key=lambda s: (s[0], s[1].offsets)):
        leaf = job.flat.tensors[key]
        items += _cap_items([WriteItem(key, box, leaf.shape, leaf.dtype)], job.file_cap)
    writer.remove_files(old)
    job.items = items
    job.files = _name_files(job, _cap_files(_assign_files(items, job.thread_count), job.file_cap))
    records, sizes, linked = _write_data(job, writer, data)
    sizes.update({name: size for name, size in mine["files"].items() if name not in old})
    return {**mine, "chunks": records, "files": sizes, "linked": linked}


def _discard(writer: StorageWriter, job: SaveJob) -> None:
    """A failed save: remove this rank's files, and the directory if the save made it."""
    _remove_own_files(writer, job)
    if job.new_dir and isinstance(writer, FileSystemWriter):
        writer.remove_empty_directory()


def _discard_uncommitted(
    writer: StorageWriter, job: SaveJob, replies: list[dict], metadata: bytes
) -> None:
    """Rank 0 after its commit failed: every rank's files of this save (all in this
    directory; linked base files are not among them) go, unless the metadata landed
    anyway or that cannot be told, so a committed checkpoint never loses its data."""
    if not isinstance(writer, FileSystemWriter):
        return  # a custom writer: its commit may have landed; keep the files
    try:
        if writer.holds_metadata(metadata):
            return
    except Exception:
        return
    job.files = [(name, []) for reply in replies for name in reply["files"]]
    _discard(writer, job)


def _discard_unseen(writer: StorageWriter, job: SaveJob) -> None:
    """Another rank after rank 0's commit failed: this rank's files go too, unless its
    directory holds this save's metadata (rank 0's commit landed there after all, or that
    cannot be told). Where rank 0 shares the directory they are gone already; where it
    does not (a path that differs per rank), nobody else would remove them."""
    if not isinstance(writer, FileSystemWriter):
        return
    try:
        raw = writer.fs.cat_file(writer.join(METADATA_FILE))
    except FileNotFoundError:
        raw = b""
    except Exception:
        return
    if job.save_id.encode() not in raw:
        _remove_own_files(writer, job)


def _remove_own_files(writer: StorageWriter, job: SaveJob) -> None:
    names = [name for name, _ in job.files]
    if job.object_keys:
        names.append(_objects_file(job))
    try:
        writer.remove_files(names)
    except Exception as exc:  # the save's own error is the one to report
        warnings.warn(f"could not remove the files of the failed save: {exc}", stacklevel=3)


def _objects_file(job: SaveJob) -> str:
    suffix = "" if job.is_coordinator else f"-rank{job.rank}"
    return f"objects-{job.save_id}{suffix}.bin"


def _write_objects(job: SaveJob, writer: StorageWriter, sizes: dict[str, int]) -> dict:
    """This rank's pickled values (``job.object_keys``) into one objects file of its own."""
    if not job.object_keys:
        return {}
    name, parts, out, pos = _objects_file(job), [], {}, 0
    for key in job.object_keys:
        blob = pickle.dumps(job.flat.objects[key], protocol=pickle.HIGHEST_PROTOCOL)
        out[key] = {"offset": pos, "nbytes": len(blob), "xxh3_64": xxhash.xxh3_64_hexdigest(blob)}
        parts.append(memoryview(blob))
        pos += len(blob)
    writer.write_file(name, parts)
    sizes[name] = pos
    return {k: {"file": name, **v} for k, v in out.items()}


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
    verify_replicas: bool = True,
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
            Given with ``checkpoint_id``, it is pointed there first (its ``reset``), as
            in torch.
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
        verify_replicas: compare the copies of every box several ranks hold (plain
            tensors, replicated shards) by checksum; copies that differ are saved from
            one rank whole, with a :class:`ReplicaMismatchWarning`. False skips the check
            (and its cost, see docs/checkpoint.md); differing copies are then saved mixed.

    Returns:
        The committed :class:`Metadata` (the same on every rank).
    """
    writer, planner, base = begin_save(
        checkpoint_id, storage_writer, planner, verify_replicas, incremental_base, no_dist
    )
    comm = Comm(process_group, local=check_no_dist(no_dist, use_collectives))
    if isinstance(writer, FileSystemWriter):  # every rank sees the same URL: all raise
        refuse_per_process(writer.fs, writer.url, comm.world_size)
    job = prepare(
        state_dict, planner, comm, writer.thread_count, max_file_bytes(writer),
        replicas="after" if verify_replicas else "off", writer=writer,
    )  # fmt: skip
    job.base = base
    return write_and_commit(job, writer, comm, live_data(planner))


def begin_save(
    checkpoint_id: Any,
    storage_writer: Any,
    planner: Any,
    verify_replicas: Any,
    incremental_base: Any,
    no_dist: Any,
) -> tuple[StorageWriter, SavePlanner, Any]:
    """What :func:`save` and ``async_save`` do first, in one order: check the arguments
    (a mistake raises at the call), wait for a save still in flight, then join the world
    the environment describes (torchrun, SLURM) unless ``no_dist``.

    Returns the writer, the planner and the incremental base's reader (or None).
    """
    writer = resolve_writer(checkpoint_id, storage_writer)
    planner = planner if planner is not None else DefaultSavePlanner()
    if not isinstance(planner, SavePlanner):
        raise TypeError(f"planner must be a SavePlanner, got {type(planner).__name__}")
    check_verify_replicas(verify_replicas)
    base = base_reader(writer, incremental_base)
    wait_for_inflight()
    if not no_dist:  # no_dist: a world of one, even where the environment names more
        runtime.init()
    return writer, planner, base


def base_reader(writer: StorageWriter, incremental_base: Any) -> Any:
    """The base's reader (validated as a sibling of ``writer``'s directory), or None."""
    if incremental_base is None:
        return None
    from ._incremental import check_sibling

    return check_sibling(writer, incremental_base)


# exit: an async save in flight finishes (and commits) before the process ends
runtime.drain_at_exit(wait_for_inflight)
runtime.drain_at_exit(join_cleanups)
