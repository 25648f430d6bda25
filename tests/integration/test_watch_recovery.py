"""``slurmft watch`` on the devcluster, through the real template and examples/train_gpt.py:
each fault ends with the run training again from the newest valid checkpoint, the journal naming
the cause, and no human (or test) sending Slurm anything but the fault itself."""

from __future__ import annotations

import os
import signal
import time

import pytest

from slurmft import exitcodes
from slurmft.slurm.client import JobState

from train_job_support import TINY_ARGS, kill_ranks, losses, submit
from watch_support import WatcherProc, events_until, observe_until, of

pytestmark = pytest.mark.integration

ARGS = [*TINY_ARGS, "--ckpt-every", "5", "--step-sleep", "0.1"]


def _committed(events) -> list[int]:
    return [e.get("step") for e in of(events, "checkpoint_committed")]


def _context(job, watcher):
    return lambda: f"--- job log\n{job.log_text()[-3000:]}\n--- watcher\n{watcher.text()[-3000:]}"


def _assert_resumed_from_newest(events, before_fault: list[int]) -> None:
    starts = of(events, "segment_start")
    assert len(starts) >= 2
    assert starts[-1].get("restored_step") == max(before_fault)


@pytest.mark.timeout(240)
def test_crash_is_requeued_started_now_and_training_resumes(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    job = submit(slurm_cluster, run, [*ARGS, "--steps", "40"], nodes=2)
    client = job.client
    observe_until(client, job.job_id, lambda j: j.run_dir is not None, 60, "run dir comment",
                  context=job.log_text)
    watcher = WatcherProc(slurm_cluster, [job.job_id], tmp_path / "watch.log")
    ctx = _context(job, watcher)
    try:
        events_until(run, lambda ev: 10 in _committed(ev) and any(
            e.get("step", 0) >= 12 for e in of(ev, "loss")), 120, "step 12", context=ctx)
        assert kill_ranks(job.job_id) >= 2  # an ordinary crash: torchrun reports exit 1
        killed_at = time.time()
        committed = _committed(job.events())
        events = events_until(run, lambda ev: of(ev, "job_running"), 90, "job running again",
                              context=ctx)
        detected = of(events, "fault_detected")
        assert [e.get("cause") for e in detected] == ["crash"]
        actions = [(e.get("action"), e.get("ok")) for e in of(events, "recovery_action")]
        assert actions == [("requeue", True), ("start_now", True)]
        running = of(events, "job_running")[0]
        assert running.time - killed_at < 60
        final = observe_until(client, job.job_id, lambda j: j.state.finished, 150, "end", context=ctx)
        assert final.state is JobState.COMPLETED, ctx()
        assert watcher.wait(30) == 0, ctx()
        events = job.events()
        _assert_resumed_from_newest(events, committed)
        assert of(events, "run_finished")
        steps = losses([e for e in events if e.kind == "loss" and e.get("restart_count") == 1])
        assert sorted(steps) == list(range(max(committed) + 1, 41))
    finally:
        watcher.kill()
