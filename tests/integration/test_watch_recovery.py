"""``slurmft watch`` on the devcluster, through the real template and examples/train_gpt.py:
each fault ends with the run training again from the newest valid checkpoint, the journal naming
the cause, and no human (or test) sending Slurm anything but the fault itself. The node death
and the hang are checked in the chaos demo's run (tests/integration/test_demo.py); a job that
completes under the watcher, untouched, in test_watch_healthy.py (each of its runs)."""

from __future__ import annotations

import time

import pytest

from slurmft import exitcodes
from slurmft.rundir import RunDir
from slurmft.slurm.client import JobState
from slurmft.watch import resubmit

from train_job_support import TEMPLATE, TINY_ARGS, kill_ranks, losses, submit
from watch_support import WatcherProc, events_until, observe_until, of

pytestmark = pytest.mark.integration

ARGS = [*TINY_ARGS, "--ckpt-every", "5", "--step-sleep", "0.1"]


def _committed(events) -> list[int]:
    return [e.get("step") for e in of(events, "checkpoint_committed")]


def _context(job, watcher):
    return lambda: f"--- job log\n{job.log_text()[-3000:]}\n--- watcher\n{watcher.text()[-3000:]}"


def _assert_resumed_from_newest(events) -> None:
    """The newest segment restored the newest checkpoint committed by the segments before it.

    A rank killed between a commit (the rename) and its journal line leaves a committed checkpoint
    the journal does not name: the restore may be newer than the newest journaled commit, never
    older, and never one the new segment wrote itself.
    """
    starts = of(events, "segment_start")
    assert len(starts) >= 2
    last = starts[-1]
    before = [e.get("step") for e in of(events, "checkpoint_committed")
              if e.get("restart_count") < last.get("restart_count")]
    since = [e.get("step") for e in of(events, "checkpoint_committed")
             if e.get("restart_count") >= last.get("restart_count")]
    restored = last.get("restored_step")
    assert restored is not None and restored >= max(before), (restored, before)
    assert all(step > restored for step in since), (restored, since)


@pytest.mark.timeout(240)
def test_crash_is_requeued_started_now_and_training_resumes(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    job = submit(slurm_cluster, run, [*ARGS, "--steps", "40"], nodes=1)  # one node: the crash is the watcher's to see
    client = job.client
    observe_until(client, job.job_id, lambda j: j.run_dir is not None, 60, "run dir comment",
                  context=job.log_text)
    prom = tmp_path / "watch.prom"
    watcher = WatcherProc(slurm_cluster, [job.job_id], tmp_path / "crash-watch.log",
                          "--textfile", str(prom), run_dir=run)
    ctx = _context(job, watcher)
    try:
        events_until(run, lambda ev: 10 in _committed(ev) and any(
            e.get("step", 0) >= 12 for e in of(ev, "loss")), 120, "step 12", context=ctx)
        assert kill_ranks(slurm_cluster, job.job_id) >= 1  # an ordinary crash: torchrun reports exit 1
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
        _assert_resumed_from_newest(events)
        metrics = prom.read_text()
        for line in (f'slurmft_watch_faults_total{{cause="crash",slurm_job="{job.job_id}",where="requeue"}} 1.0',
                     f'slurmft_watch_restarts_total{{cause="crash",slurm_job="{job.job_id}",where="requeue"}} 1.0',
                     "slurmft_watch_controller_reachable 1.0"):
            assert line in metrics, metrics
        assert of(events, "run_finished")
        steps = losses([e for e in events if e.kind == "loss" and e.get("restart_count") == 1])
        assert sorted(steps) == list(range(max(committed) + 1, 41))
        # Saved at first sight, should Slurm ever forget the job: its submit line and script.
        record = resubmit.load_record(RunDir(run))
        assert record is not None and record.job_id == job.job_id
        assert resubmit.saved_script(RunDir(run)) == TEMPLATE.read_bytes()
    finally:
        watcher.kill()


def _start(cluster, tmp_path, args, *, nodes, watch_args=(), watch_env=None, name="run", job_env=None):
    run = tmp_path / name
    job = submit(cluster, run, args, nodes=nodes, env=job_env)
    observe_until(job.client, job.job_id, lambda j: j.run_dir is not None, 60, "run dir comment",
                  context=job.log_text)
    watcher = WatcherProc(cluster, [job.job_id], tmp_path / f"{name}-watch.log", *watch_args,
                          env=watch_env, run_dir=run)
    return run, job, watcher


@pytest.mark.timeout(200)
def test_do_not_requeue_exit_gives_up_without_requeue(slurm_cluster, tmp_path):
    args = [*TINY_ARGS, "--steps", "16", "--ckpt-every", "5", "--inject-nan-at", "8",
            "--inject-nan-times", "99", "--guard-max-trips", "3"]
    # Two ranks (their guards agree on each verdict) on one node (issue 28: two nodes before).
    run, job, watcher = _start(slurm_cluster, tmp_path, args, nodes=1, name="no_requeue",
                               job_env={"SLURMFT_NPROC_PER_NODE": "2"})
    ctx = _context(job, watcher)
    try:
        assert watcher.wait(150) == 0, ctx()
        events = job.events()
        assert [e.get("cause") for e in of(events, "gave_up")] == ["no_requeue"]
        assert not of(events, "recovery_action", action="requeue")
        assert [e.get("exit_code") for e in of(events, "segment_end")] == [exitcodes.NO_REQUEUE]
        # The job's own side (test_train_job_faults.py's test_repeated_nans_end_the_job_with_do_not_requeue,
        # merged here, issue 28): the guard rolled back twice then gave up, the launcher said why.
        assert [(e.get("world_size"), e.get("num_nodes")) for e in of(events, "segment_start")] == [(2, 1)]
        assert [e.get("verdict") for e in of(events, "guard_trip")] == ["rollback", "rollback", "give_up"]
        assert "3 troubles" in of(events, "segment_end")[-1].get("reason")
        assert "NO_REQUEUE (86)" in job.log_text() and "asked not to be requeued" in job.log_text()
        held = job.client.job(job.job_id)   # given up: held in the queue (requeuehold), never run
        assert held.state is JobState.PENDING and held.reason in ("JobHeldUser", "JobHeldAdmin"), held
        # Never requeued to run again: the one segment, and the watcher's requeuehold (which
        # counts as a restart in Slurm's restart count) its only act.
        assert of(events, "gave_up")[0].get("held") is True and of(events, "gave_up")[0].get("restarts") == 0
        time.sleep(3)
        assert job.client.job(job.job_id).state is JobState.PENDING   # still held, not started
    finally:
        watcher.kill()
