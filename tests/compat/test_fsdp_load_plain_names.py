"""``FSDP.load_state_dict`` takes keys with or without the wrapper's names.

This wrapper's keys carry ``module.`` (as DDP's do); torch FSDP1's ``state_dict()`` and a
plain model's do not. Code moved over from FSDP1 loads the latter: with ``strict=True``
it raised a missing/unexpected-keys error, with ``strict=False`` it loaded nothing and
said so only in the returned key lists. torch FSDP1 loads such a state dict, so the
reference here is the plain model the state dict came from.
"""

import functools

import pytest
import torch
from fsdp_models import Stack, wrap_fsdp
from harness import run_ranks
from torch import nn

pytestmark = pytest.mark.timeout(180)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.up(x)))


Net = functools.partial(Stack, Block)


def _body(nested: bool, strict: bool):

    source = Net(seed=1)
    with torch.no_grad():
        for block in source.blocks:  # buffers differ from a fresh model's too
            block.norm.running_mean.uniform_()
            block.norm.num_batches_tracked.fill_(7)
    plain = {k: v.clone() for k, v in source.state_dict().items()}
    model = wrap_fsdp(Net(seed=0), nested, Block)
    result = model.load_state_dict(plain, strict=strict)
    model.eval()
    source.eval()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (model(x) - source(x)).abs().max().item()
    tracked = [int(m.num_batches_tracked) for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    return {
        "missing": list(result.missing_keys),
        "unexpected": list(result.unexpected_keys),
        "diff": diff,
        "tracked": tracked,
        "keys": sorted(model.state_dict())[:2],
    }


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
@pytest.mark.parametrize("nested", [False, True], ids=["one_unit", "nested"])
def test_plain_names_load_into_fsdp(nested, strict):
    for r in run_ranks(_body, 2, nested, strict):
        assert r["missing"] == [] and r["unexpected"] == [], r
        assert r["diff"] < 1e-6, r
        assert r["tracked"] == [7, 7], r
        assert all(k.startswith("module.") for k in r["keys"]), r  # its own keys unchanged


def test_wrapped_names_still_load_and_unknown_keys_still_fail():
    """The renaming only maps keys the model lacks onto keys it expects."""
    from shardkit.fsdp import FSDP

    model = FSDP(Net(seed=0))
    own = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in
           model.state_dict().items()}  # fmt: skip
    assert not model.load_state_dict(own).missing_keys
    bad = {("blocks.0.up.weight" if k == "module.blocks.0.up.weight" else k): v
           for k, v in own.items()}  # fmt: skip
    bad["extra.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="extra.weight"):
        model.load_state_dict(bad)
