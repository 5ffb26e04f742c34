"""Storage: a checkpoint is a flat directory of files on any fsspec filesystem.

Storage layers move bytes only; the format, checksums and commit protocol live above
them, so a user-written store gets integrity checks for free.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ._errors import CorruptCheckpointError, UsageError
from ._format import METADATA_FILE
from ._fs_rules import publish_file, refuse_glob_characters, write_remote

#: Bytes per write() call: one huge write() stalls far longer in the kernel's dirty-page
#: throttling than the same bytes in 1 MiB calls (measured 2-3x on ext4).
_WRITE_CHUNK = 1 << 20
#: Default cap on the tensor bytes of one data file (Hugging Face shards at 5 GB).
DEFAULT_MAX_FILE_BYTES = 4 << 30


class NotRegularFileError(OSError):
    """:func:`open_regular` refused the entry: a FIFO, device, socket or directory."""


def open_regular(path: str, *, follow_symlinks: bool = True, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the local regular file ``path`` (relative to ``dir_fd``
    when given), opened without blocking: a FIFO, device or directory planted under the
    name raises :class:`NotRegularFileError` (an OSError, EINVAL) at once instead of
    hanging or reading forever. Other failures raise ``os.open``'s OSError; callers turn
    either into their own message."""
    nofollow = 0 if follow_symlinks else os.O_NOFOLLOW
    flags = os.O_RDONLY | nofollow | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFileError(errno.EINVAL, f"{path} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small_file(path: str, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of the local regular file ``path`` (more than ``limit``
    means it is too large). Never through a symlink and never blocking (see
    :func:`open_regular`)."""
    fd = open_regular(path, follow_symlinks=False)
    try:
        return os.read(fd, limit + 1)
    finally:
        os.close(fd)


class JSONNestingError(ValueError):
    """JSON nested deeper than :data:`MAX_PARSE_NESTING`, refused before parsing."""


#: Deepest JSON nesting handed to ``json.loads``, far below Python's recursion limit.
#: ``json.loads`` recurses once per level; near the limit, any finalizer that the garbage
#: collector runs in the middle of parsing (of some other thread's garbage) fails with
#: RecursionError, printed as "Exception ignored", and its cleanup is lost.
MAX_PARSE_NESTING = 256

_QUOTE, _OPENS, _CLOSES = 34, (91, 123), (93, 125)  # " [ { ] }


def json_nesting(raw: bytes | str) -> int:
    """How deep the arrays and objects of JSON text ``raw`` nest (brackets inside strings
    not counted), found without parsing it: a few ms per MB."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if b"\\" in raw:  # drop escapes that could hide a quote: \\ first, then \"
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    text = np.frombuffer(raw, np.uint8)
    marks = text[(text == _QUOTE) | np.isin(text, _OPENS + _CLOSES, kind="table")]
    step = np.where(np.isin(marks, _OPENS), 1, np.where(marks == _QUOTE, 0, -1))
    step[(np.cumsum(marks == _QUOTE) & 1).astype(bool)] = 0  # inside a string
    return int(np.cumsum(step).max(initial=0))


def parse_json(raw: bytes | str, *, max_depth: int = MAX_PARSE_NESTING, **kwargs: Any) -> Any:
    """``json.loads(raw, **kwargs)`` whose every failure is a ValueError; arrays and
    objects nested more than ``max_depth`` deep (at most :data:`MAX_PARSE_NESTING`) are
    refused before parsing (:class:`JSONNestingError`)."""
    limit = min(max_depth, MAX_PARSE_NESTING)
    brackets = (b"[", b"{") if isinstance(raw, bytes) else ("[", "{")
    if sum(map(raw.count, brackets)) > limit and json_nesting(raw) > limit:
        raise JSONNestingError(f"JSON nested deeper than {limit} levels")
    try:
        return json.loads(raw, **kwargs)
    except RecursionError:  # a caller already deep in its stack
        raise JSONNestingError("JSON nested too deeply") from None


def resolve_storage(checkpoint_id: Any, storage: Any, kind: type, what: str) -> Any:
    """The storage a ``save`` (``kind`` StorageWriter) or ``load`` (StorageReader) uses, as
    torch picks it: ``storage`` if given, pointed at ``checkpoint_id`` if that is given too
    (through its ``reset``), else a FileSystemWriter / FileSystemReader of
    ``checkpoint_id``. ``what`` is the argument's name, e.g. "storage_writer"."""
    if storage is None:
        if checkpoint_id is None:
            raise UsageError(f"pass checkpoint_id (a path or fsspec URL) or a {what}")
        return (FileSystemWriter if kind is StorageWriter else FileSystemReader)(checkpoint_id)
    if not isinstance(storage, kind):
        members = (
            "thread_count, write_file, commit, list_files, remove_files"
            if kind is StorageWriter
            else "thread_count, read_metadata, file_size, read_into"
        )
        raise TypeError(f"{what} {storage!r} does not implement {kind.__name__} ({members})")
    if checkpoint_id is not None:
        reset = getattr(storage, "reset", None)
        if not callable(reset):
            raise ValueError(
                f"both checkpoint_id {os.fspath(checkpoint_id)!r} and {what} {storage!r} were "
                f"given, and the {what} has no reset(checkpoint_id) to point it there (as "
                "torch would); pass one of them"
            )
        reset(checkpoint_id)
    return storage


__all__ = ["StorageWriter", "StorageReader", "FileSystemWriter", "FileSystemReader"]


@runtime_checkable
class StorageWriter(Protocol):
    """Where a save writes. ``write_file`` runs on every rank (from ``thread_count`` threads
    at once); ``commit``, ``list_files`` and ``remove_files`` run on the coordinator only."""

    thread_count: int

    def write_file(self, name: str, parts: Iterable[memoryview]) -> None:
        """Create file ``name`` holding ``parts`` back to back; durable when it returns.

        ``parts`` is an iterator: consume it once, in order, to the end (checksums are
        computed as it yields).
        """

    def commit(self, metadata: bytes) -> None:
        """Publish the metadata file atomically: readers see all of it or none of it."""

    def list_files(self) -> list[str]:
        """Names of the files in the checkpoint directory (empty when it does not exist)."""

    def remove_files(self, names: Sequence[str]) -> None:
        """Delete files of superseded or interrupted saves."""


@runtime_checkable
class StorageReader(Protocol):
    """Where a load reads; ``read_into`` is called from ``thread_count`` threads at once."""

    thread_count: int

    def read_metadata(self) -> bytes:
        """The metadata file's bytes; FileNotFoundError when there is none."""

    def file_size(self, name: str) -> int:
        """Size of file ``name`` in bytes; FileNotFoundError when it is missing."""

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``name`` from ``offset``; EOFError if it ends early."""


def _check_threads(thread_count: int) -> int:
    if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
        raise ValueError(f"thread_count must be a positive int, got {thread_count!r}")
    return thread_count


class _FileSystem:
    def __init__(self, path: str | os.PathLike, storage_options: dict | None = None) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise TypeError(f"checkpoint path must be a non-empty str or PathLike, got {path!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict, got {storage_options!r}")
        self.url = os.fspath(path)
        self.storage_options = dict(storage_options or {})
        self.fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.local = isinstance(self.fs, LocalFileSystem)
        refuse_glob_characters(self.fs, self.url)
        self.root = os.path.abspath(root) if self.local else root.rstrip("/")
        self._links: dict[str, str] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point this storage at checkpoint directory ``checkpoint_id``, keeping its options
        (torch's ``reset``: ``save`` and ``load`` call it when given both a storage object
        and a ``checkpoint_id``). None keeps the current directory."""
        if checkpoint_id is not None:
            _FileSystem.__init__(self, checkpoint_id, self.storage_options)

    @property
    def parent(self) -> str:
        """The directory holding this checkpoint directory (where its siblings live)."""
        return os.path.dirname(self.root) if self.local else self.root.rsplit("/", 1)[0]

    @property
    def dir_name(self) -> str:
        """This checkpoint directory's own name inside :attr:`parent`."""
        return os.path.basename(self.root) if self.local else self.root.rsplit("/", 1)[-1]

    def set_links(self, links: dict[str, str]) -> None:
        """Linked file name -> sibling directory name (plain names, checked by the metadata
        validation); ``join`` then finds those files in ``<parent>/<dir>/``."""
        from ._validate import check_name

        for name, folder in links.items():
            check_name(name, f"{self.url}: linked file")
            check_name(folder, f"{self.url}: linked directory")
        self._links = dict(links)

    def join(self, name: str) -> str:
        """The path of entry ``name``, which must be a plain file name (no ``/``, ``..``,
        absolute path or URL): a checkpoint is exactly its directory, plus the files of
        sibling directories its metadata links (by plain names, see ``set_links``)."""
        from ._validate import check_name

        check_name(name, f"{self.url}: file")
        folder = self._links.get(name)
        if folder is not None:
            if self.local:
                return os.path.join(self.parent, folder, name)
            return f"{self.parent}/{folder}/{name}"
        return os.path.join(self.root, name) if self.local else f"{self.root}/{name}"

    def _open_nofollow(self, name: str) -> int:
        """:func:`open_regular` of ``join(name)`` following no symlink in the last
        component, nor in the sibling directory's name of a linked file."""
        folder = self._links.get(name)
        if folder is None:
            return open_regular(self.join(name), follow_symlinks=False)
        dflags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            dfd = os.open(os.path.join(self.parent, folder), dflags)
        except FileNotFoundError:
            raise
        except OSError:
            raise CorruptCheckpointError(
                f"{self.url}: linked directory {folder} is not a plain directory beside the "
                "checkpoint (a symbolic link or another kind of entry); refused"
            ) from None
        try:
            return open_regular(name, follow_symlinks=False, dir_fd=dfd)
        finally:
            os.close(dfd)

    def open_local(self, name: str) -> int:
        """A read-only descriptor of local entry ``name``: never through a symlink, never
        blocking (a FIFO opens at once), and only for a regular file."""
        path = self.join(name)
        try:
            return self._open_nofollow(name)
        except NotRegularFileError:
            raise CorruptCheckpointError(
                f"{self.url}: {name} is not a regular file (a FIFO, device, socket or "
                "directory); refused"
            ) from None
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                raise FileNotFoundError(f"{self.url}: {name} does not exist") from None
            if os.path.islink(path):
                raise CorruptCheckpointError(
                    f"{self.url}: {name} is a symbolic link; checkpoint files must be regular "
                    "files inside the directory"
                ) from None
            raise

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class FileSystemWriter(_FileSystem):
    """Writes a checkpoint directory through fsspec (local paths, ``memory://``, ``s3://``...).

    Args:
        path: the checkpoint directory or URL.
        thread_count: files each rank writes in parallel.
        sync_files: fsync every file and the directory before the commit (local paths).
        storage_options: fsspec options for ``path`` (credentials, an S3 ``endpoint_url``...).
        max_file_bytes: most tensor bytes per data file (plus its small header); a rank's
            share then spans several files, a larger tensor is cut into row pieces. None:
            no cap.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        thread_count: int = 1,
        sync_files: bool = True,
        storage_options: dict | None = None,
        max_file_bytes: int | None = DEFAULT_MAX_FILE_BYTES,
    ) -> None:
        super().__init__(path, storage_options)
        self.thread_count = _check_threads(thread_count)
        if max_file_bytes is not None and (
            isinstance(max_file_bytes, bool)
            or not isinstance(max_file_bytes, int)
            or max_file_bytes < 1
        ):
            raise ValueError(
                f"max_file_bytes must be a positive int or None, got {max_file_bytes!r}"
            )
        self.max_file_bytes = max_file_bytes
        self.sync_files = bool(sync_files)
        self._made = False
        self._in_place = False  # overwrite existing files instead of truncating them

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            super().reset(checkpoint_id)
            self._made = False
            self._in_place = False

    reset.__doc__ = _FileSystem.reset.__doc__

    def _makedirs(self) -> None:
        if not self._made:
            if self.local:
                if os.path.isfile(self.root):  # else a bare FileExistsError [Errno 17]
                    raise ValueError(
                        f"checkpoint_id {self.root!r} is a file; a checkpoint is a directory: "
                        "pass a new or existing directory path"
                    )
                os.makedirs(self.root, exist_ok=True)
            else:
                self.fs.makedirs(self.root, exist_ok=True)
            self._made = True

    def write_file(self, name: str, parts: Iterable[memoryview]) -> None:
        self._makedirs()
        if not self.local:
            write_remote(self.fs, self.join(name), parts)
            return
        _write_local(
            self.join(name), parts, exclusive=False, sync=self.sync_files, in_place=self._in_place
        )

    def commit(self, metadata: bytes) -> None:
        self._makedirs()
        final = self.join(METADATA_FILE)
        if not self.local:
            publish_file(self.fs, final, metadata)
            return
        tmp = self.join(f"{METADATA_FILE}.tmp-{uuid.uuid4().hex}")
        try:
            _write_local(tmp, [metadata], exclusive=True, sync=self.sync_files)
        except BaseException:
            _remove_quietly(tmp)  # e.g. ENOSPC: leave no partial temporary behind
            raise
        if self.sync_files:  # the data files' directory entries are durable before the commit
            _fsync_dir(self.root)
        os.replace(tmp, final)
        if self.sync_files:
            _fsync_dir(self.root)

    def list_files(self) -> list[str]:
        if self.local:
            return sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []
        try:
            return sorted(
                p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)
            )
        except FileNotFoundError:
            return []

    def has_file(self, name: str) -> bool:
        """Whether file ``name`` exists, asked by name: a listing (:meth:`list_files`) may
        be stale where a lookup is not (an NFS client caches directory contents for up to
        a minute; a lookup by name asks the server)."""
        path = self.join(name)
        return os.path.exists(path) if self.local else bool(self.fs.exists(path))

    def directory_exists(self) -> bool:
        """Whether the checkpoint directory exists yet (a failed save into a directory it
        created removes that directory again, see ``remove_empty_directory``)."""
        return os.path.isdir(self.root) if self.local else self.fs.isdir(self.root)

    def holds_metadata(self, metadata: bytes) -> bool:
        """Whether ``metadata`` is the committed metadata file (after a failed commit: an
        object store may have stored it anyway). Raises when that cannot be told."""
        final = self.join(METADATA_FILE)
        try:
            if self.local:
                if os.path.getsize(final) != len(metadata):
                    return False
                with open(final, "rb") as f:
                    return f.read() == metadata
            return self.fs.size(final) == len(metadata) and self.fs.cat_file(final) == metadata
        except FileNotFoundError:
            return False

    def remove_empty_directory(self) -> None:
        """Remove the checkpoint directory if it is empty, else leave it: a failed save's
        ranks each try once they removed their own files, so the last one succeeds."""
        try:
            if self.local:
                os.rmdir(self.root)
            else:
                self.fs.rmdir(self.root)
        except Exception:  # not empty yet, already gone, or the store has no directories
            pass

    def remove_files(self, names: Sequence[str]) -> None:
        for name in names:
            try:
                if "/" in name or name in ("", ".", ".."):
                    continue  # list_files never returns such names; never delete outside
                path = os.path.join(self.root, name) if self.local else f"{self.root}/{name}"
                if self.local:
                    if os.path.lexists(path):  # a read-only disk answers EROFS even then
                        os.remove(path)
                else:
                    self.fs.rm_file(path)
            except FileNotFoundError:
                pass


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _write_local(
    path: str, parts: Iterable, *, exclusive: bool, sync: bool, in_place: bool = False
) -> None:
    """Write ``parts`` to a local file in bounded ``write()`` calls, fsynced if ``sync``.

    ``exclusive`` refuses an existing file (a fresh temporary); otherwise it is truncated,
    or with ``in_place`` overwritten and cut to the bytes written (a RAM disk then reuses
    the file's pages instead of allocating new ones). Never follows a symlink planted
    at ``path``.
    """
    trunc = 0 if in_place else os.O_TRUNC
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_EXCL if exclusive else trunc)
    fd = os.open(path, flags, 0o644)
    try:
        written = 0
        for part in parts:
            view = _as_bytes(part)
            for start in range(0, len(view), _WRITE_CHUNK):
                piece = view[start : start + _WRITE_CHUNK]
                while piece:
                    n = os.write(fd, piece)
                    written += n
                    piece = piece[n:]
        if in_place:
            os.ftruncate(fd, written)
        if sync:
            os.fsync(fd)
    except OSError as exc:
        if exc.filename is not None:
            raise
        # write() and fsync() errors (ENOSPC, EIO, EDQUOT) name no file: name it
        raise type(exc)(exc.errno, exc.strerror, path) from exc
    finally:
        os.close(fd)


def _as_bytes(buf) -> memoryview:
    if isinstance(buf, memoryview) and buf.ndim == 1 and buf.format == "B":
        return buf  # re-wrapping asks the exporter again, which is slow per row
    return memoryview(buf).cast("B")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileSystemReader(_FileSystem):
    """Reads a checkpoint directory through fsspec; remote stores get byte-range requests.

    Args:
        path: the checkpoint directory or URL.
        thread_count: chunks each rank reads in parallel.
        storage_options: fsspec options for ``path`` (credentials, an S3 ``endpoint_url``...).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        thread_count: int = 1,
        storage_options: dict | None = None,
    ) -> None:
        super().__init__(path, storage_options)
        self.thread_count = _check_threads(thread_count)

    def read_metadata(self) -> bytes:
        """The metadata file's bytes, at most one past the allowed size (checked later)."""
        from ._validate import MAX_METADATA_BYTES

        limit = MAX_METADATA_BYTES + 1  # one byte more than allowed: the parser refuses it
        if self.local:
            with os.fdopen(self.open_local(METADATA_FILE), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > MAX_METADATA_BYTES:  # refused unread: memory stays bounded
                    raise CorruptCheckpointError(
                        f"{self.url}/{METADATA_FILE}: {size} bytes, more than the "
                        f"{MAX_METADATA_BYTES} a metadata file may have "
                        "(SHARDKIT_MAX_METADATA_BYTES raises the limit)"
                    )
                return f.read(limit)
        path = self.join(METADATA_FILE)
        if int(self.fs.size(path)) >= limit:
            return self.fs.cat_file(path, start=0, end=limit)
        return self.fs.cat_file(path)

    def file_size(self, name: str) -> int:
        """Size of data file ``name``; a symlink or non-regular file is refused."""
        if self.local and name in self._links:
            fd = self.open_local(name)  # no symlinked sibling, regular file only
            try:
                return os.fstat(fd).st_size
            finally:
                os.close(fd)
        if self.local:
            path = self.join(name)
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                raise CorruptCheckpointError(
                    f"{self.url}: {name} is {kind}; checkpoint files must be regular files "
                    "inside the directory"
                )
            return st.st_size
        return int(self.fs.size(self.join(name)))

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``name`` from ``offset``; EOFError if it ends early."""
        out = memoryview(out).cast("B")
        if offset < 0:  # fsspec would read from the end
            raise EOFError(f"{name}: negative offset {offset}")
        if not self.local:
            data = self.fs.cat_file(self.join(name), start=offset, end=offset + len(out))
            if len(data) != len(out):
                raise EOFError(f"{name}: {len(data)} of {len(out)} bytes at offset {offset}")
            out[:] = data
            return
        fd = self.open_local(name)
        try:
            pos, done = offset, 0
            while done < len(out):
                n = os.preadv(fd, [out[done:]], pos)
                if n == 0:
                    raise EOFError(f"{name}: file ends at byte {pos}, {len(out) - done} short")
                done += n
                pos += n
        finally:
            os.close(fd)
