"""The background side of :class:`CheckpointManager`: async saves finishing, the
incremental base pins, retention passes, and the waits for them (kept here to keep
the manager short; it is a mixin of the manager, using its attributes)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .._core._errors import CheckpointError
from ._refs import referenced_files
from ._retention import steps_to_delete

__all__ = ["BackgroundMethods"]

log = logging.getLogger("shardkit.checkpoint._manager._manager")


class BackgroundMethods:
    """Async-save completion, base pins and retention of :class:`CheckpointManager`."""

    _lock: threading.Lock
    _errors: list[BaseException]
    _in_flight: deque
    _pins: dict[int, int]
    _metrics: dict[int, Any]
    _retention: ThreadPoolExecutor
    _retention_futures: list[Future]
    _last_committed: int | None
    _is_coordinator: bool
    _links: dict[int, dict[str, str]]
    _store: Any  # StepStore
    _lease: Any  # Lease
    preservation_policy: Any
    path: str

    def _pin_base(self) -> int | None:
        """The base of an incremental save: the newest step the coordinator saw commit.

        It is pinned (kept by retention) until the save that references it finishes, and
        broadcast so every rank references the same step.
        """

        def choose() -> int | None:
            with self._lock:
                base = self._last_committed
                if base is not None:
                    self._pins[base] = self._pins.get(base, 0) + 1
            return base

        return self._coordinated("choosing the base of an incremental save", choose)

    def _unpin(self, base: int | None) -> None:
        if base is None or not self._is_coordinator:
            return
        with self._lock:
            left = self._pins.get(base, 0) - 1
            if left > 0:
                self._pins[base] = left
            else:
                self._pins.pop(base, None)

    def _on_async_done(self, step: int, metrics, future: Future, handled, base=None) -> None:
        self._unpin(base)
        try:
            exc = future.exception()
            if exc is None:
                self._on_committed(step, metrics)
                return
            self._remove_failed(step)
            err = CheckpointError(f"background save of step {step} to {self.path} failed: {exc}")
            err.__cause__ = exc
            with self._lock:
                self._errors.append(err)
                self._failed_steps.add(step)
        finally:
            handled.set()

    def _on_committed(self, step: int, metrics) -> None:
        if not self._is_coordinator:
            return
        with self._lock:
            self._last_committed = max(step, self._last_committed or 0)
            self._metrics[step] = metrics
            try:
                self._retention_futures.append(self._retention.submit(self._retain))
            except RuntimeError:  # interpreter exiting: the next writer's pass will do it
                log.debug("retention pass after step %d skipped: shutting down", step)

    def _retain(self) -> None:
        """One retention pass over storage (coordinator, retention thread); never raises.

        A failure is logged and retried by the next pass: raising on the coordinator
        alone would desynchronise the ranks.
        """
        if self.preservation_policy is None:
            return
        try:
            self._retain_pass()
        except Exception as exc:
            log.warning(
                "retention pass under %s failed, so no step was deleted (the next save "
                "retries): %s: %s",
                self.path, type(exc).__name__, exc,
            )  # fmt: skip

    def _retain_pass(self) -> None:
        self._lease.renew(force=False)  # a writer that lost its lease deletes nothing
        committed = self._store.committed_steps()
        with self._lock:
            known = {s: self._metrics[s] for s in committed if s in self._metrics}
        for s in committed:
            if s not in known:
                known[s] = self._store.read_metrics(s)
        with self._lock:
            pinned = set(self._pins)  # bases of saves in flight
        doomed = [s for s in steps_to_delete(self.preservation_policy, known) if s not in pinned]
        # files of deleted steps that kept steps still reference stay (see _refs.py)
        referenced = referenced_files(
            self._store, [s for s in committed if s not in doomed], self._links
        )
        for s in doomed:
            try:
                self._store.delete(s, referenced)
            except Exception as exc:  # retried by the next pass; training goes on
                log.warning("could not delete step %d under %s: %s", s, self.path, exc)
                continue
            with self._lock:
                self._metrics.pop(s, None)
        if committed:  # shared files that no kept step references any more
            self._store.remove_incomplete(referenced, below=committed[-1])

    # -- waiting ------------------------------------------------------------------------
    def _wait_in_flight(self, keep: int) -> None:
        while len(self._in_flight) > keep:
            step, future, handled = self._in_flight.popleft()
            try:
                future.result()
            except BaseException:
                pass  # recorded by the done callback; raised below
            handled.wait()
            self._roll_back_failed(step)
        self._raise_errors()

    def _roll_back_failed(self, step: int) -> None:
        """A background save of ``step`` that failed did not happen: it (and the
        preemption checkpoint, if it was that) can be saved again, as after a failed
        blocking save. Every rank sees the same failure (the core agrees on it)."""
        previous = self._previous_step.pop(step, None)
        while previous in self._rolled_back:  # the save before it failed too
            previous = self._rolled_back[previous]
        with self._lock:
            failed = step in self._failed_steps
            self._failed_steps.discard(step)
        if failed:
            self._rolled_back[step] = previous
            if self._last_step == step:
                self._last_step = previous
            if self._preemption_step == step:
                self._preemption_step = None
        if not self._in_flight:
            self._rolled_back.clear()

    def _wait_retention(self) -> None:
        with self._lock:
            pending, self._retention_futures = self._retention_futures, []
        for future in pending:
            future.result()

    def _raise_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]
