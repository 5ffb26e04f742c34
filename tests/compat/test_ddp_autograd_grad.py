"""``torch.autograd.grad`` through a DDP model's outputs before the real backward.

A gradient penalty (WGAN-GP) or an adversarial input (FGSM) takes gradients through the
outputs first. shardkit's reducer started its reduction from the outputs' backward
nodes, which ``autograd.grad`` runs too, so (found side by side with torch DDP,
2026-11-28):
- with ``find_unused_parameters=True`` the reduction ended inside ``autograd.grad``
  with every parameter unused, and the real backward's gradients were never averaged:
  each rank kept its own, silently;
- with the defaults ``autograd.grad`` raised "backward produced no gradient".
torch's DDP averages them in both cases; the reference here is one process computing
the mean of the ranks' losses.
"""

import pytest
import torch
from harness import run_ranks
from torch import nn

pytestmark = pytest.mark.timeout(180)
WORLD = 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _batch(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(4, 3, generator=g)


def _penalty_loss(model, x):
    x = x.clone().requires_grad_(True)
    out = model(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.sum() + gx.square().sum()


def _fgsm_loss(model, x):
    x = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(model(x).sum(), x)
    return model(x + 0.1 * gx.sign()).square().mean()


LOSSES = {"penalty": _penalty_loss, "fgsm": _fgsm_loss}


def _body(kind, find_unused):
    import torch.distributed as dist

    from shardkit.ddp import DistributedDataParallel as DDP

    rank = dist.get_rank()
    ddp = DDP(_model(), find_unused_parameters=find_unused)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        LOSSES[kind](ddp, _batch(rank + 2 * step)).backward()
        opt.step()
        ref_opt.zero_grad()  # the mean of every rank's loss, in one process
        sum(LOSSES[kind](ref, _batch(r + 2 * step)) for r in range(WORLD)).div(WORLD).backward()
        ref_opt.step()
    return max(
        (p - q).abs().max().item() for p, q in zip(ddp.module.parameters(), ref.parameters())
    )


@pytest.mark.parametrize("find_unused", [False, True], ids=["default", "find_unused"])
@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_autograd_grad_before_backward_averages_like_one_process(kind, find_unused):
    for diff in run_ranks(_body, WORLD, kind, find_unused):
        assert diff < 1e-6, diff
