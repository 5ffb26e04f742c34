"""Rebuild a full, unwrapped state dict from per-rank FSDP checkpoints.

Each rank saved ``{'model': model.state_dict(), 'shard_metadata':
model.get_shard_metadata(), ...}`` to ``<prefix>_rank-XXXXXXXX-of-XXXXXXXX.pth``. Files
are read one at a time, so at most the full model plus one rank's file is in memory.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable, Iterable

import torch

__all__ = ["consolidate_sharded_model_checkpoints", "find_rank_files", "rank_file_name"]

_RANK_RE = re.compile(r"_rank-(\d+)-of-(\d+)")


def rank_file_name(prefix: str, rank: int, world_size: int, suffix: str = ".pth") -> str:
    """The conventional per-rank file name, ``<prefix>_rank-00000001-of-00000004.pth``."""
    return f"{prefix}_rank-{rank:08d}-of-{world_size:08d}{suffix}"


def find_rank_files(
    ckpt_prefix: str, ckpt_suffix: str = "*.pth", ignore: tuple[str, ...] = ()
) -> list[str]:
    """Every rank's file, in rank order; a missing, duplicate or stray file is an error.

    ``ignore`` lists files to skip (a previous consolidation's output, say).
    """
    pattern = ckpt_prefix + ckpt_suffix
    skip = {os.path.abspath(p) for p in ignore if p}
    paths = sorted(p for p in glob.glob(pattern) if os.path.abspath(p) not in skip)
    if not paths:
        raise FileNotFoundError(f"no checkpoint files match {pattern!r}")
    by_rank: dict[int, str] = {}
    worlds: dict[int, list[str]] = {}
    for path in paths:
        match = _RANK_RE.search(os.path.basename(path))
        if match is None:
            raise ValueError(
                f"checkpoint file {path!r} matches {pattern!r} but has no _rank-R-of-N in its "
                "name; remove it or narrow --ckpt_suffix"
            )
        rank, world = int(match.group(1)), int(match.group(2))
        worlds.setdefault(world, []).append(path)
        if rank in by_rank:
            raise ValueError(f"two files claim rank {rank}: {by_rank[rank]!r} and {path!r}")
        by_rank[rank] = path
    if len(worlds) > 1:
        detail = ", ".join(f"{n} ranks: {sorted(p)}" for n, p in sorted(worlds.items()))
        raise ValueError(f"checkpoint files from different world sizes match {pattern!r}: {detail}")
    world = next(iter(worlds))
    extra = sorted(p for r, p in by_rank.items() if r >= world)
    if extra:
        raise ValueError(f"unexpected checkpoint file(s) {extra}: rank out of range 0..{world - 1}")
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        names = [os.path.basename(rank_file_name(ckpt_prefix, r, world)) for r in missing]
        raise FileNotFoundError(
            f"missing checkpoint file(s) for rank(s) {missing} of {world}: expected {names} "
            f"matching {pattern!r}"
        )
    return [by_rank[r] for r in range(world)]


def _merge_rank(path: str, rank: int, world: int, slots: dict, full: dict) -> dict[str, str]:
    """Copy one rank file's rows into the full tensors; its tensors die on return.

    Returns rank 0's ``state_dict`` key -> unwrapped name map, in order (else empty).
    """
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    try:
        model, meta = ckpt["model"], ckpt["shard_metadata"]
    except (KeyError, TypeError):
        raise ValueError(
            f"{path!r} is not a per-rank FSDP checkpoint: it needs 'model' and "
            "'shard_metadata' entries"
        ) from None
    if meta.get("world_size") != world or meta.get("rank") != rank:
        raise ValueError(
            f"{path!r} holds rank {meta.get('rank')} of {meta.get('world_size')} ranks, but "
            f"its name says rank {rank} of {world}"
        )
    for key, info in meta["params"].items():
        if key not in model:
            raise ValueError(f"{path!r}: shard metadata names {key!r}, missing from 'model'")
        shard = model[key]
        shape = info["shape"]
        expected = tuple(shape) if info["replicated"] else (info["rows"], *shape[1:])
        if tuple(shard.shape) != expected:
            raise ValueError(
                f"{path!r}: {key!r} has shape {tuple(shard.shape)}, but its shard metadata "
                f"says {expected}"
            )
        target = slots.get(info["slot"])
        if target is None:
            target = slots[info["slot"]] = torch.empty(shape, dtype=shard.dtype)
        if info["replicated"]:
            if rank == 0:
                target.copy_(shard)
        elif info["rows"]:
            target.narrow(0, info["start"], info["rows"]).copy_(shard)
        full[info["fqn"]] = target
    if rank != 0:
        return {}
    for key, fqn in meta["buffers"].items():
        full[fqn] = model[key].clone()
    names = {**{k: v["fqn"] for k, v in meta["params"].items()}, **meta["buffers"]}
    return {k: names[k] for k in model if k in names}


def _consolidate(paths: list[str], progress: Callable[[Iterable], Iterable]) -> dict:
    world = len(paths)
    full: dict[str, torch.Tensor] = {}
    slots: dict[int, torch.Tensor] = {}  # one full tensor per unique (maybe tied) parameter
    order: dict[str, str] = {}
    for rank, path in enumerate(progress(paths)):
        order = _merge_rank(path, rank, world, slots, full) or order
    return {fqn: full[fqn] for fqn in order.values()}


def consolidate_sharded_model_checkpoints(
    ckpt_prefix: str,
    ckpt_suffix: str = "*.pth",
    save_path: str = "",
    save_model: bool = True,
    *,
    progress: bool = False,
) -> tuple[dict[str, torch.Tensor], str]:
    """Merge per-rank FSDP checkpoints into the unwrapped model's full state dict.

    Args:
        ckpt_prefix: path prefix shared by the rank files, e.g. ``/ckpt/final``.
        ckpt_suffix: glob completing the prefix, e.g. ``"_rank-*-of-*.pth"``.
        save_path: where to write ``{'model': full_state_dict}``; default
            ``<ckpt_prefix>_consolidated.pth``.
        save_model: write the file (otherwise only return the state dict).
        progress: show a tqdm progress bar over the rank files.

    Returns:
        ``(full_state_dict, save_path)``; keys are the unwrapped model's names, with
        padding removed, ready for ``plain_model.load_state_dict``.
    """
    save_path = save_path or f"{ckpt_prefix}_consolidated.pth"
    paths = find_rank_files(ckpt_prefix, ckpt_suffix, ignore=(save_path,))
    if progress:
        from tqdm import tqdm

        def bar(items):
            return tqdm(items, desc="consolidating", unit="rank")
    else:

        def bar(items):
            return items

    full = _consolidate(paths, bar)
    if save_model:
        directory = os.path.dirname(save_path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        torch.save({"model": full}, save_path)
    return full, save_path
