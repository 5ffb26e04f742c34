"""Notice a preemption signal (SIGTERM, or e.g. SIGUSR1 under SLURM) without dying.

The handler only sets a flag: the process is never killed mid-save by it. The
:class:`CheckpointManager` reads the flag at each ``save``/``save_async`` call and
agrees on it across ranks with one ``all_reduce(MAX)``, so a signal delivered to any
one rank makes every rank checkpoint the same step.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings

__all__ = ["PreemptionWatcher"]

_lock = threading.Lock()
# One flag and one installed handler per signal number, shared by every watcher, so
# two managers watching SIGTERM both see it. Values: [event, previous handler, users].
_installed: dict[int, list] = {}


def _handler(signum, frame):  # runs in the main thread between bytecodes
    entry = _installed.get(signum)
    if entry is not None:
        entry[0].set()


def _reset_in_child() -> None:
    """A forked child (a DataLoader worker, a helper process) is not the training
    process: give the signals their previous handlers back, so SIGTERM stops it again."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    for signum, entry in list(_installed.items()):
        previous = entry[1] if entry[1] is not None else signal.SIG_DFL
        try:
            signal.signal(signum, previous)
        except (ValueError, OSError):
            pass
    _installed.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


class PreemptionWatcher:
    """Installs a flag-setting handler for ``signum`` while alive.

    Args:
        signum: the signal that announces preemption, e.g. ``signal.SIGTERM``.

    Handlers can only be installed from the main thread; from another thread the
    watcher warns and only notices :meth:`trigger`.
    """

    def __init__(self, signum: int | signal.Signals = signal.SIGTERM):
        try:
            self.signum = signal.Signals(signum)
        except (ValueError, TypeError):
            raise ValueError(
                f"preemption_signal={signum!r} is not a signal number; use e.g. "
                "signal.SIGTERM or signal.SIGUSR1"
            ) from None
        if self.signum in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"preemption_signal={self.signum.name} cannot be caught; use e.g. "
                "signal.SIGTERM or signal.SIGUSR1"
            )
        self._local = threading.Event()
        self._entry = None
        self._closed = False
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                f"CheckpointManager created outside the main thread: cannot install a "
                f"{self.signum.name} handler, so preemption is only noticed through "
                "trigger()",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        with _lock:
            entry = _installed.get(self.signum)
            if entry is None:
                previous = signal.signal(self.signum, _handler)
                entry = [threading.Event(), previous, 0]
                _installed[self.signum] = entry
            entry[2] += 1
            self._entry = entry

    def received(self) -> bool:
        """Whether the signal (or :meth:`trigger`) arrived since the handler was installed."""
        return self._local.is_set() or (self._entry is not None and self._entry[0].is_set())

    def trigger(self) -> None:
        """Act as if the signal arrived (for tests and for schedulers that poll)."""
        self._local.set()

    def close(self) -> None:
        """Uninstall the handler once no watcher uses it; restores the previous one."""
        if self._closed:
            return
        self._closed = True
        if self._entry is None:
            return
        with _lock:
            self._entry[2] -= 1
            # Off the main thread the handler cannot be swapped back; keep the entry so
            # the signal is still noticed rather than silently swallowed.
            on_main = threading.current_thread() is threading.main_thread()
            if self._entry[2] == 0 and on_main and _installed.get(self.signum) is self._entry:
                del _installed[self.signum]
                signal.signal(self.signum, self._entry[1])
