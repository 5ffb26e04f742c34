"""``torch.distributed.checkpoint.storage``'s names: the storage interfaces."""

from ._core._storage import StorageReader, StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
