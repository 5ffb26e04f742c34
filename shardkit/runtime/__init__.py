"""Process-group bootstrap and rank helpers (``import shardkit.runtime as xr``)."""

from ._runtime import (
    default_backend,
    device,
    global_ordinal,
    global_runtime_device_count,
    init,
    is_initialized,
    is_spmd,
    local_rank,
    use_spmd,
    world_size,
)

__all__ = [
    "default_backend",
    "device",
    "global_ordinal",
    "global_runtime_device_count",
    "init",
    "is_initialized",
    "is_spmd",
    "local_rank",
    "use_spmd",
    "world_size",
]
