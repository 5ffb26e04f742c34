"""Finish pending work at interpreter exit, and tear down the group shardkit created.

Two phases, both while the interpreter and every process group are still alive:

1. **drain** (always, a world of one included): the hooks registered with
   :func:`drain_at_exit` (wait for an in-flight async save and its background
   deletions) run in ``threading``'s own exit phase, before Python stops the
   ``concurrent.futures`` workers and joins non-daemon threads. Later, an async save
   still writing would fail with "cannot schedule new futures after interpreter
   shutdown" and its checkpoint would silently never commit.
2. **teardown** (atexit, only for a default group shardkit created): the hooks
   registered with :func:`at_teardown` drop shardkit's own references to process groups
   (a Mesh's per-axis groups, the async save's private group); then a barrier on the
   default group, so no rank goes away while another still talks to it; then
   ``destroy_process_group()``. A group Python still references keeps its gloo worker
   threads after ``destroy_process_group()``; a worker that releases a finished
   collective (whose tensors Python created) while the interpreter finalizes needs the
   GIL, is torn down inside C++ and aborts the process with ``terminate called without
   an active exception``.

A rank that dies from an uncaught exception skips the barrier (the others may be
inside a collective it will never join); it exits non-zero and the launcher stops the
rest.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (registers its exit callback before ours)
import sys
import threading
import warnings
from collections.abc import Callable

import torch.distributed as dist

_hooks: list[Callable[[], None]] = []
_drains: list[Callable[[], None]] = []
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


def drain_at_exit(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` at interpreter exit while threads and thread pools still work.

    For waiting on background work (an async save) that must finish before the process
    ends, with or without a process group. Returns ``fn``.
    """
    if fn not in _drains:
        _drains.append(fn)
    return fn


def _run(hooks: list[Callable[[], None]]) -> None:
    for hook in list(hooks):
        try:
            hook()
        except Exception as exc:  # keep going: a hook's failure is reported
            warnings.warn(f"shardkit exit hook {hook!r} failed: {exc}", stacklevel=1)


def _drain() -> None:
    _run(_drains)


# threading runs these exit callbacks in reverse order of registration, before it joins
# non-daemon threads: registered after concurrent.futures' own, ours runs first
threading._register_atexit(_drain)


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
    _run(_hooks)
    alive = [t.name for t in threading.enumerate() if t.name.startswith("shardkit-")]
    assert not alive, f"shardkit threads still running at teardown: {alive}"
    if not _failed:
        dist.barrier()
    dist.destroy_process_group()
    _owned = False
