"""The demo's per-rank program for every strategy and hook, without torchrun's start-up.

On 2 ranks each configuration runs like `shardkit demo`: phase 1 is preempted by a real
SIGTERM to rank 0, phase 2 resumes from the agreed step and finishes; a third run trains
the same steps without interruption. Resuming must give bitwise the same consolidated
model (PowerSGD included: its per-rank memory and iteration count are checkpointed), and
the consolidated file must reproduce the reported accuracy.
"""

import json

import torch
from harness import run_ranks

CONFIGS = [
    ("fsdp", "none"),
    ("ddp", "none"),
    ("ddp", "fp16"),
    ("ddp", "powersgd"),
    ("spmd", "none"),
]
STEPS, PREEMPT = 24, 12


def _run_all(root):
    import os

    from safetensors.torch import load_file

    from shardkit.cli import _demo_worker

    results = {}
    for strategy, hook in CONFIGS:
        name = f"{strategy}-{hook}"
        out = {}
        for run, preempt in (("resumed", PREEMPT), ("straight", -1)):
            d = os.path.join(root, name, run)
            base = [
                *("--strategy", strategy, "--hook", hook, "--steps", str(STEPS)),
                *("--save-every", "5", "--lr", "0.01", "--ckpt-dir", f"{d}/ckpt"),
                *("--out-file", f"{d}/model.safetensors", "--report", f"{d}/report.jsonl"),
            ]
            phases = [[*base, "--preempt-at", str(preempt)]] + ([base] if preempt >= 0 else [])
            for i, argv in enumerate(phases, 1):
                _demo_worker.run(_demo_worker._parse([*argv, "--phase", str(i)]))
            if torch.distributed.get_rank() == 0:
                with open(f"{d}/report.jsonl") as f:
                    reports = [json.loads(line) for line in f]
                weights = {k: v.tolist() for k, v in load_file(f"{d}/model.safetensors").items()}
                out[run] = {"reports": reports, "weights": weights}
        results[name] = out
    return results


def test_every_strategy_preempts_resumes_and_consolidates(tmp_path):
    from shardkit.cli._demo_parts import accuracy, load_digits_split, make_mlp

    results = run_ranks(_run_all, 2, str(tmp_path), timeout=240)[0]
    _, _, x_test, y_test = load_digits_split(0)
    for name, runs in results.items():
        phase1, phase2 = runs["resumed"]["reports"]
        assert phase1["preempted_at"] == PREEMPT and phase1["accuracy"] is None, name
        assert phase2["resumed_from"] == PREEMPT and phase2["start_step"] == PREEMPT + 1, name
        assert phase2["last_step"] == STEPS - 1 and phase1["comm_bytes"] > 0, name
        assert len(phase1["ckpt_blocking_s"]) == 4  # steps 0, 5, 10 and the preemption at 12
        model = make_mlp(seed=0)
        model.load_state_dict({k: torch.tensor(v) for k, v in runs["resumed"]["weights"].items()})
        assert accuracy(model, x_test, y_test) == phase2["accuracy"], name
        assert phase2["accuracy"] > 0.5, name  # 24 steps at lr 0.01 already learn
        assert runs["resumed"]["weights"] == runs["straight"]["weights"], name
    # compressed hooks send fewer bytes per step than plain DDP
    per_step = {n: r["straight"]["reports"][0]["comm_bytes"] / STEPS for n, r in results.items()}
    assert per_step["ddp-fp16"] < 0.6 * per_step["ddp-none"]
    assert per_step["ddp-powersgd"] < per_step["ddp-none"]
