"""The streaming-store copy used for async staging: exact, with a copy_ fallback."""

import os
import platform
import subprocess
import sys

import pytest
import torch

import shardkit.checkpoint as dcp
from shardkit.checkpoint._core import _stream_copy
from shardkit.checkpoint._core._stream_copy import (
    can_stream_rows,
    stream_copy,
    stream_copy_rows,
    streaming_available,
)


def _expected_available() -> bool:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    return "avx" in flags and os.environ.get("SHARDKIT_STREAMING_COPY", "1") != "0"


def test_available_exactly_where_it_should_be():
    # an x86-64 Linux CPU with AVX must get the fast path: a silent fallback would hide
    # a lost speed-up; anywhere else it must be off
    assert streaming_available() == _expected_available()


@pytest.fixture
def calls(monkeypatch):
    """Counts calls into the streaming routine (none when it is unavailable)."""
    seen = []
    if streaming_available():
        real = _stream_copy._routines
        spy = real._replace(blocks=lambda d, s, n: (seen.append(n), real.blocks(d, s, n)))
        monkeypatch.setattr(_stream_copy, "_routines", spy)
    return seen


def _aligned_empty(numel: int, dtype: torch.dtype, skew: int = 0) -> torch.Tensor:
    """A 1-d tensor whose first element sits ``skew`` bytes past a 32-byte boundary."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.empty(numel * itemsize + 64 + skew, dtype=torch.uint8)
    start = -raw.data_ptr() % 32 + skew
    return raw[start : start + numel * itemsize].view(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool])
@pytest.mark.parametrize("nbytes", [1 << 20, (1 << 20) + 16384 * 3, (5 << 20) + 7])
@pytest.mark.parametrize("src_skew", [0, 1, 24])
def test_bytes_match_copy(dtype, nbytes, src_skew, calls):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = nbytes // itemsize
    src = _aligned_empty(numel, dtype, skew=src_skew * itemsize)
    src.view(torch.uint8).copy_(torch.randint(0, 256, (src.numel() * itemsize,), dtype=torch.uint8))
    if dtype == torch.bool:
        src.view(torch.uint8).bitwise_and_(1)
    dst = _aligned_empty(numel, dtype)
    stream_copy(dst, src)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    assert len(calls) == int(streaming_available())


def test_cases_it_does_not_handle_fall_back_to_copy(calls):
    big = torch.randn(1024, 1024)
    strided_src, out = big.t(), torch.empty(1024, 1024)
    stream_copy(out, strided_src)  # non-contiguous source
    assert torch.equal(out, strided_src)
    skewed = _aligned_empty(1 << 20, torch.float32, skew=4)
    stream_copy(skewed, big.reshape(-1))  # destination not 32-byte aligned
    assert torch.equal(skewed, big.reshape(-1))
    small = torch.randn(100)
    tiny = torch.empty(100)
    stream_copy(tiny, small)  # too small to be worth it
    assert torch.equal(tiny, small)
    half = torch.empty(1024, 1024, dtype=torch.float64)
    stream_copy(half, big)  # dtype conversion
    assert torch.equal(half, big.double())
    assert calls == []


def test_async_save_stages_through_it_and_round_trips(tmp_path, calls):
    state = {
        "w": torch.randn(777, 1031),  # not a multiple of the 16 KiB block
        "b": torch.randn(3),
        "h": torch.randn(600, 1000).to(torch.bfloat16),
    }
    dcp.async_save(state, checkpoint_id=tmp_path).result()
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, checkpoint_id=tmp_path)
    for key, value in state.items():
        assert torch.equal(back[key].view(torch.uint8), value.view(torch.uint8)), key
    assert len(calls) == 2 * int(streaming_available())  # w and h; b is too small


def test_disabled_by_environment():
    code = "from shardkit.checkpoint._core._stream_copy import streaming_available as a; print(a())"
    env = dict(os.environ, SHARDKIT_STREAMING_COPY="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("cols_bytes", [(64, 256), (96, 96), (32, 4096)])
def test_rows_land_in_strided_slots_exactly(dtype, cols_bytes, monkeypatch):
    monkeypatch.setattr(_stream_copy, "_MIN_ROWS_BYTES", 0)
    part_bytes, other_bytes = cols_bytes
    itemsize = torch.empty(0, dtype=dtype).element_size()
    part_cols, other_cols = part_bytes // itemsize, other_bytes // itemsize
    rows = 301
    dest = torch.zeros(rows, part_cols + other_cols, dtype=dtype)
    src = torch.randint(0, 100, (rows, part_cols + 3), dtype=torch.uint8).to(dtype)[:, 3:]
    slot = dest[:, other_cols:]  # a strided slot; its rows are contiguous
    assert can_stream_rows(slot, src) == streaming_available() or dest.data_ptr() % 32
    stream_copy_rows(slot, src)
    assert torch.equal(slot, src)
    assert not dest[:, :other_cols].any()  # nothing written outside the slot


def test_rows_it_cannot_stream_are_still_copied(monkeypatch):
    monkeypatch.setattr(_stream_copy, "_MIN_ROWS_BYTES", 0)
    assert can_stream_rows(torch.zeros(4, 8), torch.zeros(4, 8)) == streaming_available()
    dest = torch.zeros(64, 24)  # 8-float slot rows are 32 bytes, 4-float ones are not
    src = torch.randn(64, 4)
    assert not can_stream_rows(dest[:, :4], src)  # 16-byte rows
    stream_copy_rows(dest[:, :4], src)
    assert torch.equal(dest[:, :4], src)
    column_major = torch.randn(8, 64).t()  # rows not contiguous
    assert not can_stream_rows(dest[:, 8:16], column_major)
    stream_copy_rows(dest[:, 8:16], column_major)
    assert torch.equal(dest[:, 8:16], column_major)
    assert not can_stream_rows(dest[:, 16:24], torch.randn(64, 8).double())
    assert not can_stream_rows(torch.zeros(8), torch.zeros(8))  # 1-d
    assert not can_stream_rows(torch.zeros(0, 8), torch.zeros(0, 8))  # no rows
    stream_copy_rows(torch.zeros(0, 8), torch.zeros(0, 8))
    monkeypatch.setattr(_stream_copy, "_MIN_ROWS_BYTES", 64 << 10)
    assert not can_stream_rows(torch.zeros(4, 8), torch.zeros(4, 8))  # too small to pay
