"""Real models under SPMD tensor parallelism: Hugging Face Llama, GPT-2 and BERT.

Tiny models from configs (random init, nothing downloaded), sharded with
``xs.shard_module``, trained 2 AdamW steps next to the unsharded model. Every op runs
through a sharding rule (the fallback counter stays at zero) and the collectives are
exactly the optimum stated in docs/spmd.md ("Llama"):

- forward: one all-reduce over 'model' per row-parallel layer (o_proj, down_proj);
- backward: one all-reduce over 'model' per group of column-parallel layers sharing an
  input (q/k/v, gate/up): the input gradient;
- on a 2-D mesh, plus one all-reduce over 'data' per parameter (the data-parallel
  gradient reduction), the cross-entropy mean's token count (one scalar) and, with SDPA
  and a padding mask, the two batch-wide scalars HF's mask code reads (``fast_all``);
- the optimizer step: nothing.

One 2-rank launch (1-D mesh) and one 4-rank launch (2 x 2 mesh) run every case.
"""

import pytest
from harness import run_ranks
from hf_tp_cases import run_bert, run_gpt2_tied, run_llama

NUM_LAYERS = 2
NUM_PARAMS = 9 * NUM_LAYERS + 3  # 7 linears + 2 norms per layer; embed, final norm, lm_head
TOL = 1e-5
#: AdamW divides by sqrt(v): parameters whose gradients are ~0 move by up to lr on float
#: noise, so parameters, and the logits after the steps, are compared more loosely than
#: the first step's logits and gradients (an untied lm_head is off by ~0.1)
PARAM_TOL = 1e-4

LLAMA_1D = {
    "sdpa_mask_cache": ("sdpa", True, True),
    "eager_mask_cache": ("eager", True, True),
    "sdpa_nomask_nocache": ("sdpa", False, False),
    # more tokens than the GQA k/v width: the counts must not depend on sizes (the k/v
    # input gradients stay pending and merge with q's rather than gathering)
    "sdpa_mask_cache_seq64": ("sdpa", True, True, 64),
}
LLAMA_2D = {
    "sdpa_mask_cache": ("sdpa", True, True),
    "eager_mask_cache": ("eager", True, True),
    "eager_nomask_nocache": ("eager", False, False),
}
#: 1 sequence per data rank, 32 tokens: enough tokens that the lm_head gradient is
#: reduced as a pending sum (cheaper than gathering its activations)
SEQ_2D = 32


#: dropout in training mode (attention, residual, embedding dropout where the model has
#: them): shardkit draws every mask as one device would, so values match exactly
DROPOUT = 0.3


def _one_d():
    out = {name: run_llama((2,), *args) for name, args in LLAMA_1D.items()}
    for attn in ("sdpa", "eager"):
        out[f"local_{attn}"] = run_llama((2,), attn, True, True, activations="local")
        out[f"local_bert_{attn}"] = run_bert((2,), attn, activations="local")
        out[f"gpt2_{attn}"] = run_gpt2_tied((2,), attn)
        out[f"bert_{attn}"] = run_bert((2,), attn)
        out[f"llama_{attn}_dropout"] = run_llama((2,), attn, True, True, dropout=DROPOUT)
        out[f"gpt2_{attn}_dropout"] = run_gpt2_tied((2,), attn, dropout=DROPOUT)
        out[f"bert_{attn}_dropout"] = run_bert((2,), attn, dropout=DROPOUT)
    return out


def _two_d():
    out = {name: run_llama((2, 2), *args, seq=SEQ_2D) for name, args in LLAMA_2D.items()}
    out["sdpa_dropout"] = run_llama((2, 2), "sdpa", True, True, seq=SEQ_2D, dropout=DROPOUT)
    return out


def _agree(results):
    first = results[0]
    for r in results[1:]:
        assert {k: v["calls"] for k, v in r.items()} == {k: v["calls"] for k, v in first.items()}
    return first


@pytest.fixture(scope="module")
def one_d():
    return _agree(run_ranks(_one_d, 2, timeout=300))


@pytest.fixture(scope="module")
def two_d():
    return _agree(run_ranks(_two_d, 4, timeout=300))


def _check_values(r):
    assert r["logits_err"][0] < TOL, r["logits_err"]  # before any update
    assert max(r["logits_err"]) < PARAM_TOL, r["logits_err"]
    assert r["final_logits_err"] < PARAM_TOL
    assert max(r["loss_err"]) < TOL
    assert r["grad_err"] < TOL
    assert r["grads_placed"], "a gradient came back in another layout than its parameter"
    assert r["param_err"] < PARAM_TOL


@pytest.mark.parametrize("case", sorted(LLAMA_1D))
def test_llama_tp_1d_zero_fallbacks_optimal_collectives(one_d, case):
    r = one_d[case]
    _check_values(r)
    assert r["fallbacks"] == {}
    assert r["calls"] == {
        "forward": {"all_reduce:model": 2 * NUM_LAYERS},
        "backward": {"all_reduce:model": 2 * NUM_LAYERS},
        "step": {},
    }


@pytest.mark.parametrize("case", sorted(LLAMA_2D))
def test_llama_tp_2d_zero_fallbacks_optimal_collectives(two_d, case):
    r = two_d[case]
    _check_values(r)
    assert r["fallbacks"] == {}
    attn, mask, _ = LLAMA_2D[case]
    mask_scalars = 2 if (attn == "sdpa" and mask) else 0
    assert r["calls"] == {
        "forward": {"all_reduce:data": 1 + mask_scalars, "all_reduce:model": 2 * NUM_LAYERS},
        "backward": {"all_reduce:data": NUM_PARAMS, "all_reduce:model": 2 * NUM_LAYERS},
        "step": {},
    }


def test_llama_plan_shards_as_stated(one_d):
    specs = one_d["sdpa_mask_cache"]["specs"]
    assert specs["model.layers.0.self_attn.q_proj.weight"] == ("model", None)
    assert specs["model.layers.1.mlp.down_proj.weight"] == (None, "model")
    assert specs["lm_head.weight"] == (None, None)
    assert specs["model.norm.weight"] == (None,)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gpt2_tied_embeddings_stay_tied_and_match(one_d, attn):
    r = one_d[f"gpt2_{attn}"]
    assert r["tied"], "lm_head no longer shares wte's sharded parameter"
    assert r["specs"]["transformer.wte.weight"] == ("model", None)
    assert "lm_head.weight" not in r["specs"]  # named once, as in torch
    _check_values(r)
    assert r["fallbacks"] == {}
    # all-reduces: per layer the row-parallel c_proj outputs forward and the input
    # gradients of c_attn / c_fc backward; the vocabulary-parallel embedding's sum
    # forward and lm_head's input gradient backward; the vocabulary-parallel softmax's row
    # max and row sum forward and its row sum backward (the logits are never gathered).
    # Gathers: the fused c_attn output is split into q, k, v along its sharded dim (one
    # per layer forward; backward the three gradients are joined again: three per layer).
    assert r["calls"] == {
        "forward": {"all_gather:model": NUM_LAYERS, "all_reduce:model": 2 * NUM_LAYERS + 3},
        "backward": {"all_gather:model": 3 * NUM_LAYERS, "all_reduce:model": 2 * NUM_LAYERS + 2},
        "step": {},
    }


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bert_tp_zero_fallbacks(one_d, attn):
    r = one_d[f"bert_{attn}"]
    _check_values(r)
    assert r["fallbacks"] == {}
    assert r["calls"] == {
        "forward": {"all_reduce:model": 2 * NUM_LAYERS},
        "backward": {"all_reduce:model": 2 * NUM_LAYERS},
        "step": {},
    }


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llama_local_activations_match_with_the_same_collectives(one_d, attn):
    """``activations="local"``: the same values and the same all-reduces as the sharded
    program (and as torch's ColwiseParallel / RowwiseParallel plan), with only the seven
    linears per layer sharded and every other parameter a plain tensor."""
    r = one_d[f"local_{attn}"]
    _check_values(r)
    assert r["fallbacks"] == {}
    assert r["calls"] == one_d[f"{attn}_mask_cache"]["calls"]
    assert len(r["sharded"]) == 7 * NUM_LAYERS
    assert all(n.endswith("_proj.weight") for n in r["sharded"]), r["sharded"]
    assert r["specs"]["model.layers.1.mlp.down_proj.weight"] == (None, "model")
    assert r["specs"]["lm_head.weight"] is None  # a plain tensor


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bert_local_activations_split_the_biases(one_d, attn):
    r = one_d[f"local_bert_{attn}"]
    _check_values(r)
    assert r["calls"] == one_d[f"bert_{attn}"]["calls"]
    assert r["specs"]["bert.encoder.layer.0.attention.self.query.bias"] == ("model",)
    assert r["specs"]["bert.encoder.layer.0.output.dense.bias"] is None


@pytest.mark.parametrize("model", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_dropout_training_zero_fallbacks_same_values(one_d, model, attn):
    """Dropout > 0 in training mode: no fallback, the same collectives as without
    dropout, and the same values as one process seeded alike (the same masks)."""
    r = one_d[f"{model}_{attn}_dropout"]
    same_without = {"llama": f"{attn}_mask_cache"}.get(model, f"{model}_{attn}")
    plain = one_d[same_without]
    _check_values(r)
    assert r["fallbacks"] == {}
    assert r["calls"] == plain["calls"]


def test_dropout_training_2d(two_d):
    r = two_d["sdpa_dropout"]
    _check_values(r)
    assert r["fallbacks"] == {}
    assert r["calls"] == two_d["sdpa_mask_cache"]["calls"]
