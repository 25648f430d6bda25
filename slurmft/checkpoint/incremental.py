"""Incremental saves: a tensor whose bytes did not change since the last committed save is not
written again; the new checkpoint points at the record already on disk.

Each rank remembers, for its last committed save, where each of its tensors lies (the file below
``checkpoints/``, offset and length of its record in DCP's layout) and a digest of the tensor
(xxh3-128 over dtype, shape and bytes). A save hashes every staged tensor in the save thread; one
whose digest matches is not written: its ``WriteResult`` names the old record as
``../step_M/<file>``, which DCP's ``FileSystemReader`` joins to the checkpoint's path, so a plain
``dcp.load`` reads it where it lies; the manifest lists each referenced file with its size and
checksum (``refs``), so verification and the verifying loader check those bytes too. References
are flat: they always name the checkpoint that holds the bytes, never one that references them.
A checkpoint that holds referenced bytes may itself reference older ones; retention keeps the
whole chain, and a step that a newer checkpoint references is never replaced by a new save of it.

What is remembered lives in memory only: the first save of a process is whole, and so is every
``full_every``-th save, so old checkpoints stop being referenced and retention (which keeps every
checkpoint a kept one references, :mod:`slurmft.checkpoint.retention`) can delete them. Before a record
is referenced, its file is checked to be the one written (size, inode, mtime); damage a stat cannot
see is caught by the checksums when the new checkpoint is verified or loaded, and retention keeps a
whole checkpoint older than every referenced one as the fallback.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from slurmft.checkpoint import torch_compat
from slurmft.checkpoint.manifest import REF_PREFIX, FileEntry, ref_step

Key = tuple[str, tuple[int, ...] | None]


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's record lies: ``file`` (its path is relative to ``checkpoints/``)."""

    digest: str
    file: FileEntry
    offset: int
    length: int
    identity: tuple[int, int, int]  # the file's size, inode and mtime (ns) when written


def _key(index: MetadataIndex) -> Key:
    return index.fqn, None if index.offset is None else tuple(index.offset)


def tensor_digest(tensor: torch.Tensor) -> str:
    """xxh3-128 of a CPU tensor's dtype, shape and bytes (hashed in place, GIL released)."""
    flat = tensor.detach().contiguous().reshape(-1)
    hasher = xxhash.xxh3_128(f"{flat.dtype}{tuple(tensor.shape)}".encode())
    if flat.numel():
        hasher.update(flat.view(torch.uint8).numpy().data)
    return hasher.hexdigest()


class TensorIndex:
    """One rank's memory of its last committed save, and the count of saves since a whole one."""

    def __init__(self, full_every: int) -> None:
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.full_every = full_every
        self._stored: dict[Key, StoredTensor] = {}
        self._saves_since_full = 0

    def forget(self) -> None:
        """Make the next save whole (the state was replaced, e.g. by a load)."""
        self._stored = {}
        self._saves_since_full = 0

    def begin(self, checkpoints: Path, step: int) -> "SaveDelta":
        """The delta of the save of ``step``: nothing to reuse when it is due to be whole."""
        whole = not self._stored or self._saves_since_full + 1 >= self.full_every
        return SaveDelta({} if whole else self._stored, checkpoints, step)

    def committed(self, delta: "SaveDelta") -> None:
        """``delta``'s save committed: remember where its tensors lie now."""
        self._stored = delta.stored
        self._saves_since_full = self._saves_since_full + 1 if delta.reused_from else 0


class SaveDelta:
    """What one rank's save writes and what it references (used by ``CommitWriter``)."""

    def __init__(self, previous: dict[Key, StoredTensor], checkpoints: Path, step: int) -> None:
        self._previous = previous
        self._checkpoints = checkpoints
        self._step = step
        self._digests: dict[Key, str] = {}
        self.stored: dict[Key, StoredTensor] = {}  # after the save: where every tensor lies
        self.refs: dict[str, FileEntry] = {}  # referenced files, by their ref path
        self.reused_from = bool(previous)
        self.bytes_reused = 0

    def split(self, plan: SavePlan, planner: SavePlanner) -> tuple[SavePlan, list[WriteResult]]:
        """The plan of what must be written, and the results of the items that are not."""
        present = self._files_still_there()
        written: list[WriteItem] = []
        reused: list[WriteResult] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                written.append(item)
                continue
            key = _key(item.index)
            data = planner.resolve_data(item)
            if not isinstance(data, torch.Tensor):
                raise TypeError(f"{item.index.fqn}: planned as a tensor, resolved to {type(data).__name__}")
            digest = tensor_digest(data)
            self._digests[key] = digest
            old = self._previous.get(key)
            if old is None or old.digest != digest or old.file.path not in present:
                written.append(item)
                continue
            ref = f"{REF_PREFIX}{old.file.path}"
            self.refs[ref] = FileEntry(ref, old.file.size, old.file.hash)
            self.stored[key] = old
            self.bytes_reused += old.length
            reused.append(WriteResult(index=item.index, size_in_bytes=old.length,
                                      storage_data=torch_compat.storage_info(ref, old.offset, old.length)))
        return dataclasses.replace(plan, items=written), reused

    def wrote(self, results: list[WriteResult], files: dict[str, FileEntry], final_name: str,
              written_in: Path) -> None:
        """Record the written tensors' records (``files``: this save's entries by relative path,
        written in the directory ``written_in`` that will be renamed to ``final_name``)."""
        identities: dict[str, tuple[int, int, int]] = {}
        for result in results:
            key = _key(result.index)
            digest = self._digests.get(key)
            info = result.storage_data
            if digest is None or not hasattr(info, "relative_path") or info.relative_path.startswith(REF_PREFIX):
                continue
            entry = files[info.relative_path]
            if entry.path not in identities:
                identities[entry.path] = _identity(os.stat(written_in / entry.path, follow_symlinks=False))
            self.stored[key] = StoredTensor(digest, FileEntry(f"{final_name}/{entry.path}", entry.size, entry.hash),
                                            info.offset, info.length, identities[entry.path])

    def _files_still_there(self) -> set[str]:
        """The previous save's files that are still there, the same file unchanged as far as a
        stat tells (size, inode, mtime), in checkpoints older than this one (a step saved again
        replaces its directory). Damage that a stat cannot see is found by the checksums."""
        present = set()
        for path, identity in {s.file.path: s.identity for s in self._previous.values()}.items():
            if not 0 <= ref_step(f"{REF_PREFIX}{path}") < self._step:
                continue
            try:
                st = os.stat(self._checkpoints / path, follow_symlinks=False)
            except OSError:
                continue
            if _identity(st) == identity:
                present.add(path)
        return present


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_ino, st.st_mtime_ns

