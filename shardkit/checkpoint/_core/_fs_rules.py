"""What every non-local store must respect: per-process stores, glob characters in
paths, and files that must never be seen half-written (the commit, manager files)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import fsspec
from fsspec.implementations.cached import CachingFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ._errors import UsageError

__all__ = ["publish_file", "refuse_glob_characters", "refuse_per_process", "write_remote"]


def _layers(fs: Any) -> Iterable[Any]:
    """``fs`` and the file systems it wraps (``simplecache::``, ``dir::``...)."""
    seen = set()
    while fs is not None and id(fs) not in seen:
        seen.add(id(fs))
        yield fs
        inner = getattr(fs, "fs", None)
        fs = inner if isinstance(inner, fsspec.AbstractFileSystem) else None


def refuse_per_process(fs: Any, url: str, world_size: int) -> None:
    """UsageError when ``world_size`` processes would each write to their own copy of a
    per-process file system (fsspec's ``memory://``, also behind a wrapper such as
    ``simplecache::memory://``): every rank's files would stay in its own process, so the
    checkpoint would be committed but unreadable."""
    if world_size > 1 and any(isinstance(layer, MemoryFileSystem) for layer in _layers(fs)):
        raise UsageError(
            f"{url}: memory:// is a per-process file system, so {world_size} ranks cannot "
            "share a checkpoint there; use a local path, a shared disk or an object store "
            "(s3://, gs://), or keep memory:// for single-process runs"
        )


_GLOB_CHARACTERS = ("*", "?", "[")


def refuse_glob_characters(fs: Any, url: str) -> None:
    """UsageError for ``* ? [`` in a path on a non-local file system.

    fsspec expands them as a glob in ``rm``, ``cat``, ``copy`` and ``mv``: removing the
    files of ``s3://b/exp[1]`` would remove those of ``s3://b/exp1``, another run's.
    Local paths (plain or ``file://``) never glob, so they may hold any character.
    """
    if isinstance(fs, LocalFileSystem):
        return
    found = sorted({c for c in _GLOB_CHARACTERS if c in url})
    if found:
        raise UsageError(
            f"{url}: {' '.join(found)} in a path on {type(fs).__name__} would be read as a "
            "glob pattern by fsspec, so cleaning up this checkpoint could delete another "
            "one's files; use a name without * ? [ ]"
        )


#: fsspec protocols whose single PUT publishes an object all at once (never torn)
_ATOMIC_PUT = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl"})


def publish_file(fs: Any, path: str, data: bytes) -> None:
    """Make non-local ``path`` hold ``data`` all at once: readers see the old bytes or the
    new, never a torn file, and a failed write leaves the old file as it was.

    One PUT does that on object stores. Elsewhere (sftp, webdav, a cache wrapper over a
    disk) ``pipe_file`` truncates the live file and rewrites it, so the bytes go to a
    temporary name first and are moved into place, as torch's FsspecWriter does.
    """
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if _ATOMIC_PUT.intersection(protocols):
        fs.pipe_file(path, data)
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        write_remote(fs, tmp, [memoryview(data)])
        fs.mv(tmp, path)
        for layer in _layers(fs):  # a cache wrapper would go on serving the old bytes
            if isinstance(layer, CachingFileSystem):
                try:
                    layer.clear_cache()  # the public way to drop a cached copy
                except Exception:  # a read-only cache: nothing of ours in it
                    pass
    except BaseException:
        try:
            if fs.exists(tmp):
                fs.rm_file(tmp)
        except Exception:  # the write's own error is the one to report
            pass
        raise


def write_remote(fs, path: str, parts: Iterable) -> None:
    """Write one object; on any error the upload is discarded, never completed.

    Closing an fsspec file completes it, so a failed write would publish a truncated
    object (or leave a multipart upload open): an S3 file is discarded instead, which
    aborts its multipart upload.
    """
    try:
        f = fs.open(path, "wb")
        try:
            for part in parts:
                f.write(part)
        except BaseException:
            try:
                f.discard()
                f.closed = True  # so that garbage collection does not complete it after all
            except Exception:  # the write's own error is the one to report
                pass
            raise
        f.close()
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        # ENOSPC, EFBIG through fsspec name no file: name it
        raise type(exc)(exc.errno, exc.strerror, fs.unstrip_protocol(path)) from exc
