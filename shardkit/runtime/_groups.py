"""shardkit's private gloo groups: one world's, and destroyed once their owner is gone.

A ``CheckpointManager`` (and its RAM tier) talks over gloo groups of its own, so that its
control traffic never interleaves with the training's collectives, and ``async_save``
commits over one private group per rank set. torch keeps every group until it is
destroyed: at world size 2 a gloo group costs each rank 5 descriptors and 3 threads
(more at larger worlds), so a driver that opened a manager every few minutes ran out of
descriptors.

A group over the whole world whose owner was garbage-collected is *retired* here, and
destroyed the next time shardkit makes a group. Making that group connects every rank
(gloo's full-mesh connect, then a barrier on the new group), so each has left the code
that used the retired group and no message of it is still in flight. Destroying it when
its owner goes would race a rank still finishing its last collective on it.

A group over part of the world is made by its own ranks only, and torch names such a
group after its ranks and the number of live groups: after any destroy, the next one
over the same ranks can get the name of one still alive, and torch refuses it. Those
groups are never destroyed (one per owner over a subgroup), and while one lives (ours
or the application's) nothing is destroyed.

Groups are also tied to the world they were made in: after ``destroy_process_group()``
and a new ``init_process_group()``, a cached group of the old world is dead and is made
again.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ._teardown import at_teardown

__all__ = ["cached_group", "current_world", "private_group"]

_lock = threading.Lock()
_retired: list[tuple[Any, Any]] = []  # (world, group)
_cache: dict[tuple[int, ...], tuple[Any, Any]] = {}  # ranks -> (world, group)


def current_world() -> Any:
    """The default group of the current world (a new object after a re-init), or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.group.WORLD


def private_group(ranks: Sequence[int], *, owner: object = None, **kwargs: Any) -> Any:
    """A new gloo group over ``ranks``: collective over the whole world when they are the
    whole world, else over ``ranks`` only. A whole-world group is destroyed after
    ``owner`` is garbage-collected (see the module docstring); with no owner, or over
    part of the world, it lives as long as its world.

    Args:
        kwargs: passed on to ``dist.new_group`` (a ``timeout``, say).
    """
    ranks = sorted(ranks)
    whole = len(ranks) == dist.get_world_size()
    group = dist.new_group(ranks, backend="gloo", use_local_synchronization=not whole, **kwargs)
    dist.barrier(group=group)  # every one of `ranks` has come this far
    if whole:
        _destroy_retired()
        if owner is not None:
            # not at exit: the teardown drops every reference to the groups instead
            weakref.finalize(owner, _retire, current_world(), group).atexit = False
    return group


def cached_group(ranks: Sequence[int]) -> Any:
    """One private gloo group per rank set and world, made on first use (collectively,
    by ``ranks`` only when they are a subgroup of the world)."""
    key = tuple(ranks)
    world = current_world()
    hit = _cache.get(key)
    if hit is None or hit[0] is not world:
        # a group of an earlier world was destroyed with it: drop every such reference
        for stale in [k for k, (w, _) in _cache.items() if w is not world]:
            del _cache[stale]
        _cache[key] = (world, private_group(key))
    return _cache[key][1]


def _retire(world: Any, group: Any) -> None:
    with _lock:
        _retired.append((world, group))


def _destroy_retired() -> None:
    """Destroy this world's retired groups (every rank was just connected); forget
    those of an earlier world (destroyed with it)."""
    world = current_world()
    if _named_by_ranks_alive():
        return  # a destroy could make torch give a new group a live group's name
    with _lock:
        due, _retired[:] = list(_retired), []
    for old_world, group in due:
        if old_world is world:
            dist.destroy_process_group(group)


def _named_by_ranks_alive() -> bool:
    """Whether a live group was named after its ranks (``use_local_synchronization``:
    a 40-digit hash); True when torch's registry cannot be read."""
    from torch.distributed import distributed_c10d as c10d

    names = getattr(getattr(c10d, "_world", None), "pg_names", None)
    if not isinstance(names, dict):
        return True
    return any(len(n) == 40 and all(c in "0123456789abcdef" for c in n) for n in names.values())


@at_teardown
def _forget() -> None:
    """At exit, drop every reference: a group Python still holds keeps its gloo threads
    running into interpreter finalization, where they abort the process."""
    with _lock:
        _retired.clear()
    _cache.clear()
