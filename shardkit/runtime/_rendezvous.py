"""``init_method="xla://"``: torch_xla's rendezvous, resolved like torchrun's environment.

Code written for torch_xla starts its group with
``dist.init_process_group("gloo", init_method="xla://")``. Importing ``shardkit.runtime``
registers a handler for that scheme, so the same line works here: the world comes from
RANK / WORLD_SIZE (or SLURM_PROCID / SLURM_NTASKS) and MASTER_ADDR / MASTER_PORT, as
torchrun sets them; a plain ``python`` run is a world of one with an in-process store.
The group then counts as shardkit's: it is torn down at exit like one :func:`init` made.
"""

from __future__ import annotations

import datetime
from urllib.parse import urlparse

import torch.distributed as dist
from torch.distributed.rendezvous import register_rendezvous_handler, rendezvous

from . import _teardown
from ._runtime import env_world

SCHEME = "xla"


def _query_int(query: str, name: str) -> int | None:
    for pair in filter(None, query.split("&")):
        key, _, value = pair.partition("=")
        if key == name and value not in ("", "-1"):
            return int(value)
    return None


def _handler(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=10), **kwargs):
    query = urlparse(url).query
    rank, size = _query_int(query, "rank"), _query_int(query, "world_size")
    world = env_world()
    if world is None and size in (None, 1):
        _teardown.own_default_group()
        yield dist.HashStore(), 0, 1
        return
    env_rank, env_size = world if world is not None else (None, None)
    rank = env_rank if rank is None else rank
    size = env_size if size is None else size
    if rank is None or size is None:
        raise ValueError(
            f"xla:// rendezvous: world_size={size} but no rank; launch with torchrun, "
            "which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    store, rank, size = next(rendezvous("env://", rank, size, timeout=timeout, **kwargs))
    _teardown.own_default_group()
    yield store, rank, size


def register() -> None:
    """Register the ``xla://`` handler unless one is registered already (torch_xla's)."""
    if not dist.is_available():
        return
    try:
        register_rendezvous_handler(SCHEME, _handler)
    except RuntimeError:  # already registered (torch_xla installed, or imported twice)
        pass
