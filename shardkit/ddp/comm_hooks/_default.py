"""All-reduce and fp16 / bf16 compression hooks.

A hook is ``hook(state, bucket) -> torch.futures.Future`` whose value is the averaged
flat gradient of the bucket. The hooks use only the public ``GradBucket`` methods, so
they run on shardkit's DDP and on ``torch.nn.parallel.DistributedDataParallel`` alike.
The hook, not the DDP, divides by the world size (as torch's hooks do).
"""
# No "from __future__ import annotations": torch DDP checks the hook return annotation
# against the real torch.futures.Future[torch.Tensor] object.

from collections.abc import Callable

import torch

from . import _comm

__all__ = [
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "fp16_compress_wrapper",
    "bf16_compress_wrapper",
]


def _value(fut: torch.futures.Future) -> torch.Tensor:
    value = fut.value()
    return value[0] if isinstance(value, (list, tuple)) else value


def allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group: what DDP does with no hook registered.

    ``process_group`` is the hook state: a process group, or None for the world.
    """
    return _comm.all_reduce_async(bucket.buffer(), process_group, average=True)


def _compress_hook(dtype: torch.dtype, process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    # Cast, then divide before the sum: halves the bytes and keeps the sum in range.
    compressed = buffer.to(dtype)
    fut = _comm.all_reduce_async(compressed, process_group, average=True)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(_value(fut))
        return buffer

    return fut.then(decompress)


def fp16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket as float16 (half the bytes); the result is cast back.

    Example::

        ddp.register_comm_hook(None, fp16_compress_hook)
    """
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket as bfloat16 (half the bytes, fp32's range).

    Runs on gloo as well as NCCL.
    """
    return _compress_hook(torch.bfloat16, process_group, bucket)


# torch's DDP refuses a hook *named* bf16_compress_hook unless it runs on NCCL / XCCL.
# Ours needs no such backend (gloo sums bfloat16), so it goes by another __name__;
# __qualname__ is kept, so the hook still pickles by reference.
bf16_compress_hook.__name__ = "shardkit_bf16_compress_hook"


def _compress_wrapper(dtype: torch.dtype, hook: Callable, name: str) -> Callable:
    if not callable(hook):
        raise TypeError(
            f"{name} expects a communication hook (a callable (state, bucket) -> Future), "
            f"got {hook!r}"
        )

    def wrapper(state, bucket) -> torch.futures.Future[torch.Tensor]:
        original = bucket.buffer()
        bucket.set_buffer(original.to(dtype))
        fut = hook(state, bucket)

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            original.copy_(_value(fut))
            return original

        return fut.then(decompress)

    wrapper.__name__ = f"{name}({getattr(hook, '__name__', type(hook).__name__)})"
    wrapper.__qualname__ = wrapper.__name__
    return wrapper


def fp16_compress_wrapper(hook: Callable) -> Callable:
    """Run ``hook`` on a float16 copy of the bucket and cast its result back.

    ``fp16_compress_wrapper(allreduce_hook)`` equals ``fp16_compress_hook``; wrapping
    ``powerSGD_hook`` halves PowerSGD's bytes again.
    """
    return _compress_wrapper(torch.float16, hook, "fp16_compress_wrapper")


def bf16_compress_wrapper(hook: Callable) -> Callable:
    """Run ``hook`` on a bfloat16 copy of the bucket and cast its result back."""
    return _compress_wrapper(torch.bfloat16, hook, "bf16_compress_wrapper")
