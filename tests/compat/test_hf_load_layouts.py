"""``load_hf`` on checkpoints that ``save_pretrained`` writes, found by a model audit
(2026-11-28): it listed a tied alias it had filled (GPT-2's ``lm_head.weight``) among
the keys that "kept their values", and on a mixture-of-experts checkpoint in the Hub's
per-expert layout it suggested ``strict=False``, which leaves router and experts random.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardkit.checkpoint.hf import load_hf  # noqa: E402


def test_a_tied_alias_filled_from_the_files_is_not_reported_kept(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(config)
    kept = load_hf(model, tmp_path)
    assert "lm_head.weight" not in kept
    want = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert torch.equal(model.lm_head.weight, want.lm_head.weight)


def test_per_expert_moe_files_name_the_layout_instead_of_strict_false(tmp_path):
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
        num_experts_per_tok=1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(KeyError, match="experts one by one.*from_pretrained"):
        load_hf(transformers.MixtralForCausalLM(config), tmp_path)
