"""Exhaustive single-byte damage: every byte of every file of a small checkpoint, changed
(all bits inverted at even positions, the lowest bit at odd ones, so both a byte
replacement and a single bit flip hit every field), must make load raise
CorruptCheckpointError or load exactly the original values. The checkpoint is a few KB (two data files: two ranks' worth
of chunks, written by one process with two threads); the whole sweep loads in-process and
takes a few seconds (the measured time is printed with ``-s``).
"""

import time

import pytest
import torch
from column_planner import ColumnPlanner

import shardkit.checkpoint as dcp


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(6, 8, generator=g),
        "h": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "step": 3,
        "cfg": {"lr": 0.1, "betas": (0.9, 0.99)},
    }


def _target():
    return {
        "w": torch.zeros(6, 8),
        "h": torch.zeros(4, 4, dtype=torch.bfloat16),
        "step": 0,
        "cfg": {},
    }


def _same(a, b):
    return (
        torch.equal(a["w"], b["w"])
        and torch.equal(a["h"], b["h"])
        and a["step"] == b["step"]
        and a["cfg"] == b["cfg"]
    )


def test_every_single_byte_flip_raises_or_loads_the_original(tmp_path):
    writer = dcp.FileSystemWriter(tmp_path, thread_count=2, sync_files=False)
    dcp.save(_state(), storage_writer=writer, planner=ColumnPlanner())
    files = sorted(p for p in tmp_path.iterdir())
    assert len(files) == 3, files  # metadata.json and two data files
    total = sum(p.stat().st_size for p in files)
    assert total < 8192, total
    reference = _target()
    dcp.load(reference, checkpoint_id=tmp_path)
    assert _same(reference, _state())

    start = time.perf_counter()
    raised = loaded_same = 0
    for path in files:
        original = path.read_bytes()
        for i in range(len(original)):
            for mask in (0xFF if i % 2 == 0 else 0x01,):
                damaged = bytearray(original)
                damaged[i] ^= mask
                path.write_bytes(bytes(damaged))
                out = _target()
                try:
                    dcp.load(out, checkpoint_id=tmp_path)
                except dcp.CorruptCheckpointError:
                    raised += 1
                    continue
                if not _same(out, reference):
                    pytest.fail(f"{path.name} byte {i} ^ {mask:#x} loaded different values")
                loaded_same += 1
        path.write_bytes(original)
    elapsed = time.perf_counter() - start
    print(
        f"\nflip sweep: {total} bytes = {raised + loaded_same} loads, {raised} raised, "
        f"{loaded_same} loaded the original values, {elapsed:.1f} s"
    )
    assert raised + loaded_same == total
