"""The manager's in-memory tiers: local copies, peer replicas, the restore agreement.

One :class:`TierEngine` per manager. ``save`` copies this rank's pieces into a reused
staging buffer (the only part the training loop waits for), then a background thread
writes the rank-local copy, exchanges replicas with the peers over a private gloo
group and applies retention. ``latest_step`` and ``restore`` gather every rank's
inventory (one all-gather of small JSON over the manager's control group) and agree on
each rank's source; see docs/checkpoint-manager.md, "Tiers and recovery".
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ...runtime._groups import private_group
from .._core._comm import Comm
from .._core._copy import copy_into
from .._core._errors import CheckpointError
from .._core._flatten import Flat, flatten
from .._core._zero_stall import Snapshot, Staging, copy_values, protect, wait_for_staging
from ._local import LocalStore, localized, shard_layout
from ._peer import exchange
from ._run import read_run_id
from ._tiers import (
    LocalTier,
    RestoreInfo,
    choose_latest,
    default_directory,
    layout_fingerprint,
    peer_map,
    persistent_steps,
    plan_sources,
)

if TYPE_CHECKING:
    from ._manager import CheckpointManager

__all__ = ["TierEngine", "TierMethods"]

log = logging.getLogger(__name__)

_PEER_TIMEOUT = datetime.timedelta(minutes=10)
_SLACK = 64 << 20  # metadata and headers on top of a shard's tensor bytes


def _machine() -> list:
    """This rank's machine, as every rank reports it: ``[index, hostname]``. The index is
    torchrun's ``GROUP_RANK`` (SLURM's node id; else ``RANK // LOCAL_WORLD_SIZE``), the
    hostname tells machines apart where no launcher says."""
    from ... import runtime

    try:
        index = runtime.host_index()
    except ValueError:  # a malformed variable: the hostname alone
        index = 0
    return [index, socket.gethostname()]


class TierEngine:
    """The local tier (and peer replicas) of one manager, on one rank."""

    def __init__(self, mgr: CheckpointManager, options: LocalTier) -> None:
        if not isinstance(options, LocalTier):
            raise TypeError(
                f"local_tier must be a LocalTier(...) or None, got {type(options).__name__}"
            )
        if mgr.read_only:
            raise ValueError(
                f"CheckpointManager({mgr.path!r}, read_only=True) cannot keep a local tier "
                "(it saves copies); pass local_tier=None to read, or read_only=False"
            )
        self.mgr = mgr
        self.options = options
        self.world = len(mgr._ranks)
        self.rank = mgr._rank
        self._default_dir = options.directory is None
        run = mgr._store.identity
        root = default_directory(run) if self._default_dir else os.fspath(options.directory)
        root = os.path.abspath(root)
        error = None
        try:
            if os.path.lexists(root) and not os.path.isdir(root):
                raise ValueError(
                    f"LocalTier(directory={root!r}) is not a directory; pass a directory "
                    "(or a path to create), or directory=None for node-local RAM (/dev/shm)"
                )
            self.store = LocalStore(root, run, self.rank, self.world)
        except (OSError, ValueError) as exc:
            error = exc
        # One exchange at construction: every rank's machine (so all ranks build the
        # same replica ring, whatever LOCAL_WORLD_SIZE each was given) and errors (so a
        # bad directory on one machine raises on every rank, not a hang in new_group).
        mine = {
            "machine": _machine(),
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "history": uuid.uuid4().hex,
        }
        comm = Comm(mgr._ctrl) if mgr._ctrl is not None else Comm(None, local=True)
        everyone = comm.all_gather_json(mine)
        if error is not None:
            if isinstance(error, ValueError):
                raise error
            raise ValueError(
                f"LocalTier(directory={root!r}) cannot be used: {error}; pass a directory "
                "this process can create and write"
            ) from error
        bad = [(r, e["error"]) for r, e in enumerate(everyone) if e["error"] is not None]
        if bad:
            raise ValueError(
                f"the local checkpoint tier cannot start on rank(s) {[r for r, _ in bad]}: "
                f"{bad[0][1]} (see that rank's error)"
            )
        #: the manager instance that saves the copies (one per training, agreed by rank 0)
        self.history: str = everyone[0]["history"]
        #: the instance of the run directory the copies belong to (see _run.py)
        self.run_id: str | None = None
        use_peer = options.peer and self.world > 1
        peers = peer_map([e["machine"] for e in everyone]) if use_peer else None
        self.peer = None if peers is None else peers[self.rank]
        self.source = None if peers is None else peers.index(self.rank)
        self._peer_group = None
        if use_peer:  # collective: every rank constructs the manager
            self._peer_group = private_group(mgr._ranks, owner=self, timeout=_PEER_TIMEOUT)
        self.last_step: int | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardkit-tier")
        self._job: Future | None = None
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        self._staged: dict[str, torch.Tensor] = {}
        self._pending: tuple[int, Flat, dict, int] | None = None
        self._pending_error: BaseException | None = None
        self._peak = 0
        self.last_restore: RestoreInfo | None = None
        self._wrote = False  # saved a copy (see _may_remove)
        self._restored = False  # restored a step (see _may_remove)
        self._ignored_runs = False  # logged the copies of another run directory instance

    # -- saving ---------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return step % self.options.interval == 0 and (
            self.last_step is None or step > self.last_step
        )

    def set_run_id(self, run_id: str) -> None:
        """The run directory's id (see ``_run.py``), recorded in every copy saved."""
        self.run_id = run_id

    def prepare(self, step: int, state_dict: dict) -> int:
        """Before the save's agreement: this rank's shard bytes if due, 0 if not, -1 on error."""
        self._pending, self._pending_error = None, None
        if not self.due(step):
            return 0
        try:
            flat = flatten(state_dict, for_save=True)
            if flat.objects:
                key = next(iter(flat.objects))
                raise TypeError(
                    f"key {key!r}: a {type(flat.objects[key]).__name__} is neither a tensor "
                    "nor a JSON value; the local tier saves tensors and JSON values only"
                )
            layout = shard_layout(flat)
            nbytes = sum(
                leaf.local.numel() * leaf.local.element_size() for leaf in flat.tensors.values()
            )
        except Exception as exc:  # raised on every rank after the agreement
            self._pending_error = exc
            return -1
        self._pending = (step, flat, layout, nbytes)
        return nbytes

    def save(self, step: int, lo: int, hi: int, *, persisted: bool = False) -> bool:
        """After the agreement: stage and start the background write (if due).
        ``persisted``: this call also saves ``step`` to the persistent tier (recorded
        in the copy: only then may a restore combine the two)."""
        pending, self._pending = self._pending, None
        if lo < 0:
            error, self._pending_error = self._pending_error, None
            if error is not None:
                raise error
            raise CheckpointError(
                f"the local checkpoint tier could not save step {step} on another rank "
                "(see that rank's error)"
            )
        if pending is None or pending[0] != step:
            return False
        _, flat, layout, nbytes = pending
        self._check_bound(step, hi)
        # The staging buffer is reused: the previous write must be done. Its failure, if
        # any, is raised at the next call, after the ranks agreed on it (so all raise).
        self._wait_job()
        wait_for_staging()  # one staging at a time per process (an async save's, or ours)
        # zero-stall: clones what no optimizer owns, now (or all of it, when opted out)
        snapshot = protect(flat) if self.mgr.zero_stall else None
        tensors, staging = None, None
        if snapshot is None:  # nothing an optimizer owns: copy it all in the call
            copy_values(flat)
            tensors = self._stage(flat, None)
        else:  # optimizer steps wait until the background thread has copied it
            staging = Staging()
            staging.start()
        self.last_step = step
        self._wrote = True
        mark = {"run": self.run_id, "history": self.history, "persisted": bool(persisted)}
        self._job = self._pool.submit(
            self._background, step, flat, tensors, snapshot, staging, layout, hi, mark
        )
        return True

    def wait_staging(self) -> None:
        """Wait until this rank's pieces are staged (before another save stages)."""
        wait_for_staging()

    def _check_bound(self, step: int, hi: int) -> None:
        cap = self.options.max_bytes
        if cap is None:
            return
        keep = self.options.max_to_keep
        # a save writes into the oldest copy's files (see LocalStore.recycle), except with
        # max_to_keep=1, where the one copy stays whole until the new one is in place
        copies = max(keep, 2)
        per_step = hi * (2 if self._peer_group is not None else 1)
        need = copies * per_step
        if need > cap:
            why = "max_to_keep" if keep >= 2 else "max_to_keep=1 + the one being written"
            raise ValueError(
                f"the local checkpoint tier needs up to {need} bytes per rank at step {step} "
                f"({copies} steps ({why}) x {per_step} bytes (largest shard {hi}"
                f"{' + its peer replica' if self._peer_group is not None else ''})), more than "
                f"LocalTier(max_bytes={cap}); raise max_bytes, lower max_to_keep, or pass "
                "peer=False"
            )

    def _stage(self, flat: Flat, snapshot: Snapshot | None) -> dict[str, torch.Tensor]:
        """Copy this rank's pieces into the reused CPU staging buffers; with a
        ``snapshot``, check after each copy that nothing changed it since the call."""
        out, cuda = {}, []
        with torch.no_grad():
            for key, leaf in flat.tensors.items():
                src = leaf.local
                buf = self._staged.get(key)
                if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                    buf = torch.empty(src.shape, dtype=src.dtype)
                    with self._lock:  # tier_memory() reads it from the training thread
                        self._staged[key] = buf
                if src.device.type == "cpu":
                    copy_into(buf, src)
                    if snapshot is not None:
                        snapshot.check(key)
                else:
                    buf.copy_(src)
                    cuda.append(key)
                out[key] = buf
        if cuda and snapshot is not None:
            torch.cuda.synchronize()
            for key in cuda:
                snapshot.check(key)
        with self._lock:
            for key in [k for k in self._staged if k not in flat.tensors]:
                del self._staged[key]
        self._track()
        return out

    def _background(self, step, flat, tensors, snapshot, staging, layout, hi, mark) -> None:
        path, error, keep = None, None, self.options.max_to_keep
        try:
            if staging is not None:
                try:
                    tensors = self._stage(flat, snapshot)
                finally:
                    staging.finish()
            self._drop_newer(step - 1)
            path = self.store.write_own(
                step, localized(flat, tensors), layout, keep=keep, mark=mark
            )
            if snapshot is not None:
                try:
                    snapshot.final()  # an in-place op that ran during the copy
                except CheckpointError:
                    self.store.remove_step("local", self.rank, step)
                    path = None
                    raise
            self.store.retain("local", self.rank, keep)
        except BaseException as exc:
            error = exc
        finally:
            if snapshot is not None:
                snapshot.forget()
        if self._peer_group is not None:  # always take part, so the peers stay in step
            try:
                got = exchange(
                    self._peer_group, step=step, send_to=self.peer, send_path=path,
                    recv_from=self.source, store=self.store, recv_kind="replica",
                    recv_src=self.source, cap=hi + _SLACK, keep=keep,
                )  # fmt: skip
                if got is None:
                    log.warning(
                        "local checkpoint tier: rank %d sent no replica for step %d",
                        self.source, step,
                    )  # fmt: skip
                self.store.retain("replica", self.source, keep)
            except BaseException as exc:
                error = error or exc
        self._track()
        if error is not None:
            err = CheckpointError(f"local checkpoint tier: saving step {step} failed: {error}")
            err.__cause__ = error
            with self._lock:
                self._errors.append(err)

    def _track(self) -> None:
        mem = self.memory()
        self._peak = max(self._peak, mem["local"] + mem["replica"] + mem["staging"])

    def memory(self) -> dict[str, int]:
        local = self.store.bytes_of("local", self.rank)
        replica = self.store.bytes_of("replica", self.source)
        with self._lock:
            staging = sum(t.numel() * t.element_size() for t in self._staged.values())
        peak = max(self._peak, local + replica + staging)
        return {"local": local, "replica": replica, "staging": staging, "peak": peak}

    def has_error(self) -> bool:
        with self._lock:
            return bool(self._errors)

    def _raise_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def raise_agreed_error(self) -> None:
        """Some rank's background tier work failed: raise it here (or say where it failed)."""
        self._wait_job()
        self._raise_errors()
        raise CheckpointError(
            "the local checkpoint tier failed on another rank (see that rank's error)"
        )

    def _wait_job(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            job.result()

    def join(self) -> None:
        self._wait_job()
        self._raise_errors()

    # -- agreement ------------------------------------------------------------------------
    def _inventory(self, fp: str | None) -> list[dict]:
        mine: dict[str, Any] = {
            "fp": fp, "copies": self.store.scan(), "persistent": [], "history": uuid.uuid4().hex
        }  # fmt: skip
        if self.mgr._is_coordinator:
            try:
                mine["persistent"] = self.mgr._store.committed_steps()
                mine["run"] = read_run_id(self.mgr._store)
            except Exception as exc:  # every rank raises it below
                mine["error"] = f"{type(exc).__name__}: {exc}"
        comm = Comm(self.mgr._ctrl) if self.mgr._ctrl is not None else Comm(None, local=True)
        invs = comm.all_gather_json(mine)
        for entry in invs:
            if "error" in entry:
                raise CheckpointError(f"listing checkpoints under {self.mgr.path} failed: "
                                      f"{entry['error']}")  # fmt: skip
        # Only copies of this instance of the run directory: one removed and started
        # again under the same path is a new run, whose restore must not find the old
        # run's copies (they stay until this run's saves and retention remove them).
        run = next((e["run"] for e in invs if "run" in e), None)
        ignored = 0
        for entry in invs:
            kept = [c[:6] for c in entry["copies"] if run is not None and c[6] == run]
            ignored += len(entry["copies"]) - len(kept)
            entry["copies"] = kept
        if ignored and self.rank == 0 and not self._ignored_runs:
            self._ignored_runs = True
            log.warning(
                "local checkpoint tier: ignoring %d RAM cop%s saved for an earlier instance "
                "of %s (its directory was removed or replaced since, or holds no %s): a new "
                "run does not resume them", ignored, "y" if ignored == 1 else "ies",
                self.mgr.path, "manager.run",
            )  # fmt: skip
        return invs

    def latest_step(self) -> int | None:
        self._wait_job()
        return choose_latest(self._inventory(None))

    def restore(self, step: int, state_dict: dict) -> None:
        start = time.perf_counter()
        self._wait_job()
        flat = flatten(state_dict, for_save=False)
        fp = layout_fingerprint(shard_layout(flat))
        invs = self._inventory(fp)
        stale = sorted(
            {c[0] for e in invs for c in e["copies"] if c[1] == step and c[3] != invs[c[0]]["fp"]}
        )
        if stale and self.rank == 0:
            log.warning(
                "local checkpoint tier: step %d was saved with another layout of rank(s) %s's "
                "shards than the state dict given now; those ranks use another source",
                step, stale,
            )  # fmt: skip
        comm = Comm(self.mgr._ctrl) if self.mgr._ctrl is not None else Comm(None, local=True)
        excluded: set[tuple] = set()
        for _ in range(4):
            plan = plan_sources(invs, step, excluded)
            missing = [r for r, p in enumerate(plan) if p is None]
            if missing:
                avail = choose_latest(invs, check_layout=True)
                raise CheckpointError(
                    f"step {step} cannot be restored: no tier holds the shard of rank(s) "
                    f"{missing} (local, peer replica, or the persistent steps "
                    f"{persistent_steps(invs)} under {self.mgr.path}); the newest step "
                    f"restorable into this state dict is {avail}"
                    + (self._layout_difference(step, state_dict) if stale else "")
                )
            error = self._transfer_and_load(step, plan, flat, state_dict, fp)
            failed = comm.all_gather_json(None if error is None else str(error))
            bad = {r: msg for r, msg in enumerate(failed) if msg is not None}
            if not bad:
                tiers = [p[0] for p in plan]
                self.last_restore = RestoreInfo(
                    step, tiers[self.rank], tiers, time.perf_counter() - start
                )
                fell_back = [r for r, t in enumerate(tiers) if t == "persistent"]
                if self.rank == 0 and fell_back:
                    log.warning(
                        "restored step %d; rank(s) %s read the persistent tier (no usable RAM "
                        "copy); tier by rank: %s", step, fell_back, tiers,
                    )  # fmt: skip
                elif self.rank == 0:
                    log.info("restored step %d; tier by rank: %s", step, tiers)
                self.last_step = step
                self._restored = True
                self.history = invs[0]["history"]  # copies saved from here on: a new history
                if self._may_remove():  # else the first save drops them (_background)
                    self._drop_newer(step)
                return
            for r, msg in bad.items():
                if plan[r][0] == "persistent":
                    raise CheckpointError(
                        f"restoring step {step} from {self.mgr.path} failed on rank {r}: {msg}"
                    )
                log.warning(
                    "local checkpoint tier: rank %d could not use its %s copy of step %d (%s); "
                    "trying the next source", r, plan[r][0], step, msg,
                )  # fmt: skip
                excluded.add((r, plan[r][1], plan[r][2]))
        raise CheckpointError(f"restoring step {step}: every source failed")

    def _layout_difference(self, step: int, state_dict: dict) -> str:
        """How this rank's RAM copy of ``step`` differs from ``state_dict`` (keys, shapes),
        or ''. Only for the error: copies of another layout are skipped (did the model or
        optimizer change, or is only a part of the saved state restored?)."""
        from .._core._load import read_metadata

        try:
            md = read_metadata(self.store.copy_path("local", self.rank, step))
        except (CheckpointError, OSError):
            return ""
        flat = flatten(state_dict, for_save=False, saved_parents=md.key_parents)
        wanted, saved = set(flat.tensors) | set(flat.slots), set(md.keys())
        shapes = [
            f"{k!r} {list(md.tensors[k].shape)} saved, {list(flat.tensors[k].shape)} given"
            for k in sorted(wanted & saved)
            if k in md.tensors and k in flat.tensors
            and tuple(md.tensors[k].shape) != tuple(flat.tensors[k].shape)
        ]  # fmt: skip
        parts = [
            f"{what} {keys[:5]}{' ...' if len(keys) > 5 else ''}"
            for what, keys in (
                ("keys missing from the copy", sorted(wanted - saved)),
                ("keys only in the copy", sorted(saved - wanted)),
                ("other shapes", shapes),
            )
            if keys
        ]
        if not parts:
            return ""
        return (
            f". This rank's RAM copy of step {step} holds another state than the one given "
            f"({'; '.join(parts)}): the RAM tier restores the whole saved state into the same "
            "keys and shapes; restore a persistent step to load a part of it or a changed model"
        )

    def _drop_newer(self, step: int) -> None:
        """Remove own copies and held replicas newer than ``step``: an abandoned timeline."""
        for kind, src in (("local", self.rank), ("replica", self.source)):
            if src is None:
                continue
            for s in self.store.steps(kind, src):
                if s > step and self.store._ours(self.store.copy_path(kind, src, s)):
                    self.store.remove_step(kind, src, s)

    def _transfer_and_load(self, step, plan, flat: Flat, state_dict: dict, fp: str) -> str | None:
        """Run every transfer this rank takes part in (in one global order), then load."""
        me = self.rank
        got: str | None = None
        error: BaseException | None = None
        nbytes = sum(
            leaf.local.numel() * leaf.local.element_size() for leaf in flat.tensors.values()
        )
        transfers = sorted(
            (r, p[1], p[2]) for r, p in enumerate(plan) if p[0] == "peer" and p[1] != r
        )
        for r, holder, kind in transfers:
            if holder == me:
                path = self.store.copy_path(kind, r, step)
                if self.store.check_copy(path, r, step) is None:
                    path = None  # gone since the inventory: the receiver gets "nothing"
                try:
                    exchange(self.mgr._ctrl, step=step, send_to=r, send_path=path)
                except BaseException as exc:  # the receiver reports the failure
                    log.warning("sending rank %d's copy of step %d failed: %s", r, step, exc)
            elif r == me:
                try:
                    self.store.remove_step("local", me, step)  # a torn own copy, if any
                    got = exchange(
                        self.mgr._ctrl, step=step, recv_from=holder, store=self.store,
                        recv_kind="local", recv_src=me, cap=2 * nbytes + (64 << 20),
                    )  # fmt: skip
                    if got is None:
                        error = CheckpointError(f"rank {holder} no longer holds the copy")
                except BaseException as exc:
                    error = exc
        if error is not None:
            return f"{type(error).__name__}: {error}"
        tier, holder, kind = plan[me]
        try:
            if tier == "persistent":
                from . import _io as io

                io.load_step(self.mgr, step, state_dict, alone=True)
            else:
                path = got if got is not None else self.store.copy_path(kind, me, step)
                self.store.load_copy(path, flat, fp)
        except BaseException as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    # -- lifecycle --------------------------------------------------------------------------
    def _may_remove(self) -> bool:
        """Whether this manager may delete copies of its run: it saved some, or it
        restored a step and no live writer holds the run's lease. A restarted job that
        only restored cleans up on a clean exit; a manager opened beside a running
        trainer (an evaluator) never deletes the trainer's copies, and one that never
        used them (a restore that failed: the wrong model, say) leaves them for the
        program that can."""
        if self._wrote or self.mgr._writing:
            return True
        if not self._restored:
            return False
        try:
            lease = self.mgr._lease.read()
        except Exception:  # unreadable: keep the copies
            return False
        return lease is None or not self.mgr._lease.is_live(lease)

    def close(self, *, remove: bool) -> None:
        try:
            self._wait_job()
        finally:
            self._pool.shutdown(wait=True)
            self._staged.clear()
            if remove and self._may_remove():
                self.store.remove("local", self.rank)
                if self.source is not None:
                    self.store.remove("replica", self.source)
                self.store.remove_stale(replicas=self.source is not None)  # a former world's
                self.store.prune_empty(parent=self._default_dir)
        self._raise_errors()


class TierMethods:
    """The tier queries of :class:`CheckpointManager` (kept here to keep it short)."""

    _tiers: TierEngine | None

    @property
    def last_restore(self) -> RestoreInfo | None:
        """Where the last :meth:`restore` read from (with a local tier), else None."""
        return None if self._tiers is None else self._tiers.last_restore

    def tier_memory(self) -> dict[str, int]:
        """Bytes this rank holds in the local tier: ``local``, ``replica``, ``staging``, ``peak``."""
        if self._tiers is None:
            return {"local": 0, "replica": 0, "staging": 0, "peak": 0}
        return self._tiers.memory()
