"""FullyShardedDataParallel: per-parameter dim-0 sharding with ZeRO-3 / ZeRO-2 units."""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .. import runtime
from . import _direct_call
from ._build import prepare_buffers, shard_parameters, step_options, verify_same_parameters
from ._comm import group_info
from ._direct_call import install_direct_call_hooks
from ._hf import guard_save_pretrained
from ._meta import FSDPUsageError, materialize_meta, replaced_after_wrapping, uses_checkpointing
from ._options import FSDPOptions, cast_floats
from ._rows import describe_rows, install_optimizer_hooks, row_entries, split_rows
from ._state import (
    clip_grad_norm,
    load_sharded_state_dict,
    param_fqns,
    shard_metadata,
    sharded_state_dict,
    with_wrapper_names,
)
from ._torch_only import TORCH_FSDP_ONLY
from ._unit import UnitState
from ._wrap import auto_wrap
from ._xla_knobs import check_xla_knobs

__all__ = ["FullyShardedDataParallel", "FSDP", "XlaFullyShardedDataParallel"]


#: True while an FSDP constructor auto-wraps children: it checked their parameters
#: across the ranks already (verify_same_parameters over the whole module)
_CHECKED_BY_PARENT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "shardkit_fsdp_checked_by_parent", default=False
)


class _AllGather(torch.autograd.Function):
    """Shards in, full parameters out; its backward is the unit's post-backward."""

    @staticmethod
    def forward(ctx, unit, *shards):
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        outs = tuple(f.view_as(f) for f in unit._state.fulls())
        frozen = [o for o, s in zip(outs, shards) if not s.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit._post_backward(grads)
        return (None,) * (1 + len(grads))


class FullyShardedDataParallel(nn.Module):
    """Shard a module's parameters, gradients and optimizer state over the ranks.

    Each parameter is split along dim 0 like :func:`torch.chunk`; the ``nn.Parameter``
    objects the optimizer sees are this rank's rows, so any torch optimizer works
    unchanged and its state is sharded too. A unit (this wrapper, or each nested /
    auto-wrapped one) all-gathers its parameters before its forward and reduce-scatters
    its gradients (averaged over ranks) during backward.

    Args:
        module: the module to shard; its parameters are replaced by their shards.
        process_group: ranks to shard over (default: the whole world).
        reshard_after_forward: ``True`` is ZeRO-3 (free full parameters after forward,
            gather again for backward); ``False`` is ZeRO-2 (keep them until backward).
            The root unit keeps its own parameters through forward either way.
        flatten_parameters: accepted for API compatibility; only ``False`` is supported.
        auto_wrap_policy: ``policy(module, recurse, nonwrapped_numel) -> bool`` deciding
            which submodules become their own units (see :mod:`shardkit.fsdp.wrap`).
        auto_wrapper_callable: ``fn(module, **fsdp_kwargs)`` building each auto-wrapped
            unit, e.g. ``lambda m, **kw: FSDP(checkpoint_module(m), **kw)``.
        compute_dtype: dtype of gathered parameters and of forward / backward compute
            (bf16 or fp16 for mixed precision); shards stay in their own dtype.
        buffer_dtype: dtype floating buffers are cast to; by default (``None``) they keep
            their own dtype, as FSDP2 and autocast do (e.g. RoPE's fp32 ``inv_freq``).
        fp32_reduce_scatter: reduce gradients in fp32 rather than ``compute_dtype``.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
            Without it each rank keeps its own rows, so every rank must hold the same
            values (same seed); a cheap fingerprint warns when they differ. Parameter
            names, order, shapes, dtypes and requires_grad are always checked across
            the ranks (``ModelMismatchError``, docs/fsdp.md).
        forward_prefetch / backward_prefetch: issue the next unit's all-gather early.
        param_init_fn: ``fn(module)`` run on each module holding meta-device tensors
            before sharding; without it such modules get empty CPU storage and their
            ``reset_parameters()`` (see docs/fsdp.md, deferred initialization).
        **xla_options: torch_xla's XLA-only keywords, accepted by the rule in
            docs/fsdp.md (no effect, one warning for a non-default value; those that
            would change results are refused).

    ``state_dict()`` values of sharded parameters are ShardedTensors holding this
    rank's rows; see :meth:`state_dict`.
    """

    _shardkit_wrapper = True
    #: DistributedDataParallel refuses to wrap it: its parameters are shards
    _shardkit_sharded = True
    _shardkit_fsdp_unit = True

    def __init__(
        self,
        module: nn.Module,
        reshard_after_forward: bool = True,
        *,
        process_group: Any = None,
        flatten_parameters: bool = False,
        auto_wrap_policy: Callable | None = None,
        auto_wrapper_callable: Callable | None = None,
        compute_dtype: torch.dtype | None = None,
        buffer_dtype: torch.dtype | None = None,
        fp32_reduce_scatter: bool = False,
        sync_module_states: bool = False,
        forward_prefetch: bool = True,
        backward_prefetch: bool = True,
        param_init_fn: Callable | None = None,
        **xla_options: Any,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        if isinstance(module, FullyShardedDataParallel):
            raise FSDPUsageError(
                "the module is already FSDP-wrapped; wrap the inner module once (for nested "
                "FSDP, wrap the children first, then the parent)"
            )
        _refuse_torch_sharded(module)
        install_optimizer_hooks()
        opts = FSDPOptions(
            process_group=process_group,
            reshard_after_forward=reshard_after_forward,
            flatten_parameters=flatten_parameters,
            auto_wrap_policy=auto_wrap_policy,
            auto_wrapper_callable=auto_wrapper_callable,
            compute_dtype=compute_dtype,
            buffer_dtype=buffer_dtype,
            fp32_reduce_scatter=fp32_reduce_scatter,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch,
            param_init_fn=param_init_fn,
        )
        self._opts = opts
        runtime.init()  # join the world the environment describes (torchrun, SLURM)
        self._group, self.rank, self.world_size = group_info(process_group)
        check_xla_knobs(xla_options, rank=self.rank, world=self.world_size)
        if not _CHECKED_BY_PARENT.get():
            # before any collective: every unit an auto-wrap makes below is covered by
            # this one check (one all-reduce per wrap, not one per unit)
            verify_same_parameters(
                module,
                self._group,
                self.world_size,
                values=not opts.sync_module_states,
                options=step_options(opts),
            )
        if opts.auto_wrap_policy is not None:
            wrapper = opts.auto_wrapper_callable or (lambda m, **kw: type(self)(m, **kw))
            token = _CHECKED_BY_PARENT.set(True)
            try:
                auto_wrap(module, opts.auto_wrap_policy, wrapper, opts.for_child(), type(self))
            finally:
                _CHECKED_BY_PARENT.reset(token)
        materialize_meta(module, opts.param_init_fn)
        self.module = module
        guard_save_pretrained(module)  # HF models: never write local shards silently
        for inner in module.modules():
            if isinstance(inner, FullyShardedDataParallel):
                inner._nested = True  # its state_dict() values are described by the root
        prepare_buffers(module, opts, self._group, self.world_size)
        params = shard_parameters(module, opts, self._group, self.rank, self.world_size)
        self._state = UnitState(
            params,
            group=self._group,
            rank=self.rank,
            world=self.world_size,
            compute_dtype=opts.compute_dtype,
            fp32_reduce_scatter=opts.fp32_reduce_scatter,
        )
        self._has_checkpointed = uses_checkpointing(module)
        self._nested = False
        self._is_root: bool | None = None
        self.__dict__["_root"] = self  # not a submodule: no cycle in the module tree
        self._uses = 0  # gathers of this iteration whose backward has not run yet
        # the tensors the last tracked forward installed; backward puts them back so a
        # recomputation (checkpoint_module, HF gradient checkpointing) reads full values
        self._fulls: tuple | None = None
        # root-only bookkeeping
        self._units: list[FullyShardedDataParallel] = []
        self._order: list[FullyShardedDataParallel] = []
        self._recording = True
        self._callback_queued = False
        self._sync_grads = True
        self._pending_reduces: deque = deque()
        self._meta_checked = False
        self._full_installed = False  # the wrapped module holds full parameters now
        self._direct_call = None  # the module whose direct call gathered the parameters
        install_direct_call_hooks(self)
        self.register_load_state_dict_post_hook(self._drop_refused_keys)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            module = self._modules["module"]
            if name in TORCH_FSDP_ONLY and not hasattr(module, name):
                raise AttributeError(
                    f"shardkit's FSDP has no {name}() (torch FSDP's): {TORCH_FSDP_ONLY[name]}; "
                    "see docs/migrating.md"
                ) from None
            return getattr(module, name)

    def __getitem__(self, key: int) -> Any:
        """Index the wrapped module (a wrapped ``nn.Sequential``), as torch_xla's FSDP."""
        return self._modules["module"].__getitem__(key)

    @property
    def params_with_grad(self) -> list[nn.Parameter]:
        """This rank's parameter shards that have a gradient (torch_xla's property)."""
        return [p for p in self.parameters() if p.grad is not None]

    # -- root ------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self._is_root is not None:
            return
        self._is_root = True
        self._units = [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]
        for unit in self._units:
            if unit is not self:
                if unit._is_root:
                    raise FSDPUsageError(
                        "a nested FSDP unit already ran forward on its own; run forward "
                        "through the outermost FSDP module only"
                    )
                unit._is_root = False
                unit.__dict__["_root"] = self
        for unit in self._units:  # torch's apply_activation_checkpointing may come late
            unit._has_checkpointed = uses_checkpointing(unit.module)
        self._state.is_root = True

    def _neighbour(self, unit: FullyShardedDataParallel, step: int):
        order = self._order
        try:
            index = order.index(unit) + step
        except ValueError:
            return None
        return order[index] if 0 <= index < len(order) else None

    # -- forward ---------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._lazy_init()
        root = self._root
        if self._is_root:
            self._start_root_call()
        elif root._recording and self not in root._order:
            root._order.append(self)
        args, kwargs = cast_floats((args, kwargs), self._opts.compute_dtype)
        self._state.refresh_trainable()  # requires_grad may have changed since wrapping
        track = torch.is_grad_enabled() and any(p.shard.requires_grad for p in self._state.params)
        self._pre_forward(track)
        try:
            out = self.module(*args, **kwargs)
        finally:
            self._restore_shards()
        hooked = self._hook_outputs(out) if torch.is_grad_enabled() else False
        if not torch.is_grad_enabled():
            if not self._is_root:
                self._state.free()
        elif self._opts.reshard_after_forward and not self._is_root and hooked:
            self._state.free()
        if self._is_root:
            root._recording = False
            if not torch.is_grad_enabled():
                for unit in root._units:
                    unit._state.free()
        return out

    def _start_root_call(self) -> None:
        """A new iteration begins at the root: nothing gathered may outlive an optimizer
        step, and the first call records the units' order (for prefetching)."""
        if not self._meta_checked:
            _check_not_meta(self)
            self._meta_checked = True
        self._recording = not self._order
        # a forward without autograd (targets or a teacher computed with this model
        # between a forward and its backward) leaves that backward's bookkeeping alone
        new_iteration = torch.is_grad_enabled()
        for unit in self._units:
            if new_iteration:
                unit._uses = 0
                unit._fulls = None
            unit._direct_call = None
            unit._restore_shards()
            unit._state.free()
        if self._recording:
            self._order.append(self)

    def _direct_call_pre_hook(self, module, args, kwargs):
        return _direct_call.pre_hook(self, module, args, kwargs)

    def _direct_call_post_hook(self, module, args, output) -> None:
        _direct_call.post_hook(self, module)

    def _pre_forward(self, track: bool) -> None:
        state = self._state
        state.ensure_gathered()
        root = self._root
        if root._opts.forward_prefetch:
            nxt = root._neighbour(self, 1)
            if nxt is not None and not nxt._state.materialized:
                nxt._state.issue_gather()
        if not state.params:
            return
        if track:
            self._uses += 1
            fulls = _AllGather.apply(self, *[p.shard for p in state.params])
            self._fulls = fulls
        else:
            fulls = state.fulls()
        self._install(fulls, full=True)

    def _install(self, tensors, *, full: bool) -> None:
        tensors = list(tensors)
        before = self.__dict__.get("_installed") or [None] * len(tensors)
        for p, t, last in zip(self._state.params, tensors, before):
            for mod, name in p.owners:
                current = mod._parameters.get(name)
                if current is not last and current is not p.shard:
                    replaced_after_wrapping(p, mod, name)
                mod._parameters[name] = t
        self.__dict__["_installed"] = tensors  # what a later install expects to find
        self._full_installed = full

    def _restore_shards(self) -> None:
        self._install([p.shard for p in self._state.params], full=False)

    def _hook_outputs(self, out: Any) -> bool:
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        hooked = False
        for t in tensors:
            if t.requires_grad:
                t.register_hook(self._pre_backward_hook)
                hooked = True
        return hooked

    # -- backward --------------------------------------------------------------------
    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        self._pre_backward()

    def _queue_finalize(self) -> None:
        root = self._root
        if not root._callback_queued:
            root._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root._finalize_backward)

    def _pre_backward(self) -> None:
        root = self._root
        self._queue_finalize()
        state = self._state
        if not state.params:
            return
        state.ensure_gathered()
        if self._fulls is not None:
            # an activation recomputation (ours or HF's gradient_checkpointing_enable(),
            # reentrant or not) reads module attributes: give it the full parameters of
            # forward, whose gradients flow into this unit's reduce-scatter
            self._install(self._fulls, full=True)
        if root._opts.backward_prefetch:
            prev = root._neighbour(self, -1)
            if prev is not None and prev._uses > 0 and not prev._state.materialized:
                prev._state.issue_gather()

    def _post_backward(self, grads) -> None:
        root = self._root
        self._queue_finalize()  # also when no output hook ran (outputs pytree cannot see)
        state = self._state
        self._uses = max(self._uses - 1, 0)
        if state.trainable:
            if root._sync_grads:
                pending = state.reduce_grads(grads)
                if pending is not None:
                    root._pending_reduces.append(pending)
                while len(root._pending_reduces) > 1:
                    root._pending_reduces.popleft().finish()
            else:
                state.accumulate(grads)
        if self._uses == 0:
            self._fulls = None
            self._restore_shards()
            state.free()

    def _finalize_backward(self) -> None:
        """Run once at the end of each backward: land gradients, free every unit."""
        while self._pending_reduces:
            self._pending_reduces.popleft().finish()
        for unit in self._units:
            if unit._uses == 0:
                unit._fulls = None
                unit._restore_shards()
                unit._state.free()
        self._callback_queued = False

    # -- public API --------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (unsharded) without communication.

        The next backward outside the block reduce-scatters the sum of every
        micro-batch's gradient, as DDP's ``no_sync`` does. Costs full-size gradient
        memory for the units that accumulate.
        """
        self._lazy_init()
        if not self._is_root:
            raise FSDPUsageError("call no_sync() on the outermost FSDP module")
        previous = self._sync_grads
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = previous

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """FSDP2's switch for gradient accumulation: ``False`` acts as inside
        :meth:`no_sync` until it is set back to ``True``.

        Args:
            requires_gradient_sync: reduce-scatter gradients in backward (the default).
            recurse: accepted for FSDP2's signature; the switch covers the whole model.
        """
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(
                f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}"
            )
        self._lazy_init()
        if not self._is_root:
            raise FSDPUsageError("call set_requires_gradient_sync() on the outermost FSDP module")
        self._sync_grads = requires_gradient_sync

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every shard by the global norm over all ranks; return it."""
        return clip_grad_norm(self, max_norm, norm_type)

    # -- state dicts ----------------------------------------------------------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Like ``nn.Module.state_dict``, sharded parameters as :class:`ShardedTensor` rows.

        Each sharded parameter's value holds this rank's rows (the live shard) and knows
        the global shape and its offsets, so ``shardkit.checkpoint.save`` /
        ``CheckpointManager`` store every rank's rows and reshard on load; ``torch.save``
        writes just the local rows. Buffers and 0-d parameters stay plain (replicated).
        """
        if args:  # torch's deprecated positional form: (destination, prefix, keep_vars)
            given = {"destination": destination, "prefix": prefix, "keep_vars": keep_vars}
            given.update(zip(("destination", "prefix", "keep_vars"), args))
            destination, prefix, keep_vars = given.values()
        out = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if not keep_vars and not self._nested:
            describe_rows(self, out, prefix)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; keys may also lack the wrapper's names.

        This wrapper's keys carry ``module.``; torch FSDP1's and a plain model's do not.
        Both load, full tensors or this rank's rows (a plain ``strict=False`` load of
        FSDP1 names would otherwise load nothing, silently).
        """
        if not self._nested and isinstance(state_dict, Mapping):
            state_dict = with_wrapper_names(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        if not self._nested:
            bad = split_rows(state_dict, row_entries(self, prefix), self.rank)
            errors.extend(bad.values())
            self.__dict__["_refused_keys"] = set(bad)  # not missing: see _drop_refused_keys
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )

    @staticmethod
    def _drop_refused_keys(unit, incompatible) -> None:
        """Load post-hook: a key refused for its size was given, so it is not missing."""
        refused = unit.__dict__.pop("_refused_keys", set())
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in refused]

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._adopt_params()
        return out

    def _adopt_params(self) -> None:
        """After ``to_empty`` / ``to``: make the parameters torch put in place the shards."""
        state = self._state
        for mp in state.params:
            mod, name = mp.owners[0]
            current = mod._parameters.get(name)
            if current is None or current is mp.shard:
                continue
            current._shardkit_fsdp_shard = True
            current._shardkit_fsdp_rows = mp.shard._shardkit_fsdp_rows
            for m, n in mp.owners:  # torch's _apply unties shared parameters: tie again
                m._parameters[n] = current
            mp.shard, mp.full = current, None
        if not state.gathered:  # device or dtype may have changed: gather into new tensors
            for mp in state.params:
                mp.full = None
        if state.params:
            state.device = state.params[0].shard.device
            if self._opts.compute_dtype is None:
                state.compute_dtype = state.params[0].shard.dtype
                if not self._opts.fp32_reduce_scatter:
                    state.reduce_dtype = state.compute_dtype
        self._root._meta_checked = False

    def get_shard_metadata(self) -> dict:
        """Describe this rank's shards so per-rank checkpoints can be consolidated.

        Only plain containers, ``str`` and ``int``: it loads with ``weights_only=True``.
        """
        return shard_metadata(self)

    def _shardkit_sharded_state_dict(self) -> dict:
        """Checkpoint protocol: unwrapped FQN -> ShardedTensor (see docs/architecture.md)."""
        return sharded_state_dict(self)

    def _shardkit_load_sharded_state_dict(self, state: dict) -> None:
        """Checkpoint protocol: copy sharded or full values into the shards, in place."""
        load_sharded_state_dict(self, state)

    def _shardkit_param_fqns(self) -> dict[int, str]:
        """Checkpoint protocol: ``id(shard parameter)`` -> unwrapped FQN."""
        return param_fqns(self)

    def extra_repr(self) -> str:
        mode = "ZeRO-3" if self._opts.reshard_after_forward else "ZeRO-2"
        return f"{mode}, world_size={self.world_size}, params={len(self._state.params)}"


def _check_not_meta(root) -> None:
    for unit in root._units:
        for mp in unit._state.params:
            if mp.shard.is_meta:
                raise FSDPUsageError(
                    f"FSDP parameter {mp.fqns[0]!r} is on the meta device; call "
                    "model.to_empty(device='cpu') and initialize it (reset_parameters()), or "
                    "pass param_init_fn to FSDP"
                )


FSDP = FullyShardedDataParallel
XlaFullyShardedDataParallel = FullyShardedDataParallel


def _refuse_torch_sharded(module: nn.Module) -> None:
    """FSDPUsageError if torch already shards ``module``: its FSDP2 (``fully_shard``) or
    FSDP1 wrapper, or DTensor parameters. Sharding those again would fail later, at the
    first forward, with an error about mixed tensor types."""
    from torch.distributed.tensor import DTensor

    torch_fsdp = sys.modules.get("torch.distributed.fsdp")  # loaded if the user used it
    kinds = (torch_fsdp.FSDPModule, torch_fsdp.FullyShardedDataParallel) if torch_fsdp else ()
    for name, sub in module.named_modules():
        if kinds and isinstance(sub, kinds):
            where = f"submodule {name!r}" if name else "the module"
            raise FSDPUsageError(
                f"{where} is already sharded by torch's FSDP ({type(sub).__name__}, e.g. "
                "from fully_shard); wrap a module that no torch FSDP has sharded. shardkit's "
                "checkpoint and state-dict helpers work with torch FSDP2 models as they are, "
                "so keep torch's FSDP there, or build the model afresh for shardkit's"
            )
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise FSDPUsageError(
                f"parameter {name!r} is a torch DTensor (sharded by torch, e.g. fully_shard "
                "or parallelize_module); shardkit FSDP shards plain parameters: wrap the "
                "module before torch shards it, or keep torch's sharding"
            )
