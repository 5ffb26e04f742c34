"""A ``torch.save`` file read without mapping it privately.

``torch.load`` with ``mmap`` on maps the whole file privately and writably, which Linux charges
in full against committed memory (it fails for a file larger than RAM, and under strict
overcommit far sooner). Here the file's structure is unpickled with ``weights_only=True``
onto the meta device (no tensor bytes are read), every tensor's bytes are located and
checked against the zip directory, and a tensor's bytes are then read on demand with
``preadv`` straight into a destination, or viewed through a read-only shared map.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import warnings
import zipfile
from typing import Any

import torch

from .._core._errors import CorruptCheckpointError, damage_is_corruption
from .._core._storage import open_regular

__all__ = ["TorchFile", "byte_order_error", "check_views", "records", "torch_load"]

_DATA_RE = re.compile(r"^[^/]+/data/[^/]+$")
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
# what Python's zipfile raises for a damaged archive: a bad header, a size past the end,
# an unknown version or compression method, a name that is not text
_ZIP_DAMAGE = (zipfile.BadZipFile, EOFError, NotImplementedError, ValueError, struct.error)


def records(f, name: str, size: int) -> dict[int, int]:
    """Data offset -> byte count of every stored tensor record of the zip archive."""
    try:
        infos = zipfile.ZipFile(f).infolist()
    except _ZIP_DAMAGE as exc:
        raise CorruptCheckpointError(
            f"{name}: not a readable torch.save zip file ({type(exc).__name__}: {exc})"
        ) from None
    out: dict[int, int] = {}
    for info in infos:
        if not _DATA_RE.match(info.filename):
            continue
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptCheckpointError(f"{name}: record {info.filename!r} is compressed")
        if not 0 <= info.header_offset <= size - _LOCAL_HEADER.size:
            raise CorruptCheckpointError(f"{name}: record {info.filename!r} has no header")
        f.seek(info.header_offset)
        header = f.read(_LOCAL_HEADER.size)
        if len(header) < _LOCAL_HEADER.size:
            raise CorruptCheckpointError(f"{name}: record {info.filename!r} has no header")
        sig, name_len, extra_len = _LOCAL_HEADER.unpack(header)
        if sig != b"PK\x03\x04":
            raise CorruptCheckpointError(f"{name}: record {info.filename!r} has a bad header")
        start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if start + info.file_size > size:
            raise CorruptCheckpointError(
                f"{name}: record {info.filename!r} runs past the end of the file"
            )
        out[start] = info.file_size
    return out


def _byteorder(f, name: str) -> None:
    with zipfile.ZipFile(f) as z:
        for info in z.infolist():
            if info.filename.endswith("/byteorder") and info.file_size <= 16:
                try:
                    order = z.read(info).decode(errors="replace")
                except _ZIP_DAMAGE as exc:
                    raise CorruptCheckpointError(
                        f"{name}: record {info.filename!r}: {exc}"
                    ) from None
                if order != "little":
                    raise byte_order_error(name, repr(order))


def byte_order_error(name: str, order: str) -> ValueError:
    """The refusal of a file saved on a machine of another byte order ``order``."""
    return ValueError(
        f"{name}: saved on a {order}-endian machine; shardkit reads little-endian "
        "torch.save files only (load it with torch.load)"
    )


# A file's tensors together may hold at most this many times the file's size (plus
# _SLACK_BYTES): tied weights and views of one storage import, a file listing one storage
# under a million keys does not (docs/checkpoint.md, "torch.save files").
_AMPLIFY = 8
_SLACK_BYTES = 1 << 20


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage a view needs, from the storage's start."""
    if t.numel() == 0:
        return 0
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def _own_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage a view covers, from its first element to its last."""
    return _span_bytes(t) - t.storage_offset() * t.element_size() if t.numel() else 0


def _tensors(value: Any, key: str = "") -> Any:
    """(key, tensor) for every tensor in dicts, lists and tuples, keys joined with '.'."""
    if isinstance(value, torch.Tensor):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{key}.{i}" if key else str(i))


def _check_view(name: str, key: str | None, t: torch.Tensor) -> int:
    """``t``'s bytes once read; refuses a view holding more bytes than it covers."""
    nbytes = t.numel() * t.element_size()
    if any(st < 0 for st in t.stride()) or nbytes > _own_bytes(t):
        where = f"key {key!r}" if key is not None else "a tensor"
        raise CorruptCheckpointError(
            f"{name}: {where} ({t.dtype}, shape {tuple(t.shape)}, strides "
            f"{tuple(t.stride())}) would hold {nbytes} bytes but covers only "
            f"{_own_bytes(t)} bytes of its storage (an expanded or overlapping view such "
            "as x.expand(n)); shardkit does not import such views: torch.save "
            "x.contiguous() instead, or load the file with torch.load"
        )
    return nbytes


def check_views(obj: Any, name: str, file_bytes: int) -> None:
    """Refuse, before anything is read, a tensor holding more bytes than the storage it
    covers, and tensors holding together more than ``_AMPLIFY`` x ``file_bytes`` (plus
    ``_SLACK_BYTES``): what is read from a file is bounded by the file's size."""
    total = 0
    for key, t in _tensors(obj):
        total += _check_view(name, key, t)
    limit = _AMPLIFY * file_bytes + _SLACK_BYTES
    if total > limit:
        raise CorruptCheckpointError(
            f"{name}: its tensors hold {total} bytes together, more than {_AMPLIFY} times "
            f"the file's {file_bytes} bytes (plus {_SLACK_BYTES}): too many keys view the "
            "same storage; shardkit does not import it (load it with torch.load)"
        )


def torch_load(f: Any, name: str, **kwargs: Any) -> Any:
    """``torch.load(f, weights_only=True, **kwargs)``. A damaged pickle fails in many ways
    (``UnpicklingError``, ``KeyError``, ``UnicodeDecodeError``, ...): each is a
    ``CorruptCheckpointError`` naming the file, never an error that looks like our bug."""
    with damage_is_corruption(f"{name}: not a readable torch.save file"):
        return torch.load(f, weights_only=True, **kwargs)


class TorchFile:
    """A local ``torch.save`` file (zip format): ``obj`` is what ``torch.load`` would
    return, but every tensor is on the meta device until read with :meth:`read_into`,
    :meth:`read` or viewed with :meth:`view`.

    Legacy (pre-zip) files cannot be read lazily: ``ValueError`` says so.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        # a FIFO planted under the name is refused at once, not waited on
        self._fd = open_regular(self.path)
        self._map: mmap.mmap | None = None
        try:
            self.size = os.fstat(self._fd).st_size
            with open(self._fd, "rb", closefd=False) as f:
                if f.read(4) != b"PK\x03\x04":
                    raise ValueError(
                        f"{self.path}: not a zip-format torch.save file (a legacy file, "
                        "from torch < 1.6 or _use_new_zipfile_serialization=False); "
                        "re-save it with a current torch.save"
                    )
                self._records = records(f, self.path, self.size)
                _byteorder(f, self.path)
                f.seek(0)
                self.obj: Any = torch_load(f, self.path, map_location="meta")
            check_views(self.obj, self.path, self.size)
        except OSError as exc:
            os.close(self._fd)
            if exc.filename is not None or exc.errno is None:
                raise
            raise type(exc)(exc.errno, exc.strerror, self.path) from exc  # EIO names no file
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> TorchFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the file (views from :meth:`view` keep the map alive)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._map = None

    def _locate(self, t: torch.Tensor) -> int:
        """The file offset of ``t``'s storage, checked against the zip directory."""
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            raise TypeError(f"{self.path}: expected a tensor of this file, got {type(t)}")
        storage = t.untyped_storage()
        start = getattr(storage, "_checkpoint_offset", None)
        if start is None or start not in self._records:
            raise CorruptCheckpointError(f"{self.path}: a tensor's bytes are not a data record")
        nbytes = self._records[start]
        if storage.nbytes() != nbytes or _span_bytes(t) > nbytes:
            raise CorruptCheckpointError(
                f"{self.path}: a tensor of shape {tuple(t.shape)} needs bytes past its "
                f"record ({nbytes} bytes at offset {start})"
            )
        _check_view(self.path, None, t)  # also checked for every tensor of obj at open
        return start

    def _pread(self, offset: int, out: memoryview) -> None:
        done = 0
        while done < len(out):
            n = os.preadv(self._fd, [out[done:]], offset + done)
            if n == 0:
                raise CorruptCheckpointError(f"{self.path}: file ends at byte {offset + done}")
            done += n

    def read_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """Fill ``out`` (CPU, ``t``'s shape and dtype) with ``t``'s values; a contiguous
        ``t`` and ``out`` take one read straight into ``out``, anything else reads the
        bytes ``t`` spans into a temporary buffer first."""
        start = self._locate(t)
        if tuple(out.shape) != tuple(t.shape) or out.dtype != t.dtype or out.device.type != "cpu":
            raise ValueError(
                f"{self.path}: cannot read a {t.dtype} tensor of shape {tuple(t.shape)} into "
                f"a {out.dtype} {out.device.type} tensor of shape {tuple(out.shape)}"
            )
        if t.numel() == 0:
            return
        item = t.element_size()
        if t.is_contiguous() and out.is_contiguous():
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            self._pread(start + t.storage_offset() * item, view)
            return
        span = _span_bytes(t)
        buf = torch.empty(span, dtype=torch.uint8)
        self._pread(start, memoryview(buf.numpy()))
        src = buf.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
        with torch.no_grad():
            out.copy_(src)

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s values in a new contiguous CPU tensor."""
        out = torch.empty(t.shape, dtype=t.dtype)
        self.read_into(t, out)
        return out

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a view of a read-only shared map of the file: it costs page cache, not
        committed memory, and must not be written to."""
        start = self._locate(t)
        if t.numel() == 0:
            return torch.empty(t.shape, dtype=t.dtype)
        if self._map is None:
            self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():  # read-only bytes: torch warns, nothing writes them
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(
                self._map, dtype=torch.uint8, count=self._records[start], offset=start
            )
        if start % t.element_size():
            raw = raw.clone()  # keep element access aligned
        return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    def materialize(self, value: Any, *, mapped: bool = False) -> Any:
        """``value`` (``obj`` or part of it) with every tensor read (or, ``mapped``,
        viewed); dicts, lists and tuples are rebuilt, anything else is returned as is."""
        if isinstance(value, torch.Tensor):
            return self.view(value) if mapped else self.read(value)
        if isinstance(value, dict):
            return type(value)((k, self.materialize(v, mapped=mapped)) for k, v in value.items())
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self.materialize(v, mapped=mapped) for v in value)
        return value
