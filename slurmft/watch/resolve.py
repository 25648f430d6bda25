"""Which run directory a watched job writes, and whether the watcher may act on it.

The job comment (``SLURMFT_RUN_DIR=...``) and ``--run-dir`` are the user's words: the watcher
acts only on a directory that is a slurmft run dir (it has ``events.jsonl``, ``checkpoints/``,
``heartbeat/`` or the launcher's ``claim.json``, or is still empty: a job that has just started),
is not reached through a symlink at its last component, and is owned by the job's user; and it
runs as that user, never with more rights (root may watch only root's jobs).
"""

from __future__ import annotations

import os
import pwd
import stat
import time
from pathlib import Path

from slurmft.rundir import CHECKPOINTS, CLAIM, EVENTS, HEARTBEAT, WATCH
from slurmft.slurm.client import Job, JobState
from slurmft.slurm.policy import HELD_REASONS


class ResolveError(ValueError):
    """The job cannot be watched as asked; the message names the job and what is wrong."""


def current_user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def check_owner(job: Job) -> None:
    me = current_user()
    if job.user and job.user != me:
        raise ResolveError(f"job {job.job_id} belongs to user {job.user}: run slurmft watch as "
                           f"{job.user} (the watcher never acts with more rights than the job's owner)")


def _has_entries(path: Path) -> bool:
    with os.scandir(path) as entries:
        return any(not e.name.startswith(".slurmft-probe-") for e in entries)


def run_dir_for(job: Job, explicit: Path | None) -> Path:
    """The job's run dir (``explicit`` wins over the job comment), checked as described above."""
    raw = explicit if explicit is not None else job.run_dir
    if raw is None:
        raise ResolveError(f"job {job.job_id} names no run dir (the template sets the comment "
                           "SLURMFT_RUN_DIR=... when the job starts): pass --run-dir")
    path = Path(raw)
    if not path.is_absolute():
        raise ResolveError(f"job {job.job_id}: run dir {path} is not an absolute path")
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise ResolveError(f"job {job.job_id}: run dir {path}: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ResolveError(f"job {job.job_id}: run dir {path} is not a directory (symlinks are "
                           "not followed)")
    owner = job.user or current_user()
    try:
        uid = pwd.getpwnam(owner).pw_uid
    except KeyError:
        raise ResolveError(f"job {job.job_id}: its user {owner!r} is unknown here") from None
    if info.st_uid != uid:
        raise ResolveError(f"job {job.job_id}: run dir {path} is not owned by the job's user {owner}")
    for name in (WATCH, HEARTBEAT, CHECKPOINTS, EVENTS):
        if os.path.islink(path / name):
            raise ResolveError(f"job {job.job_id}: {path / name} is a symlink (slurmft never "
                               "follows one out of a run dir)")
    marked = any(os.path.lexists(path / name) for name in (EVENTS, CHECKPOINTS, HEARTBEAT, CLAIM))
    try:
        unmarked_content = not marked and _has_entries(path)
    except OSError as exc:
        raise ResolveError(f"job {job.job_id}: run dir {path}: {exc.strerror}") from None
    if unmarked_content:
        raise ResolveError(f"job {job.job_id}: {path} is not a slurmft run dir (no {EVENTS}, "
                           f"{CHECKPOINTS}/ or {HEARTBEAT}/, and it is not empty)")
    return Path(os.path.realpath(path))


READY, WAIT = "ready", "wait"


class StartWait:
    """Named jobs that have not named their run dir yet: the launcher sets the comment a few
    seconds after the job starts. They ride along in the watcher's cycle query and are taken on
    as soon as they name it, so one job waiting to start never stops the others from being
    watched. ``judge`` says, each cycle, READY, WAIT, or why the job cannot be watched: held (it
    starts only when someone releases it), ended before naming a run dir, RUNNING for
    ``startup_s`` without naming one, or missing from two answers in a row."""

    def __init__(self, job_ids, startup_s: float, clock=None) -> None:
        self.clock = clock or time.monotonic
        self.startup_s = startup_s
        self._running_since: dict[str, float] = {}
        self._missed: dict[str, int] = {}
        self.pending: list[str] = list(job_ids)
        self.refused: list[str] = []  # why each job that could not be taken on was not

    def judge(self, job_id: str, job) -> str:
        verdict = self._judge(job_id, job)
        if verdict != WAIT:
            self.pending.remove(job_id)
        if verdict not in (READY, WAIT):
            self.refused.append(verdict)
        return verdict

    def _judge(self, job_id: str, job) -> str:
        hint = "(the template sets the comment SLURMFT_RUN_DIR=... when the job starts): pass --run-dir"
        if job is None:
            self._missed[job_id] = self._missed.get(job_id, 0) + 1
            return WAIT if self._missed[job_id] < 2 else \
                f"job {job_id} is no longer listed by Slurm and never named a run dir {hint}"
        self._missed.pop(job_id, None)
        if job.run_dir is not None:
            return READY
        if job.state is JobState.PENDING:
            return WAIT if job.reason not in HELD_REASONS else \
                f"job {job_id} is held ({job.reason}) and names no run dir {hint}"
        if job.state is JobState.RUNNING:
            since = self._running_since.setdefault(job_id, self.clock())
            return WAIT if self.clock() - since < self.startup_s else \
                f"job {job_id} has run {self.startup_s:.0f} s without naming a run dir {hint}"
        return f"job {job_id} ended ({job.state.value}) without naming a run dir {hint}"


def waiting_for_start(job) -> bool:
    """A job that names no run dir yet and may still name one (pending, not held; running)."""
    if job.run_dir is not None:
        return False
    return (job.state is JobState.PENDING and job.reason not in HELD_REASONS) \
        or job.state is JobState.RUNNING
