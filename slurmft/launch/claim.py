"""The run dir's claim, ``<run_dir>/claim.json``: which job (array task) runs in it now.

Two jobs, or two tasks of an array, writing one run dir would resume each other's checkpoints and
mix their journals. Whatever the path's spelling (``%a``, a wrapper that exports
``SLURMFT_RUN_DIR=/runs/sweep/task_$SLURM_ARRAY_TASK_ID``, a symlinked parent), the fact is on
disk: the launcher claims the run dir before anything else is written there. A claim is created
exclusively (written to a temp name, fsynced, then ``link``ed to ``claim.json``, which fails if
one exists: atomic on local filesystems and NFS alike). A claim by this same job (a requeue) is
ours. A claim by another job that Slurm says is still alive refuses this one; a claim by a job
that ended (or that Slurm forgot) is taken over: judged (Slurm asked) outside any lock, then,
under ``.claim.lock`` (created exclusively the same way; a lock over a minute old is a dead
holder's), checked to be the very claim that was judged, moved aside and replaced exclusively:
every change of ``claim.json`` happens under that lock, so two takeovers can never both win. Without ``scontrol`` nothing can be
asked: a claim by a task of the same array job refuses (sibling tasks run at the same time),
any other is taken over (jobs in one run dir follow each other).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

from slurmft import safeio
from slurmft.launch.identity import JobIdentity
from slurmft.rundir import CLAIM, fsync_dir

CLAIM_VERSION = 1
MAX_CLAIM_BYTES = 4096
TRIES = 5
LOCK = ".claim.lock"
LOCK_WAIT_S = 30.0   # a lock is held for a few file operations: longer means its holder died
LOCK_STALE_S = 60.0


class ClaimRefused(Exception):
    """The run dir is another live job's, or the claim cannot be judged; ``code`` is the exit
    code (86: do not requeue; 1: could not tell now, passed on), the message says whose."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Claim:
    job_id: str               # the array-aware id Slurm commands take
    raw_job_id: str
    array_job_id: str | None
    array_task_id: str | None
    host: str
    time: float

    @staticmethod
    def of(ident: JobIdentity) -> "Claim":
        return Claim(ident.slurm_id, ident.raw_job_id, ident.array_job_id, ident.array_task_id,
                     socket.gethostname(), time.time())

    def describe(self) -> str:
        task = f" (task {self.array_task_id} of array job {self.array_job_id})" \
            if self.array_task_id is not None else ""
        return f"job {self.job_id}{task}"


def read_claim(path: Path) -> Claim | None:
    """The claim at ``path``; None when there is none. A claim that is not one (not a regular
    file, not JSON of this shape) is ClaimRefused: the run dir is untrusted input."""
    try:
        data = safeio.read_regular(path, MAX_CLAIM_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ClaimRefused(86, f"{path}: cannot be read as a claim ({exc.strerror or exc}): "
                           "remove it if no job runs in this run dir") from None
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.pop("version", None) != CLAIM_VERSION:
            raise TypeError("not a claim of version 1")
        claim = Claim(**raw)
        if not all(isinstance(v, str) for v in (claim.job_id, claim.raw_job_id, claim.host)) \
                or not all(v is None or isinstance(v, str) for v in (claim.array_job_id,
                                                                      claim.array_task_id)):
            raise TypeError("a field has the wrong type")
    except (ValueError, TypeError, RecursionError) as exc:
        raise ClaimRefused(86, f"{path}: not a slurmft run dir claim ({exc}): remove it if no job "
                           "runs in this run dir") from None
    return claim


def _publish(run_dir: Path, claim: Claim) -> bool:
    """Create ``claim.json`` exclusively; False when one exists already."""
    data = json.dumps({"version": CLAIM_VERSION, **asdict(claim)}, sort_keys=True).encode() + b"\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{CLAIM}.", suffix=".tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        try:
            os.link(tmp, run_dir / CLAIM)
        except FileExistsError:
            return False
        fsync_dir(run_dir)
        return True
    finally:
        os.unlink(tmp)


def _move_aside(run_dir: Path, judged: Claim, me: Claim) -> bool:
    """Move the ended job's claim out of the way; False when another launcher was first."""
    aside = run_dir / f".{CLAIM}.ended-{me.raw_job_id}-{os.getpid()}"
    try:
        os.rename(run_dir / CLAIM, aside)
    except FileNotFoundError:
        return False
    try:
        moved = read_claim(aside)
    except ClaimRefused:
        moved = None
    if moved != judged:  # a live claim made meanwhile: put it back (it was first)
        try:
            os.link(aside, run_dir / CLAIM)
        except FileExistsError:
            pass
        os.unlink(aside)
        return False
    os.unlink(aside)
    return True


def claim_run_dir(run_dir: Path, ident: JobIdentity,
                  alive: Callable[[str], bool | None] | None) -> Claim:
    """Claim ``run_dir`` for this job, or raise ClaimRefused naming the job that holds it.
    ``alive(job_id)``: does Slurm still run (or queue) that job? None: could not tell now.
    ``alive`` None: no ``scontrol`` in the job (see the module's docstring)."""
    me = Claim.of(ident)
    path = run_dir / CLAIM
    for _ in range(TRIES):
        held = read_claim(path)
        if held is not None and held.job_id == me.job_id:
            return held  # this job's own claim: it was requeued
        if held is not None:
            if alive is None:
                live: bool | None = held.array_job_id is not None and held.array_job_id == me.array_job_id
            else:
                live = alive(held.job_id)  # outside the lock: Slurm may take seconds to answer
            if live is None:
                raise ClaimRefused(1, f"run dir {run_dir} is claimed by {held.describe()} and Slurm "
                                   "could not be asked whether it still runs: not starting now")
            if live:
                raise ClaimRefused(86, f"run dir {run_dir} is claimed by {held.describe()}, which is "
                                   f"still alive: every job and array task needs its own run dir")
        # Every change of claim.json is made under the lock, after checking that it still holds
        # what was judged: a takeover that moved a claim aside while another launcher published
        # made two owners (8 launchers taking over one ended claim at once, seen once).
        with _lock(run_dir):
            if read_claim(path) != held:
                continue  # another launcher changed it meanwhile: judge again
            if held is not None:
                _move_aside(run_dir, held, me)
            if _publish(run_dir, me):
                return me
    raise ClaimRefused(1, f"run dir {run_dir}: could not claim it in {TRIES} tries (other jobs "
                       "claim it at the same moment)")


@contextlib.contextmanager
def _lock(run_dir: Path) -> Iterator[None]:
    """``<run_dir>/.claim.lock``, created exclusively (link, as the claim); a lock older than
    ``LOCK_STALE_S`` is its dead holder's and is removed. Bounded by ``LOCK_WAIT_S``."""
    lock = run_dir / LOCK
    fd, tmp = tempfile.mkstemp(prefix=f"{LOCK}.", suffix=".tmp", dir=run_dir)
    os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
    os.close(fd)
    deadline = time.monotonic() + LOCK_WAIT_S
    try:
        while True:
            try:
                os.link(tmp, lock)
                break
            except FileExistsError:
                pass
            try:
                if time.time() - os.lstat(lock).st_mtime > LOCK_STALE_S:
                    os.unlink(lock)
                    continue
            except FileNotFoundError:
                continue
            except OSError:
                pass  # not removable (a directory in its place): waited for, then refused
            if time.monotonic() > deadline:
                raise ClaimRefused(1, f"run dir {run_dir}: {LOCK} was held by another launcher "
                                   f"for {LOCK_WAIT_S:g} s: not starting now") from None
            time.sleep(random.uniform(0.005, 0.05))
    finally:
        os.unlink(tmp)
    try:
        yield
    finally:
        try:
            os.unlink(lock)
        except FileNotFoundError:
            pass
