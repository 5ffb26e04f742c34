"""State-dict helpers: model and optimizer state keyed by the unwrapped model's FQNs.

Works for plain models and models wrapped by torch DDP, torch FSDP2 (``fully_shard``,
DTensor parameters), ``torch.compile``, activation checkpointing, and shardkit wrappers
through the protocols in ``docs/architecture.md``. Optimizer state is keyed by parameter
FQN, so a checkpoint written on N ranks loads on M. See ``docs/state-dict.md``.
"""

from ._state_dict._api import get_state_dict, set_state_dict
from ._state_dict._model import IncompatibleKeys, get_model_state_dict, set_model_state_dict
from ._state_dict._optim import get_optimizer_state_dict, set_optimizer_state_dict
from ._state_dict._options import StateDictOptions

__all__ = [
    "IncompatibleKeys",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]
