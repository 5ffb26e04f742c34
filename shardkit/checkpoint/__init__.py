"""Distributed checkpointing: save / load / async_save with resharding (``import shardkit.checkpoint as dist_cp``).

A checkpoint is a directory of safetensors data files plus a versioned JSON metadata file
written last as the commit; every chunk carries a checksum verified on load, and nothing
is ever unpickled unless the caller opts in. See docs/checkpoint.md.
"""

from ._core._async import async_save
from ._core._deprecated import load_state_dict, save_state_dict
from ._core._errors import (
    CheckpointError,
    CorruptCheckpointError,
    ReplicaMismatchWarning,
    StateDictMismatchError,
)
from ._core._flatten import Stateful
from ._core._format import ChunkMeta, Metadata, ObjectMeta, TensorMeta
from ._core._load import is_committed, load, read_metadata
from ._core._planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    SPMDLoadPlanner,
    SPMDSavePlanner,
    WriteItem,
)
from ._core._save import save
from ._core._storage import FileSystemReader, StorageReader, StorageWriter
from ._core._torch_args import FileSystemWriter
from ._manager._manager import CheckpointManager
from ._manager._prime import prime_optimizer
from ._manager._retention import (
    AnyPreservationPolicy,
    BestN,
    EveryNSteps,
    LatestN,
    PreservationPolicy,
)
from ._manager._tiers import LocalTier, RestoreInfo

__all__ = [
    "AnyPreservationPolicy",
    "BestN",
    "CheckpointManager",
    "EveryNSteps",
    "LatestN",
    "LocalTier",
    "RestoreInfo",
    "PreservationPolicy",
    "prime_optimizer",
    "CheckpointError",
    "ChunkMeta",
    "CorruptCheckpointError",
    "DefaultLoadPlanner",
    "DefaultSavePlanner",
    "FileSystemReader",
    "FileSystemWriter",
    "LoadPlan",
    "LoadPlanner",
    "Metadata",
    "ObjectMeta",
    "ReadItem",
    "ReplicaMismatchWarning",
    "SPMDLoadPlanner",
    "SPMDSavePlanner",
    "SavePlan",
    "SavePlanner",
    "StateDictMismatchError",
    "Stateful",
    "StorageReader",
    "StorageWriter",
    "TensorMeta",
    "WriteItem",
    "async_save",
    "is_committed",
    "load",
    "load_state_dict",
    "read_metadata",
    "save",
    "save_state_dict",
]
