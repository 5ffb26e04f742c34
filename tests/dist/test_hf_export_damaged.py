"""``to_hf`` of a damaged checkpoint (fuzzer finding, 2026-11-29): it reported "safetensors
file incomplete" (the writer's close hid the checksum mismatch), left the partial file,
and on 2 ranks the rank whose files were fine published the index of a broken export."""

import os
import shutil
import struct

import pytest
import torch
from harness import run_ranks
from hf_models import build, config

import shardkit.checkpoint as dcp
from shardkit.checkpoint import CheckpointError, CorruptCheckpointError

pytestmark = pytest.mark.timeout(180)


def _damaged_checkpoint(root):
    """A gpt2 checkpoint with one bit flipped in its last data bytes."""
    torch.manual_seed(0)
    dcp.save({"model": build("gpt2").state_dict()}, checkpoint_id=str(root))
    data = sorted(n for n in os.listdir(root) if n.startswith("data-"))[-1]
    with open(root / data, "r+b") as f:
        f.seek(-64, os.SEEK_END)  # a tensor's bytes: past the header, before the end
        byte = f.read(1)
        f.seek(-64, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    assert struct.unpack("<Q", (root / data).read_bytes()[:8])[0] > 0
    return root


def test_one_process_reports_the_damage_and_leaves_nothing(tmp_path):
    from shardkit.checkpoint.hf import to_hf

    src = _damaged_checkpoint(tmp_path / "ck")
    with pytest.raises(CorruptCheckpointError, match="checksum|stored .* read"):
        to_hf(src, tmp_path / "out", config=config("gpt2"), max_shard_size="16KB")
    left = os.listdir(tmp_path / "out") if (tmp_path / "out").exists() else []
    assert [n for n in left if n.endswith((".safetensors", ".json"))] == []


def _export_body(src, out):
    from shardkit.checkpoint.hf import to_hf

    try:
        to_hf(src, out, config=config("gpt2"), max_shard_size="16KB")
    except CorruptCheckpointError:
        return "damaged"  # this rank read the flipped bit
    except CheckpointError as exc:
        return "told" if "failed writing the HF export" in str(exc) else str(exc)
    return "succeeded"


def test_every_rank_raises_and_no_index_is_published(tmp_path):
    src = _damaged_checkpoint(tmp_path / "ck")
    out = tmp_path / "out"
    results = run_ranks(_export_body, 2, str(src), str(out))
    assert sorted(results) == ["damaged", "told"], results
    left = os.listdir(out) if out.exists() else []
    assert [n for n in left if n.endswith((".safetensors", ".json"))] == [], left


def test_a_clean_copy_still_exports(tmp_path):
    from shardkit.checkpoint.hf import to_hf

    torch.manual_seed(0)
    dcp.save({"model": build("gpt2").state_dict()}, checkpoint_id=str(tmp_path / "ck"))
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    report = to_hf(tmp_path / "ck", tmp_path / "out", config=config("gpt2"), max_shard_size="16KB")
    assert len(report.files) > 1 and (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_the_command_exits_3_for_the_damage(tmp_path):
    from hostile import shardkit

    src = _damaged_checkpoint(tmp_path / "ck")
    config("gpt2").to_json_file(tmp_path / "config.json")
    args = ["ckpt", "convert", src, tmp_path / "out", "--to", "hf"]
    result = shardkit(*args, "--config", tmp_path / "config.json", code=3)
    assert "checksum mismatch" in result.stderr and "incomplete" not in result.stderr
