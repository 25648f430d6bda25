"""The checkpoint checksum (xxh3-128) and reading files fast enough that hashing never waits.

:class:`StreamHasher` checksums bytes as a writer produces them; :func:`hash_file` and
:func:`hash_files` recompute it from disk. Reads are sequential and announced to the kernel
(``POSIX_FADV_SEQUENTIAL`` doubles the read-ahead window, so the disk keeps reading ahead while a
piece is hashed), in pieces small enough to stay in the CPU's cache between the copy out of the
page cache and the hash (larger pieces cost more CPU per byte and were slower on a busy machine).
Several files are hashed at once in a small thread pool, one sequential stream each, like ranks
reading their own shards: xxhash releases the GIL while it hashes (measured: a Python loop keeps
running while another thread hashes). No torch here.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import xxhash

from slurmft.safeio import open_inside, open_regular

HASH_ALGO = "xxh3_128"
HASH_CHUNK = 1 << 20  # bytes per read when hashing a file: fits in a core's L2 cache
VERIFY_THREADS = 4  # files hashed at once


class StreamHasher:
    """Incremental checksum of one file, fed with the bytes as they are written."""

    algo = HASH_ALGO

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_128()
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)
        self.size += memoryview(data).nbytes

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def hash_file(path: str | os.PathLike[str], chunk: int = HASH_CHUNK,
              on_bytes: Callable[[int], None] | None = None, *, dir_fd: int | None = None,
              shown: str | os.PathLike[str] | None = None) -> str:
    """Checksum of the file at ``path`` (same value :class:`StreamHasher` gives for its bytes).

    Only a regular file is read, never through a symbolic link (:mod:`slurmft.safeio`); with
    ``dir_fd``, ``path`` is relative to that directory and no component of it may be a link.
    """
    hasher = StreamHasher()
    buf = bytearray(chunk)
    view = memoryview(buf)
    if dir_fd is None:
        fd, _st = open_regular(path, shown=shown)
    else:
        fd, _st = open_inside(dir_fd, Path(path).as_posix(), shown or path)
    with open(fd, "rb", buffering=0) as fh:
        _advise_sequential(fh.fileno())
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            hasher.update(view[:n])
            if on_bytes is not None:
                on_bytes(n)
    return hasher.hexdigest()


def _advise_sequential(fd: int) -> None:
    """Ask for a larger read-ahead window; only a hint, so where refused, reading goes on as is."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass


class _Cancelled(Exception):
    """Raised inside a hashing worker when the caller has given up (an exception on its side)."""


def hash_files(paths: list[Path], threads: int = VERIFY_THREADS,
               on_bytes: Callable[[int], None] | None = None, chunk: int = HASH_CHUNK, *,
               dir_fd: int | None = None, shown_root: Path | None = None) -> list[str | OSError]:
    """Checksums of ``paths``, hashed ``threads`` files at a time; an OSError in place of a digest
    for a file that could not be read (or is a link or a special file: ``UnsafeFileError``).
    With ``dir_fd``, ``paths`` are relative to that directory (shown below ``shown_root``).

    ``on_bytes(n)`` is called on the caller's thread only, as bytes are hashed (never concurrently).
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if not paths:
        return []
    events: queue.SimpleQueue[int | None] = queue.SimpleQueue()  # bytes hashed; None: a file is done
    stop = threading.Event()

    def report(n: int) -> None:
        if stop.is_set():
            raise _Cancelled
        events.put(n)

    def one(path: Path) -> str | OSError:
        try:
            shown = shown_root / path if shown_root is not None else path
            return hash_file(path, chunk, on_bytes=report, dir_fd=dir_fd, shown=shown)
        except OSError as exc:
            return exc
        finally:
            events.put(None)

    # Largest first, so the pool does not end on one big file alone.
    order = sorted(range(len(paths)), key=lambda i: -_size_or_zero(paths[i], dir_fd))
    with ThreadPoolExecutor(max_workers=min(threads, len(paths)),
                            thread_name_prefix="slurmft-verify") as pool:
        futures = {i: pool.submit(one, paths[i]) for i in order}
        try:
            remaining = len(futures)
            while remaining:
                n = events.get()
                if n is None:
                    remaining -= 1
                elif on_bytes is not None:
                    on_bytes(n)
        except BaseException:
            stop.set()  # workers stop at their next chunk; the pool's exit waits for them
            raise
    return [futures[i].result() for i in range(len(paths))]


def _size_or_zero(path: Path, dir_fd: int | None) -> int:
    try:
        return os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_size
    except OSError:
        return 0
