"""The caches behind the watcher's stat-first reads of a run dir (``runview.read_run_files``).

A file or directory is identified by its signature (device, inode, size, mtime): the heartbeat
writer and the DONE marker replace their files by rename, which changes the directory's mtime,
so an unchanged signature means nothing to read again. A signature whose mtime is within
``RACY_S`` of now is not trusted: on a filesystem with coarse timestamps the same tick may hold
a second change.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurmft.allocation import Allocation
    from slurmft.watch.runview import Beat

# A directory or file whose mtime is this close to now may change again within the same mtime
# tick (filesystems with coarse timestamps): its cached reading is not trusted ("racy" entry).
RACY_S = 2.0


def signature(info: os.stat_result) -> tuple[int, int, int, int]:
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def settled(info: os.stat_result, now: float) -> bool:
    return now - info.st_mtime_ns / 1e9 >= RACY_S


class HeartbeatCache:
    """What ``read_heartbeats`` read last time: the heartbeat directory's signature and, per
    file, its signature and the Beat read from it. Heartbeats are replaced by rename, which
    changes the directory's mtime, so an unchanged directory costs one ``stat`` per cycle and a
    changed one a listing, an ``lstat`` per file and a read per changed file. (An inode alone
    does not tell: the filesystem reuses the one a replaced beat freed.)"""

    def __init__(self) -> None:
        self.dir_sig: tuple[int, int, int, int] | None = None
        self.files: dict[str, tuple[tuple[int, int, int, int], Beat | None]] = {}
        self.beats: dict[str, Beat] | None = None


class DoneCache:
    """The DONE marker's signature and value when last read (``read_done``)."""

    def __init__(self) -> None:
        self.sig: tuple[int, int, int, int] | None = None
        self.value: dict[str, Any] | None = None
        self.unreadable = False  # the last lstat failed for another reason than absence


class RunFilesCache:
    """``read_run_files``'s memory of one run dir: the root's signature and the caches below."""

    def __init__(self) -> None:
        self.root_sig: tuple[int, int, int, int] | None = None
        self.beats = HeartbeatCache()
        self.done = DoneCache()
        self.no_heartbeat_dir = False
        # allocation.json (in-allocation mode): read when the run dir's signature moved (the
        # launcher replaces it by rename); None: none, or one that does not check (``error``).
        self.allocation: Allocation | None = None
        self.allocation_error: str | None = None
        self.allocation_sig: tuple[int, int, int, int] | None = None
        # False when the last read could not look at the run dir (its stat, or DONE's lstat,
        # failed for another reason than absence): DONE is then unknown, not absent.
        self.observed = True
