"""Detectors: pure functions of (what one cycle observed about a run, what the watcher remembers
of it, config) returning findings. Nothing here reads a file, calls Slurm or acts.

A finding says what happened (``cause``), what it calls for (``action``), the evidence in one
line, the nodes the evidence points at, and the best estimate of when the fault happened.
Actions: ``recover`` (requeue, then exclude and start now), ``expedite`` (Slurm or the job
already requeued it: exclude and start now only), ``give_up`` (hold, never requeue), ``finish``
(the run is over: stop watching), ``wait`` (something is under way: do nothing yet), ``warn``,
and in operator mode ``set_down`` (mark a silent node DOWN, then recover).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from slurmft import exitcodes
from slurmft.slurm.client import Job, JobState, Node
from slurmft.slurm.policy import held_after_failed_launch
from slurmft.watch.config import WatchConfig
from slurmft.watch.runview import Beat, JournalSummary, done_for

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

_SLURM_END_CAUSES = {
    JobState.NODE_FAIL: NODE_FAIL,
    JobState.TIMEOUT: TIMEOUT,
    JobState.PREEMPTED: PREEMPTED,
    JobState.BOOT_FAIL: BOOT_FAIL,
    JobState.OUT_OF_MEMORY: OUT_OF_MEMORY,
    JobState.DEADLINE: TIMEOUT,
}
SWEEPER_PREFIX = "slurmft:"


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
        if summary.no_requeue(job.ids, restart):
            reason = summary.find(summary.segment_ends, job.ids, restart).get("reason")
            return Finding(NO_REQUEUE, GIVE_UP, f"the job exited {exitcodes.NO_REQUEUE} (do not "
                           f"requeue): {reason}", fault_time=end)
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


def detect_nodes(obs: RunObservation, memory: Memory, config: WatchConfig) -> Finding | None:
    """A node of a RUNNING job's allocation that is DOWN or drained: recover at once, except from
    a drain that is an admin's alone (maintenance: see ``admin_drain``)."""
    job = obs.job
    if job is None or job.state is not JobState.RUNNING or job.completing:
        return None
    troubled = bad_nodes(job.nodes, obs.nodes)
    acting = [t for t in troubled if t[1] != NOT_RESPONDING]
    if not acting:
        return None
    if all(cause == NODE_DRAINED for _, cause, _ in acting):
        return admin_drain(obs, memory, config, acting)
    return Finding(acting[0][1], RECOVER, "; ".join(e for _, _, e in acting),
                   tuple(n for n, _, _ in acting))


def admin_drain(obs: RunObservation, memory: Memory, config: WatchConfig,
                drained: list[tuple[str, str, str]]) -> Finding | None:
    """Nodes drained by an admin (not the sweeper): a drain lets jobs finish, so the job trains on
    until a checkpoint commits after the drain was first seen, then it is requeued without those
    nodes (no step lost). Bounded: with no such checkpoint within the run's checkpoint-overdue
    bound (``admin_drain_wait_s`` while the run's interval is unknown), it is requeued anyway.
    ``admin_drain = "ignore"``: left alone (the node's jobs end as the admin planned)."""
    names = tuple(n for n, _, _ in drained)
    what = "; ".join(e for _, _, e in drained)
    if config.admin_drain == "ignore":
        return Finding(NODE_DRAINED, WARN, f"{what}: an admin's drain, left alone (admin_drain = "
                       "ignore)", names)
    since = min(memory.drained_since.get(n, obs.now) for n in names)
    seen = [memory.drained_after_step[n] for n in names if n in memory.drained_after_step]
    if len(seen) == len(names):  # newer than every step the journal named at first sight
        newest_seen = max(-1 if s is None else s for s in seen)
        after = [(t, step) for t, step, *_ in obs.summary.commits if step > newest_seen]
    else:  # a state from before steps were kept: the clocks, as then
        after = [(t, step) for t, step, *_ in obs.summary.commits if t > since]
    if after:
        return Finding(NODE_DRAINED, RECOVER, f"{what}: checkpoint step {after[-1][1]} committed "
                       "after the drain: requeued without the node", names, since)
    bound = admin_drain_bound(obs.summary, config)
    waited = obs.now - since
    if waited > bound:
        return Finding(NODE_DRAINED, RECOVER, f"{what}: no checkpoint committed in the {waited:.0f} s "
                       f"since the drain (bound {bound:.0f} s): requeued without the node",
                       names, since)
    return Finding(NODE_DRAINED, WARN, f"{what}: an admin's drain; training goes on until its next "
                   f"checkpoint commits (at most {bound:.0f} s), then the job is requeued without "
                   "the node", names, since)


def admin_drain_bound(summary: JournalSummary, config: WatchConfig) -> float:
    """How long an admin-drained node is kept for a checkpoint: the checkpoint-overdue bound of the
    run's usual interval, ``admin_drain_wait_s`` while fewer than two commits give no interval."""
    times = [c[0] for c in summary.commits]
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    if not gaps:
        return config.admin_drain_wait_s
    return max(config.checkpoint_overdue_factor * statistics.median(gaps),
               config.checkpoint_overdue_min_s)


def silent_nodes(obs: RunObservation, memory: Memory, config: WatchConfig, restart: int,
                 first_seen: Mapping[str, float]) -> list[str]:
    """Operator mode's one rule before a node is set DOWN (DOWN kills every job on it, other
    users' too): Slurm has shown it NOT_RESPONDING (not yet DOWN) at two polls at least
    (``first_seen``: when each node was first seen so) AND the run's heartbeats from that node
    (segment ``restart``) are older than the run's learned hang timeout. A node with no heartbeat
    of the segment gives no such evidence: it is left to Slurm's own SlurmdTimeout."""
    job = obs.job
    if not config.operator or job is None or obs.beats is None:
        return []
    timeout = hang_timeout(memory, config)
    found = []
    for name in job.nodes:
        node = obs.nodes.get(name)
        if node is None or node.responding or node.down:
            continue
        if name not in first_seen or obs.now - first_seen[name] < config.poll_s:
            continue
        beats = [b for b in obs.beats.values() if b.node == name and b.job_id in job.ids
                 and b.restart_count == restart]
        newest = max(beats, key=lambda b: b.time) if beats else None
        # Past the hang timeout, and past the bound of a phase the node announced.
        if newest is not None and obs.now - newest.time > timeout and (
                newest.phase_bound_s is None or obs.now > _beat_deadline(newest, memory, config, False)):
            found.append(name)
    return found


def detect_silent_node(obs: RunObservation, memory: Memory, config: WatchConfig) -> Finding | None:
    """Operator mode: nodes of a RUNNING job that ``silent_nodes`` corroborates as gone, which
    Slurm would call DOWN only after SlurmdTimeout."""
    job = obs.job
    if job is None or job.state is not JobState.RUNNING:
        return None
    silent = silent_nodes(obs, memory, config, job.restart_count, memory.silent_since)
    if not silent:
        return None
    newest = max(b.time for b in (obs.beats or {}).values() if b.node in silent
                 and b.job_id in job.ids and b.restart_count == job.restart_count)
    return Finding(NODE_DOWN, SET_DOWN, f"{','.join(silent)} not responding for two polls and its "
                   f"heartbeats {obs.now - newest:.0f} s old > hang timeout "
                   f"{hang_timeout(memory, config):.0f} s", tuple(silent), newest)


def silent_nodes_of_ending_job(obs: RunObservation, memory: Memory, config: WatchConfig,
                               restart: int, first_seen: Mapping[str, float]) -> list[str]:
    """Operator mode, during a recovery: the nodes of a job that is ending (COMPLETING; never one
    being cancelled or that completed) that ``silent_nodes`` corroborates for the segment that was
    recovered from (``restart``). Slurm keeps such a job COMPLETING until those nodes are DOWN,
    which it decides only after SlurmdTimeout."""
    job = obs.job
    if (job is None or not job.completing
            or job.state in (JobState.CANCELLED, JobState.COMPLETED)):
        return []
    return silent_nodes(obs, memory, config, restart, first_seen)


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
    beats = [b for b in obs.beats.values() if b.node in job.nodes
             and b.job_id in job.ids and b.restart_count == job.restart_count]
    starting = not any(b.step_s is not None for b in beats)  # no step finished this segment yet
    deadlines = [_beat_deadline(b, memory, config, starting) for b in beats]
    if starting and started is not None:  # loading, or stuck before its first step
        deadlines.append(started + config.startup_grace_s + hang_timeout(memory, config, 0.0))
    if not deadlines:
        return None
    deadline = max(deadlines)
    if obs.now <= deadline:
        return None
    timeout = hang_timeout(memory, config)
    newest = max(b.time for b in beats) if beats else None
    fault_time = newest if newest is not None else (started or obs.now) + config.startup_grace_s
    silent = tuple(n for n in job.nodes if (node := obs.nodes.get(n)) is not None
                   and not node.responding)
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


def detect(obs: RunObservation, memory: Memory, config: WatchConfig) -> list[Finding]:
    """Every finding for one run this cycle, the one to act on first. A running job whose run
    dir says DONE for it is finishing (final upload, teardown): no node or hang finding."""
    end = detect_end(obs, memory)
    finishing = obs.job is not None and done_for(obs.done, obs.job.ids)
    found = [f for f in (end, *(() if finishing else (
        detect_nodes(obs, memory, config), detect_silent_node(obs, memory, config),
        detect_hang(obs, memory, config))))
             if f is not None]
    for warning in (detect_straggler(memory, config), detect_checkpoint_overdue(obs, config)):
        if warning is not None:
            found.append(warning)
    return found
