"""Auto-wrap policies for :class:`~shardkit.fsdp.FullyShardedDataParallel`.

A policy is ``policy(module, recurse, nonwrapped_numel) -> bool``: asked with
``recurse=True`` whether to descend into ``module``, and with ``recurse=False`` whether
``module`` should become its own FSDP unit. Bind options with :func:`functools.partial`.
"""

from ._wrap import (
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

__all__ = [
    "always_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "lambda_auto_wrap_policy",
]
