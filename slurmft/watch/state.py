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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from slurmft import numbers, records
from slurmft.health.result import one_line
from slurmft.numbers import UnixTime
from slurmft.rundir import RunDir, atomic_write_json
from slurmft.slurm.client import Job, JobState
from slurmft.slurm.policy import HELD_REASONS
from slurmft.watch.lock import LockError, RunLock  # noqa: F401  (the lock lives in lock.py)
from slurmft.watch.runview import MAX_SMALL_FILE, read_regular

STATE_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: before epochs (the state of one job)
MAX_EPOCHS = 1024  # a run of months is a few hundred jobs; the oldest are dropped past this
# Fields of older watchers, read and dropped (step times are learned from the heartbeats again).
LEGACY_FIELDS = ("max_step_s", "max_beat_gap_s")
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
    fault_time: UnixTime
    detect_time: UnixTime
    restart_count: int          # the job's restart count when the fault was seen
    exclude: list[str] = field(default_factory=list)
    requeue: str = TODO
    exclude_step: str = TODO
    start_now: str = TODO
    release: str = SKIP         # a job Slurm held after a failed launch: released once excluded
    release_attempts: int = 0
    requeued_at: UnixTime | None = None
    pending_since: UnixTime | None = None
    start_now_attempts: int = 0
    start_now_at: UnixTime | None = None
    exclude_attempts: int = 0
    readmit_attempts: int = 0
    warned_pending: bool = False
    set_down: list[str] = field(default_factory=list)  # operator mode: nodes set DOWN mid-recovery
    silent_since: dict[str, UnixTime] = field(default_factory=dict)  # NOT_RESPONDING first seen


@dataclass
class Epoch:
    """One job that ran in the run dir: its id, when the watcher first took it on (its own clock),
    and, for a job the watcher submitted in place of a forgotten one, that job's id."""

    job_id: str
    since: UnixTime | None = None
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
    # Per cause, fault restarts with no checkpoint newer than at the fault restart before
    # (``giveup.py``): what max_restarts and max_restarts_per_cause count.
    stalled_by_cause: dict[str, int] = field(default_factory=dict)
    launch_lookups: int = 0  # cycles waited for accounting to name a failed launch's node
    last_restart_count: int | None = None
    last_nodes: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)  # nodes this watcher excluded, oldest first
    recovery: Recovery | None = None
    warned: list[str] = field(default_factory=list)
    reason: str = ""
    resubmit_started: UnixTime | None = None  # intent: a resubmission may be in flight since then
    announced: bool = False  # a watch_started event was journaled for this run
    # Per node, when first seen so: NOT_RESPONDING (operator mode's corroboration), drained by
    # an admin (maintenance, waited on until a checkpoint commits), serving the job with no fault
    # since (its faults fade, one per node_fault_fade_s).
    silent_since: dict[str, UnixTime] = field(default_factory=dict)
    drained_since: dict[str, UnixTime] = field(default_factory=dict)
    # ... and the newest committed step the journal named then (None: none): a checkpoint counts
    # as "after the drain" by its place in the journal, never by the compute node's clock.
    drained_after_step: dict[str, int | None] = field(default_factory=dict)
    clean_since: dict[str, UnixTime] = field(default_factory=dict)
    # In-allocation mode: per node of the running allocation, when first seen DOWN or drained
    # (the launcher's grace to fence it: ``allocation_grace_s``).
    down_since: dict[str, UnixTime] = field(default_factory=dict)
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
            for legacy in LEGACY_FIELDS:
                raw.pop(legacy, None)
            recovery = raw.pop("recovery", None)
            epochs = raw.pop("epochs", None)
            state = cls(**raw)
            if recovery is not None and not isinstance(recovery, dict):
                raise TypeError(f"recovery must be an object, got {type(recovery).__name__}")
            state.recovery = Recovery(**recovery) if recovery is not None else None
            if data["version"] >= 2:
                if not isinstance(epochs, list) or not epochs or len(epochs) > MAX_EPOCHS \
                        or not all(isinstance(e, dict) for e in epochs):
                    raise StateError(f"{where}: field epochs has the wrong type (remove the file "
                                     "to start afresh)")
                state.epochs = [Epoch(**e) for e in epochs]
        except TypeError as exc:
            # one line: the message may quote a key of the file (``'\r'``)
            raise StateError(f"{where}: unreadable watch state ({one_line(str(exc))}; remove the "
                             "file to start afresh)") from None
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
    """The state file is in the user's run dir: the whole record is checked, every field against
    its annotation (``slurmft.records``: times within unix time, durations within
    ``numbers.MAX_SECONDS``, counts whole and >= 0), before anything acts on it; a field that does
    not check is a StateError naming it, never a reset."""
    try:
        records.check(state, str(where))
    except records.RecordError as exc:
        raise StateError(f"{exc} (remove the file to start afresh)") from None
    if state.phase not in PHASES:
        raise StateError(f"{where}: unknown phase {state.phase!r}")
    if state.epochs[-1].job_id != state.job_id:
        raise StateError(f"{where}: field epochs has the wrong type (the last epoch is not the "
                         "current job; remove the file to start afresh)")
    rec = state.recovery
    steps = (rec.requeue, rec.exclude_step, rec.start_now, rec.release) if rec is not None else ()
    if any(step not in (TODO, DOING, DONE, SKIP) for step in steps):
        raise StateError(f"{where}: field recovery has an unknown step state (one of "
                         f"{TODO}, {DOING}, {DONE}, {SKIP}); remove the file to start afresh")


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
    state.stalled_by_cause = {}
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


def read_saved(run_dir: RunDir) -> Any:
    """The JSON of the run's saved state (unchecked), None when there is none; StateError when
    the file is not a regular file of at most MAX_SMALL_FILE bytes holding JSON (``NaN`` and
    ``Infinity`` are not JSON)."""
    path = run_dir.watch_state
    if not path.exists() and not path.is_symlink():
        return None
    raw = read_regular(path, MAX_SMALL_FILE)
    if raw is None:
        raise StateError(f"{path}: not a readable regular file of at most {MAX_SMALL_FILE} bytes "
                         "(remove it to start afresh)")
    try:
        return numbers.loads(raw)
    except ValueError as exc:
        raise StateError(f"{path}: not valid JSON ({' '.join(str(exc).split())[:120]}; remove it "
                         "to start afresh)") from None


def load_state(run_dir: RunDir, job_id: str) -> RunState:
    """The run's saved state, checked whole, or a fresh one for ``job_id`` when there is none. The
    saved state may be another job's (an earlier epoch's, or a resubmission's): ``adopt_job``
    decides."""
    data = read_saved(run_dir)
    if data is None:
        return RunState(job_id=job_id)
    return RunState.from_json(data, run_dir.watch_state)


def save_state(run_dir: RunDir, state: RunState) -> None:
    atomic_write_json(run_dir.watch_state, state.to_json())
