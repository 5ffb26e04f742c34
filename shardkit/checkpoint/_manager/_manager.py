"""CheckpointManager: one committed checkpoint per step, retention, async saves, preemption.

See docs/checkpoint-manager.md. All ranks of ``process_group`` construct the manager
and call ``save``/``save_async``/``all_steps``/``latest_step``/``restore``/``join``
together: each is (or may be) a collective over the manager's own gloo group, which
is separate from the training group so background work can never interleave with it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from ... import runtime
from .._core._errors import CheckpointError
from .._core._fs_rules import refuse_per_process
from ._background import BackgroundMethods
from ._checks import check_metrics as _check_metrics
from ._checks import nonneg_int as _nonneg_int
from ._comm import flags_and_ranges
from ._lease import MAX_LEASE_AHEAD_S, Lease
from ._preemption import PreemptionWatcher
from ._restore import RestoreMethods
from ._retention import AnyPreservationPolicy as _Any
from ._retention import LatestN, PreservationPolicy
from ._setup import SetupMethods
from ._storage import StepStore
from ._tiered import TierEngine, TierMethods
from ._tiers import LocalTier

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)


class CheckpointManager(SetupMethods, BackgroundMethods, TierMethods, RestoreMethods):
    """Saves a checkpoint every ``save_interval`` steps under ``path`` and prunes old ones.

    Args:
        path: fsspec URL of the run's directory (local path, ``memory://``, ``s3://``...).
        save_interval: ``should_save(step)`` is true when ``step % save_interval == 0``.
        max_to_keep: keep only the newest N committed steps (0: no count limit, so every
            step is kept unless ``preservation_policy`` says otherwise). Older ones are
            deleted in the background once a newer step has committed.
        max_pending_async: how many ``save_async`` saves may be in flight; the next waits.
        process_group: the ranks that take part (default: the world). The manager runs
            its own collectives on a private gloo group over those ranks.
        chkpt_on_preemption: watch ``preemption_signal`` and checkpoint at the next save
            call on every rank when any rank received it. Not with ``read_only``: a
            reader cannot checkpoint, so the signal stops it as usual.
        preemption_signal: the signal announcing preemption (e.g. ``signal.SIGUSR1``).
        preservation_policy: a :class:`PreservationPolicy` (``EveryNSteps``, ``BestN``,
            ...); a step is kept when it or ``max_to_keep`` (if > 0) keeps it. The newest
            committed step is never deleted.
        storage_options: fsspec options for ``path`` (credentials, ``endpoint_url``...).
        async_process_group: names the ranks of the background commit of ``save_async``
            (must be the same ranks as ``process_group``); the commit itself always runs
            on the checkpoint core's private gloo group for those ranks, never on the
            training group.
        read_only: a reader (an evaluator, a tool): ``save`` raises, and nothing under
            ``path`` is ever deleted or written. Without it the manager is also a
            reader until its first save, which takes the writer's lease on ``path``.
        lease_ttl: seconds the writer's lease outlives its last renewal (it is renewed
            at every save and every ``lease_ttl / 3`` s in the background).
        take_over_lease: take the lease even if another writer's lease is live (use
            when that writer is known to be gone; it fails at its next save).
        num_of_threads: torch_xla's option: data files each rank writes in parallel.
        max_file_bytes: most tensor bytes per data file of a step (``FileSystemWriter``'s
            cap; HF uses 5 GB shards); a rank's share then spans several files. None: no
            cap.
        zero_stall: ``save_async`` and the RAM tier copy the tensors an optimizer owns on
            a background thread while training goes on (the next ``optimizer.step()``
            waits for that copy). False copies the whole state in the call instead: for
            loops that change weights outside ``optimizer.step()`` right after saving.
        incremental: save each step as an incremental checkpoint of the previous committed
            step: chunks whose bytes did not change (a frozen base model, LoRA) are not
            rewritten but referenced. Retention keeps every file a kept step references.
            Off by default: a step directory is then no longer self-contained (copy it
            with ``shardkit ckpt materialize``). See docs/checkpoint-manager.md.
        local_tier: a :class:`LocalTier`: also keep rank-local copies in node-local RAM
            every ``interval`` steps, replicated to a peer rank; ``latest_step`` and
            ``restore`` then use the fastest tier that has every rank's shard.
        verify_replicas: as in :func:`shardkit.checkpoint.save`: compare the ranks'
            copies of replicated tensors at every save (False: skip the check).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        save_interval: int,
        max_to_keep: int = 0,
        max_pending_async: int = 1,
        process_group: dist.ProcessGroup | None = None,
        chkpt_on_preemption: bool = True,
        *,
        preemption_signal: int = signal.SIGTERM,
        preservation_policy: PreservationPolicy | None = None,
        storage_options: dict[str, Any] | None = None,
        async_process_group: dist.ProcessGroup | None = None,
        read_only: bool = False,
        lease_ttl: float = 60.0,
        take_over_lease: bool = False,
        num_of_threads: int = 1,
        max_file_bytes: int | None = None,
        zero_stall: bool = True,
        incremental: bool = False,
        local_tier: LocalTier | None = None,
        verify_replicas: bool = True,
    ):
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise TypeError(f"path must be a non-empty str or os.PathLike URL, got {path!r}")
        self.save_interval = _nonneg_int("save_interval", save_interval, minimum=1)
        self.max_to_keep = _nonneg_int("max_to_keep", max_to_keep)
        self.max_pending_async = _nonneg_int("max_pending_async", max_pending_async, minimum=1)
        #: torch_xla's option: files each rank writes in parallel per checkpoint
        self.num_of_threads = _nonneg_int("num_of_threads", num_of_threads, minimum=1)
        #: most tensor bytes per data file of a step (None: no cap), as FileSystemWriter's
        self.max_file_bytes = (
            None
            if max_file_bytes is None
            else _nonneg_int("max_file_bytes", max_file_bytes, minimum=1)
        )
        if not isinstance(zero_stall, bool):
            raise TypeError(f"zero_stall must be True or False, got {zero_stall!r}")
        #: save_async (and the RAM tier) copy in the background (True) or in the call
        self.zero_stall = zero_stall
        if not isinstance(chkpt_on_preemption, bool):
            raise TypeError(f"chkpt_on_preemption must be a bool, got {chkpt_on_preemption!r}")
        if preservation_policy is not None and not isinstance(
            preservation_policy, PreservationPolicy
        ):
            raise TypeError(
                f"preservation_policy must have should_preserve(steps_with_metrics), got "
                f"{type(preservation_policy).__name__}"
            )
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict, got {storage_options!r}")
        for name, flag in (("read_only", read_only), ("take_over_lease", take_over_lease)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if isinstance(lease_ttl, bool) or not isinstance(lease_ttl, (int, float)):
            raise TypeError(
                f"lease_ttl must be a number of seconds >= 1, got {type(lease_ttl).__name__} "
                f"{lease_ttl!r}"
            )
        if not 1.0 <= lease_ttl <= MAX_LEASE_AHEAD_S:
            raise ValueError(
                f"lease_ttl must be a number of seconds from 1 to {MAX_LEASE_AHEAD_S} (100 "
                f"years), got {lease_ttl!r}"
            )
        self.read_only = read_only
        self._take_over = take_over_lease
        if not isinstance(incremental, bool):
            raise TypeError(f"incremental must be a bool, got {incremental!r}")
        self.incremental = incremental
        if not isinstance(verify_replicas, bool):
            raise TypeError(f"verify_replicas must be True or False, got {verify_replicas!r}")
        self.verify_replicas = verify_replicas
        policies = [LatestN(self.max_to_keep)] if self.max_to_keep else []
        policies += [preservation_policy] if preservation_policy is not None else []
        self.preservation_policy = (
            None if not policies else policies[0] if len(policies) == 1 else _Any(policies)
        )
        self._store = StepStore(os.fspath(path), storage_options)
        self.path = self._store.url
        if self._store.fs.isfile(self._store.root):
            raise ValueError(
                f"CheckpointManager path {self.path!r} is a file; it must be a directory (or "
                "not exist yet), where each step becomes a subdirectory"
            )
        runtime.init()  # join the world the environment describes (torchrun, SLURM)
        self._lease = Lease(self._store.fs, self._store.root, ttl=float(lease_ttl))
        self._init_groups(process_group, async_process_group)
        self._agree_on_options(
            {
                "save_interval": self.save_interval,
                "max_to_keep": self.max_to_keep,
                "max_pending_async": self.max_pending_async,
                "chkpt_on_preemption": chkpt_on_preemption,
                "read_only": read_only,
                "incremental": incremental,
                "zero_stall": zero_stall,
                "verify_replicas": verify_replicas,
                # a wrong tier type is refused with its own message just after
                "local_tier.interval": getattr(local_tier, "interval", None),
                "local_tier.peer": getattr(local_tier, "peer", None),
                "local_tier.max_to_keep": getattr(local_tier, "max_to_keep", None),
                "local_tier.max_bytes": getattr(local_tier, "max_bytes", None),
            }
        )
        refuse_per_process(self._store.fs, self.path, len(self._ranks))
        self._tiers = None if local_tier is None else TierEngine(self, local_tier)
        # a reader never saves: it leaves the signal to stop the process, as without it
        watch = chkpt_on_preemption and not read_only
        self._watcher = PreemptionWatcher(preemption_signal) if watch else None
        if self._watcher is not None:  # a manager dropped without close() gives SIGTERM back
            weakref.finalize(self, self._watcher.close)
        self._lock = threading.Lock()
        self._in_flight: deque[tuple[int, Future, threading.Event]] = deque()
        self._errors: list[BaseException] = []
        self._previous_step: dict[int, int | None] = {}  # in-flight step -> step before it
        self._failed_steps: set[int] = set()  # background saves that failed, not yet seen
        self._rolled_back: dict[int, int | None] = {}  # failed step -> step before it
        self._stale_preemption_warned = False
        self._stale_tier_warned = False  # a step saved to RAM only, its persistent save stale
        self._retention = ThreadPoolExecutor(1, thread_name_prefix="shardkit-retention")
        self._retention_futures: list[Future] = []
        self._metrics: dict[int, dict[str, Any] | None] = {}
        self._preemption_step: int | None = None
        self._closed = False
        self._writing = False
        self._pins: dict[int, int] = {}  # base step -> saves in flight that reference it
        self._links: dict[int, dict[str, str]] = {}  # committed step -> its linked files
        # Read-only until the first save: a manager opened on a live run (an evaluator,
        # a second trainer) never deletes what the writer is saving.
        steps = self._coordinated("listing checkpoints", self._store.committed_steps)
        if not steps and self._is_coordinator:
            self._warn_if_single_checkpoint()
        self._last_step = steps[-1] if steps else None
        self._last_committed = self._last_step
        if self._is_coordinator:  # a manager dropped without close() frees its lease
            weakref.finalize(self, self._lease.release)

    # -- queries ------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether ``step`` is on the interval and newer than every step saved so far
        (of the persistent tier, or of the local tier when there is one), or a rank
        received the preemption signal, as in torch_xla: so ``if mgr.should_save(step):
        mgr.save(step, state)`` takes the preemption checkpoint too.

        While watching for preemption (before it was taken) this is collective, one
        small all-reduce: call it on every rank at the same steps, as :meth:`save`.
        """
        step = self._check_step(step)
        if self._watcher is not None and self._preemption_step is None:
            self._check_open()
            (signalled,), _ = flags_and_ranges(
                [self._watcher.received()], [], self._ctrl, len(self._ranks)
            )
            if signalled:
                return True
        if self._tiers is not None and self._tiers.due(step):
            return True
        return step % self.save_interval == 0 and (
            self._last_step is None or step > self._last_step
        )

    def all_steps(self) -> list[int]:
        """Committed steps, ascending, as the coordinator lists them (same on every rank)."""
        return self._coordinated("listing checkpoints", self._store.committed_steps)

    def latest_step(self) -> int | None:
        """The newest committed step, or None.

        With a local tier: the newest step whose every rank's shard some tier holds
        (own local copy, a peer's replica, or the persistent tier), agreed in one exchange.
        """
        if self._tiers is not None:
            self._check_open()
            return self._tiers.latest_step()
        steps = self.all_steps()
        return steps[-1] if steps else None

    def reached_preemption(self, step: int) -> bool:
        """True once a preemption checkpoint was taken (or started, async) at or before ``step``.

        The same on every rank. After it, finish with ``mgr.join()`` and exit.
        """
        step = self._check_step(step)
        return self._preemption_step is not None and step >= self._preemption_step

    @staticmethod
    def _check_step(step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, int):
            if isinstance(step, torch.Tensor) or not hasattr(step, "__index__"):
                raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
            step = int(step.__index__())
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return step

    # -- saving ---------------------------------------------------------------------------
    def save(self, step: int, state_dict: dict, force: bool = False, *, metrics=None) -> bool:
        """Save ``state_dict`` as ``step`` if due (interval, ``force`` or preemption).

        Blocks until the checkpoint is committed. Returns whether it saved. The first
        save takes the writer's lease on ``path`` (a second writer is refused with
        :class:`CheckpointError`); every rank must pass the same ``step`` and ``force``.
        """
        return self._save(step, state_dict, force, metrics, blocking=True)

    def save_async(self, step: int, state_dict: dict, force: bool = False, *, metrics=None) -> bool:
        """Like :meth:`save`, but returns once the state is staged; commits in the background.

        At most ``max_pending_async`` saves are in flight: the call waits for the oldest
        before starting another. A failed background save raises
        :class:`CheckpointError` (naming its step) here on the next call, or in :meth:`join`.
        """
        return self._save(step, state_dict, force, metrics, blocking=False)

    def _save(self, step, state_dict, force, metrics, *, blocking: bool) -> bool:
        self._check_open()
        step = self._check_step(step)
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        # Metrics are often rank-local (a loss that is NaN on one rank): their check is
        # agreed, so every rank raises at this call instead of one leaving the others
        # in a collective.
        bad_metrics = None
        try:
            metrics = _check_metrics(metrics)
        except (TypeError, ValueError) as exc:
            bad_metrics = exc
        # One collective per call: did any rank get the signal, or see a failed save?
        # A failure is raised on every rank at the same call, after all ranks waited
        # for their in-flight saves (the core fails a save on every rank alike).
        signalled = self._watcher is not None and self._watcher.received()
        with self._lock:
            failed = bool(self._errors)
        tiers = self._tiers
        tier_bytes = tiers.prepare(step, state_dict) if tiers is not None else 0
        tier_failed = tiers is not None and tiers.has_error()
        flags, ranges = flags_and_ranges(
            [signalled, failed, tier_failed, bad_metrics is not None],
            [step, int(bool(force)), tier_bytes, int(blocking)],
            self._ctrl,
            len(self._ranks),
        )
        signalled, failed, tier_failed, any_bad = flags
        (lo, hi), (f_lo, f_hi), tier_range, (b_lo, b_hi) = ranges
        if any_bad:
            if bad_metrics is not None:
                raise bad_metrics
            raise ValueError(
                f"another rank passed invalid metrics to save() of step {step} under "
                f"{self.path} (see its error); nothing saved"
            )
        if b_lo != b_hi:  # the blocking save would wait for a commit the others do later
            raise ValueError(
                f"some ranks called save() and others save_async() for step {step} under "
                f"{self.path} (this rank: {'save' if blocking else 'save_async'}); every rank "
                "must make the same call. Nothing saved"
            )
        if lo != hi or f_lo != f_hi:
            what = f"steps from {lo} to {hi}" if lo != hi else "different force= values"
            raise ValueError(
                f"the ranks passed {what} to save() under {self.path}; every rank must "
                f"save the same step (this rank: step {step}, force={force}). Nothing saved"
            )
        if failed:
            self._wait_in_flight(0)
        if tier_failed:
            tiers.raise_agreed_error()
        if tiers is not None and tier_range[0] >= 0 and tiers.due(step):
            self._become_writer()  # a RAM copy is a save: one writer per run
        preempted = signalled and self._preemption_step is None
        due = force or preempted or step % self.save_interval == 0
        stale = self._last_step is not None and step <= self._last_step
        # the copy records whether this call saves the step to storage too: a restore
        # combines the two only then (never the persistent step of an older training)
        local_saved = tiers is not None and tiers.save(
            step, *tier_range, persisted=due and not stale
        )
        if local_saved and due and stale and not (force or preempted or self._stale_tier_warned):
            self._stale_tier_warned = True
            log.warning(
                "step %d saved to the local tier only: %s holds steps up to %d, so its "
                "persistent saves of steps up to %d are skipped (after a rollback, save "
                "into a new directory to keep the new steps on storage)",
                step, self.path, self._last_step, self._last_step,
            )  # fmt: skip
        if not due or stale:
            if force and stale:
                raise ValueError(
                    f"step {step} is not newer than the last saved step {self._last_step} "
                    f"under {self.path}; steps must increase"
                )
            if preempted and stale and not self._stale_preemption_warned:
                # not taken: reached_preemption() stays False
                self._stale_preemption_warned = True
                log.warning(
                    "preemption signal at step %d not saved: it is not newer than the last "
                    "saved step %d under %s (after a rollback, save into a new directory); "
                    "the first newer step is saved instead",
                    step,
                    self._last_step,
                    self.path,
                )
            return local_saved
        # Bound the backlog: the in-flight limit, and retention of every finished commit
        # (so at most max_to_keep + max_pending_async committed steps exist at any time).
        self._wait_in_flight(0 if blocking else self.max_pending_async - 1)
        self._wait_retention()
        from . import _io as io

        self._become_writer()
        if self._last_step is not None and step <= self._last_step:
            return local_saved  # another writer committed it before we took the lease
        if preempted:
            self._preemption_step = step  # every rank agreed on this very step
        self._coordinated(
            f"preparing step {step}", lambda: self._prepare_step(step, metrics) or None
        )
        previous, self._last_step = self._last_step, step
        base = self._pin_base() if self.incremental else None
        if tiers is not None:  # the core stages one save at a time per process
            tiers.wait_staging()
        try:
            future = None if blocking else io.save_step_async(self, step, state_dict, base)
            if blocking:
                io.save_step(self, step, state_dict, base)
        except BaseException as exc:
            self._last_step = previous  # not saved: the step can be saved again
            if preempted:
                self._preemption_step = None
            self._unpin(base)
            if not isinstance(exc, Exception):
                # Ctrl-C, SystemExit: no collective clean-up (the other ranks may not have
                # been interrupted); saving the step again removes what it left.
                raise
            if blocking:  # every rank failed alike (the core agrees on errors): clean up
                self._coordinated("cleaning up", lambda: self._remove_failed(step))
            raise CheckpointError(f"save of step {step} to {self.path} failed: {exc}") from exc
        if blocking:
            self._unpin(base)
            self._on_committed(step, metrics)
        else:
            handled = threading.Event()
            self._in_flight.append((step, future, handled))
            self._previous_step[step] = previous  # where a failure rolls back to
            # The core keeps its last future alive after it is done, and a future keeps
            # its callbacks: the callback lets go of the manager once it has run, so a
            # manager dropped without close() is still collected (lease, signal handler).
            holder = [self]

            def done(f, s=step, m=metrics, h=handled, b=base) -> None:
                holder.pop()._on_async_done(s, m, f, h, b)

            future.add_done_callback(done)
        return True

    def join(self) -> None:
        """Wait for every in-flight save and retention pass; raise the first failure."""
        # Whatever fails, every save and retention pass is waited for: close() frees the
        # lease right after, and nothing may still write under it then.
        try:
            if self._tiers is not None:
                self._tiers.join()
        finally:
            try:
                self._wait_in_flight(0)
            finally:
                self._wait_retention()
        self._raise_errors()

    # -- lifecycle ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"CheckpointManager({self.path!r}) is closed")

    def close(self) -> None:
        """``join()``, then uninstall the preemption handler and stop the background thread.

        Removes this rank's local-tier files (a crash or a kill keeps them for the restart).
        """
        self._close(remove_local=True)

    def _close(self, *, remove_local: bool) -> None:
        if self._closed:
            return
        try:
            self.join()
        finally:
            self._closed = True
            if self._tiers is not None:
                self._tiers.close(remove=remove_local)
            if self._watcher is not None:
                self._watcher.close()
            self._retention.shutdown(wait=True)
            if self._is_coordinator:
                self._lease.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._close(remove_local=exc_type is None)  # an exception keeps the local tier

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self.path!r}, save_interval={self.save_interval}, "
            f"max_to_keep={self.max_to_keep}, policy={self.preservation_policy!r})"
        )
