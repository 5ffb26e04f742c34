"""FSDP consolidation of per-rank files whose ``shard_metadata`` lies: every file is
checked before anything is allocated, and each lie is a ``CorruptCheckpointError`` (also
a ``ValueError``) naming the file and the parameter, never uninitialised rows, a raw
``KeyError``/``IndexError`` or a huge allocation (docs/fsdp.md, consolidation)."""

from __future__ import annotations

import os

import pytest
import torch

from shardkit.checkpoint import CorruptCheckpointError
from shardkit.fsdp import consolidate_sharded_ckpts as cli
from shardkit.fsdp import consolidate_sharded_model_checkpoints, consolidate_sharded_state_dicts

SUFFIX = "_rank-*-of-*.pth"


def _file(prefix, rank, world=2):
    return f"{prefix}_rank-{rank:08d}-of-{world:08d}.pth"


def _ranks(edit=lambda rank, meta, model: None, world=2, rows=2):
    """``(state dict, shard metadata)`` of each of ``world`` ranks of a (world * rows, 3)
    parameter 'w' (rank r holds rows r*rows..), after ``edit``."""
    out = []
    for rank in range(world):
        info = dict(shape=[world * rows, 3], replicated=False, rows=rows, start=rank * rows)
        info.update(slot=0, fqn="w")
        meta = dict(version=1, rank=rank, world_size=world, params={"_w": info}, buffers={})
        model = {"_w": torch.full((rows, 3), float(rank + 1))}
        edit(rank, meta, model)
        out.append((model, meta))
    return out


def _write(prefix, edit=lambda rank, meta, model: None, world=2):
    """The rank files of ``_ranks``."""
    for rank, (model, meta) in enumerate(_ranks(edit, world)):
        torch.save({"model": model, "shard_metadata": meta}, _file(prefix, rank, world))


def _set(field, value, only=None):
    def edit(rank, meta, model):
        if only is None or rank == only:
            meta["params"]["_w"][field] = value

    return edit


def _drop_params(rank, meta, model):
    del meta["params"]


def _extra_param_on_rank_1(rank, meta, model):
    if rank == 1:
        meta["params"]["_v"] = dict(meta["params"]["_w"], slot=1, fqn="v")
        model["_v"] = model["_w"].clone()


def _other_shape_on_rank_1(rank, meta, model):
    if rank == 1:
        meta["params"]["_w"].update(shape=[4, 2])
        model["_w"] = torch.zeros(2, 2)


def _shard_missing_from_model(rank, meta, model):
    del model["_w"]


def _buffer_missing_from_model(rank, meta, model):
    meta["buffers"]["_b"] = "b"


HOSTILE = {  # case: (edit, the file named, the parameter named, what is wrong)
    # overlapping rows: rows 2..3 used to stay uninitialised, silently
    "overlap": (_set("start", 0), "ck_rank-00000001", "'_w'", "overlap"),
    "gap": (_set("start", 1, only=0), "ck_rank-00000000", "'_w'", "leave rows 0..0 out"),
    "negative start": (_set("start", -2, only=1), "ck_rank-00000001", "'_w'", "outside its 4"),
    "start past the end": (_set("start", 99, only=1), "ck_rank-00000001", "'_w'", "outside its"),
    # a 1.5 KB file asked for 12 MB (or 12 TB) of uninitialised memory
    "huge shape": (_set("shape", [1 << 20, 3]), "ck_rank-00000001", "'_w'", "rows 4..1048575"),
    "tera shape": (_set("shape", [10**12, 3]), "ck_rank-00000001", "'_w'", "rows 4..9999"),
    "shape not a list": (_set("shape", "ab"), "ck_rank-00000000", "'_w'", "'shape' must be"),
    "start not an int": (_set("start", "0"), "ck_rank-00000000", "'_w'", "'start' must be int"),
    "rows missing": (_set("rows", None), "ck_rank-00000000", "'_w'", "'rows' must be int"),
    "no params": (_drop_params, "ck_rank-00000000", "'params'", "got NoneType"),
    "params differ": (_extra_param_on_rank_1, "ck_rank-00000001", "'_v'", "than rank 0's"),
    "shape differs": (_other_shape_on_rank_1, "ck_rank-00000001", "'_w'", "rank 0's file says"),
    "shard not in model": (_shard_missing_from_model, "ck_rank-00000000", "'_w'", "missing"),
    "buffer not in model": (_buffer_missing_from_model, "ck_rank-00000000", "'_b'", "no tensor"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_lying_shard_metadata_is_refused_naming_file_and_parameter(tmp_path, case):
    edit, file_part, name, detail = HOSTILE[case]
    prefix = str(tmp_path / "ck")
    _write(prefix, edit)
    with pytest.raises(CorruptCheckpointError) as info:
        consolidate_sharded_model_checkpoints(prefix, SUFFIX)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)  # what this module raised before
    assert file_part in msg and name in msg and detail in msg, msg
    assert not os.path.exists(prefix + "_consolidated.pth")


def _tied_replicated_and_empty(rank):
    """Rank ``rank`` of 3: ``(state_dict, shard_metadata)`` with tied parameters (two keys,
    one slot), a replicated 0-d parameter, a buffer, and a 2-row parameter of which rank 2
    holds no rows."""
    emb = torch.arange(12.0).reshape(6, 2)
    head = torch.arange(2.0).reshape(2, 1)
    e_start, e_rows = 2 * rank, 2
    h_start, h_rows = min(rank, 2), 1 if rank < 2 else 0
    params = {
        "_emb": dict(fqn="emb", shape=[6, 2], slot=0, replicated=False, start=e_start,
                     rows=e_rows),
        "_out": dict(fqn="out", shape=[6, 2], slot=0, replicated=False, start=e_start,
                     rows=e_rows),
        "_head": dict(fqn="head", shape=[2, 1], slot=1, replicated=False, start=h_start,
                      rows=h_rows),
        "_scale": dict(fqn="scale", shape=[], slot=2, replicated=True, start=0, rows=1),
    }  # fmt: skip
    shard = emb[e_start : e_start + 2].clone()
    model = {
        "_emb": shard,
        "_out": shard,  # tied: the same storage under two keys
        "_head": head[h_start : h_start + h_rows].clone(),
        "_scale": torch.tensor(0.5),
        "_buf": torch.ones(3),
    }
    meta = dict(version=1, rank=rank, world_size=3, params=params, buffers={"_buf": "buf"})
    return model, meta


def _check_full(full):
    assert list(full) == ["emb", "out", "head", "scale", "buf"]
    assert torch.equal(full["emb"], torch.arange(12.0).reshape(6, 2))
    assert full["out"] is full["emb"]
    assert torch.equal(full["head"], torch.arange(2.0).reshape(2, 1))
    assert torch.equal(full["scale"], torch.tensor(0.5))
    assert torch.equal(full["buf"], torch.ones(3))


def test_legit_tied_replicated_and_empty_shards_consolidate(tmp_path):
    """The same state dicts consolidate from rank files and from memory."""
    prefix = str(tmp_path / "ok")
    ranks = [_tied_replicated_and_empty(rank) for rank in range(3)]
    for rank, (model, meta) in enumerate(ranks):
        torch.save({"model": model, "shard_metadata": meta}, _file(prefix, rank, 3))
    full, _ = consolidate_sharded_model_checkpoints(prefix, SUFFIX, save_model=False)
    _check_full(full)
    # shard_metadata of any rank will do: each rank's rows follow from the full shapes
    _check_full(consolidate_sharded_state_dicts([m for m, _ in ranks], ranks[2][1]))


def _in_memory(edit=lambda rank, meta, model: None):
    """The state dicts and rank 0's shard metadata that ``_write`` would save."""
    ranks = _ranks(edit)
    return [model for model, _ in ranks], ranks[0][1]


def _on_rank_1(change):
    def edit(rank, meta, model):
        if rank == 1:
            change(model)

    return edit


IN_MEMORY = {  # case: (edit, the exception, what the message names)
    "a key missing on rank 1": (
        _on_rank_1(lambda m: m.pop("_w")),
        "state dict 1: shard metadata names '_w', missing from its state dict",
    ),
    "a stray key on rank 1": (
        _on_rank_1(lambda m: m.update(_x=torch.zeros(1))),
        "state dict 1: key '_x' is not described by shard_metadata",
    ),
    "too many rows on rank 1": (
        _on_rank_1(lambda m: m.update(_w=torch.zeros(3, 3))),
        "state dict 1: '_w' has shape (3, 3), but its shard metadata says (2, 3)",
    ),
    "other columns on rank 1": (
        _on_rank_1(lambda m: m.update(_w=torch.zeros(2, 4))),
        "state dict 1: '_w' has shape (2, 4)",
    ),
    "another dtype on rank 1": (
        _on_rank_1(lambda m: m.update(_w=torch.zeros(2, 3, dtype=torch.float64))),
        "state dict 1: '_w' is 'w' of shape [4, 3] (slot 0, replicated=False, torch.float64), "
        "but state dict 0 says",
    ),
    "a tera-row shape": (  # refused by its rows, never allocated
        _set("shape", [10**12, 3], only=0),
        "state dict 0: '_w' has shape (2, 3), but its shard metadata says (500000000000, 3)",
    ),
    "shape not a list": (_set("shape", "ab", only=0), "'shape' must be a list"),
    "a buffer not in the state dict": (_buffer_missing_from_model, "buffer '_b'"),
}


@pytest.mark.parametrize("case", sorted(IN_MEMORY))
def test_in_memory_state_dicts_that_disagree_are_refused_naming_rank_and_key(case):
    edit, detail = IN_MEMORY[case]
    states, meta = _in_memory(edit)
    with pytest.raises(ValueError) as info:
        consolidate_sharded_state_dicts(states, meta)
    assert detail in str(info.value), str(info.value)


def test_in_memory_arguments_of_the_wrong_kind_are_refused():
    states, meta = _in_memory()
    assert torch.equal(
        consolidate_sharded_state_dicts(states, meta)["w"],
        torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)]),
    )
    with pytest.raises(ValueError, match="describes 2 ranks but 1 state dicts"):
        consolidate_sharded_state_dicts(states[:1], meta)
    with pytest.raises(TypeError, match="shard_metadata must be the dict"):
        consolidate_sharded_state_dicts(states, [meta])
    with pytest.raises(TypeError, match="state dict 1 is a list, not a dict"):
        consolidate_sharded_state_dicts([states[0], []], meta)
    with pytest.raises(ValueError, match="world_size'\\] must be an int >= 1, got '2'"):
        consolidate_sharded_state_dicts(states, {**meta, "world_size": "2"})
    with pytest.raises(TypeError, match="must be a list of every rank's state dict, got a dict"):
        consolidate_sharded_state_dicts(dict(enumerate(states)), meta)


def test_a_file_rewritten_after_the_check_is_refused(tmp_path, monkeypatch):
    """The merge checks each file again: one rewritten between the check and the merge
    (here with overlapping rows) is an error, not uninitialised rows."""
    import shardkit.fsdp._consolidate as cons

    prefix = str(tmp_path / "ck")
    _write(prefix)
    real_plan = cons._plan

    def plan_then_rewrite(paths):
        ref = real_plan(paths)
        _write(prefix, _set("start", 0))
        return ref

    monkeypatch.setattr(cons, "_plan", plan_then_rewrite)
    with pytest.raises(CorruptCheckpointError, match="ck_rank-00000001.*'_w'.*overlap"):
        consolidate_sharded_model_checkpoints(prefix, SUFFIX, save_model=False)


def test_command_line_reports_a_damaged_rank_file_in_one_line(tmp_path, capsys):
    """A stride-0 shard (16 bytes stored, 64 MiB once read) is refused when the file is
    opened; the command line says so (exit 2), without a traceback."""

    def expanded(rank, meta, model):
        meta["params"]["_w"].update(shape=[2 << 22, 1], rows=1 << 22, start=rank << 22)
        model["_w"] = torch.zeros(1, 1).expand(1 << 22, 1)

    prefix = str(tmp_path / "ck")
    _write(prefix, expanded)
    code = cli.main(["--ckpt_prefix", prefix, "--ckpt_suffix", SUFFIX])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "ck_rank-00000000" in err and "key 'model._w'" in err and "expand" in err, err
    assert not os.path.exists(prefix + "_consolidated.pth")
