"""How close do shardkit's checkpoint I/O paths come to the machine's limit?

One process (a world of one), one run, rounds interleaved so drift hits every path alike:

- ``readinto``: a plain read of the checkpoint's data files into one preallocated
  buffer, ``--threads`` files at a time (the ceiling for a load);
- ``write_fsync``: a plain write + fsync of the same bytes into as many files, same
  threads (the ceiling for a save);
- shardkit ``save`` (fsync on), ``load``, a resharded ``load`` (the chunks are column
  halves, so every destination row is filled from two chunks) and ``async_save``
  (blocking time, and time until committed);
- torch DCP ``save`` / ``load`` of the same state.

Each of ours is reported as a fraction of the plain I/O (plain seconds / our seconds:
1.0 = at the limit), warm (page cache holds the files) and cold (each file evicted with
``posix_fadvise(POSIX_FADV_DONTNEED)`` before each round). Peak RSS over the destination
is recorded for every load. Prints one JSON line.

    .venv/bin/python benchmarks/bench_io_limit.py                     # 1 GiB, 7 rounds
    .venv/bin/python benchmarks/bench_io_limit.py --quick    # smoke run: 64 MiB, 3 rounds
    .venv/bin/python benchmarks/bench_io_limit.py --size-mib 4096 --threads 8
    .venv/bin/python benchmarks/bench_io_limit.py --only save     # the save paths alone
    .venv/bin/python benchmarks/bench_io_limit.py --only load --verify-cost  # loads, and without hashing
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from unittest import mock

import torch

import shardkit.checkpoint as dcp

MiB = 1 << 20
_COLS = 4096


class _Columns(dcp.DefaultSavePlanner):
    """Stores every 2-d box as two column halves (loads then fill rows from two chunks)."""

    def create_global_plan(self, plans):
        out = super().create_global_plan(plans)
        for plan in out:
            split = []
            for item in plan.items:
                (r, c), (nr, nc) = item.box.offsets, item.box.sizes
                for a, b in ((0, nc // 2), (nc // 2, nc)):
                    box = type(item.box)((r, c + a), (nr, b - a))
                    split.append(dcp.WriteItem(item.key, box, item.shape, item.dtype))
            plan.items[:] = split
        return out


def _state(mib: int, num_tensors: int) -> dict:
    rows = max(1, mib * MiB // 4 // num_tensors // _COLS)
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(rows, _COLS, generator=g) for i in range(num_tensors)}


def _peak_rss_reset() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _files(root: str) -> list[str]:
    return [
        os.path.join(d, n)
        for d, _, names in os.walk(root)
        for n in sorted(names)
        if not n.startswith(".")
    ]


def _evict(root: str) -> None:
    for path in _files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _plain_read(paths: list[str], buf: memoryview, threads: int) -> None:
    offsets, pos = [], 0
    for p in paths:
        offsets.append(pos)
        pos += os.path.getsize(p)
    assert pos <= len(buf)

    def read(k: int) -> None:
        with open(paths[k], "rb", buffering=0) as f:
            view, done = buf[offsets[k] : offsets[k] + os.path.getsize(paths[k])], 0
            while done < len(view):
                done += f.readinto(view[done:])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, range(len(paths))))


def _plain_write(root: str, parts: list[memoryview], threads: int) -> None:
    os.makedirs(root, exist_ok=True)

    def write(k: int) -> None:
        fd = os.open(f"{root}/plain-{k}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = parts[k]
            for s in range(0, len(view), 1 << 20):
                piece = view[s : s + (1 << 20)]
                while piece:
                    piece = piece[os.write(fd, piece) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(len(parts))))
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


class _NoDigest:
    """Stands in for ``xxhash.xxh3_64`` under ``--verify-cost``: hashes nothing and its
    digest compares equal to any stored checksum."""

    def __init__(self, *args) -> None:
        pass

    def update(self, data) -> None:
        pass

    def hexdigest(self) -> _NoDigest:
        return self

    def __eq__(self, other) -> bool:
        return True

    def __ne__(self, other) -> bool:
        return False

    __hash__ = None


def _patched(load, name: str, value):
    """``load`` run with the read path's module attribute ``name`` set to ``value``."""
    from shardkit.checkpoint._core import _read_chunks

    def run() -> None:
        with mock.patch.object(_read_chunks, name, value):
            load()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=4, help="I/O threads, all paths alike")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--dir", default=os.environ.get("BENCH_DIR"))
    parser.add_argument("--no-torch", action="store_true", help="skip torch DCP")
    parser.add_argument("--quick", action="store_true", help="smoke run: 64 MiB, 3 rounds")
    parser.add_argument(
        "--scratch-baseline",
        action="store_true",
        help="also time the resharded load with numpy placing off (the path a device or a "
        "dtype change takes: scratch buffer, then copy_ of each piece's part)",
    )
    parser.add_argument(
        "--verify-cost",
        action="store_true",
        help="also time both loads with checksum verification stubbed out (a ceiling that "
        "shows what verifying costs; not a mode shardkit offers)",
    )
    parser.add_argument(
        "--only", choices=("save", "load"), help="time only the save or only the load paths"
    )
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.rounds = 64, 3
    import torch.distributed.checkpoint as tdcp

    warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")

    threads = args.threads
    sd = _state(args.size_mib, args.tensors)
    nbytes = sum(t.nbytes for t in sd.values())
    root = tempfile.mkdtemp(prefix="bench_io_limit_", dir=args.dir)
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    for t in target.values():
        t.zero_()  # touched: the destination is resident before any load
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in sd.values()]
    read_buf = torch.empty(nbytes + 64 * MiB, dtype=torch.uint8)
    read_buf.zero_()
    read_view = memoryview(read_buf.numpy())

    def writer(name, **kw):
        return dcp.FileSystemWriter(f"{root}/{name}", thread_count=threads, **kw)

    def reader(name):
        return dcp.FileSystemReader(f"{root}/{name}", thread_count=threads)

    def sk_save():
        dcp.save(sd, storage_writer=writer("sk"))

    def sk_load():
        dcp.load(target, storage_reader=reader("sk"))

    def sk_reshard():
        dcp.load(target, storage_reader=reader("cols"))

    block = []

    def sk_async():
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, storage_writer=writer("async"))
        block.append(time.perf_counter() - t0)
        fut.result()

    def th_save():
        tdcp.save(sd, storage_writer=tdcp.FileSystemWriter(f"{root}/th", thread_count=threads))

    def th_load():
        tdcp.load(target, storage_reader=tdcp.FileSystemReader(f"{root}/th"))

    def plain_read(name):
        return lambda: _plain_read(
            [p for p in _files(f"{root}/{name}") if "/data-" in p], read_view, threads
        )

    def plain_write():
        _plain_write(f"{root}/plain", views, threads)

    # files for the loads, once; the first of each also warms allocators
    sk_save()
    dcp.save(sd, storage_writer=writer("cols"), planner=_Columns())
    if not args.no_torch:
        th_save()
    loads = {
        "readinto": plain_read("sk"),
        "load": sk_load,
        "readinto_cols": plain_read("cols"),
        "reshard_load": sk_reshard,
    }
    if not args.no_torch:
        loads["torch_load"] = th_load
    if args.scratch_baseline:  # as if no destination could take a raw numpy copy
        loads["reshard_scratch"] = _patched(sk_reshard, "_raw_destination", lambda *args: None)
    if args.verify_cost:  # every block checksum "matches" without hashing
        no_hash = SimpleNamespace(xxh3_64=_NoDigest)
        loads["load_unverified"] = _patched(sk_load, "xxhash", no_hash)
        loads["reshard_unverified"] = _patched(sk_reshard, "xxhash", no_hash)
    saves = {"write_fsync": plain_write, "save": sk_save, "async_save": sk_async}
    if not args.no_torch:
        saves["torch_save"] = th_save
    if args.only == "save":
        loads = {}
    elif args.only == "load":
        saves = {}
    dirs = {"load": "sk", "readinto": "sk", "reshard_load": "cols", "readinto_cols": "cols"}
    dirs["torch_load"] = "th"
    dirs["reshard_scratch"] = "cols"
    dirs.update(load_unverified="sk", reshard_unverified="cols")
    times: dict[str, list[float]] = {}
    growth: dict[str, list[int]] = {}
    for r in range(args.rounds):
        names = list(saves) if r % 2 == 0 else list(reversed(saves))
        for name in names:
            t0 = time.perf_counter()
            saves[name]()
            times.setdefault(name, []).append(time.perf_counter() - t0)
        for mode in ("warm", "cold"):
            names = list(loads) if r % 2 == 0 else list(reversed(loads))
            for name in names:
                if mode == "cold":
                    _evict(f"{root}/{dirs[name]}")
                else:
                    loads[name]()  # make sure the files are cached
                before = _peak_rss_reset()
                t0 = time.perf_counter()
                loads[name]()
                times.setdefault(f"{name}_{mode}", []).append(time.perf_counter() - t0)
                growth.setdefault(name, []).append(_status("VmHWM") - before)
    if loads:
        assert all(torch.equal(target[k], sd[k]) for k in sd)
    shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    if block:
        med["async_block"] = statistics.median(block)

    def frac(plain: str, ours: str) -> float | None:
        if plain not in med or ours not in med:
            return None  # not timed in this run (--only)
        return round(med[plain] / med[ours], 3)

    def ratio(ours: str, theirs: str) -> float | None:
        if ours not in med or theirs not in med:
            return None
        return round(med[ours] / med[theirs], 3)

    out = {
        "bench": "io_limit",
        "size_mib": round(nbytes / MiB),
        "rounds": args.rounds,
        "threads": threads,
        "cpus": os.cpu_count(),
        "loadavg": round(os.getloadavg()[0], 1),
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "spread_s": {k: [round(min(v), 4), round(max(v), 4)] for k, v in times.items()},
        "fraction_of_plain_io": {
            "load_warm": frac("readinto_warm", "load_warm"),
            "load_cold": frac("readinto_cold", "load_cold"),
            "reshard_load_warm": frac("readinto_cols_warm", "reshard_load_warm"),
            "reshard_load_cold": frac("readinto_cols_cold", "reshard_load_cold"),
            "save_fsync": frac("write_fsync", "save"),
            "async_save_total": frac("write_fsync", "async_save"),
        },
        # plain / ours per round (same round, adjacent in time): min, median, max
        "paired_fraction_of_plain_io": {
            name: [round(min(v), 3), round(statistics.median(v), 3), round(max(v), 3)]
            for name, plain, ours in (
                ("save_fsync", "write_fsync", "save"),
                ("load_warm", "readinto_warm", "load_warm"),
                ("reshard_load_warm", "readinto_cols_warm", "reshard_load_warm"),
            )
            if plain in times and ours in times
            for v in [[p / o for p, o in zip(times[plain], times[ours])]]
        },
        # resharded load, numpy placing / the copy_ path: below 1 is faster
        "reshard_placed_vs_scratch": {
            mode: ratio(f"reshard_load_{mode}", f"reshard_scratch_{mode}")
            for mode in ("warm", "cold")
        }
        if args.scratch_baseline
        else None,
        # with checksum verification stubbed out (--verify-cost): what a load without its
        # hashing pass would reach, as a fraction of plain I/O
        "unverified_fraction_of_plain_io": {
            "load_warm": frac("readinto_warm", "load_unverified_warm"),
            "reshard_load_warm": frac("readinto_cols_warm", "reshard_unverified_warm"),
        }
        if args.verify_cost
        else None,
        "peak_rss_over_destination_mib": {
            k: round(max(v) / MiB, 1) for k, v in growth.items() if not k.startswith("readinto")
        },
        "targets": {"load_warm": 0.9, "reshard_load_warm": 0.8, "save_fsync": 0.8},
    }
    if not args.no_torch:
        out["vs_torch_dcp"] = {  # ours / torch: below 1 is faster
            "save": ratio("save", "torch_save"),
            "load_warm": ratio("load_warm", "torch_load_warm"),
            "load_cold": ratio("load_cold", "torch_load_cold"),
        }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
