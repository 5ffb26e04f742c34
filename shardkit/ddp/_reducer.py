"""Gradient buckets and their overlapped reduction.

Parameters are grouped into flat buckets in reverse registration order (roughly the
order backward produces gradients). A post-accumulate-grad hook per parameter copies
its gradient into its bucket; when a bucket is full it is handed to the comm hook at
once, so its all-reduce runs while backward goes on. Buckets launch strictly in
index order, so every rank issues the same collectives in the same order. A callback
queued on the autograd engine waits for all of them when backward ends and writes
the results back into ``.grad``.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable

import torch

from ._errors import CommHookError
from ._grad_bucket import GradBucket
from .comm_hooks import _comm

__all__ = ["FIRST_BUCKET_BYTES", "assign_buckets", "Reducer"]

FIRST_BUCKET_BYTES = 1 << 20  # small first bucket: its all-reduce starts early


def assign_buckets(
    params: list[torch.Tensor], *, cap_bytes: int, first_cap_bytes: int = FIRST_BUCKET_BYTES
) -> list[list[int]]:
    """Group parameter indices into buckets, last-registered first.

    A bucket holds one dtype and device; it closes once it reaches its cap (the first
    closed bucket uses the smaller of the two caps). A parameter bigger than the cap gets a
    bucket of its own.
    """
    done: list[list[int]] = []
    open_: dict[tuple, list] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        entry = open_.setdefault(key, [[], 0])
        entry[0].append(i)
        entry[1] += p.numel() * p.element_size()
        if entry[1] >= (min(first_cap_bytes, cap_bytes) if not done else cap_bytes):
            done.append(entry[0])
            del open_[key]
    done.extend(entry[0] for entry in open_.values())
    return done


class _Bucket:
    __slots__ = ("index", "members", "buffer", "views", "pending", "future")

    def __init__(self, index: int, members: list[int], params: list[torch.Tensor]):
        self.index = index
        self.members = sorted(members)  # registration order inside a bucket, as torch
        p0 = params[members[0]]
        numel = sum(params[i].numel() for i in members)
        self.buffer = torch.zeros(numel, dtype=p0.dtype, device=p0.device)
        self.views = self.views_of(self.buffer, params)
        self.pending = len(members)
        self.future: torch.futures.Future | None = None

    def views_of(self, buffer: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """One view per member parameter into a flat ``buffer`` laid out like this bucket.

        A view has its parameter's strides where the parameter is dense (transposed,
        channels_last), as torch's bucket views do, so ``gradient_as_bucket_view``
        gradients keep the parameter's memory format; otherwise it is row-major.
        """
        views, offset = [], 0
        for i in self.members:
            p = params[i]
            strides = torch.empty_like(p, device="meta").stride()  # torch's preserve_format
            views.append(buffer.as_strided(p.shape, strides, buffer.storage_offset() + offset))
            offset += p.numel()
        return views


class Reducer:
    """Owns the buckets of one DDP module and runs one reduction per synced backward."""

    def __init__(
        self,
        params: list[torch.Tensor],
        names: list[str],
        *,
        cap_bytes: int,
        gradient_as_bucket_view: bool,
        find_unused_parameters: bool,
        process_group,
    ) -> None:
        self.params = params
        self.names = names
        self.as_view = gradient_as_bucket_view
        self.find_unused = find_unused_parameters
        self.process_group = process_group
        self.hook: Callable | None = None
        self.hook_state = None
        self.sum_divisor: int | None = None  # join(divide_by_initial_world_size=False)
        self.buckets = [
            _Bucket(i, members, params)
            for i, members in enumerate(assign_buckets(params, cap_bytes=cap_bytes))
        ]
        self.where = {}
        for b in self.buckets:
            for slot, i in enumerate(b.members):
                self.where[i] = (b, slot)
        self.lock = threading.Lock()
        self.armed = False
        self.ready = [False] * len(params)
        self.had_grad = [False] * len(params)
        self.unused: list[int] = []
        self.callback_queued = False
        self.output_hooks: list = []
        self.next_launch = 0
        self.backwards_done = 0
        with torch.enable_grad():  # each parameter's AccumulateGrad node, kept alive
            self.accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
        ref = weakref.ref(self)
        self.handles = [
            p.register_post_accumulate_grad_hook(_make_param_hook(ref, i))
            for i, p in enumerate(params)
        ]
        # A dropped DDP must not leave hooks on the parameters of a module that lives on.
        weakref.finalize(self, _remove_all, self.handles)

    def _fix_for(self, missing: list[int]) -> str:
        """The fix for parameters that got no gradient: frozen after wrapping (re-wrap),
        or unused by this forward (find_unused_parameters)."""
        frozen = [self.names[i] for i in missing if not self.params[i].requires_grad]
        if frozen:
            return (
                f"{frozen} stopped requiring grad after the module was wrapped: wrap it "
                "again after changing requires_grad (DDP reduces the parameters that "
                "required grad when it was built)"
            )
        return (
            "construct DistributedDataParallel with find_unused_parameters=True when a "
            "forward does not use every parameter"
        )

    # -- per iteration -------------------------------------------------------------

    def prepare(self, outputs) -> None:
        """Arm the reduction for the backward of this forward's outputs."""
        if self.armed and any(self.ready):
            missing = [i for i, r in enumerate(self.ready) if not r]
            raise RuntimeError(
                f"DDP: the previous backward did not finish its reduction (it raised, or "
                f"produced no gradient for {[self.names[i] for i in missing]}); "
                f"{self._fix_for(missing)}"
            )
        for b in self.buckets:
            b.pending = len(b.members)
            b.future = None
        self.ready = [False] * len(self.params)
        self.had_grad = [False] * len(self.params)
        self.next_launch = 0
        self.callback_queued = False
        self.unused = []
        tensors = _tensors_in(outputs)
        if self.find_unused:
            used = _params_reached(tensors)
            self.unused = [i for i, p in enumerate(self.params) if id(p) not in used]
        self.armed = True
        self._hook_outputs(tensors)

    def _hook_outputs(self, tensors: list[torch.Tensor]) -> None:
        """Queue the end-of-backward step from the outputs' own backward nodes.

        The end of the graph task a callback is queued on is where it runs. A gradient
        may first arrive inside a nested backward (reentrant activation checkpointing
        around the last layer), whose task ends long before the outer one: queued
        there, the step would run with most gradients missing. The outputs' nodes run in
        the outer backward, so their pre-hook queues on it; the first gradient queues
        only when no output node ran (a backward through something else).
        """
        for h in self.output_hooks:
            h.remove()
        nodes = {id(t.grad_fn): t.grad_fn for t in tensors if t.grad_fn is not None}

        ref = weakref.ref(self)  # the graph must not keep the reducer alive

        def start(*_args) -> None:
            reducer = ref()
            if reducer is not None:
                with reducer.lock:
                    if reducer.armed and reducer._reaches_parameters():
                        reducer._start_backward()

        self.output_hooks = [node.register_prehook(start) for node in nodes.values()]

    def _reaches_parameters(self) -> bool:
        """Whether the running backward accumulates into a parameter's ``.grad``.

        ``torch.autograd.grad`` through the outputs (a gradient penalty, an adversarial
        input) runs their nodes too, but fills no ``.grad``: it must neither start nor
        end this forward's reduction, which the real backward after it does (as torch's
        DDP, whose reduction only parameter hooks drive)."""
        try:
            return any(torch._C._will_engine_execute_node(a) for a in self.accumulators)
        except RuntimeError:  # raised inside autograd.grad(), which fills no .grad
            return False

    def _start_backward(self) -> None:
        """Once per backward: queue the end-of-backward step, mark unused parameters."""
        if self.callback_queued:
            return
        self.callback_queued = True
        for h in self.output_hooks:
            h.remove()
        self.output_hooks = []
        torch.autograd.Variable._execution_engine.queue_callback(self.finalize)
        for j in self.unused:
            self._mark_ready(j)

    def on_grad_ready(self, i: int) -> None:
        with self.lock:
            if not self.armed:
                return
            self._start_backward()
            if self.ready[i]:
                raise RuntimeError(
                    f"DDP: parameter {self.names[i]!r} received a gradient after it was "
                    f"marked unused (not reachable from the last forward's outputs); "
                    f"run one forward per backward, or combine the outputs in one forward. "
                    f"Parameters inside reentrant activation checkpointing "
                    f"(use_reentrant=True) are invisible to the graph walk of "
                    f"find_unused_parameters / static_graph: use use_reentrant=False"
                )
            self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        self.ready[i] = True
        bucket, slot = self.where[i]
        view = bucket.views[slot]
        p = self.params[i]
        grad = p.grad
        if grad is None:
            view.zero_()
        else:
            if grad.is_sparse:
                raise TypeError(f"DDP: parameter {self.names[i]!r} has a sparse gradient")
            self.had_grad[i] = True
            if not (grad.data_ptr() == view.data_ptr() and grad.shape == view.shape):
                view.copy_(grad)
                if self.as_view:
                    p.grad = view
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        last = len(self.buckets) - 1
        while self.next_launch <= last and self.buckets[self.next_launch].pending == 0:
            b = self.buckets[self.next_launch]
            grad_bucket = GradBucket(
                b.index,
                b.buffer,
                b.views,
                [self.params[i] for i in b.members],
                is_last=b.index == last,
            )
            if self.hook is None:
                average = self.sum_divisor is None
                fut = _comm.all_reduce_async(b.buffer, self.process_group, average=average)
            else:
                fut = self.hook(self.hook_state, grad_bucket)
                if not isinstance(fut, torch._C.Future):  # base of torch.futures.Future
                    name = getattr(self.hook, "__name__", repr(self.hook))
                    raise CommHookError(
                        f"DDP communication hook {name} returned {type(fut).__name__}; a hook "
                        f"must return a torch.futures.Future whose value is the bucket's tensor"
                    )
            b.future = fut
            self.next_launch += 1

    def finalize(self) -> None:
        """End of backward: wait for every bucket and write the averaged gradients."""
        with self.lock:
            if not self.armed:
                return
            if self.find_unused:
                for i, r in enumerate(self.ready):
                    if not r:
                        self._mark_ready(i)
            missing = [i for i, r in enumerate(self.ready) if not r]
            self.armed = False
            if missing:
                raise RuntimeError(
                    f"DDP: backward produced no gradient for "
                    f"{[self.names[i] for i in missing]}; {self._fix_for(missing)}"
                )
            used = None
            if self.find_unused:
                flags = torch.tensor(self.had_grad, dtype=torch.int32)
                dev = self.buckets[0].buffer.device
                used = _comm.all_reduce(flags.to(dev), self.process_group).cpu().tolist()
            for b in self.buckets:
                value = b.future.wait()
                if isinstance(value, (list, tuple)):
                    value = value[0]
                if not isinstance(value, torch.Tensor) or value.numel() != b.buffer.numel():
                    raise CommHookError(
                        f"DDP communication hook: the future of bucket {b.index} holds "
                        f"{type(value).__name__}; it must hold a tensor of "
                        f"{b.buffer.numel()} elements"
                    )
                if self.hook is None and self.sum_divisor:
                    value = value / self.sum_divisor
                if value.data_ptr() != b.buffer.data_ptr() or value.dtype != b.buffer.dtype:
                    b.buffer.copy_(value.reshape(-1))
                for slot, i in enumerate(b.members):
                    self._write_back(i, b.views[slot], used)
            self.backwards_done += 1

    def _write_back(self, i: int, view: torch.Tensor, used) -> None:
        p = self.params[i]
        if used is not None and not used[i]:
            return  # no rank produced a gradient: leave .grad as it is (None)
        if self.as_view:
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view
        elif p.grad is None:
            p.grad = view.clone()
        else:
            p.grad.copy_(view)

    def shadow_backward(self) -> None:
        """A joined rank's part of one backward of the others: zero gradients, same order."""
        with self.lock:
            last = len(self.buckets) - 1
            futures = []
            for b in self.buckets:
                zeros = torch.zeros_like(b.buffer)
                if self.hook is None:
                    fut = _comm.all_reduce_async(zeros, self.process_group, average=True)
                else:
                    bucket = GradBucket(
                        b.index,
                        zeros,
                        b.views_of(zeros, self.params),
                        [self.params[i] for i in b.members],
                        is_last=b.index == last,
                    )
                    fut = self.hook(self.hook_state, bucket)
                futures.append(fut)
            if self.find_unused:
                dev = self.buckets[0].buffer.device
                _comm.all_reduce(
                    torch.zeros(len(self.params), dtype=torch.int32, device=dev), self.process_group
                )
            for fut in futures:
                fut.wait()

    def remove(self) -> None:
        _remove_all(self.handles)


def _remove_all(handles) -> None:
    for handle in handles:
        handle.remove()


def _make_param_hook(ref: weakref.ref, i: int):
    def hook(_param: torch.Tensor) -> None:
        reducer = ref()
        if reducer is not None:
            reducer.on_grad_ready(i)

    return hook


def _tensors_in(outputs) -> list[torch.Tensor]:
    """The tensors in a forward's outputs: in lists, tuples, dicts and dataclasses (as
    torch's DDP finds them; a model output such as transformers' is a dict)."""
    found, todo = [], [outputs]
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            todo.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
    return found


def _params_reached(tensors: list[torch.Tensor]) -> set[int]:
    """ids of the leaf tensors the autograd graph of ``tensors`` accumulates into."""
    stack, seen, found = [], set(), set()
    for t in tensors:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            found.add(id(t))
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            found.add(id(variable))
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                stack.append(nxt)
    return found
