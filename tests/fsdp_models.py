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
