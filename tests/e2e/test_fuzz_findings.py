"""Findings of a fuzzer run over every reader (10,229 mutated checkpoints, 2026-11-29):

- a tagged float holding a 400-digit number raised a raw ``OverflowError`` from every
  reader (``load``, ``is_committed``, the manager's listing, every CLI command);
- a FIFO among FSDP rank files hung consolidation; ``/proc/self/mem`` in their place gave
  an error naming no file, and a traceback from the consolidation command;
- ``step_2`` beside ``step_00000002`` listed step 2 twice;
- ``inspect --json`` of a valid checkpoint with a NaN dict key exited 2;
- ``diff`` of tensors with more than 64 dims exited 4 ("internal error").
"""

import gc
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hostile import fail_after, shardkit
from metadata_edit import reseal_metadata

import shardkit.checkpoint as dcp
from shardkit.checkpoint import CheckpointManager, LocalTier
from shardkit.fsdp import consolidate_sharded_model_checkpoints

pytestmark = pytest.mark.timeout(120)


def test_a_tagged_float_that_is_a_number_is_damage_not_an_overflow(tmp_path):
    ck = tmp_path / "ck"
    dcp.save({"w": torch.ones(2), "best": float("inf")}, checkpoint_id=ck)
    doc = json.loads((ck / "metadata.json").read_bytes())
    doc["values"]["best"]["repr"] = "1" + "0" * 400
    reseal_metadata(ck, doc)
    with pytest.raises(dcp.CorruptCheckpointError, match="tagged float"):
        dcp.load({"w": torch.zeros(2), "best": 0.0}, checkpoint_id=ck)
    assert not dcp.is_committed(ck)
    result = shardkit("ckpt", "inspect", ck, code=3)
    assert "tagged float" in result.stderr


def _rank_file(path, rank):
    torch.save(
        {"model": {"w": torch.ones(2)}, "shard_metadata": {"rank": rank, "world_size": 2}}, path
    )


def test_a_fifo_among_rank_files_is_refused_at_once(tmp_path):
    _rank_file(tmp_path / "final_rank-00000000-of-00000002.pth", 0)
    os.mkfifo(tmp_path / "final_rank-00000001-of-00000002.pth")
    with fail_after(60), pytest.raises(OSError, match="not a regular file"):
        consolidate_sharded_model_checkpoints(
            str(tmp_path / "final"), "_rank-*-of-*.pth", save_model=False
        )


def test_an_unreadable_rank_file_is_named_and_the_command_prints_one_line(tmp_path):
    _rank_file(tmp_path / "final_rank-00000000-of-00000002.pth", 0)
    bad = tmp_path / "final_rank-00000001-of-00000002.pth"
    os.symlink("/proc/self/mem", bad)  # a regular file whose reads fail with EIO
    cmd = [sys.executable, "-m", "shardkit.fsdp.consolidate_sharded_ckpts"]
    cmd += ["--ckpt_prefix", str(tmp_path / "final"), "--ckpt_suffix", "_rank-*-of-*.pth"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert str(bad) in result.stderr


def test_a_second_spelling_of_a_step_directory_is_not_listed(tmp_path, caplog):
    run = tmp_path / "run"
    with CheckpointManager(str(run), 1, chkpt_on_preemption=False) as mgr:
        for step in range(3):
            mgr.save(step, {"w": torch.full((2,), float(step))})
    os.rename(run / "step_00000001", run / "step_1")  # the same step, spelled another way
    with caplog.at_level("WARNING"), CheckpointManager(str(run), 1, read_only=True) as mgr:
        assert mgr.all_steps() == [0, 2]
    assert "step_1 is not how this manager names a step directory" in caplog.text


def test_inspect_json_shows_a_nan_dict_key(tmp_path):
    ck = tmp_path / "ck"
    dcp.save({"w": torch.ones(2), "hist": [{float("nan"): 1, 0.5: 2}]}, checkpoint_id=ck)
    shown = json.loads(shardkit("ckpt", "inspect", "--json", ck, code=0).stdout)
    assert "nan" in json.dumps(shown) and "0.5" in json.dumps(shown)


def test_diff_compares_tensors_of_more_than_64_dims(tmp_path):
    many = torch.arange(4.0).reshape([4] + [1] * 69)
    dcp.save({"w": many}, checkpoint_id=tmp_path / "a")
    dcp.save({"w": many}, checkpoint_id=tmp_path / "b")
    dcp.save({"w": many + 1}, checkpoint_id=tmp_path / "c")
    assert "identical: 1" in shardkit("ckpt", "diff", tmp_path / "a", tmp_path / "b", code=0).stdout
    shardkit("ckpt", "diff", tmp_path / "a", tmp_path / "c", code=1)


def _steps(mgr, steps):
    for step in steps:
        mgr.save(step, {"w": torch.full((4,), float(step))})


def test_a_step_directory_copied_over_another_is_not_that_step(tmp_path, caplog):
    run = tmp_path / "run"
    with CheckpointManager(str(run), 1, chkpt_on_preemption=False) as mgr:
        _steps(mgr, range(3))
    shutil.rmtree(run / "step_00000002")
    shutil.copytree(run / "step_00000001", run / "step_00000002")  # manager.json says 1
    with caplog.at_level("WARNING"), CheckpointManager(str(run), 1, read_only=True) as mgr:
        assert mgr.all_steps() == [0, 1]
        with pytest.raises(ValueError, match="step 2 has no committed checkpoint"):
            mgr.restore(2, {"w": torch.zeros(4)})
    assert "says it holds step 1" in caplog.text


def test_a_ram_copy_moved_under_another_steps_name_is_not_that_step(tmp_path):
    run, ram = str(tmp_path / "run"), str(tmp_path / "ram")
    tier = LocalTier(interval=1, directory=ram)
    mgr = CheckpointManager(run, 10, chkpt_on_preemption=False, local_tier=tier)
    _steps(mgr, range(4))
    mgr.join()
    del mgr  # the process "dies" here: its RAM copies stay
    gc.collect()
    two, three = (glob.glob(f"{ram}/local/rank_*/step_0000000{s}")[0] for s in (2, 3))
    for name in os.listdir(three):
        if name != "tier.json":  # step 3's tier.json over step 2's data
            os.unlink(os.path.join(three, name))
    for name in os.listdir(two):
        if name != "tier.json":
            shutil.copy(os.path.join(two, name), three)
    tier = LocalTier(interval=1, directory=ram)
    with CheckpointManager(run, 10, chkpt_on_preemption=False, local_tier=tier) as mgr:
        assert mgr.latest_step() == 2
        out = {"w": torch.zeros(4)}
        mgr.restore(2, out)
        assert out["w"].tolist() == [2.0] * 4


def test_materialize_refuses_a_damaged_step_instead_of_archiving_it(tmp_path):
    src = tmp_path / "ck"
    dcp.save({"w": torch.arange(64.0)}, checkpoint_id=src)
    data = next(n for n in os.listdir(src) if n.startswith("data-"))
    with open(src / data, "r+b") as f:  # one bit of the tensor's bytes (its own file)
        f.seek(-8, os.SEEK_END)
        byte = f.read(1)
        f.seek(-8, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    result = shardkit("ckpt", "materialize", src, tmp_path / "archive", code=3)
    assert "checksum mismatch" in result.stderr
    assert not (tmp_path / "archive").exists()
    dcp.save({"w": torch.arange(64.0)}, checkpoint_id=tmp_path / "good")
    shardkit("ckpt", "materialize", tmp_path / "good", tmp_path / "copy", code=0)
    out = {"w": torch.zeros(64)}
    dcp.load(out, checkpoint_id=tmp_path / "copy")
    assert torch.equal(out["w"], torch.arange(64.0))
