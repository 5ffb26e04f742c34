"""`shardkit demo` as `make demo` runs it: torchrun, preemption, resume, summary.

Short (--steps 60) to fit the test budget; the full run (300 steps, accuracy >= 0.95) is
`make demo`. Every strategy and hook is covered, faster, by test_demo_strategies.py.
"""

import subprocess
import sys

import torch
from safetensors.torch import load_file

from shardkit.cli._demo_parts import accuracy, load_digits_split, make_mlp


def test_demo_runs_both_phases_and_prints_the_summary(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "shardkit", "demo", "--steps", "60", "--lr", "0.01"]
        + ["--save-every", "20", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = result.stdout
    assert "phase 1" in result.stderr and "phase 2" in result.stderr  # rank 0's progress bars
    assert "[shardkit demo] preempted (SIGTERM) at step 30; checkpoint saved" in text
    assert "[shardkit demo] resumed from step 30" in text
    summary = text[text.index("shardkit demo summary") :].splitlines()
    fields = {line.split()[0]: line for line in summary[1:]}
    assert "fsdp, 2 ranks" in fields["strategy"]
    assert "steps 31..59, resumed from step 30" in text
    for name in ("step", "checkpoint", "bytes", "consolidated", "wall"):
        assert name in fields, summary
    reported = float(fields["accuracy"].split()[1])
    model = make_mlp(seed=0)
    model.load_state_dict(load_file(out / "model.safetensors"))
    _, _, x_test, y_test = load_digits_split(0)
    assert abs(accuracy(model, x_test, y_test) - reported) < 1e-4
    assert reported > 0.8
    assert "MiB per rank" in fields["bytes"] or "KiB per rank" in fields["bytes"]
    # a second run into the same directory is refused with one line, not overwritten
    again = subprocess.run(
        [sys.executable, "-m", "shardkit", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert again.stderr.strip().startswith("shardkit: error:") and "already holds" in again.stderr
    assert torch.equal(load_file(out / "model.safetensors")["0.weight"], model[0].weight)
