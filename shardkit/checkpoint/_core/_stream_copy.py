"""Streaming (non-temporal) copies: async-save staging, and resharded loads.

Staging writes bytes that no CPU reads again until the background writer reaches them,
long after they would have left the cache. Ordinary stores first read every destination
cache line (read-for-ownership) and evict the training loop's working set; streaming
stores do neither. glibc's memcpy switches to them only above a threshold derived from
the L3 size, which on server CPUs lies far above one tensor, and ``Tensor.copy_`` never
uses them.

Python, numpy and torch offer no way to issue streaming stores, so on x86-64 Linux with
AVX this module assembles a small copy routine (below, one instruction per line), maps
it into a read+execute page and calls it through ctypes, which releases the GIL while it
runs. Two routines: a flat copy that reads four 4 KiB pages side by side, 64 bytes
from each per iteration, so four DRAM streams are in flight at once (the scheme glibc
uses for its own large copies): about 1.8x ``copy_`` here; and a row copy, for a
resharded load writing chunk rows into strided slots of the destination rows. Both are
checked against ``copy_`` on first use. On any other platform, if a check fails, or with
``SHARDKIT_STREAMING_COPY=0``, the callers use ``copy_`` / ``torch.cat``.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import platform
import threading

import torch

__all__ = [
    "can_stream_rows",
    "stream_copy",
    "stream_copy_rows",
    "stream_rows_checked",
    "streaming_available",
]

_PAGE = 4096
_BLOCK = 4 * _PAGE  # bytes per outer iteration: four pages side by side
_ALIGN = 32  # streaming stores of 32 bytes need a 32-byte aligned destination
_MIN_BYTES = 1 << 20  # below this, the call overhead outweighs the gain
_MIN_ROWS_BYTES = 64 << 10  # the same for row copies (resharded loads copy in pieces)

_Routines = collections.namedtuple("_Routines", "blocks rows")
_lock = threading.Lock()
_routines = None  # _Routines of ctypes functions, False once known to be unavailable
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


def _assemble_blocks() -> bytes:
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
    return outer + _EPILOGUE


#: sfence (streaming stores become visible before anything after); vzeroupper; ret
_EPILOGUE = b"\x0f\xae\xf8" + b"\xc5\xf8\x77" + b"\xc3"


def _assemble_rows() -> bytes:
    """``void copy(void *dst /*rdi*/, const void *src /*rsi*/, size_t rows /*rdx*/,
    size_t row_bytes /*rcx*/, size_t dst_stride /*r8*/, size_t src_stride /*r9*/)``;
    ``rows`` > 0, ``row_bytes`` a positive multiple of 32, ``dst`` and ``dst_stride``
    32-byte aligned."""
    col = b"\xc5\xfe\x6f\x04\x06"  # vmovdqu ymm0, [rsi + rax]
    col += b"\xc5\xfd\xe7\x04\x07"  # vmovntdq [rdi + rax], ymm0
    col += b"\x48\x83\xc0\x20"  # add rax, 32
    col += b"\x48\x39\xc8"  # cmp rax, rcx
    col += bytes([0x72, -(len(col) + 2) & 0xFF])  # jb col
    row = b"\x31\xc0" + col  # xor eax, eax; the row's columns
    row += b"\x4c\x01\xc7"  # add rdi, r8
    row += b"\x4c\x01\xce"  # add rsi, r9
    row += b"\x48\xff\xca"  # dec rdx
    row += bytes([0x75, -(len(row) + 2) & 0xFF])  # jnz row
    return row + _EPILOGUE


def _cpu_has_avx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx" in line.split()
    except OSError:
        pass
    return False


def _load_routines():
    if os.environ.get("SHARDKIT_STREAMING_COPY", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if not _cpu_has_avx():
        return False
    try:
        blocks_code, rows_code = _assemble_blocks(), _assemble_rows()
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        page.write(blocks_code)
        page.seek(_ROWS_AT)
        page.write(rows_code)
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
            return False  # a W^X policy forbids it: copy_ it is
        ptr, size = ctypes.c_void_p, ctypes.c_size_t
        blocks = ctypes.CFUNCTYPE(None, ptr, ptr, size)(address)
        rows = ctypes.CFUNCTYPE(None, ptr, ptr, size, size, size, size)(address + _ROWS_AT)
    except (OSError, ValueError, AttributeError, TypeError):
        return False
    _keep_alive.append(page)
    return _Routines(blocks, rows) if _self_test(blocks, rows) else False


#: where the row routine starts in the executable page
_ROWS_AT = 1024


def _self_test(blocks, rows) -> bool:
    """Both routines against copy_: unaligned sources, several blocks, a tail, strides."""
    src = torch.randint(0, 256, (3 * _BLOCK + 1000,), dtype=torch.uint8)[1:]
    dst = torch.zeros(src.numel() + _ALIGN, dtype=torch.uint8)
    skip = -dst.data_ptr() % _ALIGN
    out = dst[skip : skip + src.numel()]
    body = src.numel() // _BLOCK * _BLOCK
    blocks(out.data_ptr(), src.data_ptr(), body)
    out[body:].copy_(src[body:])
    ok = torch.equal(out, src) and not dst[:skip].any()
    grid = torch.zeros(37, 256 + _ALIGN, dtype=torch.uint8)
    slot = grid[:, -grid.data_ptr() % _ALIGN :][:, 64:160]  # 96-byte rows, 288-byte stride
    part = torch.randint(0, 256, (37, 97), dtype=torch.uint8)[:, 1:]
    rows(slot.data_ptr(), part.data_ptr(), 37, 96, grid.stride(0), part.stride(0))
    expect = torch.zeros_like(grid)
    expect[:, -grid.data_ptr() % _ALIGN :][:, 64:160] = part
    return ok and torch.equal(grid, expect)


def streaming_available() -> bool:
    """Whether streaming stores are in use on this machine."""
    global _routines
    with _lock:
        if _routines is None:
            _routines = _load_routines()
    return _routines is not False


def _plain(*tensors: torch.Tensor) -> bool:
    """Dense tensors whose memory holds their values as is (no lazy conj/neg views)."""
    return all(
        t.layout == torch.strided and not t.is_conj() and not t.is_neg() and not t.is_quantized
        for t in tensors
    )


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
        or not _plain(dst, src)
        or not (src.is_contiguous() and dst.is_contiguous())
        or dst.data_ptr() % _ALIGN
        or not streaming_available()
    ):
        dst.copy_(src)
        return
    body = nbytes // _BLOCK * _BLOCK
    if body:  # the routine needs at least one block
        _routines.blocks(dst.data_ptr(), src.data_ptr(), body)
    if body < nbytes:
        flat_dst, flat_src = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        flat_dst[body:].copy_(flat_src[body:])


def _row_layout(t: torch.Tensor) -> tuple[int, int] | None:
    """(bytes per dim-0 row, bytes between rows) if each row of ``t`` is contiguous."""
    expect = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expect:
            return None
        expect *= size
    return expect * t.element_size(), t.stride(0) * t.element_size()


def can_stream_rows(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether :func:`stream_copy_rows` can copy ``src`` into ``dst`` with streaming
    stores: CPU tensors of one dtype and shape, each dim-0 row contiguous in both, rows a
    multiple of 32 bytes, ``dst`` rows 32-byte aligned, and enough bytes to be worth it."""
    if (
        dst.dim() < 2
        or src.device.type != "cpu"
        or dst.device.type != "cpu"
        or src.dtype != dst.dtype
        or src.shape != dst.shape
        or not _plain(dst, src)
        or dst.data_ptr() % _ALIGN
    ):
        return False
    dst_rows, src_rows = _row_layout(dst), _row_layout(src)
    if dst_rows is None or src_rows is None:
        return False
    row_bytes, dst_stride = dst_rows
    return (
        row_bytes * dst.shape[0] >= _MIN_ROWS_BYTES
        and dst.shape[0] > 0  # the routine needs at least one row
        and row_bytes > 0
        and row_bytes % _ALIGN == 0
        and dst_stride % _ALIGN == 0
        and (dst_stride >= row_bytes or dst.shape[0] == 1)  # rows must not overlap
        and streaming_available()
    )


def stream_copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` row by row with streaming stores (``copy_`` unless
    :func:`can_stream_rows`)."""
    if can_stream_rows(dst, src):
        stream_rows_checked(dst, src)
    else:
        dst.copy_(src)


def stream_rows_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """:func:`stream_copy_rows` for a pair that :func:`can_stream_rows` already accepted
    (callers that check a whole band first do not pay for the checks twice)."""
    row_bytes, dst_stride = _row_layout(dst)
    _, src_stride = _row_layout(src)
    _routines.rows(dst.data_ptr(), src.data_ptr(), dst.shape[0], row_bytes, dst_stride, src_stride)
