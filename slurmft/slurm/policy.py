"""Backend-independent decisions: how to requeue a job given its state, how to merge exclusions.

Both backends (CLI, pyslurm) act on the same :class:`Job` values, so the rules live here once:
  * ``scontrol requeue`` requeues even a COMPLETED job, and ``requeue Incomplete`` silently does
    nothing on COMPLETED or FAILED ones (measured on 22.05/24.11/26.05) -- so the decision is
    taken from the job's state, never left to Slurm;
  * a job shown as COMPLETING (on 22.05 without its base state) is waited on, briefly, until
    its state says what it is;
  * an ``ExcNodeList`` update replaces the list, so new exclusions are merged with the job's
    current ones before the update;
  * a change that got no answer (``OutcomeUnknown``) is never simply sent again: the state is
    re-read and the change is repeated only if it did not happen (a requeue is known to have
    happened when the job's restart count went up or it is PENDING);
  * a cancel is final: a plain ``scontrol requeue`` or ``requeuehold`` brings back a CANCELLED
    job, also one still COMPLETING after ``scancel`` (rc 0, PENDING, restart count up), while
    their ``Incomplete`` forms, ``release``, ``hold`` and ``update`` leave it cancelled
    ("Job has already finished") (measured on 22.05.8). So a job read as CANCELLED (with or
    without COMPLETING) raises ``JobCancelled``; the plain verb goes only to a job read as ended
    for another reason (a job that ended cannot be cancelled after), and a running one gets the
    ``Incomplete`` verb, which a cancel landing first turns into a no-op.
"""

from __future__ import annotations

import enum
import time
from datetime import datetime, timedelta, timezone
from typing import Callable, Mapping, Sequence

from slurmft.slurm import validate
from slurmft.slurm.parse_steps import FailedRun
from slurmft.slurm.client import (
    Job, JobCancelled, JobNotFound, JobState, Node, OutcomeUnknown, SlurmError, SlurmUnavailable,
)


class RequeueAction(enum.Enum):
    ALREADY_PENDING = "already pending: success, nothing to do"
    REFUSE_COMPLETED = "completed successfully: never requeued"
    WAIT = "completing: decide once Slurm says how it ended"
    INCOMPLETE = "requeue Incomplete (running or suspended)"
    PLAIN = "requeue (ended without success)"
    IMPOSSIBLE = "cannot requeue from this state"
    NOT_REQUEUEABLE = "submitted with --no-requeue"
    CANCELLED = "cancelled: final"


_PLAIN = frozenset({
    JobState.FAILED, JobState.NODE_FAIL, JobState.TIMEOUT, JobState.PREEMPTED,
    JobState.BOOT_FAIL, JobState.DEADLINE, JobState.OUT_OF_MEMORY,
})


def requeue_action(job: Job) -> RequeueAction:
    if job.state is JobState.CANCELLED:  # with or without COMPLETING: a cancel is final
        return RequeueAction.CANCELLED
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


# How many times a change is sent when each attempt ends without an answer and the re-read
# shows it did not happen.
CHANGE_ATTEMPTS = 2


def change_confirmed(change: Callable[[], object], happened: Callable[[], bool], *,
                     attempts: int = CHANGE_ATTEMPTS) -> None:
    """Make a state change that may get no answer: after ``OutcomeUnknown`` re-read the state;
    done when ``happened()``, else send it again (``attempts`` in all). Raises the last
    OutcomeUnknown when it never did, or when the re-read itself fails."""
    unknown: OutcomeUnknown | None = None
    for _ in range(attempts):
        try:
            change()
            return
        except OutcomeUnknown as exc:
            unknown = exc
        except SlurmError:
            # Refused, e.g. "Invalid node state": the earlier send, still queued in the
            # controller when the state was re-read, may have landed since.
            if unknown is None or not _quietly(happened):
                raise
            return
        try:
            if happened():
                return
        except SlurmError as exc:
            raise OutcomeUnknown(f"{unknown}; re-reading the state to check failed too: {exc}") from None
    assert unknown is not None
    raise unknown


def _quietly(happened: Callable[[], bool]) -> bool:
    try:
        return happened()
    except SlurmError:
        return False


def requeue_by_state(fetch: Callable[[], Job], requeue: Callable[[bool], None], *, wait_s: float,
                     sleep: Callable[[float], None] = time.sleep,
                     attempts: int = CHANGE_ATTEMPTS,
                     decided: Callable[[Job], None] = lambda job: None) -> bool:
    """Requeue the job ``fetch`` returns, deciding from its state; ``requeue(incomplete)`` runs
    Slurm's requeue (``decided(job)`` runs between the read and each send: the tests' point to
    cancel the job there). True when requeued or already pending, False when it completed
    successfully; a cancelled job raises JobCancelled, whenever the cancel came.
    A job still COMPLETING after ``wait_s`` raises SlurmUnavailable (try again next cycle). A
    requeue that got no answer counts as done once the re-read job shows a higher restart count
    (or PENDING); otherwise it is decided again from the state, ``attempts`` requeues in all."""
    deadline = time.monotonic() + wait_s
    job = fetch()
    before = job.restart_count
    unknown: OutcomeUnknown | None = None
    sent = 0

    def send(incomplete: bool) -> str:
        """"sent", "unknown" (no answer) or "done" (refused, but an earlier send landed)."""
        nonlocal unknown, sent, deadline
        sent += 1
        deadline = time.monotonic() + wait_s  # a job it ends is COMPLETING for a while
        decided(job)
        try:
            requeue(incomplete)
            return "sent"
        except OutcomeUnknown as exc:
            unknown = exc
            return "unknown"
        except SlurmError:
            # e.g. "Job is pending execution": the send that got no answer was still queued in
            # the controller when the job was re-read, and has landed since.
            if sent > 1 and _quietly(lambda: fetch().restart_count > before):
                return "done"
            raise

    def refetch() -> Job:
        try:
            return fetch()
        except SlurmError as exc:
            if unknown is None:
                raise
            raise OutcomeUnknown(f"{unknown}; re-reading the job to check failed too: {exc}") from None

    while True:
        action = requeue_action(job)
        if unknown is not None and job.restart_count > before:
            return True  # the requeue that got no answer did happen
        if unknown is not None and action is not RequeueAction.WAIT:
            if action is RequeueAction.ALREADY_PENDING:
                return True
            if sent >= attempts:
                raise unknown
            unknown = None
        if action is RequeueAction.CANCELLED:
            raise JobCancelled(f"job {job.job_id} was cancelled: a cancel is final, not requeued")
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
                if unknown is not None:
                    raise OutcomeUnknown(f"{unknown}; and job {job.job_id} is still COMPLETING "
                                         f"after {wait_s:g} s") from None
                raise SlurmUnavailable(f"could not decide: job {job.job_id} still COMPLETING after {wait_s:g} s")
            sleep(0.5)
            job = refetch()
            continue
        if action is RequeueAction.PLAIN:
            if send(False) != "unknown":
                return True
            job = refetch()
            continue
        landed = send(True)  # Incomplete: a no-op should the job have finished meanwhile
        if landed == "done":
            return True
        job = refetch()
        if landed == "sent" and not job.state.finished:
            return True
        # It finished before the requeue landed (decide again: FAILED -> plain, COMPLETED ->
        # False), or it got no answer (decided at the top of the loop).


# How the re-read state shows that a change that got no answer happened.
HELD_REASONS = frozenset({"JobHeldAdmin", "JobHeldUser"})

# What Slurm says of a job it requeued held because its batch launch failed on a node (slurmd
# could not start it): reason JobHeldUser, state_description this (22.05.8, measured; see
# tests/fixtures/slurm/2205/README.md). A user's or an admin's hold reads JobHeldUser or
# JobHeldAdmin with no such description (an admin's hold clears it).
LAUNCH_FAILED_HELD = "launch failed requeued held"


def held_after_failed_launch(job: Job) -> bool:
    """Whether Slurm itself holds ``job`` after a failed launch (never a user's or admin's hold)."""
    return (job.state is JobState.PENDING and job.reason in HELD_REASONS
            and job.reason_detail.strip().lower().startswith(LAUNCH_FAILED_HELD))


# The drain reasons Slurm itself sets on a node whose prolog (or the job's environment set-up)
# failed: slurmctld's node_mgr.c, "Prolog error" measured on 22.05.8 for a failed Prolog with and
# without PrologFlags=Alloc (tests/fixtures/slurm/2205/sinfo_prolog_error_drain.json).
PROLOG_DRAIN_REASONS = ("prolog error", "job env setup error")


def prolog_failed(node: Node) -> bool:
    """Whether Slurm drained ``node`` because a job's prolog (or environment set-up) failed."""
    return node.drained and node.reason.strip().lower().startswith(PROLOG_DRAIN_REASONS)


def launch_failure_nodes(run: FailedRun, nodes: Mapping[str, Node]) -> tuple[tuple[str, ...], str]:
    """The nodes a held job's failed run failed on, and the evidence: the run's nodes Slurm
    drained for a failed prolog (on any node of the allocation, the batch host or not: with
    PrologFlags=Alloc, or at a step's first launch on another node, the batch step ran on a
    healthy batch host, measured), else its batch host (a batch launch that failed). Slurm
    drains the node before it requeues the job, so both show by the time the job reads held."""
    prolog = tuple(n for n in run.nodes if n in nodes and prolog_failed(nodes[n]))
    if prolog:
        return prolog, f"Slurm drained it: {nodes[prolog[0]].reason.strip()}"
    if run.batch_host is not None:
        return (run.batch_host,), "the batch step's node in accounting's record of the failed run"
    return (), ""


def release_launch_hold(fetch: Callable[[], Job], release: Callable[[], None]) -> None:
    """Release the job ``fetch`` returns only if Slurm itself still holds it after a failed launch
    (re-read just before: a cancel or an admin's hold since the watcher's last look wins)."""
    job = fetch()
    if job.state is JobState.CANCELLED:
        raise JobCancelled(f"job {job.job_id} was cancelled: a cancel is final, not released")
    if not held_after_failed_launch(job):
        raise SlurmError(f"job {job.job_id} is not held by Slurm after a failed launch "
                         f"(state {job.state.value}, reason {job.reason or 'none'}): not released")
    release()


def gone_or_ending(jobs: Callable[[Sequence[str]], Mapping[str, Job]], job_id: str) -> bool:
    """A cancel happened: the controller forgot the job, or shows it finished or completing."""
    try:
        job = jobs([job_id]).get(job_id)
    except JobNotFound:
        return True
    return job is None or job.state.finished or job.completing


def pending_update_done(job: Job, exclude: Sequence[str], start_now: bool,
                        readmit: Sequence[str] = ()) -> bool:
    """An ExcNodeList and/or StartTime=now update shows in the re-read job."""
    excluded = set(job.excluded_nodes) >= set(exclude) and not set(job.excluded_nodes) & set(readmit)
    if not start_now or job.state is not JobState.PENDING:
        return excluded
    soon = datetime.now(timezone.utc) + timedelta(seconds=2)
    return excluded and job.eligible_time is not None and job.eligible_time <= soon


def excludable_now(job: Job) -> bool:
    """Whether Slurm takes a new ExcNodeList for ``job`` now: PENDING, or requeued while its batch
    script still ends (22.05 prints that job RUNNING+COMPLETING, and takes the update: measured).
    A job that is really ending (FAILED, CANCELLED... + COMPLETING) is refused here, before Slurm."""
    return job.state is JobState.PENDING or (job.state is JobState.RUNNING and job.completing)


def merged_exclusions(job: Job, extra: Sequence[str], readmit: Sequence[str] = ()) -> str:
    """The job's current excluded nodes plus ``extra`` less ``readmit``, as one sorted hostlist
    expression ('' when none is left: the update then clears the list)."""
    gone = set(readmit)
    return validate.compress_nodes([n for n in [*job.excluded_nodes, *extra] if n not in gone])
