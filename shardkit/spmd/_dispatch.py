"""Op dispatch for ShardedTensor: sharding rules where registered, a gather fallback otherwise.

The fallback gathers every sharded input, runs the op on full tensors, writes back any
input the op mutates, and re-shards each output like the first sharded input when its
sharded dims kept their sizes (otherwise the output is replicated). It is correct for
every deterministic op, counted per op name and logged once per op name.

Before any rule, cheap fast paths serve what a rule would answer anyway: ops whose
operands are all replicated, pointwise ops whose operands share one layout, and views
whose output layout is memoized (see ``_fast`` and ``FAST_HANDLERS``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import _comm
from ._placement import Placement
from ._redistribute import redistribute_local

__all__ = [
    "register_rule",
    "dispatch",
    "fallback_counts",
    "reset_fallback_counts",
    "Declined",
]

logger = logging.getLogger("shardkit.spmd")
aten = torch.ops.aten

Rule = Callable[[object, tuple, dict], object]


class Declined:
    """What a rule returns when it exists but cannot handle this call: the call then runs
    through the fallback, and the log says the rule declined and why."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Declined({self.reason!r})"


_ST = None  # ShardedTensor, bound on first dispatch (its module imports this one)
_RULES: dict[object, Rule] = {}
#: (predicate(func), rule) pairs consulted, in order, for ops with no registered rule.
_CLASS_RULES: list[tuple[Callable[[object], bool], Rule]] = []
_FALLBACK_COUNTS: Counter = Counter()
_LOGGED: set[tuple[str, str]] = set()


def register_rule(*ops) -> Callable[[Rule], Rule]:
    """Register ``rule(func, args, kwargs)`` for aten ops (overloads or packets).

    A rule may return :class:`Declined` (with the reason) or ``NotImplemented`` to hand
    the call to the fallback.
    """

    def decorate(rule: Rule) -> Rule:
        for op in ops:
            _RULES[op] = rule
        return rule

    return decorate


def register_class_rule(predicate: Callable[[object], bool], rule: Rule) -> None:
    """Use ``rule`` for every op without its own rule for which ``predicate(func)`` holds
    (for example all ops tagged pointwise)."""
    _CLASS_RULES.append((predicate, rule))


def _rule_for(func) -> Rule | None:
    rule = _RULES.get(func) or _RULES.get(func.overloadpacket)
    if rule is None:
        for predicate, candidate in _CLASS_RULES:
            if predicate(func):
                rule = candidate
                break
        _RULES[func] = rule
    return rule


def fallback_counts() -> Counter:
    """How many times each op name ran through the gather fallback in this process."""
    return Counter(_FALLBACK_COUNTS)


def reset_fallback_counts() -> None:
    """Zero the per-op fallback counters (for tests and per-phase accounting)."""
    _FALLBACK_COUNTS.clear()


def _sharded_type():
    from ._sharded_tensor import ShardedTensor

    return ShardedTensor


def _plain_grad(grad):
    """Hook on a plain tensor used with ShardedTensors: its gradient arrives sharded (or as
    a pending sum); give it back whole, so a plain parameter's ``.grad`` is a plain tensor
    as in torch, plain layers upstream run their backward on plain tensors, and the
    optimizer step of plain parameters needs no collective."""
    return grad.full_tensor() if isinstance(grad, _sharded_type()) else grad


def _watch(x) -> None:
    if (
        type(x) in (torch.Tensor, torch.nn.Parameter)
        and x.requires_grad
        and not any(h is _plain_grad for h in (x._backward_hooks or {}).values())
    ):
        x.register_hook(_plain_grad)


def _watch_plain(args: tuple) -> None:
    for a in args:
        if isinstance(a, (list, tuple)):
            for b in a:
                _watch(b)
        else:
            _watch(a)


#: ``(detect(args, kwargs), handle(func, args, kwargs, dispatch))`` pairs for operands
#: that need their own path before the rules (folded batch dims: ``_rules/_fold.py``)
_SPECIAL_OPERANDS: list[tuple[Callable, Callable]] = []


#: rules that, given operands that all have one placement and one shape, return exactly
#: that placement and shape while computing on the local shards alone (pointwise ops);
#: filled by ``_rules/__init__.py``
UNIFORM_RULES: set = set()

#: ops never on the fast paths: in-place ops that change their operand's shape or strides
#: (the wrapper would keep the old global shape), and stride-sensitive views
_METADATA_MUTATING = frozenset(
    {"resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_"}
    | {"transpose_", "t_", "swapdims_", "swapaxes_", "_unsafe_set"}
    # views that need the operand's real strides: a ShardedTensor reports the global
    # tensor's strides, which its local tensor need not have (their rules reshape)
    | {"view", "_unsafe_view", "as_strided", "_reshape_alias", "view_as_real"}
    | {"view_as_complex"}
)

#: per-op fast handlers ``handler(func, args, kwargs)`` that return the result or
#: ``SLOW`` (then the usual path runs): memoized layouts of views, for example
FAST_HANDLERS: dict = {}

#: per op: 0 no fast path, 1 the all-replicated path, 2 also the uniform-layout path,
#: 3 a handler in FAST_HANDLERS
_FAST_KIND: dict = {}
SLOW = _SLOW = object()
_REPLICATED: dict = {}  # (mesh, ndim) -> replicated Placement


def _fast_kind(func) -> int:
    kind = _FAST_KIND.get(func)
    if kind is None:
        if func in FAST_HANDLERS:
            kind = 3
        elif func.namespace != "aten" or func.overloadpacket.__name__ in _METADATA_MUTATING:
            kind = 0
        else:
            rule = _RULES[func] if func in _RULES else _rule_for(func)
            # an op tagged pointwise that returns a bool (aten.equal) compares whole
            # tensors: run on the shards, each rank would answer for its own rows
            returns_tensors = all(
                isinstance(r.type, torch.TensorType) for r in func._schema.returns
            )
            kind = 2 if rule in UNIFORM_RULES and returns_tensors else 1
        _FAST_KIND[func] = kind
    return kind


def _replicated(mesh, ndim: int) -> Placement:
    key = (mesh, ndim)
    placement = _REPLICATED.get(key)
    if placement is None:
        placement = _REPLICATED[key] = Placement.replicated(mesh, ndim)
    return placement


def _fast(func, args: tuple, kwargs: dict, kind: int):
    """Run ``func`` on the local shards without consulting a rule, when that is exactly
    what the rule would do; ``_SLOW`` otherwise.

    Two cases, checked in one pass over the operands:

    - *all replicated*: every ShardedTensor operand is replicated with no pending sum
      (plain tensors count as replicated, as everywhere). Each rank holds the whole
      tensors, so the op runs as on one device and every tensor output is replicated.
    - *uniform* (pointwise ops only, ``kind == 2``): every tensor operand is a
      ShardedTensor with the same placement (no pending sum) and the same shape, and no
      tensor comes through a list or a keyword. The pointwise rule would choose that
      placement at zero cost; the output has it too.

    An output that is an operand's own local tensor (an in-place op) is that operand.
    """
    st_type = _ST
    placement = shape = None
    uniform = kind == 2
    replicated = True
    for a in args:
        t = type(a)
        if t is st_type:
            p = a._placement
            if placement is None:
                placement, shape = p, a.shape
            elif uniform and (a.shape != shape or (p is not placement and p != placement)):
                uniform = False
            if not p._replicated:
                replicated = False
        elif t is list or t is tuple:
            for b in a:
                if isinstance(b, torch.Tensor):
                    uniform = False
                    if type(b) is st_type:
                        if placement is None:
                            placement = b._placement
                        if not b._placement._replicated:
                            return _SLOW
                    elif isinstance(b, st_type):
                        return _SLOW
        elif isinstance(a, torch.Tensor):
            if isinstance(a, st_type):
                return _SLOW  # a ShardedTensor subclass (folded dims) has its own path
            uniform = False
        if not (uniform or replicated):
            return _SLOW
    for v in kwargs.values():
        if isinstance(v, torch.Tensor):
            uniform = False
            if isinstance(v, st_type) and (type(v) is not st_type or not v._placement._replicated):
                return _SLOW
        elif isinstance(v, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in v):
            return _SLOW
    if placement is None or not (uniform or replicated):
        return _SLOW
    if placement.partial:
        return _SLOW
    inputs = {}
    largs = [_unwrap(a, inputs) for a in args]
    lkwargs = {k: _unwrap(v, inputs) for k, v in kwargs.items()} if kwargs else kwargs
    out = func(*largs, **lkwargs)
    if uniform:
        return _rewrap(out, inputs, placement, shape)
    return _rewrap(out, inputs, placement.mesh, None)


def _unwrap(value, inputs: dict):
    if type(value) is _ST:
        local = value._local_tensor
        inputs[id(local)] = value
        return local
    if type(value) is list or type(value) is tuple:
        return type(value)(_unwrap(v, inputs) for v in value)
    return value


def _rewrap(out, inputs: dict, where, shape):
    """Wrap a local result: under placement ``where`` with global ``shape`` (uniform), or
    replicated on mesh ``where`` (``shape`` None)."""
    if isinstance(out, torch.Tensor):
        mine = inputs.get(id(out))
        if mine is not None:
            return mine
        if shape is None:
            return _ST(out, _replicated(where, out.ndim), out.shape)
        return _ST(out, where, shape)
    if type(out) is tuple or type(out) is list:
        return type(out)(_rewrap(o, inputs, where, shape) for o in out)
    return out


def dispatch(func, args: tuple, kwargs: dict):
    global _ST
    if torch.is_grad_enabled():
        _watch_plain(args)
    if _ST is None:
        _ST = _sharded_type()
    kind = _FAST_KIND[func] if func in _FAST_KIND else _fast_kind(func)
    if kind:
        if kind == 3:
            out = FAST_HANDLERS[func](func, args, kwargs)
        else:
            out = _fast(func, args, kwargs, kind)
        if out is not _SLOW:
            return out
    for detect, handle in _SPECIAL_OPERANDS:
        if detect(args, kwargs):
            return handle(func, args, kwargs, _dispatch_rules)
    return _dispatch_rules(func, args, kwargs)


def _dispatch_rules(func, args: tuple, kwargs: dict):
    rule = _RULES[func] if func in _RULES else _rule_for(func)
    if rule is None:
        return fallback(func, args, kwargs)
    out = rule(func, args, kwargs)
    if out is NotImplemented:
        return fallback(func, args, kwargs, reason="its sharding rule declined this call")
    if isinstance(out, Declined):
        return fallback(func, args, kwargs, reason=f"its sharding rule declined: {out.reason}")
    return out


def _full(st) -> torch.Tensor:
    replicated = Placement.replicated(st._placement.mesh, st.ndim)
    return redistribute_local(st._local_tensor, st.shape, st._placement, replicated)


def _mutated_positions(func) -> list[tuple[int, str]]:
    return [
        (i, arg.name)
        for i, arg in enumerate(func._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    ]


def fallback(func, args: tuple, kwargs: dict, *, reason: str = "it has no sharding rule"):
    """Gather, compute on full tensors, write back mutations, re-shard outputs.

    Logged once per op name and reason (``reason`` says whether the op has no rule or
    its rule declined, and why).
    """
    ShardedTensor = _sharded_type()
    name = str(func.overloadpacket.__name__)
    _FALLBACK_COUNTS[name] += 1
    _comm.record_fallback(name)
    flat, spec = tree_flatten((args, kwargs))
    sharded_inputs = [a for a in flat if isinstance(a, ShardedTensor)]
    if (name, reason) not in _LOGGED:
        _LOGGED.add((name, reason))
        logger.warning(
            "shardkit: op %s runs through the gather fallback because %s "
            "(logged once per op and reason)",
            name,
            reason,
        )
    full_flat = [_full(a) if isinstance(a, ShardedTensor) else a for a in flat]
    f_args, f_kwargs = tree_unflatten(full_flat, spec)
    out = func(*f_args, **f_kwargs)

    writes = []
    for position, arg_name in _mutated_positions(func):
        original = args[position] if position < len(args) else kwargs.get(arg_name)
        computed = f_args[position] if position < len(f_args) else f_kwargs.get(arg_name)
        if isinstance(original, ShardedTensor):
            if tuple(computed.shape) != tuple(original.shape):
                raise NotImplementedError(
                    f"shardkit: {name} changes the shape of a ShardedTensor in place "
                    f"({tuple(original.shape)} -> {tuple(computed.shape)}), which its layout "
                    f"cannot follow; use the out-of-place op (e.g. t = t.t() for t.t_()) "
                    f"and mark_sharding the result"
                )
            writes.append((original, computed))
    mutated = {}
    for original, computed in writes:
        placement = original._placement.without_partial()
        box = placement.box(original.shape)
        original._local_tensor.copy_(computed[box.slices()])
        original._placement = placement
        mutated[id(computed)] = original

    def wrap(value):
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) in mutated:
            return mutated[id(value)]
        placement = _output_placement(sharded_inputs, value)
        if placement.is_replicated():
            return ShardedTensor(value, placement, value.shape)
        local = value[placement.box(value.shape).slices()].clone()
        return ShardedTensor(local, placement, value.shape)

    out_flat, out_spec = tree_flatten(out)
    return tree_unflatten([wrap(v) for v in out_flat], out_spec)


def _output_placement(inputs: list, value: torch.Tensor) -> Placement:
    """Shard like the first sharded input whose sharded dims kept their sizes, else replicate.

    Inputs that actually split a dim are preferred over replicated ones, so that for
    example ``grad * weight`` comes back sharded like ``weight``.
    """
    ordered = sorted(inputs, key=lambda st: st._placement.without_partial().is_replicated())
    for st in ordered:
        spec = st._placement.spec
        if value.ndim == st.ndim and all(
            not axes or value.shape[d] == st.shape[d] for d, axes in enumerate(spec)
        ):
            return Placement(st._placement.mesh, spec)
    return Placement.replicated(inputs[0]._placement.mesh, value.ndim)


# Plumbing that autograd and tensor bookkeeping call constantly; these keep the layout and
# touch only the local shard, so they are not sharding rules and never communicate.
@register_rule(aten.detach.default, aten.alias.default)
def _local_alias(func, args, kwargs):
    st = args[0]
    return _sharded_type()(func(st._local_tensor), st._placement, st.shape)


@register_rule(aten.clone.default)
def _local_clone(func, args, kwargs):
    st = args[0]
    return _sharded_type()(func(st._local_tensor, **kwargs), st._placement, st.shape)
