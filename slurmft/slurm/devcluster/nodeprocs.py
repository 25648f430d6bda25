"""Finding every process that belongs to one devcluster node: its slurmd, the slurmstepd
daemons it forked, and the job processes they run.

slurmd double-forks slurmstepd, so step daemons are NOT below slurmd in the parent tree. They are
found by the marker variable that slurmd passes down in its environment (``NODE_MARK_ENV``); job
processes by ``SLURMD_NODENAME`` + ``SLURM_CLUSTER_NAME``, which slurmstepd puts in every task's
environment; then everything below any of these in the parent tree (which also catches a task
that cleared its environment).
"""

from __future__ import annotations

import os
import signal

from slurmft.slurm.devcluster.procs import (
    ProcId, descendants, describe, is_alive, read_environ, send, snapshot, wait_gone,
)

KILL_PASSES = 5


def node_mark(cluster: str, node: str) -> str:
    return f"{cluster}:{node}"


def belongs_to_node(env: dict[str, str], cluster: str, node: str, mark_env: str) -> bool:
    """Pure: does a process with this environment belong to ``node`` of ``cluster``?"""
    if env.get(mark_env) == node_mark(cluster, node):
        return True
    return env.get("SLURMD_NODENAME") == node and env.get("SLURM_CLUSTER_NAME") == cluster


def node_processes(cluster: str, node: str, slurmd: ProcId | None, mark_env: str) -> list[ProcId]:
    """Every live process of ``node`` (slurmd included), from one pass over the process table."""
    table = snapshot()
    me = os.getpid()
    roots = {st.pid for st in table
             if st.pid != me and belongs_to_node(read_environ(st.pid), cluster, node, mark_env)}
    if slurmd is not None and is_alive(slurmd):
        roots.add(slurmd.pid)
    pids = roots | descendants(roots, table)
    pids.discard(me)
    by_pid = {st.pid: st for st in table}
    return [ProcId(pid, by_pid[pid].start_time) for pid in sorted(pids)
            if by_pid[pid].state not in ("Z", "X")]


def kill_node_tree(cluster: str, node: str, slurmd: ProcId | None, mark_env: str) -> list[ProcId]:
    """SIGKILL the node's whole tree as one event; returns what could not be killed.

    The tree is frozen (SIGSTOP) before anything dies: killed one process at a time, a
    slurmstepd could see its task die and report a failed job to slurmctld before it died
    itself, which is not what a node death looks like. Frozen processes cannot fork either, so
    a second look after the freeze finds every member.

    Everything frozen is killed, whether or not the second look still counts it as the node's:
    a member that changed between the looks (exec'd without the node's environment, its parent
    gone) was otherwise left stopped for ever, holding whatever it held of the node."""
    left: list[ProcId] = []
    for _ in range(KILL_PASSES):
        procs = node_processes(cluster, node, slurmd, mark_env)
        if not procs:
            return []
        for proc in procs:
            send(proc, signal.SIGSTOP)
        frozen = node_processes(cluster, node, slurmd, mark_env)
        for proc in frozen:
            send(proc, signal.SIGSTOP)
        doomed = list(dict.fromkeys([*procs, *frozen]))
        for proc in doomed:
            send(proc, signal.SIGKILL)
        left = wait_gone(doomed, 5.0)
    return left


def describe_node(cluster: str, node: str, slurmd: ProcId | None, mark_env: str) -> str:
    """The node's live processes for an error message: pid, state and command of each."""
    parts = []
    for proc in node_processes(cluster, node, slurmd, mark_env):
        try:
            with open(f"/proc/{proc.pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        parts.append(f"{describe(proc)}: {os.path.basename(argv[0].decode(errors='replace'))}")
    return "; ".join(parts) or "none"
