"""The lock of a devcluster's directory: ``up`` and ``down`` hold it for their whole run, so two
of them never work on one directory at once, and another cluster's ``up`` can tell a cluster
being started (lock held, no daemon yet) from a dead one."""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from typing import Iterator

from slurmft.slurm.devcluster.layout import Layout


@contextmanager
def dir_lock(layout: Layout) -> Iterator[None]:
    """Serialise up/down on one directory (two ``up`` racing on D must not both start)."""
    layout.root.mkdir(parents=True, exist_ok=True)
    with open(layout.lock_file, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def dir_busy(layout: Layout) -> bool:
    """Whether an ``up`` or ``down`` holds the directory's lock right now."""
    try:
        fh = open(layout.lock_file, "rb")
    except OSError:
        return False
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False
