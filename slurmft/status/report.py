"""What a run's journal says about it: segments, faults and what each one cost, ETTR, restarts by
cause, checkpoint loads, and where the run stands now. Pure: ``build_report(events, job, now)``
turns journal events (and, when known, the Slurm job) into a ``Report``; nothing here reads a
file or calls Slurm; ``read_journal`` (re-exported), the bounded reader of ``events.jsonl``,
is :mod:`slurmft.status.journal_reader`.

Definitions (``slurmft status`` shows them; docs/architecture.md repeats them):

- A *segment* is one run of the training process: ``segment_start`` to ``segment_end`` (absent
  when the process was killed), keyed by (job id, restart count, ordinal): a requeue starts one
  (a new restart count), and so does a restart of the world inside the allocation (in-allocation
  mode: same restart count, the next ordinal; ``segkeys.py``). Its loss events are its steps.
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
  the steps between the restored step and the last step reached before the fault. *Where* it was
  recovered: ``requeue`` (through Slurm: a new restart count) or ``allocation`` (the next segment
  is the same job and restart count: the launcher re-formed the world in the allocation; its own
  ``fault_detected`` is the detection, its ``recovery_action`` the action, no requeue).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from slurmft import exitcodes, journal, numbers
from slurmft.allocation import Allocation
from slurmft.journal import Event
from slurmft.slurm.client import Job
from slurmft.status.faults import Fault, Index, Segment, find_fault
from slurmft.status.segkeys import Key, SegmentKeys
from slurmft.status.state import run_state, waiting_from_watcher, watcher_view
from slurmft.status.journal_reader import JournalUnreadable, read_journal
from slurmft.watch.detect import PLANNED as PLANNED_CAUSES

__all__ = ["PLANNED_CAUSES", "Fault", "JournalUnreadable", "Report", "Segment", "build_report", "read_journal",
           "report_dict"]

RECENT_WARNINGS = 5
# A segment's start-up by phase, as the ranks journal it (``restart_phases``), in order.
PHASES = ("import_s", "setup_s", "load_s", "first_step_s", "total_s")


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
    # In-allocation mode: allocation.json as a person reads it (active nodes, spares, fenced), or
    # {"unreadable": why}; None when the run dir has none.
    allocation: dict[str, Any] | None = None

    @property
    def restarts(self) -> int:
        return max(len(self.segments) - 1, 0)

    @property
    def planned_restarts(self) -> int:
        """Restarts after a planned end (time limit, preemption, pre-flight): no fault."""
        return sum(n for cause, n in self.restarts_by_cause.items() if cause in PLANNED_CAUSES)


def _steps(events: Sequence[Event], keys: Sequence[Key | None]
           ) -> tuple[dict[Key, list[tuple[int, float, float, int]]], set[int]]:
    """Per segment key, one row per loss event: (step, time, duration, event index); and the
    indices of loss events that a later run of the same step superseded (redone work)."""
    per_seg: dict[Key, list[tuple[int, float, int]]] = {}
    last_index: dict[int, int] = {}
    for index, event in enumerate(events):
        if event.kind != journal.LOSS:
            continue
        step, key = event.count("step"), keys[index]
        if step is None or key is None:
            continue
        per_seg.setdefault(key, []).append((step, event.time, index))
        last_index[step] = index
    rows_by_seg: dict[Key, list[tuple[int, float, float, int]]] = {}
    for key, rows in per_seg.items():
        gaps = [max(b[1] - a[1], 0.0) for a, b in zip(rows, rows[1:])]
        median = statistics.median(gaps) if gaps else 0.0
        rows_by_seg[key] = [(step, when, median if i == 0 else gaps[i - 1], index)
                            for i, (step, when, index) in enumerate(rows)]
    superseded = {i for rows in per_seg.values() for step, _, i in rows if last_index[step] != i}
    return rows_by_seg, superseded


def _segments(events: Sequence[Event], keys: Sequence[Key | None], steps) -> list[Segment]:
    segments: dict[Key, Segment] = {}
    for event, key in zip(events, keys):
        if key is None:
            continue
        if event.kind == journal.SEGMENT_START and key not in segments:
            segments[key] = Segment(
                job_id=key[0], restart_count=key[1], start=event.time, ordinal=key[2],
                attempt=event.count("attempt"),
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
        elif event.kind == journal.RESTART_PHASES and key in segments and segments[key].restart_phases is None:
            segments[key].restart_phases = {
                "process_start": event.when("process_start"), "tier": event.text("tier", 16) or None,
                **{name: event.seconds(name) for name in PHASES}}
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


def _allocation_view(record: Allocation | Exception | None) -> dict[str, Any] | None:
    if record is None:
        return None
    if isinstance(record, Exception):
        return {"unreadable": str(record)[:300]}
    return {"job_id": record.job_id, "generation": record.generation, "active": list(record.active),
            "spares": list(record.spares), "min_nodes": record.min_nodes,
            "fenced": [{"node": f.node, "cause": f.cause, "time": f.time} for f in record.fenced],
            "spare_jobs": [{"job_id": j.job_id, "node": j.node or None} for j in record.spare_jobs]}


def build_report(events: Sequence[Event], job: Job | None = None, *, now: float,
                 watch_state: Mapping[str, Any] | Exception | None = None,
                 allocation: Allocation | Exception | None = None) -> Report:
    """The run's report from its journal events (file order) and, when known, its Slurm job,
    the watcher's saved state (the JSON of ``watch/state.json``, or why it could not be read) and
    the in-allocation launcher's ``allocation.json`` (or why it could not be read)."""
    keying = SegmentKeys()
    keys = [keying.key(e) for e in events]
    steps, superseded = _steps(events, keys)
    segments = _segments(events, keys, steps)
    others = [e for e in events if e.kind != journal.LOSS]  # a weeks-long run: mostly losses
    by_time = Index(others)
    faults = [f for f in (find_fault(by_time, steps, seg, segments[i + 1] if i + 1 < len(segments) else None)
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
        slurm=_job_dict(job) if job else None, watcher=watcher, first_time=first, now=now,
        allocation=_allocation_view(allocation))


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
