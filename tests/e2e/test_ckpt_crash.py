"""SIGKILL during saves: what is on disk loads as the previous complete checkpoint, or not at all.

A subprocess (or a 2-rank world) saves a growing step into the same directory in a loop
and is SIGKILLed at random moments, mid-write, mid-commit or mid-cleanup.
"""

import os
import random
import signal
import subprocess
import sys
import time

import torch
from harness import free_port, world_env

import shardkit.checkpoint as dcp

SAVER = r"""
import sys, torch
import shardkit.runtime as xr, shardkit.checkpoint as dcp
xr.init(backend="gloo")
path, step = sys.argv[1], int(sys.argv[2])
sys.path[:0] = [sys.argv[3], sys.argv[3] + "/.."]
from test_ckpt_crash import state
while True:
    dcp.save(state(step), checkpoint_id=path)
    print(step, flush=True)
    step += 1
"""


def state(step):
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(512, 1024, generator=g),
        "rep": torch.full((256, 1024), float(step), dtype=torch.float64),
        "step": step,
    }


def _check(path, at_least):
    """The directory holds a complete checkpoint of some step >= at_least, or none at all."""
    if not dcp.is_committed(path):
        assert at_least is None, f"a committed step {at_least} was lost"
        return None
    target = {"w": torch.empty(512, 1024), "rep": torch.empty(256, 1024, dtype=torch.float64)}
    target["step"] = -1
    dcp.load(target, checkpoint_id=path)
    step = target["step"]
    expected = state(step)
    assert torch.equal(target["w"], expected["w"]) and torch.equal(target["rep"], expected["rep"])
    assert at_least is None or step >= at_least
    return step


def _spawn(path, step, env):
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.Popen(
        [sys.executable, "-c", SAVER, path, str(step), here],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        text=True,
    )


def _last_line(proc):
    os.set_blocking(proc.stdout.fileno(), False)
    lines = (proc.stdout.read() or "").split()
    return int(lines[-1]) if lines else None


def test_sigkill_single_process_at_random_moments(tmp_path):
    path = str(tmp_path / "ck")
    rng = random.Random(1234)
    committed, step = None, 0
    for round_ in range(4):
        proc = _spawn(path, step, {})
        if round_ == 0:  # kill somewhere in the very first save too
            time.sleep(2.0 + rng.uniform(0, 1.5))
        else:
            first = proc.stdout.readline()  # one more save committed after restart
            assert first.strip(), "saver exited early"
            committed = int(first)
            time.sleep(rng.uniform(0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        last = _last_line(proc)
        committed = last if last is not None else committed
        found = _check(path, committed)
        step = (found if found is not None else step) + 100
    assert committed is not None


def test_sigkill_one_rank_of_two_mid_save(tmp_path):
    path = str(tmp_path / "ck")
    port = free_port()
    procs = [_spawn(path, 0, world_env(r, 2, port)) for r in range(2)]
    first = procs[0].stdout.readline()
    assert first.strip(), "rank 0 exited early"
    time.sleep(random.Random(7).uniform(0, 0.3))
    procs[1].send_signal(signal.SIGKILL)  # rank 1 dies mid-save
    time.sleep(1.0)
    procs[0].send_signal(signal.SIGKILL)  # rank 0 is stuck in (or failed) its collective
    for p in procs:
        p.wait()
    last = _last_line(procs[0])
    _check(path, last if last is not None else int(first))
