"""After a commit, rank 0 deletes the files of the checkpoints it replaced, and only those.

Two processes saving into one directory with ``no_dist=True`` (a misuse the docs warn
about, which torch's DCP survives) each deleted the other's files, so the metadata
committed last named files that were gone. Files modified after a save started now
stay; older orphans (a crashed save's) still go.
"""

from __future__ import annotations

import os
import time

import torch

import shardkit.checkpoint as dcp
from shardkit.checkpoint._core import _storage
from shardkit.checkpoint._core._save import join_cleanups


def _orphan(path, name: str, age_s: float) -> str:
    full = os.path.join(path, name)
    with open(full, "wb") as f:
        f.write(b"x" * 16)
    when = time.time() - age_s
    os.utime(full, (when, when))
    return name


def test_files_written_during_a_save_survive_its_cleanup(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(4)}, checkpoint_id=path)
    first = set(os.listdir(path))
    crashed = _orphan(path, "data-20000101T000000-aaaaaaaaaaaa-00000-000.safetensors", 3600)
    real = _storage.FileSystemWriter.commit
    beside = "data-20991231T235959-bbbbbbbbbbbb-00000-000.safetensors"

    def commit(self, metadata):  # another process writes its files meanwhile
        _orphan(path, beside, 0)
        real(self, metadata)

    monkeypatch.setattr(_storage.FileSystemWriter, "commit", commit)
    dcp.save({"w": torch.full((4,), 2.0)}, checkpoint_id=path)
    join_cleanups()  # the deletion runs on a background thread
    left = set(os.listdir(path))
    assert beside in left  # a save beside this one keeps its files
    assert crashed not in left and not (first - {"metadata.json"}) & left  # older ones go
    got = {"w": torch.zeros(4)}
    dcp.load(got, checkpoint_id=path)
    assert torch.equal(got["w"], torch.full((4,), 2.0))
