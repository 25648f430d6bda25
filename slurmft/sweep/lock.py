"""One sweep at a time per node name: a non-blocking ``flock`` on ``<state_dir>/sweep-<node>.lock``.

The lock dies with the process (the kernel drops it), so a killed sweep never leaves a stale lock.
The sweep runs as root: its state directory must be one nobody else can write (checked, see
:func:`slurmft.safeio.check_private_dir`), and the lock file is opened without following a link,
so no user can make root create or truncate a file elsewhere, or hold root's lock.
``bin/slurmft-sweep-cron`` adds its own ``flock(1)`` around the whole run; this lock also keeps
Slurm's HealthCheckProgram and cron from overlapping.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from slurmft.safeio import open_lock_file


class LockHeld(RuntimeError):
    """Another sweep for this node holds the lock."""


class SweepLock:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def __enter__(self) -> "SweepLock":
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd = open_lock_file(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockHeld(f"another sweep holds {self.path}") from None
        self._fd = fd
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
