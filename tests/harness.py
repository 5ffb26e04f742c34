"""Run a function on N real ranks (gloo over 127.0.0.1) with a hard timeout.

Ranks are forked from a forkserver that has already imported torch, so starting a
world costs a fraction of a second. A rank that raises fails the test with its own
traceback; a world that hangs is killed at the timeout instead of blocking CI.

Usage::

    def _body(x):                      # module-level, so it can be pickled
        import torch.distributed as dist
        return dist.get_rank() * x

    assert run_ranks(_body, 2, 10) == [0, 10]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

_CTX = None

# Imported once by the forkserver, so no rank pays for them again. torch's dispatcher
# imports torch.distributed.tensor (about a second) the first time a tensor subclass
# such as ShardedTensor reaches it; transformers takes several seconds. Importing
# changes no state a test checks: no process group, no threads, no torch op runs.
# The forkserver imports them from its own sys.path, the working directory first, then
# PYTHONPATH: Python before 3.12.8 / 3.13.1 ignores the parent's sys.path there (CPython
# gh-117378). So ranks run the shardkit found from the working directory; a caller that
# wants another tree's runs in that tree (benchmarks/bench_full_save_ab.py does).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.tensor",
    "numpy",
    "shardkit.runtime",
    "shardkit.spmd",
    "shardkit.checkpoint",
    "shardkit.fsdp",
    "shardkit.ddp",
    "transformers",  # absent without the dev extra: the forkserver skips what fails
    "transformers.models.bert.modeling_bert",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
]


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(AssertionError):
    """A rank raised, died or hung; the message carries the rank and its traceback."""


def world_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun would give one rank on this machine."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }


def _rank_main(fn, rank, world_size, port, env, args, kwargs, conn):
    os.environ.update(world_env(rank, world_size, port))
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(1)
        if world_size > 1:
            import shardkit.runtime as xr

            xr.init(backend="gloo")
        result = fn(*args, **kwargs)
        # plain pickle, not the connection's: torch sends a tensor through a connection as
        # a shared-memory file descriptor, which is gone if this rank exits before the
        # parent reads it (a FileNotFoundError in the parent, on a busy machine)
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as exc:  # report everything, including SystemExit
        report = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        conn.send_bytes(pickle.dumps(report))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                # nobody tears down the store while a peer is still using it
                dist.barrier()
                dist.destroy_process_group()
        except Exception:
            pass
        conn.close()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return each rank's result.

    With ``world_size == 1`` no process group is created (shardkit's world of one).
    """
    if not 1 <= world_size <= 8:
        raise ValueError(f"world_size must be 1..8, got {world_size}")
    ctx = _context()
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, env or {}, args, kwargs, child),
            daemon=True,
        )
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    results: list[Any] = [None] * world_size
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout
    failure = None
    while pending and failure is None:
        if time.monotonic() > deadline:
            failure = f"timed out after {timeout:.0f}s; ranks still running: {sorted(pending)}"
            break
        for rank in sorted(pending):
            conn = conns[rank]
            if conn.poll(0.02):
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    status, payload = "error", f"died (exit code {procs[rank].exitcode})"
                pending.discard(rank)
                if status == "ok":
                    results[rank] = payload
                else:
                    failure = f"rank {rank} failed: {payload}"
                    break
            elif not procs[rank].is_alive() and not conn.poll(0):
                pending.discard(rank)
                failure = f"rank {rank} died with exit code {procs[rank].exitcode}"
                break
    for p in procs:
        if failure is not None and p.is_alive():
            p.kill()
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    if failure is not None:
        raise RankFailed(failure)
    return results


def outcome(fn: Callable[[], Any]) -> str:
    """``"ok"``, or ``"ClassName: message"`` of what ``fn()`` raised on this rank: rank
    bodies return it so the test compares every rank's error class and message."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the class and message are what tests check
        return f"{type(exc).__name__}: {exc}"
    return "ok"
