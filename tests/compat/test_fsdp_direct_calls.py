"""FSDP code moved over from torch: ``requires_grad`` changed after wrapping, the wrapped
module called directly (``model.module(x)``, a reference kept from before wrapping, and
Hugging Face ``generate()``), and misuse on a nested unit.

Found side by side with torch FSDP1 / FSDP2 (2026-11-28): shardkit trained a parameter
unfrozen after wrapping never (and moved one frozen after wrapping by momentum), and a
direct call computed silently with this rank's rows. The references here are plain
single-process training and plain modules; torch's FSDP gives the same values.
"""

import functools

import pytest
import torch
from fsdp_models import Stack, TanhBlock, wrap_fsdp
from harness import run_ranks
from torch import nn

pytestmark = pytest.mark.timeout(180)
WORLD = 2


Block, Net = TanhBlock, Stack


def _wrap(model, nested):
    return wrap_fsdp(model, nested)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _train(model, rank, world, toggle, steps=3):
    """SGD with momentum and weight decay; ``toggle(model, step)`` flips requires_grad.
    Each rank takes its part of the same global batch; returns the .grad-is-None flags
    of the toggled parameter per step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9, weight_decay=0.1)
    seen = []
    for step in range(steps):
        toggle(model, step)
        x, y = _batch(step)
        n = len(x) // world
        x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        seen.append(_toggled(model).grad is None)
        opt.step()
    return seen


def _toggled(model):
    inner = getattr(model, "module", model)
    return inner.proj.weight


def _unfreeze_at_1(model, step):
    _toggled(model).requires_grad_(step >= 1)


def _freeze_at_1(model, step):
    _toggled(model).requires_grad_(step < 1)


TOGGLES = {"unfreeze": _unfreeze_at_1, "freeze": _freeze_at_1}


def _requires_grad_body():
    import torch.distributed as dist

    from shardkit.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, toggle in TOGGLES.items():
        for nested in (False, True):
            if name == "unfreeze":  # frozen at wrap time, as when fine-tuning a head later
                model = Net()
                model.proj.weight.requires_grad_(False)
            else:
                model = Net()
            wrapped = _wrap(model, nested)
            seen = _train(wrapped, rank, world, toggle)
            options = StateDictOptions(full_state_dict=True)  # full values, unwrapped names
            state = get_model_state_dict(wrapped, options=options)
            out[name, nested] = (seen, {k: v.numpy().copy() for k, v in state.items()})
    return out


def _plain(toggle, frozen_at_start):
    model = Net()
    if frozen_at_start:
        model.proj.weight.requires_grad_(False)
    seen = _train(model, 0, 1, toggle)
    return seen, model.state_dict()


@pytest.fixture(scope="module")
def requires_grad_runs():
    return run_ranks(_requires_grad_body, WORLD, timeout=150)


@pytest.mark.parametrize("nested", [False, True], ids=["one_unit", "nested"])
@pytest.mark.parametrize("name", sorted(TOGGLES))
def test_requires_grad_changed_after_wrapping_trains_like_plain(requires_grad_runs, name, nested):
    want_seen, want = _plain(TOGGLES[name], frozen_at_start=name == "unfreeze")
    # unfreeze: no gradient at step 0, one after; freeze: the reverse
    assert want_seen == ([True, False, False] if name == "unfreeze" else [False, True, True])
    for seen, got in (r[name, nested] for r in requires_grad_runs):
        assert seen == want_seen
        assert sorted(got) == sorted(want)
        for key in want:
            torch.testing.assert_close(
                torch.from_numpy(got[key]), want[key], rtol=1e-5, atol=1e-6, msg=key
            )


def _direct_calls_body():
    import torch.distributed as dist

    rank = dist.get_rank()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    plain = Net()
    with torch.no_grad():
        want = plain(x)
        want_block = plain.blocks[0](x)
    out = {}
    for nested in (False, True):
        model = Net()
        kept = model  # a reference kept from before wrapping
        wrapped = _wrap(model, nested)
        errors = []
        for call in (lambda m=wrapped: m.module(x), lambda m=kept: m(x)):
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - its classes are checked below
                errors.append((isinstance(exc, ValueError), isinstance(exc, RuntimeError), exc))
        with torch.no_grad():
            got = [wrapped.module(x), kept(x), wrapped(x)]
            # a nested unit's module, called directly once the root has run
            got_block = wrapped.module.blocks[0].module(x) if nested else None
        # training still matches plain after the direct calls (nothing left gathered)
        loss = wrapped(x).square().mean()
        loss.backward()
        out[nested] = {
            "errors": [(v, r, str(e)) for v, r, e in errors],
            "same": [torch.allclose(g, want, atol=1e-6) for g in got],
            "block": None if got_block is None else torch.allclose(got_block, want_block),
            "loss": loss.item(),
        }
    out["plain_loss"] = plain(x).square().mean().item()
    return out


def test_a_direct_call_gathers_without_autograd_and_is_refused_with_it():
    for res in run_ranks(_direct_calls_body, WORLD, timeout=150):
        for nested in (False, True):
            got = res[nested]
            assert len(got["errors"]) == 2, got  # model.module(x) and the kept reference
            for is_value, is_runtime, message in got["errors"]:
                assert is_value and is_runtime  # torch raises RuntimeError
                assert "called directly" in message and "torch.no_grad()" in message
            assert got["same"] == [True, True, True]
            assert got["block"] in (None, True)
            assert got["loss"] == pytest.approx(res["plain_loss"], rel=1e-6)


def _generate_body():
    import torch.distributed as dist
    from hf_models import build

    rank = dist.get_rank()
    prompt = torch.tensor([[1, 2, 3], [4 + rank, 5, 6]])  # differs per rank
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    torch.manual_seed(0)
    plain = build("gpt2").eval()
    want = plain.generate(prompt, **kwargs)
    out = {}
    for nested in (False, True):
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        from shardkit.fsdp import FSDP
        from shardkit.fsdp.wrap import transformer_auto_wrap_policy

        torch.manual_seed(0)
        model = build("gpt2").eval()
        if nested:
            policy = functools.partial(
                transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block}
            )
            model = FSDP(model, auto_wrap_policy=policy)
        else:
            model = FSDP(model)
        first = model.generate(prompt, **kwargs)  # before any forward of the wrapper
        ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(rank))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        again = model.module.generate(prompt, **kwargs)
        out[nested] = (torch.equal(first, want), torch.equal(again, want), loss.item())
    out["plain_loss"] = plain(input_ids=ids, labels=ids).loss.item()
    return out


def test_hf_generate_through_the_wrapper_matches_the_plain_model():
    pytest.importorskip("transformers")
    for res in run_ranks(_generate_body, WORLD, timeout=170):
        for nested in (False, True):
            first, again, loss = res[nested]
            assert first and again
            assert loss == pytest.approx(res["plain_loss"], rel=1e-5)


def _nested_misuse_body():
    x = torch.randn(2, 6)
    model = _wrap(Net(), nested=True)
    model(x).sum().backward()
    inner = model.module.blocks[0]
    caught = []
    for call in (lambda: inner.no_sync().__enter__(), lambda: inner.clip_grad_norm_(1.0)):
        try:
            call()
        except RuntimeError as exc:  # torch's class for both
            caught.append((isinstance(exc, ValueError), str(exc)))
    return caught


def test_no_sync_and_clip_on_a_nested_unit_raise_torchs_class():
    for caught in run_ranks(_nested_misuse_body, WORLD, timeout=90):
        assert [is_value for is_value, _ in caught] == [True, True]
        assert "outermost FSDP module" in caught[0][1] and "outermost" in caught[1][1]


def _clip_dtype_body():
    import torch.distributed as dist

    from shardkit.fsdp import FSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in (torch.float64, torch.bfloat16):
        torch.manual_seed(0)
        plain = nn.Linear(4, 3).to(dtype)
        model = FSDP(nn.Linear(4, 3).to(dtype).requires_grad_(True))
        model.load_state_dict({f"module.{k}": v for k, v in plain.state_dict().items()})
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).to(dtype)
        plain(x).float().square().mean().backward()
        n = len(x) // world
        model(x[rank * n : (rank + 1) * n]).float().square().mean().backward()
        want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        got = model.clip_grad_norm_(0.5)
        out[str(dtype)] = (str(got.dtype), str(want.dtype), got.item(), want.item())
    return out


def test_clip_grad_norm_returns_the_norm_in_the_gradients_dtype():
    """fp64 gradients gave a float32 norm (torch: float64, every digit kept)."""
    for res in run_ranks(_clip_dtype_body, WORLD, timeout=90):
        got_dtype, want_dtype, got, want = res["torch.float64"]
        assert got_dtype == want_dtype == "torch.float64"
        assert got == pytest.approx(want, rel=1e-12)
        got_dtype, want_dtype, got, want = res["torch.bfloat16"]
        assert got_dtype == want_dtype == "torch.bfloat16"
        assert got == pytest.approx(want, rel=2e-2)
