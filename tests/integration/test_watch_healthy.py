"""Healthy runs that are slow in the ways real ones are, under the real ``slurmft watch`` with its
default hang settings (issue 25): nothing is detected, nothing is done to them. The template runs
examples/train_gpt.py with its default heartbeat cadence; slow steps come from the example's
``--step-sleep``, a slow save and a slow load from the checkpoint manager's slow-storage knob for
tests (``SLURMFT_CKPT_FAULT_SLOW``: a sleep at that phase of that step, on every rank). The watcher
polls every second (``WatcherProc``): more chances to misjudge, not fewer.

One run pays for all of it (issue 28 merged two tests that each started a 2-node job under the
watcher: test_steps_of_several_seconds_with_the_default_heartbeat_cadence_are_left_alone and
test_a_save_and_a_load_longer_than_hang_min_s_are_waited_for, every assertion of both kept): 20
slow steps with nothing else beating, then a rollback whose load is slow, then a slow final save.
It is also the suite's plain completing job under the watcher (test_watch_recovery.py's
test_a_job_that_completes_is_never_requeued, merged into ``_finished_untouched``) and its NaN
rollback (test_train_job_faults.py's test_one_nan_rolls_back_and_training_continues, merged: the
same guard trip, rollback and replayed step)."""

from __future__ import annotations

import pytest

from slurmft.rundir import RunDir, read_json
from slurmft.slurm.client import JobState

from train_job_support import submit
from watch_support import WatcherProc, observe_until, of

pytestmark = pytest.mark.integration

# The example at its defaults but for size: no --heartbeat-interval (10 s by default).
SMALL = ["--tiny", "--global-batch", "12"]
HANG_MIN_S = 60.0  # [watch] hang_min_s's default, which a blocking phase here outlasts
STEPS = 22


def _start(cluster, tmp_path, args, name, env=None):
    run = tmp_path / name
    job = submit(cluster, run, args, nodes=2, env=env)
    observe_until(job.client, job.job_id, lambda j: j.run_dir is not None, 120, "run dir comment",
                  context=job.log_text)
    watcher = WatcherProc(cluster, [job.job_id], tmp_path / f"{name}-watch.log", run_dir=run)
    context = lambda: f"--- job log\n{job.log_text()[-3000:]}\n--- watcher\n{watcher.text()[-3000:]}"  # noqa: E731
    return run, job, watcher, context


def _finished_untouched(job, watcher, context, timeout: float):
    assert watcher.wait(timeout) == 0, context()
    final = job.client.job(job.job_id)
    assert final.state is JobState.COMPLETED and final.restart_count == 0, (final, context())
    events = job.events()
    assert not of(events, "fault_detected") and not of(events, "recovery_action"), context()
    assert [e.get("how") for e in of(events, "run_finished")] == ["finished"], context()
    assert "finished" in watcher.text()
    return events


@pytest.mark.mostly_waits  # ~300 s of sleeping steps, load and save, ~25 CPU-s
@pytest.mark.timeout(900)
def test_slow_steps_a_slow_load_and_a_slow_save_with_the_default_heartbeat_cadence_are_waited_for(
        slurm_cluster, tmp_path):
    # 6.5 s steps: the old cadence (a beat every 10 steps, the first without a step time) called
    # this run hung 61 s after its first beat, 131 s in, before the second beat at 130 s + load;
    # nothing else beats before step 20 (the first checkpoint). A NaN at step 22 rolls back to
    # step 20, whose load takes 65 s; the final save (blocking, the job ends with it) takes 65 s.
    # Both announce themselves in the heartbeat with their bound.
    args = [*SMALL, "--steps", str(STEPS), "--ckpt-every", "20", "--step-sleep", "6.5",
            "--inject-nan-at", "22"]
    slow = {"SLURMFT_CKPT_FAULT_SLOW": f"load@20=65,write@{STEPS}=65"}
    run, job, watcher, context = _start(slurm_cluster, tmp_path, args, "slow", env=slow)
    try:
        events = _finished_untouched(job, watcher, context, 780)
        beats = [read_json(p) for p in sorted(RunDir(run).heartbeat_dir.glob("*.json"))]
        assert len(beats) == 2 and all(b["interval_s"] == 10 and b["last_step_s"] >= 6.5 for b in beats), beats
        trip, = of(events, "guard_trip")
        rollback, = of(events, "rollback")
        assert (trip.get("step"), trip.get("verdict")) == (22, "rollback"), context()
        assert "non-finite loss" in trip.get("reason")
        assert (rollback.get("from_step"), rollback.get("to_step")) == (22, 20), context()
        assert rollback.time - trip.time > HANG_MIN_S, context()
        # Step 21 redone after the rollback to 20, every other step once, training on to the end.
        assert [e.get("step") for e in of(events, "loss")] == [*range(1, 22), 21, 22], context()
        final = [e for e in of(events, "checkpoint_committed") if e.get("step") == STEPS]
        assert final and final[0].get("total_s") > HANG_MIN_S, context()
        last_step = [e for e in of(events, "loss") if e.get("step") == STEPS][-1]
        end, = of(events, "segment_end")
        assert end.time - last_step.time > HANG_MIN_S, context()  # the loop waited on the save
    finally:
        watcher.kill()
