"""torch_xla's ``torch_xla.runtime`` helpers, answered for a world of torch processes.

shardkit runs one process per device, so a *process* and a *device* are the same
thing here: ``process_index() == global_ordinal()``, every process addresses one
device, and a *host* is a machine of torchrun's launch (``GROUP_RANK``). Knobs that
only steer the XLA compiler are accepted with a one-time warning so code runs as is.
"""

from __future__ import annotations

import os
import warnings

import torch

from ._runtime import _env_int, global_ordinal, local_rank, world_size

__all__ = [
    "addressable_device_count",
    "addressable_runtime_device_count",
    "device_type",
    "get_master_ip",
    "global_device_count",
    "host_index",
    "initialize_cache",
    "is_bf16_supported",
    "local_device_count",
    "local_ordinal",
    "local_process_count",
    "process_count",
    "process_index",
    "set_device_type",
]

_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def process_index() -> int:
    """This process's index in the job: its rank."""
    return global_ordinal()


def process_count() -> int:
    """Number of processes in the job: the world size."""
    return world_size()


def local_process_count() -> int:
    """Number of processes on this machine (LOCAL_WORLD_SIZE, else SLURM's, else 1)."""
    value = _env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")
    return 1 if value is None else value


def addressable_device_count() -> int:
    """Devices this process drives: always one (one process per device)."""
    return 1


def addressable_runtime_device_count() -> int:
    """Runtime devices this process drives: always one."""
    return 1


def local_device_count() -> int:
    """Devices on this machine: one per local process."""
    return local_process_count() * addressable_device_count()


def global_device_count() -> int:
    """Devices in the job: one per rank."""
    return world_size()


def local_ordinal() -> int:
    """This process's device index on its machine: its local rank."""
    return local_rank()


def host_index() -> int:
    """Index of this machine in the job (torchrun's GROUP_RANK, SLURM_NODEID, else 0)."""
    value = _env_int("GROUP_RANK", "SLURM_NODEID")
    if value is not None:
        return value
    local = _env_int("LOCAL_WORLD_SIZE")
    return global_ordinal() // local if local else 0


def device_type() -> str:
    """``"CUDA"`` when this process computes on a GPU, else ``"CPU"``."""
    return "CUDA" if torch.cuda.is_available() else "CPU"


def is_bf16_supported() -> bool:
    """Whether this process's device computes in bfloat16."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return True


def get_master_ip() -> str:
    """The coordinator's address (MASTER_ADDR, as torchrun sets it)."""
    address = os.environ.get("MASTER_ADDR")
    if not address:
        raise RuntimeError(
            "MASTER_ADDR is not set: get_master_ip reads the rendezvous address torchrun "
            "sets; launch with torchrun or set MASTER_ADDR"
        )
    return address


def set_device_type(pjrt_device: str) -> None:
    """Accepted for torch_xla code; the device follows the process (CUDA if present)."""
    if not isinstance(pjrt_device, str):
        raise TypeError(f"set_device_type expects a device name, got {pjrt_device!r}")
    _warn_once(
        "set_device_type",
        f"xr.set_device_type({pjrt_device!r}) selects the PJRT device on XLA; shardkit "
        f"computes on {device_type()} (the process's own device), so the call does nothing",
    )


def initialize_cache(path: str, readonly: bool = False) -> None:
    """Accepted for torch_xla code; there is no XLA compilation cache to keep."""
    _warn_once(
        "initialize_cache",
        f"xr.initialize_cache({path!r}) sets up XLA's persistent compilation cache; "
        "shardkit runs eagerly and compiles nothing, so the call does nothing",
    )
