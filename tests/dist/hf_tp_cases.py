"""Tensor parallelism on real Hugging Face models (tiny, random init, nothing downloaded).

Each ``run_*`` function runs on every rank: it builds the model from a config, shards a
copy with :func:`shardkit.spmd.shard_module`, trains it next to the unsharded original
(the one-process reference, run on each rank) and reports errors, collective counts and
fallbacks per phase (forward, backward, optimizer step).
"""

from __future__ import annotations

import copy

import hf_models
import torch

D, M = "data", "model"

#: Megatron-style Llama plan: q/k/v/gate/up column-parallel (output features, dim 0),
#: o/down row-parallel (input features, dim 1); embeddings, norms and lm_head replicated.
LLAMA_PLAN = {
    "*.self_attn.q_proj.weight": (M, None),
    "*.self_attn.k_proj.weight": (M, None),
    "*.self_attn.v_proj.weight": (M, None),
    "*.self_attn.o_proj.weight": (None, M),
    "*.mlp.gate_proj.weight": (M, None),
    "*.mlp.up_proj.weight": (M, None),
    "*.mlp.down_proj.weight": (None, M),
}

#: GPT-2 (Conv1D layers store weights as (in, out)): c_attn / c_fc column-parallel (dim 1),
#: the two c_proj row-parallel (dim 0); the tied wte / lm_head vocabulary-parallel.
GPT2_PLAN = {
    "*.attn.c_attn.weight": (None, M),
    "*.attn.c_attn.bias": (M,),
    "*.mlp.c_fc.weight": (None, M),
    "*.mlp.c_fc.bias": (M,),
    "*.attn.c_proj.weight": (M, None),
    "*.mlp.c_proj.weight": (M, None),
    "transformer.wte.weight": (M, None),
}

#: BERT: query/key/value and intermediate.dense column-parallel, the two output.dense
#: row-parallel; embeddings, layer norms, pooler and classifier replicated.
BERT_PLAN = {
    "*.attention.self.query.weight": (M, None),
    "*.attention.self.query.bias": (M,),
    "*.attention.self.key.weight": (M, None),
    "*.attention.self.key.bias": (M,),
    "*.attention.self.value.weight": (M, None),
    "*.attention.self.value.bias": (M,),
    "*.intermediate.dense.weight": (M, None),
    "*.intermediate.dense.bias": (M,),
    "*.output.dense.weight": (None, M),
}


def llama(attn: str, *, use_cache: bool = True, dropout: float = 0.0):
    return hf_models.build(
        "llama" if attn == "sdpa" else "llama_eager",
        use_cache=use_cache,
        attention_dropout=dropout,
        architectures=None,
    )


def gpt2(attn: str = "sdpa", *, dropout: float = 0.0):
    return hf_models.build(
        "gpt2",
        attn_implementation=attn,
        use_cache=True,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        architectures=None,
    )


def bert(attn: str = "sdpa", *, dropout: float = 0.0):
    from transformers import BertForSequenceClassification

    return hf_models.build(
        "bert",
        cls=BertForSequenceClassification,
        attn_implementation=attn,
        num_labels=3,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        architectures=None,
    )


def _mesh(mesh_shape):
    import numpy as np

    import shardkit.runtime as xr
    import shardkit.spmd as xs

    names = (D, M) if len(mesh_shape) == 2 else (M,)
    return xs.Mesh(np.arange(xr.world_size()), mesh_shape, names)


def _err(a, b) -> float:
    import shardkit.spmd as xs

    a = xs.clear_sharding(a).detach().double()
    return float((a - b.detach().double()).abs().max())


def _calls(counts) -> dict:
    return {f"{k}:{','.join(axes)}": n for (k, axes), n in sorted(counts.calls.items())}


def train_side_by_side(
    ref,
    plan,
    mesh_shape,
    batch: dict,
    labels_key: str = "labels",
    *,
    steps: int = 2,
    reseed: bool = False,
    activations: str = "sharded",
):
    """Train ``ref`` and a sharded copy for ``steps`` AdamW steps on ``batch``.

    ``batch`` holds full tensors; dim 0 is sharded over ``'data'`` on a 2-D mesh.
    ``reseed`` seeds torch's generator identically before each forward of either model
    (for dropout: shardkit draws the same masks as one device). With
    ``activations="local"`` the batch goes in as plain tensors (a 1-D mesh only).
    Returns per-step logits / loss errors, the largest gradient and parameter errors,
    collectives and fallbacks per phase (of the last step), and the parameter specs.
    """
    import shardkit.spmd as xs

    mesh = _mesh(mesh_shape)
    model = xs.shard_module(copy.deepcopy(ref), mesh, plan, activations=activations)
    batch_spec = D if len(mesh_shape) == 2 else None
    sharded = {
        k: xs.mark_sharding(v, mesh, (batch_spec,) + (None,) * (v.ndim - 1))
        for k, v in batch.items()
    }
    if activations == "local":
        sharded = batch
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = {"logits_err": [], "loss_err": [], "grad_err": 0.0}
    xs.reset_fallback_counts()

    def seed(step):
        if reseed:
            torch.manual_seed(100 + step)

    for i in range(steps):
        seed(i)
        r = ref(**batch)
        r.loss.backward()
        seed(i)
        with xs.count_collectives() as fwd:
            o = model(**sharded)
        with xs.count_collectives() as bwd:
            o.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        out["grad_err"] = max(
            out["grad_err"],
            max(_err(grads[n], p.grad) for n, p in ref.named_parameters()),
        )
        out["grads_placed"] = all(
            p.grad.placement == p.placement
            for p in model.parameters()
            if isinstance(p, xs.ShardedTensor) and p.grad is not None
        )
        opt_ref.step()
        with xs.count_collectives() as step:
            opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        out["logits_err"].append(_err(o.logits, r.logits))
        out["loss_err"].append(_err(o.loss, r.loss))
    with torch.no_grad():
        seed(steps)
        final = model(**sharded).logits
        seed(steps)
        out["final_logits_err"] = _err(final, ref(**batch).logits)
    out["param_err"] = max(
        _err(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    out["calls"] = {"forward": _calls(fwd), "backward": _calls(bwd), "step": _calls(step)}
    out["fallbacks"] = dict(xs.fallback_counts())
    out["specs"] = {n: getattr(p, "partition_spec", None) for n, p in model.named_parameters()}
    out["model"] = model
    return out


def llama_batch(mesh_shape, *, mask: bool, seq: int):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, seq), generator=gen)
    batch = {"input_ids": ids, "labels": ids}
    if mask:
        am = torch.ones(2, seq, dtype=torch.long)
        am[1, :3] = 0  # left padding on the second sequence
        batch["attention_mask"] = am
    return batch


def run_llama(
    mesh_shape,
    attn: str,
    mask: bool,
    use_cache: bool,
    seq: int = 8,
    dropout: float = 0.0,
    activations: str = "sharded",
) -> dict:
    ref = llama(attn, use_cache=use_cache, dropout=dropout)
    batch = llama_batch(mesh_shape, mask=mask, seq=seq)
    out = train_side_by_side(
        ref, LLAMA_PLAN, mesh_shape, batch, reseed=dropout > 0, activations=activations
    )
    import shardkit.spmd as xs

    model = out.pop("model")
    out["sharded"] = sorted(
        n for n, p in model.named_parameters() if isinstance(p, xs.ShardedTensor)
    )
    return out


def run_gpt2_tied(mesh_shape, attn: str = "sdpa", dropout: float = 0.0) -> dict:
    ref = gpt2(attn, dropout=dropout)
    assert ref.lm_head.weight is ref.transformer.wte.weight
    batch = llama_batch(mesh_shape, mask=True, seq=8)
    out = train_side_by_side(ref, GPT2_PLAN, mesh_shape, batch, reseed=dropout > 0)
    model = out.pop("model")
    out["tied"] = model.lm_head.weight is model.transformer.wte.weight
    out["num_params"] = len(list(model.parameters()))
    return out


def run_bert(
    mesh_shape, attn: str = "sdpa", dropout: float = 0.0, activations: str = "sharded"
) -> dict:
    ref = bert(attn, dropout=dropout)
    batch = llama_batch(mesh_shape, mask=True, seq=8)
    batch["labels"] = torch.tensor([0, 2])
    out = train_side_by_side(
        ref, BERT_PLAN, mesh_shape, batch, reseed=dropout > 0, activations=activations
    )
    out.pop("model")
    return out
