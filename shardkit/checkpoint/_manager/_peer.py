"""Moving one rank-local copy between ranks over a gloo group (replicas and restores).

A copy travels as: its header length (an int64, -1 for "nothing to send"), the header
(JSON: the step and each file's name and size), then each file's bytes in 16 MiB
pieces. Senders map their files and send them as they are; receivers map files in a
temporary directory (reusing the files of their oldest copy, when retention would
delete it next) and receive straight into them, so a replica costs no extra buffer. The
header is hostile until checked (plain names, a bounded count and total size); the
received copy is checked like any local copy (commit, sizes, ``tier.json``) before it
is renamed into place, and its checksums are verified when it is loaded.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from typing import Any

import torch
import torch.distributed as dist

from .._core._errors import CheckpointError, CorruptCheckpointError
from ._local import LocalStore, drop_spares, take_spare

__all__ = ["exchange", "copy_files"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
_MAX_FILES = 4096
_HEADER_MAX = 1 << 20
_PIECE = 16 << 20


def copy_files(path: str) -> list[list]:
    """``[name, size]`` of every regular file of a copy, by name."""
    out = []
    for name in sorted(os.listdir(path)):
        p = os.path.join(path, name)
        if os.path.islink(p) or not os.path.isfile(p):
            continue
        out.append([name, os.path.getsize(p)])
    return out


def _map(path: str, size: int, maps: list, *, receive: bool) -> torch.Tensor:
    """A uint8 tensor over the ``size`` bytes of the file at ``path`` (a received file is
    created or cut to that size), mapped shared and populated at once: one call instead
    of a page fault per 4 KiB, which on a RAM disk cost more than the transfer itself.
    The sender's map is writable only because a tensor cannot wrap a read-only buffer;
    nothing writes to it."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if receive else 0), 0o600)
    try:
        if os.fstat(fd).st_size != size:
            if not receive:  # changed since its header was sent: never map past its end
                raise OSError(f"{path} is no longer {size} bytes long")
            os.ftruncate(fd, size)
        if receive and hasattr(os, "posix_fallocate"):
            # reserve the space now: a full RAM disk is then ENOSPC here, before anything
            # is posted, instead of SIGBUS when the receive writes into the mapping
            os.posix_fallocate(fd, 0, size)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    maps.append(mm)
    return torch.frombuffer(mm, dtype=torch.uint8)


def _pieces(tensor: torch.Tensor, peer: int) -> list[tuple[torch.Tensor, int]]:
    """``(piece, peer)`` for the ``_PIECE``-byte pieces of a file's tensor: several
    messages in flight move faster over gloo than one large one."""
    return [(tensor[i : i + _PIECE], peer) for i in range(0, tensor.numel(), _PIECE)]


def _unmap(maps: list) -> None:
    while maps:
        try:
            maps.pop().close()
        except BufferError:  # a tensor still views it: unmapped when that goes
            pass


def _receive_into(
    path: str, spares: list[str], in_files: list[list], peer: int, maps: list
) -> list[tuple[torch.Tensor, int]]:
    """Create (or reuse a spare for) each announced file in the temporary copy ``path``,
    with its space reserved; the ``(piece, peer)`` receives that fill them."""
    recvs = []
    for name, size in in_files:
        target = os.path.join(path, name)
        take_spare(spares, target)
        if size:
            recvs += _pieces(_map(target, size, maps, receive=True), peer)
        else:
            open(target, "wb").close()
    drop_spares(spares)
    return recvs


def _check_header(header: Any, step: int, cap: int) -> list[list]:
    if not isinstance(header, dict) or header.get("step") != step:
        raise CorruptCheckpointError(f"peer copy header is not for step {step}: {header!r:.200}")
    files = header.get("files")
    if not isinstance(files, list) or len(files) > _MAX_FILES:
        raise CorruptCheckpointError("peer copy header: bad file list")
    total, names = 0, set()
    for entry in files:
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or not isinstance(entry[0], str)
            or not _NAME.match(entry[0])
            or isinstance(entry[1], bool)
            or not isinstance(entry[1], int)
            or entry[1] < 0
        ):
            raise CorruptCheckpointError(f"peer copy header: bad file entry {entry!r:.200}")
        if entry[0] in names:
            raise CorruptCheckpointError(f"peer copy header: file {entry[0]!r} named twice")
        names.add(entry[0])
        total += entry[1]
    if total > cap:
        raise CorruptCheckpointError(
            f"peer copy of step {step} announces {total} bytes, more than the {cap} expected"
        )
    return files


def _post(group: Any, sends: list, recvs: list) -> None:
    """Post every ``(tensor, peer)`` send and receive, then wait for all of them."""
    works = [dist.isend(t, group=group, group_dst=p) for t, p in sends]
    works += [dist.irecv(t, group=group, group_src=p) for t, p in recvs]
    for w in works:
        w.wait()


def exchange(
    group: Any,
    *,
    step: int,
    send_to: int | None = None,
    send_path: str | None = None,
    recv_from: int | None = None,
    store: LocalStore | None = None,
    recv_kind: str = "replica",
    recv_src: int | None = None,
    cap: int = 0,
    keep: int = 1,
) -> str | None:
    """Send the copy at ``send_path`` to group rank ``send_to`` (None path: send "nothing")
    while receiving one from ``recv_from`` into ``store`` as ``recv_kind`` of rank
    ``recv_src``. Returns the received copy's path, or None when the sender had nothing.
    With ``keep`` >= 2 the receiver reuses the files of its oldest copy, as
    :meth:`LocalStore.recycle` says.

    Four phases, each posted in both directions before waiting (so a ring of exchanges
    cannot deadlock): header lengths, headers, the receiver's accept/refuse answer, and
    the files (only when accepted). Raises :class:`CorruptCheckpointError` for a refused
    header or an invalid copy, after the pair finished its phases.
    """
    maps: list = []
    try:
        # the sender maps its files before announcing them: a copy that cannot be mapped
        # (gone, changed, no memory) is sent as "nothing", so no receiver posts receives
        # for bytes that never come and waits out the group's timeout
        files, sends = _open_copy(send_path, send_to, maps) if send_to is not None else (None, [])
        raw = b"" if files is None else json.dumps({"step": step, "files": files}).encode()
        return _run_phases(
            group, step=step, send_to=send_to, raw=raw, sends=sends, recv_from=recv_from,
            store=store, recv_kind=recv_kind, recv_src=recv_src, cap=cap, keep=keep, maps=maps,
        )  # fmt: skip
    finally:
        _unmap(maps)


def _open_copy(path: str | None, peer: int, maps: list) -> tuple[list[list] | None, list]:
    """The ``[name, size]`` list of the copy at ``path`` and the ``(piece, peer)`` sends
    of its mapped files; ``(None, [])`` (send "nothing") if any file cannot be listed or
    mapped."""
    if path is None:
        return None, []
    sends: list = []
    try:
        files = copy_files(path)
        for name, size in files:
            if size:
                sends += _pieces(_map(os.path.join(path, name), size, maps, receive=False), peer)
        return files, sends
    except OSError:
        sends.clear()
        _unmap(maps)
        return None, []


def _run_phases(
    group, *, step, send_to, raw, sends, recv_from, store, recv_kind, recv_src, cap, keep, maps
) -> str | None:
    """The four phases of :func:`exchange`, with the sender's files already mapped."""
    sending, receiving = send_to is not None, recv_from is not None
    # 1. header lengths (-1: nothing to send)
    out_len = torch.tensor([len(raw) if raw else -1], dtype=torch.int64)
    in_len = torch.zeros(1, dtype=torch.int64)
    _post(
        group, [(out_len, send_to)] if sending else [], [(in_len, recv_from)] if receiving else []
    )
    n_in = int(in_len.item()) if receiving else -1
    error: Exception | None = None
    if n_in > _HEADER_MAX:
        error, n_in = CorruptCheckpointError(f"peer copy header of {n_in} bytes refused"), -1
    # 2. headers
    header = torch.empty(max(n_in, 0), dtype=torch.uint8)
    _post(
        group,
        [(torch.frombuffer(bytearray(raw), dtype=torch.uint8), send_to)] if raw else [],
        [(header, recv_from)] if n_in > 0 else [],
    )
    in_files: list[list] = []
    if n_in > 0:
        try:
            in_files = _check_header(json.loads(bytes(header.numpy())), step, cap)
        except ValueError as exc:
            error = CorruptCheckpointError(f"peer copy header of step {step} is not JSON: {exc}")
        except CorruptCheckpointError as exc:
            error = exc
    # 3. the receiver makes room for the copy (space reserved), then answers the sender:
    # a receiver that cannot take it refuses here, so no sender waits on a send forever
    recvs, tmp = [], None
    try:
        if n_in > 0 and error is None:
            assert store is not None and recv_src is not None
            try:
                tmp, spares = store.recycle(recv_kind, recv_src, step, keep)
                recvs = _receive_into(tmp, spares, in_files, recv_from, maps)
            except Exception as exc:  # e.g. ENOSPC on the RAM disk; any error refuses
                # here, so the pair's messages stay in step (an unanswered sender would
                # take this rank's next message for the answer)
                where = (
                    f"the copy of rank {recv_src}'s shard at step {step} from group rank "
                    f"{recv_from} into {tmp or store.root}"
                )
                error = (
                    OSError(exc.errno, f"cannot take {where}: {exc.strerror or exc}")
                    if isinstance(exc, OSError)
                    else CheckpointError(f"cannot take {where}: {type(exc).__name__}: {exc}")
                )
                recvs = []  # the maps made so far go in `finally`
        accept = torch.tensor([int(n_in > 0 and error is None)], dtype=torch.int64)
        accepted = torch.zeros(1, dtype=torch.int64)
        _post(
            group, [(accept, recv_from)] if n_in > 0 else [], [(accepted, send_to)] if raw else []
        )
        # 4. the files, straight from the sender's mapped files into the receiver's
        _post(group, sends if raw and accepted.item() else [], recvs)
    except BaseException:
        if tmp is not None:
            store._remove(tmp)
        raise
    finally:
        sends.clear()
        recvs.clear()
        _unmap(maps)
    if error is not None and tmp is not None:
        store._remove(tmp)
        tmp = None
    if error is not None:
        raise error
    if tmp is None:
        return None
    if store.check_copy(tmp, recv_src, step) is None:
        store._remove(tmp)
        raise CorruptCheckpointError(
            f"the copy of rank {recv_src}'s shard at step {step} received from group rank "
            f"{recv_from} is not a valid copy"
        )
    return store.publish(tmp, recv_kind, recv_src, step)
