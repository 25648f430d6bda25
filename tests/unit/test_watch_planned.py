"""Give-up rules judge faults and progress, never planned ends; a DONE marker without a job id
finishes nothing; an exit 87 blames no node (issue 25, items 2, 6 and 9)."""

from __future__ import annotations

import json

import pytest

from slurmft import exitcodes, journal
from slurmft.journal import Event, read_events
from slurmft.rundir import RunDir
from slurmft.slurm.client import JobState
from slurmft.watch import detect
from slurmft.watch.config import WatchConfig
from slurmft.watch.detect import Memory, RunObservation
from slurmft.watch.runview import JournalSummary, done_for

from test_watch_runwatch import NODES, T0, RecordingClient, job, journal_line, watcher


@pytest.fixture
def run(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    return rd


PLANNED_REASON = "training saved and asked to be requeued"


def _time_limit_end(rd, w, client, restart: int, now: float) -> None:
    """Segment ``restart`` saved on the time limit's signal and requeued itself; the watcher
    sees it PENDING, then running again."""
    journal_line(rd, journal.PREEMPTION, job_id="7", restart_count=restart, step=10 * restart, signal="USR2")
    journal_line(rd, journal.TEMPLATE, job_id="7", restart_count=restart, action="requeue",
                 reason=PLANNED_REASON)
    journal_line(rd, journal.SEGMENT_END, job_id="7", restart_count=restart, exit_code=85)
    w.step(job(JobState.PENDING, restart=restart + 1, nodes=()), NODES, now)
    w.step(job(restart=restart + 1), NODES, now + 5)


def test_planned_time_limit_ends_never_reach_a_restart_limit_or_a_crash_loop(run):
    # Limits of 2: on the old rules the third chunk was held. No checkpoint is journaled at all,
    # so a planned end cannot pass for progress either: planned ends are just not faults.
    client = RecordingClient()
    w = watcher(run, client, max_restarts=2, max_restarts_per_cause=2, crash_loop_restarts=2,
                start_now_delay_s=0)
    w.step(job(), NODES, T0)
    for restart in range(6):
        _time_limit_end(run, w, client, restart, T0 + 100 * (restart + 1))
    assert w.state.phase == "watching", w.state.reason
    assert [c[0] for c in client.calls] == ["start_now"] * 6  # helped to restart, never held
    kinds = {e.kind for e in read_events(run.events)}
    assert "fault_detected" not in kinds and "recovery_action" not in kinds and "gave_up" not in kinds
    planned = [e for e in read_events(run.events) if e.kind == journal.PLANNED_END]
    assert len(planned) == 6 and {e.get("cause") for e in planned} == {"preempted"}
    assert {e.get("action") for e in read_events(run.events, [journal.RESTART_ACTION])} == {"start_now"}
    assert all(e.get("planned") for e in read_events(run.events, [journal.JOB_RUNNING]))


def test_a_fault_after_many_planned_ends_is_recovered_not_over_max_restarts(run):
    client = RecordingClient()
    w = watcher(run, client, max_restarts=2, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    for restart in range(3):
        _time_limit_end(run, w, client, restart, T0 + 100 * (restart + 1))
    w.step(job(JobState.FAILED, restart=3, exit_code=1), NODES, T0 + 1000)
    assert client.calls[-1] == ("requeue", "7") and w.state.phase == "recovering"
    assert w.faults() == 1


def test_a_crash_loop_is_consecutive_faults_with_no_newer_checkpoint(run):
    client = RecordingClient()
    w = watcher(run, client, crash_loop_restarts=2, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    now, restart = T0, 0
    for commit in (10, 20, 30):  # progress between crashes: never a loop
        journal_line(run, journal.CHECKPOINT_COMMITTED, step=commit)
        now += 100
        w.step(job(JobState.FAILED, restart=restart, exit_code=1), NODES, now)
        restart += 1
        w.step(job(JobState.PENDING, restart=restart, nodes=()), NODES, now + 5)
        w.step(job(restart=restart), NODES, now + 10)
    assert w.state.phase == "watching"
    for _ in range(2):  # no newer checkpoint across two crashes: a loop
        now += 100
        w.step(job(JobState.FAILED, restart=restart, exit_code=1), NODES, now)
        restart += 1
        w.step(job(JobState.PENDING, restart=restart, nodes=()), NODES, now + 5)
        w.step(job(restart=restart), NODES, now + 10)
    w.step(job(JobState.FAILED, restart=restart, exit_code=1), NODES, now + 100)
    assert w.state.phase == "gave_up" and "crash loop" in (w.state.reason or "")


def _summary(*events: tuple[str, dict]) -> JournalSummary:
    summary = JournalSummary()
    for i, (kind, fields) in enumerate(events):
        summary.add(Event(kind, T0 + i, fields))
    return summary


def _requeued(summary: JournalSummary) -> detect.Finding | None:
    o = RunObservation("7", job(JobState.PENDING, restart=1, nodes=()), NODES, summary, {}, None, T0 + 50)
    return detect.detect_end(o, Memory(last_restart_count=0, last_nodes=("n1", "n2")))


def test_a_pre_flight_requeue_is_planned_and_a_rendezvous_failure_is_a_fault():
    preflight = _requeued(_summary(
        (journal.REQUEUE_REQUEST, {"job_id": "7", "restart_count": 0, "exclude": ["n2"],
                                   "reason": "pre-flight failed before rendezvous (no scontrol in the job)"}),
        (journal.TEMPLATE, {"job_id": "7", "restart_count": 0, "action": "requeue",
                            "reason": "pre-flight failed before rendezvous"})))
    assert preflight.cause == detect.PREFLIGHT and detect.planned(preflight.cause)
    assert preflight.nodes == ("n2",)
    port = _requeued(_summary((journal.TEMPLATE, {"job_id": "7", "restart_count": 0, "action": "requeue",
                                                  "reason": "no free rendezvous port on n1"})))
    assert port.cause == detect.REQUEUE_REQUEST and not detect.planned(port.cause)


def test_a_planned_end_the_launcher_could_not_requeue_is_still_planned():
    summary = _summary(
        (journal.PREEMPTION, {"job_id": "7", "restart_count": 0, "step": 5, "signal": "USR2"}),
        (journal.REQUEUE_REQUEST, {"job_id": "7", "restart_count": 0, "exclude": [],
                                   "reason": f"{PLANNED_REASON} (no scontrol in the job)"}),
        (journal.SEGMENT_END, {"job_id": "7", "restart_count": 0, "exit_code": 85}))
    o = RunObservation("7", job(JobState.FAILED, exit_code=85), NODES, summary, {}, None, T0 + 50)
    found = detect.detect_end(o, Memory(last_restart_count=0))
    assert found.cause == detect.PREEMPTED and found.action == detect.RECOVER


def test_a_done_marker_without_a_job_id_does_not_finish_a_later_job():
    assert not done_for({"step": 100, "total_steps": 100}, "7")
    assert not done_for({"job_id": None, "step": 100}, ["7"])
    assert done_for({"job_id": "7", "step": 100}, ["7", "7_1"])
    o = RunObservation("7", job(JobState.FAILED, exit_code=1), NODES, JournalSummary(), {},
                       {"step": 100, "total_steps": 100}, T0 + 50)
    found = detect.detect(o, Memory(last_restart_count=0), WatchConfig())
    assert found[0].cause == detect.CRASH and found[0].action == detect.RECOVER


def test_an_exit_87_blames_no_node_that_merely_did_not_journal_a_watchdog_hang():
    # n1's rank timed out first and exited 87; srun killed n2's ranks before their watchdogs fired.
    summary = _summary((journal.HANG, {"job_id": "7", "restart_count": 0, "node": "n1"}),
                       (journal.SEGMENT_END, {"job_id": "7", "restart_count": 0,
                                              "exit_code": exitcodes.HANG}))
    o = RunObservation("7", job(JobState.FAILED, exit_code=exitcodes.HANG), NODES, summary, {}, None, T0 + 50)
    found = detect.detect_end(o, Memory(last_restart_count=0, last_nodes=("n1", "n2")))
    assert found.cause == detect.HANG and found.nodes == ()
    stale = RunObservation("7", job(), NODES, summary, {}, None, T0 + 10_000)
    hang = detect.detect_hang(stale, Memory(beats_seen=True),
                              WatchConfig(hang_timeout_s=30, startup_grace_s=0))
    assert hang is not None and hang.nodes == ()


@pytest.mark.parametrize("reason", [
    # launch/main.py's two pre-flight requeues that exclude nothing
    "the pre-flight produced no verdict on any node (srun exit 1): srun: error: Invalid generic "
    "resource (gres) specification",
    "the pre-flight failed on every node: requeued without exclusions",
])
def test_a_pre_flight_requeue_that_excluded_nothing_is_bounded_like_a_fault(run, reason):
    # Nothing was excluded, so the next try meets the same: a planned end here never counted,
    # and the job went round the queue for ever with the watcher never holding it.
    client = RecordingClient()
    w = watcher(run, client, crash_loop_restarts=2, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    for restart in range(4):
        journal_line(run, journal.TEMPLATE, job_id="7", restart_count=restart, action="requeue",
                     reason=reason)
        journal_line(run, journal.SEGMENT_END, job_id="7", restart_count=restart, exit_code=85)
        w.step(job(JobState.PENDING, restart=restart + 1, nodes=()), NODES, T0 + 100 * restart + 50)
        if w.state.phase == "gave_up":
            break
        w.step(job(restart=restart + 1), NODES, T0 + 100 * restart + 60)
    assert w.state.phase == "gave_up" and "crash loop" in w.state.reason, w.state.reason
    assert not read_events(run.events, [journal.PLANNED_END])


def test_fault_restarts_that_follow_progress_never_reach_a_restart_limit(run):
    """Max restarts judge progress: a months-long run on many nodes sees more node faults than
    any cap, each after a newer checkpoint; it goes on. (It was held at the cap's count.)"""
    client = RecordingClient()
    w = watcher(run, client, max_restarts=2, max_restarts_per_cause=2, crash_loop_restarts=2,
                start_now_delay_s=0)
    w.step(job(), NODES, T0)
    for restart in range(8):
        now = T0 + 100 * (restart + 1)
        journal_line(run, journal.CHECKPOINT_COMMITTED, job_id="7", restart_count=restart,
                     step=100 * (restart + 1))
        w.step(job(JobState.PENDING, restart=restart + 1, nodes=()), NODES, now)  # requeued by Slurm
        w.step(job(restart=restart + 1), NODES, now + 5)
    assert w.state.phase == "watching", w.state.reason
    assert ("hold", "7") not in client.calls and w.state.stalled_by_cause == {}
    assert w.state.restarts_by_cause == {"requeued": 8}


def test_fault_restarts_without_progress_reach_max_restarts(run):
    client = RecordingClient()
    w = watcher(run, client, max_restarts=2, max_restarts_per_cause=10, crash_loop_restarts=10,
                start_now_delay_s=0)
    w.step(job(), NODES, T0)
    journal_line(run, journal.CHECKPOINT_COMMITTED, job_id="7", restart_count=0, step=50)
    for restart in range(3):
        now = T0 + 100 * (restart + 1)
        w.step(job(JobState.PENDING, restart=restart + 1, nodes=()), NODES, now)
        w.step(job(restart=restart + 1), NODES, now + 5)
    # The first restart followed a checkpoint (progress); the next two did not: the third stalled
    # one is over max_restarts = 2.
    assert w.state.stalled_by_cause == {"requeued": 2}
    w.step(job(JobState.PENDING, restart=4, nodes=()), NODES, T0 + 500)
    assert w.state.phase == "gave_up" and "max_restarts" in w.state.reason
    assert client.calls[-1] == ("hold", "7")


def test_stalled_restarts_are_kept_in_the_state_and_an_older_state_reads_as_none(run):
    from slurmft.watch.state import load_state, save_state
    from slurmft.watch.state import RunState
    save_state(run, RunState(job_id="7", stalled_by_cause={"crash": 2}))
    assert load_state(run, "7").stalled_by_cause == {"crash": 2}
    data = json.loads(run.watch_state.read_text())
    del data["stalled_by_cause"]
    run.watch_state.write_text(json.dumps(data))
    assert load_state(run, "7").stalled_by_cause == {}
