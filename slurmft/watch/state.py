"""The watcher's own state for one run, ``<run_dir>/watch/state.json``, and the run's lock.

The state belongs to the run dir, not to a job: ``epochs`` lists the jobs that ran in it, oldest
first. A new job in the same run dir (the user's next ``sbatch``) starts a new epoch: what judges
one job (restart counts, the crash-loop memory, step times, the recovery) starts afresh, what the
watcher learned about nodes (``CARRIED``) is kept. A job the watcher resubmitted itself continues
its epoch under the new id (``resubmitted_from``). Any job id of any epoch finds the run. Version 1
files (one job, no epochs) are read as one epoch.

The state records each recovery step's intent before the step is taken and its completion after,
so a watcher killed at any moment (between the requeue and the ``ExcNodeList`` update included)
is carried on by the next one with no double requeue and no lost exclusion. Written atomically
(``slurmft.rundir.atomic_write_json``). One watcher per run: ``RunLock`` (``lock.py``: flock and
a lease that holds on shared filesystems) names the holder to a second one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from slurmft.rundir import RunDir, atomic_write_json
from slurmft.slurm.client import Job, JobState
from slurmft.slurm.policy import HELD_REASONS
from slurmft.watch.lock import LockError, RunLock  # noqa: F401  (the lock lives in lock.py)
from slurmft.watch.runview import read_small_json

STATE_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: before epochs (the state of one job)
MAX_EPOCHS = 1024  # a run of months is a few hundred jobs; the oldest are dropped past this
log = logging.getLogger("slurmft.watch")

WATCHING, RECOVERING, FINISHED, GAVE_UP, LOST = "watching", "recovering", "finished", "gave_up", "lost"
PHASES = (WATCHING, RECOVERING, FINISHED, GAVE_UP, LOST)
# Recovery step progress: todo -> doing (intent recorded, about to act) -> done; skip: not needed.
TODO, DOING, DONE, SKIP = "todo", "doing", "done", "skip"


class StateError(RuntimeError):
    """The state file cannot be used; the message names the file."""


class RunBusy(StateError):
    """The run dir's current job is still alive: another job there cannot be taken on yet."""


@dataclass
class Recovery:
    """One fault being recovered from."""

    cause: str
    evidence: str
    fault_time: float
    detect_time: float
    restart_count: int          # the job's restart count when the fault was seen
    exclude: list[str] = field(default_factory=list)
    requeue: str = TODO
    exclude_step: str = TODO
    start_now: str = TODO
    release: str = SKIP         # a job Slurm held after a failed launch: released once excluded
    release_attempts: int = 0
    requeued_at: float | None = None
    pending_since: float | None = None
    start_now_attempts: int = 0
    start_now_at: float | None = None
    exclude_attempts: int = 0
    readmit_attempts: int = 0
    warned_pending: bool = False
    set_down: list[str] = field(default_factory=list)  # operator mode: nodes set DOWN mid-recovery
    silent_since: dict[str, float] = field(default_factory=dict)  # NOT_RESPONDING first seen


@dataclass
class Epoch:
    """One job that ran in the run dir: its id, when the watcher first took it on (its own clock),
    and, for a job the watcher submitted in place of a forgotten one, that job's id."""

    job_id: str
    since: float | None = None
    resubmitted_from: str | None = None


# Kept from one epoch to the next: what the watcher learned about the cluster's nodes, and the
# epochs themselves. Every other field judges one job and starts afresh with a new one.
CARRIED = ("node_faults", "clean_since", "epochs")


@dataclass
class RunState:
    job_id: str  # the current epoch's job: the one watched now
    phase: str = WATCHING
    restarts: int = 0
    restarts_by_cause: dict[str, int] = field(default_factory=dict)
    node_faults: dict[str, int] = field(default_factory=dict)
    ckpt_at_recovery: list[int | None] = field(default_factory=list)
    last_restart_count: int | None = None
    last_nodes: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)  # nodes this watcher excluded, oldest first
    max_step_s: float | None = None
    max_beat_gap_s: float | None = None
    recovery: Recovery | None = None
    warned: list[str] = field(default_factory=list)
    reason: str = ""
    resubmit_started: float | None = None  # intent: a resubmission may be in flight since then
    announced: bool = False  # a watch_started event was journaled for this run
    # Per node, when first seen so: NOT_RESPONDING (operator mode's corroboration), drained by
    # an admin (maintenance, waited on until a checkpoint commits), serving the job with no fault
    # since (its faults fade, one per node_fault_fade_s).
    silent_since: dict[str, float] = field(default_factory=dict)
    drained_since: dict[str, float] = field(default_factory=dict)
    clean_since: dict[str, float] = field(default_factory=dict)
    epochs: list[Epoch] = field(default_factory=list)  # oldest first; the last is job_id's

    def __post_init__(self) -> None:
        if not self.epochs:
            self.epochs = [Epoch(self.job_id)]

    def knows(self, job_id: str) -> bool:
        """``job_id`` ran in this run dir (any epoch, before or after a resubmission)."""
        return any(job_id in (e.job_id, e.resubmitted_from) for e in self.epochs)

    def new_epoch(self, job_id: str, now: float) -> None:
        """A new job (not the watcher's resubmission) in this run dir: every field that judges
        one job starts afresh; ``CARRIED`` fields are kept."""
        fresh = RunState(job_id=job_id)
        for name in CARRIED:
            setattr(fresh, name, getattr(self, name))
        fresh.epochs = [*self.epochs, Epoch(job_id, now)][-MAX_EPOCHS:]
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(fresh, f.name))

    def resubmitted(self, new_id: str, now: float) -> None:
        """The watcher submitted ``new_id`` in place of the forgotten current job: the same epoch
        goes on (counts carry) under the new id; the old id still finds the run."""
        self.epochs = [*self.epochs, Epoch(new_id, now, resubmitted_from=self.job_id)][-MAX_EPOCHS:]
        self.job_id = new_id

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["version"] = STATE_VERSION
        return data

    @classmethod
    def from_json(cls, data: Any, where: Path) -> "RunState":
        if not isinstance(data, dict) or data.get("version") not in READABLE_VERSIONS:
            raise StateError(f"{where}: not a slurmft watch state (versions "
                             f"{', '.join(map(str, READABLE_VERSIONS))})")
        try:
            raw = dict(data)
            raw.pop("version")
            recovery = raw.pop("recovery", None)
            epochs = raw.pop("epochs", None)
            state = cls(**raw)
            state.recovery = Recovery(**recovery) if recovery is not None else None
            if data["version"] >= 2:
                if not isinstance(epochs, list) or not epochs or len(epochs) > MAX_EPOCHS \
                        or not all(isinstance(e, dict) for e in epochs):
                    raise StateError(f"{where}: field epochs has the wrong type (remove the file "
                                     "to start afresh)")
                state.epochs = [Epoch(**e) for e in epochs]
        except TypeError as exc:
            raise StateError(f"{where}: unreadable watch state ({exc})") from None
        if state.phase not in PHASES:
            raise StateError(f"{where}: unknown phase {state.phase!r}")
        _check_types(state, where)
        return state

    def warn_once(self, key: str) -> bool:
        """True the first time ``key`` is seen (the caller then warns)."""
        if key in self.warned:
            return False
        self.warned.append(key)
        del self.warned[:-256]
        return True


def _check_types(state: RunState, where: Path) -> None:
    """The state file is in the user's run dir: every field must have its type."""
    def bad(name: str) -> StateError:
        return StateError(f"{where}: field {name} has the wrong type (remove the file to start afresh)")

    if not isinstance(state.job_id, str) or not isinstance(state.restarts, int):
        raise bad("job_id/restarts")
    for name in ("restarts_by_cause", "node_faults"):
        value = getattr(state, name)
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, int)
                                                  for k, v in value.items()):
            raise bad(name)
    for name in ("last_nodes", "warned", "excluded"):
        value = getattr(state, name)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad(name)
    for name in ("silent_since", "drained_since", "clean_since"):
        value = getattr(state, name)
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                and math.isfinite(v) for k, v in value.items()):
            raise bad(name)
    if not isinstance(state.ckpt_at_recovery, list):
        raise bad("ckpt_at_recovery")
    for epoch in state.epochs:
        if not isinstance(epoch.job_id, str) or not isinstance(epoch.resubmitted_from, (str, type(None))) \
                or isinstance(epoch.since, bool) or not isinstance(epoch.since, (int, float, type(None))):
            raise bad("epochs")
    if state.epochs[-1].job_id != state.job_id:
        raise bad("epochs (the last epoch is not the current job)")
    for name in ("max_step_s", "max_beat_gap_s"):
        value = getattr(state, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise bad(name)
    rec = state.recovery
    if rec is not None and (not isinstance(rec.exclude, list)
                            or not all(isinstance(n, str) for n in rec.exclude)
                            or not isinstance(rec.set_down, list)
                            or not all(isinstance(n, str) for n in rec.set_down)
                            or not isinstance(rec.silent_since, dict)
                            or not all(isinstance(n, str) and isinstance(t, (int, float))
                                       and not isinstance(t, bool) for n, t in rec.silent_since.items())
                            or not isinstance(rec.restart_count, int)):
        raise bad("recovery")


def released_after_giving_up(state: RunState, job: Job) -> bool:
    """A run the watcher gave up on, whose job someone released (``scontrol release``: no longer
    held, pending or running again), is watched afresh: phase, restart counts and crash-loop
    memory reset; the nodes it learned to distrust are kept. True when it reset."""
    if state.phase != GAVE_UP or job.state not in (JobState.PENDING, JobState.RUNNING) \
            or job.reason in HELD_REASONS:
        return False
    log.warning("job %s was released after the watcher gave up on it (%s): watching it afresh",
                job.job_id, state.reason or "no reason saved")
    state.phase, state.reason, state.recovery = WATCHING, "", None
    state.restarts, state.restarts_by_cause, state.ckpt_at_recovery = 0, {}, []
    return True


FOLLOW, SAME, NEW_EPOCH, RESUBMISSION = "follow", "same", "new_epoch", "resubmission"


def take_on(state: RunState, job_id: str, now: float,
            current_job: Callable[[], Job | None]) -> str:
    """Make ``state`` (the run dir's) the state for watching ``job_id``, a job naming that run dir.

    SAME: it is the current job. FOLLOW: it ran here before (an earlier epoch, or the job the
    watcher resubmitted as the current one): the run's current job is watched. RESUBMISSION: a
    resubmission was in flight when a watcher died, and this is the job it made. NEW_EPOCH: a new
    job in the run dir, taken on once the current job has ended (``current_job``: Slurm's view of
    it, None when Slurm has forgotten it; a SlurmError passes through: cannot tell). A current job
    that is still alive is another run of this dir: StateError naming it."""
    if job_id == state.job_id:
        return SAME
    if state.knows(job_id):
        return FOLLOW
    if state.resubmit_started is not None:
        state.resubmitted(job_id, now)
        state.resubmit_started = None
        return RESUBMISSION
    current = current_job()
    if current is not None and not current.state.finished:
        held = " (held)" if current.reason in HELD_REASONS else ""
        raise RunBusy(f"the run dir belongs to job {state.job_id}, which is still "
                         f"{current.state.value}{held}: cancel it (or wait for it to end) before "
                         f"watching job {job_id} in the same run dir")
    state.new_epoch(job_id, now)
    return NEW_EPOCH


def load_state(run_dir: RunDir, job_id: str) -> RunState:
    """The run's saved state, or a fresh one for ``job_id`` when there is none. The saved state
    may be another job's (an earlier epoch's, or a resubmission's): ``adopt_job`` decides."""
    path = run_dir.watch_state
    if not path.exists() and not path.is_symlink():
        return RunState(job_id=job_id)
    data = read_small_json(path)
    if data is None:
        raise StateError(f"{path}: not a readable regular JSON file (remove it to start afresh)")
    return RunState.from_json(data, path)


def save_state(run_dir: RunDir, state: RunState) -> None:
    atomic_write_json(run_dir.watch_state, state.to_json())
