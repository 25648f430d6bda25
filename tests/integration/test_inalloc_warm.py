"""Warm workers on the real devcluster (issue 27, ``SLURMFT_WARM_WORKERS=1``): the spare case of
``test_inalloc.py`` with every rank forked from its node's warm server, at the start and after
the fence, and still bit-identical to an uninterrupted (cold) run."""

from __future__ import annotations

import re

import pytest

from slurmft import journal
from test_inalloc import ARGS, INALLOC_ENV, _allocation, _kill_when_ready, _wait_running_until_end
from train_job_support import kill_ranks, reference_losses, submit

from slurmft.slurm.client import JobState

pytestmark = pytest.mark.integration

# examples/train_gpt.py's imports, pre-imported by each node's server
WARM_ENV = {"SLURMFT_WARM_WORKERS": "1",
            "SLURMFT_WARM_IMPORTS": "torch.nn,torch.nn.functional,torch.distributed.fsdp,slurmft.train"}
FORKED = re.compile(r"slurmft warm server\[\d+\]: rank (\d+) \(attempt (\d+)\) forked warm as pid")


@pytest.mark.timeout(420)
def test_a_spare_replaces_a_killed_node_with_warm_workers(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    job = submit(slurm_cluster, run, ARGS, nodes=4, sbatch_options=["--no-kill"],
                 env={**INALLOC_ENV, **WARM_ENV, "SLURMFT_SPARE_NODES": "1"})
    victim, committed = _kill_when_ready(slurm_cluster, job, run, spares=1)
    states = _wait_running_until_end(job, timeout=300)
    assert states == [JobState.RUNNING, JobState.COMPLETED], job.context()

    alloc = _allocation(run)
    actions = [e for e in job.events([journal.RECOVERY_ACTION]) if e.get("where") == "allocation"]
    assert [(a.get("action"), a.get("nodes")) for a in actions] == [("replace_node", [victim])]
    assert victim not in alloc["active"] and len(alloc["active"]) == 3
    starts = job.events([journal.SEGMENT_START])
    after = [e for e in starts if e.time > actions[0].time]
    assert after and after[-1].get("restored_step") >= committed

    # Every rank of both worlds was forked by a warm server, none started cold.
    log = job.log_text()
    forked = {(int(r), int(a)) for r, a in FORKED.findall(log)}
    assert {(r, 0) for r in range(3)} <= forked, log[-4000:]
    assert any(a >= 1 for _, a in forked), log[-4000:]     # the new world's ranks too
    assert "starting this rank cold" not in log and "no warm workers" not in log

    ref = reference_losses(tmp_path / "reference", ARGS, world_size=3)
    seen = [(e.get("step"), e.get("loss"), e.get("samples")) for e in job.events(["loss"])]
    assert {s for s, _, _ in seen} == set(ref)
    for step, loss, samples in seen:
        assert (loss, samples) == ref[step], f"step {step}"


@pytest.mark.timeout(420)
def test_a_warm_rank_killed_9_is_restarted_in_place(slurm_cluster, tmp_path):
    """The client of a rank on a healthy node killed -9 (what a tool that finds the rank by its
    command line kills): its worker dies with it, torchrun sees a crashed rank, and the launcher
    restarts the world in place, warm again, bit-identical."""
    run = tmp_path / "run"
    job = submit(slurm_cluster, run, ARGS, nodes=4, sbatch_options=["--no-kill"],
                 env={**INALLOC_ENV, **WARM_ENV, "SLURMFT_SPARE_NODES": "1"})
    job.wait_for(lambda j: any(e.get("step") == 10 for e in job.events(["checkpoint_committed"])),
                 150, "checkpoint of step 10")
    job.wait_step(12, timeout=60)
    node = _allocation(run)["active"][1]
    assert kill_ranks(slurm_cluster, job.job_id, node=node) == 1

    states = _wait_running_until_end(job, timeout=300)
    assert states == [JobState.RUNNING, JobState.COMPLETED], job.context()
    actions = [e for e in job.events([journal.RECOVERY_ACTION]) if e.get("where") == "allocation"]
    assert [a.get("action") for a in actions] == ["restart_in_place"]
    starts = job.events([journal.SEGMENT_START])
    assert len(starts) == 2 and starts[1].get("restored_step") >= 10
    log = job.log_text()
    assert {a for _, a in FORKED.findall(log)} >= {"0", "1"}, log[-4000:]
    assert "starting this rank cold" not in log
    ref = reference_losses(tmp_path / "reference", ARGS, world_size=3)
    seen = [(e.get("step"), e.get("loss"), e.get("samples")) for e in job.events(["loss"])]
    assert {s for s, _, _ in seen} == set(ref)
    assert all((loss, samples) == ref[step] for step, loss, samples in seen)
