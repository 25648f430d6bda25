"""``slurmft.status``: the report built from journals constructed here and from a real journal
captured on the devcluster (tests/fixtures/journal/, see its README)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurmft.journal import Event, encode_event
from slurmft.status.report import JournalUnreadable, build_report, read_journal, report_dict

pytestmark = pytest.mark.timeout(60)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "journal" / "preempt_crash.events.jsonl"
T0 = 1_700_000_000.0


class J:
    """A journal built event by event; every event is stamped with the current segment."""

    def __init__(self, job_id: str = "100") -> None:
        self.events: list[Event] = []
        self.job_id, self.restart = job_id, 0

    def add(self, t: float, kind: str, **fields) -> "J":
        stamped = {"job_id": self.job_id, "restart_count": self.restart, **fields}
        self.events.append(Event(kind=kind, time=T0 + t, fields=stamped))
        return self

    def steps(self, t: float, first: int, last: int, every: float = 1.0) -> float:
        for step in range(first, last + 1):
            self.add(t, "loss", step=step, loss=1.0, samples=0, world_size=2)
            t += every
        return t - every


def node_down_run() -> J:
    """Segment 0: steps 1-10 (1 s each), checkpoint 5; n2 dies after step 10; the watcher
    detects, requeues, excludes n2, starts it now; segment 1 restores 5 and finishes at 15."""
    j = J()
    j.add(0, "segment_start", world_size=4, num_nodes=2, nodelist="n[1-2]", restored_step=None)
    j.steps(1, 1, 5)
    j.add(5.1, "checkpoint_committed", step=5, blocking_s=0.5, total_s=2.0, bytes_written=100)
    j.steps(6, 6, 10)
    j.add(30, "fault_detected", cause="node_down", evidence="n2 DOWN", nodes=["n2"], fault_time=T0 + 12,
          state="RUNNING", action="recover")
    j.add(31, "recovery_action", action="requeue", cause="node_down", nodes=[], ok=True, detail="")
    j.restart = 1
    j.add(33, "recovery_action", action="exclude", cause="node_down", nodes=["n2"], ok=True, detail="")
    j.add(35, "recovery_action", action="start_now", cause="node_down", nodes=[], ok=True, detail="")
    j.add(36, "job_running", nodes=["n1", "n3"], start_time=T0 + 35.5)
    j.add(40, "segment_start", world_size=4, num_nodes=2, nodelist="n[1,3]", restored_step=5,
          load_s=2.0, load_bytes=4_000_000_000)
    j.steps(45, 6, 15)
    j.add(54.5, "segment_end", exit_code=0, outcome="OK (0)", reason="finished at step 15", step=15)
    j.add(56, "run_finished", state="COMPLETED", exit_code=0, how="finished")
    return j


def test_fault_times_lost_work_and_ettr_of_a_constructed_run():
    report = build_report(node_down_run().events, now=T0 + 1000)
    assert [s.restored_step for s in report.segments] == [None, 5]
    (fault,) = report.faults
    assert fault.cause == "node_down" and fault.nodes == ["n2"]
    assert (fault.fault_time, fault.detected, fault.requeued, fault.running, fault.back) == \
        (T0 + 12, T0 + 30, T0 + 31, T0 + 35.5, T0 + 45)
    assert fault.downtime_s == 33
    assert (fault.last_step, fault.restored_step, fault.steps_lost) == (10, 5, 5)
    assert fault.lost_s == pytest.approx(5.0)  # steps 6-10, one second each
    # productive: steps 1-5 of segment 0 and 6-15 of segment 1, 1 s each; wall: first start to
    # run_finished (the run is over: `now` does not count).
    assert report.steps_redone == 5 and report.redone_s == pytest.approx(5.0)
    assert report.productive_s == pytest.approx(15.0) and report.wall_s == pytest.approx(56.0)
    assert report.ettr == pytest.approx(15 / 56)
    assert report.restarts == 1 and report.restarts_by_cause == {"node_down": 1}
    assert report.segments[1].load_bandwidth == pytest.approx(2e9)
    assert report.state.startswith("finished (COMPLETED, exit 0)")
    assert report.last_checkpoint_step == 5 and report.mean_checkpoint_blocking_s == 0.5


def test_ettr_counts_the_queue_wait_from_the_submission_the_watcher_journaled():
    j = node_down_run()
    watched = Event(kind="watch_started", time=T0 - 5,
                    fields={"job_id": "100", "restart_count": 0, "job_submit_time": T0 - 24})
    report = build_report([watched] + j.events, now=T0 + 1000)
    assert report.wall_s == pytest.approx(80.0) and report.ettr == pytest.approx(15 / 80)
    assert report.first_time == T0 - 24


def test_a_submission_after_the_first_start_does_not_move_the_runs_beginning():
    # A requeue or a resubmission renews the job's submit time: not the run's beginning.
    from datetime import datetime, timezone

    from slurmft.slurm.client import Job, JobState

    job = Job(job_id="100", name="train", state=JobState.COMPLETED,
              submit_time=datetime.fromtimestamp(T0 + 20, tz=timezone.utc))
    report = build_report(node_down_run().events, job, now=T0 + 1000)
    assert report.wall_s == pytest.approx(56.0)
    earlier = Job(job_id="100", name="train", state=JobState.COMPLETED,
                  submit_time=datetime.fromtimestamp(T0 - 4, tz=timezone.utc))
    assert build_report(node_down_run().events, earlier, now=T0 + 1000).wall_s == pytest.approx(60.0)


def test_a_segment_ended_by_the_recovery_does_not_put_its_fault_after_the_detection():
    """A drained node: the watcher journals no fault time; the ranks end (and journal it) only
    when its requeue reaches them, after the detection."""
    j = J()
    j.add(0, "segment_start", world_size=2, num_nodes=2, nodelist="n[1-2]", restored_step=None)
    j.steps(1, 1, 5)
    j.add(6, "fault_detected", cause="node_unhealthy", evidence="n1 drained", nodes=["n1"],
          state="RUNNING", action="recover")
    j.add(6.1, "recovery_action", action="requeue", cause="node_unhealthy", nodes=[], ok=True, detail="")
    j.add(6.8, "segment_end", exit_code=85, outcome="REQUEUE (85)", reason="preempted", step=5)
    (fault,) = build_report(j.events, now=T0 + 100).faults
    assert fault.fault_time == fault.detected == T0 + 6


def test_a_guard_rollback_counts_its_repeated_steps_as_redone():
    j = J()
    j.add(0, "segment_start", world_size=1, num_nodes=1, nodelist="n1", restored_step=None)
    t = j.steps(1, 1, 6)
    j.add(t + 0.1, "rollback", from_step=7, to_step=4)
    j.steps(t + 1, 5, 8)
    report = build_report(j.events, now=T0 + 100)
    assert report.steps_redone == 2 and report.steps_done == 8  # steps 5 and 6 ran twice
    assert report.faults == [] and report.restarts == 0
    assert report.state.startswith("training at step 8")


@pytest.mark.parametrize("tail,state,waiting", [
    ([("fault_detected", dict(cause="hang", action="recover", fault_time=None, nodes=[]))],
     "recovering from hang", "the requeue"),
    ([("fault_detected", dict(cause="hang", action="recover", fault_time=None, nodes=[])),
      ("recovery_action", dict(action="requeue", cause="hang", ok=True, nodes=[]))],
     "recovering from hang", "to be PENDING"),
    ([("fault_detected", dict(cause="hang", action="recover", fault_time=None, nodes=[])),
      ("recovery_action", dict(action="requeue", cause="hang", ok=True, nodes=[])),
      ("recovery_action", dict(action="start_now", cause="hang", ok=True, nodes=[]))],
     "recovering from hang", "Slurm to start the job"),
    ([("fault_detected", dict(cause="crash", action="recover", fault_time=None, nodes=[])),
      ("gave_up", dict(cause="crash", reason="crash loop: no newer checkpoint", restarts=3, held=True))],
     "gave up and held the job: crash loop", "a person"),
    ([("segment_end", dict(exit_code=85, outcome="REQUEUE (85)", reason="preempted")),
      ("template", dict(action="requeue", exclude=""))],
     "requeued by the job itself", "~120 s unless `slurmft watch`"),
    ([("segment_end", dict(exit_code=1, outcome="exit 1", reason="boom"))],
     "segment ended: exit 1", "is `slurmft watch` running?"),
    # A planned end (time limit, preemption) is a restart the watcher helps, not a recovery.
    ([("planned_end", dict(cause="preempted", action="expedite", fault_time=None, nodes=[])),
      ("restart_action", dict(action="start_now", cause="preempted", ok=True, nodes=[]))],
     "restarting after a planned end (preempted)", "Slurm to start the job"),
])
def test_where_the_run_stands_and_what_it_waits_for(tail, state, waiting):
    j = J()
    j.add(0, "segment_start", world_size=2, num_nodes=1, nodelist="n1", restored_step=None)
    t = j.steps(1, 1, 3)
    for i, (kind, fields) in enumerate(tail):
        j.add(t + 1 + i, kind, **fields)
    report = build_report(j.events, now=T0 + 100)
    assert report.state.startswith(state), report.state
    assert waiting in report.waiting_for, report.waiting_for


def test_a_restart_without_a_watcher_takes_its_cause_from_the_job():
    j = J()
    j.add(0, "segment_start", world_size=2, num_nodes=1, nodelist="n1", restored_step=None)
    j.steps(1, 1, 4)
    j.add(4.5, "segment_end", exit_code=87, outcome="HANG (87)", reason="step 5 hung")
    j.restart = 1
    j.add(10, "segment_start", world_size=2, num_nodes=1, nodelist="n1", restored_step=None)
    j.steps(12, 1, 2)
    report = build_report(j.events, now=T0 + 20)
    (fault,) = report.faults
    assert fault.cause == "hang" and fault.detected is None and fault.fault_time == T0 + 4.5
    assert fault.running == T0 + 10 and fault.back == T0 + 12 and fault.steps_lost == 4
    assert report.restarts_by_cause == {"hang": 1}
    assert report.state.startswith("training at step 2")


def test_the_captured_journal_of_a_preempted_then_crashed_run():
    events = read_journal(FIXTURE)
    report = build_report(events, now=events[-1].time + 60)
    assert [(s.restart_count, s.restored_step, s.first_step, s.last_step) for s in report.segments] == \
        [(0, None, 1, 9), (1, 9, 10, 24), (2, 20, 21, 40)]
    preempted, crash = report.faults
    assert (preempted.cause, preempted.steps_lost, preempted.restored_step) == ("preempted", 0, 9)
    assert (crash.cause, crash.last_step, crash.restored_step, crash.steps_lost) == ("crash", 24, 20, 4)
    for fault in report.faults:  # every time is there, in the order the recovery happened
        assert fault.recovered and None not in (fault.fault_time, fault.detected, fault.requeued,
                                                fault.running, fault.back)
        assert fault.fault_time <= fault.detected <= fault.running <= fault.back
    assert preempted.requeued < preempted.detected  # the job requeued itself; the watcher expedited
    assert crash.detected <= crash.requeued <= crash.running
    assert report.restarts_by_cause == {"crash": 1, "preempted": 1}
    assert report.steps_done == 40 and report.steps_redone == 4
    assert 0 < report.productive_s + report.redone_s < report.wall_s and 0 < report.ettr < 1
    assert report.checkpoints == 9 and report.last_checkpoint_step == 40
    assert report.state.startswith("finished (COMPLETED, exit 0)")
    assert [w["what"] for w in report.warnings] == ["checkpoint_overdue"] * 2
    data = report_dict(report)
    assert data["restarts"] == 2 and data["faults"][1]["downtime_s"] == pytest.approx(crash.downtime_s)


def test_read_journal_skips_torn_lines_and_refuses_what_is_not_a_regular_file(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(encode_event("loss", {"step": 1}, now=T0) + b'{"v":1,"t":1,"kind":"lo'
                     + b"\n" + b"x" * 70_000 + b"\n" + encode_event("loss", {"step": 2}, now=T0 + 1))
    assert [e.get("step") for e in read_journal(path)] == [1, 2]
    link = tmp_path / "link.jsonl"
    link.symlink_to(path)
    with pytest.raises(JournalUnreadable, match="link.jsonl"):
        read_journal(link)
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(JournalUnreadable, match="not a regular file"):
        read_journal(fifo)
    with pytest.raises(JournalUnreadable, match="No such file"):
        read_journal(tmp_path / "missing.jsonl")


def _saved(phase: str, **recovery) -> dict:
    """The watcher's watch/state.json, as the watcher itself writes it."""
    from slurmft.watch.state import Recovery, RunState

    rec = Recovery(cause="node_down", evidence="n2 DOWN", fault_time=T0, detect_time=T0 + 1,
                   restart_count=0, **recovery) if recovery else None
    return RunState(job_id="100", phase=phase, restarts=1, recovery=rec, reason="").to_json()


@pytest.mark.parametrize("saved,waiting", [
    (_saved("recovering", exclude=["n2"], requeue="doing"), "the requeue"),
    (_saved("recovering", exclude=["n2"], requeue="done", exclude_step="todo"),
     "the job to be PENDING, then excluding n2 and a start now"),
    (_saved("recovering", requeue="done", exclude_step="skip", start_now="todo", start_now_attempts=2),
     "the job to be PENDING, then a start now (2 refused so far)"),
    (_saved("recovering", requeue="done", exclude_step="done", start_now="done"),
     "Slurm to start the job"),
])
def test_what_a_recovering_watcher_waits_for_comes_from_its_saved_state(saved, waiting):
    j = J()
    j.add(0, "segment_start", world_size=2, num_nodes=2, nodelist="n[1-2]", restored_step=None)
    t = j.steps(1, 1, 3)
    j.add(t + 5, "fault_detected", cause="node_down", action="recover", fault_time=T0 + t, nodes=["n2"])
    report = build_report(j.events, now=T0 + 100, watch_state=saved)
    assert report.state.startswith("recovering from node_down")
    assert report.waiting_for.startswith(waiting), report.waiting_for
    assert report.watcher["phase"] == "recovering" and report.watcher["restarts"] == 1


def test_a_run_the_watcher_found_forgotten_by_slurm_says_so():
    j = J()
    j.add(0, "segment_start", world_size=2, num_nodes=1, nodelist="n1", restored_step=None)
    j.steps(1, 1, 3)
    saved = {**_saved("lost"), "reason": "Slurm forgot job 100 and it is not DONE"}
    report = build_report(j.events, now=T0 + 100, watch_state=saved)
    assert report.state == "lost: Slurm forgot job 100 and it is not DONE"
    assert "resubmit" in report.waiting_for
    damaged = build_report(j.events, now=T0 + 100, watch_state={"phase": 3}).watcher
    assert damaged is not None and damaged["phase"] == "unreadable", damaged  # shown, never half-trusted


def test_a_run_resubmitted_by_the_watcher_names_the_new_job():
    j = J("100")
    j.add(0, "segment_start", world_size=2, num_nodes=1, nodelist="n1", restored_step=None)
    t = j.steps(1, 1, 6)
    j.add(t + 50, "fault_detected", cause="requeued", action="recover", fault_time=None, nodes=[])
    j.add(t + 51, "recovery_action", action="resubmit", cause="requeued", ok=True, nodes=[], detail="")
    j.add(t + 52, "job_resubmitted", old_job_id="100", new_job_id="205")
    report = build_report(j.events, now=T0 + 200)
    assert report.state == "resubmitted as job 205 (Slurm had forgotten job 100)"
    assert report.waiting_for.startswith("Slurm to start job 205")
    j.job_id = "205"
    j.add(t + 70, "segment_start", world_size=2, num_nodes=1, nodelist="n1", restored_step=5)
    j.steps(t + 72, 6, 8)
    report = build_report(j.events, now=T0 + 200)
    (fault,) = report.faults
    assert (fault.requeued, fault.running, fault.back) == (T0 + t + 51, T0 + t + 70, T0 + t + 72)
    assert fault.steps_lost == 1 and report.job_id == "205"
    assert report.state == "training at step 8"


def test_a_recovery_the_journal_shows_no_end_of_is_over_once_a_new_segment_trains():
    """E.g. a watcher killed between the start now and its job_running line."""
    j = J()
    j.add(0, "segment_start", world_size=2, num_nodes=1, nodelist="n1", restored_step=None)
    t = j.steps(1, 1, 4)
    j.add(t + 5, "fault_detected", cause="crash", action="recover", fault_time=T0 + t, nodes=[])
    j.add(t + 6, "recovery_action", action="requeue", cause="crash", ok=True, nodes=[], detail="")
    j.restart = 1
    j.add(t + 20, "segment_start", world_size=2, num_nodes=1, nodelist="n1", restored_step=None)
    j.steps(t + 22, 1, 2)
    report = build_report(j.events, now=T0 + 100)
    assert report.state == "training at step 2" and report.faults[0].running == T0 + t + 20
