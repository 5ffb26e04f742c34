"""Small models shared by the FSDP tests."""

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm residual MLP block whose forward takes a keyword argument."""

    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)

    def forward(self, x, *, scale=1.0):
        return x + scale * self.b(torch.relu(self.a(self.ln(x))))


class TanhBlock(nn.Module):
    """A residual tanh layer of width 6: the unit that nested-FSDP tests auto-wrap."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 6)

    def forward(self, x):
        return x + torch.tanh(self.up(x))


class Stack(nn.Module):
    """Two ``block_cls`` blocks and a projection to 3 outputs (3 rows over 2 ranks:
    uneven), initialized from ``seed``."""

    def __init__(self, block_cls=TanhBlock, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(block_cls() for _ in range(2))
        self.proj = nn.Linear(6, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.proj(x)


def wrap_fsdp(model, nested, block_cls=TanhBlock, **kwargs):
    """shardkit FSDP around ``model``: one unit, or (``nested``) one per ``block_cls``."""
    import functools

    from shardkit.fsdp import FSDP
    from shardkit.fsdp.wrap import transformer_auto_wrap_policy

    if nested:
        kwargs["auto_wrap_policy"] = functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={block_cls}
        )
    return FSDP(model, **kwargs)
