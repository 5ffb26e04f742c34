"""``torch.save`` of a whole state dict to a path or URL, with a full disk's real error.

torch's zip writer swallows any exception of the file's ``write`` (and the short write
of a full disk) and raises ``RuntimeError: [enforce fail at inline_container.cc] ...
unexpected pos N vs M`` instead. Writing through :class:`_Recorder` keeps the first
error, so the caller sees ``OSError(ENOSPC, ..., path)``. A local file is written under
a temporary name and renamed into place, so a failure never leaves half a file.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

__all__ = ["write_torch_file"]


class _Recorder:
    """A file-like object for ``torch.save``: writes every byte or raises, and keeps the
    first error of a write."""

    def __init__(self, write) -> None:
        self._write = write
        self.error: BaseException | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            done = 0
            while done < len(view):
                n = self._write(view[done:])
                done += len(view) - done if n is None else n
        except BaseException as exc:
            self.error = self.error or exc
            raise
        return done

    def flush(self) -> None:
        pass


def write_torch_file(obj: Any, target: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``target`` (a local path or fsspec URL); a failed write
    raises its real cause naming ``target``, and leaves no partial local file."""
    target = os.fspath(target)
    fs, path = fsspec.core.url_to_fs(target)
    if not isinstance(fs, LocalFileSystem):
        with fs.open(path, "wb") as f:
            _save(obj, _Recorder(f.write), target)
        return
    parent, name = os.path.split(path)
    tmp = os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0))
        try:
            _save(obj, _Recorder(lambda view: os.write(fd, view)), target)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def _save(obj: Any, out: _Recorder, target: str) -> None:
    try:
        torch.save(obj, out)
    except Exception as exc:
        error = out.error
        if error is None:
            raise
        if isinstance(error, OSError) and error.errno is not None and not error.filename:
            raise type(error)(error.errno, error.strerror, target) from exc
        raise error from exc
