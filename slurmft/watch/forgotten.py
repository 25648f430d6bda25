"""A job Slurm has forgotten (it ended while no watcher ran, past MinJobAge): at first sight of
every job the watcher saves what a resubmission needs (accounting's submit line and the batch
script, ``resubmit.py``); when the controller no longer knows the job and the run is not DONE,
the job is submitted again from that record and followed under its new id. A mixin of
``RunWatch``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from slurmft import journal
from slurmft.rundir import RUN_DIR_ENV, RunDir
from slurmft.slurm.client import Job, SlurmError
from slurmft.watch import giveup, resubmit
from slurmft.watch.act import Actor
from slurmft.watch.detect import Finding, RunObservation
from slurmft.watch.exclusions import resubmission_exclusions
from slurmft.watch.resolve import current_user
from slurmft.watch.state import LOST, RunState

# Cycles in which to try saving a job's submission (accounting lags the controller by seconds).
CAPTURE_TRIES = 10
RESUBMIT_CLOCK_SLACK_S = 300.0


class Resubmission:
    """``RunWatch``'s part for a forgotten job (a mixin)."""

    state: RunState
    run_dir: RunDir
    actor: Actor
    _capture_tries: int
    _submission_saved_for: str | None

    if TYPE_CHECKING:
        @property
        def job_id(self) -> str: ...
        def emit(self, kind: str, /, **fields: Any) -> None: ...
        def _save(self) -> None: ...
        def _detected(self, finding: Finding, obs: RunObservation) -> None: ...
        def _limit_reached(self, cause: str, newest: int | None) -> str | None: ...
        def _give_up(self, cause: str, why: str, job: Job | None) -> None: ...

    def _save_submission(self, job: Job) -> None:
        """At first sight: save the job's submit line and batch script (for a resubmission).
        The saved record is read once per job, not every cycle."""
        if self._capture_tries >= CAPTURE_TRIES or self._submission_saved_for == job.job_id:
            return
        record = resubmit.load_record(self.run_dir)
        if record is not None and record.job_id == job.job_id:
            self._submission_saved_for = job.job_id
            return
        self._capture_tries += 1
        client = self.actor.client
        try:
            line = client.submit_line(job.job_id)
            if line is None:  # accounting lags the controller: next cycle
                raise resubmit.ResubmitError("accounting has no submit line for it")
            script = client.batch_script(job.job_id)
            resubmit.save_record(self.run_dir, job.job_id, line,
                                 str(job.work_dir or self.run_dir.root), script)
            self._submission_saved_for = job.job_id
        except (SlurmError, resubmit.ResubmitError, OSError) as exc:
            if self._capture_tries >= CAPTURE_TRIES:
                self.emit(journal.WATCH_WARNING, what="no_resubmit", nodes=[],
                          detail=f"cannot save the job's submission, so it cannot be resubmitted "
                                 f"should Slurm forget it: {exc}")

    def _resubmit(self, finding: Finding, obs: RunObservation) -> None:
        st = self.state
        record = resubmit.load_record(self.run_dir)
        self._detected(finding, obs)
        if record is None or record.job_id != self.job_id:
            why = "no submission was saved for it (a watcher never saw it while Slurm knew it)"
            self.emit(journal.WATCH_WARNING, what="forgotten", nodes=[],
                      detail=f"{finding.evidence}; cannot resubmit: {why}")
            st.phase, st.reason = LOST, f"{finding.evidence}; {why}"
            return
        limit = self._limit_reached(finding.cause, obs.summary.newest_commit_step())
        if limit is not None:
            self._give_up(finding.cause, limit, None)
            return
        found = self._resubmitted_before(st.resubmit_started) if st.resubmit_started else None
        if found is False:
            return  # cannot tell whether the last resubmission went through: not again, not yet
        if found is None:
            try:
                exclude, dropped = resubmission_exclusions(obs.nodes, st.last_nodes,
                                                           sorted(st.node_faults))
                if dropped:
                    self.emit(journal.WATCH_WARNING, what="no_fit", nodes=dropped,
                              detail=f"not excluding {','.join(dropped)} from the resubmission: "
                                     "it would no longer fit in the usable nodes of its partition")
                argv = resubmit.resubmit_argv(record, resubmit.SubmitRecord.paths(self.run_dir)[1],
                                              self.run_dir.root, exclude)
            except (resubmit.ResubmitError, SlurmError) as exc:  # SlurmError: a bad node name
                self._give_up(finding.cause, f"cannot resubmit: {exc}", None)
                return
            st.resubmit_started = obs.now
            self._save()
            env = {**os.environ, RUN_DIR_ENV: str(self.run_dir.root)}
            try:
                found = resubmit.new_job_id(
                    self.actor.resubmit(argv, Path(record.work_dir), env, finding.cause), record)
            except SlurmError:
                return  # journaled by the actor; tried again next cycle
        old = self.job_id
        st.resubmitted(found, obs.now)
        st.resubmit_started = None
        st.last_restart_count, st.recovery = None, None
        st.restarts += 1
        st.restarts_by_cause[finding.cause] = st.restarts_by_cause.get(finding.cause, 0) + 1
        giveup.record_fault_restart(st, finding.cause, obs.summary.newest_commit_step())
        self.emit(journal.JOB_RESUBMITTED, old_job_id=old, new_job_id=found)

    def _resubmitted_before(self, since: float) -> str | None | Literal[False]:
        """A job this run dir names that was submitted since ``since`` (a resubmission whose
        watcher died before saving the new id); None when there is none; False when Slurm could
        not be asked."""
        try:
            jobs = self.actor.client.user_jobs(current_user())
        except SlurmError:
            return False
        for job in jobs.values():
            submitted = job.submit_time.timestamp() if job.submit_time else 0
            # The controller's clock against this host's: minutes of slack, and never the old job.
            if (job.run_dir is not None and Path(job.run_dir) == self.run_dir.root
                    and job.job_id != self.job_id and submitted >= since - RESUBMIT_CLOCK_SLACK_S):
                return job.job_id
        return None
