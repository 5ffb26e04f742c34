"""``torch.distributed.checkpoint.state_dict_saver``'s names."""

from ._core._async import async_save
from ._core._deprecated import save_state_dict
from ._core._save import save

__all__ = ["async_save", "save", "save_state_dict"]
