"""FSDP with real-model patterns found by a Hugging Face model audit (2026-11-28):

- a module inside a unit called on its own (``model.get_input_embeddings()(ids)`` then
  ``model(inputs_embeds=...)``) computed with this rank's rows only, silently; T5's
  ``generate()`` calls its encoder that way and failed with an IndexError;
- a meta-device model wrapped with ``param_init_fn`` lost its tied weights (each module
  materialized its own copy), and ``tie_weights()`` after wrapping was overwritten at
  the next forward, so ``lm_head`` computed with uninitialized memory.

References: the same plain model in one process.
"""

import functools

import pytest
import torch
from fsdp_models import TanhBlock, wrap_fsdp
from harness import run_ranks
from torch import nn

pytestmark = pytest.mark.timeout(180)
WORLD = 2


Block = TanhBlock


class TiedLM(nn.Module):
    """An embedding, one block and a head tied to the embedding (as GPT-2's)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)  # 11 rows over 2 ranks: uneven
        self.block = Block()
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids=None, embeds=None):
        x = self.emb(ids) if embeds is None else embeds
        return self.head(self.block(x))


def _wrap(model, nested):
    return wrap_fsdp(model, nested)


def _submodule_body():
    from shardkit.fsdp import FSDPUsageError

    ids = torch.tensor([[1, 10, 3], [7, 2, 9]])  # rows of both ranks' halves
    torch.manual_seed(0)
    plain = TiedLM()
    with torch.no_grad():
        want = plain(embeds=plain.emb(ids))
        want_up = plain.block.up(plain.emb(ids))
    out = {}
    for nested in (False, True):
        torch.manual_seed(0)
        model = _wrap(TiedLM(), nested)
        with torch.no_grad():
            embeds = model.module.emb(ids)  # a submodule of the root unit
            got = model(embeds=embeds)
            up = model.module.block.module.up if nested else model.module.block.up
            got_up = up(embeds)  # a submodule of a nested unit
        try:
            model.module.emb(ids)  # with autograd: refused, not silently local
            refused = None
        except FSDPUsageError as exc:
            refused = str(exc)
        loss = model(ids=ids).square().mean()  # training afterwards still matches
        loss.backward()
        out[nested] = {
            "same": torch.allclose(got, want, atol=1e-6),
            "same_up": torch.allclose(got_up, want_up, atol=1e-6),
            "refused": refused,
            "loss": loss.item(),
        }
    out["plain_loss"] = plain(ids=ids).square().mean().item()
    return out


def test_a_submodule_called_directly_gathers_or_is_refused():
    for res in run_ranks(_submodule_body, WORLD):
        for nested in (False, True):
            got = res[nested]
            assert got["same"] and got["same_up"], got
            assert got["refused"] and "inside an FSDP unit" in got["refused"], got
            assert "input_ids" in got["refused"]
            assert got["loss"] == pytest.approx(res["plain_loss"], rel=1e-6)


def _init(module):
    module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        for name, p in module.named_parameters(recurse=False):
            p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (len(name) % 3 + 1))


def _meta_body():
    from shardkit.fsdp import FSDPUsageError

    ids = torch.tensor([[1, 10, 3], [7, 2, 9]])
    plain = TiedLM()
    for m in plain.modules():
        if m._parameters:
            _init(m)
    plain.head.weight = plain.emb.weight  # the tie, holding the embedding's values
    out = {}
    for nested in (False, True):
        with torch.device("meta"):
            net = TiedLM()
        model = _wrap_meta(net, nested)
        out[nested] = {
            "tied": model.module.head.weight is model.module.emb.weight,
            "params": len(list(model.parameters())),
            "same": torch.allclose(_full_output(model, ids), plain(ids=ids), atol=1e-6),
        }
    model = _wrap(TiedLM(), False)
    model.module.head.weight = nn.Parameter(torch.zeros(11, 6))  # replaced after wrapping
    try:
        model(ids=ids)
        out["replaced"] = None
    except FSDPUsageError as exc:
        out["replaced"] = str(exc)
    return out


def _wrap_meta(net, nested):
    return wrap_fsdp(net, nested, param_init_fn=_init)


def _full_output(model, ids):
    with torch.no_grad():
        return model(ids=ids)


def test_meta_init_keeps_ties_and_a_replaced_parameter_is_refused():
    for res in run_ranks(_meta_body, WORLD):
        for nested in (False, True):
            got = res[nested]
            assert got["tied"] and got["same"], got
            assert got["params"] == 3  # emb/head once, block weight and bias
        assert res["replaced"] and "replaced after FSDP wrapped" in res["replaced"]
        assert "'head.weight'" in res["replaced"]


def _t5_body():
    import torch.distributed as dist
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Block

    from shardkit.fsdp import FSDP
    from shardkit.fsdp.wrap import transformer_auto_wrap_policy

    config = T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    prompt = torch.tensor([[5, 9, 60, 1], [7 + dist.get_rank(), 2, 3, 1]])
    kwargs = dict(max_new_tokens=4, do_sample=False)
    torch.manual_seed(0)
    want = T5ForConditionalGeneration(config).eval().generate(prompt, **kwargs)
    torch.manual_seed(0)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block})
    model = FSDP(T5ForConditionalGeneration(config).eval(), auto_wrap_policy=policy)
    return torch.equal(model.generate(prompt, **kwargs), want)


def test_t5_generate_calls_its_encoder_directly_and_matches_the_plain_model():
    pytest.importorskip("transformers")
    assert run_ranks(_t5_body, WORLD, timeout=170) == [True, True]
