"""How fast can a resharded load be on this machine, whatever the code that does it?

Issue 22 asks a resharded load for >= 0.8 of a plain ``readinto`` of the same files.
This benchmark times, in one process, rounds interleaved, on the column-half checkpoint
of ``bench_io_limit.py`` (each destination row is filled from two saved chunks):

- ``readinto``: the plain read of the data files into one buffer (the reference, 1.0);
- ``shardkit``: ``shardkit.checkpoint.load`` of it, every checksum verified;
- ``scratch_replay``: what shardkit does with no library around it: each chunk read in
  2 MiB pieces into a per-thread scratch buffer, XXH3 of each piece, one ``numpy.copyto``
  into the strided destination rows;
- ``kernel_scatter``: ``preadv`` of every saved row straight into its destination row,
  with the I/O vectors built before the clock starts and no hashing: the kernel's own
  scatter, a ceiling no Python loader reaches (building the vectors per row and hashing
  each row both cost more, under the GIL, than the scatter saves).

Every path uses ``--threads`` threads and 16 MiB parts of each chunk, as the loader does.
Prints one JSON line: medians and each path's fraction of ``readinto``.

    .venv/bin/python benchmarks/bench_reshard_ceiling.py            # 1 GiB, 9 rounds
    .venv/bin/python benchmarks/bench_reshard_ceiling.py --quick    # 64 MiB, 3 rounds
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
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash
from bench_io_limit import _Columns, _files, _plain_read, _state

import shardkit.checkpoint as dcp
from shardkit.checkpoint._core._load import _metadata

MiB = 1 << 20
_PIECE = 2 * MiB
_PART = 16 * MiB


def _parts(metadata) -> list[tuple[str, str, int, int, int, int, int]]:
    """``(key, file, file offset, first row, rows, first column, columns)`` per 16 MiB
    part of every saved chunk."""
    out = []
    for key, tensor in metadata.tensors.items():
        for chunk in tensor.chunks:
            (r0, c0), (rows, cols) = chunk.box.offsets, chunk.box.sizes
            row_bytes = cols * tensor.dtype.itemsize
            step = max(1, _PART // row_bytes)
            for a in range(0, rows, step):
                n = min(step, rows - a)
                out.append((key, chunk.file, chunk.offset + a * row_bytes, r0 + a, n, c0, cols))
    return out


def _run(threads: int, fn, jobs) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, jobs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--dir", default=os.environ.get("BENCH_DIR"))
    parser.add_argument("--quick", action="store_true", help="smoke run: 64 MiB, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.rounds = 64, 3
    sd = _state(args.size_mib, 8)
    root = tempfile.mkdtemp(prefix="bench_reshard_ceiling_", dir=args.dir)
    ckpt = f"{root}/cols"
    dcp.save(
        sd, storage_writer=dcp.FileSystemWriter(ckpt, thread_count=args.threads), planner=_Columns()
    )
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    arrays = {k: t.numpy() for k, t in target.items()}
    paths = [p for p in _files(ckpt) if "/data-" in p]
    nbytes = sum(os.path.getsize(p) for p in paths)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    metadata = _metadata(dcp.FileSystemReader(ckpt))
    parts = _parts(metadata)
    fds: dict[str, int] = {}
    scratch = threading.local()

    def readinto() -> None:
        _plain_read(paths, memoryview(buf.numpy()), args.threads)

    def shardkit_load() -> None:
        dcp.load(target, storage_reader=dcp.FileSystemReader(ckpt, thread_count=args.threads))

    def replay_part(part) -> None:
        key, name, offset, r0, rows, c0, cols = part
        if getattr(scratch, "buf", None) is None:
            scratch.buf = np.empty(_PIECE, np.uint8)
        dest, row_bytes = arrays[key], cols * 4
        step = max(1, _PIECE // row_bytes)
        for a in range(0, rows, step):
            n = min(step, rows - a)
            piece = scratch.buf[: n * row_bytes]
            os.preadv(fds[name], [memoryview(piece)], offset + a * row_bytes)
            xxhash.xxh3_64_hexdigest(piece)
            np.copyto(
                dest[r0 + a : r0 + a + n, c0 : c0 + cols], piece.view(np.float32).reshape(n, cols)
            )

    vectors = []  # the kernel scatter's row vectors, built once, outside the clock
    for key, name, offset, r0, rows, c0, cols in parts:
        flat = memoryview(arrays[key]).cast("B")
        row = arrays[key].shape[1] * 4
        vectors.append(
            (name, offset, [flat[(r0 + r) * row + c0 * 4 :][: cols * 4] for r in range(rows)])
        )

    def scatter_part(job) -> None:
        name, offset, rows = job
        for a in range(0, len(rows), 1024):  # IOV_MAX
            offset += os.preadv(fds[name], rows[a : a + 1024], offset)

    def with_fds(fn, jobs):
        def run() -> None:
            fds.update({os.path.basename(p): os.open(p, os.O_RDONLY) for p in paths})
            try:
                _run(args.threads, fn, jobs)
            finally:
                for fd in fds.values():
                    os.close(fd)
                fds.clear()

        return run

    paths_timed = {
        "readinto": readinto,
        "shardkit": shardkit_load,
        "scratch_replay": with_fds(replay_part, parts),
        "kernel_scatter": with_fds(scatter_part, vectors),
    }
    times: dict[str, list[float]] = {name: [] for name in paths_timed}
    for fn in paths_timed.values():  # warm the page cache, the allocators, the threads
        fn()
    for r in range(args.rounds):
        names = list(paths_timed) if r % 2 == 0 else list(reversed(paths_timed))
        for name in names:
            t0 = time.perf_counter()
            paths_timed[name]()
            times[name].append(time.perf_counter() - t0)
            if name != "readinto":
                assert all(torch.equal(target[k], sd[k]) for k in sd), name
                for t in target.values():
                    t.zero_()
    shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        json.dumps(
            {
                "bench": "reshard_ceiling",
                "size_mib": round(nbytes / MiB),
                "rounds": args.rounds,
                "threads": args.threads,
                "cpus": os.cpu_count(),
                "loadavg": round(os.getloadavg()[0], 1),
                "median_s": {k: round(v, 4) for k, v in med.items()},
                "spread_s": {k: [round(min(v), 4), round(max(v), 4)] for k, v in times.items()},
                "fraction_of_readinto": {k: round(med["readinto"] / v, 3) for k, v in med.items()},
                "paired_fraction_of_readinto": {
                    k: sorted(round(a / b, 2) for a, b in zip(times["readinto"], v))
                    for k, v in times.items()
                    if k != "readinto"
                },
                "target": 0.8,
            }
        )
    )


if __name__ == "__main__":
    main()
