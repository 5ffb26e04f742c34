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
    "peer_map",
    "plan_sources",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class LocalTier:
    """Options of the in-memory tier of a :class:`CheckpointManager` (see docs).

    Args:
        interval: save a rank-local copy when ``step % interval == 0`` (int >= 1).
        directory: where the copies live; None: node-local RAM,
            ``/dev/shm/shardkit-<uid>/<hash of the manager's path>``.
        max_to_keep: newest steps kept per tier (own copies, and replicas held), >= 1.
        peer: also copy each rank's shard to a peer rank on another machine (the same
            local rank on the next machine; see :func:`peer_map`), in the background.
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


def peer_map(nodes: list) -> list[int] | None:
    """The rank holding each rank's replica, from every rank's machine (``nodes[r]``,
    any JSON value that sorts; ranks with equal values share a machine).

    Built from the same gathered list on every rank, so all ranks agree on it, whatever
    each rank's ``LOCAL_WORLD_SIZE`` says. Machines of equal size: the rank with the same
    position on the next machine (for torchrun's ranks ``(rank + LOCAL_WORLD_SIZE) %
    world_size``). Machines of different sizes: ranks ordered by (position on their
    machine, machine), each sending to the next, so a replica leaves its machine
    wherever another machine has a rank at that position. One machine: the next rank.
    Always a permutation without fixed points; None in a world of one.
    """
    world = len(nodes)
    if world <= 1:
        return None
    keys = sorted({json.dumps(n, sort_keys=True) for n in nodes}, key=lambda k: json.loads(k))
    index = {k: i for i, k in enumerate(keys)}
    machine = [index[json.dumps(n, sort_keys=True)] for n in nodes]
    members: list[list[int]] = [[] for _ in keys]
    for r in range(world):
        members[machine[r]].append(r)
    position = {r: i for ranks in members for i, r in enumerate(ranks)}
    if len(members) == 1:
        return [(r + 1) % world for r in range(world)]
    if len({len(ranks) for ranks in members}) == 1:
        return [members[(machine[r] + 1) % len(members)][position[r]] for r in range(world)]
    order = sorted(range(world), key=lambda r: (position[r], machine[r]))
    peers = [0] * world
    for i, r in enumerate(order):
        peers[r] = order[(i + 1) % world]
    return peers


def layout_fingerprint(layout: dict[str, Any]) -> str:
    """A short digest of a shard's layout (keys, global shapes, dtypes, boxes)."""
    raw = json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def _usable(inv: dict, fps: list[str | None] | None):
    """``(src, step, holder, kind, history, persisted)`` of every copy whose layout
    matches its source rank's. A copy's ``history`` names the manager that saved it
    (copies saved by one ``save`` call share it); ``persisted`` says that the same call
    also saved the step to the persistent tier, so the two may be combined. Entries
    without them (4 fields) are one history, combinable with the persistent step."""
    for holder, entry in enumerate(inv):
        for copy in entry.get("copies", []):
            src, step, kind, fp = copy[:4]
            if not (isinstance(src, int) and 0 <= src < len(inv)):
                continue
            if fps is not None and fps[src] is not None and fp != fps[src]:
                continue
            history = str(copy[4]) if len(copy) > 4 else ""
            persisted = bool(copy[5]) if len(copy) > 5 else True
            yield src, step, holder, kind, history, persisted


def _histories(inventories: list[dict], fps, step: int | None = None) -> dict:
    """step -> history -> ``{"srcs": {src: [(holder, kind)]}, "persisted": bool}``."""
    out: dict[int, dict[str, dict]] = {}
    for src, s, holder, kind, history, persisted in _usable(inventories, fps):
        if step is not None and s != step:
            continue
        h = out.setdefault(s, {}).setdefault(history, {"srcs": {}, "persisted": True})
        h["srcs"].setdefault(src, []).append((holder, kind))
        h["persisted"] = h["persisted"] and persisted
    return out


def persistent_steps(inventories: list[dict]) -> list[int]:
    """The persistent committed steps (listed by the coordinator), ascending."""
    out: set[int] = set()
    for entry in inventories:
        out.update(entry.get("persistent", []))
    return sorted(out)


def choose_latest(inventories: list[dict], *, check_layout: bool = False) -> int | None:
    """The newest step every rank's shard is available at, from any tier.

    ``inventories[r]`` is rank r's report: ``{"copies": [[src, step, kind, fp, history,
    persisted], ...], "persistent": [...], "fp": ...}``. A persistent step has every
    shard; a RAM step needs a copy of each rank's shard on some rank, all of one history
    (never two trainings' copies of one step together). With ``check_layout``, a copy
    counts only when its layout fingerprint equals its source rank's ``fp``.
    """
    world = len(inventories)
    fps = [e.get("fp") for e in inventories] if check_layout else None
    steps = {
        s
        for s, histories in _histories(inventories, fps).items()
        if any(len(h["srcs"]) == world for h in histories.values())
    }
    steps.update(persistent_steps(inventories))
    return max(steps) if steps else None


def _rank_options(srcs: dict, r: int, persistent: bool) -> list[tuple[str, int | None, str | None]]:
    """Rank r's sources in order: own copy, a replica, another rank's view, persistent."""
    options: list[tuple[str, int | None, str | None]] = []
    mine = [(h, k) for h, k in srcs.get(r, []) if h == r]
    others = sorted((h, k) for h, k in srcs.get(r, []) if h != r)
    for h, k in sorted(mine, key=lambda hk: hk[1] != "local"):
        options.append(("local" if k == "local" else "peer", h, k))
    # prefer a replica (another machine's copy) to a same-node rank's view of r's copy
    for h, k in sorted(others, key=lambda hk: (hk[1] != "replica", hk[0])):
        options.append(("peer", h, k))
    if persistent:
        options.append(("persistent", None, None))
    return options


def plan_sources(
    inventories: list[dict], step: int, excluded: set[tuple] = frozenset()
) -> list[tuple[str, int | None, str | None] | None]:
    """Each rank's fastest source of its shard at ``step``: ``(tier, holder, kind)``.

    Order per rank r: its own local copy (tier "local"); a replica or copy of r's shard
    that r sees itself, else one another rank holds (tier "peer", ``holder`` sends it);
    the persistent step (tier "persistent"). ``excluded`` holds ``(r, holder, kind)``
    sources that failed (torn bytes), skipped here. None for a rank with no source.

    The copies used are all of one history, and are combined with the persistent step
    only when the call that saved them saved that step too: after a rollback (or a
    restart into the same directory) the RAM copies of a step and its persistent
    checkpoint can hold two trainings. Preferred: a history that covers every rank from
    RAM, then one the persistent step completes, then the persistent step alone.
    """
    world = len(inventories)
    fps = [e.get("fp") for e in inventories]
    persistent = step in persistent_steps(inventories)
    candidates = []
    for _, h in sorted(_histories(inventories, fps, step).get(step, {}).items()):
        srcs = {
            src: [(hd, k) for hd, k in where if (src, hd, k) not in excluded]
            for src, where in h["srcs"].items()
        }
        srcs = {src: where for src, where in srcs.items() if where}
        with_persistent = persistent and h["persisted"]
        plan = [next(iter(_rank_options(srcs, r, with_persistent)), None) for r in range(world)]
        from_ram = sum(1 for p in plan if p is not None and p[0] != "persistent")
        complete = all(p is not None for p in plan)
        candidates.append((not complete, not (complete and from_ram == world), -from_ram, plan))
    if persistent:
        candidates.append((False, True, 0, [("persistent", None, None)] * world))
    if not candidates:
        return [None] * world
    return min(candidates, key=lambda c: c[:3])[3]
