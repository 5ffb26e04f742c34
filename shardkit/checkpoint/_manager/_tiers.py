"""In-memory checkpoint tiers: the options (``LocalTier``), the restore report
(``RestoreInfo``) and the pure logic of peers and step agreement.

No I/O and no collectives here: ``_local.py`` keeps the copies on disk, ``_peer.py``
moves bytes between ranks, ``_tiered.py`` ties them to the manager.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LocalTier",
    "RestoreInfo",
    "choose_latest",
    "default_directory",
    "peer_of",
    "plan_sources",
    "source_of",
]

log = logging.getLogger(__name__)

TIERS = ("local", "peer", "persistent")


@dataclass(frozen=True, kw_only=True)
class LocalTier:
    """Options of the in-memory tier of a :class:`CheckpointManager` (see docs).

    Args:
        interval: save a rank-local copy when ``step % interval == 0`` (int >= 1).
        directory: where the copies live; None: node-local RAM,
            ``/dev/shm/shardkit-<uid>/<hash of the manager's path>``.
        max_to_keep: newest steps kept per tier (own copies, and replicas held), >= 1.
        peer: also copy each rank's shard to a peer rank on another machine
            (``(rank + LOCAL_WORLD_SIZE) % world_size``), in the background.
        max_bytes: most bytes one rank may hold in the tier (own copies + replicas);
            None: no bound. A save that could exceed it raises ``ValueError``.
    """

    interval: int = 1
    directory: str | os.PathLike | None = None
    max_to_keep: int = 2
    peer: bool = True
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name, minimum in (("interval", 1), ("max_to_keep", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"LocalTier({name}={value!r}): {name} must be an int >= {minimum}")
            if value < minimum:
                raise ValueError(
                    f"LocalTier({name}={value!r}): {name} must be >= {minimum}; "
                    f"pass e.g. {name}={max(minimum, 2 if name == 'max_to_keep' else 1)}"
                )
        if self.directory is not None:
            if not isinstance(self.directory, (str, os.PathLike)) or not os.fspath(self.directory):
                raise TypeError(
                    f"LocalTier(directory={self.directory!r}): pass a non-empty local path "
                    "(str or os.PathLike), or None for node-local RAM (/dev/shm)"
                )
            if "://" in os.fspath(self.directory):
                raise ValueError(
                    f"LocalTier(directory={self.directory!r}): the local tier needs a local "
                    "path on this machine, not a URL; put URLs in the manager's path"
                )
        if not isinstance(self.peer, bool):
            raise TypeError(f"LocalTier(peer={self.peer!r}): peer must be True or False")
        if self.max_bytes is not None:
            if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int):
                raise TypeError(
                    f"LocalTier(max_bytes={self.max_bytes!r}): pass an int number of bytes "
                    "or None (no bound)"
                )
            if self.max_bytes <= 0:
                raise ValueError(
                    f"LocalTier(max_bytes={self.max_bytes!r}): must be > 0 bytes, or None "
                    "for no bound"
                )


@dataclass(frozen=True)
class RestoreInfo:
    """What the last :meth:`CheckpointManager.restore` read.

    Attributes:
        step: the restored step.
        tier: where this rank's shard came from: ``"local"``, ``"peer"`` or
            ``"persistent"``.
        tiers_by_rank: the tier of every rank of the manager's group, by group rank.
        seconds: wall time of the restore on this rank (agreement, transfers, load).
    """

    step: int
    tier: str
    tiers_by_rank: list[str] = field(default_factory=list)
    seconds: float = 0.0


def default_directory(url: str) -> str:
    """Node-local RAM directory of the manager at ``url``: ``/dev/shm/shardkit-<uid>/<hash>``.

    Falls back to the temporary directory (logged) where ``/dev/shm`` does not exist.
    """
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    base = "/dev/shm"
    if not os.path.isdir(base):
        base = tempfile.gettempdir()
        log.warning("/dev/shm does not exist: the local checkpoint tier uses %s", base)
    return os.path.join(base, f"shardkit-{uid}", digest)


def _shift(world_size: int, local_world_size: int) -> int:
    shift = local_world_size % world_size if local_world_size > 0 else 0
    return shift if shift else 1


def peer_of(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The rank holding ``rank``'s replica: the same local rank on the next machine.

    ``(rank + local_world_size) % world_size``; on a single machine (where that is
    ``rank`` itself) the next rank. None in a world of one.
    """
    if world_size <= 1:
        return None
    return (rank + _shift(world_size, local_world_size)) % world_size


def source_of(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The rank whose replica ``rank`` holds (the inverse of :func:`peer_of`)."""
    if world_size <= 1:
        return None
    return (rank - _shift(world_size, local_world_size)) % world_size


def layout_fingerprint(layout: dict[str, Any]) -> str:
    """A short digest of a shard's layout (keys, global shapes, dtypes, boxes)."""
    raw = json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def _usable(inv: dict, fps: list[str | None] | None):
    """(src, step, holder, kind) of every copy whose layout matches its source rank's."""
    for holder, entry in enumerate(inv):
        for src, step, kind, fp in entry.get("copies", []):
            if not (isinstance(src, int) and 0 <= src < len(inv)):
                continue
            if fps is not None and fps[src] is not None and fp != fps[src]:
                continue
            yield src, step, holder, kind


def persistent_steps(inventories: list[dict]) -> list[int]:
    """The persistent committed steps (listed by the coordinator), ascending."""
    out: set[int] = set()
    for entry in inventories:
        out.update(entry.get("persistent", []))
    return sorted(out)


def choose_latest(inventories: list[dict], *, check_layout: bool = False) -> int | None:
    """The newest step every rank's shard is available at, from any tier.

    ``inventories[r]`` is rank r's report: ``{"copies": [[src, step, kind, fp], ...],
    "persistent": [...], "fp": ...}``. A persistent step has every shard; a RAM step
    needs a copy of each rank's shard on some rank. With ``check_layout``, a copy counts
    only when its layout fingerprint equals its source rank's ``fp``.
    """
    world = len(inventories)
    fps = [e.get("fp") for e in inventories] if check_layout else None
    have: dict[int, set[int]] = {}
    for src, step, _, _ in _usable(inventories, fps):
        have.setdefault(step, set()).add(src)
    steps = {s for s, srcs in have.items() if len(srcs) == world}
    steps.update(persistent_steps(inventories))
    return max(steps) if steps else None


def plan_sources(
    inventories: list[dict], step: int, excluded: set[tuple] = frozenset()
) -> list[tuple[str, int | None, str | None] | None]:
    """Each rank's fastest source of its shard at ``step``: ``(tier, holder, kind)``.

    Order per rank r: its own local copy (tier "local"); a replica or copy of r's shard
    that r sees itself, else one another rank holds (tier "peer", ``holder`` sends it);
    the persistent step (tier "persistent"). ``excluded`` holds ``(r, holder, kind)``
    sources that failed (torn bytes), skipped here. None for a rank with no source.
    """
    world = len(inventories)
    fps = [e.get("fp") for e in inventories]
    copies: dict[int, list[tuple[int, str]]] = {}
    for src, s, holder, kind in _usable(inventories, fps):
        if s == step:
            copies.setdefault(src, []).append((holder, kind))
    persistent = step in persistent_steps(inventories)
    plan: list[tuple[str, int | None, str | None] | None] = []
    for r in range(world):
        options = []
        mine = [(h, k) for h, k in copies.get(r, []) if h == r]
        others = sorted((h, k) for h, k in copies.get(r, []) if h != r)
        for h, k in sorted(mine, key=lambda hk: hk[1] != "local"):
            options.append(("local" if k == "local" else "peer", h, k))
        # prefer a replica (another machine's copy) to a same-node rank's view of r's copy
        for h, k in sorted(others, key=lambda hk: (hk[1] != "replica", hk[0])):
            options.append(("peer", h, k))
        if persistent:
            options.append(("persistent", None, None))
        chosen = next((o for o in options if (r, o[1], o[2]) not in excluded), None)
        plan.append(chosen)
    return plan
