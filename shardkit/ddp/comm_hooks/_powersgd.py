"""PowerSGD gradient compression (Vogels et al., NeurIPS 2019).

Each gradient matrix M (rows x cols) is sent as two thin factors: P = M Q is summed
over ranks and orthogonalized, then Q = M^T P is summed, and every rank rebuilds the
average as P Q^T. A rank-r factorization sends r (rows + cols) numbers instead of
rows * cols. 1-D tensors, and matrices too small to gain, go through a plain
all-reduce. All collectives are issued from the hook call itself, in bucket order, so
ranks never disagree on the order of collectives.
"""

import logging
import math
import numbers

import torch
import torch.distributed as dist

from . import _comm

__all__ = ["PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook"]

logger = logging.getLogger(__name__)


def _check_int(name: str, value, minimum: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"PowerSGDState: {name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"PowerSGDState: {name} must be >= {minimum}, got {value}")
    return int(value)


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"PowerSGDState: {name} must be True or False, got {value!r}")
    return value


class PowerSGDState:
    """Options and per-bucket memory (residuals, warm-start Q) of the PowerSGD hooks.

    The first ``start_powerSGD_iter`` iterations use a plain all-reduce: early
    gradients change fast, and torch's DDP regroups its buckets after iteration one.
    The state pickles without its process group, so it can be saved in a checkpoint;
    unpickling binds it to the default group.
    """

    def __init__(
        self,
        process_group=None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"PowerSGDState: process_group must be a torch.distributed.ProcessGroup or "
                f"None (the default group), got {process_group!r}"
            )
        self.process_group = process_group
        self.matrix_approximation_rank = _check_int(
            "matrix_approximation_rank", matrix_approximation_rank, 1
        )
        # any int, as torch: at or below 0, compression starts at the first iteration
        self.start_powerSGD_iter = _check_int("start_powerSGD_iter", start_powerSGD_iter, None)
        if isinstance(min_compression_rate, bool) or not isinstance(
            min_compression_rate, numbers.Real
        ):
            raise TypeError(
                f"PowerSGDState: min_compression_rate must be a number, got {min_compression_rate!r}"
            )
        if not (min_compression_rate >= 0 and math.isfinite(min_compression_rate)):
            raise ValueError(  # below 1 'compression' may send more bytes: torch allows it
                f"PowerSGDState: min_compression_rate must be finite and >= 0, got "
                f"{min_compression_rate}"
            )
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = _check_bool("use_error_feedback", use_error_feedback)
        self.warm_start = _check_bool("warm_start", warm_start)
        if isinstance(orthogonalization_epsilon, bool) or not isinstance(
            orthogonalization_epsilon, numbers.Real
        ):
            raise TypeError(
                f"PowerSGDState: orthogonalization_epsilon must be a number, "
                f"got {orthogonalization_epsilon!r}"
            )
        if not (orthogonalization_epsilon >= 0 and math.isfinite(orthogonalization_epsilon)):
            raise ValueError(
                f"PowerSGDState: orthogonalization_epsilon must be finite and >= 0, "
                f"got {orthogonalization_epsilon}"
            )
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.random_seed = _check_int("random_seed", random_seed, 0)
        self.compression_stats_logging_frequency = max(  # at least 1, as torch
            1,
            _check_int(
                "compression_stats_logging_frequency", compression_stats_logging_frequency, None
            ),
        )
        self.batch_tensors_with_same_shape = _check_bool(
            "batch_tensors_with_same_shape", batch_tensors_with_same_shape
        )
        if (use_error_feedback or warm_start) and self.start_powerSGD_iter <= 1:
            raise ValueError(
                f"PowerSGDState: start_powerSGD_iter={start_powerSGD_iter} cannot work with "
                f"use_error_feedback or warm_start: torch's DDP regroups its buckets after "
                f"the first iteration, which would invalidate the per-bucket memory; use "
                f"start_powerSGD_iter >= 2, or turn both off"
            )
        self.iter = 0
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.next_stats_report = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["process_group"] = None  # a process group cannot be pickled
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.process_group = _comm.resolve_group(None)

    def maybe_increase_iter(self, bucket) -> None:
        """Count an iteration when the last bucket of a backward goes through."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("PowerSGD compression starts at iteration %d", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """``(compress_rate, numel_before, numel_after)`` summed over compressed calls."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after else 0.0
        return rate, self.total_numel_before_compression, after

    def _record(self, before: int, after: int) -> None:
        self.total_numel_before_compression += before
        self.total_numel_after_compression += after
        if self.iter >= self.next_stats_report:
            rate, b, a = self.compression_stats()
            logger.info("PowerSGD compression rate %.2f (%d -> %d numbers)", rate, b, a)
            self.next_stats_report = self.iter + self.compression_stats_logging_frequency

    def _seed(self, bucket_index: int) -> int:
        # The same on every rank: Q must be identical everywhere. Without warm start
        # each iteration draws a fresh Q.
        salt = 0 if self.warm_start else self.iter
        return (self.random_seed * 1_000_003 + bucket_index * 7_919 + salt * 104_729) % (2**62)


def _random_like(numel: int, seed: int, like: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return torch.randn(numel, generator=gen).to(device=like.device, dtype=like.dtype)


def _low_rank_product(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``p @ q.transpose(1, 2)`` for [batch, rows, r] and [batch, cols, r], bit-reproducibly.

    Decompression runs in a future's callback, i.e. on whichever thread completes the
    collective: a gloo worker thread or, when the collective has already finished, the
    caller's. A BLAS ``bmm`` does not give bitwise the same result on both (its kernel and
    thread team differ per calling thread), so runs differed in the last bits from step to
    step, and a resumed run drifted from a straight one. Built from r elementwise
    multiply-adds instead (r is the small approximation rank), each element is rounded the
    same way on any thread.
    """
    out = p[:, :, :1] * q[:, :, 0].unsqueeze(1)
    for j in range(1, p.shape[-1]):
        out.add_(p[:, :, j : j + 1] * q[:, :, j].unsqueeze(1))
    return out


def _orthogonalize_(p: torch.Tensor, eps: float) -> None:
    """Gram-Schmidt on the columns of ``p`` ([batch, rows, rank]), in place.

    A zero column stays zero instead of becoming NaN (torch's 0 / 0).
    """
    tiny = torch.finfo(p.dtype).tiny
    for i in range(p.shape[-1]):
        col = p[..., i : i + 1]
        norm = col.norm(dim=-2, keepdim=True)
        col.div_((norm + eps).clamp_min(tiny))
        if i + 1 < p.shape[-1]:
            rest = p[..., i + 1 :]
            rest.sub_(col * (col * rest).sum(dim=-2, keepdim=True))


def _take_residual(state: PowerSGDState, index: int, buffer: torch.Tensor) -> torch.Tensor | None:
    """Add last step's local error to the bucket; return a copy of the result."""
    if not state.use_error_feedback:
        return None
    err = state.error_dict.get(index)
    if err is not None and err.shape == buffer.shape and err.dtype == buffer.dtype:
        buffer.add_(err)
    return buffer.clone()


def _keep_residual(state, index, local, buffer) -> None:
    if local is not None:
        state.error_dict[index] = local.sub_(buffer)


def _split(bucket, buffer: torch.Tensor) -> list[torch.Tensor]:
    views, offset = [], 0
    for param in bucket.parameters():
        n = param.numel()
        views.append(buffer[offset : offset + n].view(param.shape))
        offset += n
    if offset != buffer.numel():
        raise RuntimeError(
            f"PowerSGD: bucket {bucket.index()} holds {buffer.numel()} numbers but its "
            f"parameters have {offset}"
        )
    return views


def _q_memory(state, index, numel, like, shapes) -> torch.Tensor:
    """Warm-started Q, or a fresh seeded one; degenerate (zero / non-finite) Qs are redrawn."""
    q = state.q_memory_dict.get(index)
    fresh = not state.warm_start or q is None or q.numel() != numel or q.dtype != like.dtype
    if fresh:
        q = _random_like(numel, state._seed(index), like)
        if state.warm_start:  # else drawn anew each time and not kept, as torch
            state.q_memory_dict[index] = q
        return q
    offset = 0
    for k, m, r in shapes:
        part = q[offset : offset + k * m * r]
        if not torch.isfinite(part).all() or not part.abs().amax() > 0:
            part.copy_(_random_like(part.numel(), state._seed(index) + offset + 1, like))
        offset += k * m * r
    return q


def _compressible(view: torch.Tensor, rank: int, min_rate: float) -> tuple[int, int, int] | None:
    """``(rows, cols, rank)`` of ``view`` as a matrix (a vector is one column, as torch
    views it), if compressing it sends fewer numbers (times ``min_rate``)."""
    if view.dim() < 1:
        return None
    rows = view.shape[0]
    cols = view.numel() // rows if rows else 0
    r = min(rank, rows, cols)
    if r == 0 or (rows + cols) * r * min_rate >= rows * cols:
        return None
    return rows, cols, r


def powerSGD_hook(state: PowerSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Compress each gradient matrix of the bucket to rank ``matrix_approximation_rank``.

    Example::

        state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10)
        ddp.register_comm_hook(state, powerSGD_hook)
    """
    _check_state(state)
    group = state.process_group
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return _comm.all_reduce_async(buffer, group, average=True)
    index = bucket.index()
    world = _comm.group_size(group)
    local = _take_residual(state, index, buffer)

    plain, mats = [], []
    for view in _split(bucket, buffer):
        shape = _compressible(view, state.matrix_approximation_rank, state.min_compression_rate)
        if shape is None:
            plain.append(view)
        else:
            mats.append((view.reshape(shape[0], shape[1]), shape))
    # Same-shape matrices next to each other become one batched matmul.
    if state.batch_tensors_with_same_shape:
        mats.sort(key=lambda item: item[1])
    groups: list[list] = []
    for item in mats:
        if groups and state.batch_tensors_with_same_shape and groups[-1][0][1] == item[1]:
            groups[-1].append(item)
        else:
            groups.append([item])
    shapes = [(len(g), g[0][1][0], g[0][1][2]) for g in groups]  # (k, rows, r) for P
    q_shapes = [(len(g), g[0][1][1], g[0][1][2]) for g in groups]  # (k, cols, r) for Q

    flat_plain = torch.cat([v.reshape(-1) for v in plain]) if plain else buffer.new_empty(0)
    plain_fut = _comm.all_reduce_async(flat_plain, group, average=True)

    p_mem = buffer.new_empty(sum(k * n * r for k, n, r in shapes))
    q_mem = _q_memory(state, index, sum(k * m * r for k, m, r in q_shapes), buffer, q_shapes)
    ps, qs, ms = [], [], []
    p_off = q_off = 0
    for grp, (k, n, r), (_, m, _) in zip(groups, shapes, q_shapes):
        p = p_mem[p_off : p_off + k * n * r].view(k, n, r)
        q = q_mem[q_off : q_off + k * m * r].view(k, m, r)
        mat = grp[0][0].unsqueeze(0) if k == 1 else torch.stack([g[0] for g in grp])
        torch.bmm(mat, q, out=p)
        ps.append(p)
        qs.append(q)
        ms.append(mat)
        p_off += k * n * r
        q_off += k * m * r
    if mats:
        _comm.all_reduce(p_mem, group)
        for p in ps:
            _orthogonalize_(p, state.orthogonalization_epsilon)
        for mat, p, q in zip(ms, ps, qs):
            torch.bmm(mat.transpose(1, 2), p, out=q)
    q_fut = _comm.all_reduce_async(q_mem, group) if mats else _comm.done(q_mem)
    state._record(buffer.numel(), flat_plain.numel() + p_mem.numel() + q_mem.numel())
    state.maybe_increase_iter(bucket)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()
        averaged_plain = plain_fut.wait()
        offset = 0
        for view in plain:
            view.copy_(averaged_plain[offset : offset + view.numel()].view_as(view))
            offset += view.numel()
        q_mem.div_(world)
        for grp, p, q in zip(groups, ps, qs):
            approx = _low_rank_product(p, q)
            for i, (mat, _) in enumerate(grp):
                mat.copy_(approx[i])
        _keep_residual(state, index, local, buffer)
        return buffer

    return torch.futures.collect_all([plain_fut, q_fut]).then(decompress)


def batched_powerSGD_hook(state: PowerSGDState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Compress the whole bucket as one square matrix: fastest, but coarser.

    The flat bucket is zero-padded to a side x side matrix, side = ceil(sqrt(numel)).
    """
    _check_state(state)
    group = state.process_group
    buffer = bucket.buffer()
    index = bucket.index()
    side = math.ceil(math.sqrt(buffer.numel()))
    rank = min(state.matrix_approximation_rank, side)
    too_small = 2 * side * rank * state.min_compression_rate >= buffer.numel()
    if state.iter < state.start_powerSGD_iter or too_small:
        state.maybe_increase_iter(bucket)
        return _comm.all_reduce_async(buffer, group, average=True)
    world = _comm.group_size(group)
    local = _take_residual(state, index, buffer)
    mat = buffer.new_zeros(side * side)
    mat[: buffer.numel()] = buffer
    mat = mat.view(1, side, side)
    q = _q_memory(state, index, side * rank, buffer, [(1, side, rank)]).view(1, side, rank)
    p = torch.bmm(mat, q)
    _comm.all_reduce(p, group)
    _orthogonalize_(p, state.orthogonalization_epsilon)
    torch.bmm(mat.transpose(1, 2), p, out=q)
    fut = _comm.all_reduce_async(q, group)
    state._record(buffer.numel(), p.numel() + q.numel())
    state.maybe_increase_iter(bucket)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        q_avg = fut.wait().div_(world)
        approx = _low_rank_product(p, q_avg).view(-1)
        buffer.copy_(approx[: buffer.numel()])
        _keep_residual(state, index, local, buffer)
        return buffer

    return fut.then(decompress)


def _check_state(state) -> None:
    if not isinstance(state, PowerSGDState):
        raise TypeError(
            f"PowerSGD hooks take a PowerSGDState as their state, got {type(state).__name__}; "
            f"register with ddp.register_comm_hook(PowerSGDState(...), powerSGD_hook)"
        )
