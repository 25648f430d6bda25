"""The run directory: the one contract between the in-job side and the cluster side.

This module owns the layout (every path name is spelled here and nowhere else) and the atomic
write used for every file in it: write to a temporary name in the same directory, fsync the file,
rename over the final name, fsync the directory. A reader therefore sees either the old file or
the new one, never a torn one, even after a kill -9 or a node crash.

It imports neither torch nor anything that talks to Slurm, so both sides can use it.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUN_DIR_ENV = "SLURMFT_RUN_DIR"

CHECKPOINTS = "checkpoints"
HEARTBEAT = "heartbeat"
EVENTS = "events.jsonl"
WATCH = "watch"
DONE = "DONE"
CKPT_TIERS = "ckpt_tiers.json"  # which nodes' local tiers hold which steps (slurmft.checkpoint.tiers)
CLAIM = "claim.json"  # which job (array task) runs in the run dir now (slurmft.launch.claim)
# In-allocation mode: the launcher's view of the allocation (generation, active, spares, fenced),
# written by the launcher on the batch host, read by the ranks (slurmft.train.alloc_watch), the
# watcher and status; parsed by slurmft.allocation.
ALLOCATION = "allocation.json"
ALIVE = "alive"  # in-allocation mode: each node's task beats here every second (slurmft.launch.task)
SPARES = "spares"  # in-allocation mode: the spare jobs' batch script and logs (slurmft.launch.refill)
STEP_PREFIX = "step_"
TMP_MARK = ".tmp-"
STEP_DIGITS = 9


def step_dirname(step: int) -> str:
    """``step_000001200`` for step 1200: zero-padded so lexical order is numeric order."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a committed checkpoint directory name, or None for anything else (incl. tmp).

    Only the canonical form :func:`step_dirname` writes is a step: ASCII digits, zero-padded to
    ``STEP_DIGITS``, no extra leading zero (``step_5``, ``step_0000000005``, non-ASCII digits are
    not), so every reader that lists a name finds the same directory by its step.
    """
    if not name.startswith(STEP_PREFIX):
        return None
    digits = name[len(STEP_PREFIX):]
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 20:
        return None
    step = int(digits)
    return step if step_dirname(step) == name else None


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory. Creating the object touches nothing on disk."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @classmethod
    def from_env(cls) -> "RunDir":
        value = os.environ.get(RUN_DIR_ENV)
        if not value:
            raise ValueError(f"${RUN_DIR_ENV} is not set")
        return cls(Path(value))

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def heartbeat_dir(self) -> Path:
        return self.root / HEARTBEAT

    def heartbeat(self, node: str) -> Path:
        return self.heartbeat_dir / f"{node}.json"

    @property
    def events(self) -> Path:
        return self.root / EVENTS

    @property
    def watch_state(self) -> Path:
        return self.root / WATCH / "state.json"

    @property
    def done(self) -> Path:
        return self.root / DONE

    @property
    def ckpt_tiers(self) -> Path:
        return self.root / CKPT_TIERS

    @property
    def claim(self) -> Path:
        return self.root / CLAIM

    @property
    def allocation(self) -> Path:
        return self.root / ALLOCATION

    @property
    def spares(self) -> Path:
        """The spare jobs' batch script and logs (in-allocation mode's refill)."""
        return self.root / SPARES

    def alive(self, node: str) -> Path:
        return self.root / ALIVE / f"{node}.json"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_dirname(step)

    def committed_steps(self) -> list[int]:
        """Steps of committed checkpoint directories, oldest first (unverified; links ignored)."""
        if not self.checkpoints.is_dir():
            return []
        steps = []
        for entry in os.scandir(self.checkpoints):
            step = parse_step_dirname(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):  # a link is no checkpoint
                steps.append(step)
        return sorted(steps)


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or create inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` atomically and durably (temp name, fsync, rename, fsync dir)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as indented, key-sorted JSON with a trailing newline."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


DONE_VERSION = 1
MAX_DONE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Done:
    """What the ``DONE`` marker says: which job (and restart) reached which step of how many.
    A later run in the same directory (a larger ``--steps``) may train past it; the launcher
    decides "finished" from its own segment's recorded outcome, never from this file."""

    job_id: str | None
    step: int | None
    total_steps: int | None
    restart_count: int | None = None


def write_done(run_dir: RunDir, *, job_id: str | None, step: int, total_steps: int,
               restart_count: int | None = None) -> None:
    """Write ``DONE`` (atomically) for this job's run that reached ``step`` of ``total_steps``."""
    atomic_write_json(run_dir.done, {"version": DONE_VERSION, "job_id": job_id, "step": step,
                                     "total_steps": total_steps, "restart_count": restart_count})


def read_done(run_dir: RunDir) -> Done | None:
    """The ``DONE`` marker, or None when there is none. Only a regular file is read (no symlink,
    no FIFO), at most MAX_DONE_BYTES; an older plain-text marker (``<step>\n``) and anything
    unparseable give a ``Done`` with the fields it could not tell left None."""
    try:
        fd = os.open(run_dir.done, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, MAX_DONE_BYTES)
    finally:
        os.close(fd)

    def integer(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    try:
        record = json.loads(data)
    except (ValueError, RecursionError):
        record = None
    if isinstance(record, int) and not isinstance(record, bool):  # "1200\n": the older marker
        return Done(job_id=None, step=record, total_steps=None)
    if not isinstance(record, dict):
        return Done(job_id=None, step=None, total_steps=None)
    job = record.get("job_id")
    return Done(job_id=str(job) if isinstance(job, (str, int)) and not isinstance(job, bool) else None,
                step=integer(record.get("step")), total_steps=integer(record.get("total_steps")),
                restart_count=integer(record.get("restart_count")))


def read_json(path: Path) -> Any:
    """Read a JSON file written by :func:`atomic_write_json`."""
    with open(path, "rb") as fh:
        return json.load(fh)
