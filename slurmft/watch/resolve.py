"""Which run directory a watched job writes, and whether the watcher may act on it.

The job comment (``SLURMFT_RUN_DIR=...``) and ``--run-dir`` are the user's words: the watcher
acts only on a directory that is a slurmft run dir (it has ``events.jsonl``, ``checkpoints/`` or
``heartbeat/``, or is still empty: a job that has just started), is not reached through a symlink at its last component, and is owned by the
job's user; and it runs as that user, never with more rights (root may watch only root's jobs).
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from slurmft.rundir import CHECKPOINTS, EVENTS, HEARTBEAT, WATCH
from slurmft.slurm.client import Job


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
    marked = any(os.path.lexists(path / name) for name in (EVENTS, CHECKPOINTS, HEARTBEAT))
    try:
        unmarked_content = not marked and _has_entries(path)
    except OSError as exc:
        raise ResolveError(f"job {job.job_id}: run dir {path}: {exc.strerror}") from None
    if unmarked_content:
        raise ResolveError(f"job {job.job_id}: {path} is not a slurmft run dir (no {EVENTS}, "
                           f"{CHECKPOINTS}/ or {HEARTBEAT}/, and it is not empty)")
    return Path(os.path.realpath(path))
