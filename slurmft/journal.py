"""The run's journal, ``<run_dir>/events.jsonl``: one versioned JSON event per line, append-only.

Both sides write it (the training job: segment start/end, checkpoint committed, guard trips,
preemption, losses; the watcher: detections and actions) and both read it. Events are written
with ONE ``write`` on an ``O_APPEND`` descriptor followed by ``fsync``, so concurrent writers on
one host never interleave bytes inside a line and an event that was reported written survives a
crash. Per-step events (``loss``) would make that a metadata round trip per step on a parallel
filesystem, so :class:`Journal` buffers them in memory and writes them, in order, in one write +
fsync together with the next durable event (every other kind: segment start/end, checkpoint
committed, preemption, hang, guard trips), or once ``flush_every_events`` are pending or the
oldest is ``flush_every_s`` old, on ``flush()`` and at interpreter exit. A crash loses at most
those buffered per-step lines, never an event the watcher acts on. A reader skips a line it
cannot parse (a torn tail after a crash on a filesystem that does not honour O_APPEND
atomically) and says so once, instead of failing the whole read.

The journal sits in the user's run directory, so the reader treats it as untrusted: it is
opened without following a link and only as a regular file (a FIFO must not stall the
template's ``outcome`` or ``append``), at most ``MAX_READ_BYTES`` of its end are read, a line
longer than ``MAX_LINE_BYTES`` or one that is not JSON of bounded depth is skipped like a torn one.

``python -m slurmft.journal`` exposes ``append`` and ``outcome`` on the command line (for
scripts and by-hand inspection; the launcher calls the functions). Torch-free.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import re
import stat
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from slurmft import numbers
from slurmft.config import load_section
from slurmft.rundir import RunDir
from slurmft.safeio import UnsafeFileError, open_regular, refusal

log = logging.getLogger(__name__)

JOURNAL_VERSION = 1
_KIND_RE = re.compile(r"^[a-z][a-z0-9_.]{0,63}$")
_RESERVED = frozenset({"v", "t", "kind"})
MAX_READ_BYTES = 256 << 20  # a longer journal is read from its last 256 MiB (segment ends are last)
MAX_LINE_BYTES = 1 << 20


class JournalError(ValueError):
    """An event cannot be written as given (bad kind, reserved or unserialisable field)."""


# Event kinds written by the in-job side. The watcher adds its own; readers accept any kind.
SEGMENT_START = "segment_start"
SEGMENT_END = "segment_end"
CHECKPOINT_COMMITTED = "checkpoint_committed"  # step, path, tier (shared|local), blocking_s, total_s
# With the node-local tier: a checkpoint committed locally has also been copied to the run dir.
CHECKPOINT_COPIED = "checkpoint_copied"        # step, path, total_s
GUARD_TRIP = "guard_trip"
ROLLBACK = "rollback"
PREEMPTION = "preemption"
HANG = "hang"
LOSS = "loss"
TEMPLATE = "template"
CHECKPOINT_SKIPPED = "checkpoint_skipped"  # step, reason: damaged, passed over at load (newest first)
# step, cause (rng_before_loop | sampler | stale_inputs | inputs | rng | loss), message, site (the
# user's line that drew, when traced); loss and journaled for cause loss: the first divergence of a
# resumed run from the interrupted one (train/resume_audit.py, from resume_check.py and redo_check.py)
RESUME_DIVERGED = "resume_diverged"
# Rank 0, when the first step of a segment ends: what the (re)start cost, by phase. Wall times
# (unix s) process_start, torch_imported, run_started, checkpoint_loaded, first_step_done; their
# differences as *_s; tier (where the checkpoint was read from), restored_step, load_bytes.
RESTART_PHASES = "restart_phases"
RANK_EXIT = "rank_exit"  # rank, node, exit_code, pid, how: a crash its node's warm server saw (in-allocation)
# Written by the launcher when it wants a requeue it cannot do itself (no scontrol in the job):
# reason, exclude (node names the pre-flight failed). `slurmft watch` carries it out.
REQUEUE_REQUEST = "requeue_request"

# Event kinds written by `slurmft watch` (and read by `slurmft status`). Every one carries the
# watched job id and the restart count the watcher saw; times are unix seconds.
WATCH_STARTED = "watch_started"      # pid, host, user
FAULT_DETECTED = "fault_detected"    # cause, evidence, nodes, fault_time (best estimate), state
RECOVERY_ACTION = "recovery_action"  # action (requeue|exclude|readmit|start_now|expedite|set_down|
                                     # hold|requeue_hold|resubmit),
                                     # cause, nodes, ok, detail
# In-allocation mode (issue 27): the launcher journals FAULT_DETECTED (cause: one of
# ALLOC_CAUSES; nodes, evidence, fault_time, detected_by "launcher") and RECOVERY_ACTION (action:
# one of ALLOC_ACTIONS; nodes, spare or None, world_nodes, generation, cause) itself: one action
# per fault, ``fence`` for a spare, ``replace_node``/``shrink`` for an active node (fenced too),
# ``restart_in_place`` (nothing fenced); each with
# ``"where": WHERE_ALLOCATION``; the watcher's own events carry no ``where`` (a requeue's).
WHERE = "where"
WHERE_ALLOCATION = "allocation"
WHERE_REQUEUE = "requeue"
ALLOC_CAUSES = ("node_death", "node_silent", "rank_crash", "hang")
ALLOC_FENCE, ALLOC_REPLACE, ALLOC_SHRINK, ALLOC_RESTART = (
    "fence", "replace_node", "shrink", "restart_in_place")
ALLOC_ACTIONS = (ALLOC_FENCE, ALLOC_REPLACE, ALLOC_SHRINK, ALLOC_RESTART)
# A planned end (time limit, preemption, pre-flight requeue: ``detect.PLANNED``) is no fault: it
# is journaled as PLANNED_END (fields of FAULT_DETECTED) and the watcher's help restarting it
# (exclude, start_now...) as RESTART_ACTION (fields of RECOVERY_ACTION).
PLANNED_END = "planned_end"
RESTART_ACTION = "restart_action"
JOB_RUNNING = "job_running"          # nodes, start_time, cause, planned: running again after a
                                     # recovery or a planned end
JOB_RESUBMITTED = "job_resubmitted"  # old_job_id, new_job_id: Slurm had forgotten the job
WATCH_WARNING = "watch_warning"      # what (straggler|checkpoint_overdue|stuck_pending|no_fit...),
                                     # detail, nodes
GAVE_UP = "gave_up"                  # cause, reason, restarts: the job is held, not requeued
RUN_FINISHED = "run_finished"        # state, exit_code, how (done|completed)


@dataclass(frozen=True)
class Event:
    """One journal line: version, wall time (unix seconds), kind, and the kind's own fields."""

    kind: str
    time: float
    fields: Mapping[str, Any]
    version: int = JOURNAL_VERSION

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    # Typed reads of the event's fields (the line is the run owner's: any JSON value can be there).
    # Each gives the plain value when the field holds one fit for its use, else None / "" / [].

    def count(self, key: str) -> int | None:
        """A step, restart count, byte count: a whole number from 0 to int64's top."""
        return numbers.count(self.fields.get(key))

    def integer(self, key: str) -> int | None:
        """Any whole number that fits int64 (an exit code may be negative)."""
        return numbers.whole(self.fields.get(key), -numbers.MAX_INT64)

    def seconds(self, key: str) -> float | None:
        """A duration in seconds (0 to ``numbers.MAX_SECONDS``)."""
        return numbers.seconds(self.fields.get(key))

    def when(self, key: str) -> float | None:
        """A point in time, in unix seconds."""
        return numbers.unix_time(self.fields.get(key))

    def text(self, key: str, limit: int = 1000) -> str:
        """A string field (a number is shown as text), cut to ``limit`` characters; "" otherwise."""
        value = self.fields.get(key)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            return ""
        return (value if isinstance(value, str) else numbers.shown(value, limit))[:limit]

    def names(self, key: str, limit: int = 1024) -> list[str]:
        """A list of names (nodes): the string items of a list field, at most ``limit``."""
        value = self.fields.get(key)
        if not isinstance(value, list):
            return []
        return [v for v in value if isinstance(v, str)][:limit]


def in_allocation(event: "Event") -> bool:
    """Whether ``event`` is the in-allocation launcher's (``where: "allocation"``)."""
    return event.get(WHERE) == WHERE_ALLOCATION


def encode_event(kind: str, fields: Mapping[str, Any], *, now: float | None = None) -> bytes:
    """The exact bytes of one journal line (validated; ends with a newline)."""
    if not isinstance(kind, str) or not _KIND_RE.match(kind):
        raise JournalError(f"journal event kind {kind!r} must match {_KIND_RE.pattern}")
    clash = _RESERVED.intersection(fields)
    if clash:
        raise JournalError(f"journal event field {sorted(clash)[0]!r} is reserved")
    record = {"v": JOURNAL_VERSION, "t": time.time() if now is None else now, "kind": kind}
    record.update(fields)
    try:
        line = json.dumps(record, sort_keys=True, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise JournalError(f"journal event {kind!r} is not JSON-serialisable: {exc}") from None
    return (line + "\n").encode()


def append_event(path: Path, kind: str, /, **fields: Any) -> None:
    """Append one event to the journal at ``path`` (one O_APPEND write + fsync)."""
    _append_lines(Path(path), encode_event(kind, fields))


def _append_lines(path: Path, data: bytes) -> None:
    """Append whole encoded lines with one O_APPEND write, then fsync."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = open_for_append(path)
    try:
        written = os.write(fd, data)
        if written != len(data):
            raise OSError(f"short append to {path}: {written} of {len(data)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)


def open_for_append(path: Path) -> int:
    """An O_APPEND descriptor of the journal: created if missing, never through a link, and only a
    regular file (opened non-blocking, so a FIFO put there fails at once instead of blocking)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC | os.O_NOCTTY, 0o644)
    except OSError as exc:
        raise refusal(path, str(path), None, exc) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeFileError(path, "not a regular file, not written")
    return fd


# Kinds a Journal buffers by default: written every step, and nobody acts on one of them alone.
BUFFERED_KINDS = frozenset({LOSS})


@dataclass(frozen=True)
class JournalConfig:
    """``[journal]`` settings of the in-job writer (slurmft.toml, ``SLURMFT_JOURNAL_<FIELD>``).

    ``flush_every_events = 1`` makes every per-step event durable at once (as before buffering).
    """

    flush_every_events: int = 100
    flush_every_s: float = 10.0

    def __post_init__(self) -> None:
        if self.flush_every_events < 1:
            raise ValueError(f"flush_every_events must be >= 1, got {self.flush_every_events}")
        if self.flush_every_s <= 0:
            raise ValueError(f"flush_every_s must be > 0, got {self.flush_every_s}")

    @classmethod
    def load(cls, config_file: str | Path | None = None, *, environ: Mapping[str, str] | None = None,
             **overrides: Any) -> "JournalConfig":
        """Defaults < ``[journal]`` of the config file < environment < ``overrides``."""
        return load_section(cls, "journal", config_file=config_file, environ=environ, overrides=overrides)


def _flush_at_exit(ref: "weakref.ref[Journal]") -> None:
    journal = ref()
    if journal is not None:
        try:
            journal.flush()
        except OSError as exc:
            log.error("journal %s: %d buffered event(s) lost at exit: %s", journal.path,
                      len(journal._pending), exc)


class Journal:
    """The journal of one run directory, stamped with the job id and restart count of this writer,
    and with ``attempt`` (torchrun's restart count inside one job segment) when one is given.

    ``buffered_kinds`` are kept in memory until the next durable event, ``flush_every_events``
    of them, the oldest being ``flush_every_s`` old, ``flush()`` or interpreter exit; every other
    kind is written and fsynced before ``append`` returns. Safe to call from several threads.
    """

    def __init__(self, run_dir: RunDir | Path, *, job_id: str | None = None,
                 restart_count: int | None = None, attempt: int | None = None,
                 buffered_kinds: Iterable[str] = BUFFERED_KINDS,
                 flush_every_events: int = JournalConfig.flush_every_events,
                 flush_every_s: float = JournalConfig.flush_every_s) -> None:
        JournalConfig(flush_every_events, flush_every_s)  # validates both
        self.run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
        self.job_id = job_id
        self.restart_count = restart_count
        self.attempt = attempt
        self.buffered_kinds = frozenset(buffered_kinds)
        self.flush_every_events = flush_every_events
        self.flush_every_s = flush_every_s
        self._pending: list[bytes] = []
        self._pending_since = 0.0
        self._lock = threading.Lock()
        self._flushes_at_exit = False  # registered with the first buffered event, not per Journal

    @property
    def path(self) -> Path:
        return self.run_dir.events

    @property
    def pending(self) -> int:
        """Buffered events not written yet."""
        return len(self._pending)

    def append(self, kind: str, /, **fields: Any) -> None:
        stamped: dict[str, Any] = {"job_id": self.job_id, "restart_count": self.restart_count}
        if self.attempt is not None:
            stamped["attempt"] = self.attempt
        stamped.update(fields)
        line = encode_event(kind, stamped)  # validated (and timestamped) now, even if written later
        with self._lock:
            if kind in self.buffered_kinds:
                if not self._flushes_at_exit:
                    atexit.register(_flush_at_exit, weakref.ref(self))
                    self._flushes_at_exit = True
                if not self._pending:
                    self._pending_since = time.monotonic()
                self._pending.append(line)
                if (len(self._pending) < self.flush_every_events
                        and time.monotonic() - self._pending_since < self.flush_every_s):
                    return
                line = b""
            self._write_locked(line)

    def flush(self) -> None:
        """Write and fsync every buffered event now."""
        with self._lock:
            self._write_locked(b"")

    def _write_locked(self, tail: bytes) -> None:
        data = b"".join(self._pending) + tail
        if data:
            _append_lines(self.path, data)  # on failure the buffer is kept for the next try
        self._pending.clear()

    def read(self, kinds: Iterable[str] | None = None) -> list[Event]:
        self.flush()  # this writer's own buffered events are part of what it reads back
        return read_events(self.path, kinds)


def parse_line(line: str) -> Event | None:
    """One line -> Event, or None when it is not a journal event this version understands
    (anything unparseable: too long, not JSON, nested too deeply, a number too long to convert,
    ``NaN`` or ``Infinity`` anywhere, a time ``t`` that is not a unix time from 1970 to 9999)."""
    if len(line) > MAX_LINE_BYTES:
        return None
    try:
        record = numbers.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    version, kind = numbers.whole(record.get("v"), 1), record.get("kind")
    if version is None or version > JOURNAL_VERSION or not isinstance(kind, str):
        return None
    when = numbers.unix_time(record.get("t"))
    if when is None:
        return None
    fields = {k: v for k, v in record.items() if k not in _RESERVED}
    return Event(kind=kind, time=when, fields=fields, version=version)


def read_events(path: Path, kinds: Iterable[str] | None = None) -> list[Event]:
    """Every event in file order (optionally only ``kinds``); [] when the journal does not exist."""
    wanted = None if kinds is None else frozenset(kinds)
    try:
        lines = _read_tail(Path(path)).decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    events, skipped = [], 0
    for line in lines:
        if not line.strip():
            continue
        event = parse_line(line)
        if event is None:
            skipped += 1
            continue
        if wanted is None or event.kind in wanted:
            events.append(event)
    if skipped:
        log.warning("%s: skipped %d line(s) that are not journal events of version <= %d",
                    path, skipped, JOURNAL_VERSION)
    return events


def _read_tail(path: Path) -> bytes:
    """The journal's bytes (its last ``MAX_READ_BYTES``, from a line start): a regular file only,
    no link followed (``UnsafeFileError`` otherwise)."""
    fd, st = open_regular(path)
    try:
        start = max(0, st.st_size - MAX_READ_BYTES)
        if start:
            os.lseek(fd, start, os.SEEK_SET)
        chunks, left = [], MAX_READ_BYTES
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if start:
        log.warning("%s: larger than %d bytes; only its end is read", path, MAX_READ_BYTES)
        data = data[data.find(b"\n") + 1:] if b"\n" in data else b""
    return data


def segment_outcome(events: Iterable[Event], job_id: str, restart_count: int) -> Event | None:
    """The last ``segment_end`` written by the job segment (job id, restart count), if any."""
    found = None
    for event in events:
        if (event.kind == SEGMENT_END and str(event.get("job_id")) == str(job_id)
                and event.count("restart_count") == restart_count):
            found = event
    return found


def _parse_field(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise JournalError(f"field {text!r} must be KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    """Command line: ``append`` an event, or print a segment's recorded ``outcome``."""
    parser = argparse.ArgumentParser(prog="python -m slurmft.journal", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("append", help="append one event: KIND [KEY=VALUE ...] (values JSON or text)")
    add.add_argument("run_dir", type=Path)
    add.add_argument("kind")
    add.add_argument("fields", nargs="*")
    out = sub.add_parser("outcome", help="print the exit code the segment recorded (nothing if none)")
    out.add_argument("run_dir", type=Path)
    out.add_argument("job_id")
    out.add_argument("restart_count", type=int)
    args = parser.parse_args(argv)
    try:
        if args.command == "append":
            fields = dict(_parse_field(f) for f in args.fields)
            append_event(RunDir(args.run_dir).events, args.kind, **fields)
        else:
            event = segment_outcome(read_events(RunDir(args.run_dir).events), args.job_id,
                                    args.restart_count)
            code = None if event is None else event.integer("exit_code")
            if code is not None:
                print(code)
    except (JournalError, OSError) as exc:
        print(f"slurmft.journal: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
