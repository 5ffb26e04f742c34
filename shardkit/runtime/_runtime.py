"""Process-group bootstrap and rank helpers.

The environment torchrun (or SLURM) sets decides the world. With nothing set the
process is a world of one and no process group is created, so every shardkit API
works in a plain Python script.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

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


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return None


def default_backend() -> str:
    """nccl when this process has a CUDA device, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init(backend: str | None = None, *, timeout: datetime.timedelta = _DEFAULT_TIMEOUT) -> None:
    """Join the process group described by the environment; idempotent.

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as torchrun sets them, or
    SLURM_PROCID / SLURM_NTASKS under SLURM (MASTER_ADDR and MASTER_PORT must still be
    set). With no world size set, or a world size of one, no process group is created.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; default: :func:`default_backend`.
        timeout: collective timeout for the default group.
    """
    if dist.is_available() and dist.is_initialized():
        return
    size = _env_int("WORLD_SIZE", "SLURM_NTASKS")
    if size is None or size == 1:
        return
    rank = _env_int("RANK", "SLURM_PROCID")
    if rank is None:
        raise ValueError(f"WORLD_SIZE={size} is set but RANK is not; launch with torchrun")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(f"WORLD_SIZE={size} is set but {name} is not; launch with torchrun")
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(
        backend=backend, init_method="env://", rank=rank, world_size=size, timeout=timeout
    )


def is_initialized() -> bool:
    """Whether a multi-process group is active."""
    return dist.is_available() and dist.is_initialized()


def use_spmd() -> None:
    """Declare SPMD mode: one program, every rank holds a shard of each sharded tensor.

    shardkit is always SPMD-capable; the call exists so code written for XLA's
    ``xr.use_spmd()`` runs unchanged. It also joins the process group if needed.
    """
    global _spmd_enabled
    init()
    _spmd_enabled = True


def is_spmd() -> bool:
    """Whether :func:`use_spmd` was called."""
    return _spmd_enabled


def world_size() -> int:
    """Number of ranks in the default group (1 without a process group)."""
    return dist.get_world_size() if is_initialized() else 1


def global_ordinal() -> int:
    """This process's rank in the default group (0 without a process group)."""
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
