"""Node trouble on a running job: a node of its allocation DOWN or drained (the sweeper's drain
at once, an admin's drain as maintenance: after the next checkpoint), and operator mode's silent
node (NOT_RESPONDING at two polls and its heartbeats older than the hang timeout); for a job in
in-allocation mode, what is left to its launcher (``detect_alloc.py``). Pure functions, as in
``detect.py``.
"""

from __future__ import annotations

import statistics
from typing import Mapping, Sequence

from slurmft.slurm.client import JobState
from slurmft.watch.config import WatchConfig
from slurmft.watch.detect_hang import _beat_deadline, hang_timeout
from slurmft.watch.detect_alloc import AllocView, allocation_view, batch_host
from slurmft.watch.findings import (
    DOWN_FENCED, NODE_DOWN, NODE_DRAINED, NODE_UNHEALTHY, NOT_RESPONDING, RECOVER, SET_DOWN, WARN,
    Finding, Memory, RunObservation, bad_nodes, node_problem,
)
from slurmft.watch.runview import JournalSummary


def detect_nodes(obs: RunObservation, memory: Memory, config: WatchConfig) -> Finding | None:
    """A node of a RUNNING job's allocation that is DOWN or drained: recover at once, except from
    a drain that is an admin's alone (maintenance: see ``admin_drain``)."""
    job = obs.job
    if job is None or job.state is not JobState.RUNNING or job.completing:
        return None
    troubled = bad_nodes(job.nodes, obs.nodes)
    batch = batch_host(obs)
    if batch and batch not in job.nodes:
        # Under --no-kill Slurm keeps the job RUNNING when its batch host dies and takes the
        # DOWN node out of the job's nodes (22.05, measured): the batch script, the launcher and
        # the rendezvous store died with it, so the job is over there.
        problem = node_problem(obs.nodes.get(batch))
        if problem is not None and problem[0] == NODE_DOWN:
            troubled.append((batch, NODE_DOWN, f"{problem[1]}: the job's batch host, gone from its "
                                               "nodes (the job's launcher died with it)"))
    view = allocation_view(obs)
    left: Finding | None = None
    if view is not None:
        troubled, left = _in_allocation(obs, memory, config, view, troubled)
    acting = [t for t in troubled if t[1] != NOT_RESPONDING]
    if not acting:
        return left
    if all(cause == NODE_DRAINED for _, cause, _ in acting):
        return admin_drain(obs, memory, config, acting)
    return Finding(acting[0][1], RECOVER, "; ".join(e for _, _, e in acting),
                   tuple(n for n, _, _ in acting))


def _in_allocation(obs: RunObservation, memory: Memory, config: WatchConfig, view: AllocView,
                   troubled: list[tuple[str, str, str]]
                   ) -> tuple[list[tuple[str, str, str]], Finding | None]:
    """The node trouble of an in-allocation job that is the watcher's to act on, and a warning
    for what it leaves to the launcher: a fenced node's (expected: the launcher recovered from
    it), a spare's (it trains nothing: the launcher has one spare fewer), and, for
    ``allocation_grace_s`` from when it was first seen DOWN or drained (an admin's drain: that
    plus the drain bound, as the launcher waits for the next checkpoint), an active node's that the
    launcher has not fenced yet (it polls Slurm's node states and fences such a node itself,
    ``launch/nodestate.py``). The batch host's trouble is always the watcher's (its death ends
    the job, and it cannot be replaced inside the allocation)."""
    batch = batch_host(obs)
    kept, left = [], []
    for name, cause, evidence in troubled:
        if name == batch:
            kept.append((name, cause, evidence))
        elif name in view.fenced:
            continue
        elif name in view.spares and cause != NOT_RESPONDING:
            left.append((name, f"{evidence}: a spare, which trains nothing (the launcher has one "
                               "spare fewer)"))
        elif cause in (NODE_DOWN, NODE_UNHEALTHY, NODE_DRAINED):
            waited = obs.now - memory.down_since.get(name, obs.now)
            # An admin's drain the launcher keeps until the run's next checkpoint, at most the drain
            # bound (launch/nodestate.py): acting at that commit too would requeue the job the
            # launcher is moving onto a spare.
            grace = config.allocation_grace_s + (
                admin_drain_bound(obs.summary, config) if cause == NODE_DRAINED else 0.0)
            if waited < grace:
                left.append((name, f"{evidence}: left to the in-allocation launcher to fence "
                                   f"(for up to {grace:.0f} s)"))
            else:
                kept.append((name, cause, f"{evidence}, and the in-allocation launcher did not "
                                          f"fence it in {waited:.0f} s"))
        else:
            kept.append((name, cause, evidence))
    if not left:
        return kept, None
    return kept, Finding(NODE_DOWN, WARN, "; ".join(e for _, e in left), tuple(n for n, _ in left))


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
    return drain_bound_of([c[0] for c in summary.commits], config)


def drain_bound_of(times: Sequence[float], config: WatchConfig) -> float:
    """The same bound from the commits' times, in order (also the in-allocation launcher's)."""
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
    Slurm would call DOWN only after SlurmdTimeout. In-allocation mode: a node the launcher
    fenced is set DOWN once Slurm too has shown it NOT_RESPONDING at two polls (two witnesses,
    the launcher's evidence given as the reason), and the job is left alone."""
    job = obs.job
    if job is None or job.state is not JobState.RUNNING:
        return None
    view = allocation_view(obs)
    silent = silent_nodes(obs, memory, config, job.restart_count, memory.silent_since)
    if view is not None and config.operator:
        gone = [n for n in job.nodes if n in view.fenced and n != batch_host(obs)
                and _not_responding_twice(obs, memory, config, n)]
        if gone:
            return Finding(NODE_DOWN, DOWN_FENCED, "; ".join(
                f"{n} fenced by the in-allocation launcher ({view.evidence.get(n, 'no evidence')}) "
                "and not responding for two polls" for n in gone), tuple(gone))
        silent = [n for n in silent if n not in view.fenced]
    if not silent:
        return None
    newest = max(b.time for b in (obs.beats or {}).values() if b.node in silent
                 and b.job_id in job.ids and b.restart_count == job.restart_count)
    return Finding(NODE_DOWN, SET_DOWN, f"{','.join(silent)} not responding for two polls and its "
                   f"heartbeats {obs.now - newest:.0f} s old > hang timeout "
                   f"{hang_timeout(memory, config):.0f} s", tuple(silent), newest)


def _not_responding_twice(obs: RunObservation, memory: Memory, config: WatchConfig, name: str) -> bool:
    node = obs.nodes.get(name)
    first = memory.silent_since.get(name)
    return (node is not None and not node.responding and not node.down and first is not None
            and obs.now - first >= config.poll_s)


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


