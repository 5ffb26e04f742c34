"""``gradient_as_bucket_view=True`` keeps each gradient's memory format, as torch DDP
does: a transposed or channels_last parameter's ``.grad`` came back row-major (3-rank
audit, 2026-11-29); the values were right, but code that relies on the format was not."""

import copy

import pytest
import torch
from harness import run_ranks
from torch import nn

pytestmark = pytest.mark.timeout(180)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3).t())  # transposed: strides (1, 3)
        self.conv = nn.Conv2d(2, 3, 2).to(memory_format=torch.channels_last)

    def forward(self, x, img):
        return (x @ self.w).sum(-1) + self.conv(img).mean((1, 2, 3))


def _body():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from shardkit.ddp import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = _Net()
    torch.manual_seed(dist.get_rank())  # each rank its own batch: the average shows
    x = torch.randn(2, 3)
    img = torch.randn(2, 2, 3, 3).to(memory_format=torch.channels_last)
    out = {}
    for name, cls in (("torch", TorchDDP), ("shardkit", DDP)):
        model = copy.deepcopy(base)
        ddp = cls(model, gradient_as_bucket_view=True)
        ddp(x, img).sum().backward()
        out[name] = {
            k: [list(p.grad.stride()), p.grad.reshape(-1).tolist()]
            for k, p in model.named_parameters()
        }
    return out


def test_bucket_view_gradients_keep_the_parameters_strides_as_torch():
    for result in run_ranks(_body, 2):
        assert result["shardkit"].keys() == result["torch"].keys()
        for key, (strides, values) in result["torch"].items():
            assert result["shardkit"][key][0] == strides, key
            assert result["shardkit"][key][1] == pytest.approx(values, rel=1e-6), key
        assert result["torch"]["w"][0] == [1, 3]  # the case is the one it claims to be
