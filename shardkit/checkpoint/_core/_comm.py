"""Small JSON exchanges between ranks (never pickle: ``all_gather_object`` unpickles)."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from ...runtime._collective import collective_device
from ...runtime._json_gather import all_gather_json
from ._errors import CheckpointError


def world_of_many() -> bool:
    """Whether a process group of more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Comm:
    """The ranks taking part in one save or load; a world of one without a process group."""

    def __init__(self, group: Any = None, *, local: bool = False) -> None:
        self.group = group
        self.active = not local and dist.is_available() and dist.is_initialized()
        if group is not None and not self.active and not local:
            raise ValueError("process_group was given but no process group is initialized")
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process_group")

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world_size == 1:
            return [json.loads(json.dumps(obj, separators=(",", ":")))]
        return all_gather_json(
            obj, self.group, device=collective_device(self.group), gather=self._all_gather
        )

    def _all_gather(self, outs: list[torch.Tensor], mine: torch.Tensor) -> None:
        """``dist.all_gather``; a timeout says the likely cause: a save or load that not
        every rank called (``if rank == 0: save(...)``) waits until the group's timeout."""
        try:
            dist.all_gather(outs, mine, group=self.group)
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
            raise CheckpointError(
                f"rank {self.rank}: the other ranks did not join this checkpoint operation "
                f"within the process group's timeout ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0]}). save, load and async_save are collective: call "
                "them on every rank of the group, in the same order (not under `if rank == "
                "0:`); to save from one process alone, pass no_dist=True"
            ) from exc

    def agree(self, error: BaseException | None, what: str, payload: Any = None) -> list[Any]:
        """Exchange success flags (and payloads); if any rank failed, every rank raises.

        The failing rank re-raises its own exception; the others raise CheckpointError
        naming the failing ranks and their messages.
        """
        mine = {"ok": error is None, "payload": payload if error is None else None}
        if error is not None:
            mine["error"] = f"{type(error).__name__}: {error}"
        replies = self.all_gather_json(mine)
        failed = {r: rep["error"] for r, rep in enumerate(replies) if not rep["ok"]}
        if failed:
            if error is not None:
                raise error
            detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed.items())
            raise CheckpointError(f"{what} failed on rank(s) {sorted(failed)}: {detail}")
        return [rep["payload"] for rep in replies]
