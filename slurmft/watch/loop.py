"""The poll loop: one controller query for every watched job and, when some run needs it, one
node query per cycle, then each run's state machine. A query that fails means "could not
observe": nothing is acted on, the loop backs off (bounded) and logs once per change of
controller health.

The node table is the controller's most expensive answer. A run whose job waits in the queue
as it did last cycle (pending, not requeued since, not being recovered) has no use for it, so a
watcher over a user's thousand queued jobs asks the controller one thing per cycle.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from slurmft.slurm.client import Job, JobNotFound, JobState, SlurmClient, SlurmError
from slurmft.slurm.policy import HELD_REASONS
from slurmft.watch.resolve import READY, WAIT, StartWait
from slurmft.watch.runwatch import RunWatch
from slurmft.watch.state import GAVE_UP, WATCHING

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 60.0


class AdoptLater(Exception):
    """``adopt`` cannot take the job on now (its run dir is busy): ask again next cycle."""


@dataclass
class CycleResult:
    observed: bool
    duration_s: float
    error: str = ""
    runs: list = field(default_factory=list)  # the runs stepped this cycle
    failed: dict[str, str] = field(default_factory=dict)  # job id -> why its step raised


def _needs_nodes(run: RunWatch, job: Job | None) -> bool:
    """Whether this run's cycle may look at nodes: anything but a job that waits in the queue
    as it did (pending, not completing, not requeued since last seen, no recovery under way)."""
    state = getattr(run, "state", None)
    if (state is None or job is None or state.phase != WATCHING or job.state is not JobState.PENDING
            or job.completing):
        return True
    last = state.last_restart_count
    return job.restart_count > (last if last is not None else 0)


class Watcher:
    def __init__(self, client: SlurmClient, runs: list[RunWatch], *, poll_s: float,
                 clock: Callable[[], float] = time.time,
                 on_cycle: Callable[[CycleResult], None] | None = None,
                 user: str | None = None,
                 adopt: Callable[[Job], RunWatch | None] | None = None,
                 let_go: Callable[[RunWatch], None] | None = None,
                 forget: Callable[[str], None] | None = None,
                 waiting: StartWait | None = None,
                 start: Callable[[Job], RunWatch | None] | None = None) -> None:
        """``user`` + ``adopt``: watch every job of ``user`` too (``--all``); each cycle's one
        query lists the user's jobs and ``adopt`` turns a new one into a RunWatch (or None).
        With ``--all`` a run that ended is let go (``let_go``: its lock) at once, so a new job in
        its run dir can be taken on; ``forget`` (its metric series) follows once Slurm no longer
        lists the job. A job whose run was given up on is adopted again once it is released."""
        self.client = client
        self.runs = runs
        self.user = user
        self.adopt = adopt
        self.let_go = let_go
        self.forget = forget
        # Named jobs that have not named their run dir yet: queried with the others each cycle,
        # taken on (``start``) once they do; their wait blocks no other run.
        self.waiting = waiting
        self.start = start
        self._seen: set[str] = {r.job_id for r in runs}
        self._held: set[str] = set()   # let go after giving up: adopted again once released
        self._gone: set[str] = set()   # let go: forgotten once Slurm no longer lists them
        self.poll_s = poll_s
        self.clock = clock
        self.on_cycle = on_cycle
        self.controller_ok: bool | None = None

    def cycle(self) -> CycleResult:
        started = time.monotonic()
        active = [r for r in self.runs if r.active]
        waiting = list(self.waiting.pending) if self.waiting is not None else []
        if not active and self.user is None and not waiting:
            return CycleResult(True, 0.0)
        try:
            if self.user is not None:
                jobs = self.client.user_jobs(self.user)
            else:
                jobs = self.client.jobs([r.job_id for r in active] + waiting)
            if self.adopt is not None:
                active += self._adopt_new(jobs)
            if waiting:
                active += self._start_waiting(jobs)
            nodes = self.client.nodes() if any(_needs_nodes(r, jobs.get(r.job_id)) for r in active) else {}
        except SlurmError as exc:
            result = CycleResult(False, time.monotonic() - started, str(exc), active)
            if self.controller_ok is not False:
                log.warning("could not observe Slurm (nothing is acted on until it answers): %s", exc)
            self.controller_ok = False
            self._report(result)
            return result
        if self.controller_ok is False:
            log.warning("Slurm answers again")
        self.controller_ok = True
        now = self.clock()
        failed: dict[str, str] = {}
        for run in active:
            job = jobs.get(run.job_id)
            if job is None:
                job = self._confirm_forgotten(run)
                if job is False:
                    continue
            try:
                run.step(job, nodes, now)
            except Exception as exc:  # one run's trouble (its disk full, its files) is not the others'
                run.failed(exc)
                failed[run.job_id] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        if self.user is not None:
            self._let_go_ended(jobs)
        result = CycleResult(True, time.monotonic() - started, runs=active, failed=failed)
        self._report(result)
        return result

    def _start_waiting(self, jobs: dict[str, Job]) -> list[RunWatch]:
        started: list[RunWatch] = []
        assert self.waiting is not None
        for job_id in list(self.waiting.pending):
            verdict = self.waiting.judge(job_id, jobs.get(job_id))
            if verdict == READY and self.start is not None:
                run = self.start(jobs[job_id])
                if run is not None:
                    self.runs.append(run)
                    started.append(run)
            elif verdict not in (READY, WAIT):
                log.error("not watching job %s: %s", job_id, verdict)
        return started

    def _adopt_new(self, jobs: dict[str, Job]) -> list[RunWatch]:
        adopted: list[RunWatch] = []
        if self.adopt is None:
            return adopted
        for job_id, job in sorted(jobs.items()):
            if job_id in self._held and job.state in (JobState.PENDING, JobState.RUNNING) \
                    and job.reason not in HELD_REASONS:
                self._held.discard(job_id)
                self._seen.discard(job_id)
            if job_id in self._seen or job.state.finished or job.run_dir is None:
                continue
            self._seen.add(job_id)
            try:
                run = self.adopt(job)
            except AdoptLater:  # its run dir is busy now (the job before it still ends)
                self._seen.discard(job_id)
                continue
            if run is not None:
                self.runs.append(run)
                adopted.append(run)
        return adopted

    def _let_go_ended(self, jobs: dict[str, Job]) -> None:
        """``--all``: release the runs that ended; forget what Slurm no longer lists."""
        for run in [r for r in self.runs if not r.active]:
            self.runs.remove(run)
            if run.state.phase == GAVE_UP:
                self._held.add(run.job_id)
            self._gone.update(e.job_id for e in run.state.epochs)
            if self.let_go is not None:
                self.let_go(run)
        watched = {r.job_id for r in self.runs}
        for job_id in [i for i in self._gone if i not in jobs and i not in watched]:
            self._gone.discard(job_id)
            if self.forget is not None:
                self.forget(job_id)
        self._seen = {i for i in self._seen if i in jobs or i in watched}
        self._held &= self._seen

    def _confirm_forgotten(self, run: RunWatch):
        """A job missing from the controller's answer: ask once more, accounting included. Its
        accounting record is used when it says COMPLETED (finished) or CANCELLED (its owner or an
        admin ended it: left cancelled, never resubmitted); otherwise the job is forgotten (None:
        it can no longer be requeued, only resubmitted). False when that cannot be told now."""
        try:
            job = self.client.job(run.job_id)
        except JobNotFound:
            return None
        except SlurmError:
            return False
        if not job.state.finished:
            return False  # the controller (or accounting) still has it alive: not forgotten
        return job if job.state in (JobState.COMPLETED, JobState.CANCELLED) else None

    def _report(self, result: CycleResult) -> None:
        if self.on_cycle is not None:
            self.on_cycle(result)

    def run(self, *, once: bool = False, stop: Callable[[], bool] = lambda: False) -> None:
        backoff = self.poll_s
        while True:
            result = self.cycle()
            idle = not any(r.active for r in self.runs) and not (self.waiting and self.waiting.pending)
            if once or (self.user is None and idle) or stop():
                return
            backoff = self.poll_s if result.observed else min(backoff * 2, MAX_BACKOFF_S)
            time.sleep(backoff)
