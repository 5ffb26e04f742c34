"""One rank fails: the whole ``torchrun`` job must end promptly, not at the group's timeout.

Found by an audit of failure propagation (2026-11-29): a rank that ended with
``sys.exit(1)`` (or argparse's error, or an uncaught exception under an application's
own ``sys.excepthook``) waited in shardkit's exit barrier while the other rank waited in
its collective, so nothing exited for the 10-minute group timeout; plain torch ends the
same job in seconds. A rank that skipped a collective the others called (a user bug)
hung the same way. Each case here must end within the test's timeout with the failure
reported, far below the group's timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import textwrap

import pytest
from _torchrun import clean_env, torchrun_cmd

pytestmark = pytest.mark.timeout(300)

SCRIPT = textwrap.dedent(
    """
    import argparse, sys
    import torch, torch.distributed as dist
    import shardkit.runtime as xr
    from shardkit.fsdp import FSDP

    how = sys.argv[1]
    xr.init()
    rank = xr.global_ordinal()
    model = FSDP(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    if rank == 1:
        if how == "sys.exit":
            sys.exit(1)
        if how == "builtin exit":
            exit(1)
        if how == "argparse":
            argparse.ArgumentParser().error("bad --lr")
        if how == "own excepthook":
            sys.excepthook = lambda *exc: print("app hook:", exc[1], file=sys.stderr)
            raise RuntimeError("data check failed on rank 1")
    if how == "skipped collective" and rank == 1:
        print("rank 1 skips the forward the others run", flush=True)
    else:
        model(torch.ones(2, 4)).sum().backward()  # rank 0 waits in it for rank 1
    print(f"rank {rank} finished", flush=True)
    """
)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return found


def _run(tmp_path, how: str, timeout: float = 150) -> tuple[int, str]:
    """Run SCRIPT under torchrun; every process of the job is killed at ``timeout``."""
    script = tmp_path / "one_fails.py"
    script.write_text(SCRIPT)
    env = clean_env(SHARDKIT_EXIT_WAIT_MAX="5", SHARDKIT_EXIT_WAIT_WARN="2")
    proc = subprocess.Popen(
        torchrun_cmd(script, 2, how),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:  # workers have sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{how}: the job still ran after {timeout:.0f} s:\n{out[-3000:]}")
    return proc.returncode, out


@pytest.mark.parametrize("how", ["sys.exit", "builtin exit", "argparse", "own excepthook"])
def test_a_rank_that_fails_ends_the_job(tmp_path, how):
    code, out = _run(tmp_path, how)
    assert code != 0, out[-3000:]
    assert "rank 0 finished" not in out, out[-3000:]
    # the failed rank skips the exit barrier rather than wait there (bounded, 5 s here)
    assert "reached the end of the program" not in out, out[-3000:]
    # rank 1 is a failure of the job, and rank 0 learns of it from the closed connection
    assert "Connection closed by peer" in out or "exitcode  : 1" in out, out[-3000:]


def test_a_rank_that_skipped_a_collective_leaves_after_the_bounded_wait(tmp_path):
    code, out = _run(tmp_path, "skipped collective")
    assert "leaves without them (SHARDKIT_EXIT_WAIT_MAX)" in out, out[-3000:]
    assert code != 0 and "rank 0 finished" not in out, out[-3000:]
