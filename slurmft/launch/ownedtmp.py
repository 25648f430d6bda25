"""Temporary directories a process holds for its lifetime, and the removal of those whose
process is gone, however it ended.

``make(prefix)`` creates a 0700 directory in the temp dir with a lock file in it, ``flock``-ed by
the calling process until it ends: the kernel lets go of the lock when the process dies, killed
-9 too, whatever its pid or network namespace (a pid recorded in the directory would say nothing
across namespaces). ``release`` removes the directory when the process is done with it. A
process killed first (its node's step KILLed, KillWait's KILL after a TERM, the OOM killer)
leaves it: ``make`` first removes this user's directories of the same prefix, made over
``MIN_AGE_S`` ago, whose lock it can take (their process is gone) or that have no lock file (a
process killed between ``mkdtemp`` and its lock). A younger one is never judged: its process may
be between creating its lock file and locking it. Anything else (another user's, a symlink, a
lock held) is left alone; nothing in the sweep raises. Used for torchrun's log directory
(``agent``); a warm server's directory has its own evidence, its socket (``warmtask``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time

LOCK_NAME = ".slurmft-owner.lock"
MIN_AGE_S = 60.0


def make(prefix: str, base: str | None = None) -> tuple[str, int]:
    """A new directory ``<base>/<prefix>XXXX`` held by this process; returns it and the lock's fd
    (keep it open: closing it lets the next sweep take the directory)."""
    base = base or tempfile.gettempdir()
    sweep(prefix, base)
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    fd = os.open(os.path.join(path, LOCK_NAME),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return path, fd


def release(path: str, fd: int) -> None:
    """Remove ``path`` (made by ``make``) and let go of its lock."""
    shutil.rmtree(path, ignore_errors=True)
    os.close(fd)


def sweep(prefix: str, base: str, now: float | None = None) -> list[str]:
    """Remove this user's ``<base>/<prefix>*`` directories that no live process holds; return
    them."""
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
        except FileNotFoundError:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
            continue
        except OSError:
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
