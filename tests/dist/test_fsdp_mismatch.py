"""Ranks that wrap different models raise ModelMismatchError on every rank at wrap time,
naming the first difference (the diverging-ranks audit): parameters registered in
another order (same shapes: each rank kept rows of a different tensor, silently), other
shapes (silently wrong forward), an extra layer or a parameter frozen on one rank (gloo
aborted the process). Auto-wrapped models are checked once, before any unit is built."""

import functools

from harness import run_ranks


def _two(swap=False, shapes=((4, 4), (4, 4)), extra=False, freeze=False):
    import torch
    from torch import nn

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            (i1, o1), (i2, o2) = shapes
            if swap:
                self.b = nn.Linear(i2, o2)
                self.a = nn.Linear(i1, o1)
            else:
                self.a = nn.Linear(i1, o1)
                self.b = nn.Linear(i2, o2)
            if extra:
                self.c = nn.Linear(o2, o2)
            if freeze:
                self.a.weight.requires_grad_(False)

        def forward(self, x):
            y = self.b(torch.relu(self.a(x)))
            return self.c(y) if hasattr(self, "c") else y

    return Two()


def _attempt(build, **kwargs):
    import torch

    from shardkit.fsdp import FSDP
    from shardkit.fsdp._errors import ModelMismatchError

    try:
        model = FSDP(build(), **kwargs)
    except (ModelMismatchError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    model(torch.randn(3, 4)).sum().backward()
    return "ok", None


def _cases(_):
    import torch
    import torch.distributed as dist
    from torch import nn

    from shardkit.fsdp.wrap import transformer_auto_wrap_policy

    one = dist.get_rank() == 1
    per_linear = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})
    return {
        "order": _attempt(lambda: _two(swap=one)),
        "order shapes": _attempt(lambda: _two(swap=one, shapes=((4, 8), (8, 4)))),
        "extra layer": _attempt(lambda: _two(extra=one)),
        "frozen": _attempt(lambda: _two(freeze=one)),
        "auto-wrapped extra layer": _attempt(lambda: _two(extra=one), auto_wrap_policy=per_linear),
        "same model": _attempt(_two),
        "same model auto-wrapped": _attempt(_two, auto_wrap_policy=per_linear),
        # fp16 on one rank, bf16 on the other: the reduce summed the two formats' bits
        # and training went on to parameters near 1e28, silently (second audit)
        "compute dtype": _attempt(
            _two, compute_dtype=torch.float16 if one else torch.bfloat16
        ),
        "reshard": _attempt(_two, reshard_after_forward=not one),
    }


def test_ranks_wrapping_different_models_raise_on_every_rank():
    for res in run_ranks(_cases, 2, None, timeout=120):
        kind, msg = res["compute dtype"]
        assert kind == "ValueError", res
        assert (
            "compute_dtype differs between the ranks (rank 0: torch.bfloat16, rank 1: "
            "torch.float16)" in msg
        ), msg
        kind, msg = res["reshard"]
        assert kind == "ValueError" and "reshard_after_forward differs" in msg, res
        kind, msg = res["order"]
        assert kind == "ModelMismatchError", res
        assert (
            "in Two, parameter 0 differs (rank 0: a.weight (4, 4) float32, "
            "rank 1: b.weight (4, 4) float32)" in msg
        )
        kind, msg = res["order shapes"]
        assert kind == "ModelMismatchError", res
        assert "rank 0: a.weight (8, 4) float32, rank 1: b.weight (4, 8) float32" in msg
        for case in ("extra layer", "auto-wrapped extra layer"):
            kind, msg = res[case]
            assert kind == "ModelMismatchError", (case, res)
            assert "the number of parameters differs (rank 0: 4, rank 1: 6 (c.weight" in msg
        kind, msg = res["frozen"]
        assert kind == "ModelMismatchError", res
        assert "rank 0: a.weight (4, 4) float32, rank 1: a.weight (4, 4) float32 frozen" in msg
        assert res["same model"] == ("ok", None)
        assert res["same model auto-wrapped"] == ("ok", None)


def _nested_by_hand(_):
    """Units wrapped by hand check themselves one by one (each its own all-reduce)."""
    import torch.distributed as dist
    from torch import nn

    from shardkit.fsdp import FSDP
    from shardkit.fsdp._errors import ModelMismatchError

    one = dist.get_rank() == 1
    try:
        FSDP(nn.Sequential(FSDP(nn.Linear(4, 4)), FSDP(nn.Linear(4, 5 if one else 4))))
    except ModelMismatchError as exc:
        return str(exc)
    return None


def test_units_wrapped_by_hand_are_checked_each():
    for msg in run_ranks(_nested_by_hand, 2, None, timeout=90):
        assert msg is not None
        assert "in Linear, parameter 0 differs (rank 0: weight (4, 4) float32, " in msg
        assert "rank 1: weight (5, 4) float32)" in msg


def _values(_):
    """Values that differ per rank (an unseeded init) without sync_module_states warn:
    each rank keeps its rows of its own tensors (torch FSDP2 mixes them silently too)."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch import nn

    from shardkit.fsdp import FSDP

    out = {}
    for case, seed, kwargs in (
        ("per-rank seed", dist.get_rank(), {}),
        ("per-rank seed, synced", dist.get_rank(), {"sync_module_states": True}),
        ("same seed", 0, {}),
    ):
        torch.manual_seed(seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), **kwargs)
        out[case] = [str(w.message) for w in caught if "different values" in str(w.message)]
    return out


def test_values_that_differ_per_rank_warn_unless_synced():
    for res in run_ranks(_values, 2, None, timeout=90):
        assert len(res["per-rank seed"]) == 1, res
        assert "sync_module_states=True" in res["per-rank seed"][0]
        assert res["per-rank seed, synced"] == [] and res["same seed"] == [], res
