"""Planned ends are not faults (issue 25, item 2), on the devcluster with the real template, the
real example and the real ``slurmft watch``: a run cut twice in a row by its time limit's
warning signal (USR2 to the batch script, what ``--signal=B:USR2@...`` sends) saves, requeues
itself and finishes, with no ``fault_detected`` and no ``recovery_action``, under a watcher whose
restart limits are 1: planned ends count toward none of them (before, the second end was held).
Two ends in a row are enough to pass every limit of 1 (issue 28: three cost a third start-up and
proved nothing more)."""

from __future__ import annotations

import pytest

from slurmft.slurm.client import JobState

from train_job_support import TINY_ARGS, losses, submit
from watch_support import WatcherProc, events_until, of

pytestmark = pytest.mark.integration

STEPS = 40
ARGS = [*TINY_ARGS, "--steps", str(STEPS), "--ckpt-every", "10", "--step-sleep", "0.1"]
ENDS = 2  # one past every restart limit of the watcher below


@pytest.mark.timeout(420)
def test_planned_ends_in_a_row_are_restarts_never_faults(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    job = submit(slurm_cluster, run, ARGS, nodes=1)
    watcher = WatcherProc(slurm_cluster, [job.job_id], tmp_path / "watch.log", run_dir=run,
                          env={"SLURMFT_WATCH_MAX_RESTARTS": "1",
                               "SLURMFT_WATCH_MAX_RESTARTS_PER_CAUSE": "1",
                               "SLURMFT_WATCH_CRASH_LOOP_RESTARTS": "1"})

    def ctx() -> str:
        return job.context() + "\n--- watcher\n" + watcher.text()[-3000:]
    try:
        for end in range(ENDS):
            # Wait for this segment to train a step past its restore, then send the warning.
            events_until(run, lambda ev: any(e.get("restart_count") == end for e in of(ev, "loss")),
                         120, f"segment {end} training", context=ctx)
            job.client.cancel(job.job_id, signal="USR2", batch_only=True)
            events_until(run, lambda ev: len(of(ev, "planned_end")) == end + 1, 90,
                         f"planned end {end + 1} seen by the watcher", context=ctx)
        final = job.wait_finished(timeout=180)
        assert final.state is JobState.COMPLETED, ctx()
        assert watcher.wait(30) == 0, ctx()
    finally:
        watcher.kill()
    events = job.events()
    assert not of(events, "fault_detected") and not of(events, "recovery_action"), ctx()
    assert not of(events, "gave_up")
    assert [e.get("cause") for e in of(events, "planned_end")] == ["preempted"] * ENDS
    assert final.restart_count == ENDS and len(of(events, "preemption")) == ENDS
    assert [e.get("how") for e in of(events, "run_finished")] == ["finished"]
    assert sorted(losses(events)) == list(range(1, STEPS + 1))  # no step lost or repeated
