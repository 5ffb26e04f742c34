"""Where ``convert`` and ``materialize`` write: never a half-written DST, errors naming it.

A local DST is written under a temporary name next to it (``.NAME.partial-XXXX``) and
renamed into place only once complete, so a failure (a full disk, a file-size limit, a
damaged source, Ctrl-C) leaves the old DST, or nothing, and removes the temporary. A
temporary that a kill left (SIGKILL) is removed by the next run writing the same DST. A
local directory that already exists, and every DST on another store (a rename there is a
copy), is written in place; on failure whatever the command added is removed.

Disk-full and file-size errors often come without a file name (a write through
fsspec): they are re-raised naming DST.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Iterator

__all__ = ["staged_output"]

#: Seconds a temporary of DST must be untouched before a later run removes it.
_STALE_SECONDS = 600
#: Errors that only a write can raise: when one carries no file name, it was DST's.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS})


@contextlib.contextmanager
def staged_output(dst: str, *, directory: bool) -> Iterator[str]:
    """Yield the path or URL to write DST's content to; publish it on success.

    ``directory``: DST is a directory (a shardkit checkpoint), not a single file.
    """
    from fsspec.implementations.local import LocalFileSystem

    from ._ckpt import fs_and_path

    fs, root = fs_and_path(dst)
    existed = fs.exists(root)
    if isinstance(fs, LocalFileSystem) and not (directory and existed):
        parent, name = os.path.split(root)
        if directory:  # as a save into a new directory would
            os.makedirs(parent or ".", exist_ok=True)
        _remove_stale_partials(parent, name)
        tmp = os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:12]}")
        try:
            if directory:
                os.mkdir(tmp)
            yield tmp
            os.replace(tmp, root)
        except BaseException as exc:
            _remove_local(tmp)
            _rename_error(exc, tmp, dst)
            raise
        return
    before = set(fs.find(root, withdirs=True)) if existed else set()
    try:
        yield dst
    except BaseException as exc:
        _remove_added(fs, root, before, existed)
        _rename_error(exc, root, dst)
        raise


def _remove_stale_partials(parent: str, name: str) -> None:
    """Remove the temporaries of DST that a killed run left (SIGKILL gives no chance to
    clean up), saying so. Only those untouched for ``_STALE_SECONDS`` go: another run
    writing the same DST right now keeps its temporary fresh."""
    pattern = re.compile(rf"^\.{re.escape(name)}\.partial-[0-9a-f]{{12}}$")
    try:
        names = [n for n in os.listdir(parent or ".") if pattern.match(n)]
    except OSError:
        return
    now = time.time()
    for stale in names:
        path = os.path.join(parent, stale)
        try:
            newest = os.lstat(path).st_mtime
            if os.path.isdir(path) and not os.path.islink(path):
                for entry in os.scandir(path):  # a file still growing inside it
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        except OSError:
            continue
        if now - newest > _STALE_SECONDS:
            _remove_local(path)
            print(f"removed {path}, left by an interrupted run", file=sys.stderr)


def _remove_local(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def _remove_added(fs, root: str, before: set[str], existed: bool) -> None:
    """Remove what appeared under ``root`` since ``before`` (``root`` too unless it
    ``existed``); best effort, file by file (``fs.rm`` would expand ``[`` ``*`` ``?`` in
    the names as a glob on some stores)."""
    with contextlib.suppress(Exception):
        added = set(fs.find(root, withdirs=True)) - before
        if not existed:
            added.add(root)
        for path in sorted(added, key=len, reverse=True):  # children before parents
            with contextlib.suppress(Exception):
                if fs.isdir(path):
                    fs.rmdir(path)
                else:
                    fs.rm_file(path)


def _rename_error(exc: BaseException, written: str, dst: str) -> None:
    """Make an OSError about the temporary name (or about no file at all: a disk-full
    error through fsspec) name DST instead; raises the renamed error from ``exc``."""
    if not isinstance(exc, OSError) or exc.errno is None:
        return
    name = os.fspath(exc.filename) if isinstance(exc.filename, (str, os.PathLike)) else None
    if name is None and exc.errno in _WRITE_ERRNOS:
        name = dst
    elif name is not None and (name == written or name.startswith(written + os.sep)):
        name = dst.rstrip("/") + name[len(written) :]
    else:
        return
    raise type(exc)(exc.errno, exc.strerror or os.strerror(exc.errno), name) from exc
