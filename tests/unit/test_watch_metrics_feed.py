"""What the watcher feeds its metrics after each cycle (checkpoint age, ETTR, textfile)."""

from __future__ import annotations

import pytest

from slurmft import journal
from slurmft.rundir import RunDir
from slurmft.watch.config import WatchConfig
from slurmft.watch.loop import CycleResult
from slurmft.watch.metrics import WatchMetrics
from slurmft.watch.metrics_feed import MetricsFeed
from slurmft.watch.runwatch import RunWatch
from slurmft.watch.state import RunState


def test_feed_sets_checkpoint_age_ettr_and_writes_the_textfile(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    for kind, t, fields in [
        (journal.SEGMENT_START, 100.0, {"restored_step": None}),
        (journal.LOSS, 110.0, {"step": 1, "loss": 1.0}),
        (journal.LOSS, 120.0, {"step": 2, "loss": 1.0}),
        (journal.CHECKPOINT_COMMITTED, 121.0, {"step": 2}),
    ]:
        rd.events.open("ab").write(journal.encode_event(kind, {"job_id": "5", "restart_count": 0,
                                                               **fields}, now=t))
    run = RunWatch(rd, RunState(job_id="5"), None, WatchConfig())
    run.tail.poll()
    metrics = WatchMetrics(clock=lambda: 150.0)
    prom = tmp_path / "w.prom"
    feed = MetricsFeed(metrics, prom, clock=lambda: 150.0)
    feed.after_cycle(CycleResult(True, 0.01, runs=[run]))
    text = prom.read_text()
    assert 'slurmft_watch_last_checkpoint_step{slurm_job="5"} 2.0' in text
    assert 'slurmft_watch_last_checkpoint_age_seconds{slurm_job="5"} 29.0' in text
    assert 'slurmft_watch_ettr{slurm_job="5"}' in text
    assert "slurmft_watch_controller_reachable 1.0" in text


def _journal(rd: RunDir, kind: str, t: float, **fields) -> None:
    with rd.events.open("ab") as fh:
        fh.write(journal.encode_event(kind, fields, now=t))


def _segment(rd: RunDir, job: str, restart: int, start: float, steps, step_s: float,
             end_code: int | None, commit_every: int = 5) -> float:
    _journal(rd, journal.SEGMENT_START, start, job_id=job, restart_count=restart)
    t = start
    for step in steps:
        t += step_s
        _journal(rd, journal.LOSS, t, job_id=job, restart_count=restart, step=step, loss=1.0)
        if step % commit_every == 0:
            _journal(rd, journal.CHECKPOINT_COMMITTED, t + 0.1, job_id=job, restart_count=restart,
                     step=step)
    if end_code is not None:
        _journal(rd, journal.SEGMENT_END, t + 1, job_id=job, restart_count=restart, exit_code=end_code)
    return t + 1


def test_the_ettr_gauge_equals_status_and_reads_only_what_was_appended(tmp_path):
    """Three segments (a crash that redoes steps 11-13, a time-limit end), a watcher start with
    the job's submit time, the run's finish: the gauge refreshed between each is status's ETTR,
    and each refresh reads the bytes appended since the last one, not the whole journal."""
    import sys
    from pathlib import Path

    from slurmft.status.report import build_report, read_journal
    from slurmft.watch.ettr import EttrTail

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from _fs_ops import FsOps

    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    tail = EttrTail(rd.events)

    def check(now: float) -> None:
        before = rd.events.stat().st_size if rd.events.exists() else 0
        with FsOps(rd.root) as ops:
            got = tail.poll().ettr(now)
        assert ops.bytes_read == before - check.size
        check.size = before
        want = build_report(read_journal(rd.events), now=now).ettr
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12), now
    check.size = 0

    _journal(rd, journal.WATCH_STARTED, 95.0, job_id="5", restart_count=0, job_submit_time=90.0)
    end = _segment(rd, "5", 0, 100.0, range(1, 14), 2.0, 1)
    check(end + 5)
    end = _segment(rd, "5", 1, end + 30, range(11, 31), 3.0, 85)  # restored at 10: 11-13 redone
    check(end + 1)
    check(end + 100)  # nothing appended: nothing read, the wall clock moves on
    end = _segment(rd, "5", 2, end + 20, range(31, 41), 2.5, 0)
    check(end + 50)
    _journal(rd, journal.RUN_FINISHED, end + 2, job_id="5", restart_count=2, how="finished")
    check(end + 500)


def test_the_ettr_reader_stays_bounded_over_a_long_run(tmp_path):
    from slurmft.watch.ettr import FROZEN_COMMITS, EttrTail

    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    _segment(rd, "5", 0, 0.0, range(1, 5001), 1.0, None, commit_every=50)
    acc = EttrTail(rd.events).poll()
    assert len(acc.live) <= (FROZEN_COMMITS + 1) * 50
    from slurmft.status.report import build_report, read_journal

    assert acc.ettr(5001.0) == pytest.approx(build_report(read_journal(rd.events), now=5001.0).ettr)


def test_feed_says_how_many_spares_an_in_allocation_run_has_left(tmp_path):
    """A gauge per in-allocation run from its allocation.json (issue 27): 0 means the next
    node death shrinks the world or requeues the job. None for a run not in that mode."""
    from slurmft import allocation
    from slurmft.allocation import Allocation, Fence
    from slurmft.slurm.client import Job, JobState

    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    rd.events.touch()
    allocation.write(rd, Allocation(job_id="5", generation=1, active=("n1", "n2", "n4"),
                                    spares=("n5",), fenced=(Fence("n3", "node_death", 100.0),)))
    run = RunWatch(rd, RunState(job_id="5"), None, WatchConfig())
    running = Job(job_id="5", name="t", state=JobState.RUNNING, nodes=("n1", "n2", "n4", "n5"),
                  raw_job_id="5")
    run.observe(running, {}, 150.0)
    metrics = WatchMetrics(clock=lambda: 150.0)
    feed = MetricsFeed(metrics, None, clock=lambda: 150.0)
    feed.after_cycle(CycleResult(True, 0.01, runs=[run]))
    assert 'slurmft_watch_spare_nodes{slurm_job="5"} 1.0' in metrics.text().decode()
    other = RunDir(tmp_path / "plain")
    other.root.mkdir()
    plain = RunWatch(other, RunState(job_id="6"), None, WatchConfig())
    feed.after_cycle(CycleResult(True, 0.01, runs=[run, plain]))
    from prometheus_client.parser import text_string_to_metric_families

    spares = {s.labels["slurm_job"]: s.value for fam in text_string_to_metric_families(
        metrics.text().decode()) for s in fam.samples if s.name == "slurmft_watch_spare_nodes"}
    assert spares == {"5": 1.0}
