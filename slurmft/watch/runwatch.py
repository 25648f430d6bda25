"""One watched run: its state machine, driven once per poll cycle with that cycle's observation.

WATCHING: the detectors run; the first finding that calls for action starts a recovery (or
gives up, or ends the watch). RECOVERING: requeue (unless Slurm or the job already did), then,
once the job is PENDING and no longer COMPLETING, merge the evidence nodes into ``ExcNodeList``
and send ``StartTime=now``; back to WATCHING when the job runs again with a newer restart count.
Every step's intent is saved in the run's state before the step is taken (``state.py``).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from slurmft import journal
from slurmft.journal import Journal
from slurmft.rundir import RUN_DIR_ENV, RunDir
from slurmft.slurm.client import (
    InvalidArgument, Job, JobCancelled, JobState, Node, PermissionDenied, SlurmError,
)
from slurmft.slurm.policy import held_after_failed_launch
from slurmft.watch import detect, giveup, resubmit, slurmhold
from slurmft.watch.act import Actor
from slurmft.watch.config import WatchConfig
from slurmft.watch.detect import Finding, Memory, RunObservation
from slurmft.watch.lock import LeaseLost, LeaseUnrenewed
from slurmft.watch.exclusions import (
    fade_faults, fit_exclusions, readmit_to_fit, resubmission_exclusions,
)
from slurmft.watch.resolve import current_user
from slurmft.watch.oncetail import load_tail, save_tail, tail_path
from slurmft.watch.filecache import RunFilesCache
from slurmft.watch.runview import JournalTail, done_for, read_run_files
from slurmft.watch.state import (
    DOING, DONE, FINISHED, GAVE_UP, LOST, RECOVERING, SKIP, TODO, WATCHING, Recovery, RunState,
    save_state,
)

log = logging.getLogger(__name__)
Listener = Callable[[str, Mapping[str, Any]], object]  # what it returns is ignored (a hook: its HookResult)
_TERMINAL = (FINISHED, GAVE_UP, LOST)
# Cycles in which to try saving a job's submission (accounting lags the controller by seconds).
CAPTURE_TRIES = 10
# Tries at an ExcNodeList update before the job is started without it.
MAX_EXCLUDE_ATTEMPTS = 3
RESUBMIT_CLOCK_SLACK_S = 300.0
# A job still waiting for its BeginTime this long after StartTime=now gets it again (at most 3x).
RESEND_START_NOW_S = 10.0
# Recent steps whose median sets the learned hang timeout.
STEP_WINDOW = 64


def _permanent(exc: SlurmError) -> bool:
    """A refusal that the same request will meet again (no rights, --no-requeue, bad input)."""
    text = str(exc)
    return (isinstance(exc, (PermissionDenied, InvalidArgument)) or "--no-requeue" in text
            or "cannot requeue a job in state" in text)


class RunWatch:
    """The watcher of one run dir: call ``step(job, nodes, now)`` once per cycle."""

    def __init__(self, run_dir: RunDir, state: RunState, actor_client, config: WatchConfig,
                 listeners: list[Listener] | None = None, recorder=None, *, once: bool = False,
                 saved: RunState | None = None, lock=None) -> None:
        """``saved``: the state as its file holds it (a copy of what was loaded), so that a
        cycle that changes nothing writes nothing; None: written at the first save."""
        self.run_dir = run_dir
        self.state = state
        self.config = config
        self.tail = JournalTail(run_dir.events, keep_lines=once)
        if once:  # a cron line's cycle: carry on where the last one stopped reading
            load_tail(self.tail, tail_path(run_dir))
        self._tail_saved = self.tail.complete_offset
        self._files = RunFilesCache()
        self._saved = saved  # what state.json holds: written again only when the state differs
        self._submission_saved_for: str | None = None
        self.listeners = list(listeners or [])
        self.actor = Actor(actor_client, self.emit)
        self._history: dict[str, deque] = {}
        self._last_beat_step: dict[str, int | None] = {}
        # Step times from the heartbeats: a window of recent steps, each (job, restart, step) once.
        self._step_times: deque[float] = deque(maxlen=STEP_WINDOW)
        self._sampled: deque[tuple] = deque(maxlen=STEP_WINDOW)
        self._beat_gap_s: float | None = None
        self._beats_seen = False
        self._no_beats_said = False
        self._job: Job | None = None
        # The job as the last cycle saw it (state, restart count, completing): a cycle that sees
        # it the same does not look for DONE unless it is about to act (``_watch``).
        self._seen: tuple | None = None
        self._light = False
        self.recorder = recorder
        self._capture_tries = 0
        self.holds = slurmhold.LaunchHolds(self.actor, self.emit, self.job_id, CAPTURE_TRIES, state)
        self._started = False
        self.once = once
        self.lock = lock  # its RunLock: the lease is kept before each cycle acts
        self.lease_lost = False

    @property
    def job_id(self) -> str:
        return self.state.job_id

    @property
    def active(self) -> bool:
        return self.state.phase not in _TERMINAL and not self.lease_lost

    # -- reporting ------------------------------------------------------------------------------

    def emit(self, kind: str, /, **fields: Any) -> None:
        """Journal an event of the watcher's and hand it to the listeners (notify, metrics)."""
        restart = self._job.restart_count if self._job is not None else self.state.last_restart_count
        record = {"job_id": self.job_id, "restart_count": restart, **fields}
        try:
            Journal(self.run_dir).append(kind, **record)
        except (OSError, journal.JournalError) as exc:
            log.error("run %s: could not journal %s: %s", self.run_dir.root, kind, exc)
        log.info("job %s: %s %s", self.job_id, kind,
                 " ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, "", [])))
        for listener in self.listeners:
            try:
                listener(kind, {"run_dir": str(self.run_dir.root), "time": time.time(), **record})
            except Exception as exc:  # a listener never stops the watcher
                log.error("event listener failed on %s: %s", kind, exc)

    def _save(self) -> None:
        """Write the state when it differs from what was last written (an idle cycle writes
        nothing; a step's intent is written before the step, as it changed)."""
        # Field by field (dataclass equality): cheap beside serialising a thousand states a cycle.
        if self.state != self._saved:
            save_state(self.run_dir, self.state)
            self._saved = copy.deepcopy(self.state)

    def failed(self, exc: Exception) -> None:
        """This run's cycle raised (its disk full, a file it cannot use): log it, say it once in
        its journal, try again next cycle; the other runs are not affected."""
        log.error("job %s: this cycle failed: %s: %s", self.job_id, type(exc).__name__, exc)
        if self.state.warn_once(f"cycle_failed:{type(exc).__name__}"):
            self.emit(journal.WATCH_WARNING, what="cycle_failed", nodes=[],
                      detail=f"{type(exc).__name__}: {str(exc)[:300]}")

    # -- the cycle ------------------------------------------------------------------------------

    def observe(self, job: Job | None, nodes: Mapping[str, Node], now: float) -> RunObservation:
        """This cycle's observation. DONE matters when the job has moved (ended, gone, requeued)
        or when a finding is about to be acted on: a cycle whose job is where it was and whose
        run is watched reads it only then (``_watch`` reads again), so an idle run costs the
        ``stat`` of its heartbeat directory and the ``lstat`` of its journal."""
        summary = self.tail.poll()
        seen = None if job is None else (job.state, job.restart_count, job.completing)
        self._light = (job is not None and seen == self._seen and not job.state.finished
                       and self.state.phase == WATCHING)
        self._seen = seen
        beats, done = read_run_files(self.run_dir, self._files, look_for_done=not self._light)
        self._learn(job, beats)
        return RunObservation(self.job_id, job, nodes, summary, beats, done, now)

    def _look_for_done(self, obs: RunObservation) -> RunObservation | None:
        """``obs`` read again in full (DONE looked for) before acting on it; None when the run
        dir could not be observed."""
        self._light = False
        beats, done = read_run_files(self.run_dir, self._files)
        self._learn(obs.job, beats)
        if not self._files.observed:
            log.warning("job %s: could not read the run dir in %s this cycle: deciding nothing",
                        self.job_id, self.run_dir.root)
            return None
        return replace(obs, beats=beats, done=done)

    def memory(self) -> Memory:
        st = self.state
        return Memory(st.last_restart_count, tuple(st.last_nodes), tuple(self._step_times),
                      {n: tuple(h) for n, h in self._history.items()}, self._beat_gap_s,
                      self._beats_seen, silent_since=dict(st.silent_since),
                      drained_since=dict(st.drained_since),
                      drained_after_step=dict(st.drained_after_step))

    def _learn(self, job: Job | None, beats) -> None:
        """Step times and the beat cadence (for the learned hang timeout) and per-node busy times
        (stragglers), from the segment's heartbeats. Learned afresh by each watcher from the
        beats (every beat carries its last step's time), so nothing of it is saved."""
        if beats:
            self._beats_seen = True
        if job is None or job.state is not JobState.RUNNING or beats is None:
            return
        segment = [b for b in beats.values()
                   if b.job_id in job.ids and b.restart_count == job.restart_count]
        steps: dict[tuple, float] = {}
        for beat in segment:
            if beat.step_s is not None and beat.step is not None:
                key = (beat.job_id, beat.restart_count, beat.step)
                steps[key] = max(beat.step_s, steps.get(key, 0.0))  # the same step on every node
        for key in sorted(steps, key=lambda k: k[2]):
            if key not in self._sampled:
                self._sampled.append(key)
                self._step_times.append(steps[key])
        if segment:
            typical = detect.typical_step_s(self.memory()) or 0.0
            self._beat_gap_s = max(b.gap_s(typical) for b in segment)
        for beat in segment:
            # Once per step: a phase's beats repeat the busy time of the step before it.
            if beat.busy_s is not None and self._last_beat_step.get(beat.node) != beat.step:
                self._last_beat_step[beat.node] = beat.step
                self._history.setdefault(beat.node, deque(maxlen=16)).append(beat.busy_s)

    def step(self, job: Job | None, nodes: Mapping[str, Node], now: float) -> None:
        if not self.active:
            return
        if self.lock is not None:
            try:
                self.lock.keep()
            except LeaseLost as exc:  # another watcher acts on the run now: never act, never save
                self.lease_lost = True
                log.error("job %s: %s: no longer watched here", self.job_id, exc)
                return
            except LeaseUnrenewed as exc:  # the lease may soon be another's: not this cycle
                log.error("job %s: %s", self.job_id, exc)
                return
        self._job = job
        if not self._started:
            self._started = True
            # A long-running watcher says it started; cron's --once cycles say it once per run.
            if not (self.once and self.state.announced):
                self.state.announced = True
                submitted = job.submit_time.timestamp() if job is not None and job.submit_time else None
                self.emit(journal.WATCH_STARTED, pid=os.getpid(), host=os.uname().nodename,
                          user=current_user(), phase=self.state.phase, once=self.once,
                          job_submit_time=submitted, epoch=len(self.state.epochs))
        obs = self.observe(job, nodes, now)
        self._note_nodes(job, nodes, now, obs.summary.newest_commit_step())
        self._note_heartbeats(obs)
        if self.recorder is not None:
            self.recorder(obs, self.memory(), self.tail.offset)
        if job is not None and not job.state.finished:
            self._save_submission(job)
        if not self._files.observed or not self.tail.observed:
            # Could not observe: the run dir (or its DONE) or its journal did not answer, so what
            # they say is unknown, not absent. Decide nothing this cycle (a finished run read as
            # not DONE would be requeued, resubmitted or marked lost; a time-limit end missing
            # from the journal would count as a fault); the next cycle looks again.
            what = "run dir" if not self._files.observed else "journal"
            log.warning("job %s: could not read the %s in %s this cycle: deciding nothing",
                        self.job_id, what, self.run_dir.root)
        elif self.state.phase == RECOVERING:
            self._advance(obs)
        else:
            self._watch(obs)
        if job is not None and self.active and job.state is JobState.RUNNING and not job.completing:
            # Only a settled, running job: a requeued job is briefly shown COMPLETING with its new
            # restart count, and remembering that count would hide the requeue from detect_end.
            self.state.last_nodes = list(job.nodes)
            if self.state.phase == WATCHING:
                self.state.last_restart_count = job.restart_count
        self._save()
        if self.once and self.tail.complete_offset != self._tail_saved:
            save_tail(self.tail, tail_path(self.run_dir))
            self._tail_saved = self.tail.complete_offset

    def _note_nodes(self, job: Job | None, nodes: Mapping[str, Node], now: float,
                    newest_step: int | None) -> None:
        """Per node of a running job's allocation: since when Slurm shows it NOT_RESPONDING,
        since when an admin's drain is on it, since when it serves with no problem (its faults
        fade: ``exclusions.fade_faults``)."""
        st = self.state
        running = job is not None and job.state is JobState.RUNNING and not job.completing
        mine = job.nodes if running and job is not None else ()
        problems = {n: detect.node_problem(nodes.get(n)) for n in mine}
        silent = {n for n in mine if (node := nodes.get(n)) is not None
                  and not node.responding and not node.down}
        drained = {n for n, p in problems.items() if p is not None and p[0] == detect.NODE_DRAINED}
        st.silent_since = {n: st.silent_since.get(n, now) for n in silent}
        st.drained_since = {n: st.drained_since.get(n, now) for n in drained}
        st.drained_after_step = {n: st.drained_after_step.get(n, newest_step) for n in drained}
        if running and st.phase == WATCHING:
            serving = [n for n, p in problems.items() if p is None]
            fade_faults(st.node_faults, st.clean_since, serving, now, self.config.node_fault_fade_s)

    def _note_heartbeats(self, obs: RunObservation) -> None:
        """Say when hang detection is off: at the first cycle, when the run has no heartbeat yet;
        in the journal (once), when its job has run past the start-up grace without one."""
        beats = obs.beats
        if beats is None or beats or getattr(beats, "unreadable", None) or self._beats_seen:
            return
        if not self._no_beats_said:
            self._no_beats_said = True
            log.warning("job %s: %s has no heartbeat yet: hang detection starts with its first "
                        "heartbeat (a run that never writes one, e.g. a CheckpointManager used "
                        "without Run or Heartbeat, is never judged hung)", self.job_id,
                        self.run_dir.root)
        job = obs.job
        started = job.start_time.timestamp() if job is not None and job.start_time else None
        if (job is not None and job.state is JobState.RUNNING and started is not None
                and obs.now - started > self.config.startup_grace_s
                and self.state.warn_once("no_heartbeat")):
            self.emit(journal.WATCH_WARNING, what="no_heartbeat", nodes=[],
                      detail=f"running {obs.now - started:.0f} s and the run has written no "
                             "heartbeat: no hang detection for it (use slurmft.train.Run, or a "
                             "Heartbeat beside the CheckpointManager)")

    # -- watching -------------------------------------------------------------------------------

    def _watch(self, obs: RunObservation) -> None:
        findings = detect.detect(obs, self.memory(), self.config)
        if self._light and any(f.action != detect.WARN for f in findings):
            # About to act on a cycle that did not look for DONE: a run finishing (DONE written,
            # its final upload under way, no beats) is no hang. Look, then decide again.
            full = self._look_for_done(obs)
            if full is None:
                return
            obs = full
            findings = detect.detect(obs, self.memory(), self.config)
        for finding in findings:
            if finding.action == detect.WARN:
                self._warn(finding, obs)
        acting = next((f for f in findings if f.action in (detect.RECOVER, detect.EXPEDITE,
                                                          detect.GIVE_UP, detect.FINISH,
                                                          detect.SET_DOWN, detect.RESUBMIT)),
                      None)
        if acting is None:
            return
        if acting.action == detect.FINISH:
            job = obs.job
            self.emit(journal.RUN_FINISHED, how=acting.cause, detail=acting.evidence,
                      state=job.state.value if job else None, exit_code=job.exit_code if job else None)
            self.state.phase = FINISHED
            return
        if acting.action == detect.RESUBMIT:
            self._resubmit(acting, obs)
            return
        if acting.action == detect.GIVE_UP:
            self._detected(acting, obs)
            self._give_up(acting.cause, acting.evidence, obs.job)
            return
        if acting.cause == detect.LAUNCH_FAILED:
            assert obs.job is not None
            found = self.holds.locate(acting, obs.job)
            if found is None:
                return  # accounting has no record of the failed run yet: next cycle
            acting = found
        self._start_recovery(acting, obs)

    def _warn(self, finding: Finding, obs: RunObservation) -> None:
        job = obs.job
        key = f"{finding.cause}:{job.job_id if job else self.job_id}:{job.restart_count if job else ''}"
        if finding.cause == detect.CHECKPOINT_OVERDUE:
            key += f":{obs.summary.newest_commit_step()}"
        if self.state.warn_once(key):
            self.emit(journal.WATCH_WARNING, what=finding.cause, detail=finding.evidence,
                      nodes=list(finding.nodes))

    def _detected(self, finding: Finding, obs: RunObservation) -> None:
        job = obs.job
        kind = journal.PLANNED_END if detect.planned(finding.cause) else journal.FAULT_DETECTED
        self.emit(kind, cause=finding.cause, evidence=finding.evidence,
                  nodes=list(finding.nodes), fault_time=finding.fault_time,
                  state=job.state.value if job else None, action=finding.action)

    def faults(self) -> int:
        return giveup.fault_restarts(self.state)

    def _limit_reached(self, cause: str, newest: int | None) -> str | None:
        return giveup.limit_reached(self.state, self.config, cause, newest)

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
        exclude = [n for n in dict.fromkeys([*finding.nodes, *self._known_bad(), *offenders])
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

    # -- a job Slurm has forgotten --------------------------------------------------------------

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
        readmit = readmit_to_fit(job, obs.nodes, excluding, self.state.excluded)
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
            keep, dropped = fit_exclusions(job, obs.nodes, wanted)
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
