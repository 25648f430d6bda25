"""Counts the filesystem calls a piece of Python makes, by wrapping ``os``'s (an instrumented
``os``, for watch_scale_bench.py and the watcher's unit tests).

Every call that costs a metadata round trip on a shared filesystem is counted by kind: ``open``
(``os.open`` and the builtin ``open``), ``stat``/``lstat``/``fstat``, ``scandir``/``listdir``,
``rename``/``replace``, ``fsync``, ``unlink``, ``mkdir``, ``chmod``; and the bytes read through
``os.read``/``os.pread`` and files opened with ``open``. Calls on paths outside ``under`` (when
given) are not counted; calls on a descriptor are counted when it was opened below ``under``.
"""

from __future__ import annotations

import builtins
import collections
import io
import os
from typing import Any, Callable

PATH_OPS = ("stat", "lstat", "scandir", "listdir", "rename", "replace", "unlink", "mkdir", "chmod",
            "utime")
FD_OPS = ("fstat", "fsync")


class FsOps:
    """Use as a context manager: ``with FsOps(root) as ops: ...``; then ``ops.counts``."""

    def __init__(self, under: str | os.PathLike[str] | None = None) -> None:
        self.under = os.path.abspath(under) if under is not None else None
        self.counts: collections.Counter[str] = collections.Counter()
        self.bytes_read = 0
        self.paths: collections.Counter[tuple[str, str]] = collections.Counter()
        self.bytes_by_name: collections.Counter[str] = collections.Counter()
        self._fds: dict[int, str] = {}
        self._saved: dict[str, Any] = {}

    @property
    def metadata_ops(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.counts.clear()
        self.paths.clear()
        self.bytes_by_name.clear()
        self.bytes_read = 0

    def _mine(self, path: Any, dir_fd: int | None = None) -> bool:
        if dir_fd is not None:
            return dir_fd in self._fds
        if isinstance(path, int):
            return path in self._fds
        if self.under is None:
            return True
        try:
            text = os.fspath(path)
        except TypeError:
            return False
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        return os.path.abspath(text).startswith(self.under)

    def _read(self, name: str, size: int) -> None:
        self.bytes_read += size
        self.bytes_by_name[name] += size

    def _count(self, op: str, path: Any) -> None:
        self.counts[op] += 1
        self.paths[(op, os.path.basename(str(path)))] += 1

    def __enter__(self) -> "FsOps":
        real = {name: getattr(os, name) for name in (*PATH_OPS, *FD_OPS, "open", "read", "pread", "close")}
        self._saved = {**real, "builtin_open": builtins.open}

        def path_op(name: str) -> Callable:
            def wrapper(path, *args, **kwargs):  # counted before: a call that fails costs too
                if self._mine(path, kwargs.get("dir_fd")):
                    self._count(name, path)
                return real[name](path, *args, **kwargs)
            return wrapper

        def fd_op(name: str) -> Callable:
            def wrapper(fd, *args, **kwargs):
                if fd in self._fds:
                    self._count(name, fd)
                return real[name](fd, *args, **kwargs)
            return wrapper

        def os_open(path, flags, mode=0o777, *, dir_fd=None):
            mine = self._mine(path, dir_fd)
            if mine:
                self._count("open", path)
            fd = real["open"](path, flags, mode, dir_fd=dir_fd)
            if mine:
                self._fds[fd] = os.path.basename(str(path))
            else:
                self._fds.pop(fd, None)  # a number reused after a close we did not see
            return fd

        def os_close(fd):
            self._fds.pop(fd, None)
            return real["close"](fd)

        def os_read(fd, n):
            data = real["read"](fd, n)
            if fd in self._fds:
                self._read(self._fds[fd], len(data))
            return data

        def os_pread(fd, n, offset):
            data = real["pread"](fd, n, offset)
            if fd in self._fds:
                self._read(self._fds[fd], len(data))
            return data

        def builtin_open(file, mode="r", *args, **kwargs):
            mine = file in self._fds if isinstance(file, int) else self._mine(file)
            if mine and not isinstance(file, int):
                self._count("open", file)
            fh = self._saved["builtin_open"](file, mode, *args, **kwargs)
            if not isinstance(file, int) and not mine:
                try:
                    self._fds.pop(fh.fileno(), None)  # a number reused after a close we did not see
                except (OSError, ValueError):
                    pass
            if mine and "r" in mode:
                name = self._fds[file] if isinstance(file, int) else os.path.basename(str(file))
                return _Counted(fh, self, name)
            return fh

        for name in PATH_OPS:
            setattr(os, name, path_op(name))
        for name in FD_OPS:
            setattr(os, name, fd_op(name))
        os.open, os.close, os.read, os.pread = os_open, os_close, os_read, os_pread  # type: ignore[assignment]
        builtins.open = io.open = builtin_open  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            if name == "builtin_open":
                builtins.open = io.open = fn
            else:
                setattr(os, name, fn)


class _Counted:
    """A file object whose reads add to ``FsOps.bytes_read``."""

    def __init__(self, fh: Any, ops: FsOps, name: str) -> None:
        self._fh, self._ops, self._name = fh, ops, name

    def read(self, *args: Any) -> Any:
        data = self._fh.read(*args)
        self._ops._read(self._name, len(data))
        return data

    def readline(self, *args: Any) -> Any:
        data = self._fh.readline(*args)
        self._ops._read(self._name, len(data))
        return data

    def __iter__(self):
        for line in self._fh:
            self._ops._read(self._name, len(line))
            yield line

    def __enter__(self) -> "_Counted":
        self._fh.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._fh.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)
