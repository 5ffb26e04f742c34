"""Moving one rank-local copy between ranks over a gloo group (replicas and restores).

A copy travels as: its header length (an int64, -1 for "nothing to send"), the header
(JSON: the step and each file's name and size), then each file's bytes. Senders map
their files and send them as they are; receivers map fresh files in a temporary
directory and receive straight into them, so a replica costs no extra buffer. The
header is hostile until checked (plain names, a bounded count and total size); the
received copy is checked like any local copy (commit, sizes, ``tier.json``) before it
is renamed into place, and its checksums are verified when it is loaded.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch
import torch.distributed as dist

from .._core._errors import CorruptCheckpointError
from ._local import LocalStore

__all__ = ["exchange", "copy_files"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
_MAX_FILES = 4096
_HEADER_MAX = 1 << 20


def copy_files(path: str) -> list[list]:
    """``[name, size]`` of every regular file of a copy, by name."""
    out = []
    for name in sorted(os.listdir(path)):
        p = os.path.join(path, name)
        if os.path.islink(p) or not os.path.isfile(p):
            continue
        out.append([name, os.path.getsize(p)])
    return out


def _map(path: str, size: int, *, write: bool) -> torch.Tensor:
    if write:
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    return torch.from_file(path, shared=False, size=size, dtype=torch.uint8)


def _check_header(header: Any, step: int, cap: int) -> list[list]:
    if not isinstance(header, dict) or header.get("step") != step:
        raise CorruptCheckpointError(f"peer copy header is not for step {step}: {header!r:.200}")
    files = header.get("files")
    if not isinstance(files, list) or len(files) > _MAX_FILES:
        raise CorruptCheckpointError("peer copy header: bad file list")
    total = 0
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
        total += entry[1]
    if total > cap:
        raise CorruptCheckpointError(
            f"peer copy of step {step} announces {total} bytes, more than the {cap} expected"
        )
    return files


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
) -> str | None:
    """Send the copy at ``send_path`` to group rank ``send_to`` (None path: send "nothing")
    while receiving one from ``recv_from`` into ``store`` as ``recv_kind`` of rank
    ``recv_src``. Returns the received copy's path, or None when the sender had nothing.

    Both directions are posted before waiting, so a ring of exchanges cannot deadlock.
    Raises :class:`CorruptCheckpointError` for a bad header or copy (after the transfer
    finished, so the pair stays in step).
    """
    sending = send_to is not None
    receiving = recv_from is not None
    files, raw = [], b""
    if sending and send_path is not None:
        try:
            files = copy_files(send_path)
            raw = json.dumps({"step": step, "files": files}).encode()
        except OSError:
            files, raw = [], b""
    out_len = torch.tensor([len(raw) if raw else -1], dtype=torch.int64)
    in_len = torch.zeros(1, dtype=torch.int64)
    works = []
    if sending:
        works.append(dist.isend(out_len, group=group, group_dst=send_to))
    if receiving:
        works.append(dist.irecv(in_len, group=group, group_src=recv_from))
    for w in works:
        w.wait()
    n_in = int(in_len.item()) if receiving else -1
    if receiving and n_in > _HEADER_MAX:
        n_in = -2  # refused: still drain nothing more (the sender sends its header below)
    works = []
    header_in = torch.empty(max(n_in, 0) if n_in != -2 else int(in_len.item()), dtype=torch.uint8)
    if sending and raw:
        works.append(
            dist.isend(torch.frombuffer(bytearray(raw), dtype=torch.uint8), group=group,
                       group_dst=send_to)
        )  # fmt: skip
    if receiving and in_len.item() > 0:
        works.append(dist.irecv(header_in, group=group, group_src=recv_from))
    for w in works:
        w.wait()
    error: Exception | None = None
    in_files: list[list] = []
    if receiving and in_len.item() > 0:
        try:
            if n_in == -2:
                raise CorruptCheckpointError("peer copy header too large")
            in_files = _check_header(json.loads(bytes(header_in.numpy())), step, cap)
        except (ValueError, CorruptCheckpointError) as exc:
            error = (
                exc
                if isinstance(exc, CorruptCheckpointError)
                else CorruptCheckpointError(f"peer copy header of step {step} is not JSON: {exc}")
            )
    # Phase 3: the file bytes. The receiver accepts what the header announced even when
    # it refused it (into a scratch), so the sender never blocks on a missing receive.
    works, keep = [], []
    tmp = None
    if sending and raw:
        for name, size in files:
            if size:
                t = _map(os.path.join(send_path, name), size, write=False)
                keep.append(t)
                works.append(dist.isend(t, group=group, group_dst=send_to))
    if receiving and in_len.item() > 0:
        announced = in_files
        if error is not None:
            try:
                announced = json.loads(bytes(header_in.numpy())).get("files", [])
            except Exception:  # noqa: BLE001 - nothing decodable: the sender sends no files
                announced = []
        if error is None:
            assert store is not None and recv_src is not None
            os.makedirs(store.kind_dir(recv_kind, recv_src), mode=0o700, exist_ok=True)
            tmp = store.new_tmp(recv_kind, recv_src, step)
        for entry in announced:
            try:
                size = int(entry[1])
            except Exception:  # noqa: BLE001
                continue
            if size <= 0:
                if tmp is not None:
                    open(os.path.join(tmp, entry[0]), "wb").close()
                continue
            if tmp is not None:
                t = _map(os.path.join(tmp, entry[0]), size, write=True)
            else:
                t = torch.empty(size, dtype=torch.uint8)  # drained and dropped
            keep.append(t)
            works.append(dist.irecv(t, group=group, group_src=recv_from))
    for w in works:
        w.wait()
    keep.clear()
    if not receiving or in_len.item() <= 0:
        return None
    assert store is not None and recv_src is not None
    if error is not None or tmp is None:
        if tmp is not None:
            store._remove(tmp)
        raise error or CorruptCheckpointError(f"peer copy of step {step} refused")
    if store.check_copy(tmp, recv_src, step) is None:
        store._remove(tmp)
        raise CorruptCheckpointError(
            f"the copy of rank {recv_src}'s shard at step {step} received from group rank "
            f"{recv_from} is not a valid copy"
        )
    return store.publish(tmp, recv_kind, recv_src, step)
