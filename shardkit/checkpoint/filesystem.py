"""``torch.distributed.checkpoint.filesystem``'s names: the file-system storage."""

from ._core._storage import FileSystemReader
from ._core._torch_args import FileSystemWriter

__all__ = ["FileSystemReader", "FileSystemWriter"]
