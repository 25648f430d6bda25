"""A node on which every batch launch fails (issue 25, item 10), on the devcluster: that node's
slurmd runs with ``-d /bin/false`` as its slurmstepd (``DevCluster.start_node(stepd=...)``), so it
answers pings and stays IDLE while every launch fails. Slurm requeues the job held ("launch failed
requeued held", within a second: measured); the real ``slurmft watch`` finds the node in
accounting, excludes it, releases the job, and the run trains elsewhere."""

from __future__ import annotations

import time

import pytest

from slurmft.slurm.client import JobState

from train_job_support import TINY_ARGS, submit
from watch_support import events_until, observe_until, of

pytestmark = pytest.mark.integration


@pytest.mark.timeout(420)
def test_a_node_that_fails_every_launch_is_excluded_and_the_job_runs_elsewhere(slurm_cluster, tmp_path):
    # On an idle cluster Slurm places a 1-node job on its first node: break that one.
    bad = slurm_cluster.node_names[0]
    slurm_cluster.kill_node(bad)
    slurm_cluster.start_node(bad, stepd="/bin/false")
    run = tmp_path / "run"
    run.mkdir()
    try:
        submitted = time.monotonic()
        job = submit(slurm_cluster, run, [*TINY_ARGS, "--steps", "6", "--step-sleep", "0.1"], nodes=1,
                     sbatch_options=[f"--comment=SLURMFT_RUN_DIR={run}"], watch=True)
        ctx = job.context
        events = events_until(run, lambda ev: of(ev, "job_running"), 240,
                              "the job running again after its failed launch", context=ctx)
        running_s = time.monotonic() - submitted
        events = events_until(run, lambda ev: of(ev, "loss"), 180, "training on another node",
                              context=ctx)
        training_s = time.monotonic() - submitted
        print(f"\nfailed launch on {bad}: running elsewhere {running_s:.0f} s after submission, "
              f"first loss after {training_s:.0f} s")
        [fault] = of(events, "fault_detected")
        assert fault.get("cause") == "launch_failed" and fault.get("nodes") == [bad], fault.fields
        assert of(events, "recovery_action", action="release", ok=True)
        assert bad not in of(events, "job_running")[0].get("nodes")
        live = job.state()
        assert bad in live.excluded_nodes and live.restart_count == 1
        final = observe_until(job.client, job.job_id, lambda j: j.state.finished, 180, "end", context=ctx)
        assert final.state is JobState.COMPLETED, ctx()
    finally:
        slurm_cluster.kill_node(bad)
        slurm_cluster.start_node(bad)
