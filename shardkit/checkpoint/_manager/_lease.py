"""The writer's lease on a run directory: one writing CheckpointManager per directory.

The lease is the file ``<path>/manager.lease``: JSON naming the owner (host, pid and a
random id per manager) and when the lease expires. Only the coordinator of the writing
manager holds it. It is written atomically (a temporary file moved into place on local
disks, one PUT on object stores), checked before every save (the fencing: a writer
that lost it stops) and renewed by a background heartbeat, so it stays live while the
writer runs and expires ``ttl`` seconds after the writer stops. Works on any fsspec filesystem: no locks, no rename on object stores.

A lease is live until it expires, except that a lease whose owner ran on this host
under a pid that no longer exists is dead at once (a crashed trainer restarted on the
same machine). Anyone may take over a lease with ``take_over=True``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ... import runtime
from .._core._errors import CheckpointError
from .._core._fs_rules import publish_file
from .._core._storage import parse_json, read_small_file

__all__ = ["LEASE_FILE", "Lease", "LeaseHeldError", "LeaseLostError"]

log = logging.getLogger(__name__)

LEASE_FILE = "manager.lease"
_MAX_LEASE_BYTES = 4096


class LeaseHeldError(CheckpointError):
    """Another writer holds the lease on the run directory."""


class LeaseLostError(CheckpointError):
    """This writer's lease was taken over (or expired and was taken) by another writer."""


def _pid_alive(pid: Any) -> bool:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def describe(doc: dict) -> str:
    """``owner 'o' (host h, pid p), live until <UTC time>`` for error messages."""
    expires = doc.get("expires")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires))
        if isinstance(expires, (int, float))
        else "?"
    )
    return (
        f"owner {doc.get('owner')!r} (host {doc.get('host')!r}, pid {doc.get('pid')!r}), "
        f"live until {when}"
    )


class Lease:
    """The lease file of one run directory, seen by one manager (its coordinator)."""

    def __init__(self, fs, root: str, *, ttl: float) -> None:
        self.fs, self.root, self.ttl = fs, root, float(ttl)
        self.local = isinstance(fs, LocalFileSystem)
        self.path = f"{root}/{LEASE_FILE}"
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.held = False
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: LeaseLostError | None = None
        self._renew_lock = threading.Lock()

    # -- file I/O ---------------------------------------------------------------------
    def read(self) -> dict | None:
        """The current lease, or None when there is none (an unreadable one: stale)."""
        try:
            if self.local:  # never through a symlink; a planted FIFO does not block
                raw = read_small_file(self.path, _MAX_LEASE_BYTES)
            else:
                self.fs.invalidate_cache(self.root)
                raw = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None
        except OSError as exc:  # e.g. a symlink planted as the lease: ELOOP
            raise CheckpointError(f"cannot read the lease {self.path}: {exc}") from None
        try:
            doc = parse_json(raw[:_MAX_LEASE_BYTES])
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("owner"), str):
            log.warning("ignoring an unreadable lease file %s", self.path)
            return {"owner": None, "expires": 0, "unreadable": True}
        return doc

    def _doc(self) -> dict:
        return {
            "owner": self.owner,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "ttl": self.ttl,
            "expires": time.time() + self.ttl,
        }

    def _write(self, *, exclusive: bool) -> bool:
        """Write our lease; with ``exclusive``, only if none exists (False if one does)."""
        raw = json.dumps(self._doc(), sort_keys=True).encode()
        if not self.local:
            self.fs.makedirs(self.root, exist_ok=True)
            publish_file(self.fs, self.path, raw)
            return True
        os.makedirs(self.root, exist_ok=True)
        tmp = f"{self.path}.tmp-{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0))
        try:
            try:
                os.write(fd, raw)
            finally:
                os.close(fd)
            if exclusive:
                try:
                    os.link(tmp, self.path)  # atomic create-if-absent
                except FileExistsError:
                    return False
            else:
                os.replace(tmp, self.path)  # replaces a planted symlink, never follows it
        finally:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
        return True

    # -- protocol -----------------------------------------------------------------------
    def is_live(self, doc: dict) -> bool:
        """Whether ``doc`` (another owner's lease) still excludes us."""
        expires = doc.get("expires")
        if not isinstance(expires, (int, float)) or time.time() >= expires:
            return False
        if doc.get("host") == socket.gethostname() and not _pid_alive(doc.get("pid")):
            return False  # its process is gone from this host: a crash
        return True

    def acquire(self, *, take_over: bool) -> None:
        """Take the lease or raise :class:`LeaseHeldError` naming its owner."""
        if self.local and self._write(exclusive=True):
            self.held = True
            return
        current = self.read()
        if current is not None and current.get("owner") not in (None, self.owner):
            if self.is_live(current) and not take_over:
                raise LeaseHeldError(
                    f"{self.root} is being written by another CheckpointManager: lease "
                    f"{self.path} has {describe(current)}. Only one writer may use a run "
                    "directory; open this one with read_only=True to read it, wait until "
                    f"the lease expires (up to {current.get('ttl', self.ttl)} s after its "
                    "writer stops), or pass take_over_lease=True if that writer is gone"
                )
            log.warning("taking over the lease of %s: %s", self.root, describe(current))
        self._write(exclusive=False)
        check = self.read()
        if check is None or check.get("owner") != self.owner:
            raise LeaseHeldError(
                f"another writer took the lease {self.path} at the same time: "
                f"{describe(check or {})}"
            )
        self.held = True

    def renew(self, *, force: bool = True) -> None:
        """Check that the lease is still ours (:class:`LeaseLostError` if not) and extend it.

        Without ``force`` the lease is only rewritten when less than half its ttl is
        left (the heartbeat keeps it fresher), so a save costs one read of it.
        """
        with self._renew_lock:
            self._renew(force)

    def _renew(self, force: bool) -> None:
        if self.lost is not None:
            raise self.lost
        current = self.read()
        if current is not None and current.get("unreadable"):
            # torn by a failed write (ours, on a store without atomic writes): no other
            # writer is named, so the holder puts its lease back rather than stop saving
            log.warning("rewriting the unreadable lease %s, held by this manager", self.path)
            self._write(exclusive=False)
            return
        if current is None or current.get("owner") != self.owner:
            self.held = False
            self.lost = LeaseLostError(
                f"this CheckpointManager lost its lease on {self.root}: "
                + (f"{describe(current)}" if current else "the lease file was removed")
                + "; another writer took over the directory, so this one stops saving"
            )
            raise self.lost
        expires = current.get("expires")
        if force or not isinstance(expires, (int, float)) or expires - time.time() < self.ttl / 2:
            self._write(exclusive=False)

    def release(self) -> None:
        """Stop the heartbeat and remove our lease if it is still ours."""
        self.stop_heartbeat()
        if not self.held or os.getpid() != self._pid:
            return  # a forked child (a data loader worker) never releases its parent's
        self.held = False
        try:
            current = self.read()
            if current is not None and current.get("owner") == self.owner:
                self.fs.rm_file(self.path) if not self.local else os.remove(self.path)
        except Exception as exc:  # it simply expires
            log.warning("could not release the lease %s: %s", self.path, exc)

    # -- heartbeat -----------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        """Renew every ttl/3 seconds from a daemon thread until released or lost."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._beat, name="shardkit-lease-heartbeat", daemon=True
        )
        self._thread.start()
        _beating.add(self)

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.renew()
            except LeaseLostError as exc:
                log.error("%s", exc)
                return
            except Exception as exc:  # a transient storage error: try again next beat
                log.warning("could not renew the lease %s: %s", self.path, exc)

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat thread (waits for it)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()


# a manager the user never closes still has its heartbeat at exit: stop it before
# shardkit's teardown (which requires that no shardkit thread outlives it); the lease
# itself is kept and simply expires, as after a crash
_beating: weakref.WeakSet[Lease] = weakref.WeakSet()


@runtime.at_teardown
def _stop_heartbeats() -> None:
    for lease in list(_beating):
        lease.stop_heartbeat()
