"""Errors for mesh and partition-spec mistakes.

torch_xla reports most of these with ``assert`` (``AssertionError``) and some with
``ValueError``; shardkit raises classes that subclass both, so ``except`` clauses
written for either keep working, and the message names the entry and the fix.
"""

from __future__ import annotations

__all__ = ["MeshError", "PartitionSpecError", "PartitionSpecTypeError"]


class MeshError(ValueError, AssertionError):
    """A mesh that cannot be built: bad shape, axis names or device ids."""


class PartitionSpecError(ValueError, AssertionError):
    """A partition spec entry that does not fit the mesh or the tensor."""


class PartitionSpecTypeError(PartitionSpecError, TypeError):
    """A partition spec (or one of its entries) of a type that is not allowed."""
