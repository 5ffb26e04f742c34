"""The replica check of a save: copies of a box held by several ranks must be equal.

A box that several ranks hold (a plain tensor; a DTensor/ShardedTensor shard replicated
along a mesh axis) is cut into row pieces that different ranks write, so copies that
differ would be saved as a mix. Two ways to find such copies, both exchanging checksums
in a collective the save runs anyway:

- ``save`` (*after* writing): the writing rank's block checksums, which the write
  computes anyway, are compared with the same block checksums that every other holder
  computes of its own copy of the piece, on a thread that runs while this rank writes.
  Each rank thus reads only the replicated bytes it does not write, concurrently with its
  I/O, and the digests travel in the write agreement. When a box whose pieces several
  ranks wrote differs, the data files are rewritten with the lowest holder's copy whole.
- ``async_save`` (*before* staging, which only copies this rank's share): every rank
  hashes each plain tensor it holds and sends the digests with its save plan; a
  differing one is then planned whole from the lowest rank.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import xxhash

from ...runtime._xla_api import local_process_count
from ...spmd.layout import Box
from ._errors import ReplicaMismatchWarning
from ._flatten import Flat
from ._format import block_rows_for, encode_value, row_bytes
from ._planner import SavePlan, WriteItem

__all__ = [
    "ReplicaPlan",
    "ReplicaStats",
    "STATS",
    "Shadows",
    "check_verify_replicas",
    "holder_box",
    "keep_one_copy",
    "mismatches_after_write",
    "plan_replicas",
    "replica_digests",
    "replica_mismatches",
    "warn_mismatches",
]

_HASH_SPAN = 32 << 20


def check_verify_replicas(value: object) -> bool:
    """``verify_replicas`` checked: a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"verify_replicas must be True or False, got {value!r}")
    return value


def _bytes_view(t: torch.Tensor) -> memoryview:
    if not t.numel():
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _cores() -> int:
    try:
        local = max(1, local_process_count())
    except ValueError:  # a thread-count hint: a bad LOCAL_WORLD_SIZE never fails a save
        local = 1
    return max(1, min(8, (os.cpu_count() or 1) // local))


# -- after writing (save) ----------------------------------------------------------------
@dataclass
class ReplicaPlan:
    """What the after-write check needs, the same on every rank after planning."""

    #: key -> [(box, holder ranks)] for every box that more than one rank holds
    holders: dict[str, list[tuple[Box, list[int]]]] = field(default_factory=dict)
    #: pieces that other ranks write of boxes this rank holds too (file-capped as written)
    shadows: list[WriteItem] = field(default_factory=list)


def _contains(outer: Box, inner: Box) -> bool:
    return all(
        o <= i and i + s <= o + t
        for o, t, i, s in zip(outer.offsets, outer.sizes, inner.offsets, inner.sizes)
    )


def holder_box(rp: ReplicaPlan, key: str, box: Box) -> tuple[Box, list[int]] | None:
    """The multi-holder box that contains ``box`` of ``key``, with its holders."""
    for outer, ranks in rp.holders.get(key, ()):
        if _contains(outer, box):
            return outer, ranks
    return None


def plan_replicas(
    local_plans: list[SavePlan], global_plans: list[SavePlan], rank: int, cap_items
) -> ReplicaPlan:
    """The multi-holder boxes and this rank's shadow pieces (``cap_items`` cuts each
    rank's items as its writer will)."""
    by_box: dict[tuple[str, Box], list[int]] = {}
    for r, plan in enumerate(local_plans):
        for item in plan.items:
            by_box.setdefault((item.key, item.box), []).append(r)
    rp = ReplicaPlan()
    for (key, box), ranks in by_box.items():
        if len(ranks) > 1:
            rp.holders.setdefault(key, []).append((box, ranks))
    if not rp.holders:
        return rp
    for r, plan in enumerate(global_plans):
        if r == rank:
            continue
        for item in cap_items(plan.items):
            found = holder_box(rp, item.key, item.box)
            if found is not None and rank in found[1]:
                rp.shadows.append(item)
    return rp


def block_sums(view: memoryview, item: WriteItem) -> list[str]:
    """The block checksums the write records for ``item`` (see ``_save._write_file``)."""
    rows = block_rows_for(item.box.sizes, item.dtype.itemsize)
    block = max(1, rows * row_bytes(item.box.sizes, item.dtype.itemsize))
    return [xxhash.xxh3_64_hexdigest(view[s : s + block]) for s in range(0, len(view), block)]


@dataclass
class ReplicaStats:
    """Counters of the after-write check, per process and cumulative (for benchmarks)."""

    hashed_bytes: int = 0  # bytes of other ranks' pieces hashed here
    hash_cpu_s: float = 0.0  # CPU time of that hashing (its threads)
    waited_s: float = 0.0  # time the saves waited for it after writing their own files


STATS = ReplicaStats()
_stats_lock = threading.Lock()


class Shadows:
    """Hashes this rank's copies of the pieces other ranks write, on background threads.

    With a spare core per rank the hashing starts at once, beside the write. Without one
    it starts when ``start()`` is called: once this rank has handed all bytes of a data
    file to the writer, which then waits for the disk (fsync, an upload) with the CPU
    idle, so the hashing does not compete with copying the data into the page cache.
    """

    def __init__(self, items: list[WriteItem], data) -> None:
        self._items, self._data = items, data
        self._lock = threading.Lock()
        self._futures: list[tuple[WriteItem, Future]] | None = None
        self._pool = ThreadPoolExecutor(min(_cores(), max(1, len(items))), "shardkit-replicas")
        if _cores() > 1:
            self.start()

    def start(self) -> None:
        """Start hashing (once; later calls do nothing)."""
        with self._lock:
            if self._futures is None:
                self._futures = [(i, self._pool.submit(self._hash, i)) for i in self._items]

    def _hash(self, item: WriteItem) -> list[str]:
        start = time.thread_time()
        sums = block_sums(_bytes_view(self._data(item)), item)
        with _stats_lock:
            STATS.hashed_bytes += item.nbytes
            STATS.hash_cpu_s += time.thread_time() - start
        return sums

    def result(self) -> list[list]:
        """``[key, offsets, sizes, sums]`` per piece (waits; re-raises a hashing error)."""
        self.start()
        assert self._futures is not None
        start = time.perf_counter()
        try:
            return [
                [i.key, list(i.box.offsets), list(i.box.sizes), f.result()]
                for i, f in self._futures
            ]
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            STATS.waited_s += time.perf_counter() - start

    def cancel(self) -> None:
        """Stop: drop the pieces not started, wait for the running ones."""
        with self._lock:
            self._futures = self._futures or []
        self._pool.shutdown(wait=True, cancel_futures=True)


def mismatches_after_write(
    rp: ReplicaPlan, replies: list[dict]
) -> tuple[dict[str, list[list[int]]], dict[tuple[str, Box], int], set[tuple[str, Box]]]:
    """From the write agreement's replies: keys whose copies differ -> ranks grouped by
    equal copy; the rank whose copy is kept per differing box; the boxes to rewrite
    (their pieces came from several ranks)."""
    table: dict[tuple[str, Box], dict[int, dict]] = {}
    writers: dict[tuple[str, Box], set[int]] = {}

    def note(rank: int, key: str, offsets, sizes, sums, written: bool) -> None:
        found = holder_box(rp, key, Box(tuple(offsets), tuple(sizes)))
        if found is None:
            return
        slot = (key, found[0])
        table.setdefault(slot, {}).setdefault(rank, {})[(tuple(offsets), tuple(sizes))] = tuple(
            sums
        )
        if written:
            writers.setdefault(slot, set()).add(rank)

    for rank, reply in enumerate(replies):
        for c in reply.get("chunks", ()):
            if c["key"] in rp.holders:
                note(rank, c["key"], c["offsets"], c["sizes"], c["xxh3_64"], True)
        for key, offsets, sizes, sums in reply.get("replicas", ()):
            note(rank, key, offsets, sizes, sums, False)
    mismatched: dict[str, list[list[int]]] = {}
    keepers: dict[tuple[str, Box], int] = {}
    rewrite: set[tuple[str, Box]] = set()
    for slot in sorted(table, key=lambda s: (s[0], s[1].offsets)):
        groups: dict[tuple, list[int]] = {}
        for rank, pieces in sorted(table[slot].items()):
            groups.setdefault(tuple(sorted(pieces.items())), []).append(rank)
        if len(groups) < 2:
            continue
        mismatched.setdefault(slot[0], []).extend(sorted(groups.values()))
        wrote = writers.get(slot, set())
        if len(wrote) == 1:  # one rank wrote all of it: its copy is already whole
            keepers[slot] = next(iter(wrote))
        else:
            keepers[slot] = min(r for g in groups.values() for r in g)
            rewrite.add(slot)
    return mismatched, keepers, rewrite


# -- before staging (async_save) ---------------------------------------------------------
def replica_digests(flat: Flat) -> dict[str, str]:
    """xxh3-64 of every tensor this rank holds whole (plain tensors: replicated copies).

    Spans of 32 MiB are hashed on up to 8 threads (xxhash releases the GIL; at most this
    rank's share of the host's cores). Tensors in contiguous CPU memory are hashed in
    place; any other (a GPU tensor, a strided view) is copied to the host one at a time.
    """
    in_place: dict[str, memoryview] = {}
    copied: list[tuple[str, torch.Tensor]] = []
    for key, leaf in flat.tensors.items():
        if tuple(leaf.box.sizes) == tuple(leaf.shape) and not any(leaf.box.offsets):
            t = leaf.local.detach()
            if t.device.type == "cpu" and t.is_contiguous():
                in_place[key] = _bytes_view(t)
            else:
                copied.append((key, t))
    if not in_place and not copied:
        return {}
    with ThreadPoolExecutor(_cores(), "shardkit-replica-hash") as pool:
        out = _hash_views(in_place, pool)
        for key, t in copied:
            out.update(_hash_views({key: _bytes_view(t.to("cpu").contiguous())}, pool))
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


def keep_one_copy(plans: list[SavePlan], mismatched: dict[str, list[list[int]]]) -> None:
    """Let only the lowest rank holding a differing replica write it (whole)."""
    for key, by_copy in mismatched.items():
        keeper = min(r for ranks in by_copy for r in ranks)
        for rank, plan in enumerate(plans):
            if rank != keeper:
                plan.items = [
                    i for i in plan.items if not (i.key == key and i.box.sizes == i.shape)
                ]


# -- both ----------------------------------------------------------------------------------
def _ranks(ranks) -> str:
    return "/".join(map(str, sorted(ranks))) or "?"


def warn_mismatches(
    mismatched: dict[str, list[list[int]]], keepers: dict[str, set[int]]
) -> BaseException | None:
    """Warn on this rank; a warning the caller's filters turn into an error is returned.

    ``keepers``: for each mismatched key, the rank(s) whose copy the checkpoint holds."""
    if not mismatched:
        return None
    shown = "; ".join(
        f"{key!r}: "
        + " vs ".join(f"ranks {ranks}" for ranks in by_copy)
        + f", saved the copy of rank {_ranks(keepers.get(key, ()))}"
        for key, by_copy in list(mismatched.items())[:5]
    )
    more = f" (and {len(mismatched) - 5} more)" if len(mismatched) > 5 else ""
    try:
        warnings.warn(
            f"{len(mismatched)} replicated tensor(s) differ between ranks: {shown}"
            f"{more}. Each is saved whole from one rank's copy. Make the copies "
            "equal (broadcast or all-reduce them), or save per-rank shards as a "
            "ShardedTensor/DTensor with their global offsets",
            ReplicaMismatchWarning,
            stacklevel=5,
        )
    except ReplicaMismatchWarning as exc:
        return exc
    return None


# -- plain values (JSON) -------------------------------------------------------------------
def value_digests(values: dict) -> dict[str, str]:
    """A short digest of each plain value (``step``, a scheduler's milestones...), so the
    ranks can tell when their copies differ: the checkpoint keeps one rank's."""
    return {
        key: xxhash.xxh3_64_hexdigest(json.dumps(encode_value(value), sort_keys=True).encode())[:8]
        for key, value in values.items()
    }


def warn_value_mismatches(digests: list[dict[str, str]]) -> BaseException | None:
    """Warn (on every rank: ``digests`` is every rank's) about plain values some rank holds
    differently from rank 0, whose value the checkpoint keeps. As :func:`warn_mismatches`,
    a warning the caller's filters turn into an error is returned."""
    differ = {
        key: [rank for rank, theirs in enumerate(digests) if theirs.get(key, digest) != digest]
        for key, digest in digests[0].items()
    }
    differ = {key: ranks for key, ranks in differ.items() if ranks}
    if not differ:
        return None
    shown = "; ".join(f"{key!r}: ranks {ranks}" for key, ranks in list(differ.items())[:5])
    more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
    try:
        warnings.warn(
            f"{len(differ)} plain value(s) differ from rank 0's: {shown}{more}. The "
            "checkpoint keeps rank 0's value of each; give every rank the same value, or "
            "save per-rank values under per-rank keys",
            ReplicaMismatchWarning,
            stacklevel=5,
        )
    except ReplicaMismatchWarning as exc:
        return exc
    return None
