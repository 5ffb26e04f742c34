"""shardkit FSDP against torch FSDP2 (``fully_shard`` per block) on the same model.

Two ranks (gloo, one thread each) train the same 8-block MLP-transformer-style model
(d=512), or with ``--model llama`` a Hugging Face ``LlamaForCausalLM`` (random init from a
config: GQA, RoPE, SDPA; needs transformers), with Adam under each framework in turn, in fresh processes so each peak RSS is
its own. Prints ONE JSON line: median step time, peak RSS (VmHWM) and peak RSS above the
pre-model baseline per framework (the worst rank), and shardkit / torch ratios.

    .venv/bin/python benchmarks/bench_fsdp.py            # full run
    .venv/bin/python benchmarks/bench_fsdp.py --quick    # smoke run, tiny model
    .venv/bin/python benchmarks/bench_fsdp.py --model llama [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _common import medians, spawn_ranks, spread, status_kb, worst_rank


def _model(blocks: int, d: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.ln(x))))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(blocks)]), Block


def _llama(blocks: int, d: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=d,
        intermediate_size=int(d * 8 / 3) // 8 * 8,
        num_hidden_layers=blocks,
        num_attention_heads=max(d // 64, 2),
        num_key_value_heads=max(d // 128, 1),
        max_position_embeddings=512,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg), LlamaDecoderLayer


def _blocks(model):
    return model.model.layers if hasattr(model, "model") else list(model)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _state_bytes(model, opt) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state."""
    n = 0
    for p in model.parameters():
        for t in (p, p.grad, *opt.state[p].values()):
            if t is not None and hasattr(t, "numel"):
                t = _local(t)
                n += t.numel() * t.element_size()
    return n


def _worker(rank, world, framework, cfg):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    baseline = status_kb("VmRSS")
    llama = cfg["model"] == "llama"
    model, block_cls = (_llama if llama else _model)(cfg["blocks"], cfg["d"])
    # unsharded parameters + gradients + two Adam moments, all fp32
    full_bytes = sum(p.numel() for p in model.parameters()) * 4 * 4
    if framework == "shardkit":
        import functools

        from shardkit.fsdp import FSDP
        from shardkit.fsdp.wrap import transformer_auto_wrap_policy

        model = FSDP(
            model,
            auto_wrap_policy=functools.partial(
                transformer_auto_wrap_policy, transformer_layer_cls={block_cls}
            ),
        )
    else:
        from torch.distributed.fsdp import fully_shard

        for block in _blocks(model):
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    times = []
    total = cfg["warmup"] + cfg["steps"]
    for step in range(total):
        if llama:
            x = torch.randint(0, 1024, (cfg["batch"], cfg["seq"]), generator=g)
        else:
            x = torch.randn(cfg["batch"], cfg["seq"], cfg["d"], generator=g)
        dist.barrier()
        if framework == "shardkit" and step == total - 1:
            from shardkit.fsdp._unit import GATHER_STATS

            GATHER_STATS.reset()
        start = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss if llama else model(x).square().mean()
        loss.backward()
        opt.step()
        if step == total - 1:
            held = _state_bytes(model, opt)
        opt.zero_grad()
        dist.barrier()
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - start)
    figures = dict(
        step_s=statistics.median(times),
        peak_rss_mb=status_kb("VmHWM") / 1024,
        peak_above_baseline_mb=(status_kb("VmHWM") - baseline) / 1024,
        # this rank's parameter + gradient + Adam state, as a share of the unsharded total
        state_share=held / full_bytes,
    )
    if framework == "shardkit":
        figures["max_units_gathered"] = GATHER_STATS.peak
    dist.destroy_process_group()
    return figures


def _run(framework: str, cfg: dict) -> dict:
    return worst_rank(spawn_ranks(_worker, 2, framework, cfg))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
    parser.add_argument(
        "--repeats", type=int, help="alternating runs per framework (default 5, quick 1)"
    )
    parser.add_argument("--model", choices=("mlp", "llama"), default="mlp", help="what to train")
    args = parser.parse_args()
    cfg = dict(blocks=8, d=512, batch=4, seq=32, warmup=2, steps=6)
    if args.model == "llama":
        cfg = dict(blocks=4, d=512, batch=4, seq=64, warmup=2, steps=6)
    if args.quick:
        cfg = dict(blocks=2, d=64, batch=2, seq=8, warmup=1, steps=2)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    cfg["model"] = args.model
    runs: dict[str, list[dict]] = {"shardkit": [], "torch_fsdp2": []}
    for _ in range(args.repeats):  # alternate, so machine noise hits both alike
        for name in runs:
            runs[name].append(_run("shardkit" if name == "shardkit" else "torch", cfg))
    figures = {name: medians(rs) for name, rs in runs.items()}
    sk, tf = figures["shardkit"], figures["torch_fsdp2"]
    # each repeat runs both frameworks back to back: their ratio per repeat shows how
    # much of the spread is the machine (it moves both) and how much is either side
    per_run = [a["step_s"] / b["step_s"] for a, b in zip(runs["shardkit"], runs["torch_fsdp2"])]
    out = {
        "benchmark": "fsdp" if args.model == "mlp" else "fsdp_llama",
        "config": {**cfg, "ranks": 2, "threads_per_rank": 1, "repeats": args.repeats},
        **figures,
        "step_time_ratio": round(sk["step_s"] / tf["step_s"], 3),
        "step_time_ratio_per_repeat": [round(r, 3) for r in per_run],
        "step_time_spread": {n: spread([r["step_s"] for r in rs]) for n, rs in runs.items()},
        "peak_rss_ratio": round(sk["peak_rss_mb"] / tf["peak_rss_mb"], 3),
        "peak_above_baseline_ratio": round(
            sk["peak_above_baseline_mb"] / max(tf["peak_above_baseline_mb"], 1e-9), 3
        ),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
