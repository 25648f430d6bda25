"""A node drained while its task still beats, on the real devcluster (issue 27): the health
sweeper's drain of an active non-batch node of a 3 + 1-spare ``sbatch --no-kill`` job, with the
real ``slurmft watch`` beside it. The launcher learns it from Slurm (``launch/nodestate.py``) and
replaces the node with the spare inside the allocation; the watcher leaves it to the launcher.
The job never leaves RUNNING, is never requeued, and every step's loss equals an uninterrupted
run's bit for bit."""

from __future__ import annotations

import json

import pytest

from slurmft import journal
from slurmft.rundir import RunDir
from slurmft.slurm.client import JobState

from train_job_support import TINY_ARGS, reference_losses, submit

pytestmark = pytest.mark.integration

# The drain comes at step 12: the steps after it must outlast the launcher's next answer from
# Slurm (SLURMFT_NODE_POLL_S) on a busy machine, or the run ends before anything is fenced (a CI
# run at 40 steps and the default 10 s poll did just that).
ARGS = [*TINY_ARGS, "--steps", "80", "--ckpt-every", "5", "--step-sleep", "0.2"]
INALLOC_ENV = {"SLURMFT_NODE_SILENT_S": "4", "SLURMFT_PG_TIMEOUT_S": "60",
               "SLURMFT_SPARE_NODES": "1", "SLURMFT_NODE_POLL_S": "2"}
# What the sweeper writes (``slurmft: <check>: <detail>``, docs/sweeper.md).
REASON = "slurmft: external_site: ERROR: site check: /scratch is read-only"


def _allocation(run) -> dict:
    return json.loads(RunDir(run).allocation.read_text())


@pytest.mark.timeout(420)
def test_a_node_the_sweeper_drains_is_replaced_by_the_spare_and_the_watcher_leaves_it(
        slurm_cluster, tmp_path):
    run = tmp_path / "run"
    job = submit(slurm_cluster, run, ARGS, nodes=4, sbatch_options=["--no-kill"], env=INALLOC_ENV)
    job.watch(slurm_cluster)
    job.wait_for(lambda j: any(e.get("step") == 10 for e in job.events(["checkpoint_committed"])),
                 150, "checkpoint of step 10")
    job.wait_step(12, timeout=60)
    alloc = _allocation(run)
    batch, victim, spare = alloc["active"][0], alloc["active"][1], alloc["spares"][0]
    job.wait_for(lambda j: RunDir(run).alive(spare).exists(), 60, f"spare {spare}'s beat")
    job.client.drain(victim, REASON)

    seen: list[JobState] = []
    final = job.wait_for(lambda j: (seen.append(j.state) if not seen or seen[-1] is not j.state
                                    else None) or j.state.finished, 300, "the job's end")
    assert seen[0] is JobState.RUNNING and final.state is JobState.COMPLETED, job.context()
    assert set(seen) == {JobState.RUNNING, JobState.COMPLETED} and final.restart_count == 0

    alloc = _allocation(run)
    assert [(f["node"], f["cause"]) for f in alloc["fenced"]] == [(victim, "node_unhealthy")]
    assert victim not in alloc["active"] and spare in alloc["active"] and batch in alloc["active"]
    faults = [e for e in job.events([journal.FAULT_DETECTED]) if e.get("where") == "allocation"]
    assert [(e.get("cause"), e.get("nodes")) for e in faults] == [("node_unhealthy", [victim])]
    assert REASON in faults[0].get("evidence")[0]
    actions = [e for e in job.events([journal.RECOVERY_ACTION]) if e.get("where") == "allocation"]
    assert [(a.get("action"), a.get("nodes"), a.get("spare")) for a in actions] == \
        [("replace_node", [victim], spare)]
    # The watcher journaled no fault and no action of its own: the launcher's to handle.
    own = [e for e in job.events([journal.FAULT_DETECTED, journal.RECOVERY_ACTION])
           if not journal.in_allocation(e)]
    assert own == [], own

    starts = job.events([journal.SEGMENT_START])
    assert len(starts) == 2 and all(e.get("world_size") == 3 for e in starts)
    assert starts[1].get("restored_step") >= 10
    ref = reference_losses(tmp_path / "reference", ARGS, world_size=3)
    seen_losses = [(e.get("step"), e.get("loss"), e.get("samples")) for e in job.events(["loss"])]
    assert {s for s, _, _ in seen_losses} == set(ref)
    for step, loss, samples in seen_losses:
        assert (loss, samples) == ref[step], f"step {step}"


# An admin's drain (any reason but the sweeper's): maintenance, "finish what runs".
ADMIN_REASON = "maintenance: DIMM replacement, ticket 4711"
ADMIN_ARGS = [*TINY_ARGS, "--steps", "80", "--ckpt-every", "10", "--step-sleep", "0.2"]


@pytest.mark.timeout(420)
def test_an_admins_drain_is_fenced_after_the_next_checkpoint_and_the_spare_goes_on_from_it(
        slurm_cluster, tmp_path):
    """A drain lets what runs finish: the admin-drained active node trains on until a checkpoint
    newer than the one committed when the launcher first saw the drain commits; only then is it
    fenced and replaced by the spare, which resumes from that checkpoint (on the code before, it
    was fenced at the launcher's first sight of the drain, losing the steps since the last one)."""
    run = tmp_path / "run"
    job = submit(slurm_cluster, run, ADMIN_ARGS, nodes=4, sbatch_options=["--no-kill"], env=INALLOC_ENV)
    job.wait_for(lambda j: any(e.get("step") == 10 for e in job.events(["checkpoint_committed"])),
                 150, "checkpoint of step 10")
    job.wait_step(12, timeout=60)
    alloc = _allocation(run)
    victim, spare = alloc["active"][1], alloc["spares"][0]
    job.wait_for(lambda j: RunDir(run).alive(spare).exists(), 60, f"spare {spare}'s beat")
    job.client.drain(victim, ADMIN_REASON)

    final = job.wait_for(lambda j: j.state.finished, 300, "the job's end")
    assert final.state is JobState.COMPLETED and final.restart_count == 0, job.context()
    said = [line for line in job.log_text().splitlines()
            if f"an admin's drain: {victim} trains on until the next checkpoint commits" in line]
    assert len(said) == 1 and ADMIN_REASON in said[0], job.log_text()[-4000:]
    alloc = _allocation(run)
    assert [(f["node"], f["cause"]) for f in alloc["fenced"]] == [(victim, "node_drained")]
    assert victim not in alloc["active"] and spare in alloc["active"]
    [fault] = [e for e in job.events([journal.FAULT_DETECTED]) if e.get("where") == "allocation"]
    evidence = fault.get("evidence")[0]
    assert ADMIN_REASON in evidence and "committed after it was seen" in evidence, evidence
    step = int(evidence.split("checkpoint step ")[1].split()[0])
    # That checkpoint is newer than the drain (step 10 was committed before it) and was in the
    # journal before the fence; the spare's world resumed from it or a newer one.
    assert step > 10
    [commit] = [e for e in job.events(["checkpoint_committed"]) if e.get("step") == step]
    assert commit.time <= fault.time
    starts = job.events([journal.SEGMENT_START])
    assert len(starts) == 2 and all(e.get("world_size") == 3 for e in starts)
    assert starts[1].get("restored_step") >= step
    ref = reference_losses(tmp_path / "reference", ADMIN_ARGS, world_size=3)
    seen_losses = [(e.get("step"), e.get("loss"), e.get("samples")) for e in job.events(["loss"])]
    assert {s for s, _, _ in seen_losses} == set(ref)
    for step_, loss, samples in seen_losses:
        assert (loss, samples) == ref[step_], f"step {step_}"
