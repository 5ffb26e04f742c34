"""Hugging Face format both ways on real models (tiny configs, random init).

- train with FSDP on 2 ranks -> shardkit checkpoint -> ``to_hf`` (on both ranks, and via
  ``shardkit ckpt convert --to hf``) -> ``from_pretrained`` -> the same logits;
- ``save_pretrained`` directory (sharded with an index, or one file) -> ``load_hf`` into an
  FSDP model and into a tensor-parallel (ShardedTensor) model on 2 ranks -> the HF
  model's logits, each rank reading only its own rows.
"""

import json
import os

import numpy as np
import pytest
import torch
import transformers
from harness import run_ranks
from hf_models import batches, build, config, loss_of, policy, rank_world

from shardkit.cli import main

KINDS = ("llama", "gpt2")
# the ranks compute with 1 thread, this process with several: matmuls may block (and so
# round) differently; identical weights give logits equal to float32 rounding.
LOGITS_ATOL = 1e-5


def _eval_ids():
    return batches(1, 2, seed=5)[0]


def _train_export(tmp):
    import shardkit.checkpoint as dcp
    from shardkit.checkpoint.hf import to_hf
    from shardkit.checkpoint.state_dict import get_state_dict
    from shardkit.fsdp import FSDP

    rank, world = rank_world()
    out = {}
    for kind in KINDS:
        model = FSDP(build(kind), auto_wrap_policy=policy(kind))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for ids in batches(2, 4):
            loss_of(model, ids.chunk(world)[rank]).backward()
            opt.step()
            opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{tmp}/{kind}-ckpt")
        report = to_hf(
            f"{tmp}/{kind}-ckpt", f"{tmp}/{kind}-hf", config=config(kind), max_shard_size="20KB"
        )
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=_eval_ids()).logits.numpy().copy()
        out[kind] = {"logits": logits, "report": report}
        with pytest.raises(ValueError, match="would write this rank's shards"):
            model.module.save_pretrained(f"{tmp}/{kind}-bad")
    return out


def _body(tmp, layouts):
    imported = _import_body(layouts)
    imported["paths"] = layouts
    return {"export": _train_export(tmp), "import": imported}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """HF directories written by save_pretrained (sharded and single-file) and their
    logits; then one 2-rank launch that trains + exports and imports them."""
    tmp = tmp_path_factory.mktemp("hfx")
    layouts, want = {}, {}
    for kind in KINDS:
        model = build(kind)
        want[kind] = _logits(model)
        for layout, size in (("sharded", "20KB"), ("single", "5GB")):
            path = tmp / f"{kind}-{layout}"
            model.save_pretrained(path, max_shard_size=size)
            has_index = os.path.exists(path / "model.safetensors.index.json")
            assert has_index == (layout == "sharded")
            layouts[kind, layout] = str(path)
    results = run_ranks(_body, 2, str(tmp), layouts, timeout=400)
    return str(tmp), results, want


@pytest.fixture(scope="module")
def exported(world2):
    tmp, results, _ = world2
    return tmp, [r["export"] for r in results]


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=_eval_ids()).logits.numpy()


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_training_exports_to_from_pretrained(exported, kind):
    tmp, results = exported
    want, report = results[0][kind]["logits"], results[0][kind]["report"]
    np.testing.assert_array_equal(results[1][kind]["logits"], want)
    out = f"{tmp}/{kind}-hf"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    np.testing.assert_allclose(_logits(model), want, atol=LOGITS_ATOL, rtol=0)
    # layout: several shards named as HF names them, an index over all, HF key names
    index = json.load(open(f"{out}/{'model.safetensors.index.json'}"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files == report.files
    assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    assert set(os.listdir(out)) == set(files) | {"model.safetensors.index.json", "config.json"}
    assert report.prefix == "model."
    assert (
        not any(k.startswith(("model.", "optim.")) for k in index["weight_map"]) or kind == "llama"
    )
    assert set(index["weight_map"]) == set(model.state_dict()) - set(report.tied)
    assert any(k.startswith("optim.state.") for k in report.dropped)
    if kind == "gpt2":  # tied: written once, under the embedding's name
        assert report.tied == {"lm_head.weight": "transformer.wte.weight"}
        assert "lm_head.weight" not in index["weight_map"]


def test_cli_convert_to_hf(exported, tmp_path):
    tmp, results = exported
    cfg = tmp_path / "config.json"
    cfg.write_text(config("gpt2").to_json_string())
    out = tmp_path / "gpt2-hf"
    code = main(
        [
            "ckpt",
            "convert",
            f"{tmp}/gpt2-ckpt",
            str(out),
            "--to",
            "hf",
            "--config",
            str(cfg),
            "--max-shard-size",
            "50KB",
        ]
    )
    assert code == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    np.testing.assert_allclose(
        _logits(model), results[0]["gpt2"]["logits"], atol=LOGITS_ATOL, rtol=0
    )


def _import_body(layouts):
    import shardkit.checkpoint._convert._hf_import as hf_import
    from shardkit.checkpoint.hf import load_hf
    from shardkit.fsdp import FSDP

    rank, world = rank_world()
    reads = []
    real_open = hf_import.safe_open

    class Recorder:  # records which rows each get_slice call asks for
        def __init__(self, *a, **kw):
            self.f = real_open(*a, **kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def get_slice(self, key):
            piece = self.f.get_slice(key)

            class Slice:
                def get_shape(self):
                    return piece.get_shape()

                def __getitem__(self, slices):
                    reads.append((key, piece.get_shape()[0], slices[0].start, slices[0].stop))
                    return piece[slices]

            return Slice()

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            reads.append((key, None, None, None))
            return self.f.get_tensor(key)

    real_rows, real_read = hf_import._rows_read, hf_import._Header.read_into
    nbytes = [0]

    def rows_read(head, key, slices, live, shape):  # the direct pread path
        done = real_rows(head, key, slices, live, shape)
        if done:
            reads.append((key, shape[0], slices[0].start, slices[0].stop))
        return done

    def read_into(self, out, offset):
        nbytes[0] += out.numel() * out.element_size()
        return real_read(self, out, offset)

    hf_import.safe_open, hf_import._rows_read = Recorder, rows_read
    hf_import._Header.read_into = read_into
    out = {}
    try:
        for (kind, layout), path in layouts.items():
            reads.clear()
            nbytes[0] = 0
            model = FSDP(build(kind, seed=7), auto_wrap_policy=policy(kind))
            load_hf(model, path)
            out[kind, layout, "fsdp"] = (_logits(model).copy(), list(reads), nbytes[0])
            if kind == "llama":
                out[kind, layout, "tp"] = _tp_logits(path, load_hf)
    finally:
        hf_import.safe_open, hf_import._rows_read = real_open, real_rows
        hf_import._Header.read_into = real_read
    return out


def _tp_logits(path, load_hf):
    """Megatron-style plan on 2 ranks: q/k/v/gate/up rows, o/down columns."""
    from torch import nn

    import shardkit.spmd as xs

    _, world = rank_world()
    mesh = xs.Mesh(list(range(world)), (world,), ("model",))
    model = build("llama", seed=7)
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        spec = {
            "q_proj": ("model", None),
            "k_proj": ("model", None),
            "v_proj": ("model", None),
            "gate_proj": ("model", None),
            "up_proj": ("model", None),
            "o_proj": (None, "model"),
            "down_proj": (None, "model"),
        }.get(leaf)
        if spec is not None:
            mod.weight = nn.Parameter(xs.mark_sharding(torch.zeros_like(mod.weight), mesh, spec))
    load_hf(model, path)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_eval_ids()).logits
    if isinstance(logits, xs.ShardedTensor):
        logits = logits.full_tensor()
    return logits.detach().numpy().copy()


@pytest.mark.parametrize("layout", ["sharded", "single"])
@pytest.mark.parametrize("kind", KINDS)
def test_hf_directory_imports_into_fsdp(world2, kind, layout):
    _, results, want = world2
    path = results[0]["import"]["paths"][kind, layout]
    total = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    for rank, res in enumerate(results):
        logits, reads, nbytes = res["import"][kind, layout, "fsdp"]
        np.testing.assert_allclose(logits, want[kind], atol=LOGITS_ATOL, rtol=0)
        assert reads
        assert 0 < nbytes < 0.6 * total, (nbytes, total)  # about half: its own rows only
        for key, rows, start, stop in reads:  # only this rank's dim-0 rows
            if rows is None or rows < 2:
                continue
            per = -(-rows // 2)
            assert (start, stop) == (rank * per, min(rows, (rank + 1) * per)), (key, start)


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_hf_directory_imports_into_tensor_parallel(world2, layout):
    _, results, want = world2
    for res in results:
        logits = res["import"]["llama", layout, "tp"]
        np.testing.assert_allclose(logits, want["llama"], atol=LOGITS_ATOL, rtol=0)
