"""Accounting's per-step records (``sacct -P --noheader -D -j <id> -o JobIDRaw,State,NodeList``):
the job's newest run that Slurm requeued after a failed launch or prolog.

A batch launch that fails (slurmd cannot start the job: "launch failed requeued held") leaves no
node in the controller's record of the requeued job (NodeList and BatchHost empty), while
accounting keeps one record per run and one per step: the run ``REQUEUED`` on its allocation,
and its ``<id>.batch`` step on the batch host (22.05.8, captured in
tests/fixtures/slurm/2205/sacct_steps_launch_failed*.txt). A prolog that fails on another node
of the allocation than the batch host leaves the same records (the batch step on the healthy
batch host; sacct_steps_prolog_failed_second_node.txt): which node failed is for
``policy.launch_failure_nodes`` to tell from the node table.
"""

from __future__ import annotations

from dataclasses import dataclass

import hostlist

from slurmft.slurm import validate
from slurmft.slurm.client import InvalidArgument

STEP_FIELDS = ("JobIDRaw", "State", "NodeList")


@dataclass(frozen=True)
class FailedRun:
    """The newest run accounting records as ``REQUEUED``: its allocation and its batch host
    (None where accounting names none, or not one node)."""

    nodes: tuple[str, ...]
    batch_host: str | None


def _names(expression: str) -> tuple[str, ...]:
    try:
        return tuple(validate.node_names(hostlist.expand_hostlist(expression)))
    except (hostlist.BadHostlist, InvalidArgument):  # "None assigned", an odd value: no names
        return ()


def failed_run(output: str, raw_job_id: str) -> FailedRun | None:
    """The job's newest run that ended REQUEUED (the run Slurm put back in the queue; the
    current, pending run has no step yet); None when accounting has no such record yet (it lags
    the controller by seconds). Called only for a job Slurm holds after a failed launch, whose
    newest requeued run is that launch."""
    batch = f"{raw_job_id}.batch"
    newest: FailedRun | None = None
    in_requeued_run = False
    for line in output.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) != len(STEP_FIELDS):
            continue
        job, state, nodes = fields
        if job == raw_job_id:
            in_requeued_run = state.split(" ")[0] == "REQUEUED"
            if in_requeued_run:
                newest = FailedRun(_names(nodes), None)  # a newer requeued run: its steps decide
        elif job == batch and in_requeued_run and newest is not None:
            hosts = _names(nodes)
            # One name: a batch step runs on the batch host only; a list is no evidence.
            newest = FailedRun(newest.nodes, hosts[0] if len(hosts) == 1 else None)
    if newest is None or (not newest.nodes and newest.batch_host is None):
        return None
    return newest
