"""Which nodes a recovery may exclude, which of the watcher's old exclusions to lift, and how a
node's fault count fades: pure functions of the job, the node table and the watcher's memory.

Capacity is counted where the job can run: the nodes of its partition (of any one of them, for a
job that names several), never the whole cluster, so the ``no_fit`` guard and readmission work on
a cluster with other partitions. Where Slurm names no partition for the job or its nodes, the
whole node table is the job's pool.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from slurmft.allocation import Allocation
from slurmft.slurm.client import Job, JobState, Node
from slurmft.watch.detect import node_problem


def needed_nodes(job: Job) -> int:
    """The job's smallest size in nodes."""
    return max(job.min_nodes or 0, 1) if job.min_nodes else max(job.node_count, 1)


def sized_as_allocated(job: Job, record: Allocation | None) -> Job:
    """``job`` with at least the size of the in-allocation segment ``record`` describes (its
    active, spare and fenced nodes: the whole allocation it started with). The launcher takes a
    dead node out of the job before it requeues itself (``launch/handback.py``); Slurm then shows
    the pending job with the smaller count (22.05: NumNodes 2 of 3) but starts it only on the size
    it asked for at submission, so a fit judged by the count shown would leave a requeued job that
    can never start (the soak of 2026-11-27: 3 of 6 nodes excluded, 4 needed, 3 counted)."""
    if record is None or not record.for_job(job.ids):
        return job
    outside = {j.node for j in record.spare_jobs if j.node}   # spare jobs' nodes: not the job's
    size = len({*record.active, *record.spares, *record.fenced_nodes} - outside)
    return job if size <= needed_nodes(job) else dataclasses.replace(job, min_nodes=size)


def pools(job: Job, nodes: Mapping[str, Node]) -> list[set[str]]:
    """The node sets the job may run in: one per partition it names (the nodes Slurm lists in
    it), else the whole node table."""
    found = [{n for n, node in nodes.items() if part in node.partitions}
             for part in sorted(job.partitions)]
    found = [pool for pool in found if pool]
    return found or [set(nodes)]


def usable(nodes: Mapping[str, Node]) -> set[str]:
    return {n for n, node in nodes.items() if node_problem(node) is None}


def fit_exclusions(job: Job, nodes: Mapping[str, Node], wanted: list[str]) -> tuple[list[str], list[str]]:
    """(nodes to exclude, nodes left out) so that the job still fits: excluding a node that is
    DOWN, drained or outside the job's partitions costs no capacity; excluding a usable one of
    its partition must leave one partition with enough usable nodes for the job's smallest size."""
    needed = needed_nodes(job)
    already = set(job.excluded_nodes)
    free = [pool & usable(nodes) - already for pool in pools(job, nodes)]
    keep, dropped = [], []
    for name in wanted:
        if name in already:
            continue
        after = [pool - {name} for pool in free]
        if any(name in pool for pool in free) and max(len(pool) for pool in after) < needed:
            dropped.append(name)
            continue
        free = after
        keep.append(name)
    return keep, dropped


def readmit_to_fit(job: Job, nodes: Mapping[str, Node], excluding: list[str],
                   excluded_by_us: list[str]) -> list[str]:
    """Nodes this watcher once excluded that are usable again, oldest exclusion first, to take
    out of the job's ExcNodeList while, with ``excluding`` added, the job would not fit the
    usable nodes left of its partitions: over weeks the exclusions of repaired nodes would
    otherwise pile up until the job can never start again. A node of another partition is never
    readmitted (it would not help); the user's own exclusions are never touched."""
    needed = needed_nodes(job)
    ok = usable(nodes)
    excluded = set(job.excluded_nodes) | set(excluding)
    whole = pools(job, nodes)
    free = [pool & ok - excluded for pool in whole]
    readmit = []
    for name in excluded_by_us:
        if max(len(pool) for pool in free) >= needed:
            break
        if (name in job.excluded_nodes and name in ok and name not in excluding
                and any(name in pool for pool in whole)):
            readmit.append(name)
            for pool, full in zip(free, whole):
                if name in full:
                    pool.add(name)
    return readmit


def resubmission_exclusions(nodes: Mapping[str, Node], last_nodes: list[str],
                            wanted: list[str]) -> tuple[list[str], list[str]]:
    """``fit_exclusions`` for a job Slurm has forgotten (no Job to read): its size and partitions
    from its last allocation (the partitions every one of those nodes is in)."""
    known = [nodes[n].partitions for n in last_nodes if n in nodes]
    common = frozenset.intersection(*known) if known and len(known) == len(last_nodes) else frozenset()
    shape = Job(job_id="", name="", state=JobState.PENDING, node_count=max(len(last_nodes), 1),
                partition=",".join(sorted(common)))
    return fit_exclusions(shape, nodes, wanted)


def fade_faults(node_faults: dict[str, int], clean_since: dict[str, float], serving: Iterable[str],
                now: float, fade_s: float) -> bool:
    """Forget one fault of a node for each ``fade_s`` it has served the job without one
    (``serving``: the nodes of the running job's allocation with no problem this cycle;
    ``clean_since``: when each was first seen so, updated here). True when a count changed."""
    serving = set(serving)
    for name in [n for n in clean_since if n not in serving]:
        del clean_since[name]  # a clean period is one unbroken stretch of service
    changed = False
    for name in serving:
        since = clean_since.setdefault(name, now)
        if fade_s > 0 and node_faults.get(name, 0) > 0 and now - since >= fade_s:
            node_faults[name] -= 1
            if node_faults[name] == 0:
                del node_faults[name]
            clean_since[name] = now
            changed = True
    return changed
