"""Argument checks of the CheckpointManager: user mistakes raise naming the value."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["check_metrics", "nonneg_int"]


def nonneg_int(name: str, value: Any, *, minimum: int = 0) -> int:
    """``value`` if it is an int >= ``minimum``, else an error naming it: TypeError for
    another type (bools, floats such as ``1.0``, None), ValueError for a smaller int."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_metrics(metrics: Any) -> dict[str, Any] | None:
    """``metrics`` if it is None or a dict of finite JSON values with str keys."""
    if metrics is None:
        return None
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise TypeError(f"metrics must be a dict with str keys, got {metrics!r}")
    try:
        json.dumps(metrics)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metrics must be JSON values (numbers, str, ...): {exc}") from None
    for key, value in metrics.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"metrics[{key!r}] = {value!r} is not finite")
    return metrics
