"""Launch a script with the real ``torchrun`` (static rendezvous on a free port)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness import free_port

TORCHRUN = Path(sys.executable).with_name("torchrun")
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment minus any world description, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def torchrun_cmd(script: str | os.PathLike, nproc: int, *args: str) -> list[str]:
    """``torchrun --nproc-per-node nproc script args`` on a free port of 127.0.0.1."""
    return [
        str(TORCHRUN),
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        *args,
    ]


def torchrun(
    script: str | os.PathLike, nproc: int, *args: str, cwd=None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` ranks; stdout and stderr together in ``.stdout``."""
    return subprocess.run(
        torchrun_cmd(script, nproc, *args),
        cwd=cwd,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
