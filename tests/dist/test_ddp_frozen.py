"""A parameter frozen after DDP was built gets the fix migrating.md gives (wrap again),
not "find_unused_parameters=True", which fits a forward that skips a parameter."""

from harness import run_ranks


def _frozen(_):
    import torch
    from torch import nn

    from shardkit.ddp import DistributedDataParallel as DDP

    out = []
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ddp = DDP(model)
    model[0].weight.requires_grad_(False)
    try:
        ddp(torch.randn(3, 4)).sum().backward()
    except RuntimeError as exc:
        out.append(str(exc))
    ddp = DDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    ddp(torch.randn(3, 4))  # the forward arms the reduction; this backward skips [0]
    try:
        ddp.module[1](torch.randn(3, 4)).sum().backward()
        ddp(torch.randn(3, 4))
    except RuntimeError as exc:
        out.append(str(exc))
    return out


def test_a_parameter_frozen_after_wrapping_gets_the_rewrap_fix():
    for frozen, unused in run_ranks(_frozen, 2, None, timeout=90):
        assert "['0.weight'] stopped requiring grad" in frozen and "wrap it again" in frozen
        assert "find_unused_parameters=True" in unused and "wrap it again" not in unused
