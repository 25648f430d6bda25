"""How ``DevCluster.reset`` brings every node back to IDLE from whatever state it is in.

One rule per node state, as a pure function (``node_action``), and one bounded loop
(``settle``) that re-reads the controller each round, because states move on their own between
a read and an action: a restarted controller shows every node UNKNOWN until its slurmd
registers, a DOWN node returns by itself (``ReturnToService=1``) once its slurmd answers, a job
it restored from saved state comes back. RESUME is sent only where slurmctld accepts it for a
registered node; an answer that the state moved on is not an error, only not being IDLE by the
deadline is, and that error names every node still not IDLE with its state.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from slurmft.slurm.devcluster.errors import DevClusterError
from slurmft.slurm.devcluster.query import JobStatus, NodeStatus

POLL_S = 0.3
# Flags that only an admin's RESUME clears (DOWN is a base state and is resumed too).
RESUME_FLAGS = frozenset({"DRAIN", "FAIL"})


def node_action(node: NodeStatus) -> str:
    """``"resume"``, ``"wait"`` or ``"none"`` (already IDLE) for one node.

    UNKNOWN means the node has not registered since the controller (re)started: 22.05 answers
    RESUME there with "Invalid node state specified" (measured; it clears DRAIN anyway), so the
    node is left to register first and resumed in a later round as IDLE+DRAIN or DOWN.
    """
    if node.idle:
        return "none"
    if node.state == "UNKNOWN":
        return "wait"
    if node.state == "DOWN" or node.flags & RESUME_FLAGS:
        return "resume"
    return "wait"  # COMPLETING, ALLOCATED while a job is cancelled, NOT_RESPONDING ...


def describe_not_idle(nodes: dict[str, NodeStatus], expected: Sequence[str]) -> str:
    parts = [f"{name}={nodes[name].describe()}" if name in nodes else f"{name}=not listed"
             for name in expected if name not in nodes or not nodes[name].idle]
    return ", ".join(parts) or "every node IDLE"


def settle(node_names: Sequence[str], *, read_jobs: Callable[[], list[JobStatus]],
           read_nodes: Callable[[], dict[str, NodeStatus]],
           cancel: Callable[[list[str]], None], resume: Callable[[str], None],
           timeout: float, logs: str, clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep,
           check: Callable[[], None] = lambda: None,
           explain: Callable[[list[str]], str] = lambda names: "") -> None:
    """Cancel every job and resume what needs it, round after round, until no job is left and
    every node in ``node_names`` is IDLE; DevClusterError after ``timeout`` seconds.
    ``check`` runs every round and raises to give up early (a restarted slurmd that exited);
    ``explain(not_idle)`` adds what the caller knows about those nodes to the timeout's error
    (their slurmd processes: the controller only says NOT_RESPONDING)."""
    deadline = clock() + timeout
    jobs: list[JobStatus] = []
    nodes: dict[str, NodeStatus] = {}
    last_error = ""
    while True:
        try:
            jobs = read_jobs()
            live = [j.job_id for j in jobs if j.state != "COMPLETING"]
            if live:
                cancel(live)
        except DevClusterError as exc:  # the controller may still be starting, a job ending
            last_error = str(exc)
        try:
            nodes = read_nodes()
        except DevClusterError as exc:
            last_error = str(exc)
        else:
            if not jobs and all(n in nodes and nodes[n].idle for n in node_names):
                return
            for name in node_names:
                if name in nodes and node_action(nodes[name]) == "resume":
                    try:
                        resume(name)
                    except DevClusterError as exc:  # its state moved on since the read
                        last_error = str(exc)
        check()
        if clock() >= deadline:
            left = f"; jobs left: {', '.join(j.job_id for j in jobs)}" if jobs else ""
            last = f"; last error: {last_error}" if last_error else ""
            why = explain([n for n in node_names if n not in nodes or not nodes[n].idle])
            raise DevClusterError(
                f"reset: timed out after {timeout:.0f} s waiting for every node IDLE and no job "
                f"({describe_not_idle(nodes, node_names)}{left}){last}"
                f"{'; ' + why if why else ''}; logs in {logs}")
        sleep(POLL_S)
