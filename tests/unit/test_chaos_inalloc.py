"""``slurmft.chaos.drive.ChaosRun.inject`` on a recovery inside the allocation (issue 27): the
journal written the way the launcher (``slurmft.launch.journaling.Voice``) and the ranks
(``slurmft.journal.Journal`` with torchrun's attempt) write it, and ``allocation.json`` by
``slurmft.allocation.write``. The next segment is the next attempt of the same restart count;
"running again" is its start; the fenced node counts as excluded; the nodes are the active ones.
(The chaos demo's and the soak's devcluster runs drive the real thing.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft import allocation, journal
from slurmft.chaos import faults
from slurmft.chaos.drive import ChaosError, ChaosRun, outcome_problems
from slurmft.chaos.faults import Fault, Target
from slurmft.journal import Journal
from slurmft.launch import identity
from slurmft.launch.journaling import Voice
from slurmft.rundir import RunDir

ENV = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_NUM_NODES": "4",
       "SLURM_RESTART_COUNT": "0"}


def ranks(run: RunDir, attempt: int) -> Journal:
    return Journal(run, job_id="7", restart_count=0, attempt=attempt, buffered_kinds=())


def write_alloc(run: RunDir, generation: int, active: list[str], spares: list[str],
                fenced: list[str] = ()) -> None:
    allocation.write(run, allocation.Allocation(
        job_id="7", generation=generation, active=tuple(active), spares=tuple(spares),
        fenced=tuple(allocation.Fence(n, "node_death", 1.0, ("silent",)) for n in fenced),
        min_nodes=3))


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    write_alloc(run, 0, ["n1", "n2", "n3"], ["n4"])
    first = ranks(run, 0)
    first.append(journal.SEGMENT_START, world_size=3, restored_step=None)
    for step in range(1, 13):
        first.append(journal.LOSS, step=step, loss=1.0)
    (run.checkpoints / "step_000000010").mkdir(parents=True)
    return run


def spare_takes_over(run: RunDir, *, active_after: list[str], attempt: int = 1) -> Fault:
    voice = Voice(identity.from_environ(ENV), run.root)

    def inject(target: Target) -> str:
        target.victim = "n3"
        write_alloc(run, 1, active_after, [], fenced=["n3"])
        voice.event(journal.FAULT_DETECTED, where="allocation", cause="node_death", nodes=["n3"],
                    evidence=["its training step ended"], fault_time=0.0, detected_by="launcher")
        voice.event(journal.RECOVERY_ACTION, where="allocation", action="replace_node",
                    nodes=["n3"], spare="n4", world_nodes=3, generation=1, cause="node_death",
                    ok=True)
        again = ranks(run, attempt)
        again.append(journal.SEGMENT_START, world_size=3, restored_step=10)
        again.append(journal.LOSS, step=11, loss=1.0)
        return "node n3 died"
    return Fault("node death", faults.NODE_DEATH.causes, inject)


def chaos(run: RunDir) -> ChaosRun:
    target = Target(cluster=None, client=None, job_id="7", run_dir=run,  # type: ignore[arg-type]
                    script=Path("train.py"), work_dir=run.root)
    return ChaosRun(target, alive=lambda: None)


def test_a_spare_taking_over_is_an_in_allocation_recovery_with_nothing_wrong(run):
    outcome = chaos(run).inject(spare_takes_over(run, active_after=["n1", "n2", "n4"]), timeout=5)
    assert outcome.where == "allocation"
    assert (outcome.detected_as, outcome.expected) == ("node_death", True)
    assert (outcome.resumed_step, outcome.world_size, outcome.last_step) == (10, 3, 12)
    assert outcome.running_s is not None and 0 <= outcome.running_s <= outcome.back_s
    assert outcome.excluded == ["n3"] and outcome.nodes == ["n1", "n2", "n4"]
    assert outcome_problems(outcome) == []


def test_the_fenced_node_still_active_is_reported(run):
    outcome = chaos(run).inject(spare_takes_over(run, active_after=["n1", "n2", "n3"]), timeout=5)
    assert outcome_problems(outcome) == ["running again on n3, the node the fault hit"]


def test_no_new_attempt_is_no_recovery(run):
    def nothing(target: Target) -> str:
        ranks(run, 0).append(journal.LOSS, step=13, loss=1.0)  # the old attempt goes on
        return "nothing"
    with pytest.raises(ChaosError, match="training back after the node death"):
        chaos(run).inject(Fault("node death", faults.NODE_DEATH.causes, nothing), timeout=1)


def test_a_new_segment_that_journals_the_old_key_is_found_by_its_time(run):
    # measured on the devcluster (SlurmdTimeout 120): the segment after a spare took over
    # journaled attempt 0, the key of the segment before it
    outcome = chaos(run).inject(spare_takes_over(run, active_after=["n1", "n2", "n4"], attempt=0),
                                timeout=5)
    assert (outcome.where, outcome.resumed_step, outcome.last_step) == ("allocation", 10, 12)
    assert outcome_problems(outcome) == []


def test_a_node_fault_in_the_allocation_hits_a_training_node_never_the_batch_host_or_a_spare(run):
    """The soak's node death and failing health check hit a training node other than the batch
    host (whose loss is the requeue path's) and never a spare; outside the mode, the job's last
    node. The job as Slurm reports it: nodes n[1-4], batch host n1."""
    from slurmft.slurm.client import Job, JobState

    class Client:
        def job(self, job_id):
            return Job(job_id=job_id, name="train", state=JobState.RUNNING,
                       nodes=("n1", "n2", "n3", "n4"), node_count=4, batch_host="n1")
    target = Target(cluster=None, client=Client(), job_id="7", run_dir=run,  # type: ignore[arg-type]
                    script=Path("train.py"), work_dir=run.root)
    assert faults.training_victim(target) == "n3"
    write_alloc(run, 1, ["n1", "n2", "n4"], [], fenced=["n3"])
    assert faults.training_victim(target) == "n4"
    # A spare job's node (SLURMFT_SPARE_REFILL=1) that took a place trains though Slurm does not
    # list it among the job's nodes (the soak of 2026-11-28 killed fenced n4 instead, and waited).
    allocation.write(run, allocation.Allocation(
        job_id="7", generation=2, active=("n1", "n2", "n9"), fenced=(
            allocation.Fence("n3", "node_death", 1.0), allocation.Fence("n4", "node_death", 2.0)),
        spare_jobs=(allocation.SpareJob("8", "n9"),)))
    assert faults.training_victim(target) == "n9"
    run.allocation.unlink()
    assert faults.training_victim(target) == "n4"
