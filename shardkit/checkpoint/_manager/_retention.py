"""Preservation policies: which committed steps a :class:`CheckpointManager` keeps.

A policy sees every committed step with the metrics passed to ``save`` for it and
returns the steps to keep; the manager deletes the rest in the background. The
newest committed step is always kept, whatever the policy says, so a run can always
resume. Modelled on Orbax's preservation policies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from ._checks import nonneg_int

__all__ = [
    "AnyPreservationPolicy",
    "BestN",
    "EveryNSteps",
    "LatestN",
    "PreservationPolicy",
]

StepsWithMetrics = Mapping[int, Mapping[str, Any] | None]


@runtime_checkable
class PreservationPolicy(Protocol):
    """Decides which committed steps to keep.

    ``steps_with_metrics`` maps every committed step to the metrics dict given to
    ``CheckpointManager.save(..., metrics=...)`` for it (``None`` when none were given).
    """

    def should_preserve(self, steps_with_metrics: StepsWithMetrics) -> set[int]:
        """Return the subset of steps to keep."""
        ...


class LatestN:
    """Keep the ``n`` newest steps (what ``max_to_keep=n`` means)."""

    def __init__(self, n: int):
        self.n = nonneg_int("LatestN(n)", n, minimum=1)

    def should_preserve(self, steps_with_metrics: StepsWithMetrics) -> set[int]:
        """The ``n`` largest steps."""
        return set(sorted(steps_with_metrics)[-self.n :])

    def __repr__(self) -> str:
        return f"LatestN({self.n})"


class EveryNSteps:
    """Keep every step that is a multiple of ``k`` (for example, a long-term archive)."""

    def __init__(self, k: int):
        self.k = nonneg_int("EveryNSteps(k)", k, minimum=1)

    def should_preserve(self, steps_with_metrics: StepsWithMetrics) -> set[int]:
        """Steps divisible by ``k``."""
        return {s for s in steps_with_metrics if s % self.k == 0}

    def __repr__(self) -> str:
        return f"EveryNSteps({self.k})"


class BestN:
    """Keep the ``n`` best steps by one metric passed to ``save(..., metrics=...)``.

    Args:
        metric: key in the metrics dict, e.g. ``"val_loss"``.
        n: how many steps to keep.
        mode: ``"max"`` keeps the largest values, ``"min"`` the smallest.
        keep_without_metric: keep steps saved without this metric (default True), so
            a checkpoint is never dropped just because it was not evaluated. A value
            that is not a finite number (``None``, a string) counts as no metric.
    """

    def __init__(self, metric: str, n: int, *, mode: str = "max", keep_without_metric=True):
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"BestN(metric) must be a non-empty str, got {metric!r}")
        if mode not in ("max", "min"):
            raise ValueError(f"BestN(mode) must be 'max' or 'min', got {mode!r}")
        if not isinstance(keep_without_metric, bool):
            raise TypeError(
                f"BestN(keep_without_metric) must be True or False, got {keep_without_metric!r}"
            )
        self.metric = metric
        self.n = nonneg_int("BestN(n)", n, minimum=1)
        self.mode = mode
        self.keep_without_metric = keep_without_metric

    def should_preserve(self, steps_with_metrics: StepsWithMetrics) -> set[int]:
        """The ``n`` best steps by ``metric``; ties go to the newer step.

        Metrics come back from ``manager.json``, so any JSON value may turn up: one
        that is not a finite number is treated as missing rather than raising, which
        would stop every deletion, ``max_to_keep``'s too.
        """
        scored, unscored = [], set()
        for step, metrics in steps_with_metrics.items():
            value = metrics.get(self.metric) if isinstance(metrics, Mapping) else None
            if _is_score(value):
                scored.append((float(value), step))
            else:
                unscored.add(step)
        sign = -1.0 if self.mode == "max" else 1.0
        scored.sort(key=lambda vs: (sign * vs[0], -vs[1]))
        kept = {step for _, step in scored[: self.n]}
        return kept | unscored if self.keep_without_metric else kept

    def __repr__(self) -> str:
        return f"BestN({self.metric!r}, {self.n}, mode={self.mode!r})"


def _is_score(value: Any) -> bool:
    """A finite int or float (not a bool): what ``BestN`` can rank."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value)


class AnyPreservationPolicy:
    """Keep a step if any of the given policies keeps it."""

    def __init__(self, policies: Iterable[PreservationPolicy]):
        self.policies = list(policies)
        if not self.policies:
            raise ValueError("AnyPreservationPolicy needs at least one policy, got none")
        for i, policy in enumerate(self.policies):
            if not isinstance(policy, PreservationPolicy):
                raise TypeError(
                    f"AnyPreservationPolicy: policies[{i}] ({type(policy).__name__}) has no "
                    "should_preserve(steps_with_metrics) method"
                )

    def should_preserve(self, steps_with_metrics: StepsWithMetrics) -> set[int]:
        """The union of what each policy keeps."""
        kept: set[int] = set()
        for policy in self.policies:
            kept |= set(policy.should_preserve(steps_with_metrics))
        return kept

    def __repr__(self) -> str:
        return f"AnyPreservationPolicy({self.policies!r})"


def steps_to_delete(policy: PreservationPolicy | None, steps_with_metrics: StepsWithMetrics):
    """Committed steps ``policy`` does not keep, oldest first; never the newest step."""
    if policy is None or not steps_with_metrics:
        return []
    kept = set(policy.should_preserve(steps_with_metrics))
    newest = max(steps_with_metrics)
    return sorted(s for s in steps_with_metrics if s not in kept and s != newest)
