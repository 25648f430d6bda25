"""The detectors' vocabulary: the causes a finding names (planned ends apart from faults), the
actions it calls for, ``Finding``, what the watcher remembers of a run (``Memory``) and what one
cycle observed (``RunObservation``), and a node's problem as Slurm shows it. Pure: nothing here
reads a file, calls Slurm or acts (``detect.py`` re-exports all of it).

A finding says what happened (``cause``), what it calls for (``action``), the evidence in one
line, the nodes the evidence points at, and the best estimate of when the fault happened.
Actions: ``recover`` (requeue, then exclude and start now), ``expedite`` (Slurm or the job
already requeued it: exclude and start now only), ``give_up`` (hold, never requeue), ``finish``
(the run is over: stop watching), ``wait`` (something is under way: do nothing yet), ``warn``,
and in operator mode ``set_down`` (mark a silent node DOWN, then recover).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from slurmft.allocation import Allocation
from slurmft.slurm.client import Job, Node
from slurmft.sweep.config import REASON_PREFIX
from slurmft.watch.runview import Beat, JournalSummary

# Causes (journaled as fault_detected.cause; slurmft status groups restarts by them).
NODE_FAIL = "node_fail"            # Slurm ended or requeued the job for a node failure
NODE_DOWN = "node_down"            # a node of the allocation is DOWN / not responding
NODE_UNHEALTHY = "node_unhealthy"  # drained by slurmft's sweeper (reason "slurmft: ...")
NODE_DRAINED = "node_drained"      # drained by someone else
HANG = "hang"                      # heartbeats stale, or the step watchdog fired (exit 87)
CRASH = "crash"                    # any other failed exit
TIMEOUT = "timeout"                # Slurm ended it at its time limit (no signal to save on)
PREEMPTED = "preempted"            # Slurm preempted it, or the job saved and requeued itself on a
                                   # signal (time limit warning, preemption)
PREFLIGHT = "preflight"            # the launcher's pre-flight requeued it (bad nodes excluded)
BOOT_FAIL = "boot_fail"
OUT_OF_MEMORY = "out_of_memory"
REQUEUED = "requeued"              # requeued by Slurm or an admin, cause unknown
REQUEUE_REQUEST = "requeue_request"  # the launcher asked for a requeue it could not do itself
LAUNCH_FAILED = "launch_failed"    # Slurm requeued it held: its launch failed on a node
FORGOTTEN = "forgotten"            # Slurm no longer knows the job and the run is not DONE
NO_REQUEUE = "no_requeue"          # the job exited "do not requeue" (86)
FINISHED = "finished"
CANCELLED = "cancelled"
STRAGGLER = "straggler"
CHECKPOINT_OVERDUE = "checkpoint_overdue"
NOT_RESPONDING = "not_responding"

RECOVER, EXPEDITE, GIVE_UP, FINISH, WAIT, WARN = "recover", "expedite", "give_up", "finish", "wait", "warn"
SET_DOWN = "set_down"  # operator mode: mark the silent node DOWN, then recover
# Operator mode, in-allocation: a node the launcher fenced that Slurm shows NOT_RESPONDING at two
# polls is set DOWN with the launcher's evidence; the job, recovered in its allocation, is left be.
DOWN_FENCED = "down_fenced"
RESUBMIT = "resubmit"  # Slurm forgot the job: submit it again from what was saved

# Planned ends: the run stopped because the cluster's rules said so (a time limit, a
# preemption, an admin's drain for maintenance, acted on after a checkpoint) or its launcher chose
# to before training (pre-flight). They are restarts, never
# faults: they count toward no restart limit and no crash loop (journaled as ``planned_end``,
# their actions as ``restart_action``). A pre-flight's bad nodes are still counted against them.
PLANNED = frozenset({TIMEOUT, PREEMPTED, PREFLIGHT, NODE_DRAINED})
# Causes that count toward max_restarts, max_restarts_per_cause and the crash-loop rule.
FAULTS = frozenset({NODE_FAIL, NODE_DOWN, NODE_UNHEALTHY, HANG, CRASH, BOOT_FAIL,
                    OUT_OF_MEMORY, REQUEUED, REQUEUE_REQUEST, FORGOTTEN, LAUNCH_FAILED})


def planned(cause: str) -> bool:
    return cause in PLANNED


SWEEPER_PREFIX = REASON_PREFIX  # a drain reason of this prefix is the sweeper's own (sweep/decide.py)


@dataclass(frozen=True)
class Finding:
    cause: str
    action: str
    evidence: str
    nodes: tuple[str, ...] = ()
    fault_time: float | None = None


@dataclass(frozen=True)
class Memory:
    """What the watcher remembers of a run between cycles (from its state and its own memory).

    step_times: the durations of the run's recent steps as its heartbeats carried them (oldest
    first, a bounded window: one long step or clock step ages out of it). beat_gap_s: the expected
    time between two beats of a node outside phases (the newest beats' cadence). beats_seen: the
    run has written a heartbeat; a run that never does gets no hang detection."""

    last_restart_count: int | None = None
    last_nodes: tuple[str, ...] = ()
    step_times: tuple[float, ...] = ()
    node_history: Mapping[str, Sequence[float]] = field(default_factory=dict)
    beat_gap_s: float | None = None
    beats_seen: bool = False
    # When each node was first seen NOT_RESPONDING (operator mode's corroboration), and when
    # each node of the allocation was first seen drained by an admin (maintenance).
    silent_since: Mapping[str, float] = field(default_factory=dict)
    drained_since: Mapping[str, float] = field(default_factory=dict)
    drained_after_step: Mapping[str, int | None] = field(default_factory=dict)
    # When each node of the allocation was first seen DOWN or drained (in-allocation mode: the
    # launcher's grace to fence it before the watcher recovers the job itself).
    down_since: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RunObservation:
    """One cycle's view of one run: the job (None: Slurm has forgotten it), every node, the
    run dir's journal summary, heartbeats and DONE marker, and the time of the observation."""

    job_id: str
    job: Job | None
    nodes: Mapping[str, Node]
    summary: JournalSummary
    beats: Mapping[str, Beat] | None  # None: the heartbeat dir could not be read this cycle
    done: dict | None
    now: float
    # allocation.json (in-allocation mode), when the run dir has one that checks; None otherwise.
    allocation: Allocation | None = None


def _ts(job: Job, attr: str) -> float | None:
    value = getattr(job, attr)
    return value.timestamp() if value is not None else None


def node_problem(node: Node | None) -> tuple[str, str] | None:
    """(cause, evidence) when a node cannot be trusted with the job, else None."""
    if node is None:
        return None
    if node.down:
        return NODE_DOWN, f"{node.name} is DOWN ({node.reason or 'no reason'})"
    if node.drained:
        if node.reason.startswith(SWEEPER_PREFIX):
            return NODE_UNHEALTHY, f"{node.name} drained by the sweeper: {node.reason}"
        return NODE_DRAINED, f"{node.name} drained ({node.reason or 'no reason'})"
    if not node.responding:
        return NOT_RESPONDING, f"{node.name} is not responding"
    return None


def bad_nodes(names: Sequence[str], nodes: Mapping[str, Node]) -> list[tuple[str, str, str]]:
    """(node, cause, evidence) for each node of ``names`` with a problem."""
    found = []
    for name in names:
        problem = node_problem(nodes.get(name))
        if problem is not None:
            found.append((name, *problem))
    return found
