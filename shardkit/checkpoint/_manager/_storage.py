"""Step directories of a :class:`CheckpointManager` on any fsspec filesystem.

Layout: ``<path>/step_<step, zero-padded to 8 digits>/``, each a checkpoint written by
``shardkit.checkpoint.save`` (committed once its metadata file exists), plus the
manager's own ``manager.json`` (the metrics passed to ``save``), written before the
checkpoint's data so it is present whenever the step is committed. Anything else
under ``<path>`` is ignored and never deleted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import fsspec

from .._core._format import METADATA_FILE

__all__ = ["StepStore"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
MANAGER_FILE = "manager.json"


def step_dir_name(step: int) -> str:
    """``step_00000042``; steps of more than 8 digits simply get longer names."""
    return f"step_{step:08d}"


class StepStore:
    """Lists, commits-checks, cleans and deletes step directories under one URL."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None):
        self.url = url.rstrip("/") or url
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.root = self.root.rstrip("/") or self.root

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
        steps = []
        for entry in self.fs.ls(self.root, detail=True):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            match = _STEP_DIR.match(name)
            if match and entry.get("type") == "directory":
                steps.append(int(match.group(1)))
        return sorted(steps)

    def has_marker(self, step: int) -> bool:
        """Whether the step's metadata file (written last, as the commit) exists."""
        return self.fs.exists(f"{self._step_path(step)}/{METADATA_FILE}")

    def is_committed(self, step: int) -> bool:
        """The core's check: committed metadata whose files all exist with their sizes."""
        from ._io import is_committed_step

        return is_committed_step(self, step)

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending; incomplete directories are never listed."""
        return [s for s in self.list_step_dirs() if self.is_committed(s)]

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

    def delete(self, step: int, referenced: Mapping[str, set[str]] | None = None) -> None:
        """Delete a committed step, un-committing it first.

        The metadata file goes first, so a crash half-way leaves an incomplete directory
        (never listed, removed at the next start) rather than a listed, broken checkpoint.
        Files that ``referenced`` names for this step's directory (data of incremental
        steps still kept) stay, in a directory without metadata, until unreferenced.
        """
        path = self._step_path(step)
        marker = f"{path}/{METADATA_FILE}"
        if self.fs.exists(marker):
            self.fs.rm(marker)
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
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.root)

    def write_metrics(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """Record the step's metrics (for :class:`BestN`) inside its directory."""
        payload = json.dumps({"step": step, "metrics": dict(metrics or {})}, sort_keys=True)
        path = self._step_path(step)
        self.fs.makedirs(path, exist_ok=True)
        with self.fs.open(f"{path}/{MANAGER_FILE}", "w") as f:
            f.write(payload)

    def read_metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with ``step``, or None when it has no (readable) record."""
        try:
            with self.fs.open(f"{self._step_path(step)}/{MANAGER_FILE}", "r") as f:
                record = json.load(f)
        except (FileNotFoundError, ValueError):
            return None
        metrics = record.get("metrics") if isinstance(record, dict) else None
        return metrics if isinstance(metrics, dict) else None
