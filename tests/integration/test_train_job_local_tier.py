"""The node-local checkpoint tier on the devcluster: every node has its own "local disk"
(``<devcluster>/local/<node>``), a real 2-node job commits there first, and a node killed while
the copy to the run directory was still in flight costs nothing: the next job resumes from the
newest local checkpoint, read from the surviving node's own shards and its replica of the dead
node's, not from the older one in the run directory."""

from __future__ import annotations

import pytest

from slurmft.rundir import RunDir
from slurmft.checkpoint.tiers import read_tier_index
from slurmft.checkpoint.writer import FAULT_ENV, FAULT_MARK_ENV

from train_job_support import TINY_ARGS, kill_ranks, losses, reference_losses, submit

pytestmark = pytest.mark.integration

ARGS = [*TINY_ARGS, "--ckpt-every", "5", "--step-sleep", "0.1"]


@pytest.mark.timeout(300)
def test_node_killed_during_the_copy_to_the_run_dir_resumes_from_the_local_tier(slurm_cluster, tmp_path):
    run, mark = tmp_path / "run", tmp_path / "fault-mark"
    tier_env = {"SLURMFT_CHECKPOINT_LOCAL_DIR": slurm_cluster.local_dir,
                "SLURMFT_CHECKPOINT_SHARED_INTERVAL": "5"}
    # Step 5 (the first save) is copied to the run dir; step 10 commits on both nodes' local
    # disks and its copy stops half way (shards copied, nothing committed) at the fault point.
    first = submit(slurm_cluster, run, [*ARGS, "--steps", "40"], nodes=2,
                   env={**tier_env, FAULT_ENV: "shared_copy@10", FAULT_MARK_ENV: str(mark)})
    first.wait_for(lambda j: mark.exists() and len(mark.read_text().splitlines()) == 2, 120,
                   "both ranks paused in the copy of step 10 to the run dir")
    survivor, victim = first.state().nodes
    slurm_cluster.kill_node(victim)  # its slurmd, its slurmstepd, its rank: SIGKILL
    kill_ranks(slurm_cluster, first.job_id)
    first.client.cancel(first.job_id)
    first.wait_finished(timeout=120)
    assert RunDir(run).committed_steps() == [5]
    assert [p.name for p in RunDir(run).checkpoints.glob("step_000000010.tmp-*")]  # the half copy
    assert read_tier_index(RunDir(run)) == {survivor: (5, 10), victim: (5, 10)}
    committed = [(e.get("step"), e.get("tier")) for e in first.events(["checkpoint_committed"])]
    assert committed == [(5, "local"), (10, "local")]
    assert [e.get("step") for e in first.events(["checkpoint_copied"])] == [5]

    # The dead node stays out; its disk with it. The next job runs on the survivor and a node
    # that has never seen this run: that node's rank gets its shard from the survivor's replica.
    second = submit(slurm_cluster, run, [*ARGS, "--steps", "20"], nodes=2, env=tier_env,
                    sbatch_options=[f"--nodelist={survivor}", f"--exclude={victim}"])
    final = second.wait_finished(timeout=150)
    assert final.state.value == "COMPLETED", second.context()
    starts = second.events(["segment_start"])
    assert [e.get("restored_step") for e in starts] == [None, 10], second.context()
    assert victim not in second.state().nodes
    # Resumed exactly: the steps after 10 see the samples an uninterrupted run sees.
    events = second.events(["segment_start", "loss"])
    last_start = max(i for i, e in enumerate(events) if e.kind == "segment_start")
    resumed = losses(events[last_start + 1:])
    assert sorted(resumed) == list(range(11, 21))
    reference = reference_losses(tmp_path / "reference", [*ARGS, "--steps", "20"], world_size=2)
    for step in range(11, 21):
        assert resumed[step][1] == reference[step][1]
        assert resumed[step][0] == pytest.approx(reference[step][0], rel=1e-4)
    steps = RunDir(run).committed_steps()
    assert steps[0] == 5 and steps[-1] == 20  # the new segment's first save was copied, and the last
    assert not list(RunDir(run).checkpoints.glob("*.tmp-*"))  # the half copy of 10 was swept
