"""Process-group bootstrap and rank helpers.

The environment torchrun (or SLURM) sets decides the world. With nothing set the
process is a world of one and no process group is created, so every shardkit API
works in a plain Python script. Every shardkit entry point that needs a group calls
:func:`init`, so under torchrun the world is joined without any call by the user.
"""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist

from . import _teardown

__all__ = [
    "init",
    "is_initialized",
    "use_spmd",
    "is_spmd",
    "world_size",
    "global_ordinal",
    "global_runtime_device_count",
    "local_rank",
    "device",
    "default_backend",
]

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
_spmd_enabled = False


def _env_named(*names: str) -> tuple[str, int] | None:
    """``(name, value)`` of the first of ``names`` set in the environment (blank counts
    as unset), the value as an int; None when none is set. Raises ValueError naming the
    variable when it is no integer."""
    for name in names:
        value = os.environ.get(name, "")
        if value.strip():
            try:
                return name, int(value)
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return None


def _env_int(*names: str) -> int | None:
    """The int value of the first of ``names`` set (see :func:`_env_named`), or None."""
    found = _env_named(*names)
    return None if found is None else found[1]


def env_world() -> tuple[int, int] | None:
    """(rank, world size) the environment describes, or None for a world of one.

    Raises ValueError when the environment describes a larger world incompletely, so a
    misconfigured launch never silently runs as a world of one. Messages name the
    variables actually read (torchrun's, or SLURM's).
    """
    found = _env_named("WORLD_SIZE", "SLURM_NTASKS")
    if found is None or found[1] == 1:
        return None
    size_name, size = found
    slurm = size_name == "SLURM_NTASKS"
    launcher = "srun, with the job's task count" if slurm else "torchrun"
    if size < 1:
        raise ValueError(f"{size_name}={size} must be at least 1")
    rank_found = _env_named("RANK", "SLURM_PROCID")
    if rank_found is None:
        rank_name = "SLURM_PROCID" if slurm else "RANK"
        raise ValueError(
            f"{size_name}={size} is set but {rank_name} is not; launch with {launcher}"
        )
    rank_name, rank = rank_found
    if not 0 <= rank < size:
        raise ValueError(
            f"{rank_name}={rank} is outside the world of {size} ({size_name}; 0..{size - 1})"
        )
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(
                f"{size_name}={size} is set but {name} is not; launch with torchrun "
                f"(or export {name} under SLURM)"
            )
    return rank, size


def default_backend() -> str:
    """nccl when this process has a CUDA device, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init(backend: str | None = None, *, timeout: datetime.timedelta = _DEFAULT_TIMEOUT) -> None:
    """Join the process group described by the environment; idempotent.

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as torchrun sets them, or
    SLURM_PROCID / SLURM_NTASKS under SLURM (MASTER_ADDR and MASTER_PORT must still be
    set). With no world size set, or a world size of one, no process group is created.
    Every shardkit entry point that needs a group (``Mesh``, ``mark_sharding``, FSDP,
    DDP, checkpoint save / load, ``CheckpointManager``, the state-dict helpers) calls
    this, so an explicit call is only needed to choose the backend or timeout.

    A group created here is shardkit's: at interpreter exit shardkit drains in-flight
    async saves, waits for every rank (barrier) and destroys it. A group you create
    with ``torch.distributed.init_process_group`` stays yours to destroy.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; default: :func:`default_backend`.
        timeout: collective timeout for the default group.
    """
    if dist.is_available() and dist.is_initialized():
        current = dist.get_backend()
        used = str(current).lower().replace(":", ",").split(",")  # "cpu:gloo,cuda:nccl"
        if backend is not None and str(backend).lower() not in used:
            warnings.warn(
                f"shardkit.runtime.init(backend={backend!r}): a process group is already "
                f"initialized with backend {current!r}, which stays; init() chooses the "
                "backend only when it creates the group",
                stacklevel=2,
            )
        return
    world = env_world()
    if world is None:
        return
    if not dist.is_available():
        raise RuntimeError(
            f"the environment describes a world of {world[1]} ranks but this torch build "
            "has no torch.distributed; install a torch build with distributed support"
        )
    rank, size = world
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(
        backend=backend, init_method="env://", rank=rank, world_size=size, timeout=timeout
    )
    _teardown.own_default_group(dist.group.WORLD)


def is_initialized() -> bool:
    """Whether a multi-process group is active."""
    return dist.is_available() and dist.is_initialized()


def use_spmd(auto: bool | None = False) -> None:
    """Declare SPMD mode: one program, every rank holds a shard of each sharded tensor.

    shardkit is always SPMD-capable; the call exists so code written for XLA's
    ``xr.use_spmd()`` runs unchanged. It also joins the process group if needed.
    ``auto=True`` (XLA's automatic sharding) has no counterpart and is refused.
    """
    global _spmd_enabled
    if auto:
        raise NotImplementedError(
            "use_spmd(auto=True): XLA's automatic sharding has no counterpart in shardkit; "
            "annotate tensors with mark_sharding (or shard modules) instead"
        )
    init()
    _spmd_enabled = True


def is_spmd() -> bool:
    """Whether :func:`use_spmd` was called."""
    return _spmd_enabled


def world_size() -> int:
    """Number of ranks in the world (1 in a plain single-process run).

    Joins the world the environment describes first, like every entry point.
    """
    init()
    return dist.get_world_size() if is_initialized() else 1


def global_ordinal() -> int:
    """This process's rank in the world (0 in a plain single-process run)."""
    init()
    return dist.get_rank() if is_initialized() else 0


def global_runtime_device_count() -> int:
    """Number of addressable devices in the SPMD world: one per rank."""
    return world_size()


def local_rank() -> int:
    """This process's index on its machine (LOCAL_RANK, else SLURM_LOCALID, else 0)."""
    value = _env_int("LOCAL_RANK", "SLURM_LOCALID")
    return 0 if value is None else value


def device() -> torch.device:
    """The device this rank computes on: its local CUDA device, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")
