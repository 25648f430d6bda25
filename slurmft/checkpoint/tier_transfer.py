"""Copying checkpoint files between ranks' node-local disks over the checkpoint's gloo group.

A node's local tier is reachable only from that node, so a replica (after a save) or a file a
rank needs but its node lacks (at a load) travels over the network: point-to-point ``send`` /
``recv`` of fixed-size chunks on the ``io`` group.

Every rank walks the same list of transfers in the same order and takes part only in its own.
That order is what keeps it from deadlocking: the earliest unfinished transfer always has both
its ends waiting on it. No rank ever leaves a transfer out, even when it fails: a sender that
cannot read its file sends zeros, a receiver that cannot write keeps receiving; the receiver's
checksum against the manifest then names the problem, so the ranks never disagree about how
many messages are coming.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurmft import safeio
from slurmft.checkpoint.checksum import StreamHasher
from slurmft.checkpoint.manifest import FileEntry

CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class Transfer:
    """``entry`` from ``src``'s ``src_dir`` to ``dst``'s ``dst_dir`` (group ranks)."""

    src: int
    dst: int
    entry: FileEntry
    src_dir: Path
    dst_dir: Path


def run_transfers(transfers: list[Transfer], rank: int, group: Any) -> list[str]:
    """Carry out this rank's part of ``transfers`` (the same list on every rank); the problems
    this rank found as a receiver. A received file is written under a temporary name, fsynced,
    checked against its entry and only then renamed to its name; its directory is not fsynced
    here (the caller commits the directory)."""
    problems: list[str] = []
    if not transfers:
        return problems
    buf = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
    for t in transfers:
        if t.src == rank and t.dst == rank:
            continue
        if t.src == rank:
            _send(t, buf, dist.get_global_rank(group, t.dst), group)
        elif t.dst == rank:
            problems.extend(_receive(t, buf, dist.get_global_rank(group, t.src), group))
    return problems


def _chunks(size: int) -> list[int]:
    return [min(CHUNK_BYTES, size - at) for at in range(0, size, CHUNK_BYTES)]


def _send(t: Transfer, buf: torch.Tensor, peer: int, group: Any) -> None:
    view = memoryview(buf.numpy())  # type: ignore[arg-type]
    fh = None
    try:
        fh = os.fdopen(open_checkpoint_file(t.src_dir, t.entry.path), "rb", buffering=0)
    except OSError:
        fh = None  # the receiver's checksum will name the file
    try:
        for n in _chunks(t.entry.size):
            filled = 0
            if fh is not None:
                try:
                    while filled < n:
                        got = fh.readinto(view[filled:n])
                        if not got:
                            break
                        filled += got
                except OSError:
                    fh.close()
                    fh = None
            if filled < n:
                buf[filled:n].zero_()
            dist.send(buf[:n], dst=peer, group=group)
    finally:
        if fh is not None:
            fh.close()


def open_checkpoint_file(directory: Path, relative: str) -> int:
    """A read descriptor of ``relative`` below ``directory``, no link followed, regular files only."""
    dir_fd = safeio.open_dir(directory)
    try:
        fd, _ = safeio.open_inside(dir_fd, relative, directory / relative)
        return fd
    finally:
        os.close(dir_fd)


def _receive(t: Transfer, buf: torch.Tensor, peer: int, group: Any) -> list[str]:
    target = t.dst_dir / t.entry.path
    tmp = t.dst_dir / f".{Path(t.entry.path).name}.recv"
    hasher = StreamHasher()
    out = None
    problem = None
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        out = open(tmp, "wb", buffering=0)
    except OSError as exc:
        problem = f"{target}: cannot be written ({exc.strerror or exc})"
    view = memoryview(buf.numpy())  # type: ignore[arg-type]
    for n in _chunks(t.entry.size):
        dist.recv(buf[:n], src=peer, group=group)
        hasher.update(view[:n])
        if out is not None:
            try:
                out.write(view[:n])
            except OSError as exc:
                problem = f"{target}: cannot be written ({exc.strerror or exc})"
                out.close()
                out = None
    if out is not None:
        try:
            os.fsync(out.fileno())
        except OSError as exc:
            problem = f"{target}: cannot be synced ({exc.strerror or exc})"
        out.close()
    if problem is None and (hasher.size != t.entry.size or hasher.hexdigest() != t.entry.hash):
        problem = f"{target}: received bytes do not match the manifest (checksum {hasher.hexdigest()})"
    if problem is None:
        try:
            os.replace(tmp, target)
        except OSError as exc:
            problem = f"{target}: cannot be renamed into place ({exc.strerror or exc})"
    if problem is not None:
        try:
            tmp.unlink()
        except OSError:
            pass
        return [problem]
    return []
