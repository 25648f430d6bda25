"""Accounting's per-step records (``sacct -P --noheader -D -j <id> -o JobIDRaw,State,NodeList``):
where a job's newest run failed to launch.

A batch launch that fails (slurmd cannot start the job: "launch failed requeued held") leaves no
node in the controller's record of the requeued job (NodeList and BatchHost empty), while
accounting keeps one record per run and one per step: the run ``REQUEUED`` on its allocation,
and its ``<id>.batch`` step on the batch host, the node the launch failed on (22.05.8, captured
in tests/fixtures/slurm/2205/sacct_steps_launch_failed*.txt).
"""

from __future__ import annotations

from slurmft.slurm import validate
from slurmft.slurm.client import InvalidArgument

STEP_FIELDS = ("JobIDRaw", "State", "NodeList")


def failed_launch_host(output: str, raw_job_id: str) -> str | None:
    """The node of the batch step of the job's newest run that ended REQUEUED (the run Slurm put
    back in the queue; the current, pending run has no step yet); None when accounting has no
    such record yet (it lags the controller by seconds). Called only for a job Slurm holds after
    a failed launch, whose newest requeued run is that launch."""
    batch = f"{raw_job_id}.batch"
    host: str | None = None
    in_requeued_run = False
    for line in output.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) != len(STEP_FIELDS):
            continue
        job, state, nodes = fields
        if job == raw_job_id:
            in_requeued_run = state.split(" ")[0] == "REQUEUED"
            if in_requeued_run:
                host = None  # a newer requeued run: its own batch step decides
        elif job == batch and in_requeued_run:
            host = nodes
    if not host:
        return None
    try:
        return validate.node_name(host)  # one name: a batch step runs on the batch host only
    except InvalidArgument:  # a node list or an odd value: no evidence about one node
        return None
