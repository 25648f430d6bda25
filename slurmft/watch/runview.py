"""What the watcher reads from a run directory: heartbeats, DONE, and a summary of the journal.

The run dir belongs to the job's user and is untrusted here: every file is opened without
following a symlink and without blocking on a FIFO, must be a regular file, and is read up to a
bound; anything else reads as absent, except a heartbeat file that is there but fails to read,
which reads as "could not observe" (``Heartbeats.unreadable``). The journal is followed incrementally (``JournalTail``
keeps a byte offset), so a cycle costs the new lines, not the whole history of a weeks-long run.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmft import exitcodes, journal, numbers, safeio
from slurmft.journal import Event, parse_line
from slurmft.rundir import RunDir
from slurmft.watch.filecache import DoneCache, HeartbeatCache, RunFilesCache, settled, signature

MAX_SMALL_FILE = 64 * 1024
MAX_JOURNAL_CHUNK = 8 * 1024 * 1024
MAX_LINE = 64 * 1024
_KEEP_COMMITS = 32
MAX_EVERY = 1_000_000  # steps between beats; more is not a heartbeat
MAX_PHASE_LABEL = 200
MAX_KEPT_LINES = 4096  # journal lines a --once invocation hands to the next


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
    last read. Anything else (no heartbeat directory, one that cannot be read) reads in full."""
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
    cache.observed = not cache.done.unreadable
    if not cache.observed:
        cache.root_sig = None  # look again next cycle
    if same and cache.no_heartbeat_dir:
        return {}, done
    beats = read_heartbeats(run_dir, cache.beats, root_exists=True)
    cache.no_heartbeat_dir = beats == {} and cache.beats.beats is None
    return beats, done


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


@dataclass
class JournalSummary:
    """What the watcher needs from ``events.jsonl``, kept up to date line by line."""

    segment_starts: list[Event] = field(default_factory=list)
    segment_ends: dict[tuple[str, int], Event] = field(default_factory=dict)
    commits: deque = field(default_factory=lambda: deque(maxlen=_KEEP_COMMITS))
    requeue_requests: dict[tuple[str, int], Event] = field(default_factory=dict)
    self_requeues: dict[tuple[str, int], str] = field(default_factory=dict)  # -> the launcher's reason
    preemptions: dict[tuple[str, int], Event] = field(default_factory=dict)  # the run saved on a signal
    last_loss_step: int | None = None
    last_loss_time: float | None = None
    events_read: int = 0

    @staticmethod
    def key(event: Event) -> tuple[str, int] | None:
        job, restart = event.get("job_id"), event.get("restart_count")
        if not isinstance(job, (str, int)) or isinstance(restart, bool) or not isinstance(restart, int):
            return None
        return str(job), restart

    def add(self, event: Event) -> None:
        self.events_read += 1
        key = self.key(event)
        kind = event.kind
        if kind == journal.LOSS:
            step = event.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                self.last_loss_step, self.last_loss_time = step, event.time
        elif kind == journal.CHECKPOINT_COMMITTED:
            step = event.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                self.commits.append((event.time, step, event.seconds("blocking_s")))
        elif key is None:
            return
        elif kind == journal.SEGMENT_START:
            self.segment_starts.append(event)
            del self.segment_starts[:-64]
        elif kind == journal.SEGMENT_END:
            self.segment_ends[key] = event
        elif kind == journal.REQUEUE_REQUEST:
            self.requeue_requests[key] = event
        elif kind == journal.TEMPLATE and event.get("action") == "requeue":
            self.self_requeues[key] = str(event.get("reason") or "")
        elif kind == journal.PREEMPTION:
            self.preemptions[key] = event

    @staticmethod
    def find(mapping: dict, ids, restart_count: int):
        """``mapping[(id, restart)]`` for the first of the job's ``ids`` that has an entry (an
        array task's processes name it by its own number, Slurm by ``<array>_<task>``)."""
        for job_id in ([ids] if isinstance(ids, str) else sorted(ids)):
            value = mapping.get((str(job_id), restart_count))
            if value is not None:
                return value
        return None

    def outcome(self, ids, restart_count: int) -> int | None:
        """The exit code the segment (job, restart) recorded, if any."""
        event = self.find(self.segment_ends, ids, restart_count)
        code = None if event is None else event.get("exit_code")
        return code if isinstance(code, int) and not isinstance(code, bool) else None

    def no_requeue(self, ids, restart_count: int) -> bool:
        return self.outcome(ids, restart_count) == exitcodes.NO_REQUEUE

    def self_requeued(self, ids, restart_count: int) -> bool:
        ids = [ids] if isinstance(ids, str) else ids
        return any((str(i), restart_count) in self.self_requeues for i in ids)

    def newest_commit_step(self) -> int | None:
        return self.commits[-1][1] if self.commits else None

    def last_segment(self, job_id: str) -> Event | None:
        for event in reversed(self.segment_starts):
            if str(event.get("job_id")) == str(job_id):
                return event
        return None


class JournalTail:
    """Follows one run's ``events.jsonl`` from a byte offset; lines are parsed as they arrive."""

    def __init__(self, path: Path, *, keep_lines: bool = False) -> None:
        """``keep_lines``: also keep the lines the summary is made of (every line but the
        losses, the newest of those, up to ``MAX_KEPT_LINES``) so that ``save`` can hand the
        place in the journal to the next ``--once`` invocation."""
        self.path = path
        self.offset = 0
        self.identity: tuple[int, int] | None = None
        self.summary = JournalSummary()
        self._partial = b""
        self._kept: deque[bytes] | None = deque(maxlen=MAX_KEPT_LINES) if keep_lines else None
        self._last_loss = b""
        # False when the last poll could not read the journal (it exists, but the filesystem or
        # its type refused: an NFS ESTALE, EIO, a FIFO): the summary is then older than the run,
        # and deciding on it could take a planned end for a fault (could not observe, not absent).
        self.observed = True

    def poll(self) -> JournalSummary:
        """The summary with the lines appended since the last poll; a journal whose identity
        and size have not changed costs one ``lstat``."""
        self.observed = True
        try:
            seen = os.lstat(self.path)
        except OSError as exc:
            self.observed = exc.errno == errno.ENOENT  # none yet: nothing to read is the truth
            return self.summary
        if (seen.st_dev, seen.st_ino) == self.identity and seen.st_size == self.offset:
            return self.summary
        try:
            fd, info = safeio.open_regular(self.path)
        except OSError:
            self.observed = False
            return self.summary
        try:
            identity = (info.st_dev, info.st_ino)
            if identity != self.identity or info.st_size < self.offset:  # replaced or truncated
                self.identity, self.offset, self._partial = identity, 0, b""
                self.summary = JournalSummary()
                if self._kept is not None:
                    self._kept.clear()
                self._last_loss = b""
            while self.offset < info.st_size:
                chunk = os.pread(fd, min(MAX_JOURNAL_CHUNK, info.st_size - self.offset), self.offset)
                if not chunk:
                    break
                self.offset += len(chunk)
                self._feed(chunk)
        except OSError:
            self.observed = False
        finally:
            os.close(fd)
        return self.summary

    def _feed(self, chunk: bytes) -> None:
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_LINE:  # a line without end: drop it, keep going
            self._partial = b""
        for raw in lines:
            if not raw.strip() or len(raw) > MAX_LINE:
                continue
            try:
                event = parse_line(raw.decode("utf-8", errors="replace"))
            except (RecursionError, ValueError):
                event = None
            if event is not None:
                self.summary.add(event)
                if self._kept is not None:
                    if event.kind == journal.LOSS:
                        self._last_loss = raw
                    else:
                        self._kept.append(raw)

    def kept_lines(self) -> list[bytes]:
        """With ``keep_lines``: the lines the summary is made of, in journal order (enough to
        rebuild it: ``restore``)."""
        return [*(self._kept or ()), *([self._last_loss] if self._last_loss else [])]

    def restore(self, identity: tuple[int, int], offset: int, lines: list[bytes]) -> None:
        """Carry on at ``offset`` of the journal ``identity`` (device, inode), the summary
        rebuilt from ``lines`` (``kept_lines`` of an earlier tail)."""
        self.summary, self._partial, self._last_loss = JournalSummary(), b"", b""
        if self._kept is not None:
            self._kept.clear()
        self._feed(b"".join(raw + b"\n" for raw in lines))
        self._partial = b""
        self.identity, self.offset = identity, offset

    @property
    def complete_offset(self) -> int:
        """The offset of the end of the last whole line read."""
        return self.offset - len(self._partial)
