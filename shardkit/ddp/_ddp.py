"""DistributedDataParallel: replicate a module, average its gradients over ranks."""

from __future__ import annotations

import contextlib
import inspect
import json
import numbers
import sys
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from .. import runtime
from ..runtime._collective import collective_device, ranks_differ
from ..runtime._json_gather import all_gather_json
from ._errors import CommHookError, ModelMismatchError, NothingToTrainError
from ._grad_bucket import GradBucket
from ._join import DDPJoinHook, exchange
from ._reducer import Reducer, assign_buckets
from .comm_hooks import _comm

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallel training: each rank runs the whole module on its own batch.

    Construction broadcasts rank 0's parameters and buffers. Each synced backward
    averages the gradients over the group, bucket by bucket, while backward still
    runs. ``state_dict()`` keys carry the ``module.`` prefix exactly as torch's DDP;
    shardkit's checkpoint helpers strip it (``_shardkit_wrapper`` protocol).

    Options are keyword-only: torch's positional order differs (``device_ids`` comes
    second there), so a positional call could not mean the same thing in both.

    Args:
        module: the model; every rank must build it with the same parameters.
        process_group: the group to average over; default: the world.
        bucket_cap_mb: size of each gradient bucket (the first one is 1 MiB).
        find_unused_parameters: allow forwards that leave some parameters out.
        gradient_as_bucket_view: make ``.grad`` views into the buckets (saves a copy
            and a gradient-sized allocation).
        forward_sync_buffers: broadcast rank 0's buffers at the start of a forward
            (torch 2.13's name; default True). As in torch, only a forward that follows
            a synced training forward does (not one after a ``no_sync`` or ``no_grad``
            forward), and the construction broadcast includes buffers whatever its value.
        broadcast_buffers: the older name of ``forward_sync_buffers``; ``False`` also
            leaves buffers out of the construction broadcast (rank-local buffers), as in
            torch. ``forward_sync_buffers`` wins when both are given.
        static_graph: the forward uses the same parameters every iteration; accepted as
            in torch (parameters a forward leaves out are handled as with
            ``find_unused_parameters=True``).
        init_sync: check that the ranks agree on the parameters (names, order, shapes,
            dtypes, requires_grad) and on the buckets ``bucket_cap_mb`` cuts them into,
            and broadcast rank 0's parameters and buffers at construction (torch's
            default); ``False`` skips both.
            Parameters and buffers named in ``module._ddp_params_and_buffers_to_ignore``
            (see :meth:`_set_params_and_buffers_to_ignore_for_model`) are never
            broadcast or averaged.
        dim: the batch dim torch scatters over several local devices; one device per
            rank here, so it only has to be an int.
        device_ids / output_device: accepted as in torch for one device per rank.
        device_mesh: a 1-D torch ``DeviceMesh`` whose group to average over, instead of
            ``process_group`` (torch's option).

    ``copy.deepcopy`` and pickling (``torch.save`` of the wrapper) work as torch's: the
    copy is a working DDP over the default group, without a communication hook.
    """

    _shardkit_wrapper = True

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group=None,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool | None = None,
        device_ids: list | None = None,
        output_device=None,
        dim: int = 0,
        init_sync: bool = True,
        static_graph: bool = False,
        forward_sync_buffers: bool | None = None,
        device_mesh=None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"DistributedDataParallel wraps a torch.nn.Module, got {type(module).__name__}"
            )
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real):
            raise TypeError(f"bucket_cap_mb must be a number of MiB, got {bucket_cap_mb!r}")
        if not bucket_cap_mb >= 0:
            raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
        for name, flag in (
            ("find_unused_parameters", find_unused_parameters),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("broadcast_buffers", broadcast_buffers),
            ("init_sync", init_sync),
            ("static_graph", static_graph),
            ("forward_sync_buffers", forward_sync_buffers),
        ):
            if not isinstance(flag, bool) and (flag is not None or "buffers" not in name):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if forward_sync_buffers is not None and broadcast_buffers is not None:
            warnings.warn(
                "DistributedDataParallel: both broadcast_buffers and forward_sync_buffers "
                "were given; broadcast_buffers is ignored (as in torch)",
                FutureWarning,
                stacklevel=2,
            )
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim must be an int, got {dim!r}")
        if device_ids is not None and len(device_ids) > 1:  # [] is None, as torch
            raise ValueError(
                f"device_ids must be None or name this rank's one device, got {device_ids!r}"
            )
        if device_mesh is not None:
            process_group = _mesh_group(device_mesh, process_group)
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None (the world), "
                f"got {process_group!r}"
            )
        _refuse_sharded(module)
        self.module = module
        runtime.init()  # join the world the environment describes (torchrun, SLURM)
        self.process_group = _comm.resolve_group(process_group)
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_sync_buffers = forward_sync_buffers, True
        else:
            self.forward_sync_buffers = init_sync_buffers = broadcast_buffers is not False
        self.require_forward_param_sync = True
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_cap_mb = bucket_cap_mb
        self.static_graph = static_graph
        self.dim = dim
        self.require_backward_grad_sync = True
        named = [(n, p) for n, p in self._named_params() if p.requires_grad]
        self._world = _comm.group_size(self.process_group)
        if self._world > 1 and init_sync:
            # before refusing a module with nothing to train: a rank that alone has
            # nothing would leave the others waiting in this check for good
            self._verify_same_parameters(named)
        if not named:
            raise NothingToTrainError(
                "DistributedDataParallel needs a module with at least one parameter that "
                "requires grad; there is nothing to average"
            )
        self.device = next(module.parameters()).device
        self.device_ids = self.output_device = None
        if device_ids and self.device.type != "cpu":
            self.device_ids = [self.device.index]
            out = self.device if output_device is None else output_device
            self.output_device = out if isinstance(out, int) else torch.device(out).index
        if self._world > 1 and init_sync:
            self._broadcast([p for _, p in self._named_params()])
            if init_sync_buffers:
                self._broadcast(self._synced_buffers())
        self.reducer = self._build_reducer()
        self._hook_registered = False
        self._hook_checked = False
        self._join_divide_by_initial = True

    def _build_reducer(self) -> Reducer:
        named = [(n, p) for n, p in self._named_params() if p.requires_grad]
        return Reducer(
            [p for _, p in named],
            [n for n, _ in named],
            cap_bytes=self.bucket_bytes_cap,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters or self.static_graph,
            process_group=self.process_group,
        )

    # -- copies (copy.deepcopy, torch.save of the wrapper) ----------------------------

    def __getstate__(self) -> dict:
        """A copy leaves out the process group and the reducer, as torch's: it gets the
        default group and a new reducer, without a communication hook (register it
        again). Only a DDP over the default group can be copied, as in torch."""
        if self.process_group not in (None, dist.group.WORLD):
            raise RuntimeError(
                "DistributedDataParallel: copying or pickling is only supported over the "
                "default process group (as in torch); copy or save .module instead"
            )
        state = self.__dict__.copy()
        del state["process_group"], state["reducer"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.process_group = _comm.resolve_group(None)
        self.reducer = self._build_reducer()
        self._hook_registered = False
        self._hook_checked = True  # a copy (for evaluation, often on one rank) has no hook

    # -- torch's smaller attributes ------------------------------------------------

    @property
    def bucket_bytes_cap(self) -> int:
        """Bytes per gradient bucket, from ``bucket_cap_mb`` (torch's attribute)."""
        return max(1, int(self.bucket_cap_mb * (1 << 20)))

    @property
    def device_type(self) -> str:
        """The parameters' device type (torch's attribute)."""
        return self.device.type

    def _set_static_graph(self) -> None:
        """torch's private switch, which its error messages suggest: as
        ``static_graph=True`` in the constructor."""
        self.static_graph = True
        self.reducer.find_unused = True

    # -- setup -------------------------------------------------------------------

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
        module: nn.Module, params_and_buffers_to_ignore
    ) -> None:
        """Leave these parameters and buffers (names as ``module.named_parameters()`` /
        ``named_buffers()`` give them) out of every broadcast and gradient average; call
        it before wrapping. torch's (private, widely used) API of the same name."""
        module._ddp_params_and_buffers_to_ignore = list(params_and_buffers_to_ignore)

    def _named_params(self) -> list[tuple[str, nn.Parameter]]:
        return [
            (n, p) for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore
        ]

    def _synced_buffers(self) -> list[torch.Tensor]:
        """The buffers broadcasts cover, looked up each time (a module may reassign one)."""
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name of :attr:`forward_sync_buffers`."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts rank 0's buffers: buffers are synced, there
        are some, and the previous forward was a synced training forward (as torch)."""
        return bool(self._buffers_to_sync())

    def _buffers_to_sync(self) -> list[torch.Tensor]:
        """The buffers the next forward broadcasts (see :meth:`will_sync_module_buffers`),
        listed once per forward."""
        if self.require_forward_param_sync and self.forward_sync_buffers:
            return self._synced_buffers()
        return []

    def _verify_same_parameters(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Every rank must hold the same parameters (names, order, shapes, dtypes) and
        cut them into the same gradient buckets, or the averages would mix different
        parameters or the bucket all-reduces would not match. One all-reduce of a few
        int64s, as before the names and buckets joined the signature."""
        params = [p for _, p in named]
        every = self._named_params()  # frozen ones too: the broadcast covers them
        signature = [len(params), sum(p.numel() for p in params)]
        shapes = repr([(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in every])
        signature.append(zlib.crc32(shapes.encode()))  # not hash(): differs per process
        buckets = assign_buckets(params, cap_bytes=self.bucket_bytes_cap)
        signature.append(zlib.crc32(repr(buckets).encode()))
        # options that change which collectives a step runs: buffers broadcast at forward
        # on some ranks only, or a find-unused pass on some, would pair different calls
        signature.append(zlib.crc32(repr(sorted(self._step_options().items())).encode()))
        dev = collective_device(self.process_group)
        if any(ranks_differ(signature, self.process_group, device=dev)):
            # every rank sees it: one more exchange names the difference
            options = {"bucket_cap_mb": self.bucket_cap_mb, **self._step_options()}
            params_differ, what = _first_difference(every, options, self.process_group, dev)
            if params_differ:
                raise ModelMismatchError(
                    f"DistributedDataParallel: ranks hold different parameters: {what}; "
                    "build the same model on every rank before wrapping it"
                )
            if what is not None:
                raise ValueError(
                    f"DistributedDataParallel: {what}, so the ranks would run different "
                    "collectives (or cut the gradients into different buckets) and their "
                    "all-reduces would not match; pass the same options on every rank"
                )
            raise ModelMismatchError(
                "DistributedDataParallel: the ranks group the same parameters into "
                "different gradient buckets (are some parameters on another device on "
                "one rank only?); put the model on one device per rank before wrapping it"
            )

    def _check_same_hook(self) -> None:
        """At the first forward: every rank must reduce through the same communication
        hook with the same settings. An fp16 hook on one rank and bf16 on another summed
        the two formats' bits and the ranks diverged silently; PowerSGD settings that
        differ abort in gloo; a hook on one rank only pairs different collectives. One
        all-reduce of two int64s, once (a hook registered later is not compared; neither
        under ``join()``, where a rank may have no batch at all)."""
        mine = _hook_description(self.reducer.hook, self.reducer.hook_state)
        dev = collective_device(self.process_group)
        crc = zlib.crc32(json.dumps(mine, sort_keys=True).encode())
        if not ranks_differ([crc], self.process_group, device=dev)[0]:
            return
        every = all_gather_json(mine, self.process_group, device=dev)
        shown = "; ".join(f"rank {r}: {d}" for r, d in enumerate(every))
        raise CommHookError(
            f"DistributedDataParallel: the ranks reduce gradients through different "
            f"communication hooks or settings ({shown}); register the same hook with the "
            "same state on every rank, before the first forward"
        )

    def _step_options(self) -> dict[str, bool]:
        """The options every rank must share because they decide a step's collectives."""
        return {
            "forward_sync_buffers": bool(self.forward_sync_buffers),
            "find_unused_parameters": bool(self.find_unused_parameters),
            "static_graph": bool(self.static_graph),
            "gradient_as_bucket_view": bool(self.gradient_as_bucket_view),
        }

    @torch.no_grad()
    def _broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Group rank ``src``'s values to every rank, one collective per dtype and device."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for group in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            _comm.broadcast(flat, self.process_group, src_group_rank=src)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    # -- training ----------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        if not self._hook_checked and torch.is_grad_enabled() and self.require_backward_grad_sync:
            # once, at the first forward that syncs gradients: every rank makes that one
            # (an evaluation forward on rank 0 alone, under no_grad, is fine)
            self._hook_checked = True
            if self._world > 1 and not self._join_config.enable:
                self._check_same_hook()
        src = 0
        if self._join_config.enable and self._world > 1:
            Join.notify_join_context(self)  # counts this rank as still training
            sync = torch.is_grad_enabled() and self.require_backward_grad_sync
            count, _, src = exchange(self, active=True, sync=sync)
            self.reducer.sum_divisor = None if self._join_divide_by_initial else count
        buffers = self._buffers_to_sync() if self._world > 1 else []
        if buffers:
            self._broadcast(buffers, src=src)
        outputs = self.module(*inputs, **kwargs)
        self.require_forward_param_sync = (
            torch.is_grad_enabled() and self.require_backward_grad_sync
        )
        if self.require_forward_param_sync:
            self.reducer.prepare(outputs)
        return outputs

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards of forwards run inside only accumulate local gradients.

        The first synced backward after it averages the accumulated sum.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Let ``hook(state, bucket) -> Future`` communicate each bucket.

        Allowed once, at any time between iterations (as torch). The hook averages (DDP
        does not divide its result) and its future's value is the bucket's new flat
        tensor. Errors are :class:`CommHookError`, which is the ``TypeError`` /
        ``ValueError`` / ``RuntimeError`` torch raises for the same mistake.
        """
        if self._hook_registered:
            raise CommHookError(
                "register_comm_hook may be called only once per DDP module; combine the "
                "hooks into one (e.g. fp16_compress_wrapper(powerSGD_hook))"
            )
        if self.reducer.armed and any(self.reducer.ready):
            raise CommHookError(
                "register_comm_hook was called during a backward; register it between iterations"
            )
        if not callable(hook):
            raise CommHookError(
                f"register_comm_hook: hook must be callable as hook(state, bucket), got {hook!r}"
            )
        try:
            sig = inspect.signature(hook)
        except (TypeError, ValueError):
            sig = None
        if sig is not None:
            _check_signature(hook, sig, state)
        self.reducer.hook = hook
        self.reducer.hook_state = state
        self._hook_registered = True

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> contextlib.AbstractContextManager:
        """Train on uneven inputs: ranks whose data runs out first keep the others going.

        Use as ``with model.join(): for batch in my_batches: ...`` (torch's
        ``Join([model])``, which also works, with other joinables too). A rank that leaves
        the block shadows the collectives of every later iteration of the ranks still
        training (contributing zero gradients), and at the end every rank takes the
        parameters and buffers of a rank that finished last, so all end equal.
        Gradients are divided by the initial world size (``divide_by_initial_world_size``,
        torch's default) or by the number of ranks still training (default hook only).
        With ``throw_on_early_termination`` every rank raises RuntimeError as soon as
        one runs out instead. ``enable=False`` makes it a no-op.
        """
        for name, flag in (
            ("divide_by_initial_world_size", divide_by_initial_world_size),
            ("enable", enable),
            ("throw_on_early_termination", throw_on_early_termination),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"join: {name} must be True or False, got {flag!r}")
        if self._world == 1:
            return contextlib.nullcontext()
        return Join(
            [self],
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs) -> DDPJoinHook:
        """torch ``Joinable``: the hook a joined rank runs (``divide_by_initial_world_size``)."""
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """torch ``Joinable``: the device of this module's gradient buckets."""
        return self.reducer.buckets[0].buffer.device

    @property
    def join_process_group(self):
        """torch ``Joinable``: the group gradients are averaged over."""
        return self.process_group


def _mesh_group(device_mesh, process_group):
    """The group of a 1-D ``DeviceMesh`` given as ``device_mesh=`` (torch's option)."""
    if process_group is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if getattr(device_mesh, "ndim", None) != 1:
        raise ValueError(
            f"device_mesh must be a 1-D torch DeviceMesh, got {device_mesh!r}; pass "
            "process_group= for other groups"
        )
    return device_mesh.get_group()


def _check_signature(hook: Callable, sig: inspect.Signature, state: object) -> None:
    name = getattr(hook, "__name__", repr(hook))
    try:
        sig.bind(state, None)
    except TypeError:
        raise CommHookError(
            f"register_comm_hook: hook {name!r} must take two arguments (state, bucket); "
            f"its signature is {sig}"
        ) from None
    bucket = sig.parameters.get("bucket")
    if bucket is not None and bucket.annotation is not inspect.Parameter.empty:
        ann = bucket.annotation
        if not (
            (isinstance(ann, str) and "GradBucket" in ann) or ann in (dist.GradBucket, GradBucket)
        ):
            raise CommHookError(
                f"register_comm_hook: hook {name!r} annotates bucket as {ann!r}; it must be "
                "a GradBucket (torch.distributed.GradBucket or shardkit.ddp.GradBucket)"
            )
    ret = sig.return_annotation
    if ret is not inspect.Signature.empty and not _is_future_annotation(ret):
        raise CommHookError(
            f"register_comm_hook: hook {name!r} is annotated to return {ret!r}; a hook "
            "must return a torch.futures.Future"
        )


def _is_future_annotation(ret) -> bool:
    if isinstance(ret, str):
        return "Future" in ret
    origin = getattr(ret, "__origin__", ret)
    return isinstance(origin, type) and issubclass(origin, torch._C.Future)


def _refuse_sharded(module: nn.Module) -> None:
    """DDP replicates: it broadcasts rank 0's parameters and averages whole gradients.
    Over parameters that are shards (shardkit FSDP, ShardedTensor or DTensor
    parameters) the broadcast would overwrite every rank's shard with rank 0's, so it is
    refused, with torch's class (its DDP fails on DTensor parameters the same way).
    shardkit's sharded classes carry ``_shardkit_sharded`` (this layer imports no spmd)."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")  # none made if not loaded
    dtensor = getattr(dtensor_module, "DTensor", ())
    for name, sub in module.named_modules():
        if getattr(type(sub), "_shardkit_sharded", False):
            where = f"module {name!r} ({type(sub).__name__})" if name else type(sub).__name__
            raise NotImplementedError(
                f"DistributedDataParallel cannot wrap {where}: its parameters are shards, and "
                "DDP's broadcast of rank 0's parameters would overwrite the other ranks' "
                "shards. FSDP is data parallel already (it averages gradients over its "
                "group): train with FSDP alone"
            )
    for name, param in module.named_parameters():
        if getattr(type(param), "_shardkit_sharded", False) or isinstance(param, dtensor):
            raise NotImplementedError(
                f"DistributedDataParallel cannot wrap parameter {name!r}: it is a "
                f"{type(param).__name__} (sharded), and DDP replicates whole parameters; "
                "average its gradients over the data-parallel mesh axis instead "
                "(docs/spmd.md)"
            )


def _first_difference(
    named: list[tuple[str, torch.Tensor]], options: dict, group, device
) -> tuple[bool, str | None]:
    """(True, the first parameter whose name, shape, dtype or requires_grad differs
    between the ranks, or the counts by rank); else (False, each option that differs,
    with every rank's value, or None). A JSON all-gather: nothing is unpickled."""
    mine = [
        [name, list(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad]
        for name, p in named
    ]
    every = all_gather_json({"params": mine, "options": options}, group, device=device)
    lists = [entry["params"] for entry in every]
    for index in range(min(len(params) for params in lists)):
        entries = [params[index] for params in lists]
        if any(entry != entries[0] for entry in entries):
            by_rank = ", ".join(
                f"rank {r}: {name} {tuple(shape)} {dtype}{'' if grad else ' frozen'}"
                for r, (name, shape, dtype, grad) in enumerate(entries)
            )
            return True, f"parameter {index} differs ({by_rank})"
    if any(len(params) != len(lists[0]) for params in lists):
        counts = ", ".join(f"rank {r}: {len(params)}" for r, params in enumerate(lists))
        return True, f"the number of parameters differs ({counts})"
    differ = [
        f"{name} differs between the ranks ("
        + ", ".join(f"rank {r}: {entry['options'][name]}" for r, entry in enumerate(every))
        + ")"
        for name in options
        if any(entry["options"][name] != every[0]["options"][name] for entry in every)
    ]
    return False, ("; ".join(differ) or None)


def _hook_description(hook, state) -> dict:
    """The hook's name and its state's settings, as JSON. Settings are read from the
    states shardkit and torch define (PowerSGD's); a user's own state may hold per-rank
    values (its rank), so only its type is compared."""
    if hook is None:
        return {"hook": None}
    name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    known = type(state).__module__.split(".")[0] in ("shardkit", "torch")
    settings = {
        k: v
        for k, v in sorted(getattr(state, "__dict__", {}).items() if known else ())
        if not k.startswith("_") and (v is None or isinstance(v, (bool, int, float, str)))
    }
    settings["type"] = type(state).__qualname__
    return {"hook": f"{getattr(hook, '__module__', '')}.{name}", "state": settings}
