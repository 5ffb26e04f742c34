"""Hugging Face checkpoints, both ways (``transformers`` ``from_pretrained`` directories).

- :func:`to_hf`: a shardkit checkpoint (any layout, any world size) -> an HF directory of
  sharded safetensors files plus ``model.safetensors.index.json``, streamed tensor by
  tensor; picks the model subtree of a training checkpoint and reports what it dropped.
- :func:`load_hf`: an HF safetensors directory -> a plain, FSDP-wrapped or tensor-parallel
  model in place, each rank reading only the byte ranges of its own shards.

``transformers`` is needed only to build a model from its config (``to_hf(config=...)``).
See docs/huggingface.md.
"""

from ._convert._hf import HFExport, to_hf
from ._convert._hf_import import load_hf

__all__ = ["HFExport", "load_hf", "to_hf"]
