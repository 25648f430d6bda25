"""Writing one rank's shard file in DCP's format: hashed as written, written back early, fsynced.

DCP's ``FileSystemWriter`` lays a shard file out as back-to-back records: the raw bytes of each
``BYTE_IO`` item, then one ``torch.save`` archive per tensor, each located by a ``_StorageInfo``
(file, offset, length) in ``.metadata``. :func:`write_shard_file` writes exactly that layout, so
``dcp.load`` and DCP's ``FileSystemReader`` read our checkpoints unchanged, with three differences
in *how* the bytes get there:

* **No CRC-32 per record.** ``torch.save`` computes a zip CRC-32 of every tensor; that costs about
  as much as copying the bytes into the page cache, ``torch.load`` never checks it, and the
  manifest's xxh3-128 of the whole file (computed on the same pass) already covers every byte.
  The archive is written by torch's own zip writer with CRC computation off for this call only;
  the global ``torch.serialization`` setting is left alone.
* **Unbuffered writes.** Tensor bytes go from the staged buffer to ``os.write`` with no copy
  through a Python buffer.
* **Early writeback.** Every ``WRITEBACK_BYTES`` the kernel is asked to start writing the range
  just written (``posix_fadvise(DONTNEED)`` starts asynchronous writeback of dirty pages on Linux),
  so the disk works while the rest of the file is still being copied into the page cache and the
  final ``fsync`` has little left to do.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from slurmft.checkpoint import torch_compat
from slurmft.checkpoint.manifest import FileEntry, StreamHasher

WRITEBACK_BYTES = 32 << 20
_CAN_START_WRITEBACK = hasattr(os, "posix_fadvise") and os.uname().sysname == "Linux"


class ShardStream(io.RawIOBase):
    """A write-only file that hashes every byte and starts writeback as it goes."""

    def __init__(self, path: Path, on_first_write: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.path = path
        self.hasher = StreamHasher()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._written_back = 0
        self._on_first_write = on_first_write

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self._on_first_write is not None:
            callback, self._on_first_write = self._on_first_write, None
            callback()
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])
        self.hasher.update(view)
        if _CAN_START_WRITEBACK and self.hasher.size - self._written_back >= WRITEBACK_BYTES:
            os.posix_fadvise(self._fd, self._written_back, self.hasher.size - self._written_back,
                             os.POSIX_FADV_DONTNEED)
            self._written_back = self.hasher.size
        return len(view)

    def tell(self) -> int:
        return self.hasher.size

    def fileno(self) -> int:
        return self._fd

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def save_tensor(tensor: torch.Tensor, stream: Any) -> None:
    """``torch.save(tensor, stream)`` byte for byte, except that the zip records carry no CRC-32.

    Only used when :data:`slurmft.checkpoint.torch_compat.FAST_SHARD_WRITE` (torch's private zip
    writer is there); otherwise ``CommitWriter`` lets DCP write the shards.
    """
    torch_compat.save_tensor_without_crc(tensor, stream)


def _tensor_for(planner: SavePlanner, item: WriteItem) -> torch.Tensor:
    data = planner.resolve_data(item)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{item.index.fqn}: planned as a tensor, resolved to {type(data).__name__}")
    tensor = data.detach()
    if not tensor.is_cpu:
        raise RuntimeError(f"{item.index.fqn}: checkpoint tensors must be staged to CPU first")
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()  # a view: save only its own bytes, not the whole storage behind it
    return tensor


@dataclass(frozen=True)
class ShardFileResult:
    entry: FileEntry
    results: list[WriteResult]


def write_shard_file(path: Path, relative: str, items: list[WriteItem], planner: SavePlanner, *,
                     on_first_write: Callable[[], None] | None = None) -> ShardFileResult:
    """Write ``items`` into a new file at ``path`` (``relative`` to the checkpoint dir), durably."""
    results: list[WriteResult] = []
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = [i for i in items if i.type != WriteItemType.BYTE_IO]
    stream = ShardStream(path, on_first_write)
    try:
        for item in byte_items:
            offset = stream.tell()
            data = planner.resolve_data(item)
            if not isinstance(data, io.BytesIO):
                raise TypeError(f"{item.index.fqn}: planned as bytes, resolved to {type(data).__name__}")
            stream.write(data.getbuffer())
            results.append(_result(item.index, relative, offset, stream.tell() - offset))
        for item in tensor_items:
            offset = stream.tell()
            save_tensor(_tensor_for(planner, item), stream)
            results.append(_result(item.index, relative, offset, stream.tell() - offset))
        stream.sync()
    finally:
        stream.close()
    entry = FileEntry(relative, stream.hasher.size, stream.hasher.hexdigest())
    return ShardFileResult(entry, results)


def _result(index: MetadataIndex, relative: str, offset: int, length: int) -> WriteResult:
    return WriteResult(index=index, size_in_bytes=length,
                       storage_data=torch_compat.storage_info(relative, offset, length))
