"""``dst.copy_(src)`` on the calling thread alone, for the checkpoint's bulk copies.

``Tensor.copy_`` splits a large copy over torch's intra-op threads. A copy is bound by
memory bandwidth, so the extra threads add little, and on a machine whose cores are
busy (the training loop's own threads, other processes) their hand-offs cost far more
than the copy: measured up to 20x slower than one thread on a loaded 2-core machine.
The reader threads of a load would also each start a team of intra-op threads. So CPU
copies of plain dtypes go through numpy, which copies on the calling thread (releasing
the GIL), strided layouts included; anything else falls back to ``copy_``.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["copy_into", "raw_array"]

#: A same-size integer dtype per item size: numpy copies raw items of any dtype through it.
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_array(t: torch.Tensor) -> np.ndarray | None:
    """``t``'s items as a numpy array of same-size integers (a view, strides kept); None
    for dtypes and layouts numpy cannot copy raw (complex, conjugated, not on the CPU)."""
    raw = _RAW.get(t.dtype.itemsize)
    if raw is None or t.is_complex() or t.device.type != "cpu" or t.is_conj() or t.is_neg():
        return None
    return t.view(raw).numpy()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-shape, same-dtype CPU tensors on one thread; other
    cases (a device, a dtype change, broadcasting) are ``copy_``'s."""
    if dst.dtype == src.dtype and dst.shape == src.shape and dst.numel():
        d, s = raw_array(dst), raw_array(src)
        if d is not None and s is not None:
            np.copyto(d, s, casting="no")
            return
    dst.copy_(src)
