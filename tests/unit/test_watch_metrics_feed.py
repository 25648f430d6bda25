"""What the watcher feeds its metrics after each cycle (checkpoint age, ETTR, textfile)."""

from __future__ import annotations

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
