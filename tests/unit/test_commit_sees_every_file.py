"""Rank 0 checks, before committing, that every file the ranks wrote is in the checkpoint
directory (ranks given different paths are refused: tests/dist/test_ranks_disagree_ckpt.py)."""

from __future__ import annotations

import torch

from shardkit import checkpoint as dcp


def test_a_stale_directory_listing_does_not_fail_the_save(tmp_path, monkeypatch):
    """Before committing, rank 0 checks that every file the ranks wrote is there. A
    listing can be stale (an NFS client caches directory contents for up to a minute);
    a file the listing lacks is looked up by name before the save is refused."""
    from shardkit.checkpoint._core._storage import FileSystemWriter

    monkeypatch.setattr(FileSystemWriter, "list_files", lambda self: [])
    state = {"w": torch.arange(6.0)}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt")
    back = {"w": torch.zeros(6)}
    dcp.load(back, checkpoint_id=tmp_path / "ckpt")
    assert torch.equal(back["w"], state["w"])
