"""The Slurm client contract: normalised Job/Node values, typed errors, the SlurmClient protocol.

Everything on the cluster side that needs Slurm goes through a ``SlurmClient``; backends
(``slurmft.slurm.cli`` over squeue/scontrol/sacct, ``slurmft.slurm.pyslurm`` over pyslurm) turn
whatever their Slurm release emits into these frozen dataclasses, so callers never see a
data_parser version.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Mapping, Protocol, Sequence, runtime_checkable


class JobState(str, enum.Enum):
    """A job's base state (Slurm's ``JOB_STATE_BASE``); modifiers live in ``Job.flags``."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    # Accounting only (sacct -D): this run ended because the job went back to the queue.
    REQUEUED = "REQUEUED"

    @property
    def finished(self) -> bool:
        return self not in (JobState.PENDING, JobState.RUNNING, JobState.SUSPENDED)


class NodeState(str, enum.Enum):
    """A node's base state; DRAIN, NOT_RESPONDING, COMPLETING... live in ``Node.flags``."""

    IDLE = "IDLE"
    ALLOCATED = "ALLOCATED"
    MIXED = "MIXED"
    DOWN = "DOWN"
    ERROR = "ERROR"
    FUTURE = "FUTURE"
    UNKNOWN = "UNKNOWN"


@dataclass(frozen=True)
class Job:
    """One job as the controller (or accounting) reports it, normalised across releases."""

    job_id: str
    name: str
    state: JobState
    flags: frozenset[str] = frozenset()
    reason: str = ""
    nodes: tuple[str, ...] = ()
    node_count: int = 0
    min_nodes: int = 0
    max_nodes: int = 0
    excluded_nodes: tuple[str, ...] = ()
    restart_count: int = 0
    exit_code: int | None = None
    exit_signal: int | None = None
    submit_time: datetime | None = None
    eligible_time: datetime | None = None
    start_time: datetime | None = None
    end_time: datetime | None = None
    partition: str = ""
    user: str = ""
    work_dir: Path | None = None
    run_dir: Path | None = None
    requeue_allowed: bool = True
    # Slurm's own number for this job; differs from job_id (``<array id>_<task>``) for an array
    # task, whose processes see it as $SLURM_JOB_ID. Empty where a backend does not say.
    raw_job_id: str = ""
    # When the time limit ends this run: Slurm's start + limit, for a RUNNING job with a finite
    # limit only (end_time stays None until the job has finished). None where unknown.
    time_limit_end: datetime | None = None
    # Slurm's words for the reason where it has more than ``reason`` (squeue's state_description):
    # a job Slurm held after a failed launch reads reason JobHeldUser, detail "launch failed
    # requeued held" (22.05, measured). Empty where a backend does not say.
    reason_detail: str = ""
    # The node the batch script runs on (squeue's batch_host); empty where a backend does not
    # say or the job has not started. Its death ends the job whatever ``--no-kill`` says.
    batch_host: str = ""

    @property
    def ids(self) -> frozenset[str]:
        """Every id under which the job's own processes may name it (journal, heartbeats)."""
        return frozenset(i for i in (self.job_id, self.raw_job_id) if i)

    @property
    def completing(self) -> bool:
        return "COMPLETING" in self.flags

    @property
    def partitions(self) -> frozenset[str]:
        """The partitions the job may run in (a pending job may name several, comma-separated)."""
        return frozenset(p for p in self.partition.split(",") if p)


@dataclass(frozen=True)
class Node:
    """One node: base state plus flags (DRAIN, NOT_RESPONDING, ...) and the reason set on it."""

    name: str
    state: NodeState
    flags: frozenset[str] = frozenset()
    reason: str = ""
    reason_user: str = ""
    # The partitions the node is in; empty where a backend does not say.
    partitions: frozenset[str] = frozenset()

    @property
    def drained(self) -> bool:
        """DRAIN flag set: either DRAINING (jobs still on it) or DRAINED."""
        return "DRAIN" in self.flags

    @property
    def down(self) -> bool:
        return self.state is NodeState.DOWN

    @property
    def responding(self) -> bool:
        return "NOT_RESPONDING" not in self.flags


@dataclass(frozen=True)
class SlurmInfo:
    """What the backend learned about the running Slurm (release, chosen data_parser)."""

    version: tuple[int, int, int]
    data_parser: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)


class SlurmError(RuntimeError):
    """Base of every error a Slurm call raises; the message is Slurm's own where it gave one."""


class SlurmUnavailable(SlurmError):
    """The controller could not be reached (or timed out) after the retries: "could not observe"."""


class OutcomeUnknown(SlurmUnavailable):
    """A call that changes Slurm's state got no answer (timed out, "Socket timed out"): it may or
    may not have taken effect. Never retried blindly: the state is re-read to decide."""


class JobNotFound(SlurmError):
    """Slurm says the job id does not exist (anymore)."""


class JobCancelled(SlurmError):
    """The job was cancelled (or a cancel is under way): final, never requeued or released."""


class PermissionDenied(SlurmError):
    """Slurm refused the operation for this user."""


class InvalidArgument(SlurmError, ValueError):
    """A job id, node name or reason is not of Slurm's form; nothing was run."""


class UnsupportedShape(SlurmError):
    """Slurm's JSON has a shape this client does not know; the message names the field."""


@runtime_checkable
class SlurmClient(Protocol):
    """What the watcher, the sweeper and the CLI may ask of Slurm."""

    def info(self) -> SlurmInfo:
        """The running Slurm's release and the JSON data_parser in use."""

    def jobs(self, job_ids: Sequence[str]) -> dict[str, Job]:
        """All of ``job_ids`` in ONE controller query; ids Slurm no longer knows are absent."""

    def user_jobs(self, user: str) -> dict[str, Job]:
        """Every job of ``user`` the controller still holds, in ONE query."""

    def job(self, job_id: str) -> Job:
        """One job; raises JobNotFound."""

    def job_history(self, job_id: str) -> list[Job]:
        """Accounting records (sacct -D) of every run of the job, oldest first."""

    def failed_launch_nodes(self, job: Job) -> tuple[tuple[str, ...], str]:
        """The nodes on which the job's newest run failed to launch or failed its prolog, and
        the evidence (``policy.launch_failure_nodes``); ``((), "")`` while accounting has no
        record of that run."""

    def release_launch_hold(self, job_id: str) -> None:
        """``scontrol release`` a job Slurm held after a failed launch, re-read first: a job held
        by its user or an admin, or cancelled, is refused (JobCancelled / SlurmError)."""

    def nodes(self, names: Sequence[str] | None = None) -> dict[str, Node]:
        """Nodes by name (all nodes when ``names`` is None)."""

    def submit(self, script: Path, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
               sbatch_options: Sequence[str] = ()) -> str:
        """``sbatch --parsable [options] script [args]``; returns the job id."""

    def resubmit(self, argv: Sequence[str], *, cwd: Path, env: Mapping[str, str] | None = None) -> str:
        """``sbatch --parsable --chdir=<cwd> <argv>`` with a job's own recorded sbatch arguments
        (options, script, script arguments); returns the new job id."""

    def submit_line(self, job_id: str) -> str | None:
        """The sbatch command line accounting recorded for the job (SubmitLine), if any."""

    def batch_script(self, job_id: str) -> str:
        """The job's batch script as the controller holds it (while it still knows the job)."""

    def cancel(self, job_id: str, *, signal: str | None = None, batch_only: bool = False) -> None:
        """scancel, or send ``signal`` (to the batch step only when ``batch_only``)."""

    def requeue(self, job_id: str) -> bool:
        """Requeue a job that has not completed successfully. True when requeued (or already
        pending), False when Slurm declined because it finished successfully."""

    def update_pending(self, job_id: str, *, exclude_nodes: Sequence[str] = (),
                       readmit_nodes: Sequence[str] = (), start_now: bool = False) -> None:
        """Merge ``exclude_nodes`` into the job's ExcNodeList, take ``readmit_nodes`` out of it,
        and/or set StartTime=now."""

    def release_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        """Take ``nodes`` out of the running job's allocation (its owner may): Slurm then ends
        or requeues the job without waiting on them."""

    def requeue_hold(self, job_id: str) -> bool:
        """``scontrol requeuehold``: a job that ended without success goes back into the queue held
        (visible in squeue; ``scontrol release`` starts it again), decided from its state like
        ``requeue``. False when it completed successfully."""

    def hold(self, job_id: str) -> None: ...

    def release(self, job_id: str) -> None: ...

    def drain(self, node: str, reason: str) -> None:
        """Drain ``node`` with ``reason`` (cut to what Slurm accepts)."""

    def resume(self, node: str) -> None:
        """Return a drained node to service."""

    def set_down(self, node: str, reason: str) -> None:
        """Mark ``node`` DOWN with ``reason`` (operator rights): Slurm then ends or requeues its
        jobs at once instead of waiting for SlurmdTimeout."""
