"""Physical limits measured in the same run, on the same state and the same disk as the save methods.

Each limit runs on both ranks at once (a barrier starts it; the slowest rank's time counts), so it
bounds what a two-rank save can achieve here: copying the state into preallocated buffers (the
floor for blocking time), writing its bytes with fsync (the floor for total time), reading them
back from a cold page cache, and hashing them with the manifest's hash.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

READ_CHUNK = 16 << 20


def max_across_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sum_across_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())


def _timed_on_all_ranks(fn: Callable[[], None]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return max_across_ranks(time.perf_counter() - t0)


def _byte_views(tensors: list[torch.Tensor]) -> list[memoryview]:
    return [memoryview(t.contiguous().view(torch.uint8).numpy()) for t in tensors]


class DiskAndCopyProbe:
    """The copy and write limits, measurable again and again next to each save.

    The disk and CPUs of a shared machine change speed from minute to minute, so every save is
    paired with a probe taken just before it; ratios are then per-save, not across minutes.
    """

    def __init__(self, tensors: list[torch.Tensor], path: Path) -> None:
        self.tensors = tensors
        self._base = path
        self._writes = 0
        self.path: Path | None = None  # the file the last write() made (read back cold later)
        self._views = _byte_views(tensors)
        self._buffers = [torch.empty_like(t) for t in tensors]
        for b in self._buffers:
            b.zero_()  # touch every page now, so the copy measures copying, not page faults

    def copy(self) -> float:
        """Seconds to copy this rank's state once into the preallocated buffers (both ranks)."""

        def copy() -> None:
            for b, t in zip(self._buffers, self.tensors):
                b.copy_(t)

        return _timed_on_all_ranks(copy)

    def write(self) -> float:
        """Seconds to write this rank's state bytes to a new file and fsync it (both ranks).

        A new file each time (the previous one is then deleted), like a checkpoint: rewriting one
        file in place could reuse its blocks, which a new checkpoint cannot.
        """
        self._writes += 1
        previous, self.path = self.path, self._base.with_name(f"{self._base.name}.{self._writes}")

        def write() -> None:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for view in self._views:
                    done = 0
                    while done < len(view):
                        done += os.write(fd, view[done:])
                os.fsync(fd)
            finally:
                os.close(fd)

        seconds = _timed_on_all_ranks(write)
        if previous is not None:
            previous.unlink()
        return seconds

    def remove(self) -> None:
        if self.path is not None:
            self.path.unlink()
            self.path = None


def _drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def evict_from_page_cache(paths: list[Path], *, drop_all: bool = True) -> str:
    """Collective: make the next read of every rank's ``paths`` come from disk.

    With ``drop_all``, rank 0 drops the whole page cache (root only); where that is refused or not
    wanted, each rank asks the kernel to drop its own files' pages. Returns how: "drop_caches" or
    "fadvise".
    """
    os.sync()
    dist.barrier()
    dropped = [_drop_caches() if drop_all and dist.get_rank() == 0 else False]
    dist.broadcast_object_list(dropped, src=0)
    if not dropped[0]:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    dist.barrier()
    return "drop_caches" if dropped[0] else "fadvise"


def measure_cold_read(path: Path, *, drop_all: bool = True) -> tuple[float, str]:
    """Seconds to read ``path`` back from a cold cache on every rank at once, and the eviction used."""
    how = evict_from_page_cache([path], drop_all=drop_all)
    buf = bytearray(READ_CHUNK)

    def read() -> None:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass

    return _timed_on_all_ranks(read), how


def measure_hash(tensors: list[torch.Tensor], new_hasher: Callable[[], object]) -> float:
    """Seconds to hash this rank's state bytes (in memory) with the manifest's streaming hasher."""
    views = _byte_views(tensors)

    def digest() -> None:
        hasher = new_hasher()
        for view in views:
            for start in range(0, len(view), READ_CHUNK):
                hasher.update(view[start:start + READ_CHUNK])  # type: ignore[attr-defined]

    return _timed_on_all_ranks(digest)
