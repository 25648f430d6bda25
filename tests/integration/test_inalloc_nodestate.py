"""Nodes drained while their tasks still beat, on the real devcluster (issue 27): one 2-active +
2-spare ``sbatch --no-kill`` job with the real ``slurmft watch`` beside it. The launcher learns
each drain from Slurm (``launch/nodestate.py``) and replaces the node with a spare inside the
allocation; the watcher leaves both to the launcher:

- the health sweeper's drain of the active non-batch node: fenced at once, the first spare goes on;
- then an admin's drain (maintenance) of that spare, now active: it trains on until a checkpoint
  newer than the one committed when the launcher first saw the drain commits; only then is it
  fenced, and the second spare resumes from that checkpoint (on the code before, it was fenced at
  the launcher's first sight of the drain, losing the steps since the last one).

The job never leaves RUNNING, is never requeued, and every step's loss equals an uninterrupted
run's bit for bit. Issue 28 merged the two tests that each started a 3 + 1 job for one drain,
test_a_node_the_sweeper_drains_is_replaced_by_the_spare_and_the_watcher_leaves_it and
test_an_admins_drain_is_fenced_after_the_next_checkpoint_and_the_spare_goes_on_from_it, into this
one job (every assertion of both kept)."""

from __future__ import annotations

import json

import pytest

from slurmft import journal
from slurmft.rundir import RunDir
from slurmft.slurm.client import JobState

from train_job_support import TINY_ARGS, reference_losses, submit

pytestmark = pytest.mark.integration

# The first drain comes at step 12, the second a checkpoint later: the steps after each must
# outlast the launcher's next answer from Slurm (SLURMFT_NODE_POLL_S) on a busy machine, or the
# run ends before anything is fenced (a CI run at 40 steps and the default 10 s poll did just that).
ARGS = [*TINY_ARGS, "--steps", "80", "--ckpt-every", "5", "--step-sleep", "0.2"]
INALLOC_ENV = {"SLURMFT_NODE_SILENT_S": "4", "SLURMFT_PG_TIMEOUT_S": "60",
               "SLURMFT_SPARE_NODES": "2", "SLURMFT_NODE_POLL_S": "2"}
# What the sweeper writes (``slurmft: <check>: <detail>``, docs/sweeper.md).
REASON = "slurmft: external_site: ERROR: site check: /scratch is read-only"
# An admin's drain (any reason but the sweeper's): maintenance, "finish what runs".
ADMIN_REASON = "maintenance: DIMM replacement, ticket 4711"


def _allocation(run) -> dict:
    return json.loads(RunDir(run).allocation.read_text())


def _in_allocation(job, kind: str) -> list:
    return [e for e in job.events([kind]) if e.get("where") == "allocation"]


@pytest.mark.timeout(600)
def test_a_sweepers_drain_is_replaced_at_once_an_admins_after_the_next_checkpoint_and_the_watcher_leaves_both(
        slurm_cluster, tmp_path):
    run = tmp_path / "run"
    job = submit(slurm_cluster, run, ARGS, nodes=4, sbatch_options=["--no-kill"], env=INALLOC_ENV)
    job.watch(slurm_cluster)
    job.wait_for(lambda j: any(e.get("step") == 10 for e in job.events(["checkpoint_committed"])),
                 150, "checkpoint of step 10")
    job.wait_step(12, timeout=60)
    alloc = _allocation(run)
    batch, victim, (first, second) = alloc["active"][0], alloc["active"][1], alloc["spares"]
    for spare in (first, second):
        job.wait_for(lambda j, s=spare: RunDir(run).alive(s).exists(), 60, f"spare {spare}'s beat")

    seen: list[JobState] = []

    def watch_state(j) -> None:
        if not seen or seen[-1] is not j.state:
            seen.append(j.state)

    # The sweeper's drain: the first spare takes the victim's place at once.
    job.client.drain(victim, REASON)
    job.wait_for(lambda j: watch_state(j) or _in_allocation(job, journal.RECOVERY_ACTION)
                 or j.state.finished, 200, f"the fence of {victim}")
    [replaced] = _in_allocation(job, journal.RECOVERY_ACTION)
    # Then an admin's drain of that spare, once its world committed a checkpoint.
    job.wait_for(lambda j: watch_state(j) or any(e.time > replaced.time for e in job.events(["checkpoint_committed"]))
                 or j.state.finished, 200, "a checkpoint of the world with the first spare")
    drained_after = max(RunDir(run).committed_steps())
    job.client.drain(first, ADMIN_REASON)

    final = job.wait_for(lambda j: watch_state(j) or j.state.finished, 300, "the job's end")
    assert seen[0] is JobState.RUNNING and final.state is JobState.COMPLETED, job.context()
    assert set(seen) == {JobState.RUNNING, JobState.COMPLETED} and final.restart_count == 0

    alloc = _allocation(run)
    assert [(f["node"], f["cause"]) for f in alloc["fenced"]] == \
        [(victim, "node_unhealthy"), (first, "node_drained")]
    assert alloc["active"] == [batch, second] and alloc["spares"] == [], alloc
    faults = _in_allocation(job, journal.FAULT_DETECTED)
    assert [(e.get("cause"), e.get("nodes")) for e in faults] == \
        [("node_unhealthy", [victim]), ("node_drained", [first])]
    assert REASON in faults[0].get("evidence")[0]
    actions = _in_allocation(job, journal.RECOVERY_ACTION)
    assert [(a.get("action"), a.get("nodes"), a.get("spare")) for a in actions] == \
        [("replace_node", [victim], first), ("replace_node", [first], second)]
    # The watcher journaled no fault and no action of its own: the launcher's to handle.
    own = [e for e in job.events([journal.FAULT_DETECTED, journal.RECOVERY_ACTION])
           if not journal.in_allocation(e)]
    assert own == [], own

    # The admin's drain: said once, then fenced only after a checkpoint newer than the one
    # committed when it was seen, which was in the journal before the fence.
    said = [line for line in job.log_text().splitlines()
            if f"an admin's drain: {first} trains on until the next checkpoint commits" in line]
    assert len(said) == 1 and ADMIN_REASON in said[0], job.log_text()[-4000:]
    evidence = faults[1].get("evidence")[0]
    assert ADMIN_REASON in evidence and "committed after it was seen" in evidence, evidence
    step = int(evidence.split("checkpoint step ")[1].split()[0])
    assert step > drained_after
    [commit] = [e for e in job.events(["checkpoint_committed"]) if e.get("step") == step]
    assert commit.time <= faults[1].time

    # Each fenced node's torchrun agent left the rendezvous by itself (rdzv_leave) instead of
    # holding the next round until its keep-alive expired, and its step ended with it (89).
    log = job.log_text().splitlines()
    for node in (victim, first):
        assert any(f"{node} is fenced by the launcher (" in line and "): left the rendezvous" in line
                   for line in log), node
        assert any(f"the fenced {node}'s agent left the rendezvous and its step ended" in line
                   for line in log), node

    starts = job.events([journal.SEGMENT_START])
    assert len(starts) == 3 and all(e.get("world_size") == 2 for e in starts)
    assert starts[1].get("restored_step") >= 10 and starts[2].get("restored_step") >= step
    ref = reference_losses(tmp_path / "reference", ARGS, world_size=2)
    seen_losses = [(e.get("step"), e.get("loss"), e.get("samples")) for e in job.events(["loss"])]
    assert {s for s, _, _ in seen_losses} == set(ref)
    for step_, loss, samples in seen_losses:
        assert (loss, samples) == ref[step_], f"step {step_}"
