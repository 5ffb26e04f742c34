"""Process-group bootstrap and rank helpers (``import shardkit.runtime as xr``).

Importing this package registers the ``xla://`` rendezvous, so torch_xla's
``dist.init_process_group("gloo", init_method="xla://")`` works unchanged.
"""

from . import _rendezvous, _xla_api
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
from ._xla_api import *  # noqa: F403  (torch_xla.runtime names; listed in _xla_api.__all__)

_rendezvous.register()

__all__ = [
    "at_teardown",
    "default_backend",
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
    *_xla_api.__all__,
]
