"""One watched run: its state machine, driven once per poll cycle with that cycle's observation.

WATCHING: the detectors run; the first finding that calls for action starts a recovery (or
gives up, or ends the watch). RECOVERING (``recovering.py``): requeue (unless Slurm or the job
already did), then, once the job is PENDING and no longer COMPLETING, merge the evidence nodes
into ``ExcNodeList`` and send ``StartTime=now``; back to WATCHING when the job runs again with a
newer restart count. A job Slurm forgot is resubmitted (``forgotten.py``). This module owns the
cycle: the lease, what is observed (stat first), what is learned from the beats, the watching.
Every step's intent is saved in the run's state before the step is taken (``state.py``).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Mapping

from slurmft import journal
from slurmft.journal import Journal
from slurmft.rundir import RunDir
from slurmft.slurm.client import Job, JobState, Node, SlurmError
from slurmft.watch import detect, giveup, slurmhold
from slurmft.watch.act import Actor
from slurmft.watch.config import WatchConfig
from slurmft.watch.detect import Finding, Memory, RunObservation
from slurmft.watch.exclusions import fade_faults
from slurmft.watch.filecache import RunFilesCache
from slurmft.watch.forgotten import CAPTURE_TRIES, Resubmission
from slurmft.watch.lock import LeaseLost, LeaseUnrenewed
from slurmft.watch.oncetail import load_tail, save_tail, tail_path
from slurmft.watch.recovering import Recovering
from slurmft.watch.resolve import current_user
from slurmft.watch.runview import JournalTail, read_run_files
from slurmft.watch.state import FINISHED, GAVE_UP, LOST, RECOVERING, WATCHING, RunState, save_state

log = logging.getLogger(__name__)
Listener = Callable[[str, Mapping[str, Any]], object]  # what it returns is ignored (a hook: its HookResult)
_TERMINAL = (FINISHED, GAVE_UP, LOST)
# Recent steps whose median sets the learned hang timeout.
STEP_WINDOW = 64
__all__ = ["CAPTURE_TRIES", "Listener", "RunWatch", "STEP_WINDOW"]


class RunWatch(Recovering, Resubmission):
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
        self._relaying = self._tail_saved > 0  # a restored --once tail: what follows is new
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
    def allocation(self):
        """allocation.json of the job watched now, as last read (None: none, or another job's)."""
        record = self._files.allocation
        return record if record is not None and record.job_id in (self._job.ids if self._job
                                                                  else {self.job_id}) else None

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

    def _relay(self, events: list[tuple[str, float, dict]]) -> None:
        """Hand the in-allocation launcher's events (its faults and actions, and running again)
        to the listeners, as the watcher's own are (metrics count both alike): never journaled
        again. The history a first read from the journal's start finds was told before."""
        if self._relaying:
            for kind, when, record in events:
                for listener in self.listeners:
                    try:
                        listener(kind, {"run_dir": str(self.run_dir.root), "time": when, **record})
                    except Exception as exc:  # a listener never stops the watcher
                        log.error("event listener failed on %s: %s", kind, exc)
        self._relaying = True

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
        self._relay(summary.take_relayed())
        seen = None if job is None else (job.state, job.restart_count, job.completing)
        self._light = (job is not None and seen == self._seen and not job.state.finished
                       and self.state.phase == WATCHING)
        self._seen = seen
        beats, done = read_run_files(self.run_dir, self._files, look_for_done=not self._light)
        self._learn(job, beats)
        return RunObservation(self.job_id, job, nodes, summary, beats, done, now,
                              self._allocation())

    def _allocation(self):
        """allocation.json as last read; one that does not check is said once in the journal."""
        error = self._files.allocation_error
        if error is not None and self.state.warn_once(f"allocation_unreadable:{error[:120]}"):
            self.emit(journal.WATCH_WARNING, what="allocation_unreadable", nodes=[],
                      detail=f"{error[:300]}: judged by the journal's launcher events alone")
        return self._files.allocation

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
        return replace(obs, beats=beats, done=done, allocation=self._allocation())

    def memory(self) -> Memory:
        st = self.state
        return Memory(st.last_restart_count, tuple(st.last_nodes), tuple(self._step_times),
                      {n: tuple(h) for n, h in self._history.items()}, self._beat_gap_s,
                      self._beats_seen, silent_since=dict(st.silent_since),
                      drained_since=dict(st.drained_since),
                      drained_after_step=dict(st.drained_after_step),
                      down_since=dict(st.down_since))

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
        down = {n for n in mine if (node := nodes.get(n)) is not None and (node.down or node.drained)}
        st.down_since = {n: st.down_since.get(n, now) for n in down}
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
                                                          detect.SET_DOWN, detect.RESUBMIT,
                                                          detect.DOWN_FENCED)),
                      None)
        if acting is None:
            return
        if acting.action == detect.DOWN_FENCED:
            self._down_fenced(acting, obs)
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

    def _down_fenced(self, finding: Finding, obs: RunObservation) -> None:
        """Operator mode, in-allocation: set DOWN the nodes the launcher fenced that Slurm shows
        NOT_RESPONDING (each once per segment: no rights, and Slurm's own timeout does it); the
        job, recovered in its allocation, is left alone."""
        job = obs.job
        assert job is not None
        for name in finding.nodes:
            if self.state.warn_once(f"down_fenced:{name}:{job.job_id}:{job.restart_count}"):
                try:
                    self.actor.set_down(name, finding.cause, f"fenced by job {job.job_id}'s launcher: "
                                        f"{finding.evidence}")
                except SlurmError as exc:
                    log.error("job %s: could not set %s DOWN: %s", self.job_id, name, exc)

    def _warn(self, finding: Finding, obs: RunObservation) -> None:
        job = obs.job
        key = f"{finding.cause}:{job.job_id if job else self.job_id}:{job.restart_count if job else ''}"
        if finding.cause == detect.CHECKPOINT_OVERDUE:
            key += f":{obs.summary.newest_commit_step()}"
        elif finding.cause == detect.NODE_DOWN:  # in-allocation: each node left to the launcher
            key += f":{','.join(finding.nodes)}"
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
