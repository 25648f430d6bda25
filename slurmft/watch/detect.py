"""Detectors: pure functions of (what one cycle observed about a run, what the watcher remembers
of it, config) returning findings. Nothing here reads a file, calls Slurm or acts.

This module: how a job's end (or requeue) is read (``detect_end``: Slurm's state, the exit code,
the segment's own journal for a self-requeue) and ``detect``, every finding of a cycle in the
order to act on. The vocabulary (causes, actions, ``Finding``, ``Memory``, ``RunObservation``)
is ``findings.py``; node trouble ``detect_nodes.py``; hangs, stragglers and overdue checkpoints
``detect_hang.py``. Every name of those is re-exported here (``detect.HANG``, ``detect.detect_hang``).
"""

from __future__ import annotations

from dataclasses import replace

from slurmft import exitcodes
from slurmft.slurm.client import JobState
from slurmft.slurm.policy import held_after_failed_launch
from slurmft.watch.config import WatchConfig
from slurmft.watch.detect_alloc import allocation_view
from slurmft.watch.detect_hang import (
    detect_checkpoint_overdue, detect_hang, detect_straggler, hang_timeout, typical_step_s,
)
from slurmft.watch.detect_nodes import (
    admin_drain, admin_drain_bound, detect_nodes, detect_silent_node, silent_nodes,
    silent_nodes_of_ending_job,
)
from slurmft.watch.findings import (
    NODE_FAIL, NODE_DOWN, NODE_UNHEALTHY, NODE_DRAINED, HANG, CRASH, TIMEOUT, PREEMPTED,
    PREFLIGHT, BOOT_FAIL, OUT_OF_MEMORY, REQUEUED, REQUEUE_REQUEST, LAUNCH_FAILED, FORGOTTEN,
    NO_REQUEUE, FINISHED, CANCELLED, STRAGGLER, CHECKPOINT_OVERDUE, NOT_RESPONDING, RECOVER,
    EXPEDITE, GIVE_UP, FINISH, WAIT, WARN, SET_DOWN, DOWN_FENCED, RESUBMIT, PLANNED, FAULTS,
    planned, SWEEPER_PREFIX, Finding, Memory, RunObservation, _ts, node_problem, bad_nodes,
)
from slurmft.watch.runview import JournalSummary, done_for

# The names other modules and the tests use as detect.<name>.
__all__ = [
    "NODE_FAIL", "NODE_DOWN", "NODE_UNHEALTHY", "NODE_DRAINED", "HANG", "CRASH", "TIMEOUT",
    "PREEMPTED", "PREFLIGHT", "BOOT_FAIL", "OUT_OF_MEMORY", "REQUEUED", "REQUEUE_REQUEST",
    "LAUNCH_FAILED", "FORGOTTEN", "NO_REQUEUE", "FINISHED", "CANCELLED", "STRAGGLER",
    "CHECKPOINT_OVERDUE", "NOT_RESPONDING", "RECOVER", "EXPEDITE", "GIVE_UP", "FINISH", "WAIT",
    "WARN", "SET_DOWN", "DOWN_FENCED", "RESUBMIT", "PLANNED", "FAULTS", "planned", "SWEEPER_PREFIX", "Finding",
    "Memory", "RunObservation", "node_problem", "bad_nodes", "detect_checkpoint_overdue",
    "detect_hang", "detect_straggler", "hang_timeout", "typical_step_s", "admin_drain",
    "admin_drain_bound", "detect_nodes", "detect_silent_node", "silent_nodes",
    "silent_nodes_of_ending_job", "detect_end", "self_requeue_cause", "detect",
]

_SLURM_END_CAUSES = {
    JobState.NODE_FAIL: NODE_FAIL,
    JobState.TIMEOUT: TIMEOUT,
    JobState.PREEMPTED: PREEMPTED,
    JobState.BOOT_FAIL: BOOT_FAIL,
    JobState.OUT_OF_MEMORY: OUT_OF_MEMORY,
    JobState.DEADLINE: TIMEOUT,
}


def detect_end(obs: RunObservation, memory: Memory) -> Finding | None:
    """The job ended (or was requeued) since the last cycle: what that calls for."""
    job = obs.job
    if job is None:
        if done_for(obs.done, obs.job_id):
            return Finding(FINISHED, FINISH, "the run dir says DONE; Slurm no longer lists the job")
        return Finding(FORGOTTEN, RESUBMIT, "Slurm no longer knows the job (past MinJobAge) and "
                       "the run is not DONE")
    restart = job.restart_count
    summary = obs.summary
    if job.state is JobState.COMPLETED or done_for(obs.done, job.ids) and job.state.finished:
        return Finding(FINISHED, FINISH, f"job {job.state.value}, exit {job.exit_code}"
                       + (", run dir DONE" if obs.done is not None else ""))
    if job.state is JobState.CANCELLED:
        return Finding(CANCELLED, FINISH, "cancelled (by its owner or an admin): left cancelled")
    if job.state.finished:
        end = _ts(job, "end_time") or obs.now
        if summary.no_requeue(job.ids, restart) or (
                job.exit_code == exitcodes.NO_REQUEUE and not job.exit_signal):
            # The ranks' segment_end 86, or the launcher's own (a give_up it journaled: bad
            # input before training, an in-allocation crash loop): the job's last word.
            said = summary.find(summary.gave_up, job.ids, restart)
            if said is None:
                ended = summary.find(summary.segment_ends, job.ids, restart)
                said = ended.get("reason") if ended is not None else "no reason journaled"
            return Finding(NO_REQUEUE, GIVE_UP, f"the job exited {exitcodes.NO_REQUEUE} (do not "
                           f"requeue): {said}", fault_time=end)
        outcome = summary.outcome(job.ids, restart)
        request = summary.find(summary.requeue_requests, job.ids, restart)
        if request is not None or outcome == exitcodes.REQUEUE:
            exclude = request.get("exclude") if request is not None else None
            nodes = tuple(n for n in exclude if isinstance(n, str)) if isinstance(exclude, list) else ()
            cause, why = self_requeue_cause(summary, job.ids, restart, request)
            if cause != REQUEUE_REQUEST:  # planned: the launcher only lacked scontrol to requeue
                why = f"{why} (it could not requeue itself)"
            return Finding(cause, RECOVER, f"the job asked to be requeued: {why}", nodes, end)
        if job.state in _SLURM_END_CAUSES:
            cause = _SLURM_END_CAUSES[job.state]
            allocation = job.nodes or memory.last_nodes
            evidence_nodes = tuple(n for n, _, _ in bad_nodes(allocation, obs.nodes))
            return Finding(cause, RECOVER, f"Slurm ended the job {job.state.value}"
                           + (f" ({job.reason})" if job.reason and job.reason != "None" else ""),
                           evidence_nodes if cause in (NODE_FAIL, BOOT_FAIL) else (), end)
        code = outcome if outcome is not None else job.exit_code
        if code == exitcodes.HANG:
            # No node is blamed: the first rank to time out exits 87 and srun kills the others,
            # usually before their own watchdogs fire, so which nodes journaled a watchdog
            # ``hang`` says nothing about where the culprit ran.
            return Finding(HANG, RECOVER, f"the step watchdog fired (exit {exitcodes.HANG})",
                           (), end)
        signal = f", signal {job.exit_signal}" if job.exit_signal else ""
        return Finding(CRASH, RECOVER, f"the job {job.state.value} with exit {code}{signal}",
                       (), end)
    # Pending or running.
    if held_after_failed_launch(job):
        # Slurm's own hold, never a user's or an admin's: the recovery finds the node from
        # accounting's record of the failed run, excludes it and releases the job.
        return Finding(LAUNCH_FAILED, EXPEDITE, f"Slurm requeued the job held: its launch failed "
                       f"({job.reason_detail.strip()})", ())
    previous = memory.last_restart_count
    requeued = job.state is JobState.PENDING and (
        (previous is not None and restart > previous) or (previous is None and restart > 0))
    if requeued:
        prev = restart - 1
        allocation = memory.last_nodes
        troubled = bad_nodes(allocation, obs.nodes)
        ended = _previous_end(obs, job.ids, prev)
        if summary.self_requeued(job.ids, prev) or summary.outcome(job.ids, prev) == exitcodes.REQUEUE:
            request = summary.find(summary.requeue_requests, job.ids, prev)
            exclude = request.get("exclude") if request is not None else None
            nodes = tuple(n for n in exclude if isinstance(n, str)) if isinstance(exclude, list) else ()
            cause, why = self_requeue_cause(summary, job.ids, prev)
            return Finding(cause, EXPEDITE, f"the job requeued itself: {why}", nodes, ended)
        if troubled:
            return Finding(NODE_FAIL, EXPEDITE, "Slurm requeued the job: "
                           + "; ".join(e for _, _, e in troubled), tuple(n for n, _, _ in troubled),
                           ended)
        return Finding(REQUEUED, EXPEDITE, f"the job was requeued (restart {restart}) by Slurm or "
                       "an admin", (), ended)
    return None


def self_requeue_cause(summary: JournalSummary, ids, restart: int,
                       request=None) -> tuple[str, str]:
    """Why segment (job, ``restart``) requeued itself (or asked, in ``request``, to be requeued),
    from its own journal: a signal (the time limit's warning or a preemption: it saved first) and
    a pre-flight are planned; anything else the launcher could not get past (a rendezvous port...)
    is a fault."""
    said = request.get("reason") if request is not None else summary.find(summary.self_requeues, ids, restart)
    reason = str(said or "")
    if reason.endswith(")") and " (" in reason:  # "<reason> (no scontrol in the job)"
        reason = reason[:reason.rindex(" (")]
    if summary.find(summary.preemptions, ids, restart) is not None or reason.endswith(
            "before training started") or reason == "training saved and asked to be requeued":
        return PREEMPTED, reason or "it saved on a signal (time limit or preemption)"
    if reason.startswith("pre-flight"):  # it excluded the nodes it blamed: the cluster's end
        return PREFLIGHT, reason
    if reason.startswith("the pre-flight"):
        # No verdict on any node, or every node failing (launch/main.py): nothing was excluded,
        # so the next try meets the same. A fault, so the restart limits and the crash loop
        # bound it (planned, it went round the queue for ever and was never held).
        return REQUEUE_REQUEST, reason
    return REQUEUE_REQUEST, reason or f"exit {exitcodes.REQUEUE}"


def _previous_end(obs: RunObservation, ids, restart: int) -> float | None:
    """When the segment (job, ``restart``) stopped: its recorded end, else its newest heartbeat
    (a node death ends a segment without a word)."""
    end = obs.summary.find(obs.summary.segment_ends, ids, restart)
    if end is not None:
        return end.time
    beats = [b.time for b in (obs.beats or {}).values() if b.job_id in ids and b.restart_count == restart]
    return max(beats) if beats else None


def detect(obs: RunObservation, memory: Memory, config: WatchConfig) -> list[Finding]:
    """Every finding for one run this cycle, the one to act on first. A running job whose run
    dir says DONE for it is finishing (final upload, teardown): no node or hang finding."""
    end = detect_end(obs, memory)
    finishing = obs.job is not None and done_for(obs.done, obs.job.ids)
    found = [f for f in (end, *(() if finishing else (
        detect_nodes(obs, memory, config), detect_silent_node(obs, memory, config),
        detect_hang(obs, memory, config))))
             if f is not None]
    view = allocation_view(obs)
    if view is not None and view.fenced:  # a fenced node's busy times are an old world's
        memory = replace(memory, node_history={n: h for n, h in memory.node_history.items()
                                               if n not in view.fenced})
    for warning in (detect_straggler(memory, config), detect_checkpoint_overdue(obs, config)):
        if warning is not None:
            found.append(warning)
    return found
