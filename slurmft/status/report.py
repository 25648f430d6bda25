"""What a run's journal says about it: segments, faults and what each one cost, ETTR, restarts by
cause, checkpoint loads, and where the run stands now. Pure: ``build_report(events, job, now)``
turns journal events (and, when known, the Slurm job) into a ``Report``; nothing here reads a
file or calls Slurm; ``read_journal`` (re-exported), the bounded reader of ``events.jsonl``,
is :mod:`slurmft.status.journal_reader`.

Definitions (``slurmft status`` shows them; docs/architecture.md repeats them):

- A *segment* is one run of the training process: ``segment_start`` to ``segment_end`` (absent
  when the process was killed), keyed by (job id, restart count). Its loss events are its steps.
- A step's *duration* is the time since the previous loss event of the same segment; a
  segment's first step (which also pays for start-up and checkpoint load) is given the median
  step duration of its segment.
- A step is *redone* when a later loss event has the same step number (a restart from an older
  checkpoint, or a guard rollback); only its last run is *productive*.
- *ETTR* = productive step time / wall time from the run's submission (journaled by the watcher,
  or Slurm's submit time of the job; else the first segment's start) to the run's end (or now,
  for a run still going).
- A *fault* is every interruption between two segments (and a fault the watcher detected after
  the last segment started). Its times: fault -> detected -> requeued -> running -> back, where
  *back* is the first loss event of the next segment past its restored step; the *work lost* is
  the steps between the restored step and the last step reached before the fault.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from slurmft import exitcodes, journal, numbers
from slurmft.journal import Event
from slurmft.slurm.client import Job
from slurmft.status.state import run_state, segment_key, waiting_from_watcher, watcher_view
from slurmft.status.journal_reader import JournalUnreadable, read_journal
from slurmft.watch.detect import PLANNED as PLANNED_CAUSES

__all__ = ["PLANNED_CAUSES", "Fault", "JournalUnreadable", "Report", "Segment", "build_report", "read_journal",
           "report_dict"]

RECENT_WARNINGS = 5


@dataclass
class Segment:
    job_id: str
    restart_count: int
    start: float
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

    @property
    def downtime_s(self) -> float | None:
        """Fault to training back at the restored step (the time to recover)."""
        if self.back is None or self.fault_time is None:
            return None
        return self.back - self.fault_time


@dataclass
class Report:
    job_id: str | None
    segments: list[Segment]
    faults: list[Fault]
    restarts_by_cause: dict[str, int]
    productive_s: float
    wall_s: float
    ettr: float | None
    steps_done: int | None
    steps_redone: int
    redone_s: float
    checkpoints: int
    last_checkpoint_step: int | None
    last_checkpoint_time: float | None
    mean_checkpoint_blocking_s: float | None
    state: str
    waiting_for: str
    warnings: list[dict[str, Any]]
    slurm: dict[str, Any] | None
    watcher: dict[str, Any] | None   # from <run_dir>/watch/state.json, when there is one
    first_time: float | None
    now: float

    @property
    def restarts(self) -> int:
        return max(len(self.segments) - 1, 0)

    @property
    def planned_restarts(self) -> int:
        """Restarts after a planned end (time limit, preemption, pre-flight): no fault."""
        return sum(n for cause, n in self.restarts_by_cause.items() if cause in PLANNED_CAUSES)


def _steps(events: Sequence[Event]) -> tuple[dict[tuple[str, int], list[tuple[int, float, float, int]]], set[int]]:
    """Per segment key, one row per loss event: (step, time, duration, event index); and the
    indices of loss events that a later run of the same step superseded (redone work)."""
    per_seg: dict[tuple[str, int], list[tuple[int, float, int]]] = {}
    last_index: dict[int, int] = {}
    for index, event in enumerate(events):
        if event.kind != journal.LOSS:
            continue
        step, key = event.count("step"), segment_key(event)
        if step is None or key is None:
            continue
        per_seg.setdefault(key, []).append((step, event.time, index))
        last_index[step] = index
    rows_by_seg: dict[tuple[str, int], list[tuple[int, float, float, int]]] = {}
    for key, rows in per_seg.items():
        gaps = [max(b[1] - a[1], 0.0) for a, b in zip(rows, rows[1:])]
        median = statistics.median(gaps) if gaps else 0.0
        rows_by_seg[key] = [(step, when, median if i == 0 else gaps[i - 1], index)
                            for i, (step, when, index) in enumerate(rows)]
    superseded = {i for rows in per_seg.values() for step, _, i in rows if last_index[step] != i}
    return rows_by_seg, superseded


def _segments(events: Sequence[Event], steps) -> list[Segment]:
    segments: dict[tuple[str, int], Segment] = {}
    for event in events:
        key = segment_key(event)
        if key is None:
            continue
        if event.kind == journal.SEGMENT_START and key not in segments:
            segments[key] = Segment(
                job_id=key[0], restart_count=key[1], start=event.time,
                world_size=numbers.whole(event.get("world_size"), 1),
                num_nodes=numbers.whole(event.get("num_nodes"), 1),
                nodelist=event.text("nodelist"),
                restored_step=event.count("restored_step"),
                load_s=event.seconds("load_s"), load_bytes=event.count("load_bytes"))
        elif event.kind == journal.CHECKPOINT_SKIPPED and key in segments:
            segments[key].checkpoints_skipped.append((event.count("step"), event.text("reason")))
        elif event.kind == journal.RESUME_DIVERGED and key in segments and segments[key].resume_diverged is None:
            segments[key].resume_diverged = {"step": event.count("step"), "cause": event.text("cause"),
                                             "site": event.text("site"), "message": event.text("message", 4000)}
        elif event.kind == journal.SEGMENT_END and key in segments:
            seg = segments[key]
            seg.end, seg.exit_code = event.time, event.integer("exit_code")
            seg.outcome, seg.reason = event.text("outcome"), event.text("reason")
    for key, seg in segments.items():
        rows = steps.get(key, [])
        if rows:
            seg.first_step, seg.steps = rows[0][0], len(rows)
            seg.last_step, seg.last_step_time = rows[-1][0], rows[-1][1]
            gaps = [row[2] for row in rows[1:]]
            seg.median_step_s = statistics.median(gaps) if gaps else None
    return sorted(segments.values(), key=lambda s: s.start)


def _cause_without_watcher(index: "_Index", seg: Segment) -> str:
    """What ended a segment when no watcher journaled a detection: the job's own words."""
    key = (seg.job_id, seg.restart_count)
    if key in index.preempted:
        return "preempted"
    if seg.exit_code == exitcodes.HANG:
        return "hang"
    if seg.exit_code == exitcodes.REQUEUE:
        return "preempted"
    if seg.exit_code is not None and seg.exit_code != exitcodes.OK:
        return "crash"
    if key in index.requested:
        return "requeue_request"
    return "unknown"


class _Index:
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


def _fault(index: _Index, steps, seg: Segment, nxt: Segment | None) -> Fault | None:
    """The fault that ended ``seg``: every segment followed by another, and the last one when it
    ended with a failure or the watcher detected something after it started; None otherwise.
    ``index`` need not hold the loss events (``steps`` has them)."""
    window = index.window(seg.start, nxt.start if nxt else None)
    detections = [e for e in window if e.kind in (journal.FAULT_DETECTED, journal.PLANNED_END)]
    if nxt is None and not detections and (seg.end is None or seg.exit_code == exitcodes.OK):
        return None
    detection = detections[0] if detections else None
    fault_time = detection.when("fault_time") if detection else None
    if fault_time is None:  # no estimate: the segment's end, unless the recovery ended it
        known = [t for t in (seg.end, detection.time if detection else None) if t is not None]
        fault_time = min(known) if known else None
    fault = Fault(
        cause=(detection.text("cause", 200) or "unknown") if detection else _cause_without_watcher(index, seg),
        job_id=seg.job_id, restart_count=seg.restart_count, fault_time=fault_time,
        detected=detection.time if detection else None,
        evidence=detection.text("evidence") if detection else seg.reason,
        nodes=detection.names("nodes") if detection else [])
    after = detection.time if detection else seg.start
    for e in window:
        if e.time < after:
            continue
        if (fault.requeued is None and e.kind in (journal.RECOVERY_ACTION, journal.RESTART_ACTION)
                and e.get("action") in ("requeue", "resubmit") and e.get("ok")):
            fault.requeued = e.time
        elif fault.running is None and e.kind == journal.JOB_RUNNING:
            fault.running = e.when("start_time") or e.time
    if fault.requeued is None:  # the job requeued itself (preemption)
        own = [e for e in window if e.kind == journal.TEMPLATE and e.get("action") == "requeue"
               and segment_key(e) == (seg.job_id, seg.restart_count)]
        fault.requeued = own[0].time if own else None
    # Every loss event of the segment came before the fault that ended it.
    rows = steps.get((seg.job_id, seg.restart_count), [])
    fault.last_step = rows[-1][0] if rows else None
    if nxt is not None:
        fault.restarted = True
        fault.running = fault.running or nxt.start
        fault.restored_step = nxt.restored_step
        restored = nxt.restored_step or 0
        back = [r for r in steps.get((nxt.job_id, nxt.restart_count), []) if r[0] > restored]
        if back:
            fault.back, fault.recovered = back[0][1], True
        if fault.last_step is not None:
            fault.steps_lost = max(fault.last_step - restored, 0)
            fault.lost_s = sum(r[2] for r in rows if r[0] > restored)
    return fault


def _job_dict(job: Job) -> dict[str, Any]:
    return {"job_id": job.job_id, "state": job.state.value, "reason": job.reason,
            "restart_count": job.restart_count, "nodes": list(job.nodes),
            "excluded_nodes": list(job.excluded_nodes), "exit_code": job.exit_code,
            "user": job.user, "partition": job.partition,
            "submit_time": job.submit_time.timestamp() if job.submit_time else None,
            "start_time": job.start_time.timestamp() if job.start_time else None}


def _run_start(events: Sequence[Event], segments: Sequence[Segment], job: Job | None) -> float | None:
    """When the run's wall clock starts for ETTR: its submission, where the watcher journaled it
    or Slurm still knows it (the queue wait before the first start is time lost too), else the
    first segment's start. A submission after that start (a requeue or a resubmission renews
    it) says nothing about the run's beginning."""
    first = segments[0].start if segments else None
    if first is None:
        return None
    submitted = [t for t in (e.when("job_submit_time") for e in events
                             if e.kind == journal.WATCH_STARTED) if t is not None]
    if job is not None and job.submit_time is not None:
        submitted.append(job.submit_time.timestamp())
    return min([first] + [t for t in submitted if 0 < t <= first])


def build_report(events: Sequence[Event], job: Job | None = None, *, now: float,
                 watch_state: Mapping[str, Any] | Exception | None = None) -> Report:
    """The run's report from its journal events (file order) and, when known, its Slurm job and
    the watcher's saved state (the JSON of ``watch/state.json``, or why it could not be read)."""
    steps, superseded = _steps(events)
    segments = _segments(events, steps)
    others = [e for e in events if e.kind != journal.LOSS]  # a weeks-long run: mostly losses
    by_time = _Index(others)
    faults = [f for f in (_fault(by_time, steps, seg, segments[i + 1] if i + 1 < len(segments) else None)
                          for i, seg in enumerate(segments)) if f is not None]
    productive = redone_s = 0.0
    redone = 0
    for rows in steps.values():
        for _, _, duration, index in rows:
            if index in superseded:
                redone, redone_s = redone + 1, redone_s + duration
            else:
                productive += duration
    first = _run_start(events, segments, job)
    finishing = [e.time for e in events if e.kind == journal.RUN_FINISHED]
    last_seg = segments[-1] if segments else None
    if finishing:
        end = finishing[-1]
    elif last_seg is not None and last_seg.exit_code == exitcodes.OK and last_seg.end is not None:
        end = last_seg.end
    else:
        end = now
    wall = max(end - first, 0.0) if first is not None else 0.0
    commits = [e for e in events if e.kind == journal.CHECKPOINT_COMMITTED
               and e.count("step") is not None]
    blocking = [b for b in (e.seconds("blocking_s") for e in commits) if b is not None]
    causes: dict[str, int] = {}
    for f in faults:
        if f.restarted:
            causes[f.cause] = causes.get(f.cause, 0) + 1
    state, waiting = run_state(others, segments, faults, job)
    watcher = watcher_view(watch_state)
    if watcher is not None:
        waiting = waiting_from_watcher(watcher) or waiting
        if watcher["phase"] == "lost" and not state.startswith(("finished", "gave up")):
            state = f"lost: {watcher['reason'] or 'Slurm no longer knows the job'}"
            waiting = "a person: resubmit the job (its run dir resumes from the newest checkpoint)"
    warnings = [{"time": e.time, "what": e.text("what", 100), "detail": e.text("detail"),
                 "nodes": e.names("nodes")}
                for e in events if e.kind == journal.WATCH_WARNING][-RECENT_WARNINGS:]
    return Report(
        job_id=job.job_id if job else (segments[-1].job_id if segments else None),
        segments=segments, faults=faults,
        restarts_by_cause=dict(sorted(causes.items(), key=lambda kv: (-kv[1], kv[0]))),
        productive_s=productive, wall_s=wall, ettr=(productive / wall) if wall > 0 else None,
        steps_done=max((r[0] for rows in steps.values() for r in rows), default=None),
        steps_redone=redone, redone_s=redone_s,
        checkpoints=len(commits),
        last_checkpoint_step=commits[-1].count("step") if commits else None,
        last_checkpoint_time=commits[-1].time if commits else None,
        mean_checkpoint_blocking_s=statistics.fmean(blocking) if blocking else None,
        state=state, waiting_for=waiting, warnings=warnings,
        slurm=_job_dict(job) if job else None, watcher=watcher, first_time=first, now=now)


def report_dict(report: Report) -> dict[str, Any]:
    """The report as one JSON-ready object (what ``slurmft status --json`` prints)."""
    from dataclasses import asdict

    out = asdict(report)
    out["restarts"] = report.restarts
    out["planned_restarts"] = report.planned_restarts
    for seg_out, seg in zip(out["segments"], report.segments):
        seg_out["load_bandwidth_bytes_per_s"] = seg.load_bandwidth
    for fault_out, fault in zip(out["faults"], report.faults):
        fault_out["downtime_s"] = fault.downtime_s
    return out
