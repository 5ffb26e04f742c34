"""The SPMD op matrix: every sharding rule on a 2-D mesh with uneven shapes.

Each case is ``name -> (inputs, fn)``; an input is ``(shape, spec)`` for a float tensor
that requires grad, or ``(shape, spec, "idx", high)`` for integer indices. ``run_cases``
runs each case sharded and on plain tensors and reports the largest forward and
gradient errors, and whether every gradient came back sharded like its input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

D, M = "data", "model"
#: an additive padding mask (batch 2, broadcast over heads): the second sequence's first
#: two keys are padding
_PAD_MASK = torch.zeros(2, 1, 5, 5)
_PAD_MASK[1, :, :, :2] = float("-inf")

CASES = {
    # pointwise: broadcasting, scalars, plain tensors, mismatched specs, in-place
    "add_broadcast": ([((5, 7), (D, M)), ((7,), (M,))], lambda x, y: x + y),
    "mul_other_spec": ([((5, 7), (D, M)), ((5, 7), (M, None))], lambda x, y: x * y),
    "scalars_and_plain": (
        [((5, 7), (D, M))],
        lambda x: torch.where(x > 0, x * 2 + 1, torch.arange(7.0) - x) / 3,
    ),
    "unary_chain": (
        [((6, 5), (None, (D, M)))],
        lambda x: F.gelu(torch.tanh(x).exp() - x.sigmoid()),
    ),
    "inplace": (
        [((5, 7), (D, M)), ((5, 7), (D, None))],
        lambda x, y: (x * 1).add_(y).mul_(2).sub_(1.5).relu_(),
    ),
    # matrix products
    "mm_col_row": ([((5, 6), (None, M)), ((6, 7), (M, None))], lambda a, b: a @ b),
    "mm_row_col": ([((5, 6), (D, None)), ((6, 7), (None, M))], lambda a, b: torch.mm(a, b)),
    "mm_mixed": ([((5, 6), (M, D)), ((6, 7), (D, M))], lambda a, b: a @ b),
    "bmm": ([((3, 5, 6), (D, None, M)), ((3, 6, 4), (D, M, None))], torch.bmm),
    "linear_col": (
        [((5, 6), (D, None)), ((7, 6), (M, None)), ((7,), (M,))],
        lambda x, w, b: F.linear(x, w, b),
    ),
    "linear_row_bias": (
        [((5, 6), (D, M)), ((7, 6), (None, M)), ((7,), (None,))],
        lambda x, w, b: F.linear(x, w, b),
    ),
    "matmul_3d_2d": ([((2, 5, 6), (D, None, None)), ((6, 7), (None, M))], torch.matmul),
    "einsum_bij_jk": (
        [((3, 5, 6), (D, None, M)), ((6, 4), (M, None))],
        lambda a, b: torch.einsum("bij,jk->bik", a, b),
    ),
    "einsum_attention": (
        [((2, 3, 5, 4), (D, M, None, None)), ((2, 3, 5, 4), (D, M, None, None))],
        lambda q, k: torch.einsum("bhqd,bhkd->bhqk", q, k),
    ),
    # reductions
    "sum_all": ([((5, 7), (D, M))], lambda x: x.sum()),
    "sum_dim": ([((5, 7, 3), (D, M, None))], lambda x: x.sum(dim=1)),
    "mean_keepdim": ([((5, 7), (D, M))], lambda x: x.mean(dim=0, keepdim=True)),
    "mean_all": ([((5, 7), (M, D))], lambda x: x.mean()),
    "amax_dim": ([((5, 7), (D, M))], lambda x: x.amax(dim=1)),
    "max_all": ([((3, 7), (D, M))], lambda x: x.max()),
    "min_dim_values": ([((5, 7), (D, M))], lambda x: x.min(dim=1).values),
    "argmax_dim": ([((5, 7), (D, M))], lambda x: x.argmax(dim=1).float() + x.sum(1)),
    "norm_dim": ([((5, 7), (D, M))], lambda x: x.norm(dim=1)),
    "norm_all": ([((5, 7), (D, M))], lambda x: torch.linalg.vector_norm(x)),
    "norm_inf": ([((5, 7), (D, M))], lambda x: torch.linalg.vector_norm(x, float("inf"), dim=0)),
    # normalisations
    "softmax_sharded_dim": ([((5, 7), (D, M))], lambda x: torch.softmax(x, dim=1)),
    "log_softmax": ([((5, 7), (D, M))], lambda x: torch.log_softmax(x, dim=0)),
    "safe_softmax": ([((5, 7), (D, M))], lambda x: torch.ops.aten._safe_softmax(x, 1)),
    "layer_norm": (
        [((5, 3, 7), (D, None, M)), ((7,), (M,)), ((7,), (None,))],
        lambda x, w, b: F.layer_norm(x, (7,), w, b),
    ),
    "rms_norm": ([((5, 7), (D, M)), ((7,), (M,))], lambda x, w: F.rms_norm(x, (7,), w)),
    # embedding, dropout, cross entropy
    "embedding_dim_sharded": (
        [((11, 6), (None, M)), ((5, 3), (D, None), "idx", 11)],
        lambda w, i: F.embedding(i, w),
    ),
    "embedding_vocab_sharded": (
        [((11, 6), (M, None)), ((5, 3), (D, None), "idx", 11)],
        lambda w, i: F.embedding(i, w),
    ),
    "embedding_vocab_padding": (
        [((11, 6), (M, None)), ((5, 3), (D, None), "idx", 11)],
        lambda w, i: F.embedding(i, w, padding_idx=3),
    ),
    "cross_entropy_weighted": (
        [((6, 7), (D, M)), ((6,), (D,), "idx", 7)],
        lambda x, t: F.cross_entropy(
            x, torch.where(t == 2, 9, t), weight=torch.linspace(0.5, 2.0, 7), ignore_index=9
        ),
    ),
    "cross_entropy_none_vocab_sharded": (
        [((6, 7), (None, M)), ((6,), (None,), "idx", 7)],
        lambda x, t: F.cross_entropy(x, torch.where(t == 1, -100, t), reduction="none"),
    ),
    "dropout": ([((5, 7), (D, M))], lambda x: F.dropout(x, 0.4, training=True)),
    # the fused dropout accelerators run (CPU's F.dropout decomposes instead)
    "native_dropout": ([((5, 7), (D, M))], lambda x: torch.native_dropout(x, 0.4, True)[0]),
    # index_put: the backward of indexing (repeated rows accumulate), and written directly
    # (times a sharded w, so the gradient reaching index_put is sharded too)
    "index_backward_repeats": (
        [((6, 7), (D, M)), ((7,), (M,)), ((5,), (None,), "idx", 6)],
        lambda x, w, i: x[torch.cat([i, i[:2]])] * w,
    ),
    "index_put_accumulate": (
        [((6, 7), (D, M)), ((5, 7), (None, M)), ((5,), (None,), "idx", 6)],
        lambda x, v, i: x.index_put((i,), v, accumulate=True),
    ),
    "index_put_pending_values": (
        [((6, 4), (None, M)), ((4, 7), (M, D)), ((3,), (None,), "idx", 6)],
        lambda a, b, i: torch.zeros(6, 7).index_put((i,), a[i] @ b, accumulate=True),
    ),
    "index_put_two_dims": (
        [((4, 5, 3), (D, None, M)), ((2, 3), (None, M))],
        lambda x, v: x.index_put((torch.tensor([0, 3]), torch.tensor([4, 1])), v),
    ),
    "index_put_inplace": (
        [((6, 7), (D, M)), ((7,), (M,))],
        lambda x, v: (x * 1).index_put_((torch.tensor([1, 4]),), v),
    ),
    "cross_entropy_mean": (
        [((5, 7), (D, M)), ((5,), (D,), "idx", 7)],
        lambda x, t: F.cross_entropy(x, t),
    ),
    "cross_entropy_sum_ignore": (
        [((6, 7), (D, None)), ((6,), (D,), "idx", 7)],
        lambda x, t: F.cross_entropy(x, torch.where(t == 2, -100, t), reduction="sum"),
    ),
    "sdpa_causal": (
        [
            ((2, 3, 5, 4), (D, M, None, None)),
            ((2, 3, 5, 4), (D, None, None, None)),
            ((2, 3, 5, 4), (None, M, None, None)),
        ],
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    ),
    # views and joins
    "view_flatten_even": ([((4, 3, 5), (D, M, None))], lambda x: x.reshape(12, 5)),
    "view_uneven": ([((5, 3, 2), (D, None, M))], lambda x: x.reshape(5, 6)),
    "view_split_dim": ([((6, 7), (D, M))], lambda x: x.view(2, 3, 7)),
    "flatten": ([((3, 4, 5), (D, M, None))], lambda x: torch.flatten(x, 1)),
    "transpose_permute": (
        [((3, 4, 5), (D, M, None))],
        lambda x: x.transpose(0, 2).permute(1, 0, 2) * 2,
    ),
    "squeeze_unsqueeze": ([((5, 1, 7), (D, None, M))], lambda x: x.squeeze(1).unsqueeze(0) + 1),
    "slicing": ([((5, 7), (D, M))], lambda x: x[1:4, 2:6] * 3),
    "select": ([((5, 7), (D, M))], lambda x: x[:, 3].sum() + x[2]),
    "cat": (
        [((5, 7), (D, M)), ((3, 7), (None, M))],
        lambda x, y: torch.cat([x, y], dim=0),
    ),
    "stack": ([((5, 7), (D, M)), ((5, 7), (D, None))], lambda x, y: torch.stack([x, y], 1)),
    "split_chunk": (
        [((7, 6), (D, M))],
        lambda x: (
            torch.cat([a * (i + 1) for i, a in enumerate(x.split(3, dim=0))], 0)
            + torch.cat([c * 2 for c in x.chunk(2, dim=1)], 1)
        ),
    ),
    # padding (label shift), advanced indexing (HF mask building), KV-cache cat
    "pad_sharded_dim": ([((5, 7), (D, M))], lambda x: F.pad(x, (1, 2)) * 2),
    "pad_other_dim": ([((5, 7), (D, None))], lambda x: F.pad(x, (0, 1), value=-1.0)),
    "index_local_reads": (
        [((5, 7), (D, M)), ((5, 7), (D, M), "idx", 2)],
        lambda x, m: x * m[torch.arange(5).view(5, 1, 1), torch.arange(7).view(1, 1, 7)][:, 0],
    ),
    "index_rows_moved": (
        [((5, 7), (D, M)), ((5, 7), (D, M), "idx", 3)],
        lambda x, m: x + m[torch.tensor([4, 3, 2, 1, 0])],
    ),
    "cat_empty_kv_cache": (
        [((2, 3, 5, 4), (D, M, None, None))],
        lambda k: torch.cat([torch.empty(0), k], dim=-2) * 2,
    ),
    "all_any": (
        [((5, 7), (D, M))],
        lambda x: torch.where((x > -3).all(dim=1, keepdim=True), x, -x) + (x > 2).any().float(),
    ),
    "pending_times_tensor": (
        [((5, 6), (None, M)), ((6, 7), (M, None)), ((5, 7), (D, None))],
        lambda a, b, t: (a @ b) * t,
    ),
    # attention: a padding mask (sliced like the batch), eager attention's 4-D matmul
    "sdpa_padding_mask": (
        [((2, 4, 5, 3), (D, M, None, None))] * 3,
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_PAD_MASK),
    ),
    "matmul_4d_heads": (
        [((2, 4, 5, 3), (None, M, None, None)), ((2, 4, 3, 5), (None, M, None, None))],
        torch.matmul,
    ),
    "matmul_4d_batch_heads": (
        [((4, 4, 5, 3), (D, M, None, None)), ((4, 4, 3, 5), (D, M, None, None))],
        lambda a, b: torch.softmax(a @ b, -1) @ a,
    ),
    "flatten_heads_is_the_output": (
        [((2, 4, 5, 3), (None, M, None, None))],
        lambda x: x.reshape(8, 5, 3),
    ),
    "flatten_heads_then_other_op": (
        [((2, 4, 5, 3), (None, M, None, None))],
        lambda x: x.reshape(8, 5, 3).exp(),
    ),
}


def _make(spec_entry, generator):
    shape, spec = spec_entry[0], spec_entry[1]
    if len(spec_entry) > 2:
        return torch.randint(0, spec_entry[3], shape, generator=generator), spec, False
    return torch.randn(shape, generator=generator), spec, True


def _err(a, b) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max())


def run_case(mesh, name):
    """(forward error, max gradient error, gradients sharded like their inputs)."""
    import shardkit.spmd as xs

    inputs, fn = CASES[name]
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    made = [_make(e, gen) for e in inputs]
    refs = [t.clone().requires_grad_(g) for t, _, g in made]
    torch.manual_seed(7)
    ref_out = fn(*refs)
    cot = torch.randn(ref_out.shape, generator=gen)
    (ref_out * cot).sum().backward()

    leaves = [t.clone().requires_grad_(g) for t, _, g in made]
    sts = [xs.mark_sharding(t, mesh, spec) for t, (_, spec, _) in zip(leaves, made)]
    torch.manual_seed(7)
    with xs.count_collectives() as fwd_counts:
        out = fn(*sts)
    fwd = _err(out.full_tensor(), ref_out.detach())
    with xs.count_collectives() as counts:
        (out * cot).sum().full_tensor().backward()
    grad_err, layout_ok = 0.0, True
    for st, ref, (_, _, g) in zip(sts, refs, made):
        if not g:
            continue
        grad = st.grad
        layout_ok &= isinstance(grad, xs.ShardedTensor) and grad.placement == st.placement
        grad_err = max(grad_err, _err(grad.full_tensor(), ref.grad))
    return fwd, grad_err, layout_ok, dict(counts.fallbacks + fwd_counts.fallbacks)


def run_cases(names, mesh_shape=(2, 2)):
    import numpy as np

    import shardkit.runtime as xr
    import shardkit.spmd as xs

    mesh = xs.Mesh(np.arange(xr.world_size()), mesh_shape, (D, M))
    results = {}
    for name in names:
        try:
            results[name] = run_case(mesh, name)
        except Exception as exc:  # report per case, keep the others running
            results[name] = f"{type(exc).__name__}: {exc}"
    return results, dict(xs.fallback_counts())


def _mesh(mesh_shape):
    import numpy as np

    import shardkit.runtime as xr
    import shardkit.spmd as xs

    return xs.Mesh(np.arange(xr.world_size()), mesh_shape, (D, M))


def run_optimizers(mesh_shape=(2, 2)):
    """Max parameter error after 3 steps of each optimizer, sharded vs plain, and whether
    the steps ran without any collective or fallback beyond the forward's."""
    import shardkit.spmd as xs

    mesh = _mesh(mesh_shape)
    specs = {"w1": (M, None), "b1": (M,), "w2": (None, M)}
    gen = torch.Generator().manual_seed(3)
    init = {"w1": torch.randn(7, 6, generator=gen), "b1": torch.randn(7, generator=gen)}
    init["w2"] = torch.randn(5, 7, generator=gen)
    x = torch.randn(4, 6, generator=gen)
    makers = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
        "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    }
    results = {}
    for name, make in makers.items():
        ref = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
        shd = {
            k: xs.mark_sharding(torch.nn.Parameter(v.clone()), mesh, specs[k])
            for k, v in init.items()
        }
        step_comm = 0
        for params in (ref, shd):
            opt = make(list(params.values()))
            for _ in range(3):
                h = F.linear(x, params["w1"], params["b1"]).relu()
                loss = F.linear(h, params["w2"]).square().mean()
                if isinstance(loss, xs.ShardedTensor):
                    loss = loss.full_tensor()
                loss.backward()
                with xs.count_collectives() as counts:
                    opt.step()
                step_comm += counts.total_calls() + sum(counts.fallbacks.values())
                opt.zero_grad()
        err = max(_err(shd[k].full_tensor(), ref[k]) for k in init)
        placed = all(shd[k].partition_spec == specs[k] for k in init)
        results[name] = (err, placed, step_comm)
    return results


def run_mlp_comm(mesh_shape=(2, 2)):
    """Collectives of a Megatron MLP forward, before and when its output is needed."""
    import shardkit.spmd as xs

    mesh = _mesh(mesh_shape)
    gen = torch.Generator().manual_seed(5)
    w1, b1 = torch.randn(16, 6, generator=gen), torch.randn(16, generator=gen)
    w2, b2 = torch.randn(6, 16, generator=gen), torch.randn(6, generator=gen)
    x = torch.randn(8, 6, generator=gen)
    ref = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    sx = xs.mark_sharding(x, mesh, (D, None))
    sw1, sb1 = xs.mark_sharding(w1, mesh, (M, None)), xs.mark_sharding(b1, mesh, (M,))
    sw2, sb2 = xs.mark_sharding(w2, mesh, (None, M)), xs.mark_sharding(b2, mesh, (None,))
    with xs.count_collectives() as lazy:
        y = F.linear(F.gelu(F.linear(sx, sw1, sb1)), sw2, sb2)
    with xs.count_collectives() as resolved:
        out = y.redistribute((D, None))
    err = _err(out.full_tensor(), ref)
    return (
        err,
        dict(lazy.calls),
        dict(resolved.calls),
        dict(resolved.bytes),
        out.local_tensor().numel() * 4,
    )


def run_fallback_ops(mesh_shape=(2, 2)):
    """unique / nonzero / svd through the gather fallback: exact vs torch, and counted."""
    import shardkit.spmd as xs

    mesh = _mesh(mesh_shape)
    gen = torch.Generator().manual_seed(9)
    x = torch.randint(0, 4, (5, 7), generator=gen).float()
    a = torch.randn(5, 3, generator=gen)
    sx, sa = xs.mark_sharding(x, mesh, (D, M)), xs.mark_sharding(a, mesh, (M, D))
    with xs.count_collectives() as counts:
        checks = {
            "unique": torch.equal(torch.unique(sx).full_tensor(), torch.unique(x)),
            "nonzero": torch.equal(torch.nonzero(sx).full_tensor(), torch.nonzero(x)),
        }
        u, s, vh = torch.linalg.svd(sa, full_matrices=False)
        ru, rs, rvh = torch.linalg.svd(a, full_matrices=False)
        checks["svd"] = all(
            torch.allclose(p.full_tensor(), q, atol=1e-5) for p, q in ((u, ru), (s, rs), (vh, rvh))
        )
    return checks, dict(counts.fallbacks)


def run_clip_grad_norm(mesh_shape=(2, 2)):
    """clip_grad_norm_ over sharded gradients: the norm, the clipped grads and layouts."""
    import copy

    import shardkit.spmd as xs

    mesh = _mesh(mesh_shape)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 5))
    model = copy.deepcopy(ref)
    specs = {"0.weight": (M, None), "0.bias": (M,), "2.weight": (None, M), "2.bias": (None,)}
    for name, spec in specs.items():
        idx, leaf = name.split(".")
        setattr(model[int(idx)], leaf, xs.mark_sharding(getattr(model[int(idx)], leaf), mesh, spec))
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(7, 6, generator=gen), torch.randint(0, 5, (7,), generator=gen)
    F.cross_entropy(ref(x), y).backward()
    sx, sy = xs.mark_sharding(x, mesh, (D, None)), xs.mark_sharding(y, mesh, (D,))
    F.cross_entropy(model(sx), sy).full_tensor().backward()
    with xs.count_collectives() as counts:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    grad_err = max(
        _err(p.grad.full_tensor(), q.grad) for p, q in zip(model.parameters(), ref.parameters())
    )
    layouts = all(p.grad.placement == p.placement for p in model.parameters())
    return (
        abs(norm.full_tensor().item() - ref_norm.item()),
        grad_err,
        layouts,
        dict(counts.fallbacks),
    )


def run_reduce_scatter(mesh_shape=(2, 2)):
    """A sum pending over 'data' wanted sharded over 'data' (uneven rows) resolves by one
    reduce-scatter; wanted replicated, by one all-reduce."""
    import shardkit.spmd as xs

    mesh = _mesh(mesh_shape)
    x = torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(6))
    sx = xs.mark_sharding(x, mesh, (D, None, M))
    with xs.count_collectives() as scatter:
        sharded = sx.sum(0).redistribute((D, M))
    with xs.count_collectives() as reduce:
        replicated = sx.sum(0).redistribute((None, M))
    return (
        _err(sharded.full_tensor(), x.sum(0)),
        _err(replicated.full_tensor(), x.sum(0)),
        dict(scatter.calls),
        dict(reduce.calls),
    )


def run_pending_sum_pointwise(mesh_shape=(2, 2)):
    """A replicated tensor combined with a sum pending over 'data', out of place and in
    place: values against torch, and a view of the in-place target reads the same."""
    import shardkit.spmd as xs

    mesh = _mesh(mesh_shape)
    gen = torch.Generator().manual_seed(8)
    x, r = torch.randn(4, 6, 3, generator=gen), torch.randn(6, 3, generator=gen)
    sx = xs.mark_sharding(x, mesh, (D, None, None))
    errors = {}
    for name, fn in {
        "r + P": lambda a, p: a + p,
        "P + r": lambda a, p: p + a,
        "r - P": lambda a, p: a - p,
        "r.add_(P)": lambda a, p: a.add_(p),
        "r.sub_(P)": lambda a, p: a.sub_(p),
        "r.add_(P, alpha=2)": lambda a, p: a.add_(p, alpha=2),
    }.items():
        pending = sx.sum(0)  # a sum pending over 'data'
        assert pending._placement.partial, "the case needs a pending sum"
        sr = xs.mark_sharding(r.clone(), mesh, (None, None))
        view = sr.view(18)
        got = fn(sr, pending)
        want = fn(r.clone(), x.sum(0))
        errors[name] = _err(got.full_tensor(), want)
        if "_" in name:
            errors[name + " (view)"] = _err(view.full_tensor(), want.reshape(18))
    return errors


#: cases whose rules must not communicate at all, forward and backward
LOCAL_CASES = (
    "matmul_4d_heads",
    "matmul_4d_batch_heads",
    "sdpa_padding_mask",
    "cat_empty_kv_cache",
    "index_local_reads",
    "pad_other_dim",
)


def run_local_comm(mesh_shape=(2, 2)):
    """Collectives (forward + backward) of the cases that must run on local shards only."""
    import shardkit.spmd as xs

    mesh = _mesh(mesh_shape)
    out = {}
    for name in LOCAL_CASES:
        inputs, fn = CASES[name]
        gen = torch.Generator().manual_seed(4)
        made = [_make(e, gen) for e in inputs]
        sts = [xs.mark_sharding(t.requires_grad_(g), mesh, spec) for t, spec, g in made]
        with xs.count_collectives() as counts:
            y = fn(*sts)
            y.sum().backward()
        out[name] = (dict(counts.calls), dict(counts.fallbacks))
    return out
