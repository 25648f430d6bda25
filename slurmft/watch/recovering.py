"""A watched run's recoveries: starting one from a finding (the nodes to exclude, the counts, or
giving up instead), and stepping it each cycle while RECOVERING: requeue (unless Slurm or the job
already did), then, once the job is PENDING and no longer COMPLETING, merge the evidence nodes
into ``ExcNodeList``, release a job Slurm held after a failed launch, send ``StartTime=now``; back
to WATCHING when the job runs again with a newer restart count. Giving up holds the job, never
cancels it; a cancel ends the watch at any step. ``RunWatch`` is made of this and
``forgotten.Resubmission``; each step's intent is saved before it is taken (``state.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from slurmft import journal
from slurmft.slurm.client import InvalidArgument, Job, JobCancelled, JobState, PermissionDenied, SlurmError
from slurmft.slurm.policy import held_after_failed_launch
from slurmft.watch import detect, giveup, slurmhold
from slurmft.watch.act import Actor
from slurmft.watch.config import WatchConfig
from slurmft.watch.detect import Finding, Memory, RunObservation
from slurmft.watch.exclusions import fit_exclusions, readmit_to_fit, sized_as_allocated
from slurmft.watch.runview import done_for
from slurmft.watch.state import (
    DOING, DONE, FINISHED, GAVE_UP, RECOVERING, SKIP, TODO, WATCHING, Recovery, RunState,
)

log = logging.getLogger(__name__)
# Tries at an ExcNodeList update before the job is started without it.
MAX_EXCLUDE_ATTEMPTS = 3
# A job still waiting for its BeginTime this long after StartTime=now gets it again (at most 3x).
RESEND_START_NOW_S = 10.0


def _permanent(exc: SlurmError) -> bool:
    """A refusal that the same request will meet again (no rights, --no-requeue, bad input)."""
    text = str(exc)
    return (isinstance(exc, (PermissionDenied, InvalidArgument)) or "--no-requeue" in text
            or "cannot requeue a job in state" in text)


class Recovering:
    """``RunWatch``'s recovery steps (a mixin: the state, the actor and the reporting are
    ``RunWatch``'s)."""

    state: RunState
    config: WatchConfig
    actor: Actor
    holds: slurmhold.LaunchHolds

    if TYPE_CHECKING:
        @property
        def job_id(self) -> str: ...
        def emit(self, kind: str, /, **fields: Any) -> None: ...
        def _save(self) -> None: ...
        def memory(self) -> Memory: ...
        def faults(self) -> int: ...
        def _detected(self, finding: Finding, obs: RunObservation) -> None: ...
        def _limit_reached(self, cause: str, newest: int | None) -> str | None: ...
        def _watch(self, obs: RunObservation) -> None: ...

    def _start_recovery(self, finding: Finding, obs: RunObservation) -> None:
        job = obs.job
        assert job is not None  # detect_end returns WARN, never RECOVER, for a forgotten job
        st = self.state
        newest = obs.summary.newest_commit_step()
        self._detected(finding, obs)
        why = self._limit_reached(finding.cause, newest)
        if why is not None:
            self._give_up(finding.cause, why, job)
            return
        offenders = [n for n, count in st.node_faults.items()
                     if count >= self.config.repeat_offender_faults - 1 and n in finding.nodes]
        # In-allocation mode: the nodes the launcher fenced in the segment recovered from are
        # never used again by this job, a later requeue included.
        recovered = job.restart_count - 1 if finding.action == detect.EXPEDITE else job.restart_count
        fenced = [n for n in obs.summary.fenced(job.ids, recovered) if n not in finding.nodes]
        exclude = [n for n in dict.fromkeys([*finding.nodes, *fenced, *self._known_bad(), *offenders])
                   if n in obs.nodes]  # a name Slurm does not know (a hostname...) cannot be excluded
        if self.config.exclude_stragglers:
            straggler = detect.detect_straggler(self.memory(), self.config)
            if straggler is not None:
                exclude.extend(n for n in straggler.nodes if n not in exclude)
        if finding.action == detect.SET_DOWN:
            for name in finding.nodes:
                try:
                    self.actor.set_down(name, finding.cause, finding.evidence)
                except SlurmError as exc:  # no operator rights: Slurm's own timeout will do it
                    log.error("job %s: could not set %s DOWN: %s", self.job_id, name, exc)
        expedite = finding.action == detect.EXPEDITE
        st.recovery = Recovery(
            cause=finding.cause, evidence=finding.evidence,
            fault_time=finding.fault_time if finding.fault_time is not None else obs.now,
            detect_time=obs.now,
            restart_count=job.restart_count - 1 if expedite else job.restart_count,
            exclude=exclude, requeue=SKIP if expedite else TODO,
            exclude_step=TODO if exclude else SKIP,
            release=TODO if finding.cause == detect.LAUNCH_FAILED else SKIP)
        st.restarts += 1
        st.restarts_by_cause[finding.cause] = st.restarts_by_cause.get(finding.cause, 0) + 1
        for name in finding.nodes:
            st.clean_since.pop(name, None)
            if name in obs.nodes and finding.cause != detect.NODE_DRAINED:  # maintenance: no fault
                st.node_faults[name] = st.node_faults.get(name, 0) + 1
        for name in fenced:
            st.clean_since.pop(name, None)
            if name in obs.nodes:
                st.node_faults[name] = st.node_faults.get(name, 0) + 1
        # The nodes the launcher excluded as it requeued itself are slurmft's exclusions too:
        # once repaired they may be readmitted when the job would not fit without them (over a
        # long in-allocation run they piled up until the job could never start again).
        own = obs.summary.find(obs.summary.self_requeue_excludes, job.ids, recovered) or ()
        st.excluded = [*st.excluded, *(n for n in own if n in obs.nodes and n not in st.excluded)]
        if finding.cause in detect.FAULTS:
            giveup.record_fault_restart(st, finding.cause, newest)
        st.phase = RECOVERING
        self._save()
        if finding.action != detect.SET_DOWN:  # else Slurm requeues it now: seen next cycle
            self._advance(obs)

    def _known_bad(self) -> list[str]:
        """Nodes that were the evidence in enough earlier faults to be excluded on sight."""
        return [n for n, count in self.state.node_faults.items()
                if count >= self.config.repeat_offender_faults]

    def _give_up(self, cause: str, why: str, job: Job | None) -> None:
        """Hold the job: a pending one with ``scontrol hold``; one that ended without success (or
        still runs, hung) goes back into the queue held (``requeuehold``), so it stays in squeue with
        its reason and ``scontrol release`` resumes it from its checkpoint once the cause is fixed.
        Never cancel."""
        held = False
        if job is not None and job.state is JobState.CANCELLED:
            self._cancelled(job, "cancelled: left cancelled, not held")
            return
        try:
            if job is not None and job.state is JobState.PENDING:
                self.actor.hold(job.job_id, cause)
                held = True
            elif job is not None and (job.state is JobState.RUNNING or (
                    job.state.finished and job.state not in (JobState.COMPLETED, JobState.CANCELLED))):
                # A running one (hung at the restart limit) is requeued held too: its nodes freed.
                held = self.actor.requeue_hold(job.job_id, cause)
        except JobCancelled as exc:  # cancelled after this cycle's squeue answer
            self._cancelled(job, str(exc))
            return
        except SlurmError as exc:
            log.error("job %s: could not hold it: %s", self.job_id, exc)
        self.emit(journal.GAVE_UP, cause=cause, reason=why, restarts=self.state.restarts,
                  faults=self.faults(), held=held)
        self.state.phase = GAVE_UP
        self.state.recovery = None
        self.state.reason = why

    def _cancelled(self, job: Job | None, detail: str) -> None:
        """The job was cancelled (by its owner or an admin): the watch ends, nothing more sent."""
        self.emit(journal.RUN_FINISHED, how=detect.CANCELLED, state=JobState.CANCELLED.value,
                  exit_code=job.exit_code if job is not None else None, detail=detail)
        self.state.phase, self.state.recovery = FINISHED, None

    # -- recovering -----------------------------------------------------------------------------

    def _advance(self, obs: RunObservation) -> None:
        st, rec, job = self.state, self.state.recovery, obs.job
        if rec is None:
            st.phase = WATCHING
            return
        if job is None:  # forgotten mid-recovery: start over as a resubmission
            st.phase, st.recovery = WATCHING, None
            return
        if self.config.operator:
            self._set_silent_nodes_down(rec, job, obs)
        if job.state is JobState.CANCELLED:  # at any step of the recovery: a cancel is final
            self._cancelled(job, "cancelled during its recovery: left cancelled")
            return
        if rec.release == SKIP and held_after_failed_launch(job):
            # The restart this recovery waited for failed to launch (Slurm held the job): a new
            # fault, recovered as such (its node excluded, the job released) from this cycle on.
            st.phase, st.recovery = WATCHING, None
            self._watch(obs)
            return
        if rec.requeue in (TODO, DOING):
            if done_for(obs.done, job.ids):
                self.emit(journal.RUN_FINISHED, how=detect.FINISHED, state=job.state.value,
                          exit_code=job.exit_code, detail="ended during its recovery: not requeued")
                st.phase, st.recovery = FINISHED, None
                return
            if job.state is JobState.PENDING or job.restart_count > rec.restart_count:
                rec.requeue = DONE  # done before (by us before a crash, by Slurm or an admin)
                rec.requeued_at = rec.requeued_at or obs.now
            elif job.completing:
                return
            else:
                rec.requeue = DOING
                self._save()
                try:
                    requeued = self.actor.requeue(job.job_id, rec.cause)
                except JobCancelled as exc:  # cancelled after this cycle's squeue answer
                    self._cancelled(job, str(exc))
                    return
                except SlurmError as exc:
                    if _permanent(exc):  # retrying every cycle would change nothing
                        self._give_up(rec.cause, f"Slurm will not requeue it: {exc}", job)
                        return
                    rec.requeue = TODO
                    return
                if not requeued:
                    self.emit(journal.RUN_FINISHED, how=detect.FINISHED, state=job.state.value,
                              exit_code=job.exit_code, detail="Slurm says it completed successfully")
                    st.phase, st.recovery = FINISHED, None
                    return
                rec.requeue, rec.requeued_at = DONE, obs.now
                self._save()
                return
        if job.state is JobState.PENDING and not job.completing:
            self._expedite(rec, job, obs)
        elif job.state is JobState.RUNNING and not job.completing and job.restart_count > rec.restart_count:
            self.emit(journal.JOB_RUNNING, nodes=list(job.nodes),
                      start_time=job.start_time.timestamp() if job.start_time else obs.now,
                      cause=rec.cause, fault_time=rec.fault_time, detect_time=rec.detect_time,
                      planned=detect.planned(rec.cause))
            st.phase, st.recovery = WATCHING, None
            st.last_restart_count = job.restart_count
        elif job.state.finished and job.restart_count > rec.restart_count:
            st.phase, st.recovery = WATCHING, None  # the new run ended already: detected next cycle
            st.last_restart_count = job.restart_count

    def _set_silent_nodes_down(self, rec: Recovery, job: Job, obs: RunObservation) -> None:
        """Operator mode, mid-recovery (``detect.silent_nodes_of_ending_job``): a node death is
        usually found first as a hang, before Slurm flags the node, and the requeue then leaves
        the job COMPLETING until the node is DOWN, after SlurmdTimeout (300 s by default). Such a
        node is set DOWN once, excluded, and counted against it."""
        now_silent = {n for n in job.nodes if (node := obs.nodes.get(n)) is not None
                      and not node.responding and not node.down}
        rec.silent_since = {n: t for n, t in rec.silent_since.items() if n in now_silent}
        for name in now_silent:
            rec.silent_since.setdefault(name, obs.now)
        due = [n for n in detect.silent_nodes_of_ending_job(obs, self.memory(), self.config,
                                                            rec.restart_count, rec.silent_since)
               if n not in rec.set_down]
        for name in due:
            rec.set_down.append(name)
            if name not in rec.exclude:
                rec.exclude.append(name)
                if rec.exclude_step in (SKIP, DONE):
                    rec.exclude_step = TODO
            self.state.node_faults[name] = self.state.node_faults.get(name, 0) + 1
            self._save()
            try:
                self.actor.set_down(name, rec.cause, f"{name} not responding while job "
                                    f"{job.job_id} is ending ({rec.cause})")
            except SlurmError as exc:  # no operator rights: Slurm's own timeout will do it
                log.error("job %s: could not set %s DOWN: %s", self.job_id, name, exc)

    def _release(self, rec: Recovery, job: Job) -> bool:
        """Release the job Slurm held after a failed launch (``slurmhold.release``): True once
        done; a cancel ends the watch, a hold put on since ends the recovery (left as it is)."""
        rec.release = DOING
        self._save()
        outcome = self.holds.release(rec, job)
        if outcome == slurmhold.CANCELLED:
            self._cancelled(job, "cancelled before its release: left cancelled")
        elif outcome == slurmhold.LEFT:
            self.state.phase, self.state.recovery = WATCHING, None
            self.state.last_restart_count = job.restart_count
        self._save()
        return outcome == slurmhold.RELEASED

    def _readmit(self, rec: Recovery, job: Job, obs: RunObservation, excluding: list[str]) -> None:
        """Every cycle the requeued job pends: readmit our repaired exclusions it needs to fit
        (``excluding``: what this cycle just excluded, not yet in the job as read)."""
        if rec.readmit_attempts >= MAX_EXCLUDE_ATTEMPTS:
            return
        readmit = readmit_to_fit(sized_as_allocated(job, obs.allocation), obs.nodes, excluding,
                                 self.state.excluded)
        if not readmit:
            return
        try:
            self.actor.readmit(job.job_id, rec.cause, readmit)
        except SlurmError:  # journaled by the actor; tried again next cycle, a bounded number of times
            rec.readmit_attempts += 1
            return
        self.state.excluded = [n for n in self.state.excluded if n not in readmit]
        self._save()

    def _expedite(self, rec: Recovery, job: Job, obs: RunObservation) -> None:
        if rec.pending_since is None:
            rec.pending_since = obs.now
        if rec.exclude_step in (TODO, DOING):
            wanted = [n for n in rec.exclude if n not in job.excluded_nodes]
            keep, dropped = fit_exclusions(sized_as_allocated(job, obs.allocation), obs.nodes, wanted)
            if dropped:
                self.emit(journal.WATCH_WARNING, what="no_fit", nodes=dropped,
                          detail=f"not excluding {','.join(dropped)}: the job would no longer fit "
                                 "in the usable nodes of its partition")
            rec.exclude_step = DOING
            self._save()
            if keep:
                # Ours before it is sent (a watcher killed meanwhile must still know them);
                # one that did not get excluded is never readmitted: it is not in the list.
                self.state.excluded = [n for n in self.state.excluded if n not in keep] + keep
                self._save()
                try:
                    self.actor.exclude(job.job_id, rec.cause, keep)
                except SlurmError:
                    rec.exclude_attempts += 1
                    if rec.exclude_attempts < MAX_EXCLUDE_ATTEMPTS:
                        rec.exclude_step = TODO
                        return
                    self.emit(journal.WATCH_WARNING, what="not_excluded", nodes=keep,
                              detail=f"could not exclude {','.join(keep)} after "
                                     f"{MAX_EXCLUDE_ATTEMPTS} tries: starting the job without it")
            rec.exclude_step = DONE
            self._save()
            excluding = keep
        else:
            excluding = []
        self._readmit(rec, job, obs, excluding)
        if rec.release in (TODO, DOING) and not self._release(rec, job):
            return
        if rec.start_now == TODO and "EXPEDITING" in job.flags:
            # 26.05, job submitted with --requeue=expedite: Slurm restarts it at once by itself.
            rec.start_now = SKIP
            self.emit(journal.RECOVERY_ACTION, action="expedite", cause=rec.cause, nodes=[], ok=True,
                      detail="Slurm's expedited requeue (EXPEDITING): no StartTime=now needed")
        if (rec.start_now == DONE and job.reason == "BeginTime" and rec.start_now_attempts < 3
                and obs.now - (rec.start_now_at or obs.now) > RESEND_START_NOW_S):
            rec.start_now = TODO  # still held back by the requeue delay: the update did not stick
            rec.start_now_attempts += 1
        if rec.start_now == TODO and obs.now - rec.pending_since >= self.config.start_now_delay_s:
            try:
                self.actor.start_now(job.job_id, rec.cause)
                rec.start_now, rec.start_now_at = DONE, obs.now
            except SlurmError:
                rec.start_now_attempts += 1  # e.g. "Job credential revoked" right after a requeue
        if (not rec.warned_pending and rec.start_now in (DONE, SKIP)
                and obs.now - rec.pending_since > self.config.pending_warn_s):
            rec.warned_pending = True
            self.emit(journal.WATCH_WARNING, what="stuck_pending", nodes=[],
                      detail=f"still PENDING ({job.reason}) {obs.now - rec.pending_since:.0f} s after "
                             "the requeue: it waits for capacity (or a node range that fits)")
