"""Backend-independent decisions: how to requeue a job given its state, how to merge exclusions.

Both backends (CLI, pyslurm) act on the same :class:`Job` values, so the rules live here once:
  * ``scontrol requeue`` requeues even a COMPLETED job, and ``requeue Incomplete`` silently does
    nothing on COMPLETED or FAILED ones (measured on 22.05/24.11/26.05) -- so the decision is
    taken from the job's state, never left to Slurm;
  * a job shown as COMPLETING (on 22.05 without its base state) is waited on, briefly, until
    its state says what it is;
  * an ``ExcNodeList`` update replaces the list, so new exclusions are merged with the job's
    current ones before the update.
"""

from __future__ import annotations

import enum
import time
from typing import Callable, Sequence

from slurmft.slurm import validate
from slurmft.slurm.client import Job, JobState, SlurmError, SlurmUnavailable


class RequeueAction(enum.Enum):
    ALREADY_PENDING = "already pending: success, nothing to do"
    REFUSE_COMPLETED = "completed successfully: never requeued"
    WAIT = "completing: decide once Slurm says how it ended"
    INCOMPLETE = "requeue Incomplete (running or suspended)"
    PLAIN = "requeue (ended without success)"
    IMPOSSIBLE = "cannot requeue from this state"
    NOT_REQUEUEABLE = "submitted with --no-requeue"


_PLAIN = frozenset({
    JobState.FAILED, JobState.NODE_FAIL, JobState.TIMEOUT, JobState.CANCELLED, JobState.PREEMPTED,
    JobState.BOOT_FAIL, JobState.DEADLINE, JobState.OUT_OF_MEMORY,
})


def requeue_action(job: Job) -> RequeueAction:
    if job.state is JobState.PENDING:
        return RequeueAction.ALREADY_PENDING
    if job.state is JobState.COMPLETED:
        return RequeueAction.REFUSE_COMPLETED
    if job.state in (JobState.RUNNING, JobState.SUSPENDED) and job.completing:
        return RequeueAction.WAIT
    if job.state in (JobState.RUNNING, JobState.SUSPENDED) or job.state in _PLAIN:
        if not job.requeue_allowed:
            return RequeueAction.NOT_REQUEUEABLE
        return RequeueAction.PLAIN if job.state in _PLAIN else RequeueAction.INCOMPLETE
    return RequeueAction.IMPOSSIBLE


def requeue_by_state(fetch: Callable[[], Job], requeue: Callable[[bool], None], *, wait_s: float,
                     sleep: Callable[[float], None] = time.sleep) -> bool:
    """Requeue the job ``fetch`` returns, deciding from its state; ``requeue(incomplete)`` runs
    Slurm's requeue. True when requeued or already pending, False when it completed successfully.
    A job still COMPLETING after ``wait_s`` raises SlurmUnavailable (try again next cycle)."""
    deadline = time.monotonic() + wait_s
    job = fetch()
    while True:
        action = requeue_action(job)
        if action is RequeueAction.ALREADY_PENDING:
            return True
        if action is RequeueAction.REFUSE_COMPLETED:
            return False
        if action is RequeueAction.IMPOSSIBLE:
            raise SlurmError(f"job {job.job_id}: cannot requeue a job in state {job.state.value}")
        if action is RequeueAction.NOT_REQUEUEABLE:
            raise SlurmError(f"job {job.job_id}: submitted with --no-requeue, Slurm will not requeue it")
        if action is RequeueAction.WAIT:
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"could not decide: job {job.job_id} still COMPLETING after {wait_s:g} s")
            sleep(0.5)
            job = fetch()
            continue
        if action is RequeueAction.PLAIN:
            requeue(False)
            return True
        requeue(True)  # Incomplete: a no-op should the job have finished meanwhile
        job = fetch()
        if not job.state.finished:
            return True
        # It finished before the requeue landed: decide again (FAILED -> plain, COMPLETED -> False).


def merged_exclusions(job: Job, extra: Sequence[str]) -> str:
    """The job's current excluded nodes plus ``extra``, as one sorted hostlist expression."""
    return validate.compress_nodes([*job.excluded_nodes, *extra])
