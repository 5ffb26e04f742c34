"""Tear down, at interpreter exit, the process group shardkit created.

Python joins non-daemon threads (an async save's writer, a background cleanup) before
it runs atexit handlers, and then this handler runs, while the interpreter and every
process group are still alive:

1. the drain hooks other layers registered (wait for in-flight async saves, their
   background deletions, a CheckpointManager's queue), so no work is pending;
2. a barrier on the default group, so no rank (rank 0 hosts the rendezvous store)
   goes away while another still talks to it;
3. ``destroy_process_group()``, which destroys every group: the default one, a Mesh's
   per-axis groups and the async-save group. Left alive, their gloo worker threads
   still hold pending work when the interpreter finalizes, and the process aborts with
   ``terminate called without an active exception``.

A rank that dies from an uncaught exception skips the barrier (the others may be
inside a collective it will never join); it exits non-zero and the launcher stops the
rest.
"""

from __future__ import annotations

import atexit
import sys
import threading
import warnings
from collections.abc import Callable

import torch.distributed as dist

_hooks: list[Callable[[], None]] = []
_owned = False
_failed = False
_registered = False


def at_teardown(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` at exit before shardkit destroys a process group it created.

    Hooks run in registration order; one that raises is reported as a warning and the
    teardown goes on. Returns ``fn``, so this works as a decorator.
    """
    if fn not in _hooks:
        _hooks.append(fn)
    return fn


def own_default_group() -> None:
    """Mark the default process group as created by shardkit: tear it down at exit."""
    global _owned, _registered
    _owned = True
    if not _registered:
        _registered = True
        previous = sys.excepthook

        def excepthook(exc_type, exc, tb):
            global _failed
            _failed = True
            previous(exc_type, exc, tb)

        sys.excepthook = excepthook
        atexit.register(teardown)


def owns_default_group() -> bool:
    """Whether shardkit created the current default process group."""
    return _owned and dist.is_available() and dist.is_initialized()


def teardown() -> None:
    """Drain pending work, wait for every rank, destroy shardkit's process groups."""
    global _owned
    if not owns_default_group():
        _owned = False
        return
    for hook in list(_hooks):
        try:
            hook()
        except Exception as exc:  # keep tearing down: a hook's failure is reported
            warnings.warn(f"shardkit teardown hook {hook!r} failed: {exc}", stacklevel=1)
    alive = [t.name for t in threading.enumerate() if t.name.startswith("shardkit-")]
    assert not alive, f"shardkit threads still running at teardown: {alive}"
    if not _failed:
        dist.barrier()
    dist.destroy_process_group()
    _owned = False
