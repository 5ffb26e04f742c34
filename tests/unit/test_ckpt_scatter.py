"""Resharded loads read chunk rows straight into a strided destination (one I/O vector
per row, no scratch copy) when each chunk row lands in one contiguous run of it.

Each case checks the bytes against the saved tensor and whether the scattered path was
taken, so a wrong fast path and a regression to the scratch-copy path both show.
"""

import os

import pytest
import torch
from column_planner import ColumnPlanner

import shardkit.checkpoint as dcp
from shardkit.checkpoint._core import _format, _read_chunks
from shardkit.checkpoint._core._errors import CorruptCheckpointError


@pytest.fixture
def scattered(monkeypatch):
    """Small blocks, rows and pieces; counts the rows read by scattering."""
    monkeypatch.setattr(_format, "BLOCK_BYTES", 512)
    monkeypatch.setattr(_read_chunks, "_SCATTER_MIN_ROW", 16)
    monkeypatch.setattr(_read_chunks, "_SCATTER_MAX_ROWS", 7)
    monkeypatch.setattr(_read_chunks, "_SPLIT_BYTES", 1024)
    rows = []
    real = _read_chunks._read_rows

    def spy(files, item, offset, vecs, total, digest):
        rows.append(len(vecs))
        return real(files, item, offset, vecs, total, digest)

    monkeypatch.setattr(_read_chunks, "_read_rows", spy)
    return rows


@pytest.mark.parametrize("threads", [1, 3])
def test_column_chunks_scatter_into_place(tmp_path, scattered, threads):
    full = torch.randn(60, 24, dtype=torch.float64)
    dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([8, 10]))
    target = {"w": torch.zeros(60, 24, dtype=torch.float64)}
    dcp.load(target, storage_reader=dcp.FileSystemReader(tmp_path, thread_count=threads))
    assert torch.equal(target["w"], full)
    assert sum(scattered) == 3 * 60  # every row of every chunk, scattered


def test_padded_destination_rows(tmp_path, scattered):
    """The destination is a column window of a wider tensor (row pitch > row width)."""
    full = torch.arange(40 * 12, dtype=torch.float32).reshape(40, 12)
    dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([6]))
    wide = torch.full((40, 20), -1.0)
    dcp.load({"w": wide[:, 3:15]}, checkpoint_id=tmp_path)
    assert torch.equal(wide[:, 3:15], full)
    assert torch.equal(wide[:, :3], torch.full((40, 3), -1.0))
    assert torch.equal(wide[:, 15:], torch.full((40, 5), -1.0))
    assert sum(scattered) == 2 * 40


def test_partial_rows_take_the_scratch_path(tmp_path, scattered):
    """Loading part of a chunk's columns cannot scatter whole chunk rows."""
    full = torch.randn(30, 16, dtype=torch.float64)
    dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([8]))
    part = torch.zeros(30, 16, dtype=torch.float64)
    dcp.load({"w": part}, checkpoint_id=tmp_path)  # whole rows: scattered
    assert scattered and torch.equal(part, full)
    scattered.clear()
    dest = torch.zeros(8, 8, dtype=torch.float64).t()  # column-major: rows not contiguous
    full2 = torch.randn(8, 8, dtype=torch.float64)
    dcp.save({"v": full2}, checkpoint_id=tmp_path / "b", planner=ColumnPlanner([4]))
    dcp.load({"v": dest}, checkpoint_id=tmp_path / "b")
    assert torch.equal(dest, full2) and scattered == []


def test_short_reads_are_completed(tmp_path, scattered, monkeypatch):
    full = torch.randn(50, 16, dtype=torch.float64)
    dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([8]))
    real = os.preadv

    def short(fd, buffers, offset):  # at most 100 bytes per call, as a pipe might
        first = memoryview(buffers[0])
        return real(fd, [first[: min(100, len(first))]], offset)

    monkeypatch.setattr(_read_chunks.os, "preadv", short)
    target = torch.zeros(50, 16, dtype=torch.float64)
    dcp.load({"w": target}, checkpoint_id=tmp_path)
    assert torch.equal(target, full) and scattered


def test_corrupt_byte_in_a_scattered_chunk_is_named(tmp_path, scattered):
    full = torch.randn(40, 16, dtype=torch.float64)
    md = dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([8]))
    chunk = md.tensors["w"].chunks[1]
    path = tmp_path / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.offset + 8 * 64 + 3] ^= 0x40  # row 8 of the second chunk
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        dcp.load({"w": torch.zeros(40, 16, dtype=torch.float64)}, checkpoint_id=tmp_path)
    assert scattered


def test_remote_store_never_scatters(scattered):
    """Without a local descriptor a scattered read would be one request per row."""
    full = torch.randn(30, 16, dtype=torch.float64)
    url = "memory://shardkit-scatter/ckpt"
    dcp.save({"w": full}, checkpoint_id=url, planner=ColumnPlanner([8]))
    target = torch.zeros(30, 16, dtype=torch.float64)
    dcp.load({"w": target}, storage_reader=dcp.FileSystemReader(url, thread_count=2))
    assert torch.equal(target, full) and scattered == []
