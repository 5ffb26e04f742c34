"""The digits example end to end: a real SIGTERM preempts it, a rerun resumes from there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_with_manager.py"


def _start(ckpt, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(EXAMPLE), "--ckpt", str(ckpt), *extra]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def test_example_preempted_by_sigterm_then_resumed(tmp_path):
    ckpt = tmp_path / "run"
    proc = _start(ckpt, "--steps", "100000", "--save-interval", "1000")
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("checkpoint at 0"):
                proc.send_signal(signal.SIGTERM)  # the handler only sets a flag
        assert proc.wait(60) == 0, "".join(lines)
    finally:
        proc.kill()
    out = "".join(lines)
    preempted = [ln for ln in lines if ln.startswith("preempted: saved step")]
    assert preempted, out
    step = int(preempted[0].split()[3].rstrip(","))
    assert 0 < step < 1000, out  # an off-interval step
    assert f"checkpoint at {step}" in out

    rerun = _start(ckpt, "--steps", str(step + 3), "--save-interval", "1000")
    out2, _ = rerun.communicate(timeout=60)
    assert rerun.returncode == 0, out2
    assert f"resumed from step {step}" in out2, out2
    assert f"done: steps [0, {step}] on disk" in out2, out2
