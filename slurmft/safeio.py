"""Opening files that someone else may have written: regular files only, never through a link.

The run directory belongs to the job's user; root's retention pass, an admin's ``slurmft ckpt``
and the watcher read it. Everything they open there goes through this module:

* no symbolic link is followed (``O_NOFOLLOW`` on every component below a trusted directory
  descriptor), so a link to ``/etc/shadow`` is reported, never read;
* only regular files are read (``fstat`` after the open, which is made with ``O_NONBLOCK`` so a
  FIFO cannot stall the open): a FIFO, a device or a socket is reported, never read;
* what is read into memory is bounded in size.

Every refusal is an :class:`UnsafeFileError` (an ``OSError``) whose message names the path and
what it is instead. Torch-free; used by both sides.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_NOFOLLOW_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_DEPTH = 32  # path components below a checkpoint directory


class UnsafeFileError(OSError):
    """A path is a link, a special file, too deep or too large; ``str()`` names it and why."""

    def __init__(self, path: str | os.PathLike[str], what: str) -> None:
        super().__init__(errno.EINVAL, what, str(path))
        self.what = what

    def __str__(self) -> str:
        return f"{self.filename}: {self.what}"


def kind_of(mode: int) -> str:
    """What a file mode is, in words ("a symbolic link", "a FIFO", ...)."""
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                        (stat.S_ISREG, "a regular file")):
        if test(mode):
            return words
    return "an unknown kind of file"


def refusal(path: str | os.PathLike[str], name: str, dir_fd: int | None, exc: OSError) -> OSError:
    """Turn the errno of a refused no-follow open into a message saying what the path is."""
    if exc.errno in (errno.ELOOP, errno.ENXIO, errno.ENOTDIR, errno.EMLINK):
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            return exc
        return UnsafeFileError(path, f"{kind_of(mode)}, not followed or read")
    exc.filename = str(path)
    return exc


def open_dir(path: str | os.PathLike[str], *, dir_fd: int | None = None,
             shown: str | os.PathLike[str] | None = None) -> int:
    """A descriptor of the directory ``path`` (its last component must not be a link)."""
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise refusal(shown or path, str(path), dir_fd, exc) from None


def open_regular(path: str | os.PathLike[str], *, dir_fd: int | None = None,
                 shown: str | os.PathLike[str] | None = None) -> tuple[int, os.stat_result]:
    """Open a regular file for reading without following a link in its last component."""
    shown = shown or path
    try:
        fd = os.open(path, _NOFOLLOW_READ, dir_fd=dir_fd)
    except OSError as exc:
        raise refusal(shown, str(path), dir_fd, exc) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeFileError(shown, f"{kind_of(st.st_mode)}, not a regular file")
    return fd, st


def open_inside(root_fd: int, rel: str, shown: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """Open ``rel`` (a relative POSIX path) below the directory ``root_fd``: no component may be a
    link, the last must be a regular file."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or len(parts) > MAX_DEPTH:
        raise UnsafeFileError(shown, "not a plain relative path inside the directory")
    fd = root_fd
    try:
        for part in parts[:-1]:
            nxt = open_dir(part, dir_fd=fd, shown=shown)
            if fd != root_fd:
                os.close(fd)
            fd = nxt
        return open_regular(parts[-1], dir_fd=fd, shown=shown)
    finally:
        if fd != root_fd:
            os.close(fd)


def read_fd_bounded(fd: int, size: int, max_bytes: int, shown: str | os.PathLike[str]) -> bytes:
    """Every byte of an open regular file of ``size`` bytes, refusing one larger than ``max_bytes``."""
    if size > max_bytes:
        raise UnsafeFileError(shown, f"{size} bytes, more than the {max_bytes} this reader accepts")
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise UnsafeFileError(shown, f"grew past the {max_bytes} bytes this reader accepts")


def read_regular(path: str | os.PathLike[str], max_bytes: int, *, dir_fd: int | None = None,
                 shown: str | os.PathLike[str] | None = None) -> bytes:
    """The bytes of the regular file ``path`` (no link followed), at most ``max_bytes``."""
    fd, st = open_regular(path, dir_fd=dir_fd, shown=shown)
    try:
        return read_fd_bounded(fd, st.st_size, max_bytes, shown or path)
    finally:
        os.close(fd)


def lstat_at(name: str, dir_fd: int) -> os.stat_result | None:
    """What ``name`` below the directory ``dir_fd`` is (a link itself, not followed); None if absent."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def is_real_dir(path: Path) -> bool:
    """Whether ``path`` is a directory and not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def check_private_dir(path: str | os.PathLike[str]) -> None:
    """Refuse (``UnsafeFileError``) a directory that someone other than us or root could change.

    For root's locks and state: ``path`` must be absolute and free of links (it is its own real
    path), owned by us (or root), and writable by nobody else; every directory above it must be
    owned by root or us and writable by others only if sticky (``/tmp``). Then nobody else can
    create, replace or link a file inside it.
    """
    path = Path(path)
    if not path.is_absolute():
        raise UnsafeFileError(path, "must be an absolute path")
    real = Path(os.path.realpath(path))
    if real != Path(os.path.normpath(path)):
        raise UnsafeFileError(path, f"contains a symbolic link (resolves to {real}); name the real path")
    me = os.geteuid()
    ancestors = [real, *real.parents]
    for i, directory in enumerate(ancestors):
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeFileError(directory, f"{kind_of(st.st_mode)}, not a directory")
        if st.st_uid not in (0, me):
            raise UnsafeFileError(directory, f"owned by uid {st.st_uid}, neither root nor uid {me}")
        others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if others_write and (i == 0 or not st.st_mode & stat.S_ISVTX):
            raise UnsafeFileError(directory, f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")


def open_lock_file(path: str | os.PathLike[str]) -> int:
    """Open (creating) a lock file in a private directory: no link followed, a regular file of ours."""
    path = Path(path)
    check_private_dir(path.parent)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise refusal(path, str(path), None, exc) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafeFileError(path, f"{kind_of(st.st_mode)} owned by uid {st.st_uid}, not our lock file")
    return fd
