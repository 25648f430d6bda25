"""Jobs that survive preemption and time limits: the real template, the real example, real Slurm.

Every run here is checked against the journal: each step's loss journaled exactly once (no step
lost or repeated), and — same world size — equal, bit for bit, to an uninterrupted run's.

One job pays for both kinds of USR2 to the batch script (issue 28 merged
test_usr2_twice_requeues_and_resumes_bit_for_bit into the time-limit test, whose job was there
anyway): one sent by hand, what an admin's or a preempting job's ``scancel --signal`` sends, and
then Slurm's own ``--signal=B:USR2@60``, which the resumed segment cannot outlast.
"""

from __future__ import annotations

import pytest

from slurmft import exitcodes
from slurmft.slurm.client import JobState

from train_job_support import TINY_ARGS, losses, reference_losses, submit

pytestmark = pytest.mark.integration

STEPS = 40
# 3.5 s steps (a sleep: the losses are those of the uninterrupted run, made without it).
ARGS = [*TINY_ARGS, "--steps", str(STEPS), "--ckpt-every", "10", "--step-sleep", "3.5"]
BY_HAND_AT = 3  # the step after which the test sends USR2 itself


def _preemptions(job):
    return job.events(["preemption"])


@pytest.mark.mostly_waits  # ~220 s of 3.5 s step sleeps and Slurm's signal window, ~65 CPU-s
@pytest.mark.timeout(1200)
def test_usr2_by_hand_then_the_time_limit_signal_save_requeue_and_resume_bit_for_bit(slurm_cluster, tmp_path):
    # USR2 60 s before a 3 min limit, which Slurm may send up to 60 s early (sbatch(1) --signal:
    # the resolution of its event handling): 60-120 s after a segment's start (measured: 93-98 s
    # at load 27). A segment that starts up in 55 s (load 27) still trains before it. With a 2 min
    # limit and USR2@60 a start-up over 60 s left no training before the signal: every segment
    # was requeued without a step, and the test made no progress until its timeout (it failed so
    # at load 27). The first segment is preempted by hand at step 3, long before its limit. The
    # 37 steps x 3.5 s left (130 s) outlast the next segment's window (at most 120 s, its
    # start-up inside it), so Slurm's own signal cuts at least one segment short.
    run = tmp_path / "run"
    job = submit(slurm_cluster, run, ARGS, nodes=2, watch=True,
                 sbatch_options=["--time=3", "--signal=B:USR2@60"])
    # Each wait includes a segment's start-up (pre-flight, torchrun, the ranks' imports): over
    # 56 s at load 22 (a fresh-clone run beside four engineers' tests).
    job.wait_step(BY_HAND_AT, timeout=240)
    by_hand = job.events(["loss"])[-1].get("restart_count")  # the segment the test signals
    job.client.cancel(job.job_id, signal="USR2", batch_only=True)
    job.wait_for(lambda j: _preemptions(job), 120, "the preemption by hand")
    # The uninterrupted run, made while the job's next segment starts up and sleeps through its
    # steps: not before it, on the job's time.
    reference = reference_losses(tmp_path / "reference", ARGS, world_size=2)
    final = job.wait_finished(timeout=1000)
    assert final.state is JobState.COMPLETED, job.context()
    preempted = _preemptions(job)
    assert final.restart_count == len(preempted) >= 2, job.context()
    # Slurm's signal: a preemption in a segment after the one the test signalled.
    assert any(e.get("restart_count") > by_hand for e in preempted), [e.fields for e in preempted]
    assert final.run_dir == run  # the template put it in the job comment for the watcher
    assert (run / "DONE").exists()
    got = losses(job.events())
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == reference
    stops = [e.get("step") for e in preempted]
    starts = [e.get("restored_step") for e in job.events(["segment_start"])]
    assert starts == [None, *stops]  # each segment resumed exactly at the emergency checkpoint
    ends = [e.get("exit_code") for e in job.events(["segment_end"])]
    assert ends == [exitcodes.REQUEUE] * len(stops) + [exitcodes.OK]
    beats = sorted(p.stem for p in (run / "heartbeat").glob("*.json"))
    assert len(beats) == 2 and all(name in slurm_cluster.node_names for name in beats)
