"""Tiny Hugging Face models built from configs (random init, nothing downloaded)."""

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

VOCAB, SEQ = 96, 8
KINDS = ("llama", "llama_eager", "gpt2", "bert")
LAYER_CLS = {
    "llama": LlamaDecoderLayer,
    "llama_eager": LlamaDecoderLayer,
    "gpt2": GPT2Block,
    "bert": BertLayer,
}


def config(kind: str, **overrides):
    """A 2-layer config of ``kind``; Llama has grouped-query attention (4 heads, 2 kv).

    ``overrides`` replace or add config fields (``use_cache=True``, dropout rates, ...).
    """
    if kind.startswith("llama"):
        fields = dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            use_cache=False,
            attn_implementation="eager" if kind == "llama_eager" else "sdpa",
            architectures=["LlamaForCausalLM"],
        )
        return LlamaConfig(**{**fields, **overrides})
    if kind == "gpt2":
        fields = dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation="sdpa",
            architectures=["GPT2LMHeadModel"],
        )
        return GPT2Config(**{**fields, **overrides})
    if kind == "bert":
        fields = dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="sdpa",
            architectures=["BertForMaskedLM"],
        )
        return BertConfig(**{**fields, **overrides})
    raise ValueError(f"unknown model kind {kind!r}; pick one of {KINDS}")


def build(kind: str, seed: int = 0, *, cls=None, **overrides):
    """The model of ``kind`` with seeded random weights, in train mode, dropout off
    unless ``overrides`` (config fields) turn it on; ``cls`` picks another head class."""
    torch.manual_seed(seed)
    cfg = config(kind, **overrides)
    if cls is None:
        cls = {"gpt2": GPT2LMHeadModel, "bert": BertForMaskedLM}.get(kind, LlamaForCausalLM)
    model = cls(cfg)
    model.train()
    return model


def batches(steps: int, batch: int, *, seed: int = 1):
    """``steps`` batches of token ids, each ``(batch, SEQ)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(steps)]


def loss_of(model, ids):
    """Mean token loss of a causal LM (next token) or a masked LM (every token)."""
    return model(input_ids=ids, labels=ids).loss


def policy(kind: str):
    """The transformer auto-wrap policy on the model's layer class."""
    import functools

    from shardkit.fsdp.wrap import transformer_auto_wrap_policy

    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LAYER_CLS[kind]})


def rank_world():
    """(rank, world size); (0, 1) without a process group."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_loss(loss):
    """The loss averaged over ranks (each rank's loss is its shard's mean)."""
    import torch.distributed as dist

    t = loss.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.item()
