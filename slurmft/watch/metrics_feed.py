"""Feeds ``WatchMetrics`` after each poll cycle: cycle time and controller health, each run's
newest checkpoint and its age (from the journal summary the run already keeps), the spares an
in-allocation run has left (its allocation.json as last read), ETTR every
``ettr_every_s`` (from the lines appended since the last refresh: ``watch/ettr.py``), and the
textfile. Runs no longer watched are forgotten here too."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from slurmft.watch.ettr import EttrTail
from slurmft.watch.loop import CycleResult
from slurmft.watch.metrics import WatchMetrics

log = logging.getLogger(__name__)


class MetricsFeed:
    def __init__(self, metrics: WatchMetrics, textfile: Path | None, *, ettr_every_s: float = 300.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.metrics = metrics
        self.textfile = textfile
        self.ettr_every_s = ettr_every_s
        self.clock = clock
        self._ettr_at: dict[str, float] = {}
        self._ettr: dict[str, EttrTail] = {}
        self._textfile_failed = False

    def after_cycle(self, result: CycleResult) -> None:
        now = self.clock()
        self.metrics.cycle(result.duration_s, observed=result.observed)
        for run in result.runs:
            commits = run.tail.summary.commits
            if commits:
                when, step, _ = commits[-1]
                self.metrics.set_checkpoint(run.job_id, step, max(0.0, now - when))
            alloc = run.allocation  # as last read (only when the run dir changed)
            self.metrics.set_spares(run.job_id, len(alloc.spares) if alloc is not None else None)
            if now - self._ettr_at.get(run.job_id, float("-inf")) >= self.ettr_every_s:
                self._ettr_at[run.job_id] = now
                tail = self._ettr.get(run.job_id)
                if tail is None or tail.path != run.run_dir.events:
                    tail = self._ettr[run.job_id] = EttrTail(run.run_dir.events)
                self.metrics.set_ettr(run.job_id, tail.poll().ettr(now))
        watched = {run.job_id for run in result.runs}
        if result.observed:  # a run ended or let go: its ETTR reader goes with it
            for job_id in [j for j in self._ettr if j not in watched]:
                del self._ettr[job_id]
                self._ettr_at.pop(job_id, None)
        if self.textfile is not None:
            try:
                self.metrics.write_textfile(self.textfile)
                self._textfile_failed = False
            except OSError as exc:
                if not self._textfile_failed:
                    log.error("cannot write the metrics textfile %s: %s", self.textfile, exc)
                self._textfile_failed = True

    def forget(self, job_id: str) -> None:
        """A run let go (``--all``) whose job Slurm no longer lists: its series go."""
        self.metrics.forget(job_id)
        self._ettr_at.pop(job_id, None)
        self._ettr.pop(job_id, None)
