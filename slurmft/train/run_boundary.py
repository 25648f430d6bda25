"""What :class:`slurmft.train.run.Run` does at each step boundary (the code after the loop body):
the guard's verdict acted on (rollback, or give up: exit 86), the ``loss`` event, the heartbeat,
the periodic save and preemption; and the journal events of each checkpoint committed. In
in-allocation mode it also looks at ``allocation.json`` first (one ``stat``): a world the launcher
re-forms ends here, exit 88, rather than in the next step's collective."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from slurmft import exitcodes, journal
from slurmft.train.alloc_watch import AllocationWatch
from slurmft.train.boundary import BoundaryCheck
from slurmft.checkpoint.manager import CheckpointManager
from slurmft.train.guards import GuardResult, Verdict
from slurmft.train.phases import RestartPhases
from slurmft.train.busy import ForwardTimer
from slurmft.train.heartbeat import Heartbeat
from slurmft.train.preemption import PreemptionHandler
from slurmft.train.resume_audit import ResumeAudit
from slurmft.train.run_config import RunConfig
from slurmft.train.runtime import Segment
from slurmft.checkpoint.state import TrainState


class StepBoundary:
    """The step boundary of :class:`slurmft.train.run.Run` (a base class of it): the attributes
    below are the Run's, set by its constructor and ``start()``."""

    config: RunConfig
    segment: Segment
    state: TrainState
    heartbeat: Heartbeat
    step: int
    world_size: int
    loss: float | None
    grad_norm: float | None
    result: GuardResult | None
    _boundary: BoundaryCheck
    _stop_agreed: bool
    _stop_seen: str | None
    _signalled_at_end: str | None
    _reported: bool
    _fields: dict[str, Any]
    _total: int | None
    _busy_steps: int
    _preemption: PreemptionHandler | None
    _audit: ResumeAudit | None
    _forward_timer: ForwardTimer | None
    _alloc_watch: AllocationWatch | None
    _phases: RestartPhases
    restored_step: int | None
    _end: Callable[..., NoReturn]
    _preempt: Callable[[int], None]

    if TYPE_CHECKING:  # Run.checkpoints, which these methods read
        @property
        def checkpoints(self) -> CheckpointManager: ...

    def _boundary_after(self, step: int, total: int) -> None:
        if self._alloc_watch is not None:
            self._alloc_watch.check()
        self._boundary.settle(step)  # a draw before the loop matters from the step that draws too
        stop = self._stop_agreed if self._reported else (
            self._preemption is not None and self._preemption.should_stop())
        result = self.result
        if result is not None and not result.ok:
            self.segment.record(journal.GUARD_TRIP, step=step, verdict=result.verdict.value,
                                reason=result.reason, trips=result.trips_in_window)
            if result.verdict is Verdict.GIVE_UP:
                self._end(exitcodes.NO_REQUEUE, f"guard: {result.reason}", step=step)
            if result.verdict is Verdict.ROLLBACK:
                self.checkpoints.wait()
                back = self.checkpoints.load_latest(self.state)
                self._boundary.drop()  # the restore moved the generators: a held check is void
                if self._audit is not None:
                    self._audit.drop_held()
                self.segment.record(journal.ROLLBACK, from_step=step, to_step=back,
                                    **({} if back is not None else
                                       {"reason": "no checkpoint yet: step skipped instead"}))
                if back is not None:
                    self.step = back
                    if stop:
                        self._preempt(back)
                    return
        self.step = step
        if self._reported and self.config.log_every:
            loss = self.loss if self.loss is not None and math.isfinite(self.loss) else None
            fp = (None if self._audit is None else
                  self._audit.step_done(step, loss, self.world_size, stop or self._saves_at(step),
                                        last=stop or step >= total))
            if fp is not None or step % self.config.log_every == 0:
                norm = self.grad_norm if self.grad_norm is not None and math.isfinite(self.grad_norm) else None
                self.segment.record(journal.LOSS, step=step, loss=loss, grad_norm=norm,
                                    world_size=self.world_size, **self._fields,
                                    **({} if fp is None else {"fp": fp}))
        if self._forward_timer is not None:
            self._busy_steps += 1
        self.heartbeat.beat(step, busy_s=self._busy_per_step if self._forward_timer is not None else None)
        phases = self._phases.event(restored_step=self.restored_step, world_size=self.world_size)
        if phases is not None:  # the segment's first step: what its start cost, by phase
            self.segment.record(journal.RESTART_PHASES, step=step, **phases)
        if stop and step >= total:  # nothing left to train: steps() ends with the final save and DONE
            self._signalled_at_end = self._stop_reason()
        elif stop:
            self._preempt(step)
        if self.checkpoints.due(step) and step < total:
            self.checkpoints.save(step, self.state)

    def _stop_reason(self) -> str:
        """Why the ranks stop: this rank's own reason, else what the ranks saw (``report()``),
        else "peer" (agreed without ``report()`` on another rank's flag)."""
        own = self._preemption.reason if self._preemption is not None else None
        return own or (self._stop_seen if self._reported else None) or "peer"

    def _busy_per_step(self) -> float | None:
        """The forward time per step since the last beat (asked for only when a beat is written)."""
        assert self._forward_timer is not None
        forward_s = self._forward_timer.take()
        steps, self._busy_steps = self._busy_steps, 0
        return None if forward_s is None or not steps else forward_s / steps

    def _saves_at(self, step: int) -> bool:
        return self.checkpoints.due(step) or step == self._total

    def _on_commit(self, step: int, path: Path, stats: Any) -> None:
        if stats.local_s is not None and stats.tier == "shared":  # the node-local tier's copy, later
            self.segment.record(journal.CHECKPOINT_COPIED, step=step, path=str(path), total_s=stats.total_s)
            return
        # blocking_s is the stall the loop saw: save() itself plus the optimizer's wait for the copy.
        self.segment.record(journal.CHECKPOINT_COMMITTED, step=step, path=str(path), tier=stats.tier,
                            blocking_s=stats.stall_s, total_s=stats.total_s,
                            bytes_written=stats.bytes_written)
