"""Shared plumbing of the multi-rank benchmarks (bench_fsdp, bench_hf, bench_spmd).

Each benchmark spawns its ranks in fresh processes (gloo on 127.0.0.1, a free port,
one torch thread per rank), collects one result per rank through a queue and reports
medians and spreads. Imported by path (``python benchmarks/bench_x.py`` puts this
folder on ``sys.path``, and spawned ranks inherit it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
from collections.abc import Callable, Sequence


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``); 0 when absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> None:
    """Reset this process's VmHWM to its current RSS (Linux ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rank_env(rank: int, world: int, port: int) -> None:
    """Environment for ``init_process_group`` on this machine; one torch thread."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
    )
    import torch

    torch.set_num_threads(1)


def _rank_main(target, rank, world, port, args, queue):
    rank_env(rank, world, port)
    result = target(rank, world, *args)
    if result is not None:
        queue.put((rank, result))


def spawn_ranks(
    target: Callable, world: int, *args, timeout: float = 1800, results: int | None = None
) -> dict[int, object]:
    """Run ``target(rank, world, *args)`` on ``world`` fresh processes (rank environment
    set, see :func:`rank_env`); returns ``{rank: what target returned}`` for the ranks
    that returned something other than None (``results`` of them: default every rank).
    A rank that exits non-zero raises RuntimeError."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(target, r, world, port, args, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    expected = world if results is None else results
    out = dict(queue.get(timeout=timeout) for _ in range(expected))
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{target.__name__}: a rank exited with code {p.exitcode}")
    return out


def worst_rank(results: dict[int, dict]) -> dict:
    """Per key, the largest value over ranks (the slowest time, the highest peak)."""
    first = next(iter(results.values()))
    return {k: max(r[k] for r in results.values()) for k in first}


def spread(samples: Sequence[float]) -> float:
    """(max - min) / median of ``samples``: the run-to-run noise, as a fraction."""
    return round((max(samples) - min(samples)) / statistics.median(samples), 3)


def medians(runs: Sequence[dict], ndigits: int = 4) -> dict:
    """Per key, the median over ``runs`` (dicts with the same numeric keys)."""
    return {k: round(statistics.median(r[k] for r in runs), ndigits) for k in runs[0]}


def time_abba(
    steps: dict[str, Callable], repeats: int, inner: int, barrier: Callable
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds per call of each step function: ``repeats`` rounds of
    ``inner`` calls, the functions alternating in ABBA order (so drift in machine load
    hits all alike); ``barrier`` lines the ranks up around each round. CPU time is this
    process's (all threads): on a busy machine it shows the work done, without the time
    spent waiting for a core or for the other ranks."""
    import time

    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps.items())
    for round_ in range(repeats):
        for name, step in order if round_ % 2 == 0 else order[::-1]:
            barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(inner):
                step()
            c1 = time.process_time()
            barrier()
            wall[name].append((time.perf_counter() - t0) / inner)
            cpu[name].append((c1 - c0) / inner)
    return wall, cpu
