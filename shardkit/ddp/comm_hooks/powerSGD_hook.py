"""PowerSGD low-rank gradient compression: ``PowerSGDState``, ``powerSGD_hook``,
``batched_powerSGD_hook``."""

from ._powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]
