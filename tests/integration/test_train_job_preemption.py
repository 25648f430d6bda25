"""Jobs that survive preemption and time limits: the real template, the real example, real Slurm.

Every run here is checked against the journal: each step's loss journaled exactly once (no step
lost or repeated), and — same world size — equal, bit for bit, to an uninterrupted run's.
"""

from __future__ import annotations

import pytest

from slurmft import exitcodes
from slurmft.slurm.client import JobState

from train_job_support import TINY_ARGS, losses, reference_losses, submit

pytestmark = pytest.mark.integration

STEPS = 40
ARGS = [*TINY_ARGS, "--steps", str(STEPS), "--ckpt-every", "10", "--step-sleep", "0.1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses of the same run on 2 ranks that nobody interrupts."""
    return reference_losses(tmp_path_factory.mktemp("reference") / "run", ARGS, world_size=2)


def _preemptions(job):
    return [e.get("step") for e in job.events(["preemption"])]


@pytest.mark.timeout(600)  # with the module's reference run (its first user pays for it): 3 segments' start-ups
def test_usr2_twice_requeues_and_resumes_bit_for_bit(slurm_cluster, tmp_path, reference):
    job = submit(slurm_cluster, tmp_path / "run", ARGS, nodes=2, watch=True)
    for at_step in (8, 22):
        # Each wait includes a segment's start-up (pre-flight, torchrun, the ranks' imports): over
        # 56 s at load 22 (a fresh-clone run beside four engineers' tests), the step never came.
        job.wait_step(at_step, timeout=240)
        job.client.cancel(job.job_id, signal="USR2", batch_only=True)
        job.wait_for(lambda j: len(_preemptions(job)) == (1 if at_step == 8 else 2), 120, "preemption")
    final = job.wait_finished(timeout=240)
    assert final.state is JobState.COMPLETED, job.log_text()[-4000:]
    assert final.restart_count == 2
    assert final.run_dir == tmp_path / "run"  # the template put it in the job comment for the watcher
    assert (tmp_path / "run" / "DONE").exists()
    got = losses(job.events())
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == reference
    stops = _preemptions(job)
    starts = [e.get("restored_step") for e in job.events(["segment_start"])]
    assert starts == [None, *stops]  # each segment resumed exactly at the emergency checkpoint
    ends = [e.get("exit_code") for e in job.events(["segment_end"])]
    assert ends == [exitcodes.REQUEUE, exitcodes.REQUEUE, exitcodes.OK]
    beats = sorted(p.stem for p in (tmp_path / "run" / "heartbeat").glob("*.json"))
    assert len(beats) == 2 and all(name in slurm_cluster.node_names for name in beats)


@pytest.mark.timeout(1100)
def test_time_limit_signal_saves_requeues_and_finishes(slurm_cluster, tmp_path, reference):
    # USR2 60 s before a 3 min limit: Slurm sends it at its next periodic limit check, 120-150 s
    # after the start. 40 steps x 4 s outlast that window on a quiet box, so at least one segment
    # is cut short, and a segment that starts up in 80 s (load 27: a fresh-clone run beside five
    # engineers' tests) still trains 40 s. With a 2 min limit and USR2@60 a start-up over 60 s
    # left no training before the signal: every segment was requeued without a step, and the test
    # made no progress until its timeout (it failed so at load 27).
    job = submit(slurm_cluster, tmp_path / "run", [*ARGS[:-1], "4.0"], nodes=2, watch=True,
                 sbatch_options=["--time=3", "--signal=B:USR2@60"])
    final = job.wait_finished(timeout=1000)
    assert final.state is JobState.COMPLETED, job.log_text()[-4000:]
    assert final.restart_count >= 1 and _preemptions(job)
    got = losses(job.events())
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == reference
