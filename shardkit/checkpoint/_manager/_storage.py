"""Step directories of a :class:`CheckpointManager` on any fsspec filesystem.

Layout: ``<path>/step_<step, zero-padded to 8 digits>/``, each a checkpoint written by
``shardkit.checkpoint.save`` (committed once its metadata file exists), plus the
manager's own ``manager.json`` (the metrics passed to ``save``), written before the
checkpoint's data so it is present whenever the step is committed, and the writer's
lease ``manager.lease`` (see ``_lease.py``). Anything else under ``<path>`` is ignored
and never deleted.

Listing is read-only. A step directory that is a symlink, or whose checkpoint cannot
be checked, is skipped with a warning (once per step). Local files are written via a
fresh temporary (``O_EXCL | O_NOFOLLOW``) and ``os.replace``, never through a symlink.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .._core._errors import CheckpointError
from .._core._format import METADATA_FILE
from .._core._fs_rules import publish_file, refuse_glob_characters
from .._core._storage import parse_json, read_small_file

__all__ = ["StepStore"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
#: the temporary name of a manager file while it is written (see ``publish``, the lease)
_MANAGER_TMP = re.compile(r"^manager\.(json|lease|run)\.tmp-[0-9a-f]{32}$")
MANAGER_FILE = "manager.json"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_MAX_METRICS_BYTES = 1 << 20

log = logging.getLogger(__name__)


def _without_trailing_slash(url: str) -> str:
    """``url`` without trailing slashes, but never a protocol's: ``memory://`` stays."""
    protocol, sep, path = url.rpartition("://")
    if sep:
        return f"{protocol}{sep}{path.rstrip('/')}"
    return url.rstrip("/") or url


def step_dir_name(step: int) -> str:
    """``step_00000042``; steps of more than 8 digits simply get longer names."""
    return f"step_{step:08d}"


class StepStore:
    """Lists, commits-checks, cleans and deletes step directories under one URL."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None):
        self.url = _without_trailing_slash(url)
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.root = self.root.rstrip("/") or self.root
        self.local = isinstance(self.fs, LocalFileSystem)
        refuse_glob_characters(self.fs, self.url)
        if self.local and "://" not in self.url and "::" not in self.url:
            # every step URL is built from this: relative, a later os.chdir (Hydra,
            # launchers) would send the steps to another directory than the listing's
            self.url = os.path.abspath(self.url)
        # The run's name however its URL was spelled ("ckpt" from some directory,
        # "file:///abs/ckpt", a symlinked parent): the RAM tier keys its copies by it, so
        # two runs never take each other's copies and one run always finds its own.
        self.identity = (
            os.path.realpath(self.root) if self.local else self.fs.unstrip_protocol(self.root)
        )
        self._warned: set[tuple[int, str]] = set()

    def _warn_once(self, step: int, why: str) -> None:
        if (step, why) not in self._warned:
            self._warned.add((step, why))
            log.warning("skipping step %d under %s: %s", step, self.url, why)

    def step_url(self, step: int) -> str:
        """The fsspec URL of a step's checkpoint (the ``checkpoint_id`` given to save/load)."""
        return f"{self.url}/{step_dir_name(step)}"

    def _step_path(self, step: int) -> str:
        return f"{self.root}/{step_dir_name(step)}"

    def list_step_dirs(self) -> list[int]:
        """Every step that has a directory, committed or not, ascending."""
        self.fs.invalidate_cache(self.root)  # other ranks/processes wrote since
        if not self.fs.exists(self.root):
            return []
        steps, foreign = [], []
        for entry in self.fs.ls(self.root, detail=True):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            match = _STEP_DIR.match(name)
            if not match:
                if name.isdigit() and entry.get("type") == "directory":
                    foreign.append(name)
                continue
            step = int(match.group(1))
            if name != step_dir_name(step):  # step_2 beside step_00000002: one step, two dirs
                self._warn_once(step, f"{name} is not how this manager names a step directory")
                continue
            if entry.get("islink") or (self.local and os.path.islink(self._step_path(step))):
                self._warn_once(step, "its directory is a symlink (a checkpoint is a directory)")
            elif entry.get("type") == "directory":
                steps.append(step)
        if foreign:
            self._warn_foreign(sorted(foreign, key=int))
        return sorted(steps)

    def _warn_foreign(self, names: list[str]) -> None:
        """Once per manager: step directories as torch_xla's CheckpointManager names them
        (``<path>/<step>/``, torch DCP format), which this manager does not read."""
        if getattr(self, "_warned_foreign", False):
            return
        self._warned_foreign = True
        first = names[-1]
        log.warning(
            f"{self.url} holds directories named like torch_xla CheckpointManager steps "
            f"({names[:5]}{' ...' if len(names) > 5 else ''}); shardkit's manager lists only "
            f"step_<step> directories in its own format, so it does not see them. Convert each "
            f"one you need (they are torch DCP checkpoints): `shardkit ckpt convert "
            f"{self.url}/{first} {self.url}/{step_dir_name(int(first))} --from torch-dcp --to "
            "shardkit`"
        )

    def has_marker(self, step: int) -> bool:
        """Whether the step's metadata file (written last, as the commit) exists."""
        return self.fs.exists(f"{self._step_path(step)}/{METADATA_FILE}")

    def is_committed(self, step: int) -> bool:
        """The core's check: committed metadata whose files all exist with their sizes."""
        from ._io import why_step_not_committed

        return why_step_not_committed(self, step) is None

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending; incomplete directories are never listed.

        A damaged step (malformed metadata, a missing or cut-short file, a file it may
        not read) is skipped with a warning, so the good steps stay usable. A storage
        error (an I/O error, a timeout, a lost connection) raises ``CheckpointError``:
        a step that is there but could not be read this time is not damaged, and a
        resume point must never be guessed from a partial listing.
        """
        steps = []
        for step in self.list_step_dirs():
            if self.local and not self._marker_is_plain_file(step):
                continue
            why = self._why_not_listed(step)
            if why is not None and self.has_marker(step):
                # committed between the two checks (a writer's commit), or damaged
                why = self._why_not_listed(step)
                if why is not None and self.has_marker(step):
                    self._warn_once(step, f"its checkpoint is damaged: {why}")
            if why is None:
                steps.append(step)
        return steps

    def _why_not_listed(self, step: int) -> str | None:
        from ._io import why_step_not_committed

        try:
            why = why_step_not_committed(self, step)
            if why is None:  # the checkpoint is whole; is it this step's?
                recorded = (self._record(step) or {}).get("step", step)
                if recorded != step:
                    why = (
                        f"its {MANAGER_FILE} says it holds step {recorded!r:.40}: another "
                        "step's directory was copied here"
                    )
            return why
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
            return f"it cannot be read: {exc}"  # gone meanwhile, or for good
        except OSError as exc:
            raise CheckpointError(
                f"reading step {step} under {self.url} failed ({type(exc).__name__}: {exc}); "
                "the steps cannot be listed while the storage fails. Retry when it answers; "
                f"if that step is lost for good, move {step_dir_name(step)} out of the run"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - hostile metadata: the step is unusable
            return f"it cannot be checked: {exc}"

    def abort_stale_uploads(self) -> int:
        """Abort unfinished S3 multipart uploads into step directories; returns how many.

        Only the lease holder calls this, before it writes, so every such upload was
        left by a writer that died mid-save. Other stores have none.
        """
        lister = getattr(self.fs, "list_multipart_uploads", None)
        if lister is None or not hasattr(self.fs, "call_s3"):
            return 0
        bucket, _, prefix = self.root.partition("/")
        mine = f"{prefix}/step_" if prefix else "step_"
        aborted = 0
        for upload in lister(bucket):
            key = upload.get("Key", "")
            rest = key[len(mine) - len("step_") :] if key.startswith(mine) else ""
            name = rest.split("/", 1)[0]
            if _STEP_DIR.match(name) and "UploadId" in upload:
                self.fs.call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["UploadId"]
                )
                aborted += 1
        return aborted

    def remove_stale_temporaries(self, *, older_than: float = 60.0) -> list[str]:
        """Delete the temporary files of manager files (``manager.json``, the lease,
        ``manager.run``) that a killed writer left; returns their names.

        Only the lease holder calls this, before it writes. A temporary lives for the
        milliseconds of one write, so only those older than ``older_than`` seconds go (a
        lease renewal of this writer may be writing one now). Object stores write those
        files in one request and leave none.
        """
        if not self.local:
            return []
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        removed, now = [], time.time()
        for name in names:
            if not _MANAGER_TMP.match(name):
                continue
            path = os.path.join(self.root, name)
            try:
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode) and now - info.st_mtime > older_than:
                    os.remove(path)
                    removed.append(name)
            except OSError:
                continue
        return removed

    def _committed_quietly(self, step: int) -> bool:
        return self._why_not_committed_quietly(step) is None

    def _why_not_committed_quietly(self, step: int) -> str | None:
        """None when ``step`` is committed, else why not; never raises."""
        from ._io import why_step_not_committed

        if self.local and not self._marker_is_plain_file(step):
            return f"its {METADATA_FILE} is not a regular file"
        try:
            return why_step_not_committed(self, step)
        except Exception as exc:
            return str(exc)

    def _marker_is_plain_file(self, step: int) -> bool:
        """False (with a warning) when the metadata file is a FIFO, device, symlink..."""
        try:
            mode = os.lstat(f"{self._step_path(step)}/{METADATA_FILE}").st_mode
        except FileNotFoundError:
            return True  # not committed (yet): listed as incomplete, not as bad
        except OSError as exc:
            self._warn_once(step, f"its {METADATA_FILE} cannot be examined: {exc}")
            return False
        if not stat.S_ISREG(mode):
            self._warn_once(step, f"its {METADATA_FILE} is not a regular file")
            return False
        return True

    def remove_incomplete(
        self, referenced: Mapping[str, set[str]] | None = None, *, below: int | None = None
    ) -> list[int]:
        """Delete step directories that never committed (left by a crash); returns them.

        Only directories without a commit marker go: a committed but damaged step is
        kept for inspection (it is not listed, so it is never restored). Files that
        ``referenced`` (directory name -> file names, from the committed steps' metadata)
        lists are kept: they hold data of incremental steps. ``below`` limits the sweep to
        older steps (a save in flight writes a newer one).
        """
        if referenced is None:
            from ._refs import referenced_files

            referenced = referenced_files(self, self.committed_steps())
        removed = []
        for step in self.list_step_dirs():
            if below is not None and step >= below:
                continue
            if not self.has_marker(step):
                if self._remove_unreferenced(step, referenced.get(step_dir_name(step), set())):
                    removed.append(step)
        return removed

    def prepare_step_dir(self, step: int) -> None:
        """Before saving ``step``: refuse a symlink there, remove an uncommitted leftover.

        Only the lease holder calls this, for a step newer than every committed one.
        """
        path = self._step_path(step)
        if self.local and os.path.islink(path):
            raise CheckpointError(
                f"{path} is a symlink; refusing to save through it (remove it: a step "
                "directory must be a real directory)"
            )
        self.fs.invalidate_cache(self.root)
        if self.fs.exists(path) and not self._committed_quietly(step):
            self._rm_tree(path)

    def remove_failed(self, step: int) -> bool:
        """After a failed save of ``step``: remove its directory unless it committed."""
        path = self._step_path(step)
        if self.local and os.path.islink(path):
            return False
        self.fs.invalidate_cache(self.root)
        if not self.fs.exists(path) or self._committed_quietly(step):
            return False
        self._rm_tree(path)
        return True

    def delete(self, step: int, referenced: Mapping[str, set[str]] | None = None) -> None:
        """Delete a committed step, un-committing it first.

        The metadata file goes first, so a crash half-way leaves an incomplete directory
        (never listed, removed by the next writer) rather than a listed, broken checkpoint.
        Files that ``referenced`` names for this step's directory (data of incremental
        steps still kept) stay, in a directory without metadata, until unreferenced.
        """
        path = self._step_path(step)
        marker = f"{path}/{METADATA_FILE}"
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        self._remove_unreferenced(step, (referenced or {}).get(step_dir_name(step), set()))

    def _remove_unreferenced(self, step: int, keep: set[str]) -> bool:
        """Delete the step directory, or only its files not in ``keep`` if any; returns
        whether the directory itself is gone."""
        path = self._step_path(step)
        if not keep:
            self._rm_tree(path)
            return True
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return True
        stale = [p for p in entries if p.rstrip("/").rsplit("/", 1)[-1] not in keep]
        for p in stale:
            try:
                self.fs.rm(p, recursive=True)
            except FileNotFoundError:
                pass
        self.fs.invalidate_cache(path)
        return False

    def _rm_tree(self, path: str) -> None:
        for attempt in range(2):  # a rank may remove its own files at the same time
            try:
                self.fs.rm(path, recursive=True)
                break
            except FileNotFoundError:
                break
            except OSError:
                if attempt:
                    raise
        self.fs.invalidate_cache(self.root)

    def write_metrics(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """Record the step's metrics (for :class:`BestN`) inside its directory."""
        payload = json.dumps({"step": step, "metrics": dict(metrics or {})}, sort_keys=True)
        path = self._step_path(step)
        if self.local and os.path.islink(path):
            raise CheckpointError(f"{path} is a symlink; refusing to write through it")
        self.publish(f"{path}/{MANAGER_FILE}", payload.encode())

    def publish(self, path: str, data: bytes) -> None:
        """Write a small manager file all at once, creating its directory: readers see
        the old bytes or the new. Locally through a fresh temporary (``O_EXCL |
        O_NOFOLLOW``) and ``os.replace``, which replaces a planted symlink, never
        follows it; elsewhere see :func:`publish_file`."""
        parent = path.rsplit("/", 1)[0]
        if not self.local:
            self.fs.makedirs(parent, exist_ok=True)
            publish_file(self.fs, path, data)
            return
        os.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        try:
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
            raise

    def _record(self, step: int) -> dict[str, Any] | None:
        """The step's ``manager.json``, or None when it has no (readable) one."""
        name = f"{self._step_path(step)}/{MANAGER_FILE}"
        try:
            if self.local:  # never a planted symlink, and a FIFO does not block
                raw = read_small_file(name, _MAX_METRICS_BYTES)[:_MAX_METRICS_BYTES]
            else:
                raw = self.fs.cat_file(name)[:_MAX_METRICS_BYTES]
            record = parse_json(raw)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def read_metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with ``step``, or None when it has no (readable) record."""
        metrics = (self._record(step) or {}).get("metrics")
        return metrics if isinstance(metrics, dict) else None
