"""Streaming (non-temporal) copies for async-save staging: about 1.8x ``copy_`` here.

Staging writes bytes that no CPU reads again until the background writer reaches them,
long after they would have left the cache. Ordinary stores first read every destination
cache line (read-for-ownership) and evict the training loop's working set; streaming
stores do neither. glibc's memcpy switches to them only above a threshold derived from
the L3 size, which on server CPUs lies far above one tensor, and ``Tensor.copy_`` never
uses them.

Python, numpy and torch offer no way to issue streaming stores, so on x86-64 Linux with
AVX this module assembles a small copy routine (below, one instruction per line), maps
it into a read+execute page and calls it through ctypes, which releases the GIL while it
runs. Four 4 KiB pages are copied side by side, 64 bytes from each per iteration, so
four DRAM streams are in flight at once (the scheme glibc uses for its own large
copies). The routine is checked against ``copy_`` on first use. On any other platform,
if that check fails, or with ``SHARDKIT_STREAMING_COPY=0``, :func:`stream_copy` is
``copy_``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import threading

import torch

__all__ = ["stream_copy", "streaming_available"]

_PAGE = 4096
_BLOCK = 4 * _PAGE  # bytes per outer iteration: four pages side by side
_ALIGN = 32  # streaming stores of 32 bytes need a 32-byte aligned destination
_MIN_BYTES = 1 << 20  # below this, the call overhead outweighs the gain

_lock = threading.Lock()
_routine = None  # the ctypes function, False once known to be unavailable
_keep_alive: list = []


def _mem(reg: int, base: int, disp: int) -> bytes:
    """ModRM + SIB (+ displacement) for ``[base + rcx + disp]`` with register ``reg``."""
    sib = 0b00_001_000 | base  # scale 1, index rcx
    if disp == 0:
        return bytes([0b00_000_100 | reg << 3, sib])
    if -128 <= disp < 128:
        return bytes([0b01_000_100 | reg << 3, sib, disp & 0xFF])
    return bytes([0b10_000_100 | reg << 3, sib]) + disp.to_bytes(4, "little", signed=True)


def _imm32(value: int) -> bytes:
    return value.to_bytes(4, "little", signed=True)


def _assemble() -> bytes:
    """``void copy(void *dst /*rdi*/, const void *src /*rsi*/, size_t n /*rdx*/)``;
    ``n`` a positive multiple of 16 KiB, ``dst`` 32-byte aligned."""
    rsi, rdi = 0b110, 0b111
    inner = b""
    for page in range(4):  # ymm(2*page), ymm(2*page+1) <- 64 bytes of each page
        for half in range(2):
            # vmovdqu ymm, [rsi + rcx + disp]
            inner += b"\xc5\xfe\x6f" + _mem(2 * page + half, rsi, page * _PAGE + 32 * half)
    for page in range(4):
        for half in range(2):
            # vmovntdq [rdi + rcx + disp], ymm
            inner += b"\xc5\xfd\xe7" + _mem(2 * page + half, rdi, page * _PAGE + 32 * half)
    inner += b"\x48\x83\xc1\x40"  # add rcx, 64
    inner += b"\x48\x81\xf9" + _imm32(_PAGE)  # cmp rcx, 4096
    inner += b"\x0f\x85" + _imm32(-(len(inner) + 6))  # jne inner
    outer = b"\x31\xc9" + inner  # xor ecx, ecx; inner loop
    outer += b"\x48\x81\xc6" + _imm32(_BLOCK)  # add rsi, 16384
    outer += b"\x48\x81\xc7" + _imm32(_BLOCK)  # add rdi, 16384
    outer += b"\x48\x81\xea" + _imm32(_BLOCK)  # sub rdx, 16384
    outer += b"\x0f\x85" + _imm32(-(len(outer) + 6))  # jnz outer
    return outer + b"\x0f\xae\xf8" + b"\xc5\xf8\x77" + b"\xc3"  # sfence; vzeroupper; ret


def _cpu_has_avx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx" in line.split()
    except OSError:
        pass
    return False


def _load_routine():
    if os.environ.get("SHARDKIT_STREAMING_COPY", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if not _cpu_has_avx():
        return False
    try:
        code = _assemble()
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        page.write(code)
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
            return False  # a W^X policy forbids it: copy_ it is
        fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(address)
    except (OSError, ValueError, AttributeError, TypeError):
        return False
    _keep_alive.append(page)
    # check it against copy_: unaligned source, several blocks, a tail
    src = torch.randint(0, 256, (3 * _BLOCK + 1000,), dtype=torch.uint8)[1:]
    dst = torch.zeros(src.numel() + _ALIGN, dtype=torch.uint8)
    skip = -dst.data_ptr() % _ALIGN
    out = dst[skip : skip + src.numel()]
    body = src.numel() // _BLOCK * _BLOCK
    fn(out.data_ptr(), src.data_ptr(), body)
    out[body:].copy_(src[body:])
    return fn if torch.equal(out, src) and not dst[:skip].any() else False


def streaming_available() -> bool:
    """Whether :func:`stream_copy` uses streaming stores on this machine."""
    global _routine
    with _lock:
        if _routine is None:
            _routine = _load_routine()
    return _routine is not False


def stream_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, with streaming stores where both are contiguous CPU tensors of
    one dtype and ``dst`` is 32-byte aligned (staging buffers are)."""
    nbytes = src.numel() * src.element_size()
    if (
        nbytes < _MIN_BYTES
        or src.device.type != "cpu"
        or dst.device.type != "cpu"
        or src.dtype != dst.dtype
        or src.shape != dst.shape
        or not (src.is_contiguous() and dst.is_contiguous())
        or src.is_conj()
        or src.is_neg()
        or dst.data_ptr() % _ALIGN
        or not streaming_available()
    ):
        dst.copy_(src)
        return
    body = nbytes // _BLOCK * _BLOCK
    _routine(dst.data_ptr(), src.data_ptr(), body)
    if body < nbytes:
        flat_dst, flat_src = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        flat_dst[body:].copy_(flat_src[body:])
