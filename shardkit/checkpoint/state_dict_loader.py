"""``torch.distributed.checkpoint.state_dict_loader``'s names."""

from ._core._deprecated import load_state_dict
from ._core._load import load

__all__ = ["load", "load_state_dict"]
