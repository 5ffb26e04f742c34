"""Debugging hooks: ``noop_hook``."""

from ._debugging import noop_hook

__all__ = ["noop_hook"]
