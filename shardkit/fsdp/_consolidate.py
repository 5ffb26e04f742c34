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

__all__ = [
    "consolidate_sharded_model_checkpoints",
    "consolidate_sharded_state_dicts",
    "find_rank_files",
    "rank_file_name",
]

_RANK_RE = re.compile(r"rank-(\d+)-of-(\d+)")


def rank_file_name(prefix: str, rank: int, world_size: int, suffix: str = ".pth") -> str:
    """The conventional per-rank file name, ``<prefix>_rank-00000001-of-00000004.pth``."""
    return f"{prefix}_rank-{rank:08d}-of-{world_size:08d}{suffix}"


def _open(path: str):
    from ..checkpoint._convert._torch_file import TorchFile

    try:
        return TorchFile(path)
    except ValueError as exc:  # legacy format or big-endian: say which file
        raise ValueError(f"cannot read rank file {path!r}: {exc}") from None


def _peek_meta(path: str) -> dict:
    """The ``shard_metadata`` of a rank file (no tensor bytes are read)."""
    with _open(path) as f:
        ckpt = f.obj
    meta = ckpt.get("shard_metadata") if isinstance(ckpt, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("rank"), int):
        raise ValueError(
            f"{path!r} is not a per-rank FSDP checkpoint: it needs 'model' and "
            "'shard_metadata' entries; remove it or narrow ckpt_suffix"
        )
    return meta


def find_rank_files(
    ckpt_prefix: str, ckpt_suffix: str = "*.pth", ignore: tuple[str, ...] = ()
) -> list[str]:
    """Every rank's file, ordered by its ``shard_metadata["rank"]`` (as torch_xla does).

    Any file names work (``rank-0-of-2.pth``, ``x_rank-00000000-of-00000002.pth``); a
    name that carries ``rank-R-of-N`` must agree with the file's metadata. A missing,
    duplicate or stray file is an error naming it. ``ignore`` lists files to skip (a
    previous consolidation's output, say).
    """
    pattern = ckpt_prefix + ckpt_suffix
    skip = {os.path.abspath(p) for p in ignore if p}
    paths = sorted(p for p in glob.glob(pattern) if os.path.abspath(p) not in skip)
    if not paths:
        raise FileNotFoundError(f"no checkpoint files match {pattern!r}")
    found: list[tuple[int, int, str]] = []
    worlds: dict[int, list[str]] = {}
    for path in paths:
        meta = _peek_meta(path)
        rank, world = meta["rank"], meta.get("world_size")
        match = _RANK_RE.search(os.path.basename(path))
        if match is not None and (int(match.group(1)), int(match.group(2))) != (rank, world):
            raise ValueError(
                f"{path!r} holds rank {rank} of {world} ranks, but its name says rank "
                f"{int(match.group(1))} of {int(match.group(2))}"
            )
        worlds.setdefault(world, []).append(path)
        found.append((rank, world, path))
    if len(worlds) > 1:
        detail = ", ".join(f"{n} ranks: {sorted(p)}" for n, p in sorted(worlds.items()))
        raise ValueError(f"checkpoint files from different world sizes match {pattern!r}: {detail}")
    world = next(iter(worlds))
    by_rank: dict[int, str] = {}
    for rank, _world, path in found:
        if rank in by_rank:
            raise ValueError(f"two files claim rank {rank}: {by_rank[rank]!r} and {path!r}")
        by_rank[rank] = path
    extra = sorted(p for r, p in by_rank.items() if not 0 <= r < world)
    if extra:
        raise ValueError(f"unexpected checkpoint file(s) {extra}: rank out of range 0..{world - 1}")
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        names = [os.path.basename(rank_file_name(ckpt_prefix, r, world)) for r in missing]
        raise FileNotFoundError(
            f"missing checkpoint file(s) for rank(s) {missing} of {world} matching {pattern!r} "
            f"(conventionally named {names}; found {sorted(by_rank.values())})"
        )
    return [by_rank[r] for r in range(world)]


def _merge_rank(path: str, rank: int, world: int, slots: dict, full: dict) -> dict[str, str]:
    """Copy one rank file's rows into the full tensors; its tensors die on return.

    Returns rank 0's ``state_dict`` key -> unwrapped name map, in order (else empty).
    Each shard is read with ``preadv`` straight into its rows of the full tensor.
    """
    with _open(path) as f:
        return _merge_open(f, path, rank, world, slots, full)


def _merge_open(f, path: str, rank: int, world: int, slots: dict, full: dict) -> dict[str, str]:
    ckpt = f.obj
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
            f"it was listed as rank {rank} of {world} (was it rewritten meanwhile?)"
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
        if shard.dtype != target.dtype:
            raise ValueError(
                f"{path!r}: {key!r} is {shard.dtype}, but an earlier file stored {target.dtype}"
            )
        if info["replicated"]:
            if rank == 0:
                f.read_into(shard, target)
        elif info["rows"]:
            f.read_into(shard, target.narrow(0, info["start"], info["rows"]))
        full[info["fqn"]] = target
    if rank != 0:
        return {}
    for key, fqn in meta["buffers"].items():
        full[fqn] = f.read(model[key])
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
) -> tuple[dict[str, torch.Tensor], str | None]:
    """Merge per-rank FSDP checkpoints into the unwrapped model's full state dict.

    Args:
        ckpt_prefix: path prefix shared by the rank files, e.g. ``/ckpt/final``.
        ckpt_suffix: glob completing the prefix, e.g. ``"_rank-*-of-*.pth"``.
        save_path: where to write ``{'model': full_state_dict}``; default
            ``<ckpt_prefix>_consolidated.pth``.
        save_model: write the file (otherwise only return the state dict).
        progress: show a tqdm progress bar over the rank files.

    Returns:
        ``(full_state_dict, save_path)``, ``save_path`` None when ``save_model`` is
        false (nothing was written, as in torch_xla); keys are the unwrapped model's names, with
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
    return full, None


def consolidate_sharded_state_dicts(state_dict_list: list[dict], shard_metadata: dict) -> dict:
    """Merge every rank's ``model.state_dict()`` (in rank order) into the full state dict.

    ``shard_metadata`` is ``model.get_shard_metadata()`` of any rank. Keys of the result
    are the unwrapped model's names, ready for ``plain_model.load_state_dict``.
    """
    from ..spmd import ShardedTensor
    from ..spmd.layout import chunk_bounds

    world = shard_metadata.get("world_size")
    if len(state_dict_list) != world:
        raise ValueError(
            f"shard_metadata describes {world} ranks but {len(state_dict_list)} state dicts "
            "were given; pass every rank's model.state_dict(), in rank order"
        )
    params, buffers = shard_metadata["params"], shard_metadata["buffers"]
    full: dict[str, torch.Tensor] = {}
    for key in state_dict_list[0]:
        if key in buffers:
            value = state_dict_list[0][key]
            full[buffers[key]] = value.detach().clone()
            continue
        info = params.get(key)
        if info is None:
            raise ValueError(f"state dict key {key!r} is not described by shard_metadata")
        pieces = []
        for rank, sd in enumerate(state_dict_list):
            value = sd[key]
            if isinstance(value, ShardedTensor):
                value = value._local_tensor
            if info["replicated"]:
                pieces = [value]
                break
            rows = chunk_bounds(info["shape"][0], world, rank)[1]
            if value.shape[0] != rows:
                raise ValueError(
                    f"state dict {rank}: {key!r} holds {value.shape[0]} rows, rank {rank} of "
                    f"{world} holds {rows}; are the state dicts in rank order?"
                )
            pieces.append(value.detach())
        merged = pieces[0].clone() if info["replicated"] else torch.cat(pieces, 0)
        full[info["fqn"]] = merged.reshape(info["shape"])
    return full
