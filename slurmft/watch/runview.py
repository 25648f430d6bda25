"""What the watcher reads from a run directory: heartbeats, DONE, and a summary of the journal
(``journaltail.py``, re-exported here).

The run dir belongs to the job's user and is untrusted here: every file is opened without
following a symlink and without blocking on a FIFO, must be a regular file, and is read up to a
bound; anything else reads as absent, except a heartbeat file that is there but fails to read,
which reads as "could not observe" (``Heartbeats.unreadable``). The journal is followed incrementally (``JournalTail``
keeps a byte offset), so a cycle costs the new lines, not the whole history of a weeks-long run.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft import allocation, numbers, safeio
from slurmft.rundir import RunDir
from slurmft.watch.filecache import DoneCache, HeartbeatCache, RunFilesCache, settled, signature
from slurmft.watch.follow import MAX_LINE
from slurmft.watch.journaltail import MAX_KEPT_LINES, JournalSummary, JournalTail

__all__ = ["MAX_KEPT_LINES", "MAX_LINE", "Beat", "Heartbeats", "JournalSummary", "JournalTail",
           "done_for", "read_done", "read_heartbeats", "read_regular", "read_run_files",
           "read_small_json"]

MAX_SMALL_FILE = 64 * 1024
MAX_EVERY = 1_000_000  # steps between beats; more is not a heartbeat
MAX_PHASE_LABEL = 200


def read_regular(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (no symlink, no FIFO) of at most ``limit``
    bytes; None otherwise (absent, special, too big, unreadable)."""
    try:
        return safeio.read_regular(path, limit)
    except OSError:  # safeio's UnsafeFileError included
        return None


def read_small_json(path: Path) -> Any:
    """A small JSON file's value, or None when absent, not a regular file, too big or invalid."""
    data = read_regular(path, MAX_SMALL_FILE)
    if data is None:
        return None
    try:
        return numbers.loads(data)  # no NaN or Infinity: a record holds finite numbers or is invalid
    except ValueError:
        return None


@dataclass(frozen=True)
class Beat:
    """One node's heartbeat as the job wrote it (fields it lacks are None).

    Format 2 (``slurmft.train.heartbeat``): ``step_s`` is the duration of the node's last finished
    step, ``interval_s`` the writer's cadence (a beat at the first step boundary after that many
    seconds), and ``phase``/``phase_bound_s`` a long phase under way (a checkpoint save or load,
    an evaluation) that may keep the node from beating for up to that bound. Format 1 (older
    jobs): ``step_s`` is the mean step since the previous beat and ``every`` the steps between
    beats.
    """

    node: str
    job_id: str | None
    restart_count: int | None
    step: int | None
    time: float
    step_s: float | None
    busy_s: float | None
    every: int | None = None
    interval_s: float | None = None
    phase: str | None = None
    phase_bound_s: float | None = None

    def gap_s(self, typical_step_s: float) -> float:
        """Longest expected time from this beat to the node's next one, outside a phase, when
        steps take ``typical_step_s``: the cadence, plus the step that crosses it."""
        if self.interval_s is not None:
            return self.interval_s + typical_step_s
        if self.every is not None:
            return self.every * typical_step_s
        return typical_step_s


class Heartbeats(dict):
    """``read_heartbeats``' answer: the beats by node, and ``unreadable``: the nodes whose file is
    there but could not be read this cycle (an I/O or permission error): "could not observe",
    never "absent"."""

    unreadable: frozenset[str] = frozenset()


_UNREADABLE = "unreadable"  # _read_beat's answer for a file that is there but failed to read


def read_heartbeats(run_dir: RunDir, cache: HeartbeatCache | None = None, *,
                    root_exists: bool = False) -> Heartbeats | None:
    """Every readable ``heartbeat/<node>.json``, by node: empty when the job has written none yet,
    None when the directory cannot be read (a filesystem outage on this host is not a hang). A
    file that is there but fails to open or read (EIO, EACCES, a stale NFS handle) is named in
    ``unreadable`` (and read again next time); one that is not a heartbeat (a link, a FIFO, not
    JSON) is passed over. With a ``cache``, a directory unchanged since the last call is not
    listed again and a file with the same inode is not read again."""
    beats = Heartbeats()
    unreadable: set[str] = set()
    try:
        info = os.stat(run_dir.heartbeat_dir)
        sig = signature(info)
        if cache is not None and isinstance(cache.beats, Heartbeats) and sig == cache.dir_sig:
            return cache.beats
        with os.scandir(run_dir.heartbeat_dir) as it:
            entries = list(itertools.islice(it, 4096))
    except FileNotFoundError:
        if cache is not None:
            cache.dir_sig, cache.files, cache.beats = None, {}, None
        return beats if root_exists or run_dir.root.is_dir() else None
    except OSError:
        return None
    now = time.time()
    files: dict[str, tuple[tuple[int, int, int, int], Beat | None]] = {}
    for entry in entries:
        if not entry.name.endswith(".json") or entry.name.startswith("."):
            continue
        if cache is not None:
            try:
                file_info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            file_sig = signature(file_info)
            known = cache.files.get(entry.name)
            read: Beat | str | None
            if known is not None and known[0] == file_sig:
                read = known[1]
            else:
                read = _read_beat(entry)
            if settled(file_info, now) and not isinstance(read, str):
                files[entry.name] = (file_sig, read)
        else:
            read = _read_beat(entry)
        if isinstance(read, str):  # _UNREADABLE
            unreadable.add(entry.name[:-len(".json")])
        elif read is not None:
            beats[read.node] = read
    beats.unreadable = frozenset(unreadable)
    if cache is not None:  # a directory with an unreadable file is listed again next time
        cache.dir_sig = sig if settled(info, now) and not unreadable else None
        cache.files, cache.beats = files, beats
    return beats


def _read_beat(entry: os.DirEntry) -> Beat | str | None:
    """One heartbeat file's Beat, None when it is not one (a link, a FIFO, not a heartbeat's
    JSON), ``_UNREADABLE`` when it is there but fails to open or read."""
    try:
        raw = safeio.read_regular(Path(entry.path), MAX_SMALL_FILE)
    except (FileNotFoundError, safeio.UnsafeFileError):
        return None  # removed since the listing, or not a heartbeat at all
    except OSError:
        return _UNREADABLE
    try:
        data = numbers.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    when = numbers.unix_time(data.get("time"))
    node = data.get("node")
    if when is None or not isinstance(node, str) or f"{node}.json" != entry.name:
        return None
    step = data.get("step")
    restart = data.get("restart_count")
    every = data.get("every")
    phase = data.get("phase")
    bound = numbers.finite(data.get("phase_bound_s"), 0.0, numbers.MAX_SECONDS) or None
    # Shown in the watcher's log and journal: printable characters only (run-dir content is untrusted).
    label = ("".join(c if c.isprintable() else "?" for c in phase[:MAX_PHASE_LABEL])
             if isinstance(phase, str) and phase and bound is not None else None)
    return Beat(
        node=node,
        job_id=str(data["job_id"]) if isinstance(data.get("job_id"), (str, int)) else None,
        restart_count=restart if isinstance(restart, int) and not isinstance(restart, bool) else None,
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        time=when,
        step_s=numbers.seconds(data.get("last_step_s", data.get("recent_step_s"))),
        busy_s=numbers.seconds(data.get("busy_s")),
        every=every if isinstance(every, int) and not isinstance(every, bool) and 0 < every <= MAX_EVERY
        else None,
        interval_s=numbers.seconds(data.get("interval_s")),
        # A phase without a usable bound says nothing the watcher can wait on.
        phase=label,
        phase_bound_s=bound if label is not None else None,
    )


def read_done(run_dir: RunDir, cache: DoneCache | None = None) -> dict[str, Any] | None:
    """The DONE marker: its JSON fields, ``{}`` for a plain-text marker, None when absent. With
    a ``cache``: one ``lstat`` while the marker is absent or unchanged."""
    if cache is not None:
        cache.unreadable = False
        try:
            info = os.lstat(run_dir.done)
        except FileNotFoundError:
            cache.sig = cache.value = None
            return None
        except OSError:
            cache.unreadable = True  # not known to be absent: the caller must not decide on it
            return None
        sig = signature(info)
        if sig == cache.sig:
            return cache.value
        value = read_done(run_dir)
        cache.sig, cache.value = (sig if settled(info, time.time()) else None), value
        return value
    data = read_regular(run_dir.done, MAX_SMALL_FILE)
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def read_run_files(run_dir: RunDir, cache: RunFilesCache, *, look_for_done: bool = True
                   ) -> tuple[dict[str, Beat] | None, dict[str, Any] | None]:
    """The heartbeats (``read_heartbeats``) and the DONE marker (``read_done``) for one cycle,
    at the cost of a ``stat`` of the run dir and, when it has one, of its heartbeat directory:
    DONE and the heartbeat directory are created by rename or mkdir in the run dir, which
    changes its mtime, so while the run dir's signature holds neither is looked up again.

    ``look_for_done`` False (``RunWatch``: a cycle whose job is where it was the cycle before,
    deciding nothing unless it reads again): once a read has found the run dir settled and its
    heartbeat directory there, the heartbeat directory's ``stat`` alone; DONE keeps the value
    last read. ``allocation.json`` is read with DONE, into ``cache.allocation``. Anything else
    (no heartbeat directory, one that cannot be read) reads in full."""
    if (not look_for_done and cache.root_sig is not None and cache.observed
            and not cache.no_heartbeat_dir and cache.beats.beats is not None):
        beats = read_heartbeats(run_dir, cache.beats, root_exists=True)
        if beats is not None and cache.beats.beats is not None:
            return beats, cache.done.value
        cache.root_sig = None  # gone or unreadable: the full read below says which
    try:
        info = os.stat(run_dir.root)
    except OSError:  # gone, or the filesystem does not answer: not observed
        cache.root_sig = None
        cache.observed = False
        return None, None
    sig = signature(info)
    same = sig == cache.root_sig
    cache.root_sig = sig if settled(info, time.time()) else None
    done = cache.done.value if same else read_done(run_dir, cache.done)
    if not same:
        _read_allocation(run_dir, cache)
    cache.observed = not cache.done.unreadable
    if not cache.observed:
        cache.root_sig = None  # look again next cycle
    if same and cache.no_heartbeat_dir:
        return {}, done
    beats = read_heartbeats(run_dir, cache.beats, root_exists=True)
    cache.no_heartbeat_dir = beats == {} and cache.beats.beats is None
    return beats, done


def _read_allocation(run_dir: RunDir, cache: RunFilesCache) -> None:
    """``allocation.json`` into the cache (an ``lstat`` first: read only when it changed): None
    when there is none; one that cannot be read or does not check is None too, with why in
    ``allocation_error`` (the watcher then judges the job by its journal alone: the launcher's
    events say what it fenced)."""
    try:
        sig = signature(os.lstat(run_dir.allocation))
    except FileNotFoundError:
        cache.allocation_sig, cache.allocation, cache.allocation_error = None, None, None
        return
    except OSError as exc:
        cache.allocation_sig, cache.allocation = None, None
        cache.allocation_error = f"{run_dir.allocation}: cannot be read: {exc}"
        return
    if sig == cache.allocation_sig:
        return
    try:
        cache.allocation, cache.allocation_error = allocation.read(run_dir), None
    except allocation.AllocationError as exc:
        cache.allocation, cache.allocation_error = None, str(exc)
    cache.allocation_sig = sig


def done_for(done: dict[str, Any] | None, ids) -> bool:
    """Whether a DONE marker says this job's run is finished (a marker naming another job is
    an earlier run's: a later run in the same dir may train further). A marker that names no
    job (a run outside Slurm, a hand-made one) says nothing about this job: it would otherwise
    mark every later job in the run dir finished (no node or hang checks, crashes read as done)."""
    if done is None:
        return False
    named = done.get("job_id")
    ids = {ids} if isinstance(ids, str) else set(ids)
    return isinstance(named, (str, int)) and not isinstance(named, bool) and str(named) in ids
