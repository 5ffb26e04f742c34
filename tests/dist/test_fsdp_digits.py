"""Real data: FSDP on 2 ranks learns scikit-learn's digits to >= 95% held-out accuracy;
the per-rank checkpoints consolidate (function and command line) into a plain model with
the same accuracy; a missing or stray rank file is an error naming it."""

import functools
import os
import subprocess
import sys

import pytest
import torch
from harness import run_ranks
from torch import nn

from shardkit.fsdp import consolidate_sharded_model_checkpoints

SUFFIX = "_rank-*-of-*.pth"


def _data():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.25, random_state=0, stratify=y)
    f = functools.partial(torch.tensor, dtype=torch.float32)
    return f(xtr), torch.tensor(ytr), f(xte), torch.tensor(yte)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )


def _accuracy(model, x, y):
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


def _train_and_save(prefix):
    import torch.distributed as dist

    from shardkit.fsdp import FSDP
    from shardkit.fsdp._consolidate import rank_file_name
    from shardkit.fsdp.wrap import size_based_auto_wrap_policy

    rank, world = dist.get_rank(), dist.get_world_size()
    xtr, ytr, xte, yte = _data()
    model = FSDP(
        _model(),
        auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=5000),
    )
    units = sum(isinstance(m, FSDP) for m in model.modules())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(15):  # epochs over global batches of 128, 64 per rank
        order = torch.randperm(len(xtr), generator=g)
        for start in range(0, len(order) - 127, 128):
            idx = order[start : start + 128].chunk(world)[rank]
            loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    acc = _accuracy(model, xte, yte)
    path = rank_file_name(prefix, rank, world)
    torch.save(
        {
            "model": model.state_dict(),
            "shard_metadata": model.get_shard_metadata(),
            "optimizer": opt.state_dict(),
        },
        path,
    )
    # resume on the same ranks: a fresh model and optimizer load this rank's file
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=5000)
    fresh = FSDP(_model(), auto_wrap_policy=policy)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=3e-3)
    ckpt = torch.load(path, weights_only=True)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["optimizer"])
    resumed = _accuracy(fresh, xte, yte)
    same_moments = all(
        torch.equal(fresh_opt.state[q]["exp_avg"], opt.state[p]["exp_avg"])
        for p, q in zip(model.parameters(), fresh.parameters())
    )
    return acc, units, resumed, same_moments


def test_digits_train_consolidate_and_reload(tmp_path):
    prefix = str(tmp_path / "digits")
    results = run_ranks(_train_and_save, 2, prefix, timeout=180)
    (acc, units, resumed, same_moments), (acc1, *_) = results
    assert resumed == acc and same_moments
    assert units == 3  # root (holding the small last layer) + the two big Linear layers
    assert acc == acc1 >= 0.95
    # every rank file loads without unpickling code
    for rank in range(2):
        torch.load(f"{prefix}_rank-{rank:08d}-of-00000002.pth", weights_only=True)

    full, path = consolidate_sharded_model_checkpoints(prefix, SUFFIX)
    plain = _model()
    assert list(full) == list(plain.state_dict())
    plain.load_state_dict(torch.load(path, weights_only=True)["model"])
    _, _, xte, yte = _data()
    assert _accuracy(plain, xte, yte) == acc

    # the command line does the same, with a progress bar
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cli = [sys.executable, "-m", "shardkit.fsdp.consolidate_sharded_ckpts"]
    out = str(tmp_path / "cli" / "full.pth")
    run = subprocess.run(
        [*cli, "--ckpt_prefix", prefix, "--ckpt_suffix", SUFFIX, "--save_path", out],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    assert "consolidating" in run.stderr  # tqdm's bar
    again = torch.load(out, weights_only=True)["model"]
    assert all(torch.equal(again[k], full[k]) for k in full)

    # a stray rank file, then a missing one, are errors that name the file
    stray = f"{prefix}_rank-00000002-of-00000002.pth"
    torch.save({}, stray)
    with pytest.raises(ValueError, match="digits_rank-00000002-of-00000002.pth"):
        consolidate_sharded_model_checkpoints(prefix, SUFFIX, save_model=False)
    os.remove(stray)
    os.remove(f"{prefix}_rank-00000001-of-00000002.pth")
    run = subprocess.run(
        [*cli, "--ckpt_prefix", prefix, "--ckpt_suffix", SUFFIX], capture_output=True, text=True
    )
    assert run.returncode == 2 and "digits_rank-00000001-of-00000002.pth" in run.stderr, run.stderr
