"""The state-dict helpers when ranks pass different options: an error, never swapped values.

An audit of rank-divergent inputs (2026-11-29) found that ``get_model_state_dict`` with
``full_state_dict=True`` and ``ignore_frozen_params=True`` on one rank only returned that
rank another parameter's values: it skipped the frozen ``0.weight``, so its first gather
(``1.weight``) met the other rank's gather of ``0.weight``, same shape and spec, and no
check saw a difference. The key now rides in the gather's header (no extra collective).
"""

from __future__ import annotations

import torch
from harness import outcome, run_ranks
from torch import nn



def _body():
    import torch.distributed as dist

    from shardkit.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from shardkit.fsdp import FullyShardedDataParallel as FSDP

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    model[0].weight.requires_grad_(False)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    fsdp = FSDP(model)
    out = {}
    # the same options on both ranks: the full values, exactly
    same = get_model_state_dict(fsdp, options=StateDictOptions(full_state_dict=True))
    out["same"] = {k: torch.equal(v, ref[k]) for k, v in same.items()}
    # ignore_frozen_params on rank 1 only
    odd = StateDictOptions(full_state_dict=True, ignore_frozen_params=rank == 1)
    out["frozen_one_rank"] = outcome(lambda: get_model_state_dict(fsdp, options=odd))
    # optimizer state: the keys name the parameter and the state entry
    optim = torch.optim.Adam([p for p in fsdp.parameters() if p.requires_grad], lr=0.1)
    fsdp(torch.ones(2, 8)).sum().backward()
    optim.step()
    full = get_optimizer_state_dict(fsdp, optim, options=StateDictOptions(full_state_dict=True))
    out["optim_keys"] = sorted(full["state"])
    return out


def test_state_dict_gathers_compare_keys_across_ranks():
    for r in run_ranks(_body, 2):
        assert r["same"] == {"0.weight": True, "1.weight": True}, r["same"]
        got = r["frozen_one_rank"]
        assert got.startswith("ValueError"), got
        assert "state dict key: rank 0 has 0.weight, rank 1 has 1.weight" in got, got
        assert "same model, submodules and StateDictOptions" in got, got
        assert r["optim_keys"] == ["1.weight"], r["optim_keys"]
