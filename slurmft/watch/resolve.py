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
import sys
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


def await_run_dirs(client, jobs: list, explicit: Path | None, poll_s: float, *, once: bool,
                   find, startup_s: float = 300.0, sleep=None, clock=None) -> list:
    """Jobs that have not started yet name no run dir (the launcher sets the comment a few seconds
    after the job starts): wait while they are PENDING, and for up to ``startup_s`` once RUNNING,
    re-reading them every ``poll_s`` (Slurm bounds the pending wait: the job starts or ends). With
    ``--once`` such a job is left for the next cycle (dropped from this one). A held job is not
    waited for: it starts only when someone releases it (it then fails as naming no run dir, with
    the hint to pass --run-dir). Returns the jobs to watch now."""
    sleep = sleep or time.sleep
    clock = clock or time.monotonic
    running_since: dict[str, float] = {}

    def waiting(job) -> bool:
        if explicit is not None or job.run_dir is not None:
            return False
        if job.state is JobState.PENDING:
            return job.reason not in HELD_REASONS
        if job.state is JobState.RUNNING:  # started, the launcher not yet at its comment
            return clock() - running_since.setdefault(job.job_id, clock()) < startup_s
        return False

    pending = [j for j in jobs if waiting(j)]
    if not pending:
        return jobs
    names = ", ".join(j.job_id for j in pending)
    if once:
        print(f"slurmft watch: job(s) {names} have not started (no run dir named yet): "
              "nothing to watch in this cycle", file=sys.stderr)
        return [j for j in jobs if not waiting(j)]
    print(f"slurmft watch: waiting for job(s) {names} to start (a job names its run dir when it "
          "starts; --run-dir skips the wait)", file=sys.stderr, flush=True)
    while any(waiting(j) for j in jobs):
        sleep(poll_s)
        jobs = [find(client, j.job_id) if waiting(j) else j for j in jobs]
    return jobs
