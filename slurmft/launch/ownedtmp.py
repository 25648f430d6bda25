"""Temporary directories a process holds for its lifetime, and the removal of those whose
process is gone, however it ended.

``make(prefix)`` creates a 0700 directory ``<base>/<prefix><host>-XXXXXXXX`` with a lock file in
it, ``flock``-ed by the calling process, which keeps the fd open while it uses the directory
(``release`` removes it). The kernel lets go of the lock when the process dies, killed -9 too. A
process killed first (its node's step KILLed, KillWait's KILL after a TERM, the OOM killer)
leaves its directory behind: ``make`` first removes this user's directories of the same prefix
and host, made over ``MIN_AGE_S`` ago, whose lock it can take (nothing holds it: its process is
gone, and so is every process it passed the fd to).

``<host>`` is a hash of this host's name: only a node's own directories are judged, since on a
``$TMPDIR`` shared between nodes another node's lock may not show here (Lustre's ``localflock``).
Left alone: a directory under a minute old (its maker may be between creating its lock file and
locking it), one without a lock file, another user's, a symlink, a lock held. Where the
filesystem has no ``flock``, ``make`` still returns a directory, without a lock file: ``release``
removes it, a killed process leaves it, as before. Nothing in the sweep raises. Used for a warm
server's directory (``warmtask``: held by the node's task) and torchrun's log directory
(``agent``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import tempfile
import time

LOCK_NAME = ".slurmft-owner.lock"
MIN_AGE_S = 60.0


def host_tag(hostname: str | None = None) -> str:
    """This host's part of a directory's name: 8 hex digits of its name's hash (a socket's path
    has room for no more)."""
    name = socket.gethostname() if hostname is None else hostname
    return hashlib.sha256(name.encode()).hexdigest()[:8]


def make(prefix: str, base: str | None = None) -> tuple[str, int | None]:
    """A new directory held by this process, after the sweep of ``prefix``'s stale ones; returns
    it and its lock's fd (keep it open until ``release``), None where ``flock`` is not supported."""
    base = base or tempfile.gettempdir()
    mine = f"{prefix}{host_tag()}-"
    sweep(mine, base)
    path = tempfile.mkdtemp(prefix=mine, dir=base)
    lock = os.path.join(path, LOCK_NAME)
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:   # no flock here (ENOSYS, ENOLCK...): a directory the sweep never judges
        os.close(fd)
        os.unlink(lock)
        return path, None
    return path, fd


def release(path: str, fd: int | None) -> None:
    """Remove ``path`` (made by ``make``), then let go of its lock."""
    shutil.rmtree(path, ignore_errors=True)
    if fd is not None:
        os.close(fd)


def sweep(prefix: str, base: str, now: float | None = None) -> list[str]:
    """Remove this user's ``<base>/<prefix>*`` directories over ``MIN_AGE_S`` old whose lock no
    process holds; return them."""
    now = time.time() if now is None else now
    uid = os.getuid()
    removed: list[str] = []
    try:
        entries = [e for e in os.scandir(base) if e.name.startswith(prefix)]
    except OSError:
        return removed
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if (not entry.is_dir(follow_symlinks=False) or st.st_uid != uid
                or now - st.st_mtime < MIN_AGE_S):
            continue
        try:
            fd = os.open(os.path.join(entry.path, LOCK_NAME),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:   # none (or not a file): nothing says its process is gone
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:   # held: its process lives (or the lock cannot be judged)
            continue
        else:   # removed while locked: a sweep beside this one cannot take it halfway
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        finally:
            os.close(fd)
    return removed
