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

A rank that fails skips the barrier (the others may be inside a collective it will
never join): an uncaught exception (also under an application's own ``sys.excepthook``)
or ``sys.exit``, ``exit`` or ``quit`` with a non-zero status (argparse's errors too;
not a bare ``raise SystemExit(1)``, which leaves no trace a hook could see). It closes its
connections, so a rank waiting for it in a collective fails at once instead of at the
group's timeout, and the launcher stops the rest. The barrier itself is bounded
(``SHARDKIT_EXIT_WAIT_MAX`` seconds, default 120): a rank that finished and waits longer
for the others leaves without them, saying so, for the same reason (a rank blocked in a
collective this one never called then fails instead of waiting for the timeout).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (registers its exit callback before ours)
import ctypes
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable

import torch.distributed as dist

_hooks: list[Callable[[], None]] = []
_drains: list[Callable[[], None]] = []
_owned: Callable[[], object] | None = None  # -> the default group shardkit created
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


def own_default_group(group: object = None) -> None:
    """Mark ``group`` (default: the default group about to be created) as shardkit's.

    Held through a weak reference: a strong one would keep the group's threads alive
    after a ``destroy_process_group()`` by the user, and a group the user creates later
    stays theirs.
    """
    global _owned, _registered
    _owned = weakref.ref(group) if group is not None else (lambda: dist.group.WORLD)
    if not _registered:
        _registered = True
        previous = sys.excepthook
        previous_exit = sys.exit

        def excepthook(exc_type, exc, tb):
            global _failed
            _failed = True
            previous(exc_type, exc, tb)

        def exit_(status=None):
            _note_exit_status(status)  # sys.exit(1), sys.exit("message"), argparse
            previous_exit(status)

        sys.excepthook = excepthook
        sys.exit = exit_
        _watch_builtin_exits()
        atexit.register(teardown)


def _note_exit_status(status: object) -> None:
    global _failed
    if status not in (None, 0):
        _failed = True


class _WatchedExit:
    """``exit``/``quit`` of the interactive builtins (``site``'s), noting a failing status.

    ``raise SystemExit(1)`` itself cannot be seen: Python runs no hook for it, and by
    the time exit handlers run the status is gone (docs/architecture.md, Teardown).
    """

    def __init__(self, inner: Callable[..., object]) -> None:
        self._inner = inner

    def __call__(self, code: object = None) -> object:
        _note_exit_status(code)
        return self._inner(code)

    def __repr__(self) -> str:
        return repr(self._inner)


def _watch_builtin_exits() -> None:
    import builtins

    for name in ("exit", "quit"):
        inner = getattr(builtins, name, None)  # absent under ``python -S``
        if inner is not None and not isinstance(inner, _WatchedExit):
            setattr(builtins, name, _WatchedExit(inner))


def owns_default_group() -> bool:
    """Whether shardkit created the current default process group."""
    if _owned is None or not (dist.is_available() and dist.is_initialized()):
        return False
    return _owned() is dist.group.WORLD


def teardown() -> None:
    """Release shardkit's group references, wait for every rank, destroy its groups."""
    global _owned
    if not owns_default_group():
        _owned = None
        return
    _run(_hooks)
    alive = [t.name for t in threading.enumerate() if t.name.startswith("shardkit-")]
    assert not alive, f"shardkit threads still running at teardown: {alive}"
    # an application's own excepthook may replace ours; Python still records the error
    failed = _failed or hasattr(sys, "last_value") or hasattr(sys, "last_exc")
    if not failed and not _final_barrier():
        # the barrier is still pending: freeing the group would join its worker thread,
        # blocked in it for good; the group is never freed, and the process exit closes
        # its connections (a rank waiting for this one then fails at once)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(dist.group.WORLD))
    dist.destroy_process_group()
    _owned = None
    if failed:
        _let_workers_settle()


def _let_workers_settle(limit: float = 2.0) -> None:
    """Wait (at most ``limit`` seconds) until no other thread of this process is running.

    A failed rank has no barrier to hold its finished works (see :func:`_final_barrier`),
    and a model the program still references keeps the group, and its gloo worker
    threads, alive past ``destroy_process_group()``. A worker that was descheduled just
    after finishing a collective frees that work later; if that happens once the
    interpreter finalizes, it aborts the process (``terminate called without an active
    exception``, exit -6 instead of the rank's own status; seen on a loaded 2-core
    machine about once in 20 failing runs). A worker that has freed its work sleeps on
    its queue, so once every other thread sleeps, three times in a row with the GIL
    released for 5 ms before each look (a worker waiting for the GIL to free a work gets
    it then), none is left halfway. Linux only (``/proc/self/task``); elsewhere this
    returns at once.
    """
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return
    me = str(threading.get_native_id())
    deadline, quiet = time.monotonic() + limit, 0
    while quiet < 3 and time.monotonic() < deadline:
        time.sleep(0.005)  # releases the GIL
        quiet = quiet + 1 if not _others_running(tasks, me) else 0


def _others_running(tasks: str, me: str) -> bool:
    """Whether a thread other than ``me`` is running or runnable (state ``R``)."""
    try:
        names = os.listdir(tasks)
    except OSError:
        return False
    for tid in names:
        if tid == me:
            continue
        try:
            with open(f"{tasks}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended
        if state == "R":
            return True
    return False


def _final_barrier() -> bool:
    """A barrier whose ``Work`` is never freed, so no gloo thread frees it at finalization.

    Every gloo ``Work`` enqueued from Python carries the caller's thread-local state, which
    holds Python objects; the worker thread that ran it frees it just after waking the
    caller, and that needs the GIL. Freed while the interpreter finalizes, it aborts the
    process (``~AsyncBarrierWork`` -> ``~ThreadLocalState`` -> ``take_gil`` ->
    ``pthread_exit``). Holding a Python reference from before the barrier is enqueued
    means the worker never drops the last one. The barrier also holds every earlier work
    of the group that was still in flight when it was enqueued (gloo frees a finished
    work under the queue lock, before the next enqueue can look), so none of those is
    freed on a worker thread after this returns either. One small object stays allocated
    until the process ends.
    """
    try:
        work = dist.barrier(async_op=True)
    except RuntimeError:  # a rank already left (it gave up waiting for this one)
        return True
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))
    return wait_at_exit(work, dist.get_rank())


def wait_at_exit(work, rank: int) -> bool:
    """``work.wait()``, saying on stderr why, once the wait passes
    ``SHARDKIT_EXIT_WAIT_WARN`` seconds (default 30): a rank that finished waits for the
    others, which is right while they still work but lasts until the group's timeout
    when one is blocked in a collective this rank never called."""
    after = float(os.environ.get("SHARDKIT_EXIT_WAIT_WARN", "30"))
    limit = float(os.environ.get("SHARDKIT_EXIT_WAIT_MAX", "120"))
    start, pause, warned = time.monotonic(), 0.0005, False
    while not work.is_completed():
        waited = time.monotonic() - start
        if waited >= limit:
            print(
                f"shardkit: rank {rank} reached the end of the program and waited {limit:g} s "
                "at exit for the other ranks; it leaves without them "
                "(SHARDKIT_EXIT_WAIT_MAX). A rank blocked in a collective this rank never "
                "called now fails",
                file=sys.stderr,
                flush=True,
            )
            return False
        if not warned and waited >= after:
            warned = True
            print(
                f"shardkit: rank {rank} reached the end of the program and has waited "
                f"{after:g} s at exit for the other ranks (at most {limit:g} s). If one is "
                "blocked in a collective this rank never called (e.g. `if rank == 0: "
                "st.full_tensor()`, or a save on one rank only), call collectives on every "
                "rank",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    try:
        work.wait()
    except RuntimeError:  # a rank left first (it gave up waiting, or failed)
        pass
    return True
