"""Incremental checkpoints on 2 real ranks: a LoRA-style run with a sharded frozen base and
a replicated frozen tensor, trained adapters (Adam), retention, and resharding restores."""

from __future__ import annotations

import os

import torch
from harness import run_ranks


def _body(tmp):
    import torch.distributed as dist

    import shardkit.spmd as xs
    from shardkit.checkpoint import CheckpointManager, prime_optimizer, read_metadata

    rank = dist.get_rank()
    mesh = xs.Mesh([0, 1], (2,), ("x",))
    g = torch.Generator().manual_seed(0)
    base_full = torch.randn(256, 64, generator=g)
    base = xs.mark_sharding(base_full.clone(), mesh, ("x", None))  # frozen, sharded
    emb = torch.randn(512, 32, generator=g)  # frozen, replicated: written once, split
    lora_a = torch.nn.Parameter(torch.randn(4, 64, generator=g) * 0.01)
    lora_b = torch.nn.Parameter(torch.zeros(64, 4))
    optim = torch.optim.Adam([lora_a, lora_b], lr=0.1)

    def state():
        return {
            "model": {"base": base, "emb": emb, "lora_a": lora_a, "lora_b": lora_b},
            "optim": optim.state_dict(),
        }

    mgr = CheckpointManager(
        f"{tmp}/run", 1, max_to_keep=2, incremental=True, chkpt_on_preemption=False
    )
    expected = {}
    for step in range(5):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        optim.zero_grad()
        (x @ lora_a.t() @ lora_b.t()).sin().sum().backward()
        for p in (lora_a, lora_b):
            dist.all_reduce(p.grad)
        optim.step()
        expected[step] = (
            lora_a.detach().clone(),
            lora_b.detach().clone(),
            optim.state_dict()["state"][1]["exp_avg_sq"].clone(),
        )
        (mgr.save if step % 2 else mgr.save_async)(step, state())
    mgr.join()
    out = {"steps": mgr.all_steps()}
    for step in out["steps"]:
        # restore into another layout: the frozen base sharded on dim 1
        pa, pb = torch.nn.Parameter(torch.zeros(4, 64)), torch.nn.Parameter(torch.zeros(64, 4))
        opt2 = torch.optim.Adam([pa, pb], lr=0.1)
        prime_optimizer(opt2)
        target = {
            "optim": opt2.state_dict(),
            "model": {
                "base": xs.mark_sharding(torch.zeros(256, 64), mesh, (None, "x")),
                "emb": torch.zeros(512, 32),
                "lora_a": torch.zeros(4, 64),
                "lora_b": torch.zeros(64, 4),
            },
        }
        mgr.restore(step, target)
        m = target["model"]
        out[f"ok{step}"] = (
            torch.equal(m["base"].full_tensor(), base_full)
            and torch.equal(m["emb"], emb)
            and torch.equal(m["lora_a"], expected[step][0])
            and torch.equal(m["lora_b"], expected[step][1])
            and torch.equal(target["optim"]["state"][1]["exp_avg_sq"], expected[step][2])
        )
    md = read_metadata(mgr._store.step_url(4))
    out["dirs"] = sorted({link.dir for link in md.linked.values()})
    out["shared"] = md.shared_bytes()
    out["own"] = sum(md.files.values())
    mgr.close()
    return out


def test_incremental_two_ranks(tmp_path):
    results = run_ranks(_body, 2, str(tmp_path))
    assert results[0] == results[1]
    out = results[0]
    assert out["steps"] == [3, 4]
    assert all(out[f"ok{s}"] for s in (3, 4)), out
    # every rank's frozen chunks reference the same directory: the first step's
    assert out["dirs"] == ["step_00000000"], out
    frozen = (256 * 64 + 512 * 32) * 4
    assert out["shared"] == frozen and out["own"] < 0.25 * frozen, out
    left = sorted(n for n in os.listdir(tmp_path / "run") if n.startswith("step_"))
    assert left == ["step_00000000", "step_00000003", "step_00000004"], left
