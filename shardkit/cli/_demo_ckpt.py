"""Checkpointing for the demo worker, on shardkit's CheckpointManager.

The manager saves asynchronously on its own gloo group, watches SIGTERM and makes every
rank checkpoint at the same step when any rank receives it. State dicts come from the
state-dict helpers, so the same code serves plain, DDP, FSDP and SPMD models.
"""

from __future__ import annotations

import os
import time
import warnings

import torch

from ..checkpoint import CheckpointManager, load, prime_optimizer, read_metadata
from ..checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["DemoCheckpoints"]


class DemoCheckpoints:
    """Save, restore, preemption and consolidation for the demo's training loop."""

    def __init__(
        self,
        path: str,
        save_interval: int,
        hook_state=None,
        *,
        local_every: int = 0,
        local_dir: str | None = None,
    ) -> None:
        self.path = path
        extra = {}
        if local_every > 0:  # the RAM tier (node-local copy + a peer's replica)
            if hook_state is not None:
                raise ValueError(
                    "the RAM tier does not restore PowerSGD's per-rank memory yet: "
                    "run --hook powersgd with --local-every 0"
                )
            from ..checkpoint import LocalTier

            extra["local_tier"] = LocalTier(interval=local_every, directory=local_dir)
        self.mgr = CheckpointManager(path, save_interval, max_to_keep=2, **extra)
        self.hook_state = hook_state  # a PowerSGDState, checkpointed with the model
        self._restored = False

    def _state(self, module, optimizer) -> dict:
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.hook_state is not None:
            state["powersgd"] = _powersgd_state(self.hook_state)
        return state

    def restore_latest(self, module, optimizer) -> int | None:
        """Load the latest committed step into ``module``/``optimizer``; its number."""
        self._restored = False
        step = self.mgr.latest_step()
        if step is None:
            return None
        prime_optimizer(optimizer)  # Adam's moments must exist to be loaded in place
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.hook_state is not None:
            state["powersgd"] = _powersgd_slots(read_metadata(self.step_path(step)))
        self.mgr.restore(step, state)
        set_state_dict(
            module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        if self.hook_state is not None:
            _set_powersgd_state(self.hook_state, state["powersgd"])
        self._restored = True
        return step

    def restored_tier(self, rank: int) -> str | None:
        """The tier ``rank`` restored from at the last restore: local, peer or persistent."""
        info = getattr(self.mgr, "last_restore", None)
        if info is None:
            return "persistent" if self._restored else None
        return info.tiers_by_rank[rank]

    def save(self, step: int, module, optimizer, *, force: bool = False) -> float | None:
        """Save asynchronously when due (or forced, or preempted).

        Returns the seconds the training loop was blocked, or None if nothing was saved.
        """
        start = time.perf_counter()
        saved = self.mgr.save_async(step, self._state(module, optimizer), force=force)
        return time.perf_counter() - start if saved else None

    def reached_preemption(self, step: int) -> bool:
        """Whether the ranks agreed on a preemption checkpoint at or before ``step``."""
        return self.mgr.reached_preemption(step)

    def join(self) -> None:
        """Wait until every pending save has committed."""
        self.mgr.close()

    def step_path(self, step: int) -> str:
        """Where the manager keeps ``step`` (docs/checkpoint-manager.md, "Layout on disk")."""
        return os.path.join(self.path, f"step_{step:08d}")

    def consolidate(self, step: int, out_file: str) -> None:
        """Write the model weights of ``step`` as full tensors to one safetensors file.

        Keys are the unwrapped model's names (``0.weight``), so the file loads into a
        plain ``nn.Module`` with ``load_state_dict``. Run on one rank.
        """
        from safetensors.torch import save_file

        ckpt = self.step_path(step)
        tensors = read_metadata(ckpt).tensors
        model = {
            key: torch.empty(meta.shape, dtype=meta.dtype)
            for key, meta in tensors.items()
            if key.startswith("model.")
        }
        with warnings.catch_warnings():  # the optimizer state is skipped on purpose
            warnings.simplefilter("ignore", UserWarning)
            load({"model": _nest(model)}, checkpoint_id=ckpt, strict=False, no_dist=True)
        save_file({k.removeprefix("model."): v for k, v in model.items()}, out_file)


# PowerSGD's memory: the error-feedback residual differs per rank, so every per-bucket
# tensor is saved as one row per rank of a ShardedTensor (row r = rank r's tensor); the
# warm-start P/Q memories are saved the same way for simplicity. The iteration counter
# and the original shapes are JSON values.
_MEMORIES = ("error_dict", "p_memory_dict", "q_memory_dict")


def _rank_mesh():
    from .. import runtime as xr
    from .. import spmd as xs

    world = xr.world_size()
    return xs.Mesh(list(range(world)), (world,), ("rank",)), world


def _powersgd_state(hook_state) -> dict:
    from .. import spmd as xs

    mesh, world = _rank_mesh()
    out: dict = {"iter": hook_state.iter, "shapes": {}}
    for name in _MEMORIES:
        for index, tensor in getattr(hook_state, name).items():
            key = f"{name}-{index}"
            row = tensor.detach().reshape(1, -1)
            out[key] = xs.ShardedTensor.from_local(row, mesh, ("rank", None), (world, row.shape[1]))
            out["shapes"][key] = list(tensor.shape)
    return out


def _powersgd_slots(metadata) -> dict:
    """Tensors to load the saved PowerSGD memory into, shaped as the checkpoint says."""
    from .. import spmd as xs

    mesh, world = _rank_mesh()
    prefix = "powersgd."
    out: dict = {"iter": 0, "shapes": {}}
    for key, meta in metadata.tensors.items():
        if key.startswith(prefix):
            if meta.shape[0] != world:
                raise ValueError(
                    f"the checkpoint's PowerSGD memory was saved by {meta.shape[0]} ranks; "
                    f"it cannot resume on {world}"
                )
            local = torch.empty(1, meta.shape[1], dtype=meta.dtype)
            out[key[len(prefix) :]] = xs.ShardedTensor.from_local(
                local, mesh, ("rank", None), tuple(meta.shape)
            )
    return out


def _set_powersgd_state(hook_state, loaded: dict) -> None:
    hook_state.iter = int(loaded["iter"])
    for key, shape in loaded["shapes"].items():
        name, index = key.rsplit("-", 1)
        local = loaded[key].local_tensor().detach().reshape(shape).clone()
        getattr(hook_state, name)[int(index)] = local


def _nest(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # load() flattens {"model": {"0.weight": t}} to "model.0.weight", as save did.
    return {k.removeprefix("model."): v for k, v in flat.items()}
