"""SIGKILL while a zero-stall async save stages in the background: nothing new is
committed or listed, and the previous checkpoint loads bit for bit.

The child holds its staging copy at a gate (it patches the copy call to report STAGING
and block), so the kill lands mid-staging every time, after training went on.

The child reports from two threads at once (STAGING from the staging thread, RETURNED
from the main one), so each report is one ``os.write`` of a whole line: ``print`` writes
the text and the newline separately, and the two threads' writes then interleave
("RETURNEDSTAGING\n\n"), which left the parent waiting for a line that never came.
"""

import os
import signal
import subprocess
import sys

import torch

import shardkit.checkpoint as dcp

CHILD = r"""
import faulthandler, os, sys, threading, torch
faulthandler.dump_traceback_later(120, exit=True)  # a hang fails with the stacks, not silently
import shardkit.checkpoint as dcp
from shardkit.checkpoint._core import _async
path, use_manager = sys.argv[1], sys.argv[2] == "1"
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
opt = torch.optim.Adam(model.parameters(), lr=1.0)

def step():
    opt.zero_grad()
    model(torch.ones(4, 256)).sum().backward()
    opt.step()

state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}
step()
mgr = dcp.CheckpointManager(path, save_interval=1) if use_manager else None
mgr.save(1, state(), force=True) if mgr else dcp.save(state(), checkpoint_id=path)
torch.save({k: v.clone() for k, v in model.state_dict().items()}, path + ".ref")
real, gate = _async.copy_into, threading.Event()

def gated(dst, src):
    real(dst, src)  # one piece copied, then the kill arrives
    os.write(1, b"STAGING\n")  # one write: atomic on a pipe, never interleaved
    gate.wait()

_async.copy_into = gated
step()
mgr.save_async(2, state(), force=True) if mgr else dcp.async_save(state(), checkpoint_id=path)
os.write(1, b"RETURNED\n")
threading.Event().wait()
"""


def _run_and_kill(path, use_manager):
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, path, "1" if use_manager else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        text=True,
    )
    seen = set()
    try:
        while seen != {"STAGING", "RETURNED"}:
            line = proc.stdout.readline()
            assert line, f"child exited early: {proc.wait()} {proc.stderr.read()}"
            assert line.strip() in {"STAGING", "RETURNED"}, f"unexpected line {line!r}"
            seen.add(line.strip())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _check_model(got, path):
    want = torch.load(path + ".ref")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_sigkill_mid_staging_keeps_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    _run_and_kill(path, use_manager=False)
    assert dcp.is_committed(path)
    md = dcp.read_metadata(path)
    target = {"model": {k: torch.empty_like(v) for k, v in torch.load(path + ".ref").items()}}
    dcp.load(target, checkpoint_id=path, planner=dcp.DefaultLoadPlanner())
    _check_model(target["model"], path)
    names = {n for n in os.listdir(path) if n.startswith("data-")}
    assert names == {n for n in md.files if n.startswith("data-")}  # nothing new was written


def test_sigkill_mid_staging_lists_no_new_manager_step(tmp_path):
    path = str(tmp_path / "mgr")
    _run_and_kill(path, use_manager=True)
    mgr = dcp.CheckpointManager(path, save_interval=1)
    assert mgr.all_steps() == [1]
    target = {"model": {k: torch.empty_like(v) for k, v in torch.load(path + ".ref").items()}}
    mgr.restore(1, target)
    _check_model(target["model"], path)
