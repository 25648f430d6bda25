"""The segments and faults of ``slurmft status``'s report (``report.py`` builds them): a segment's
record, a fault's record and how the fault that ended a segment is read from the journal (its
detection, the watcher's or the in-allocation launcher's; its requeue or its action in the
allocation; running again; back past the restored step). Pure."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Sequence

from slurmft import exitcodes, journal, numbers
from slurmft.journal import Event
from slurmft.status.segkeys import Key
from slurmft.status.state import segment_key

# How long after the next world's start the launcher's word on the fault before it may come (a
# restart in place is journaled once the launcher has seen the new world start).
LATE_S = 300.0


def _fault_at(event: Event) -> float:
    return event.when("fault_time") or event.time


@dataclass
class Segment:
    job_id: str
    restart_count: int
    start: float
    ordinal: int = 0                # the segment's place among its (job, restart count)'s
    attempt: int | None = None      # torchrun's restart count, as the ranks journaled it
    end: float | None = None
    exit_code: int | None = None
    outcome: str = ""
    reason: str = ""
    world_size: int | None = None
    num_nodes: int | None = None
    nodelist: str = ""
    restored_step: int | None = None
    load_s: float | None = None
    load_bytes: int | None = None
    first_step: int | None = None
    last_step: int | None = None
    last_step_time: float | None = None
    steps: int = 0
    median_step_s: float | None = None
    # (step, reason) of each checkpoint this segment passed over at its load (damaged)
    checkpoints_skipped: list[tuple[int | None, str]] = field(default_factory=list)
    # the resume check's verdict on this segment: {step, cause, site, message} (the first only)
    resume_diverged: dict[str, Any] | None = None
    # what its start cost, by phase (rank 0's ``restart_phases``, at its first step's end):
    # process_start (unix s), import_s, setup_s, load_s, first_step_s, total_s, tier
    restart_phases: dict[str, Any] | None = None

    @property
    def load_bandwidth(self) -> float | None:
        """Bytes per second of the checkpoint load, when the segment journaled both."""
        if self.load_s and self.load_bytes is not None and self.load_s > 0:
            return numbers.finite(self.load_bytes / self.load_s)
        return None


@dataclass
class Fault:
    cause: str
    job_id: str
    restart_count: int              # of the segment the fault ended (or hit)
    fault_time: float | None = None
    detected: float | None = None
    requeued: float | None = None
    running: float | None = None
    back: float | None = None
    evidence: str = ""
    nodes: list[str] = field(default_factory=list)
    last_step: int | None = None    # the last step reached before the fault
    restored_step: int | None = None
    steps_lost: int | None = None
    lost_s: float | None = None
    restarted: bool = False         # a next segment started after it
    recovered: bool = False         # training got back past its restored step
    ordinal: int = 0                # of the segment the fault ended, among its restart count's
    where: str = journal.WHERE_REQUEUE  # recovered through Slurm, or inside the allocation
    acted: float | None = None      # in the allocation: the launcher's first recovery action

    @property
    def downtime_s(self) -> float | None:
        """Fault to training back at the restored step (the time to recover)."""
        if self.back is None or self.fault_time is None:
            return None
        return self.back - self.fault_time


def key_of(seg: Segment) -> Key:
    return seg.job_id, seg.restart_count, seg.ordinal


def cause_without_watcher(index: "Index", seg: Segment) -> str:
    """What ended a segment when no watcher journaled a detection: the job's own words."""
    key = (seg.job_id, seg.restart_count)
    if key in index.preempted:
        return "preempted"
    if seg.exit_code == exitcodes.HANG:
        return "hang"
    if seg.exit_code == exitcodes.REFORM:  # the launcher re-formed the world, and said no more
        return "reform"
    if seg.exit_code == exitcodes.REQUEUE:
        return "preempted"
    if seg.exit_code is not None and seg.exit_code != exitcodes.OK:
        return "crash"
    if key in index.requested:
        return "requeue_request"
    return "unknown"


class Index:
    """The journal's non-loss events indexed once, so that each segment's look at them costs its
    own events, not the whole journal's (a journal of many short segments, a user's file read as
    root by ``slurmft status``, made the report quadratic in its size)."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.events = events
        self.order = sorted(range(len(events)), key=lambda i: events[i].time)
        self.times = [events[i].time for i in self.order]
        self.preempted = {segment_key(e) for e in events if e.kind == journal.PREEMPTION}
        self.requested = {segment_key(e) for e in events if e.kind == journal.REQUEUE_REQUEST}

    def window(self, lo: float, hi: float | None) -> list[Event]:
        """The events with ``lo <= time < hi`` (``hi`` None: no upper end), in file order."""
        start = bisect.bisect_left(self.times, lo)
        end = len(self.times) if hi is None else bisect.bisect_left(self.times, hi, start)
        return [self.events[i] for i in sorted(self.order[start:end])]


def find_fault(index: Index, steps, seg: Segment, nxt: Segment | None) -> Fault | None:
    """The fault that ended ``seg``: every segment followed by another, and the last one when it
    ended with a failure or the watcher detected something after it started; None otherwise.
    ``index`` need not hold the loss events (``steps`` has them)."""
    window = index.window(seg.start, nxt.start if nxt else None)
    # A launcher's detection whose fault came before this segment started is the fault before's
    # (a rank crash is journaled once the next world has started: nothing explained its start).
    detections = [e for e in window if e.kind in (journal.FAULT_DETECTED, journal.PLANNED_END)
                  and not (journal.in_allocation(e) and _fault_at(e) < seg.start)]
    # The next segment is the same job and restart count: the world was re-formed inside the
    # allocation, and the launcher's own detection says what for (a watcher's, if any, is not it).
    in_allocation = nxt is not None and (nxt.job_id, nxt.restart_count) == (seg.job_id, seg.restart_count)
    late: list[Event] = []
    if in_allocation:
        assert nxt is not None
        late = index.window(nxt.start, nxt.start + LATE_S)
        found = [e for e in window + late if e.kind == journal.FAULT_DETECTED
                 and journal.in_allocation(e) and seg.start <= _fault_at(e) < nxt.start]
        acts = [e for e in window + late if e.kind == journal.RECOVERY_ACTION and journal.in_allocation(e)]
        # A spare's death (its action a fence) re-forms nothing: not what ended the segment.
        found = [e for e in found if next((a.get("action") for a in acts if a.time >= e.time),
                                          None) != journal.ALLOC_FENCE]
        detections = found or detections
    if nxt is None and not detections and (seg.end is None or seg.exit_code == exitcodes.OK):
        return None
    detection = detections[0] if detections else None
    fault_time = detection.when("fault_time") if detection else None
    if fault_time is None:  # no estimate: the segment's end, unless the recovery ended it
        known = [t for t in (seg.end, detection.time if detection else None) if t is not None]
        fault_time = min(known) if known else None
    fault = Fault(
        cause=(detection.text("cause", 200) or "unknown") if detection else cause_without_watcher(index, seg),
        job_id=seg.job_id, restart_count=seg.restart_count, fault_time=fault_time,
        detected=detection.time if detection else None,
        evidence=_evidence(detection) if detection else seg.reason,
        nodes=detection.names("nodes") if detection else [],
        where=journal.WHERE_ALLOCATION if in_allocation else journal.WHERE_REQUEUE,
        ordinal=seg.ordinal)
    after = detection.time if detection else seg.start
    for e in window + late:
        if e.time < after:
            continue
        if (in_allocation and fault.acted is None and e.kind == journal.RECOVERY_ACTION
                and journal.in_allocation(e) and e.get("action") != journal.ALLOC_FENCE):
            fault.acted = e.time
            continue
        if in_allocation:
            continue  # no requeue: running again is the next segment's start
        if (fault.requeued is None and e.kind in (journal.RECOVERY_ACTION, journal.RESTART_ACTION)
                and e.get("action") in ("requeue", "resubmit") and e.get("ok")):
            fault.requeued = e.time
        elif fault.running is None and e.kind == journal.JOB_RUNNING:
            fault.running = e.when("start_time") or e.time
    if fault.requeued is None and not in_allocation:  # the job requeued itself (preemption)
        own = [e for e in window if e.kind == journal.TEMPLATE and e.get("action") == "requeue"
               and segment_key(e) == (seg.job_id, seg.restart_count)]
        fault.requeued = own[0].time if own else None
    # Every loss event of the segment came before the fault that ended it.
    rows = steps.get(key_of(seg), [])
    fault.last_step = rows[-1][0] if rows else None
    if nxt is not None:
        fault.restarted = True
        fault.running = fault.running or nxt.start
        fault.restored_step = nxt.restored_step
        restored = nxt.restored_step or 0
        back = [r for r in steps.get(key_of(nxt), []) if r[0] > restored]
        if back:
            fault.back, fault.recovered = back[0][1], True
        if fault.last_step is not None:
            fault.steps_lost = max(fault.last_step - restored, 0)
            fault.lost_s = sum(r[2] for r in rows if r[0] > restored)
    return fault


def _evidence(event: Event) -> str:
    """A detection's evidence: one line (the watcher's), or the lines the launcher listed."""
    said = event.get("evidence")
    if isinstance(said, list):
        return "; ".join(str(line)[:300] for line in said[:8])
    return event.text("evidence")
