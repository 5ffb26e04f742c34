"""Rebuild a full, unwrapped state dict from per-rank FSDP checkpoints.

Each rank saved ``{'model': model.state_dict(), 'shard_metadata':
model.get_shard_metadata(), ...}`` to ``<prefix>_rank-XXXXXXXX-of-XXXXXXXX.pth``. Files
are read one at a time, so at most the full model plus one rank's file is in memory.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import reprlib
from collections.abc import Callable, Iterable

import torch

from ..checkpoint._core._format import is_int

__all__ = [
    "consolidate_sharded_model_checkpoints",
    "consolidate_sharded_state_dicts",
    "find_rank_files",
    "rank_file_name",
]

_RANK_RE = re.compile(r"rank-(\d+)-of-(\d+)")


@functools.cache
def _rank_file_error() -> type:
    """``RankFileError``, made on first use: ``import shardkit.fsdp`` stays light."""
    from ..checkpoint._core._errors import CorruptCheckpointError

    class RankFileError(CorruptCheckpointError, ValueError):
        """A per-rank file's ``shard_metadata`` is malformed, disagrees with its shards or
        with rank 0's file. Also a ``ValueError`` (what this module raised before); the
        message names the file and the parameter."""

    RankFileError.__module__ = __name__
    return RankFileError


def _bad_file(message: str) -> Exception:
    """A ``RankFileError``: a ``CorruptCheckpointError`` that is also a ``ValueError``."""
    return _rank_file_error()(message)


def rank_file_name(prefix: str, rank: int, world_size: int, suffix: str = ".pth") -> str:
    """The conventional per-rank file name, ``<prefix>_rank-00000001-of-00000004.pth``."""
    return f"{prefix}_rank-{rank:08d}-of-{world_size:08d}{suffix}"


def _open(path: str):
    from ..checkpoint._convert._torch_file import TorchFile

    try:  # a CorruptCheckpointError (not a ValueError) names the file already
        return TorchFile(path)
    except ValueError as exc:  # legacy format or big-endian: say which file
        raise ValueError(f"cannot read rank file {path!r}: {exc}") from None


def _peek_meta(path: str) -> dict:
    """The ``shard_metadata`` of a rank file (no tensor bytes are read)."""
    with _open(path) as f:
        ckpt = f.obj
    meta = ckpt.get("shard_metadata") if isinstance(ckpt, dict) else None
    if not isinstance(meta, dict) or not is_int(meta.get("rank")):
        raise _bad_file(
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


_FIELDS = {"fqn": str, "shape": list, "slot": int, "replicated": bool, "start": int, "rows": int}


class _Plan:
    """Every rank file's ``shard_metadata`` checked against its shards and against rank
    0's, before anything is allocated: the same keys on every rank, the same full shape,
    and each parameter's rows tiling ``[0, shape[0])`` in rank order, no gap, no overlap.

    A second pass (the merge itself) checks each file again against the first pass's
    parameters, so a file rewritten in between is an error, never uninitialised rows.
    """

    def __init__(self, paths: list[str], ref: dict | None = None, *, files: bool = True) -> None:
        self.ref = ref  # key -> (fqn, shape, slot, replicated, dtype), from rank 0
        self.next_row: dict[str, int] = {}
        # how errors name things: rank files, or state dicts passed in memory
        self.model_name = "'model'" if files else "its state dict"
        self.ref_name = "rank 0's file" if files else "state dict 0"
        self.all_name = (
            f"the {len(paths)} rank files {paths[0]!r} ... {paths[-1]!r}"
            if files
            else f"the {len(paths)} state dicts"
        )

    def add(self, source: str, rank: int, model, meta: dict) -> dict:
        """Check one rank's state dict ``model`` (named ``source`` in errors) and its
        ``meta``; returns its ``params`` (key -> checked info)."""
        params, buffers = meta.get("params"), meta.get("buffers")
        if not isinstance(params, dict) or not isinstance(buffers, dict):
            raise _bad_file(
                f"{source}: shard_metadata needs 'params' and 'buffers' dicts, got "
                f"{type(params).__name__} and {type(buffers).__name__}"
            )
        if not isinstance(model, dict):
            raise _bad_file(f"{source}: {self.model_name} is a {type(model).__name__}, not a dict")
        spec = {key: self._param(source, key, info, model) for key, info in params.items()}
        if self.ref is None:
            self.ref = self._reference(source, spec)
        if rank == 0:
            self._buffers(source, buffers, model)
        missing = sorted(set(self.ref) - set(spec), key=repr)
        extra = sorted(set(spec) - set(self.ref), key=repr)
        if missing or extra:
            raise _bad_file(
                f"{source}: its shard metadata describes other parameters than rank 0's "
                f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, extra "
                f"{extra[:5]}{'...' if len(extra) > 5 else ''})"
            )
        for key, (fqn, shape, slot, replicated, dtype, start, rows) in spec.items():
            want = self.ref[key]
            if (fqn, shape, slot, replicated, dtype) != want:
                raise _bad_file(
                    f"{source}: {key!r} is {fqn!r} of shape {list(shape)} (slot {slot}, "
                    f"replicated={replicated}, {dtype}), but {self.ref_name} says {want[0]!r} "
                    f"of shape {list(want[1])} (slot {want[2]}, replicated={want[3]}, "
                    f"{want[4]})"
                )
            if replicated or not rows:
                continue
            expect = self.next_row.get(key, 0)
            if start != expect:
                what = "overlap them" if start < expect else f"leave rows {expect}..{start - 1} out"
                raise _bad_file(
                    f"{source}: {key!r} (rank {rank}) starts at row {start}, but the ranks "
                    f"before it end at row {expect}: its rows would {what}"
                )
            self.next_row[key] = start + rows
        return params

    def _param(self, source: str, key, info, model) -> tuple:
        where = f"{source}: shard metadata of {key!r}"
        if not isinstance(info, dict):
            raise _bad_file(f"{where} is a {type(info).__name__}, not a dict")
        for field, kind in _FIELDS.items():
            value = info.get(field)
            ok = is_int(value) if kind is int else isinstance(value, kind)
            if field == "shape":
                ok = isinstance(value, (list, tuple)) and all(is_int(n) and n >= 0 for n in value)
            if not ok:
                raise _bad_file(
                    f"{where}: {field!r} must be "
                    + ("a list of integers >= 0" if field == "shape" else kind.__name__)
                    + f", got {reprlib.repr(value)}"
                )
        shape, start, rows = tuple(info["shape"]), info["start"], info["rows"]
        if not info["replicated"]:
            if not shape:
                raise _bad_file(f"{where}: a sharded parameter needs a shape of >= 1 dims")
            if rows < 0 or start < 0 or start + rows > shape[0]:
                raise _bad_file(
                    f"{where}: rows {start}..{start + rows - 1} ({rows} rows from row {start}) "
                    f"are outside its {shape[0]} rows"
                )
        shard = model.get(key)
        if not isinstance(shard, torch.Tensor):
            raise _bad_file(
                f"{source}: shard metadata names {key!r}, missing from {self.model_name}"
            )
        expected = shape if info["replicated"] else (rows, *shape[1:])
        if tuple(shard.shape) != expected:
            raise _bad_file(
                f"{source}: {key!r} has shape {tuple(shard.shape)}, but its shard metadata "
                f"says {expected}"
            )
        return info["fqn"], shape, info["slot"], info["replicated"], shard.dtype, start, rows

    @staticmethod
    def _reference(source: str, spec: dict) -> dict:
        """Rank 0's parameters; tied ones (one slot) agree, no two slots share a name."""
        slots: dict[int, tuple] = {}
        names: dict[str, int] = {}
        for key, (fqn, shape, slot, replicated, dtype, start, rows) in spec.items():
            first = slots.setdefault(slot, (key, shape, replicated, dtype, start, rows))
            if first[1:] != (shape, replicated, dtype, start, rows):
                raise _bad_file(
                    f"{source}: {key!r} and {first[0]!r} share slot {slot} (tied), but their "
                    "shard metadata or shards differ"
                )
            if names.setdefault(fqn, slot) != slot:
                raise _bad_file(f"{source}: two parameters are both named {fqn!r}")
        return {key: v[:5] for key, v in spec.items()}

    def _buffers(self, source: str, buffers: dict, model: dict) -> None:
        """Rank 0's buffers (the only ones read): tensors of its state dict, named apart."""
        params = {v[0] for v in self.ref.values()}
        for key, fqn in buffers.items():
            if not isinstance(fqn, str) or not isinstance(model.get(key), torch.Tensor):
                raise _bad_file(
                    f"{source}: shard metadata names buffer {key!r} ({reprlib.repr(fqn)}), "
                    f"but {self.model_name} holds no tensor under that key"
                )
            if fqn in params:
                raise _bad_file(f"{source}: buffer {key!r} is named {fqn!r}, as a parameter")

    def finish(self) -> None:
        """Every sharded parameter's rows all came from some rank."""
        for key, (_fqn, shape, _slot, replicated, _dtype) in (self.ref or {}).items():
            if not replicated and self.next_row.get(key, 0) != shape[0]:
                end = self.next_row.get(key, 0)
                raise _bad_file(
                    f"{key!r} (shape {list(shape)}): rows {end}..{shape[0] - 1} are in none of "
                    f"{self.all_name}"
                )


def _check_rank(f, path: str, rank: int, world: int, plan: _Plan) -> tuple[dict, dict, dict]:
    """``(model, shard_metadata, params)`` of an open rank file, checked by ``plan``."""
    ckpt = f.obj
    try:
        model, meta = ckpt["model"], ckpt["shard_metadata"]
    except (KeyError, TypeError):
        raise _bad_file(
            f"{path!r} is not a per-rank FSDP checkpoint: it needs 'model' and "
            "'shard_metadata' entries"
        ) from None
    if not isinstance(meta, dict):
        raise _bad_file(f"{path!r}: 'shard_metadata' is a {type(meta).__name__}, not a dict")
    if meta.get("world_size") != world or meta.get("rank") != rank:
        raise _bad_file(
            f"{path!r} holds rank {meta.get('rank')} of {meta.get('world_size')} ranks, but "
            f"it was listed as rank {rank} of {world} (was it rewritten meanwhile?)"
        )
    return model, meta, plan.add(repr(path), rank, model, meta)


def _plan(paths: list[str]) -> dict:
    """Check every rank file's metadata (no tensor bytes are read); rank 0's parameters."""
    plan = _Plan(paths)
    for rank, path in enumerate(paths):
        _check_file(path, rank, len(paths), plan)
    plan.finish()
    return plan.ref


def _check_file(path: str, rank: int, world: int, plan: _Plan) -> None:
    with _open(path) as f:  # its (meta) tensors die on return, before the next file opens
        _check_rank(f, path, rank, world, plan)


def _merge_rank(path: str, rank: int, world: int, slots: dict, full: dict, plan) -> dict:
    """Copy one rank file's rows into the full tensors; its tensors die on return.

    Returns rank 0's ``state_dict`` key -> unwrapped name map, in order (else empty).
    Each shard is read with ``preadv`` straight into its rows of the full tensor.
    """
    with _open(path) as f:
        return _merge_open(f, path, rank, world, slots, full, plan)


def _merge_open(f, path: str, rank: int, world: int, slots: dict, full: dict, plan) -> dict:
    model, meta, params = _check_rank(f, path, rank, world, plan)
    _place(model, params, rank, slots, full, f.read_into)
    if rank != 0:
        return {}
    for key, fqn in meta["buffers"].items():
        full[fqn] = f.read(model[key])
    names = {**{k: v["fqn"] for k, v in params.items()}, **meta["buffers"]}
    return {k: names[k] for k in model if k in names}


def _place(shards: dict, params: dict, rank: int, slots: dict, full: dict, fill) -> None:
    """Put one rank's parameter shards into their rows of the full tensors, which are
    allocated on first sight (one per slot: tied parameters share it). A replicated
    parameter comes from rank 0 alone. ``fill(shard, rows)`` copies a shard's bytes."""
    for key, info in params.items():
        shard = shards[key]
        target = slots.get(info["slot"])
        if target is None:  # shape checked by the plan: the rows of every rank tile it
            target = slots[info["slot"]] = torch.empty(info["shape"], dtype=shard.dtype)
        if info["replicated"]:
            if rank == 0:
                fill(shard, target)
        elif info["rows"]:
            fill(shard, target.narrow(0, info["start"], info["rows"]))
        full[info["fqn"]] = target


def _consolidate(paths: list[str], progress: Callable[[Iterable], Iterable]) -> dict:
    world = len(paths)
    full: dict[str, torch.Tensor] = {}
    slots: dict[int, torch.Tensor] = {}  # one full tensor per unique (maybe tied) parameter
    order: dict[str, str] = {}
    plan = _Plan(paths, _plan(paths))  # every file checked before anything is allocated
    for rank, path in enumerate(progress(paths)):
        order = _merge_rank(path, rank, world, slots, full, plan) or order
    plan.finish()
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
    are the unwrapped model's names, ready for ``plain_model.load_state_dict``. Everything
    is checked before anything is allocated, as for rank files: a state dict whose keys,
    shapes or dtypes disagree with ``shard_metadata`` or with state dict 0 is a
    ``ValueError`` naming the state dict and the key.
    """
    from ..spmd import ShardedTensor

    if not isinstance(shard_metadata, dict):
        raise TypeError(
            "shard_metadata must be the dict model.get_shard_metadata() returns, got "
            f"{type(shard_metadata).__name__}"
        )
    if not isinstance(state_dict_list, (list, tuple)):
        raise TypeError(
            f"state_dict_list must be a list of every rank's state dict, got a "
            f"{type(state_dict_list).__name__}"
        )
    world = shard_metadata.get("world_size")
    if not is_int(world) or world < 1:
        raise ValueError(
            f"shard_metadata['world_size'] must be an int >= 1, got {reprlib.repr(world)}"
        )
    if len(state_dict_list) != world:
        raise ValueError(
            f"shard_metadata describes {world} ranks but {len(state_dict_list)} state dicts "
            "were given; pass every rank's model.state_dict(), in rank order"
        )
    names = [f"state dict {rank}" for rank in range(world)]
    plan = _Plan(names, files=False)
    checked = []
    for rank, state in enumerate(state_dict_list):
        if not isinstance(state, dict):
            raise TypeError(f"{names[rank]} is a {type(state).__name__}, not a dict")
        state = {
            k: v._local_tensor if isinstance(v, ShardedTensor) else v for k, v in state.items()
        }
        meta = _meta_of_rank(shard_metadata, rank, world)
        params = plan.add(names[rank], rank, state, meta)
        described = {*params, *meta["buffers"]}
        stray = [k for k in state if k not in described]
        if stray:
            raise _bad_file(
                f"{names[rank]}: key {stray[0]!r} is not described by shard_metadata; pass "
                "state dicts and shard metadata of the same model"
            )
        checked.append((state, params))
    plan.finish()
    slots: dict[int, torch.Tensor] = {}
    full: dict[str, torch.Tensor] = {}
    for rank, (state, params) in enumerate(checked):
        _place(state, params, rank, slots, full, lambda shard, rows: rows.copy_(shard.detach()))
    state, params = checked[0]
    buffers = shard_metadata["buffers"]
    for key, fqn in buffers.items():
        full[fqn] = state[key].detach().clone()
    order = {**{k: v["fqn"] for k, v in params.items()}, **buffers}
    return {order[k]: full[order[k]] for k in state}


def _meta_of_rank(meta: dict, rank: int, world: int) -> dict:
    """``meta`` (any rank's shard metadata) with the rows ``rank`` holds: FSDP splits
    dim 0 like ``torch.chunk``. Malformed entries pass through for the plan to name."""
    from ..spmd.layout import chunk_bounds

    params = meta.get("params")
    if not isinstance(params, dict):
        return meta
    mine = {}
    for key, info in params.items():
        shape = info.get("shape") if isinstance(info, dict) else None
        if (
            isinstance(shape, (list, tuple))
            and shape
            and is_int(shape[0])
            and shape[0] >= 0
            and info.get("replicated") is False
        ):
            start, rows = chunk_bounds(shape[0], world, rank)
            info = {**info, "start": start, "rows": rows}
        mine[key] = info
    return {**meta, "params": mine}
