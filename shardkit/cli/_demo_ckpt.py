"""Checkpointing for the demo worker (interim: torch DCP until shardkit.checkpoint lands)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

__all__ = ["DemoCheckpoints"]


class DemoCheckpoints:
    """Save, restore, preemption and consolidation for the demo's training loop."""

    def __init__(self, path: str, save_interval: int) -> None:
        self.path = path
        self.save_interval = save_interval
        self._preempted = False
        self._pending = None
        signal.signal(signal.SIGTERM, self._on_sigterm)
        os.makedirs(path, exist_ok=True)

    def _on_sigterm(self, signum, frame) -> None:
        self._preempted = True

    def _dir(self, step: int) -> str:
        return os.path.join(self.path, str(step))

    def all_steps(self) -> list[int]:
        """Committed steps."""
        return sorted(
            int(n)
            for n in os.listdir(self.path)
            if n.isdigit() and os.path.exists(os.path.join(self.path, n, ".metadata"))
        )

    def _state(self, module, optimizer):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if getattr(module, "_shardkit_wrapper", False):
            module = module.module
        model_sd, optim_sd = get_state_dict(module, optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def restore_latest(self, module, optimizer) -> int | None:
        """Load the latest committed step into ``module``/``optimizer``; its number."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        steps = self.all_steps()
        if not steps:
            return None
        step = steps[-1]
        state = self._state(module, optimizer)
        dcp.load(state, checkpoint_id=self._dir(step))
        if getattr(module, "_shardkit_wrapper", False):
            module = module.module
        set_state_dict(
            module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        return step

    def reached_preemption(self, step: int) -> bool:
        """Whether any rank got SIGTERM (all ranks agree on the same step)."""
        flag = torch.tensor([1.0 if self._preempted else 0.0])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def save(self, step: int, module, optimizer, *, force: bool = False) -> float | None:
        """Start an async save when due; returns the seconds the caller was blocked."""
        import torch.distributed.checkpoint as dcp

        if not force and step % self.save_interval != 0:
            return None
        start = time.perf_counter()
        self.join()
        dcp.save(self._state(module, optimizer), checkpoint_id=self._dir(step))
        return time.perf_counter() - start

    def join(self) -> None:
        """Wait for the pending save to commit."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def consolidate(self, step: int, out_file: str) -> None:
        """Write the model weights of ``step`` to one safetensors file (rank 0 only)."""
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        tmp = out_file + ".pt"
        dcp_to_torch_save(self._dir(step), tmp)
        state = torch.load(tmp, weights_only=True)
        os.remove(tmp)
        save_file({f"model.{k}": v.contiguous() for k, v in state["model"].items()}, out_file)
