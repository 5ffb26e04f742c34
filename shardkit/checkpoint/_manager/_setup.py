"""CheckpointManager's set-up: its groups, the ranks' agreement, the writer's lease.

A mixin over :class:`CheckpointManager`'s state, split from ``_manager.py`` to keep it
short. Every method here is a collective over the manager's private control group, or
runs on the coordinator and hands its result to every rank.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from ...runtime._groups import private_group
from ...runtime._json_broadcast import broadcast_json
from .._core._comm import Comm
from .._core._errors import CheckpointError
from .._core._format import METADATA_FILE
from ._run import ensure_run_id

__all__ = ["SetupMethods"]

log = logging.getLogger(__name__)


class SetupMethods:
    """Groups, option agreement and the writer's lease of :class:`CheckpointManager`."""

    def _become_writer(self) -> None:
        """Take the lease (collective), then clean up what crashed writers left."""
        if self._writing:
            return
        if self.read_only:
            raise ValueError(
                f"CheckpointManager({self.path!r}) is read-only (read_only=True); "
                "open it without read_only to save"
            )

        def acquire() -> tuple[list[int], list[int], str | None]:
            self._lease.acquire(take_over=self._take_over)
            try:
                removed = self._store.remove_incomplete()
                stale = self._store.remove_stale_temporaries()
                if stale:
                    log.warning("removed temporary files %s left under %s", stale, self.path)
                aborted = self._store.abort_stale_uploads()
                if aborted:
                    log.warning("aborted %d unfinished uploads under %s", aborted, self.path)
                # a kill between a commit and its retention pass left a step too many:
                # one pass now, before this writer's first save (never raises)
                self._retain()
                # the RAM copies record which instance of the directory they belong to
                run_id = ensure_run_id(self._store) if self._tiers is not None else None
                return removed, self._store.committed_steps(), run_id
            except BaseException:
                self._lease.release()
                raise

        removed, steps, run_id = self._coordinated("taking the writer's lease", acquire)
        if self._tiers is not None:
            self._tiers.set_run_id(run_id)
        if removed and self._is_coordinator:
            log.warning("removed incomplete step directories %s under %s", removed, self.path)
        if steps and (self._last_step is None or steps[-1] > self._last_step):
            self._last_step = steps[-1]
        self._last_committed = steps[-1] if steps else None
        self._writing = True
        if self._is_coordinator:
            self._lease.start_heartbeat()

    def _prepare_step(self, step: int, metrics) -> None:
        """Coordinator: renew the lease (fencing), make the step directory safe, metrics."""
        self._lease.renew(force=False)
        self._store.prepare_step_dir(step)
        try:
            self._store.write_metrics(step, metrics)
        except Exception as exc:  # the save itself reports a storage failure on all ranks
            log.warning("could not record metrics of step %d: %s", step, exc)

    def _remove_failed(self, step: int) -> None:
        """Coordinator, right after a failed save: its partial files go at once."""
        if not self._is_coordinator:
            return
        try:
            if self._store.remove_failed(step):
                log.warning("removed the files of the failed save of step %d", step)
        except Exception as exc:  # the next writer start removes it
            log.warning("could not remove the failed step %d under %s: %s", step, self.path, exc)

    # -- process groups ---------------------------------------------------------------
    def _init_groups(self, process_group, async_process_group) -> None:
        for name, group in (("process_group", process_group),
                            ("async_process_group", async_process_group)):  # fmt: skip
            if group is not None and not isinstance(group, dist.ProcessGroup):
                # torch_xla's 5th positional argument is num_of_threads; here it is this
                hint = (
                    "; torch_xla's num_of_threads is keyword-only here: "
                    "CheckpointManager(path, save_interval, num_of_threads=4)"
                    if name == "process_group" and type(group) is int
                    else ""
                )
                raise TypeError(
                    f"{name} must be a torch.distributed.ProcessGroup or None, got {group!r}{hint}"
                )
        if not (dist.is_available() and dist.is_initialized()):
            if process_group is not None or async_process_group is not None:
                raise ValueError(
                    "process_group/async_process_group given but torch.distributed is not "
                    "initialized; call shardkit.runtime.init() first or pass None"
                )
            self._ranks, self._rank = [0], 0
            self._ctrl = self._async_group = self._group = None
            self._is_coordinator = True
            return
        group = process_group if process_group is not None else dist.group.WORLD
        self._ranks = dist.get_process_group_ranks(group)
        self._rank = dist.get_rank(group)
        if self._rank < 0:
            raise ValueError(f"this rank ({dist.get_rank()}) is not in process_group")
        self._is_coordinator = self._rank == 0
        self._group = group
        # Private CPU group for control traffic (agreement, listings, blocking saves).
        # Destroyed once this manager is garbage-collected (torch keeps a group until then).
        self._ctrl = private_group(self._ranks, owner=self)
        if async_process_group is not None:
            async_ranks = dist.get_process_group_ranks(async_process_group)
            if async_ranks != self._ranks:
                raise ValueError(
                    f"async_process_group has ranks {async_ranks} but process_group has "
                    f"{self._ranks}; they must be the same ranks"
                )
        # Only its ranks matter: the core's async_save commits over its own private gloo
        # group for them, never over the group it is handed.
        self._async_group = async_process_group if async_process_group is not None else group

    def _warn_if_single_checkpoint(self) -> None:
        """A run path that is itself one checkpoint (``metadata.json`` at its root) lists
        no steps: say why, rather than resume from nothing."""
        try:
            single = self._store.fs.isfile(f"{self._store.root}/{METADATA_FILE}")
        except Exception:  # noqa: BLE001 - only a hint
            return
        if single:
            log.warning(
                "CheckpointManager path %s is one checkpoint (it holds %s), not a run "
                "directory: the manager keeps each step in a step_<N> subdirectory, so it "
                "lists no steps here. Load it with shardkit.checkpoint.load, or give the "
                "manager the run directory",
                self.path, METADATA_FILE,
            )  # fmt: skip

    def _agree_on_options(self, options: dict[str, Any]) -> None:
        """Raise on every rank if the ranks were given different options: each rank
        would then decide differently when to save, and wait forever in a collective
        the others never join (one small all-gather, at construction)."""
        if self._ctrl is None:
            return
        everyone = Comm(self._ctrl).all_gather_json(options)
        differ = {
            name: [entry.get(name) for entry in everyone]
            for name in options
            if any(entry.get(name) != everyone[0].get(name) for entry in everyone)
        }
        if differ:
            what = "; ".join(f"{name}: {values}" for name, values in differ.items())
            raise ValueError(
                f"CheckpointManager({self.path!r}) was given different options on different "
                f"ranks ({what}, by rank of the group); pass the same options on every rank"
            )

    def _coordinated(self, what: str, fn):
        """Run ``fn`` on the coordinator; every rank gets its result or raises its error."""
        result, cause = None, None
        if self._is_coordinator:
            try:
                result = {"ok": fn()}
            except Exception as exc:
                what_failed = str(exc) if isinstance(exc, CheckpointError) else None
                what_failed = what_failed or f"{type(exc).__name__}: {exc}"
                result, cause = {"error": what_failed}, exc
        if self._ctrl is not None and len(self._ranks) > 1:
            result = broadcast_json(result, self._ctrl)
        if "error" in result:
            raise CheckpointError(f"{what} under {self.path} failed: {result['error']}") from cause
        return result["ok"]
