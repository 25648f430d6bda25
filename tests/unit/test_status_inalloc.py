"""In-allocation recoveries (issue 27) counted alike with requeues: ``slurmft status``'s segments,
faults and ETTR, the watcher's ETTR gauge, and its metrics (the launcher's events relayed).

The journals are written as the lanes write them: the ranks stamp ``attempt`` (torchrun's restart
count) beside job id and restart count on every event (``slurmft.journal.Journal(attempt=...)``);
the launcher journals ``fault_detected`` and ``recovery_action`` with ``where: "allocation"``,
stamped with job id, raw id and restart count (``launch.journaling.Voice``). Each test fails on
the code before: it saw one segment where there were two, no fault, and the recovery's downtime
counted as the duration of the next step (productive time)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurmft import journal
from slurmft.journal import Event, encode_event
from slurmft.rundir import RunDir
from slurmft.slurm.client import Job, JobState, Node, NodeState
from slurmft.status.report import build_report, report_dict
from slurmft.status.segkeys import SegmentKeys
from slurmft.watch.config import WatchConfig
from slurmft.watch.ettr import EttrAccumulator
from slurmft.watch.metrics import WatchMetrics
from slurmft.watch.runwatch import RunWatch
from slurmft.watch.state import RunState

pytestmark = pytest.mark.timeout(60)
T0 = 1_800_000_000.0


class J:
    """Events as the ranks (``rank``: attempt stamped) and the launcher (``launcher``) write them."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def rank(self, t: float, kind: str, attempt: int, restart: int = 0, **fields) -> None:
        stamped = {"job_id": "7", "restart_count": restart, "attempt": attempt, **fields}
        self.events.append(Event(kind, T0 + t, stamped))

    def launcher(self, t: float, kind: str, restart: int = 0, **fields) -> None:
        stamped = {"job_id": "7", "raw_job_id": "7", "restart_count": restart,
                   "where": journal.WHERE_ALLOCATION, **fields}
        self.events.append(Event(kind, T0 + t, stamped))

    def steps(self, t: float, first: int, last: int, attempt: int) -> None:
        for i, step in enumerate(range(first, last + 1)):
            self.rank(t + i, journal.LOSS, attempt, step=step, loss=1.0)


def spare_run(spare_attempt: int = 1) -> J:
    """Attempt 0 on n1-n3: steps 1-10 (1 s each), checkpoint 6; n3 dies at +11; the launcher
    detects it at +21, fences it, n4 (the spare) takes its place; attempt 1 starts at +30 from
    step 6 and trains steps 7-15 from +35. ``spare_attempt``: the attempt the new world's rank 0
    journals (torchrun counts per agent: a spare's agent joins at 0)."""
    j = J()
    j.rank(0, journal.SEGMENT_START, 0, world_size=3, num_nodes=3, nodelist="n[1-3]", restored_step=None)
    j.steps(1, 1, 10, 0)
    j.rank(6.5, journal.CHECKPOINT_COMMITTED, 0, step=6)
    j.launcher(21, journal.FAULT_DETECTED, cause="node_death", nodes=["n3"], evidence=["n3 silent 10 s"],
               fault_time=T0 + 11, detected_by="launcher")
    j.launcher(21.1, journal.RECOVERY_ACTION, action="replace_node", nodes=["n3"], spare="n4",
               world_nodes=3, generation=1, cause="node_death", ok=True)
    j.rank(30, journal.SEGMENT_START, spare_attempt, world_size=3, num_nodes=3, nodelist="n[1-2,4]",
           restored_step=6, load_s=2.0)
    j.steps(35, 7, 15, spare_attempt)
    j.rank(44, journal.SEGMENT_END, spare_attempt, exit_code=0, outcome="OK (0)", reason="done", step=15)
    return j


@pytest.mark.parametrize("spare_attempt", [1, 0])
def test_a_recovery_in_the_allocation_is_a_fault_and_a_segment_like_a_requeue(spare_attempt):
    report = build_report(spare_run(spare_attempt).events, now=T0 + 100)
    assert [(s.job_id, s.restart_count, s.ordinal) for s in report.segments] == [("7", 0, 0), ("7", 0, 1)]
    assert [s.restored_step for s in report.segments] == [None, 6]
    (fault,) = report.faults
    assert (fault.cause, fault.where, fault.nodes) == ("node_death", "allocation", ["n3"])
    assert (fault.fault_time, fault.detected, fault.acted, fault.requeued, fault.running, fault.back) == \
        (T0 + 11, T0 + 21, T0 + 21.1, None, T0 + 30, T0 + 35)
    assert (fault.last_step, fault.restored_step, fault.steps_lost) == (10, 6, 4)
    assert fault.downtime_s == 24 and fault.recovered
    assert report.restarts == 1 and report.restarts_by_cause == {"node_death": 1}
    # Productive: steps 1-6 (1 s each) + steps 7-15 (the first at its segment's median, 1 s):
    # 15 s, never the 25 s from step 10 to the next world's first step.
    assert report.productive_s == pytest.approx(15.0) and report.steps_redone == 4
    assert report_dict(report)["faults"][0]["where"] == "allocation"


def test_the_watchers_ettr_gauge_agrees_with_status():
    events = spare_run(0).events
    acc = EttrAccumulator()
    for event in events:
        acc.add(event)
    assert acc.ettr(T0 + 100) == pytest.approx(build_report(events, now=T0 + 100).ettr)
    assert acc.ettr(T0 + 100) == pytest.approx(15 / 44)


def test_status_says_the_job_recovers_in_its_allocation_not_that_it_waits_for_a_requeue():
    j = spare_run()
    j.events = [e for e in j.events if e.time < T0 + 25]  # the new world not started yet
    report = build_report(j.events, now=T0 + 25)
    assert report.state.startswith("recovering in its allocation from node_death")
    assert "spare n4" in report.waiting_for and "requeue" not in report.waiting_for


def test_a_requeue_after_in_allocation_recoveries_is_still_a_requeue():
    j = spare_run()
    j.events.pop()  # no end: the batch host died at +50, Slurm requeued the job
    j.events.append(Event(journal.FAULT_DETECTED, T0 + 75, {
        "job_id": "7", "restart_count": 0, "cause": "node_fail", "nodes": ["n1"],
        "fault_time": T0 + 50, "action": "expedite"}))
    j.rank(90, journal.SEGMENT_START, 0, restart=1, world_size=3, num_nodes=3, restored_step=12)
    j.steps(92, 13, 14, 0)
    report = build_report(j.events, now=T0 + 100)
    assert [(s.restart_count, s.ordinal) for s in report.segments] == [(0, 0), (0, 1), (1, 0)]
    assert [(f.cause, f.where) for f in report.faults] == [("node_death", "allocation"),
                                                          ("node_fail", "requeue")]


def test_one_start_journaled_twice_is_one_segment_and_a_silent_first_world_is_one_too():
    keys = SegmentKeys()
    start = Event(journal.SEGMENT_START, T0, {"job_id": "7", "restart_count": 0, "attempt": 0})
    loss = Event(journal.LOSS, T0 + 1, {"job_id": "7", "restart_count": 0, "attempt": 0, "step": 1})
    assert [keys.key(e) for e in (start, start, loss, start)] == [
        ("7", 0, 0), ("7", 0, 0), ("7", 0, 0), ("7", 0, 1)]
    # A journal from before attempts: every start of a (job, restart) after a loss is a new one.
    old = SegmentKeys()
    plain = Event(journal.SEGMENT_START, T0, {"job_id": "7", "restart_count": 2})
    assert old.key(plain) == ("7", 2, 0)
    launcher = Event(journal.TEMPLATE, T0, {"job_id": "7", "restart_count": 3, "action": "start"})
    assert old.key(launcher) == ("7", 3, 0)  # before its segment's start: the first


# -- the watcher relays the launcher's events to its listeners (metrics) --------------------------

def samples(m: WatchMetrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(m.text().decode()) for s in fam.samples}


class NoActions:
    """A client that is asked for nothing but the submit line (and has none)."""

    def submit_line(self, job_id):
        return None


def test_the_watchers_metrics_count_the_launchers_recoveries(tmp_path: Path):
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    metrics = WatchMetrics(clock=lambda: T0)
    seen: list[str] = []
    w = RunWatch(rd, RunState(job_id="7"), NoActions(), WatchConfig(),
                 listeners=[metrics.on_event, lambda kind, e: seen.append(kind)])
    job = Job(job_id="7", name="t", state=JobState.RUNNING, nodes=("n1", "n2", "n3", "n4"),
              node_count=4, batch_host="n1", raw_job_id="7")
    table = {n: Node(n, NodeState.ALLOCATED) for n in job.nodes}

    def write(events) -> None:
        with open(rd.events, "ab") as f:
            for e in events:
                f.write(encode_event(e.kind, dict(e.fields), now=e.time))

    run = spare_run().events
    history = [e for e in run if e.time < T0 + 5]
    write(history)
    w.step(job, table, T0 + 5)       # the journal's history: told before, not again
    write([e for e in run if T0 + 5 <= e.time < T0 + 25])
    w.step(job, table, T0 + 25)
    write([e for e in run if e.time >= T0 + 25])
    w.step(job, table, T0 + 45)
    got = samples(metrics)
    key = (("cause", "node_death"), ("slurm_job", "7"), ("where", "allocation"))
    assert got[("slurmft_watch_faults_total", key)] == 1
    assert got[("slurmft_watch_detect_seconds_sum", key)] == pytest.approx(10.0)
    assert got[("slurmft_watch_restarts_total", key)] == 1
    assert got[("slurmft_watch_recover_seconds_sum", key)] == pytest.approx(19.0)
    assert got[("slurmft_watch_node_faults_total", (("cause", "node_death"), ("node", "n3")))] == 1
    assert seen.count(journal.FAULT_DETECTED) == 1 and seen.count(journal.JOB_RUNNING) == 1
    # Relayed, never journaled again by the watcher.
    assert len(journal.read_events(rd.events, [journal.FAULT_DETECTED])) == 1


def test_slurmft_status_shows_where_each_fault_was_recovered_and_the_spares(tmp_path: Path):
    """``slurmft status RUN --no-slurm`` at 80 columns on the run dir of ``spare_run``, with the
    launcher's allocation.json (one spare left after n4 took n3's place; n5 is a spare job's
    node, SLURMFT_SPARE_REFILL=1, and another spare job waits in the queue)."""
    import os
    import subprocess
    import sys

    from slurmft import allocation
    from slurmft.allocation import Allocation, Fence

    rd = RunDir(tmp_path / "r")
    rd.root.mkdir()
    with open(rd.events, "ab") as f:
        for e in spare_run().events:
            f.write(encode_event(e.kind, dict(e.fields), now=e.time))
    allocation.write(rd, Allocation(job_id="7", generation=1, active=("n1", "n2", "n4"),
                                    spares=("n5",), fenced=(Fence("n3", "node_death", T0 + 21),),
                                    min_nodes=2, spare_jobs=(allocation.SpareJob("12", "n5"),
                                                             allocation.SpareJob("13"))))
    env = {**os.environ, "COLUMNS": "80", "TERM": "xterm"}
    out = subprocess.run([sys.executable, "-m", "slurmft.cli", "status", str(rd.root), "--no-slurm"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any("generation 1: active n[1-2,4], spares n5 (1), fenced n3 (node_death)" in " ".join(
        " ".join(lines[i:i + 2]).split()) for i in range(len(lines)))
    assert "spare jobs 12 on n5, 13 queued" in " ".join(out.stdout.split())
    assert "#0 node_death on n3, steps 10->6: n3 silent 10 s" in out.stdout
    fault_rows = [line.split() for line in lines if line.split()[:2] == ["0", "node_death"]]
    assert fault_rows and fault_rows[0][2] == "alloc"
    assert "7.0/1" in out.stdout  # the second world: job 7, restart 0, segment 1 of it
    as_json = subprocess.run([sys.executable, "-m", "slurmft.cli", "status", str(rd.root), "--no-slurm",
                              "--json"], capture_output=True, text=True, timeout=60)
    import json

    report = json.loads(as_json.stdout)
    assert report["allocation"]["spares"] == ["n5"] and report["faults"][0]["where"] == "allocation"
    assert report["allocation"]["spare_jobs"] == [{"job_id": "12", "node": "n5"},
                                                  {"job_id": "13", "node": None}]


def test_status_shows_where_a_restarts_seconds_went_by_phase():
    """The ranks' restart_phases (rank 0, at the new world's first step) under its segment, from
    the fault before it: what bench and a person need to see where a recovery's time goes."""
    j = spare_run()
    j.rank(36.5, journal.RESTART_PHASES, 1, process_start=T0 + 23.0, torch_imported=T0 + 26.0,
           run_started=T0 + 29.5, checkpoint_loaded=T0 + 31.5, first_step_done=T0 + 36.5,
           tier="local", import_s=3.0, setup_s=3.5, load_s=2.0, first_step_s=5.0, total_s=13.5,
           restored_step=6, world_size=3, step=7)
    report = build_report(j.events, now=T0 + 100)
    assert report.segments[0].restart_phases is None
    assert report.segments[1].restart_phases == {"process_start": T0 + 23.0, "tier": "local",
                                                 "import_s": 3.0, "setup_s": 3.5, "load_s": 2.0,
                                                 "first_step_s": 5.0, "total_s": 13.5}
    from rich.console import Console

    from slurmft.status.render import render

    console = Console(record=True, width=100)
    render(report, Path("/run"), console=console)
    text = console.export_text()
    assert ("start-up segment 1: fault to process start 12.0s, import 3.0s, setup 3.5s, load 2.0s "
            "(local), first step 5.0s; process to first step 13.5s") in " ".join(text.split())


def crash_in_place_run() -> J:
    """A rank crashes after step 10 on a healthy node; torchrun restarts the world in place (no
    fence); the launcher (launch/inplace.py) journals the rank_crash only once it sees the new
    world's start, with the last loss before it as the fault time, then restart_in_place."""
    j = J()
    j.rank(0, journal.SEGMENT_START, 0, world_size=3, num_nodes=3, nodelist="n[1-3]", restored_step=None)
    j.steps(1, 1, 10, 0)
    j.rank(6.5, journal.CHECKPOINT_COMMITTED, 0, step=6)
    j.rank(20, journal.SEGMENT_START, 1, world_size=3, num_nodes=3, nodelist="n[1-3]", restored_step=6)
    j.launcher(20.5, journal.FAULT_DETECTED, cause="rank_crash", nodes=[], fault_time=T0 + 10,
               evidence=["the ranks started again without a fence or a re-form by the launcher"],
               detected_by="launcher")
    j.launcher(20.6, journal.RECOVERY_ACTION, action="restart_in_place", nodes=[], spare=None,
               world_nodes=3, generation=0, cause="rank_crash", ok=True)
    j.steps(25, 7, 15, 1)
    return j


def test_a_restart_in_place_journaled_after_the_new_world_started_is_the_fault_before_it():
    report = build_report(crash_in_place_run().events, now=T0 + 100)
    (fault,) = report.faults  # not a second one "after" the new world's start
    assert (fault.cause, fault.where, fault.ordinal) == ("rank_crash", "allocation", 0)
    assert (fault.fault_time, fault.detected, fault.acted, fault.running, fault.back) == \
        (T0 + 10, T0 + 20.5, T0 + 20.6, T0 + 20, T0 + 25)
    assert report.state.startswith("training at step 15")


def test_the_watcher_relays_running_again_for_a_restart_in_place(tmp_path: Path):
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    seen: list[tuple[str, dict]] = []
    w = RunWatch(rd, RunState(job_id="7"), NoActions(), WatchConfig(),
                 listeners=[lambda kind, e: seen.append((kind, e))])
    job = Job(job_id="7", name="t", state=JobState.RUNNING, nodes=("n1", "n2", "n3"),
              node_count=3, batch_host="n1", raw_job_id="7")
    table = {n: Node(n, NodeState.ALLOCATED) for n in job.nodes}
    rd.events.touch()
    w.step(job, table, T0 + 1)
    with open(rd.events, "ab") as f:
        for e in crash_in_place_run().events:
            f.write(encode_event(e.kind, dict(e.fields), now=e.time))
    w.step(job, table, T0 + 30)
    running = [e for kind, e in seen if kind == journal.JOB_RUNNING]
    assert [(e["cause"], e["start_time"], e["fault_time"]) for e in running] == \
        [("rank_crash", T0 + 20, T0 + 10)]


def test_a_fenced_node_set_down_while_training_runs_on_is_no_recovery():
    """Operator mode sets a fenced node DOWN when Slurm shows it NOT_RESPONDING, which with a
    long SlurmdTimeout comes after the new world trains: the run is training, not recovering."""
    j = spare_run()
    j.events.pop()  # still running
    j.events.append(Event(journal.RECOVERY_ACTION, T0 + 43.5, {
        "job_id": "7", "restart_count": 0, "action": "set_down", "cause": "node_down",
        "nodes": ["n3"], "ok": True, "detail": ""}))
    report = build_report(j.events, now=T0 + 50)
    assert report.state.startswith("training at step 15"), report.state


def test_a_spares_death_before_a_re_form_is_not_the_re_forms_fault():
    """The spare n5 dies first (fenced: nothing restarts), then n3 dies and n4 takes its place:
    the fault that ended the first world is n3's, and nothing says 'running again' for n5's."""
    j = J()
    j.rank(0, journal.SEGMENT_START, 0, world_size=3, num_nodes=3, nodelist="n[1-3]", restored_step=None)
    j.steps(1, 1, 10, 0)
    j.launcher(5, journal.FAULT_DETECTED, cause="node_death", nodes=["n5"], evidence=["n5's step ended"],
               fault_time=T0 + 4, detected_by="launcher")
    j.launcher(5.1, journal.RECOVERY_ACTION, action="fence", nodes=["n5"], spare=None, world_nodes=3,
               generation=0, cause="node_death", ok=True)
    j.launcher(21, journal.FAULT_DETECTED, cause="node_silent", nodes=["n3"], evidence=["n3 silent"],
               fault_time=T0 + 11, detected_by="launcher")
    j.launcher(21.1, journal.RECOVERY_ACTION, action="replace_node", nodes=["n3"], spare="n4",
               world_nodes=3, generation=1, cause="node_silent", ok=True)
    j.rank(30, journal.SEGMENT_START, 1, world_size=3, num_nodes=3, nodelist="n[1-2,4]", restored_step=6)
    j.steps(35, 7, 9, 1)
    (fault,) = build_report(j.events, now=T0 + 40).faults
    assert (fault.cause, fault.nodes, fault.acted) == ("node_silent", ["n3"], T0 + 21.1)
    from slurmft.watch.journaltail import JournalSummary

    summary = JournalSummary()
    for e in j.events:
        summary.add(e)
    running = [f for kind, _, f in summary.take_relayed() if kind == journal.JOB_RUNNING]
    assert [(f["cause"], f["start_time"]) for f in running] == [("node_silent", T0 + 30)]
