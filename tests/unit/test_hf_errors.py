"""Hugging Face export / import: the errors a user meets, in one process."""

import json
import re

import pytest
import safetensors.torch
import torch
import transformers
from hf_models import build, config

import shardkit.checkpoint as dcp
from shardkit.checkpoint import CheckpointError, CorruptCheckpointError
from shardkit.checkpoint._convert._hf import parse_size
from shardkit.checkpoint.hf import load_hf, to_hf
from shardkit.fsdp import FSDP


@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hfu")
    model = build("gpt2")
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model.state_dict(), "optim": {"lr": 0.5}}
    dcp.save(state, checkpoint_id=str(tmp / "train"))
    partial = {k: v for k, v in model.state_dict().items() if ".h.1." not in k}
    dcp.save({"model": partial}, checkpoint_id=str(tmp / "partial"))
    dcp.save({"a": model.state_dict(), "b": model.state_dict()}, checkpoint_id=str(tmp / "two"))
    del opt
    return tmp, model


def test_export_picks_the_model_subtree_and_reports_the_rest(gpt2_ckpt, tmp_path):
    tmp, model = gpt2_ckpt
    report = to_hf(tmp / "train", tmp_path / "out", config=config("gpt2"))
    assert report.prefix == "model."
    assert report.dropped == ["optim"]  # non-tensor values are kept whole under their key
    assert report.files == ["model-00001-of-00001.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for k, v in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, atol=0, rtol=0)


def test_export_refuses_to_leave_parameters_random(gpt2_ckpt, tmp_path):
    tmp, _ = gpt2_ckpt
    with pytest.raises(CheckpointError, match=r"lacks \d+ parameter.*transformer\.h\.1\."):
        to_hf(tmp / "partial", tmp_path / "out", config=config("gpt2"))
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_export_of_a_wrapped_models_keys_names_the_cause(gpt2_ckpt, tmp_path):
    """A checkpoint of FSDP's own state_dict() ('module.' segments, as the walkthrough of
    the manager example produced) used to fail with only the list of missing names."""
    _, model = gpt2_ckpt
    wrapped = {
        k.replace("transformer.", "module.transformer.").replace(".attn.", ".module.attn."): v
        for k, v in model.state_dict().items()
    }
    dcp.save({"model": wrapped}, checkpoint_id=str(tmp_path / "wrapped"))
    for prefix in ("model.", None):  # named (nothing under it) and found (some missing)
        with pytest.raises((ValueError, CheckpointError)) as info:
            to_hf(tmp_path / "wrapped", tmp_path / "out", config=config("gpt2"), prefix=prefix)
        message = str(info.value)
        assert "under a wrapper's names" in message and "get_model_state_dict" in message
        assert "'model.module.transformer." in message, message
    assert "--prefix" in message


def test_export_ambiguous_prefix_needs_a_name(gpt2_ckpt, tmp_path):
    tmp, _ = gpt2_ckpt
    with pytest.raises(ValueError, match=r"several prefixes \['a\.', 'b\.'\]"):
        to_hf(tmp / "two", tmp_path / "out", config=config("gpt2"))
    report = to_hf(tmp / "two", tmp_path / "out", config=config("gpt2"), prefix="b")
    assert report.prefix == "b." and len(report.dropped) > 10
    with pytest.raises(ValueError, match="no parameter of the model is under prefix 'c.'"):
        to_hf(tmp / "two", tmp_path / "o2", config=config("gpt2"), prefix="c.")


def test_export_does_not_overwrite_and_checks_arguments(gpt2_ckpt, tmp_path):
    tmp, _ = gpt2_ckpt
    to_hf(tmp / "train", tmp_path, config=config("gpt2"))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        to_hf(tmp / "train", tmp_path, config=config("gpt2"))
    to_hf(tmp / "train", tmp_path, config=config("gpt2"), overwrite=True, dtype=torch.bfloat16)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert loaded.transformer.wte.weight.dtype == torch.bfloat16
    cfg = config("gpt2")
    cfg.architectures = None
    with pytest.raises(ValueError, match="exactly one model class"):
        to_hf(tmp / "train", tmp_path / "x", config=cfg)
    with pytest.raises(ValueError, match="pass config="):
        to_hf(tmp / "train", tmp_path / "x")
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20
    assert parse_size(1024) == 1024
    for bad in ("lots", "-1", 0):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_load_hf_rejects_bad_directories(tmp_path):
    model = build("gpt2")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json"):
        load_hf(model, tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "../evil.safetensors"}})
    )
    with pytest.raises(CorruptCheckpointError, match="plain '\\*.safetensors' file name"):
        load_hf(model, tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        load_hf(model, tmp_path)


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"weight_map": ' + "[" * 100000 + "]" * 100000 + "}", "JSON nested deeper than 64"),
        ('{"x": ' + "9" * 5000 + ', "weight_map": {}}', "not valid JSON.*limit \\(4300"),
    ],
    ids=["nested 100000 deep", "5000-digit number"],
)
def test_load_hf_hostile_index_names_the_file(tmp_path, text, why):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(text)
    with pytest.raises(CorruptCheckpointError, match=f"^{re.escape(str(index))}: {why}"):
        load_hf(torch.nn.Linear(4, 2), tmp_path)


def test_load_hf_index_size_is_capped(tmp_path, monkeypatch):
    from shardkit.checkpoint._convert import _hf_import

    safetensors.torch.save_file(torch.nn.Linear(4, 2).state_dict(), tmp_path / "a.safetensors")
    wmap = {"weight": "a.safetensors", "bias": "a.safetensors"}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"pad": "x" * 1000}, "weight_map": wmap}))
    monkeypatch.setattr(_hf_import, "MAX_INDEX_BYTES", 1000)
    with pytest.raises(CorruptCheckpointError, match=f"^{re.escape(str(index))}: more than 1000"):
        load_hf(torch.nn.Linear(4, 2), tmp_path)
    monkeypatch.setattr(_hf_import, "MAX_INDEX_BYTES", 2000)  # the same index, under the cap
    assert load_hf(torch.nn.Linear(4, 2), tmp_path) == []


def test_load_hf_index_naming_a_file_without_the_key_is_refused(tmp_path):
    """The index maps 'bias' to a file that holds only 'weight': a damaged checkpoint
    naming both (was safetensors' own SafetensorError), and nothing is loaded."""
    src = torch.nn.Linear(4, 2)
    safetensors.torch.save_file({"weight": src.weight.detach()}, tmp_path / "a.safetensors")
    safetensors.torch.save_file({"bias": src.bias.detach()}, tmp_path / "b.safetensors")
    wmap = {"weight": "a.safetensors", "bias": "a.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    dst = torch.nn.Linear(4, 2)
    before = dst.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError, match=r"a\.safetensors: the index maps 'bias'"):
        load_hf(dst, tmp_path)
    assert torch.equal(dst.weight, before)


def test_load_hf_strict_names_missing_parameters(tmp_path):
    src = build("llama")
    src.save_pretrained(tmp_path)
    # drop one tensor from the file: strict load names it, strict=False keeps it
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    dst = build("llama", seed=3)
    before = dst.lm_head.weight.detach().clone()
    with pytest.raises(KeyError, match="model.norm.weight"):
        load_hf(dst, tmp_path)
    torch.testing.assert_close(dst.lm_head.weight, before, atol=0, rtol=0)  # nothing loaded
    kept = load_hf(dst, tmp_path, strict=False)
    assert "model.norm.weight" in kept
    torch.testing.assert_close(dst.lm_head.weight, src.lm_head.weight, atol=0, rtol=0)


@pytest.mark.parametrize("strict", [True, False])
def test_load_hf_with_a_prefix_no_key_has_is_refused(tmp_path, strict):
    """It loaded nothing and raised nothing, even with strict=True (errors audit)."""
    build("llama").save_pretrained(tmp_path)
    dst = build("llama", seed=3)
    with pytest.raises(ValueError, match=r"prefix='lm\.'.*\['lm_head\.', 'model\.'\]"):
        load_hf(dst, tmp_path, prefix="lm", strict=strict)


def test_save_pretrained_under_fsdp_refuses_shards_and_accepts_full_state(tmp_path):
    from shardkit.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    ref = build("gpt2")
    model = FSDP(build("gpt2"), auto_wrap_policy=None)
    with pytest.raises(ValueError, match="(?s)would write this rank's shards.*to_hf"):
        model.save_pretrained(tmp_path / "bad")
    with pytest.raises(ValueError, match="sharded values"):
        model.module.save_pretrained(tmp_path / "bad", state_dict=get_model_state_dict(model))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    model.module.save_pretrained(tmp_path / "ok", state_dict=full)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ok")
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, atol=0, rtol=0)


def test_cli_to_hf_needs_a_config_and_reports_missing_parameters(gpt2_ckpt, tmp_path, capsys):
    from shardkit.cli import main

    tmp, _ = gpt2_ckpt
    assert main(["ckpt", "convert", str(tmp / "train"), str(tmp_path / "a"), "--to", "hf"]) != 0
    assert "--to hf needs --config" in capsys.readouterr().err
    cfg = tmp_path / "config.json"
    cfg.write_text(config("gpt2").to_json_string())
    args = ["ckpt", "convert", str(tmp / "partial"), str(tmp_path / "b"), "--to", "hf"]
    assert main([*args, "--config", str(cfg)]) != 0
    assert "initialise them randomly" in capsys.readouterr().err
    args = ["ckpt", "convert", str(tmp / "train"), str(tmp_path / "c"), "--to", "hf"]
    assert main([*args, "--config", str(cfg), "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "tied (written once): lm_head.weight -> transformer.wte.weight" in out
    assert "dropped 1 key(s)" in out and "  optim" in out


def test_a_config_path_that_is_no_regular_file_is_refused_at_once(gpt2_ckpt, tmp_path):
    import os

    from hostile import fail_after

    tmp, _ = gpt2_ckpt
    os.mkfifo(tmp_path / "config.json")  # reading it would wait for a writer forever
    for path in (tmp_path / "config.json", "/dev/zero"):
        with fail_after(60), pytest.raises(OSError, match="not a regular file"):
            to_hf(tmp / "train", tmp_path / "out", config=str(path))


def test_load_hf_with_swapped_arguments_and_to_hf_with_a_missing_config(gpt2_ckpt, tmp_path):
    """load_hf(path, model) failed in os.fspath ("expected str, bytes..."), and a missing
    config file gave a bare [Errno 2] (errors audit)."""
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got str"):
        load_hf(str(tmp_path), build("llama"))
    with pytest.raises(FileNotFoundError, match=r"config file .*nope\.json' does not exist"):
        to_hf(gpt2_ckpt[0] / "train", tmp_path / "out", config=tmp_path / "nope.json")
    assert not (tmp_path / "out").exists()


def test_a_fifo_swapped_in_for_a_shard_is_refused_at_once(tmp_path):
    """The header reader opened shards with a plain blocking open: a FIFO put in a shard's
    place after the directory was listed hung the load (the check before is a listing)."""
    import os

    from hostile import fail_after

    from shardkit.checkpoint._convert import _hf_import

    fifo = tmp_path / "model-00001-of-00002.safetensors"
    os.mkfifo(fifo)
    for read in (_hf_import._Header, _hf_import._open):
        with fail_after(60), pytest.raises((OSError, CorruptCheckpointError), match="not a reg"):
            read(str(fifo))
