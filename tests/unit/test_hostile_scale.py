"""Hostile metadata that is small but costs a lot to check: long dotted keys, and chunk
layouts that make the overlap check quadratic. Each must cost memory and time linear in
the file (or a bounded amount) and fail, where it fails, with a CorruptCheckpointError."""

from __future__ import annotations

import json
import tracemalloc

import pytest
import torch
from metadata_edit import reseal_metadata

import shardkit.checkpoint as dcp
from shardkit.checkpoint import CorruptCheckpointError
from shardkit.checkpoint._core import _validate
from shardkit.checkpoint._core._format import DottedParents


def test_dotted_parents_are_the_proper_prefixes():
    keys = ["a.b.c", "a.bc", "x", "opt.state.0.exp_avg", "a.b"]
    brute = set()
    for key in keys:
        parts = key.split(".")
        brute.update(".".join(parts[:i]) for i in range(1, len(parts)))
    parents = DottedParents(keys)
    probes = brute | {"a.b.c", "x", "a.bc", "opt.state.0.exp_avg", "b", "a.", "", "op", 3}
    assert {p for p in probes if p in parents} == brute


def test_a_key_of_thousands_of_parts_costs_linear_memory(tmp_path):
    long_key = ".".join(["a"] * 8000)  # the set of its prefixes would take about 256 MB
    dcp.save({"w": torch.ones(3), long_key: 1}, checkpoint_id=tmp_path)
    metadata = dcp.read_metadata(tmp_path)
    tracemalloc.start()
    try:
        parents = metadata.key_parents
        assert ".".join(["a"] * 7999) in parents and long_key not in parents
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes for the prefixes of one 16 KB key"
    got = {"w": torch.zeros(3), long_key: 0}
    dcp.load(got, checkpoint_id=tmp_path)
    assert got[long_key] == 1 and torch.equal(got["w"], torch.ones(3))


def _staircase(tmp_path, n: int, *, complete: bool) -> None:
    """An n x n bool tensor whose chunk i is column i, rows [i, n): every chunk stays in
    the overlap sweep. ``complete`` adds row i, columns (i, n) for every i, so the chunks
    tile the tensor exactly and the element count cannot reject it."""
    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path)
    doc = json.loads((tmp_path / "metadata.json").read_bytes())
    name = next(iter(doc["files"]))
    chunk = next(iter(doc["tensors"].values()))["chunks"][0]

    def box(offsets, sizes, i):
        nbytes = sizes[0] * sizes[1]
        return {**chunk, "offsets": offsets, "sizes": sizes, "file": name, "name": f"c{i}",
                "offset": 0, "nbytes": nbytes, "block_rows": 1 << 40, "xxh3_64": ["0" * 16]}  # fmt: skip

    chunks = [box([i, i], [n - i, 1], i) for i in range(n)]
    if complete:
        chunks += [box([i, i + 1], [1, n - i - 1], n + i) for i in range(n - 1)]
    doc["tensors"] = {"x": {"dtype": "bool", "shape": [n, n], "chunks": chunks}}
    doc["files"] = {name: 1 << 40}
    reseal_metadata(tmp_path, doc)


def test_chunks_that_cannot_tile_fail_on_the_count_before_any_sweep(tmp_path, monkeypatch):
    _staircase(tmp_path, 3000, complete=False)

    def no_sweep(*args):
        raise AssertionError("the overlap sweep ran before the element count")

    monkeypatch.setattr(_validate, "_check_overlaps", no_sweep)
    with pytest.raises(CorruptCheckpointError, match=r"'x'.*cover 4501500 of its 9000000"):
        dcp.load({}, checkpoint_id=tmp_path)


def test_a_layout_too_costly_to_check_is_refused(tmp_path, monkeypatch):
    """A staircase that tiles exactly needs n^2/2 comparisons: past the budget it is
    refused, not checked for minutes. The budget is lowered so the test stays fast."""
    _staircase(tmp_path, 400, complete=True)
    monkeypatch.setattr(_validate, "MAX_OVERLAP_PAIRS", 10_000)
    with pytest.raises(CorruptCheckpointError, match=r"'x'.*more than 10000 comparisons"):
        dcp.load({}, checkpoint_id=tmp_path)
    monkeypatch.setattr(_validate, "MAX_OVERLAP_PAIRS", 1_000_000)  # the same layout, checked
    with pytest.raises(CorruptCheckpointError) as info:
        dcp.load({}, checkpoint_id=tmp_path)
    assert "comparisons" not in str(info.value)  # valid tiling: a later check (file bytes)


def test_a_real_grid_layout_fits_the_budget():
    """16,384 shards of one tensor (128 x 128) are checked within the budget, and an
    overlap among them is still found."""
    boxes = [((i, j), (i + 1, j + 1)) for j in range(128) for i in range(128)]
    _validate._check_overlaps("src", "w", 2, list(boxes))
    boxes[-1] = ((0, 0), (1, 1))
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        _validate._check_overlaps("src", "w", 2, boxes)
