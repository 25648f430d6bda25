"""Hang detection and the run's pace: the learned hang timeout (a robust statistic of the
steps the heartbeats carried), each node's deadline (its newest beat + a phase's bound, the
start-up grace or its cadence, + the timeout), the hang finding, stragglers (a node's forward
time against the others') and an overdue checkpoint. Pure functions, as in ``detect.py``.
"""

from __future__ import annotations

import statistics

from slurmft.slurm.client import JobState
from slurmft.watch.config import WatchConfig
from slurmft.watch.detect_alloc import allocation_view
from slurmft.watch.findings import (
    CHECKPOINT_OVERDUE, HANG, NODE_DOWN, RECOVER, STRAGGLER, WARN, Finding, Memory, RunObservation,
    _ts,
)
from slurmft.watch.runview import Beat


def typical_step_s(memory: Memory) -> float | None:
    """The run's usual step time: the median of its recent steps (None before the first beat that
    carries one). A median, not a maximum: an evaluation or a clock step inside one step must not
    make every later timeout hours long."""
    return statistics.median(memory.step_times) if memory.step_times else None


def hang_timeout(memory: Memory, config: WatchConfig, gap_s: float | None = None) -> float:
    """How long past a node's newest beat (outside a phase) its next one may be late: explicit
    (``hang_timeout_s``, taken as is), else the gap between two beats (``gap_s``, default the
    newest beats' cadence) plus hang_factor x the typical step, at least hang_min_s, plus
    ``clock_skew_s``: beat times come from the compute nodes' clocks."""
    if config.hang_timeout_s > 0:
        return config.hang_timeout_s
    typical = typical_step_s(memory) or 0.0
    gap = memory.beat_gap_s if gap_s is None else gap_s
    return max(config.hang_min_s, (gap or 0.0) + config.hang_factor * typical) + config.clock_skew_s


def _beat_deadline(beat: Beat, memory: Memory, config: WatchConfig, starting: bool) -> float:
    """When a node whose newest beat is ``beat`` counts as silent: its announced phase's bound,
    else the start-up grace (no step finished yet this segment), else its cadence, each plus the
    hang timeout."""
    if beat.phase_bound_s is not None:
        return beat.time + beat.phase_bound_s + hang_timeout(memory, config, 0.0)
    if starting:
        return beat.time + config.startup_grace_s + hang_timeout(memory, config, 0.0)
    return beat.time + hang_timeout(memory, config, beat.gap_s(typical_step_s(memory) or 0.0))


def detect_hang(obs: RunObservation, memory: Memory, config: WatchConfig) -> Finding | None:
    """A RUNNING job none of whose nodes has beaten within its deadline: a node's newest beat
    plus the hang timeout, or plus the bound of the phase it announced (a checkpoint save or
    load, an evaluation), or, before the segment's first step, plus the start-up grace.

    No finding (could not observe) when the heartbeats cannot be read, or a file of the job's
    nodes is there but unreadable; none for a run that has never written a heartbeat (it has no
    hang detection: ``slurmft watch`` says so)."""
    job = obs.job
    if job is None or job.state is not JobState.RUNNING or job.completing or obs.beats is None:
        return None  # None: the heartbeats could not be read, which says nothing about the job
    if set(getattr(obs.beats, "unreadable", ())) & set(job.nodes):
        return None
    if not obs.beats and not memory.beats_seen:
        return None
    started = _ts(job, "start_time")
    # In-allocation mode: a restart inside the allocation starts the world again (judged from
    # then on, as a segment's start is: the beats before it are the old world's), and a node
    # the launcher fenced is no longer the run's.
    view = allocation_view(obs)
    fenced = view.fenced if view is not None else frozenset()
    restarted = view.restarted_at if view is not None else None
    if restarted is not None and (started is None or restarted > started):
        started = restarted
    beats = [b for b in obs.beats.values() if b.node in job.nodes and b.node not in fenced
             and b.job_id in job.ids and b.restart_count == job.restart_count
             and (restarted is None or b.time >= restarted)]
    starting = not any(b.step_s is not None for b in beats)  # no step finished this segment yet
    deadlines = [_beat_deadline(b, memory, config, starting) for b in beats]
    if starting and started is not None:  # loading, or stuck before its first step
        deadlines.append(started + config.startup_grace_s + hang_timeout(memory, config, 0.0))
    if not deadlines:
        return None
    deadline = max(deadlines)
    # In-allocation mode a hang in training is the job's own first: the ranks' step watchdog
    # ends the hung step and torchrun restarts the world in place (its launcher journals it).
    # The watcher recovers only what they did not within allocation_grace_s (a restart that
    # never trains is judged from its start, above).
    in_job = config.allocation_grace_s if view is not None and not starting else 0.0
    deadline += in_job
    if obs.now <= deadline:
        return None
    timeout = hang_timeout(memory, config)
    newest = max(b.time for b in beats) if beats else None
    fault_time = newest if newest is not None else (started or obs.now) + config.startup_grace_s
    silent = tuple(n for n in job.nodes if (node := obs.nodes.get(n)) is not None
                   and not node.responding and n not in fenced)
    if silent:  # the heartbeats stopped because a node did
        return Finding(NODE_DOWN, RECOVER, f"no heartbeat in time ({obs.now - deadline:.0f} s past "
                       f"the deadline, hang timeout {timeout:.0f} s) and {','.join(silent)} not "
                       "responding", silent, fault_time)
    where = "; cannot attribute it to a node (no per-node evidence)"
    phased = [b for b in beats if b.phase is not None]
    if newest is None:
        assert started is not None
        what = (f"no heartbeat {obs.now - started:.0f} s after the segment started (start-up grace "
                f"{config.startup_grace_s:.0f} s + hang timeout {timeout:.0f} s)")
    elif phased:
        longest = max(phased, key=lambda b: b.time + (b.phase_bound_s or 0.0))
        what = (f"{longest.node}'s phase \"{longest.phase}\" announced {obs.now - longest.time:.0f} s "
                f"ago ran past its bound {longest.phase_bound_s:.0f} s + hang timeout {timeout:.0f} s")
    elif starting:
        what = (f"no step finished {obs.now - newest:.0f} s after the segment's newest heartbeat "
                f"(start-up grace {config.startup_grace_s:.0f} s + hang timeout {timeout:.0f} s)")
    else:
        what = f"newest heartbeat is {obs.now - newest:.0f} s old > hang timeout {timeout:.0f} s"
    if in_job:
        what += (f", and the job's own step watchdog and launcher did not restart it within "
                 f"allocation_grace_s {in_job:.0f} s")
    return Finding(HANG, RECOVER, what + where, (), fault_time)


def detect_straggler(memory: Memory, config: WatchConfig) -> Finding | None:
    """One node k x slower than the median of the others for ``straggler_window`` beats in a row.
    ``memory.node_history`` holds each node's recent per-node busy times (oldest first)."""
    history = {n: list(h)[-config.straggler_window:] for n, h in memory.node_history.items()}
    if len(history) < 2 or any(len(h) < config.straggler_window for h in history.values()):
        return None
    slow = []
    for name, times in history.items():
        others = [statistics.median(h[i] for m, h in history.items() if m != name)
                  for i in range(config.straggler_window)]
        if all(t > config.straggler_factor * o and o > 0 for t, o in zip(times, others)):
            slow.append((name, statistics.median(times), statistics.median(others)))
    if len(slow) != 1:
        return None
    name, mine, theirs = slow[0]
    return Finding(STRAGGLER, WARN, f"{name} busy {mine:.3f} s per step vs median {theirs:.3f} s "
                   f"for {config.straggler_window} heartbeats", (name,))


def detect_checkpoint_overdue(obs: RunObservation, config: WatchConfig) -> Finding | None:
    """No checkpoint committed for overdue_factor x the run's usual interval (RUNNING only)."""
    job = obs.job
    commits = list(obs.summary.commits)
    if job is None or job.state is not JobState.RUNNING or len(commits) < 2:
        return None
    gaps = [b[0] - a[0] for a, b in zip(commits, commits[1:]) if b[0] > a[0]]
    if not gaps:
        return None
    usual = statistics.median(gaps)
    started = _ts(job, "start_time") or commits[-1][0]
    since = obs.now - max(commits[-1][0], started)
    if since <= max(config.checkpoint_overdue_factor * usual, config.checkpoint_overdue_min_s):
        return None
    return Finding(CHECKPOINT_OVERDUE, WARN, f"no checkpoint committed for {since:.0f} s (usual "
                   f"interval {usual:.0f} s; newest step {commits[-1][1]})")

