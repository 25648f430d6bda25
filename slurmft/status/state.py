"""Where a run stands now and what it (or its watcher) is waiting for, for ``slurmft status``:
from the last journal events, the Slurm job when known, and the watcher's saved state
(``watch/state.json``, the run owner's file: read defensively). Pure."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from slurmft import exitcodes, journal
from slurmft.journal import Event
from slurmft.slurm.client import Job


def segment_key(event: Event) -> tuple[str, int] | None:
    """(job id, restart count) of an event that names both: the segment it belongs to."""
    job, restart = event.get("job_id"), event.count("restart_count")
    if isinstance(job, bool) or not isinstance(job, (str, int)) or restart is None:
        return None
    return str(job), restart


def run_state(events: Sequence[Event], segments: Sequence[Any], faults: Sequence[Any],
           job: Job | None) -> tuple[str, str]:
    """(where the run stands, what the watcher or the run is waiting for)."""
    detections, actions = (journal.FAULT_DETECTED, journal.PLANNED_END), (journal.RECOVERY_ACTION,
                                                                             journal.RESTART_ACTION)
    # A node set DOWN is no step of a recovery of its own: in operator mode one comes with the
    # fault it belongs to, and a fenced node's (in-allocation mode) comes while training runs on.
    watcher = [e for e in events if e.kind in (
        *detections, *actions, journal.JOB_RUNNING, journal.GAVE_UP,
        journal.RUN_FINISHED, journal.JOB_RESUBMITTED)
        and not (e.kind == journal.RECOVERY_ACTION and e.get("action") == "set_down")]
    last = watcher[-1] if watcher else None
    slurm = ""
    if job is not None:
        slurm = f"; Slurm: {job.state.value}"
        if job.reason and job.reason != "None":
            slurm += f" ({job.reason})"
    seg = segments[-1] if segments else None
    # A watcher event older than the newest segment's start is history: training runs again.
    # ``current``: the last watcher event when it is not history, else None.
    current = last if last is not None and (seg is None or seg.start < last.time) else None
    if current is not None and journal.in_allocation(current) and seg is not None and (
            (seg.last_step_time is not None and seg.last_step_time > current.time)
            or _launcher_fault_before(watcher, current, seg.start)):
        current = None  # the launcher's word on a restart that happened: training runs again
    over = "nothing: the run is over"
    if last is not None and last.kind == journal.RUN_FINISHED:
        how = last.text("state", 100) or last.text("how", 100)
        code = last.integer("exit_code")
        return f"finished ({how}{'' if code is None else f', exit {code}'}){slurm}", over
    if last is not None and last.kind == journal.GAVE_UP:
        held = " and held the job" if last.get("held") else ""
        return (f"gave up{held}: {last.text('reason')}{slurm}",
                "a person: fix the cause, `scontrol release` the job, and watch it again")
    if seg is not None and seg.exit_code == exitcodes.OK and seg.end is not None:
        return f"finished at step {seg.last_step}{slurm}", over
    if current is not None and current.kind == journal.JOB_RESUBMITTED:
        new_id = current.text("new_job_id", 64)
        return (f"resubmitted as job {new_id} (Slurm had forgotten job {current.text('old_job_id', 64)}){slurm}",
                f"Slurm to start job {new_id}; it resumes from the newest checkpoint")
    if current is not None and journal.in_allocation(current):
        # The in-allocation launcher's own recovery: no requeue, the job stays RUNNING.
        cause = current.text("cause", 200) or next(
            (e.text("cause", 200) for e in reversed(watcher)
             if e.kind == journal.FAULT_DETECTED and journal.in_allocation(e)), "") or "a fault"
        spare = current.text("spare", 200) if current.kind != journal.FAULT_DETECTED else ""
        world = current.count("world_nodes")
        how = f"spare {spare}" if spare else (f"{world} nodes" if world else "the nodes it has")
        return (f"recovering in its allocation from {cause}{slurm}",
                f"the launcher's new world ({how}) to start training from the newest checkpoint")
    if current is not None and current.kind in (*detections, *actions):
        detected_at = max(e.time for e in watcher if e.kind in detections) \
            if any(e.kind in detections for e in watcher) else 0.0
        done = {e.text("action", 64) for e in watcher
                if e.kind in actions and e.get("ok") and e.time >= detected_at}
        cause = faults[-1].cause if faults else current.text("cause", 200)
        if "start_now" in done:
            wait = "Slurm to start the job (its start time is set to now)"
        elif "requeue" in done or (current.kind in detections and current.get("action") == "expedite"):
            wait = "the job to be PENDING, then the bad nodes excluded and a start now"
        else:
            wait = "the requeue (the watcher retries it each cycle)"
        if current.kind in (journal.PLANNED_END, journal.RESTART_ACTION):
            return f"restarting after a planned end ({cause}){slurm}", wait
        return f"recovering from {cause}{slurm}", wait
    if faults and faults[-1].restarted and not faults[-1].recovered:
        f = faults[-1]
        return (f"restarted after {f.cause}{slurm}",
                f"training to get past its restored step {f.restored_step}")
    if job is not None and job.state.value == "PENDING":
        return f"pending{slurm}", "Slurm to schedule the job"
    if seg is not None and seg.end is None:
        return f"training at step {seg.last_step}{slurm}", "the next fault (if a watcher runs)"
    if seg is not None:
        own = any(e.kind == journal.TEMPLATE and e.get("action") == "requeue"
                  and segment_key(e) == (seg.job_id, seg.restart_count) for e in events)
        if own:
            return (f"requeued by the job itself ({seg.outcome}){slurm}",
                    "Slurm to start it again (~120 s unless `slurmft watch` starts it now)")
        return (f"segment ended: {seg.outcome or 'no end recorded'}{slurm}",
                "the watcher to act on it (is `slurmft watch` running?)")
    return f"not started{slurm}", "the job to start training"


def _launcher_fault_before(events: Sequence[Event], current: Event, start: float) -> bool:
    """Whether the launcher's fault that ``current`` (its newest event) belongs to happened before
    the newest segment started (a restart in place is journaled once the new world started)."""
    fault = next((e for e in reversed(events) if e.kind == journal.FAULT_DETECTED
                  and journal.in_allocation(e) and e.time <= current.time), None)
    return fault is not None and (fault.when("fault_time") or fault.time) < start


def watcher_view(saved: Mapping[str, Any] | Exception | None) -> dict[str, Any] | None:
    """The parts of the watcher's saved state (``watch/state.json``; an exception: why it could
    not be read) a person needs. The file is the run owner's: it is checked whole, by the
    watcher's own reader, before any of it is shown; one that does not check is shown as phase
    ``unreadable`` with the field that failed."""
    from pathlib import Path

    from slurmft.watch.state import RunState, StateError

    if saved is None:
        return None
    try:
        if isinstance(saved, Exception):
            raise StateError(str(saved))
        state = RunState.from_json(saved, Path("watch/state.json"))
    except StateError as exc:
        return {"phase": "unreadable", "restarts": None, "reason": str(exc)[:300]}
    view: dict[str, Any] = {"phase": state.phase, "restarts": state.restarts, "reason": state.reason}
    rec = state.recovery
    if rec is not None:
        view["recovery"] = {"cause": rec.cause, "requeue": rec.requeue, "exclude_step": rec.exclude_step,
                            "start_now": rec.start_now, "start_now_attempts": rec.start_now_attempts,
                            "exclude": list(rec.exclude[:64])}
    return view


def waiting_from_watcher(view: Mapping[str, Any]) -> str | None:
    """What a recovering watcher does next, from the steps its state records as done."""
    rec = view.get("recovery")
    if view.get("phase") != "recovering" or not isinstance(rec, Mapping):
        return None
    if rec.get("requeue") in ("todo", "doing"):
        return "the requeue (the watcher retries it each cycle)"
    if rec.get("exclude_step") in ("todo", "doing"):
        nodes = ",".join(rec.get("exclude") or [])
        return f"the job to be PENDING, then excluding {nodes} and a start now"
    if rec.get("start_now") != "done":
        tries = rec.get("start_now_attempts") or 0
        return "the job to be PENDING, then a start now" + (f" ({tries} refused so far)" if tries else "")
    return "Slurm to start the job (its start time is set to now)"
