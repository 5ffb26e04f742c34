"""Check a legacy (pre-zip) ``torch.save`` file before ``torch.load`` reads it.

A legacy file is a sequence of pickles: a magic number, a protocol version, a system
description, the object (its storages as persistent ids ``('storage', type, key,
location, numel, ...)``), the storage keys, then each storage's bytes. ``torch.load``
allocates every storage at the size its persistent id declares before it reads any
bytes, so a 350-byte file can ask for 400 GB. Here the pickles are walked with an
unpickler that imports and runs nothing (every class or function the pickle names is a
stand-in), and the storages' declared bytes are checked against the bytes the file
holds after them.
"""

from __future__ import annotations

import functools
import pickle
import warnings
from typing import Any, BinaryIO

import torch

from .._core._errors import CorruptCheckpointError, damage_is_corruption
from .._core._format import is_int
from ._torch_file import byte_order_error

__all__ = ["check_legacy"]

_MAGIC = 0x1950A86A20F9469CFC6C
_PROTOCOL = 1001
_STORAGE_HEADER_BYTES = 8  # each storage's bytes follow its element count (int64)


class _StandIn:
    """What any name the pickle imports becomes: accepts every call and update, runs
    nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


@functools.cache
def _storage_stand_ins() -> dict[str, type]:
    """A stand-in per legacy storage type of torch (``FloatStorage``, ...), carrying its
    element size; every other name the pickle imports becomes ``_StandIn`` itself."""
    legacy = torch.storage._LegacyStorage
    out = {}
    with warnings.catch_warnings():  # "TypedStorage is deprecated", for reading .dtype
        warnings.simplefilter("ignore", UserWarning)
        for attr in dir(torch):
            cls = getattr(torch, attr)
            if attr.endswith("Storage") and isinstance(cls, type) and issubclass(cls, legacy):
                out[attr] = type(attr, (_StandIn,), {"item_bytes": cls.dtype.itemsize})
    return out


class _Walk(pickle.Unpickler):
    """Unpickles with stand-ins; records the storages the persistent ids declare."""

    def __init__(self, f: BinaryIO, name: str) -> None:
        super().__init__(f)
        self.name = name
        self.storages: dict[str, int] = {}  # key -> bytes

    def find_class(self, module: str, name: str) -> type:
        storage = _storage_stand_ins().get(name) if module == "torch" else None
        return storage or _StandIn

    def persistent_load(self, pid: Any) -> None:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise CorruptCheckpointError(f"{self.name}: unknown persistent id {pid!r:.80}")
        kind, key, numel = pid[1], pid[2], pid[4]
        if not (
            isinstance(kind, type)
            and hasattr(kind, "item_bytes")
            and isinstance(key, str)
            and is_int(numel)
            and numel >= 0
        ):
            raise CorruptCheckpointError(f"{self.name}: malformed storage entry {pid!r:.120}")
        self.storages[key] = numel * kind.item_bytes


def check_legacy(f: BinaryIO, name: str, size: int) -> None:
    """Refuse a legacy file whose storages declare more bytes than follow them in the
    file, or whose pickles are damaged, before ``torch.load`` allocates anything.
    ``f`` is at the file's start and ``size`` is its byte count."""
    walk = _Walk(f, name)
    with damage_is_corruption(f"{name}: not a readable torch.save file"):
        magic, protocol, sys_info = (_Walk(f, name).load() for _ in range(3))
        if magic == _MAGIC and protocol == _PROTOCOL:
            walk.load()
            keys = _Walk(f, name).load()
    if magic != _MAGIC or protocol != _PROTOCOL or not isinstance(sys_info, dict):
        raise CorruptCheckpointError(f"{name}: not a torch.save file (neither zip nor legacy)")
    if sys_info.get("little_endian") is not True:
        raise byte_order_error(name, "big")
    if not (
        isinstance(keys, list)
        and all(isinstance(k, str) for k in keys)
        and set(keys) == set(walk.storages)
    ):
        raise CorruptCheckpointError(f"{name}: its storage list does not match its object")
    declared = sum(_STORAGE_HEADER_BYTES + nbytes for nbytes in walk.storages.values())
    left = size - f.tell()
    if declared > left:
        raise CorruptCheckpointError(
            f"{name}: its storages declare {declared} bytes but only {left} bytes follow "
            "them in the file (truncated or damaged)"
        )
