"""Hugging Face format export / import: shardkit against torch DCP's HF storage.

Two ranks (gloo, one thread each) hold a Hugging Face ``LlamaForCausalLM`` (random init
from a config), sharded by shardkit FSDP or by torch FSDP2 ``fully_shard``:

- export: live sharded model -> an HF ``from_pretrained`` directory. shardkit:
  ``checkpoint.save`` then ``checkpoint.hf.to_hf`` (also timed alone); torch:
  ``dcp.save`` with ``HuggingFaceStorageWriter(save_distributed=True,
  enable_consolidation=True)``.
- import: an HF directory (written by ``save_pretrained``) -> the sharded model. shardkit:
  ``checkpoint.hf.load_hf``; torch: ``dcp.load`` with ``HuggingFaceStorageReader``.

Every (framework, phase) runs in fresh processes so each peak RSS is its own. Prints ONE
JSON line: median seconds and peak RSS above the post-model baseline (worst rank) per
framework and phase, and shardkit / torch ratios.

    .venv/bin/python benchmarks/bench_hf.py            # full run
    .venv/bin/python benchmarks/bench_hf.py --quick    # smoke run, tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from _common import medians, reset_peak_rss, spawn_ranks, spread, status_kb, worst_rank


def _config(cfg: dict):
    from transformers import LlamaConfig

    d = cfg["d"]
    return LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=d,
        intermediate_size=int(d * 8 / 3) // 8 * 8,
        num_hidden_layers=cfg["layers"],
        num_attention_heads=max(d // 64, 2),
        num_key_value_heads=max(d // 128, 1),
        use_cache=False,
        architectures=["LlamaForCausalLM"],
    )


def _model(framework: str, cfg: dict, seed: int):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_config(cfg))
    if framework == "shardkit":
        import functools

        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        from shardkit.fsdp import FSDP
        from shardkit.fsdp.wrap import transformer_auto_wrap_policy

        policy = functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}
        )
        return FSDP(model, auto_wrap_policy=policy)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _config_sizes(cfg: dict):
    """Every tensor of the full model, on the meta device (shapes only)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return list(LlamaForCausalLM(_config(cfg)).state_dict().values())


def _checksum(framework: str, model) -> float:
    """Sum of every full parameter (collective): a cheap proof the import landed."""
    import torch

    if framework == "shardkit":
        from shardkit.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        sd = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return float(sum(v.double().sum() for v in sd.values() if torch.is_floating_point(v)))


def _worker(rank, world, framework, phase, cfg, tmp):
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp

    # every import before the clock starts: the phases time reading and writing only
    import shardkit.checkpoint as dcp
    from shardkit.checkpoint.hf import load_hf, to_hf
    from shardkit.checkpoint.state_dict import get_model_state_dict

    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(framework, cfg, seed=0 if phase == "export" else 1)
    dist.barrier()
    baseline = status_kb("VmRSS")
    reset_peak_rss()  # building the model is not part of the phase's peak
    out = f"{tmp}/{framework}-{phase}"
    figures = {}
    start = time.perf_counter()
    if phase == "export" and framework == "shardkit":
        dcp.save(get_model_state_dict(model), checkpoint_id=f"{out}-ckpt")
        dist.barrier()
        mid = time.perf_counter()
        to_hf(f"{out}-ckpt", out, config=_config(cfg), max_shard_size=cfg["shard_bytes"])
        figures["to_hf_s"] = time.perf_counter() - mid
    elif phase == "export":
        sd = model.state_dict()
        names, size, index = list(sd), 0, 1
        mapping = {}
        for name in names:  # the same greedy split into files as to_hf
            nbytes = sd[name].numel() * sd[name].element_size()
            if size and size + nbytes > cfg["shard_bytes"]:
                index, size = index + 1, 0
            mapping[name] = index
            size += nbytes
        writer = tdcp.HuggingFaceStorageWriter(
            out, fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=True
        )
        tdcp.save(sd, storage_writer=writer)
    elif framework == "shardkit":
        load_hf(model, f"{tmp}/hf")
    else:
        sd = model.state_dict()
        tdcp.load(sd, storage_reader=tdcp.HuggingFaceStorageReader(f"{tmp}/hf"))
    dist.barrier()
    figures["seconds"] = time.perf_counter() - start
    extra = (status_kb("VmHWM") - baseline) * 1024
    figures["peak_above_baseline_mb"] = extra / 2**20
    # the memory target: (this rank's shard + the extra peak) over
    # (this rank's shard + the largest tensor), at most 1.5
    shard = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in _config_sizes(cfg))
    figures["rss_vs_shard_plus_largest"] = (shard + extra) / (shard + largest)
    if phase == "import":
        figures["checksum"] = _checksum(framework, model)
    dist.destroy_process_group()
    return figures


def _run(framework: str, phase: str, cfg: dict, tmp: str) -> dict:
    run_dir = tempfile.mkdtemp(dir=tmp)
    if phase == "import":
        os.symlink(f"{tmp}/hf", f"{run_dir}/hf")
    return worst_rank(spawn_ranks(_worker, 2, framework, phase, cfg, run_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one repeat")
    parser.add_argument(
        "--repeats", type=int, help="alternating runs per framework (default 5, quick 1)"
    )
    args = parser.parse_args()
    cfg = dict(d=1024, layers=4, vocab=16384, shard_bytes=64 << 20)
    if args.quick:
        cfg = dict(d=128, layers=2, vocab=512, shard_bytes=256 << 10)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    import torch
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        torch.manual_seed(1)
        want = LlamaForCausalLM(_config(cfg))
        want.save_pretrained(f"{tmp}/hf", max_shard_size=cfg["shard_bytes"])
        checksum = float(sum(p.double().sum() for p in want.state_dict().values()))
        del want
        runs = {(f, p): [] for p in ("export", "import") for f in ("shardkit", "torch")}
        for _ in range(args.repeats):  # alternate, so machine noise hits both alike
            for (framework, phase), rs in runs.items():
                rs.append(_run(framework, phase, cfg, tmp))
    figures = {f"{framework}_{phase}": medians(rs) for (framework, phase), rs in runs.items()}
    spreads = {
        f"{framework}_{phase}": spread([r["seconds"] for r in rs])
        for (framework, phase), rs in runs.items()
    }
    per_repeat = {
        phase: [
            round(a["seconds"] / b["seconds"], 3)
            for a, b in zip(runs[("shardkit", phase)], runs[("torch", phase)])
        ]
        for phase in ("export", "import")
    }
    for framework in ("shardkit", "torch"):
        got = figures[f"{framework}_import"].pop("checksum")
        if abs(got - checksum) > 1e-6 * max(abs(checksum), 1.0):
            raise RuntimeError(f"{framework} import loaded wrong values ({got} vs {checksum})")
    sk_e, t_e = figures["shardkit_export"], figures["torch_export"]
    sk_i, t_i = figures["shardkit_import"], figures["torch_import"]
    print(
        json.dumps(
            {
                "benchmark": "hf",
                "config": {**cfg, "ranks": 2, "threads_per_rank": 1, "repeats": args.repeats},
                **figures,
                "export_time_ratio": round(sk_e["seconds"] / t_e["seconds"], 3),
                "to_hf_only_time_ratio": round(sk_e["to_hf_s"] / t_e["seconds"], 3),
                "import_time_ratio": round(sk_i["seconds"] / t_i["seconds"], 3),
                "time_ratio_per_repeat": per_repeat,
                "time_spread": spreads,
                "export_peak_ratio": round(
                    sk_e["peak_above_baseline_mb"] / max(t_e["peak_above_baseline_mb"], 1e-9), 3
                ),
                "import_peak_ratio": round(
                    sk_i["peak_above_baseline_mb"] / max(t_i["peak_above_baseline_mb"], 1e-9), 3
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
