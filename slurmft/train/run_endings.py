"""How a :class:`slurmft.train.run.Run` ends: a bad start (exit 86, journaled where the run dir is
known), preemption (one emergency save, exit 85), the end of ``steps()`` (the final save and
``DONE``, written once), the training script's own ``sys.exit``, a hang the watchdog fired on, and
in in-allocation mode a collective that failed because the launcher is re-forming the world.
Every ending journals ``segment_end`` first: torchrun turns a worker's exit code into 1, and the
launcher reads the real one back from the journal."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import torch.distributed as dist

from slurmft import exitcodes, journal, rundir
from slurmft.rundir import RunDir
from slurmft.train.alloc_watch import AllocationWatch
from slurmft.checkpoint.manager import CheckpointError, CheckpointManager
from slurmft.train.preemption import PreemptionHandler
from slurmft.train.resume_audit import ResumeAudit
from slurmft.train.runtime import JobEnv, JobEnvError, Segment
from slurmft.checkpoint.state import TrainState


def fail(message: str, run_dir: str | Path | None = None, env: JobEnv | None = None) -> NoReturn:
    """Exit 86 with one line, and journal it as this segment's end where the run dir and the job
    are known: torchrun turns a worker's 86 into 1, and only the journal tells the launcher (and
    the watcher) that this was a deliberate "do not requeue", not a crash to retry."""
    print(f"slurmft: {message} -> {exitcodes.describe(exitcodes.NO_REQUEUE)}", file=sys.stderr, flush=True)
    if run_dir:
        try:
            env = env or JobEnv.from_environ()
            events = RunDir(Path(run_dir)).events
            if env.is_rank0 and events.parent.is_dir():
                journal.append_event(events, journal.SEGMENT_END, job_id=env.job_id,
                                     restart_count=env.restart_count, attempt=env.attempt,
                                     exit_code=exitcodes.NO_REQUEUE,
                                     outcome=exitcodes.describe(exitcodes.NO_REQUEUE), reason=message)
        except (JobEnvError, OSError, ValueError):
            pass  # the line above is all that can be said: the job ends as a crash (exit 1 or 86)
    raise SystemExit(exitcodes.NO_REQUEUE)


def write_done(run_dir: RunDir, env: JobEnv, step: int, total_steps: int) -> bool:
    """Rank 0's ``DONE``, naming this job (array-aware: the launcher's ``SLURMFT_JOB_ID``) and the
    step it reached, so a later run in the same dir that trains further is not taken for done.
    False (nothing written) when this job's DONE for this step is there already."""
    job_id = os.environ.get("SLURMFT_JOB_ID") or env.job_id
    existing = rundir.read_done(run_dir)
    if existing is not None and existing.job_id == job_id and existing.step == step:
        return False
    rundir.write_done(run_dir, job_id=job_id, step=step, total_steps=total_steps,
                      restart_count=env.restart_count)
    return True


class RunEndings:
    """The endings of :class:`slurmft.train.run.Run` (a base class of it): the attributes below are
    the Run's, set by its constructor and ``start()``."""

    env: JobEnv
    run_dir: RunDir
    segment: Segment
    state: TrainState
    step: int
    done: bool
    process_group: Any
    _ended: bool
    _signalled_at_end: str | None
    _distributed: bool
    _preemption: PreemptionHandler | None
    _audit: ResumeAudit | None
    _alloc_watch: AllocationWatch | None
    close: Callable[[], None]
    _stop_reason: Callable[[], str]

    if TYPE_CHECKING:  # Run.checkpoints, which these methods read
        @property
        def checkpoints(self) -> CheckpointManager: ...

    def _journal_script_exit(self, exc: SystemExit) -> None:
        """Rank 0's own ``sys.exit(code)`` inside ``with Run``, with a code other than 0: torchrun
        turns the worker's code into 1, so it is journaled as this segment's end for the launcher
        to read back. No barrier: the other ranks may not be exiting. A ``sys.exit(0)`` before the
        end of ``steps()`` is not journaled: it is no proof that training finished (no ``DONE``),
        so the launcher goes by what torchrun reports."""
        code = exc.code
        if code is None or code == exitcodes.OK:
            return
        if not isinstance(code, int) or isinstance(code, bool) or not 0 <= code <= 255:
            code = 1  # what Python exits with for sys.exit("message")
        self._ended = True
        self.segment.finish(code, f"the training script exited with code {code} after step {self.step}",
                            step=self.step, announce="rank 0")

    def _on_reform(self, reason: str) -> None:
        """The allocation watch is ending this rank (88): one line, and ``segment_end`` from the
        lowest rank on a node the launcher did not fence (rank 0 may have died with its node)."""
        watch = self._alloc_watch
        self.segment.finish(exitcodes.REFORM, reason, step=self.step,
                            journal_here=watch.reporter(self.env.rank) if watch is not None else None)

    def _await_reform(self, exc: object) -> None:
        """An exception leaving ``with Run`` in in-allocation mode: a collective that failed
        because a peer died ends with 88 once the launcher's new generation comes (see
        ``AllocationWatch.await_verdict``); otherwise it goes on. A signal (torchrun's agent
        stopping its workers after a peer's crash) ends the wait and the rank with 88 too."""
        if isinstance(exc, Exception) and self._alloc_watch is not None:
            self._alloc_watch.await_verdict(
                exc, self.env.node_silent_s + 5, lambda: bool(self._preemption and self._preemption.requested))

    def _preempt(self, step: int) -> None:
        seen = self._stop_reason()
        try:
            self.checkpoints.emergency_save(step, self.state)
            reason = f"preempted: emergency checkpoint at step {step}"
        except CheckpointError as exc:  # the previous checkpoint is intact: requeueing still helps
            reason = f"preempted: emergency checkpoint at step {step} FAILED ({exc}); resuming from an older one"
        self.segment.record(journal.PREEMPTION, step=step, signal=seen)
        self._end(exitcodes.REQUEUE, reason, step=step)

    def _finish(self, total: int) -> None:
        if self.done:
            return
        try:
            self.checkpoints.emergency_save(self.step, self.state)  # the final state; no-op if committed
        except CheckpointError as exc:  # no DONE without it: a requeue redoes the steps since the last one
            self._end(exitcodes.REQUEUE, f"final checkpoint at step {self.step} failed: {exc}", step=self.step)
        if self._audit is not None:
            self._audit.flush()  # a divergence still waiting for its line is journaled in this segment
        if self.env.is_rank0:
            write_done(self.run_dir, self.env, self.step, total)
        self._ended = True
        why = f"finished at step {self.step}"
        if self._signalled_at_end:
            why += f" (a preemption signal, {self._signalled_at_end}, came in the last step: nothing left to requeue for)"
        self.segment.finish(exitcodes.OK, why, step=self.step, barrier=self._barrier())
        self.done = True

    def _end(self, code: int, reason: str, *, step: int | None = None) -> NoReturn:
        self.close()
        self._ended = True
        self.segment.end(code, reason, step=step, barrier=self._barrier(), announce="rank 0")

    def _barrier(self):
        if not self._distributed:
            return None
        return lambda: dist.barrier(group=self.process_group)

    def _on_hang(self, message: str) -> None:
        self.segment.journal.append(journal.HANG, rank=self.env.rank, node=self.env.node,
                                    message=message)
        self.segment.journal.append(journal.SEGMENT_END, exit_code=exitcodes.HANG,
                                    outcome=exitcodes.describe(exitcodes.HANG), reason=message)
