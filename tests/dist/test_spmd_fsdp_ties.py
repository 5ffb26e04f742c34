"""SpmdFullyShardedDataParallel keeps tied weights tied (GPT-2's wte / lm_head): one
sharded parameter on both owners, whose gradient sums both uses, as one device's does."""

from harness import run_ranks


def _tied(_):
    import copy

    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    import shardkit.spmd as xs

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(12, 6)
            self.mix = nn.Linear(6, 6)
            self.head = nn.Linear(6, 12, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(torch.tanh(self.mix(self.emb(x))))

    torch.manual_seed(0)
    ref = Tied()
    world = torch.distributed.get_world_size()
    mesh = xs.Mesh(np.arange(world), (world,), ("fsdp",))
    model = xs.SpmdFullyShardedDataParallel(copy.deepcopy(ref), mesh)
    tied = model.module.head.weight is model.module.emb.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x = torch.arange(8).remainder(12).reshape(4, 2)
    y = torch.arange(8).flip(0).remainder(12).reshape(4, 2)
    losses = []
    for _ in range(3):
        logits = model(x)
        target = xs.mark_sharding(y, mesh, ("fsdp", None))
        loss = F.cross_entropy(logits.reshape(-1, 12), target.reshape(-1)).full_tensor()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x).reshape(-1, 12), y.reshape(-1))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((float(ref_loss), float(loss)))
    err = max(
        float((p.full_tensor() - r).detach().abs().max())
        for p, r in zip(model.module.parameters(), ref.parameters())
    )
    return tied, len(list(model.parameters())), losses, err


def test_spmd_fsdp_keeps_tied_weights_tied():
    for tied, num_params, losses, err in run_ranks(_tied, 2, None, timeout=120):
        assert tied
        assert num_params == 3  # emb (= head) weight, mix weight and bias
        for ref, ours in losses:
            assert abs(ref - ours) < 1e-5, losses
        assert err < 1e-5
