"""``slurmft watch`` beside a job in in-allocation mode, on the real devcluster (issue 27): after a
recovery in the allocation, a later requeue (the batch host's death, which Slurm leaves the job
RUNNING through) avoids the fenced node.

The watcher leaving a recovery in the allocation alone (even in operator mode with a short hang
timeout), setting the fenced node DOWN with the launcher's evidence, and ``slurmft status``
counting the recovery as one in the allocation are asserted in test_inalloc.py's spare case:
issue 28 merged this module's test_the_watcher_leaves_a_recovery_in_the_allocation_alone there
(it started the same spare job and killed the same node)."""

from __future__ import annotations

import json

import pytest

from slurmft import journal
from slurmft.rundir import RunDir
from slurmft.slurm.client import JobState

from train_job_support import TINY_ARGS, submit

pytestmark = pytest.mark.integration

# Training must outlast the whole test (it never waits for the job's end): Slurm taking the dead
# node out of the job takes up to SlurmdTimeout plus its ping interval, and with 40 steps the
# re-formed world finished training before the batch host was killed (a fresh-clone run at load
# 38): the job then had nothing to requeue for.
ARGS = [*TINY_ARGS, "--steps", "1000", "--ckpt-every", "5", "--step-sleep", "0.2"]
INALLOC_ENV = {"SLURMFT_NODE_SILENT_S": "4", "SLURMFT_PG_TIMEOUT_S": "60", "SLURMFT_SPARE_NODES": "1"}


def _allocation(run) -> dict:
    return json.loads(RunDir(run).allocation.read_text())


@pytest.mark.timeout(720)
def test_a_requeue_after_a_recovery_in_the_allocation_avoids_the_fenced_node(five_nodes, tmp_path):
    """n2 dies and is fenced (the spare n3 takes its place); n2 comes back into service (its
    slurmd restarted, Slurm returns it: ReturnToService=1). Then the batch host n1 dies: Slurm
    keeps the job RUNNING without it (--no-kill); the job's other tasks (or the watcher, if first)
    find the batch host gone and requeue; the requeue excludes n1 and the fenced n2, so the run
    starts again on n3-n5. On the
    old code the watcher waited for its hang rule, and excluded n1 only: Slurm picked n2 again."""
    cluster = five_nodes
    run = tmp_path / "run"
    job = submit(cluster, run, ARGS, nodes=3, sbatch_options=["--no-kill"], env=INALLOC_ENV, watch=True)
    job.wait_for(lambda j: any(e.get("step") == 10 for e in job.events(["checkpoint_committed"])),
                 240, "checkpoint of step 10")
    job.wait_step(12, timeout=90)
    alloc = _allocation(run)
    batch, victim, spare = alloc["active"][0], alloc["active"][1], alloc["spares"][0]
    assert batch == job.state().batch_host
    job.wait_for(lambda j: RunDir(run).alive(spare).exists(), 90, f"spare {spare}'s beat")
    cluster.kill_node(victim)
    job.wait_for(lambda j: victim not in j.nodes, 120, f"Slurm taking the dead {victim} out of the job")
    cluster.start_node(victim)  # back in service, but fenced by this job
    replaced = [e for e in job.events([journal.RECOVERY_ACTION]) if journal.in_allocation(e)]
    assert [(e.get("action"), e.get("nodes")) for e in replaced] == [("replace_node", [victim])]
    job.wait_for(lambda j: any(e.time > replaced[0].time for e in job.events([journal.SEGMENT_START])),
                 180, "the new world's start")

    cluster.kill_node(batch)
    # Not COMPLETING: a requeued job is shown RUNNING + COMPLETING with its new restart count
    # on its old nodes for a moment.
    again = job.wait_for(lambda j: j.state is JobState.RUNNING and not j.completing
                         and j.restart_count >= 1, 300, "the requeued job running")
    assert victim not in again.nodes and batch not in again.nodes, (again.nodes, job.context())
    assert victim in again.excluded_nodes, again.excluded_nodes
    # Who finds the batch host gone: the job itself (its other nodes' tasks requeue it excluding
    # the batch host, launch/orphan.py) or, when it is first, the watcher (node_down). Seen both
    # ways: the job's own requeue won in a 6-worker fresh-clone run.
    own = [e for e in job.events([journal.TEMPLATE]) if e.get("action") == "requeue"]
    watcher = [e for e in job.events([journal.FAULT_DETECTED]) if not journal.in_allocation(e)]
    by_job = bool(own) and str(own[0].get("exclude") or "").split(",") == [batch]
    by_watcher = [(e.get("cause"), e.get("nodes")) for e in watcher][:1] == [("node_down", [batch])]
    assert by_job or by_watcher, (own, watcher, job.context())
    excluded = {n for e in job.events([journal.RECOVERY_ACTION, journal.RESTART_ACTION])
                if e.get("action") == "exclude" and e.get("ok") for n in e.get("nodes")}
    excluded |= {n for e in own for n in str(e.get("exclude") or "").split(",") if n}
    assert {batch, victim} <= excluded, excluded
