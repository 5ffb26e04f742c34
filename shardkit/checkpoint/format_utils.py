"""Checkpoint format conversions, so users can migrate to and from shardkit.

- :func:`dcp_to_torch_save` / :func:`torch_save_to_dcp`: shardkit checkpoint <-> one
  ``torch.save`` file of full tensors.
- :func:`to_safetensors` / :func:`from_safetensors`: shardkit checkpoint <-> one
  safetensors file of full tensors (non-tensor values as JSON in its header).
- :func:`import_torch_dcp`: a ``torch.distributed.checkpoint`` checkpoint -> shardkit
  (torch's metadata is a pickle: import trusted checkpoints only).
- :func:`materialize`: an incremental checkpoint -> a self-contained copy.

They run in one process (or on every rank alike when a process group is initialized,
since writing a checkpoint is collective). See docs/state-dict.md.
"""

from ._convert._convert import (
    dcp_to_torch_save,
    from_safetensors,
    import_torch_dcp,
    to_safetensors,
    torch_save_to_dcp,
)
from ._convert._materialize import materialize

__all__ = [
    "dcp_to_torch_save",
    "from_safetensors",
    "import_torch_dcp",
    "materialize",
    "to_safetensors",
    "torch_save_to_dcp",
]
