"""Process-group bootstrap and rank helpers (``import shardkit.runtime as xr``).

Importing this package registers the ``xla://`` rendezvous, so torch_xla's
``dist.init_process_group("gloo", init_method="xla://")`` works unchanged.
"""

from . import _rendezvous
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
from ._teardown import at_teardown, drain_at_exit
from ._xla_api import (
    addressable_device_count,
    addressable_runtime_device_count,
    device_type,
    get_master_ip,
    global_device_count,
    host_index,
    initialize_cache,
    is_bf16_supported,
    local_device_count,
    local_ordinal,
    local_process_count,
    process_count,
    process_index,
    set_device_type,
)

_rendezvous.register()

__all__ = [
    "addressable_device_count",
    "at_teardown",
    "addressable_runtime_device_count",
    "default_backend",
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
    "device",
    "drain_at_exit",
    "global_ordinal",
    "global_runtime_device_count",
    "init",
    "is_initialized",
    "is_spmd",
    "local_rank",
    "use_spmd",
    "world_size",
]
