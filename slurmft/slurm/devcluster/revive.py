"""How ``DevCluster.reset`` brings a node's slurmd back, and what it says when it cannot.

A node whose slurmd died is restarted only after whatever is left of it has been killed: a
leftover member (a step daemon, or a process an interrupted kill left frozen) keeps the node's
spool sockets and files, and a slurmd started beside it may never register. A stopped slurmd
(SIGSTOP) is alive but answers nothing, so it is continued, not taken for a working node. While
reset waits for the controller, a slurmd it started that exits ends the wait at once, with its
exit status and log; a node still not IDLE at the deadline is named with its slurmd's pid, its
state and the kernel function it waits in, whether this reset started it, and every other
process of the node: the controller alone only says NOT_RESPONDING. A node that a reset started
a slurmd for, or found not responding, and that did not come back before that reset ended (timed
out, or was interrupted: a test's own timeout) has its slurmd replaced by the next reset (killed
with the rest of the node, then started anew) instead of waited on again.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from slurmft.slurm.devcluster.daemons import DaemonFailed, log_tail
from slurmft.slurm.devcluster.errors import DevClusterError
from slurmft.slurm.devcluster.nodeprocs import describe_node, kill_node_tree, node_processes
from slurmft.slurm.devcluster.procs import ProcId, describe, is_alive, is_stopped, send


@dataclass
class Revival:
    """What one reset did to the nodes' slurmds, for its checks and its error message."""

    started: dict[str, tuple[ProcId, float]] = field(default_factory=dict)  # node -> (proc, when)
    continued: dict[str, ProcId] = field(default_factory=dict)
    leftovers: dict[str, int] = field(default_factory=dict)  # node -> processes killed first
    replaced: dict[str, str] = field(default_factory=dict)  # node -> the unanswering slurmd, described


def revive_node(cluster: str, node: str, slurmd: ProcId | None, mark_env: str,
                spawn: Callable[[], ProcId], revival: Revival, unanswered: bool = False) -> None:
    """Make ``node``'s slurmd a running process: continue it if stopped; if it is gone, or
    ``unanswered`` (it ran through a previous reset's whole bound and the node never came back),
    kill what is left of the node, then start a new one (``spawn``)."""
    if slurmd is not None and is_alive(slurmd):
        if unanswered:
            revival.replaced[node] = describe(slurmd)
        else:
            if is_stopped(slurmd) and send(slurmd, signal.SIGCONT):
                revival.continued[node] = slurmd
            return
    left_before = len(node_processes(cluster, node, None, mark_env))
    stubborn = kill_node_tree(cluster, node, slurmd if node in revival.replaced else None, mark_env)
    if stubborn:
        raise DevClusterError(
            f"reset: node {node}: its slurmd is gone and what is left of it cannot be killed: "
            + "; ".join(describe(p) for p in stubborn))
    if left_before and node not in revival.replaced:
        revival.leftovers[node] = left_before
    revival.started[node] = (spawn(), time.monotonic())


def check_started(revival: Revival, logs: Callable[[str], list[Path]]) -> None:
    """DaemonFailed when a slurmd this reset started has exited (it will never register)."""
    for node, (proc, _) in revival.started.items():
        if not is_alive(proc):
            raise DaemonFailed(f"reset: the slurmd it started for {node} exited "
                               f"({describe(proc)}) before the node was back\n"
                               + log_tail(logs(node)))


def explain(names: list[str], cluster: str, slurmds: dict[str, ProcId | None], mark_env: str,
            revival: Revival, last_log_line: Callable[[str], str]) -> str:
    """For each node still not IDLE: its slurmd process as the kernel sees it, and the rest."""
    parts = []
    for node in names:
        slurmd = slurmds.get(node)
        if slurmd is None:
            what = "no slurmd recorded"
        else:
            what = f"slurmd {describe(slurmd)}"
        if node in revival.started:
            proc, when = revival.started[node]
            what += f", started by this reset {time.monotonic() - when:.0f} s ago"
            if proc != slurmd:
                what += f" as pid {proc.pid}"
        else:
            what += ", not restarted (alive when reset began)"
        if node in revival.replaced:
            what += f", replacing {revival.replaced[node]}, which never brought the node back"
        if node in revival.continued:
            what += ", was stopped and continued (SIGCONT) by this reset"
        if node in revival.leftovers:
            what += f", {revival.leftovers[node]} leftover process(es) of it killed first"
        others = describe_node(cluster, node, slurmd, mark_env)
        what += f"; processes of {node}: {others}; its log ends: {last_log_line(node)}"
        parts.append(f"{node}: {what}")
    return " | ".join(parts)
