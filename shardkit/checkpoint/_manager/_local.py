"""Rank-local checkpoint copies on node-local storage (the local tier and held replicas).

Layout under the tier's directory (shared by the ranks of a machine)::

    local/rank_00003/step_00000010/     rank 3's own copy of step 10
    replica/rank_00002/step_00000010/   the replica of rank 2's shard held on this machine

Each copy is an ordinary shardkit checkpoint of one rank's pieces, saved as a world of
one (keys are the state dict's dotted keys, each tensor its local piece), plus
``tier.json``: the run's name (``StepStore.identity``), the world size, the source rank
and step, and the shard's layout (global shape, dtype and box of every piece) with its
fingerprint. A copy is written into ``step_XXXXXXXX.tmp-<run tag>-<id>`` and renamed
into place once complete, so a torn write is never listed; listing checks the core's commit (metadata, file
sizes, headers) and ``tier.json``, and loading verifies every checksum.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import threading
import uuid
from typing import Any

import torch

from .._core._comm import Comm
from .._core._errors import CheckpointError
from .._core._flatten import Flat
from .._core._format import METADATA_FILE
from .._core._load import _metadata as read_core_metadata
from .._core._load import committed_metadata, load_with_metadata
from .._core._planner import DefaultLoadPlanner, DefaultSavePlanner
from .._core._save import live_data, max_file_bytes, prepare, write_and_commit
from .._core._storage import FileSystemReader, FileSystemWriter, parse_json, read_small_file
from ._tiers import layout_fingerprint

__all__ = ["LocalStore", "shard_layout"]

log = logging.getLogger(__name__)

MANIFEST = "tier.json"
FORMAT = "shardkit-local-tier"
VERSION = 1
_STEP = re.compile(r"^step_(\d{8,})$")
_RANK = re.compile(r"^rank_(\d{5,})$")
_MANIFEST_MAX = 64 << 20


def shard_layout(flat: Flat) -> dict[str, Any]:
    """This rank's layout: per tensor key its global shape, dtype and box; value keys."""
    tensors = {
        k: [
            list(leaf.shape),
            str(leaf.dtype).removeprefix("torch."),
            list(leaf.box.offsets),
            list(leaf.box.sizes),
        ]
        for k, leaf in flat.tensors.items()
    }
    return {"tensors": tensors, "values": sorted(flat.values), "absent": sorted(flat.absent)}


def localized(flat: Flat, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The flat state as a one-level dict: dotted key -> local piece or JSON value."""
    out: dict[str, Any] = {}
    for k, leaf in flat.tensors.items():
        out[k] = leaf.local if tensors is None else tensors[k]
    out.update(flat.values)
    return out


def _size_of(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def spare_files(path: str) -> list[str]:
    """The regular files of a recycled copy, by name (their pages get reused); anything
    else in it is removed now. A file with another hard link is removed too, not reused:
    overwriting it would change the other name's bytes."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    out = []
    for name in names:
        p = os.path.join(path, name)
        try:
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                out.append(p)
            elif stat.S_ISDIR(st.st_mode):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        except OSError:
            continue
    return out


def take_spare(spares: list[str], path: str) -> None:
    """Rename a spare file of a recycled copy to ``path`` (if any is left)."""
    while spares and not os.path.lexists(path):
        try:
            os.rename(spares.pop(0), path)
        except OSError:
            continue


def drop_spares(spares: list[str]) -> None:
    """Delete the spare files no new file took."""
    while spares:
        try:
            os.unlink(spares.pop())
        except OSError:
            pass


class _RecyclingWriter(FileSystemWriter):
    """Writes a copy into a recycled directory: each new file takes over an old file and
    is overwritten in place, so a RAM disk reuses its pages instead of allocating (and
    zeroing) new ones; old files left over are removed before the commit."""

    def __init__(self, path: str, spares: list[str]) -> None:
        super().__init__(path)
        self._in_place = True
        self._spares = spares
        self._lock = threading.Lock()

    def write_file(self, name: str, parts) -> None:
        with self._lock:
            take_spare(self._spares, self.join(name))
        super().write_file(name, parts)

    def commit(self, metadata: bytes) -> None:
        with self._lock:
            drop_spares(self._spares)
        super().commit(metadata)


def make_shared_dirs(path: str, *, attempts: int = 16) -> None:
    """``os.makedirs(path, exist_ok=True)`` where other jobs may remove empty ancestors.

    Every manager with a default directory shares ``/dev/shm/shardkit-<uid>`` and
    removes it on clean exit once empty. A job closing while another starts can remove
    it between ``makedirs`` creating it and creating ``path`` inside it (then
    FileNotFoundError); once ``path`` exists its ancestors are no longer empty, so
    creating again succeeds. Only a run of such removals exhausts ``attempts``.
    """
    for _ in range(attempts - 1):
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            return
        except FileNotFoundError:
            continue
    os.makedirs(path, mode=0o700, exist_ok=True)


class LocalStore:
    """The copies under one tier directory, seen from one rank."""

    def __init__(self, root: str, url: str, rank: int, world_size: int) -> None:
        self.root = root
        self.url = url
        self.rank = rank
        self.world_size = world_size
        self._reported: set = set()  # paths, and reasons said once for many copies
        # Temporaries carry the run's tag: runs sharing a directory sweep only their own.
        self._tmp_tag = f".tmp-{hashlib.sha256(url.encode()).hexdigest()[:8]}-"
        make_shared_dirs(root)

    # -- paths ----------------------------------------------------------------------------
    def kind_dir(self, kind: str, src: int) -> str:
        return os.path.join(self.root, "local" if kind == "local" else "replica", f"rank_{src:05d}")

    def copy_path(self, kind: str, src: int, step: int) -> str:
        return os.path.join(self.kind_dir(kind, src), f"step_{step:08d}")

    def _tmp_name(self, kind: str, src: int, step: int) -> str:
        return f"{self.copy_path(kind, src, step)}{self._tmp_tag}{uuid.uuid4().hex[:12]}"

    def new_tmp(self, kind: str, src: int, step: int) -> str:
        path = self._tmp_name(kind, src, step)
        os.makedirs(path, mode=0o700)
        return path

    def recycle(self, kind: str, src: int, step: int, keep: int) -> tuple[str, list[str]]:
        """A temporary directory for a new copy of ``step``, and spare files to reuse.

        When ``keep`` (>= 2) older copies of this run exist, retention would delete the
        oldest right after this write: it is renamed to the temporary name instead (so it
        is never listed again) and its files become the spares whose pages the new copy
        reuses. The tier then holds ``keep - 1`` complete copies plus the one being
        written, never ``keep + 1``. With ``keep == 1`` nothing is recycled: the one
        copy stays complete until the new one is.
        """
        os.makedirs(self.kind_dir(kind, src), mode=0o700, exist_ok=True)
        if keep >= 2:
            old = [
                s
                for s in self.steps(kind, src)
                if s < step and self._ours(self.copy_path(kind, src, s))
            ]
            if len(old) >= keep:
                tmp = self._tmp_name(kind, src, step)
                try:
                    os.rename(self.copy_path(kind, src, old[0]), tmp)
                except OSError:
                    pass
                else:
                    for name in (METADATA_FILE, MANIFEST):
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(tmp, name))
                    return tmp, spare_files(tmp)
        return self.new_tmp(kind, src, step), []

    def publish(self, tmp: str, kind: str, src: int, step: int) -> str:
        """Move a complete copy into place (replacing an older copy of the same step)."""
        final = self.copy_path(kind, src, step)
        if os.path.lexists(final):
            if not self._ours(final):
                self._remove(tmp)
                raise CheckpointError(
                    f"{final} holds another run's copy of step {step} "
                    f"({self.read_manifest(final).get('path')!r}, not {self.url!r}); "
                    "give each run its own LocalTier(directory=...)"
                )
            self._remove(final)
        os.rename(tmp, final)
        return final

    # -- writing --------------------------------------------------------------------------
    def manifest(self, src: int, step: int, layout: dict, mark: dict | None = None) -> dict:
        """``tier.json``; ``mark`` adds the run directory's id (``run``), the saving
        manager's ``history`` and whether the same call saved the step to the persistent
        tier (``persisted``)."""
        return {
            **(mark or {}),
            "format": FORMAT,
            "version": VERSION,
            "path": self.url,
            "world_size": self.world_size,
            "rank": src,
            "step": step,
            "fp": layout_fingerprint(layout),
            "layout": layout,
        }

    def write_own(
        self, step: int, state: dict[str, Any], layout: dict, *, keep: int = 1, mark=None
    ) -> str:
        """Save this rank's ``state`` (a one-level dict) as its copy of ``step``, reusing
        the oldest copy's files when ``keep`` copies exist (see :meth:`recycle`)."""
        tmp, spares = self.recycle("local", self.rank, step, keep)
        try:
            writer = _RecyclingWriter(tmp, spares) if spares else FileSystemWriter(tmp)
            comm = Comm(None, local=True)
            planner = DefaultSavePlanner()
            job = prepare(state, planner, comm, 1, max_file_bytes(writer))
            metadata = write_and_commit(job, writer, comm, live_data(planner))
            # the save id binds tier.json to this copy's data: another step's copy moved
            # under this step's name is then foreign, not this step
            bound = {**(mark or {}), "save_id": metadata.save_id}
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(self.manifest(self.rank, step, layout, bound), f)
            return self.publish(tmp, "local", self.rank, step)
        except BaseException:
            self._remove(tmp)
            raise

    # -- listing --------------------------------------------------------------------------
    def _note(self, path: str, why: str) -> None:
        if path not in self._reported:
            self._reported.add(path)
            log.warning("local checkpoint tier: ignoring %s: %s", path, why)

    def read_manifest(self, path: str) -> dict | None:
        try:
            raw = read_small_file(os.path.join(path, MANIFEST), _MANIFEST_MAX)
            m = parse_json(raw) if len(raw) <= _MANIFEST_MAX else None
            return m if isinstance(m, dict) else None
        except (OSError, ValueError):  # a FIFO or a symlink planted, deep nesting: torn
            return None

    def check_copy(self, path: str, src: int, step: int) -> dict | None:
        """The manifest of a valid copy at ``path``, or None (logged once) if torn/foreign."""
        m = self.read_manifest(path)
        if m is None:
            self._note(path, f"{MANIFEST} missing or unreadable (a torn or partial copy)")
            return None
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            self._note(path, f"not a {FORMAT} v{VERSION} copy")
            return None
        if m.get("path") != self.url:
            self._note(path, f"a copy of another run ({m.get('path')!r}, not {self.url!r})")
            return None
        if m.get("world_size") != self.world_size:
            # one line for all of them: after a resize every copy on the machine is one
            key = ("world size", str(m.get("world_size")))
            if key not in self._reported:
                self._reported.add(key)
                log.warning(
                    "local checkpoint tier: ignoring the copies under %s saved by a world "
                    "of %s ranks (the first seen: %s); this one has %d; the persistent "
                    "tier restores across world sizes",
                    self.root, m.get("world_size"), path, self.world_size,
                )  # fmt: skip
            return None
        if m.get("rank") != src or m.get("step") != step:
            self._note(path, f"its {MANIFEST} names rank {m.get('rank')} step {m.get('step')}")
            return None
        if not isinstance(m.get("fp"), str) or m["fp"] != layout_fingerprint(m.get("layout")):
            self._note(path, "its layout does not match its fingerprint")
            return None
        try:  # one read of the metadata, for both checks
            saved = committed_metadata(path).save_id
        except CheckpointError:
            self._note(path, "not a committed checkpoint (missing metadata, truncated file)")
            return None
        if m.get("save_id") != saved:
            self._note(path, f"its data is save {saved}, its {MANIFEST} names another")
            return None
        return m

    def _rank_dirs(self, kind: str):
        """``(src, path)`` of each rank directory of ``kind`` (no link, no stray name)."""
        base = os.path.join(self.root, "local" if kind == "local" else "replica")
        try:
            ranks = os.listdir(base)
        except OSError:
            return
        for rname in sorted(ranks):
            rm = _RANK.match(rname)
            rdir = os.path.join(base, rname)
            if rm is None or os.path.islink(rdir) or not os.path.isdir(rdir):
                continue
            yield int(rm.group(1)), rdir

    def _entries(self, kind: str):
        for src, rdir in self._rank_dirs(kind):
            try:
                names = os.listdir(rdir)
            except OSError:
                continue
            for name in names:
                sm = _STEP.match(name)
                path = os.path.join(rdir, name)
                if sm is None or os.path.islink(path) or not os.path.isdir(path):
                    continue
                yield src, int(sm.group(1)), path

    def steps(self, kind: str, src: int) -> list[int]:
        """Steps with a directory (valid or not) for ``src``, ascending."""
        return sorted(s for r, s, _ in self._entries(kind) if r == src)

    def scan(self) -> list[list]:
        """Every valid copy this rank sees: ``[src, step, kind, fingerprint, history,
        persisted, run]`` (see :meth:`manifest`; a copy without them: ``""``, False, None)."""
        out = []
        for kind in ("local", "replica"):
            for src, step, path in self._entries(kind):
                if not 0 <= src < self.world_size:
                    self._note(path, f"rank {src} is outside this world of {self.world_size}")
                    continue
                m = self.check_copy(path, src, step)
                if m is not None:
                    history, run = m.get("history"), m.get("run")
                    out.append([
                        src, step, kind, m["fp"],
                        history if isinstance(history, str) else "",
                        m.get("persisted") is True,
                        run if isinstance(run, str) else None,
                    ])  # fmt: skip
        return out

    # -- loading --------------------------------------------------------------------------
    def load_copy(self, path: str, flat: Flat, fp: str) -> None:
        """Load a copy into the caller's state (in place), verifying every checksum."""
        m = self.read_manifest(path)
        if m is None or m.get("fp") != fp:
            raise CheckpointError(
                f"{path}: the copy's layout differs from this rank's state dict (or its "
                f"{MANIFEST} is unreadable)"
            )
        target = localized(flat)
        reader = FileSystemReader(path)
        load_with_metadata(target, reader, read_core_metadata(reader), planner=DefaultLoadPlanner())
        for key, slot in flat.slots.items():
            if key in target and key in flat.values:
                slot.container[slot.index] = target[key]
        for obj, inner in flat.statefuls:  # inner before outer, as the core's load
            obj.load_state_dict(inner)

    # -- retention and cleanup ---------------------------------------------------------------
    def _remove(self, path: str) -> None:
        try:
            if os.path.islink(path) or os.path.isfile(path):
                os.unlink(path)
            else:
                shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("local checkpoint tier: could not remove %s: %s", path, exc)

    def _ours(self, path: str) -> bool:
        """Whether a copy belongs to this run (or is torn: no readable manifest)."""
        m = self.read_manifest(path)
        return m is None or m.get("path") == self.url

    def retain(self, kind: str, src: int, keep: int) -> None:
        """Keep the ``keep`` newest steps of ``src`` (and no stale temporary copies).

        Copies of another run sharing the directory are left alone.
        """
        d = self.kind_dir(kind, src)
        try:
            names = os.listdir(d)
        except OSError:
            return
        steps = sorted(
            (int(m.group(1)), n)
            for n in names
            if (m := _STEP.match(n)) and self._ours(os.path.join(d, n))
        )
        for _, name in steps[:-keep] if keep else steps:
            self._remove(os.path.join(d, name))
        for name in names:  # only this rank of this run writes these: stale leftovers
            if self._tmp_tag in name:
                self._remove(os.path.join(d, name))

    def remove(self, kind: str, src: int) -> None:
        """Remove this run's copies of ``src`` (and the directory once empty)."""
        d = self.kind_dir(kind, src)
        try:
            names = os.listdir(d)
        except OSError:
            return
        for name in names:
            path = os.path.join(d, name)
            if self._tmp_tag in name or (_STEP.match(name) and self._ours(path)):
                self._remove(path)
        try:
            os.rmdir(d)
        except OSError:
            pass

    def remove_stale(self, *, replicas: bool) -> None:
        """Remove this run's copies that no rank of this world will use: those of ranks
        outside it (left by a larger world), and every replica unless ``replicas`` (this
        world keeps none)."""
        for kind in ("local", "replica"):
            for src, _ in list(self._rank_dirs(kind)):
                if src >= self.world_size or (kind == "replica" and not replicas):
                    self.remove(kind, src)

    def remove_step(self, kind: str, src: int, step: int) -> None:
        self._remove(self.copy_path(kind, src, step))

    def prune_empty(self, *, parent: bool) -> None:
        """Remove empty directories up to the root (ranks of this machine may share it),
        and its parent too with ``parent`` (the default directory's ``shardkit-<uid>``)."""
        for sub in ("local", "replica", ""):
            try:
                os.rmdir(os.path.join(self.root, sub) if sub else self.root)
            except OSError:
                pass
        if parent:
            try:
                os.rmdir(os.path.dirname(self.root))
            except OSError:
                pass

    def bytes_of(self, kind: str, src: int | None) -> int:
        return 0 if src is None else _size_of(self.kind_dir(kind, src))
