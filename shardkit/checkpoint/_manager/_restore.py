"""CheckpointManager.restore: one step into a state dict, from the fastest source."""

from __future__ import annotations

import logging

from .._core._errors import CheckpointError, CorruptCheckpointError
from ._comm import flags_and_ranges

__all__ = ["RestoreMethods"]

log = logging.getLogger(__name__)


class RestoreMethods:
    """The restore half of :class:`CheckpointManager` (a mixin over its state)."""

    def restore(self, step: int, state_dict: dict) -> dict:
        """Load committed ``step`` into ``state_dict`` in place, resharding as needed.

        Prime optimizers first (:func:`prime_optimizer`) so their state exists to load into.
        Returns ``state_dict``. With a local tier each rank reads the fastest source of its
        shard (local, peer, persistent; see :attr:`last_restore`).
        """
        self._check_open()
        step = self._check_step(step)
        _, ((lo, hi),) = flags_and_ranges([], [step], self._ctrl, len(self._ranks))
        if lo != hi:  # each rank would load another step: a model of mixed steps
            raise ValueError(
                f"the ranks passed steps from {lo} to {hi} to restore() under {self.path}; "
                f"every rank must restore the same step (this rank: step {step}). "
                "Nothing restored"
            )
        # No retention pass may delete the step while it is read.
        self._wait_in_flight(0)
        self._wait_retention()
        if self._tiers is not None:
            self._tiers.restore(step, state_dict)
            self._warn_rollback(step)
            return state_dict
        steps = self.all_steps()
        if step not in steps:
            raise ValueError(
                f"step {step} has no committed checkpoint under {self.path}; "
                f"committed steps: {steps}"
            )
        from . import _io as io

        try:
            io.load_step(self, step, state_dict)
        except CheckpointError as exc:
            if type(exc) not in (CheckpointError, CorruptCheckpointError):
                raise  # a state dict that does not fit: the step is fine
            older = [s for s in steps if s < step]
            hint = f"; the newest older step is {older[-1]}" if older else ""
            raise type(exc)(
                f"step {step} under {self.path} could not be restored: {exc}{hint}"
            ) from exc
        self._warn_rollback(step)
        return state_dict

    def _warn_rollback(self, step: int) -> None:
        """After restoring ``step``: warn when the directory holds newer persistent steps,
        whose saves are skipped from here on (with a local tier or without)."""
        if not self.read_only and self._last_step is not None and step < self._last_step:
            tier = (
                ""
                if self._tiers is None
                else "; the local tier still saves them, and a restore never combines its "
                "copies with this directory's steps of the older training"
            )
            log.warning(
                "restored step %d under %s, which holds steps up to %d: saves of steps up "
                "to %d are skipped (the preemption checkpoint too)%s; to branch off step %d, "
                "save into a new directory",
                step,
                self.path,
                self._last_step,
                self._last_step,
                tier,
                step,
            )
