"""The README's adoption, proved under Slurm: a plain DDP loop in the style of public examples
(batches from an RNG, the next one prefetched: tests/helpers/plain_ddp_loop.py) adopted with the
documented seven-line change (examples/train_ddp_minimal.py), run by the real template on the
devcluster (two ranks on one node) with the real `slurmft watch`. It is preempted once (USR2:
emergency save, exit 85, the template requeues, the watcher starts it now) and crashed once
(kill -9 of every rank: the watcher requeues it), and every step it journals has the loss of an
uninterrupted run, bit for bit.
"""

from __future__ import annotations

import pytest

from slurmft import exitcodes
from slurmft.rundir import RunDir, read_done
from slurmft.slurm.client import JobState

from train_job_support import REPO, kill_ranks, reference_losses, submit
from watch_support import WatcherProc, events_until, observe_until, of

pytestmark = pytest.mark.integration

SCRIPT = REPO / "examples" / "train_ddp_minimal.py"
STEPS = 40
ARGS = ["--steps", str(STEPS), "--batch-size", "8", "--step-sleep", "0.1"]
ENV = {"SLURMFT_CHECKPOINT_INTERVAL": "5", "SLURMFT_LOOP_HEARTBEAT_INTERVAL_S": "0.5", "SLURMFT_LOOP_LOG_EVERY": "1"}


def _per_segment_losses(events) -> dict[int, dict[int, float]]:
    """restart count -> step -> loss; a step may repeat across segments (after a crash), never within one."""
    found: dict[int, dict[int, float]] = {}
    for event in of(events, "loss"):
        seg = found.setdefault(event.get("restart_count"), {})
        assert event.get("step") not in seg, f"step {event.get('step')} twice in one segment"
        seg[event.get("step")] = event.get("loss")
    return found


@pytest.mark.timeout(900)  # ~1.5 min quiet, a reference run and three start-ups; over 300 s at load 25
def test_adopted_plain_loop_survives_preemption_and_crash_bit_for_bit(slurm_cluster, tmp_path):
    reference = reference_losses(tmp_path / "reference", ARGS, world_size=2, script=SCRIPT, env=ENV)
    assert sorted(reference) == list(range(1, STEPS + 1))
    run = tmp_path / "run"
    # Two ranks on one node (issue 28: on two nodes before): the adoption is the loop's, and each
    # node of each of the three segments is a pre-flight and a torchrun importing torch.
    job = submit(slurm_cluster, run, ARGS, nodes=1, env={**ENV, "SLURMFT_NPROC_PER_NODE": "2"},
                 script=SCRIPT)
    client = job.client
    observe_until(client, job.job_id, lambda j: j.run_dir is not None, 60, "run dir comment",
                  context=job.log_text)
    watcher = WatcherProc(slurm_cluster, [job.job_id], tmp_path / "watch.log")
    ctx = lambda: f"--- job log\n{job.log_text()[-3000:]}\n--- watcher\n{watcher.text()[-3000:]}"  # noqa: E731
    try:
        events_until(run, lambda ev: any(e.get("step", 0) >= 8 for e in of(ev, "loss")), 90,
                     "step 8", context=ctx)
        client.cancel(job.job_id, signal="USR2", batch_only=True)  # what Slurm sends before a limit
        events = events_until(run, lambda ev: len(of(ev, "segment_start")) == 2, 90,
                              "the preempted job running again", context=ctx)
        preempted_at = of(events, "preemption")[0].get("step")
        events = events_until(run, lambda ev: any(
            e.get("restart_count") == 1 and e.get("step", 0) >= preempted_at + 7
            for e in of(ev, "checkpoint_committed")), 90, "a checkpoint after the resume", context=ctx)
        assert kill_ranks(slurm_cluster, job.job_id, SCRIPT) >= 2  # a crash: no handler, no emergency save
        committed = max(e.get("step") for e in of(job.events(), "checkpoint_committed"))
        events_until(run, lambda ev: len(of(ev, "job_running")) == 2, 90,
                     "the watcher starting the crashed job again", context=ctx)
        final = observe_until(client, job.job_id, lambda j: j.state.finished, 180, "end", context=ctx)
        assert final.state is JobState.COMPLETED, ctx()
        assert watcher.wait(30) == 0, ctx()
    finally:
        watcher.kill()
    events = job.events()
    assert [e.get("cause") for e in of(events, "planned_end")] == ["preempted"]  # no fault
    assert [e.get("cause") for e in of(events, "fault_detected")] == ["crash"]
    starts = of(events, "segment_start")
    # A kill between a commit and its journal line leaves a newer committed step than the journal
    # names: the restore is that one or the journaled one, never older, never one written later.
    assert [s.get("restored_step") for s in starts[:2]] == [None, preempted_at]
    restored = starts[2].get("restored_step")
    assert restored >= committed and all(e.get("step") > restored for e in of(events, "checkpoint_committed")
                                         if e.get("restart_count") == 2), (restored, committed)
    assert all(s.get("load_bytes") > 0 for s in starts[1:])
    assert all((s.get("world_size"), s.get("num_nodes")) == (2, 1) for s in starts)
    ends = [e.get("exit_code") for e in of(events, "segment_end")]
    assert ends == [exitcodes.REQUEUE, exitcodes.OK]  # the crashed segment wrote none
    segments = _per_segment_losses(events)
    assert sorted(segments) == [0, 1, 2]
    assert max(segments[0]) == preempted_at and min(segments[1]) == preempted_at + 1
    # From the restored step, not the journaled one: s24f (two busy processes beside the suite)
    # killed the ranks between step 25's commit and its journal line and resumed at 26.
    assert min(segments[2]) == restored + 1 and max(segments[2]) == STEPS
    for restart, steps in segments.items():
        for step, loss in steps.items():
            assert loss == reference[step][0], (restart, step, loss, reference[step])
    done = read_done(RunDir(run))
    assert (done.job_id, done.step, done.total_steps) == (job.job_id, STEPS, STEPS)
