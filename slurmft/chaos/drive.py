"""One chaos run: wait until the run has something to lose, inject a fault, and read from the run's
journal what happened next: when the watcher detected it and as what, when the job ran again, when
training was back and from which step. Every wait is bounded and names what it waited for.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

from slurmft import journal
from slurmft.chaos import faults
from slurmft.chaos.faults import ALLOCATION, Fault, FaultError, Target, active_nodes
from slurmft.journal import Event
from slurmft.slurm.client import SlurmError
from slurmft.slurm.devcluster import DevClusterError
from slurmft.status.report import JournalUnreadable, read_journal

POLL_S = 0.5
# Slurm alone takes 150-180 s to restart a job after a node death (DESIGN.md), and never
# restarts a hung or crashed one: recovered later than this, something is wrong.
RUNNING_AGAIN_S = 90
T = TypeVar("T")
# The launcher's recovery actions (in the allocation) that take their node out of the job for good.
FENCING = ("fence", "replace_node", "shrink")


class ChaosError(RuntimeError):
    """The run did not do what the chaos run waited for (the message names what, and how long)."""


@dataclass
class Outcome:
    """What one injected fault cost; times are seconds after the injection."""
    fault: str
    detail: str
    injected: float
    detected_as: str | None
    detect_s: float | None
    running_s: float | None
    back_s: float | None
    last_step: int | None       # the last step trained before the fault
    resumed_step: int | None    # the checkpoint the next segment restored
    world_size: int | None
    nodes: list[str]
    expected: bool              # the watcher named one of the fault's causes
    evidence: str = ""          # the watcher's, for its first detection
    committed_before: list[int] = field(default_factory=list)  # checkpoints at the injection
    victim: str | None = None   # the node a node fault hit
    excluded: list[str] = field(default_factory=list)  # nodes its recovery excluded (excluded_for)
    corrupted: int | None = None  # the checkpoint a corruption hit
    where: str = "requeue"      # how it recovered: "allocation" (in the allocation) or "requeue"

    @property
    def lost_steps(self) -> int | None:
        if self.last_step is None:
            return None
        return self.last_step - (self.resumed_step or 0)


def outcome_problems(o: Outcome) -> list[str]:
    """What this outcome shows that slurmft should not have done (empty: nothing)."""
    found = []
    if not o.expected:
        found.append(f"detected as {o.detected_as}")
    newest = max(o.committed_before, default=None)
    if o.fault == faults.CORRUPT_NEWEST.name:
        older = [s for s in o.committed_before if o.corrupted is not None and s < o.corrupted]
        if o.resumed_step != (max(older) if older else None):
            found.append(f"resumed from {o.resumed_step}, not from the checkpoint before the "
                         f"corrupted {o.corrupted}")
    elif newest is not None and (o.resumed_step is None or o.resumed_step < newest):
        found.append(f"resumed from {o.resumed_step}, older than the newest intact {newest}")
    if o.fault == faults.TIME_LIMIT.name and o.lost_steps:
        found.append(f"{o.lost_steps} steps lost although the signal let it save")
    if o.victim is not None and o.victim in o.nodes:
        found.append(f"running again on {o.victim}, the node the fault hit")
    if o.victim is not None and o.victim not in o.excluded:
        found.append(f"{o.victim}, the node the fault hit, was not excluded")
    if o.running_s is None or o.running_s > RUNNING_AGAIN_S:
        found.append(f"running again after {o.running_s} s (more than {RUNNING_AGAIN_S} s)")
    if o.fault == faults.UNHEALTHY_NODE.name and "slurmft: external_site" not in o.evidence:
        found.append(f"evidence does not name the sweeper's check: {o.evidence!r}")
    return found


def excluded_for(events: list[Event], slurm_excluded: Callable[[], Sequence[str]]) -> list[str]:
    """The nodes a recovery took out of the job: the watcher's exclusions, the launcher's fences
    in the allocation, and the nodes the launcher's own requeue (no spare left) excluded (its
    template ``requeue`` event) where Slurm's ExcNodeList (``slurm_excluded()``, asked only
    then) shows that the exclusion took effect."""
    out: list[str] = []
    slurm: Sequence[str] | None = None
    for e in events:
        if e.kind in (journal.RECOVERY_ACTION, journal.RESTART_ACTION) and (
                (e.get("action") == "exclude" and e.get("ok"))
                or (e.get("action") in FENCING and e.get("where") == ALLOCATION)):
            out += e.names("nodes")
        elif e.kind == journal.TEMPLATE and e.get("action") == "requeue":
            said = [n for n in (e.get("exclude") or "").split(",") if n] \
                if isinstance(e.get("exclude"), str) else []
            if said and slurm is None:
                slurm = slurm_excluded()
            out += [n for n in said if n in (slurm or ())]
    return list(dict.fromkeys(out))


def _segment(event: Event) -> tuple[int, int]:
    """A segment's key: (restart count, attempt). In-allocation restarts keep the restart count
    and bump torchrun's attempt; a requeue bumps the restart count (attempts start again at 0)."""
    return (event.count("restart_count") or 0, event.count("attempt") or 0)


class ChaosRun:
    """One training job under injected faults, observed through its run dir's journal."""

    def __init__(self, target: Target, *, alive: Callable[[], str | None]) -> None:
        """``alive()`` returns why the run cannot go on (its job ended...), or None."""
        self.target = target
        self.alive = alive

    def events(self) -> list[Event]:
        try:
            return read_journal(self.target.run_dir.events)
        except JournalUnreadable:
            return []

    def wait(self, found: Callable[[list[Event]], T | None], timeout: float, what: str) -> T:
        deadline = time.monotonic() + timeout
        while True:
            result = found(self.events())
            if result is not None and result is not False:
                return result
            problem = self.alive()
            if problem:
                raise ChaosError(f"while waiting for {what}: {problem}")
            if time.monotonic() > deadline:
                raise ChaosError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(POLL_S)

    def current_segment(self, events: list[Event]) -> Event | None:
        starts = [e for e in events if e.kind == journal.SEGMENT_START]
        return starts[-1] if starts else None

    def wait_progress(self, timeout: float) -> int:
        """Until the current segment committed a checkpoint past the step it restored and trained
        a step past that checkpoint; returns that checkpoint's step."""
        def ready(events: list[Event]) -> int | None:
            seg = self.current_segment(events)
            if seg is None:
                return None
            restored = seg.get("restored_step") or 0
            mine = [e for e in events[events.index(seg):] if _segment(e) == _segment(seg)]
            saved = [e.get("step") for e in mine if e.kind == journal.CHECKPOINT_COMMITTED
                     and e.get("step", 0) > restored]
            if not saved:
                return None
            trained = [e.get("step") for e in mine if e.kind == journal.LOSS]
            return max(saved) if trained and max(trained) > max(saved) else None
        return self.wait(ready, timeout, "a new checkpoint and a step after it")

    def inject(self, fault: Fault, timeout: float) -> Outcome:
        """Inject ``fault`` and wait until training is back (a loss of a later segment)."""
        before = self.events()
        seg = self.current_segment(before)
        segment = _segment(seg) if seg is not None else (0, 0)
        losses = [e.get("step") for e in before if e.kind == journal.LOSS and _segment(e) == segment]
        committed = self.target.run_dir.committed_steps()
        self.target.victim = self.target.corrupted = None
        injected = time.time()
        detail = fault.inject(self.target)

        def back(events: list[Event]) -> tuple[Event, Event] | None:
            # A later key, or a start journaled after the injection: a new segment whose ranks
            # journaled the key of the one before (measured: an in-allocation restart whose
            # ranks all started at torchrun attempt 0) is a new segment all the same.
            starts = [e for e in events if e.kind == journal.SEGMENT_START
                      and (_segment(e) > segment or (e.time or 0.0) > injected)]
            if not starts:
                return None
            first = [e for e in events if e.kind == journal.LOSS
                     and _segment(e) == _segment(starts[0]) and (e.time or 0.0) >= (starts[0].time or 0.0)]
            return (starts[0], first[0]) if first else None

        start, first_loss = self.wait(back, timeout, f"training back after the {fault.name}")
        events = self.events()
        # Losses journaled after the injection but before the ranks died count as trained.
        losses += [e.get("step") for e in events[len(before):]
                   if e.kind == journal.LOSS and _segment(e) == segment
                   and (e.time or 0.0) < (start.time or 0.0)]
        # A time limit is a planned end (journaled apart from faults), detected all the same.
        detected = [e for e in events[len(before):]
                    if e.kind in (journal.FAULT_DETECTED, journal.PLANNED_END)]
        running = [e for e in events[len(before):] if e.kind == journal.JOB_RUNNING]
        in_allocation = _segment(start)[0] == segment[0]  # the same restart count: never requeued
        excluded = excluded_for(events[len(before):], self._slurm_excluded)
        # In the allocation, "running again" is the next segment's start (no JOB_RUNNING: the
        # job never stopped), on the nodes allocation.json names active.
        running_s = (running[0].time - injected if running
                     else start.time - injected if in_allocation else None)
        nodes = (list(running[0].get("nodes") or []) if running
                 else active_nodes(self.target.run_dir) if in_allocation else [])
        cause = detected[0].get("cause") if detected else None
        return Outcome(
            fault=fault.name, detail=detail, injected=injected, detected_as=cause,
            detect_s=detected[0].time - injected if detected else None,
            running_s=running_s,
            back_s=first_loss.time - injected,
            last_step=max(losses) if losses else None,
            resumed_step=start.get("restored_step"), world_size=start.get("world_size"),
            nodes=nodes, where=ALLOCATION if in_allocation else "requeue",
            expected=cause in fault.causes,
            evidence=str(detected[0].get("evidence") or "") if detected else "",
            committed_before=committed, victim=self.target.victim, excluded=excluded,
            corrupted=self.target.corrupted)

    def _slurm_excluded(self) -> tuple[str, ...]:
        """The job's ExcNodeList as Slurm has it now (empty when Slurm cannot say)."""
        try:
            return self.target.client.job(self.target.job_id).excluded_nodes
        except SlurmError:
            return ()

    def repair(self) -> list[str]:
        """Run and forget the repairs the faults left (a node restarted, a drain resumed)."""
        problems = []
        while self.target.repairs:
            try:
                self.target.repairs.pop(0)()
            except (FaultError, DevClusterError, OSError, subprocess.SubprocessError) as exc:
                problems.append(str(exc))  # a repair that failed leaves the cluster smaller
        return problems
