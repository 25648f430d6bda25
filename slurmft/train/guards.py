"""Training guards: non-finite loss or gradient norm, and gradient-norm spikes.

``StepGuard.check(loss, grad_norm)`` runs after backward (and the grad-norm computation) and
before ``optimizer.step()``. Its inputs must be the same on every rank — the all-reduced loss and
the global gradient norm (FSDP's ``clip_grad_norm_`` returns the global one) — so that every rank
reaches the same verdict without another collective.

Verdicts: ``OK``; ``SKIP`` (drop this step's update) or ``ROLLBACK`` (reload the last valid
checkpoint), as configured; ``GIVE_UP`` once ``max_trips`` troubles fall within ``trip_window``
executed steps — the job then exits with ``slurmft.exitcodes.NO_REQUEUE``, because a run that
keeps diverging will not heal by being requeued. The window counts executed steps, not step
numbers, so a rollback that replays the same step numbers still counts every trip.
"""

from __future__ import annotations

import collections
import enum
import math
import statistics
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class GuardConfig:
    """``[guards]`` in slurmft.toml (``load_section(GuardConfig, "guards")``, ``SLURMFT_GUARDS_<FIELD>``).

    action: what a tripped step does, "skip" its update or "rollback" to the last checkpoint ("skip").
    spike_factor: a gradient norm above this x the rolling median is a spike; 0 = off (10).
    spike_window: accepted norms kept for the median (50). spike_min_history: no spike verdict
    before this many (10). max_trips: troubles within trip_window executed steps that give up (3).
    trip_window: in executed steps (100).
    """

    action: Literal["skip", "rollback"] = "skip"
    spike_factor: float = 10.0  # a grad norm above factor x rolling median is a spike; 0 = off
    spike_window: int = 50      # accepted grad norms kept for the rolling median
    spike_min_history: int = 10  # no spike verdicts before this many accepted norms
    max_trips: int = 3
    trip_window: int = 100      # executed steps

    def __post_init__(self) -> None:
        if self.spike_factor != 0 and self.spike_factor <= 1:
            raise ValueError(f"spike_factor must be > 1 (or 0 to disable), got {self.spike_factor}")
        if self.spike_window < 1 or self.spike_min_history < 1:
            raise ValueError("spike_window and spike_min_history must be >= 1")
        if self.spike_min_history > self.spike_window:
            raise ValueError(f"spike_min_history ({self.spike_min_history}) cannot exceed "
                             f"spike_window ({self.spike_window})")
        if self.max_trips < 1 or self.trip_window < 1:
            raise ValueError("max_trips and trip_window must be >= 1")


class Verdict(str, enum.Enum):
    """What to do with a step: OK, SKIP its update, ROLLBACK to the last checkpoint, GIVE_UP (exit 86)."""

    OK = "ok"
    SKIP = "skip"
    ROLLBACK = "rollback"
    GIVE_UP = "give_up"


@dataclass(frozen=True)
class GuardResult:
    """A verdict; ``reason`` says what tripped (empty when OK); ``trips_in_window`` counts troubles."""

    verdict: Verdict
    reason: str = ""  # empty when OK; else one line: what tripped and the numbers
    trips_in_window: int = 0

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.OK


class StepGuard:
    """Judges each step's loss and gradient norm (see the module docstring): ``check(loss, grad_norm)``.

    config: :class:`GuardConfig` (default: its defaults). Feed it the same values on every rank.
    """

    def __init__(self, config: GuardConfig | None = None) -> None:
        self.config = config or GuardConfig()
        self._norms: collections.deque[float] = collections.deque(maxlen=self.config.spike_window)
        self._trips: collections.deque[int] = collections.deque()
        self._executed = 0

    def _trouble(self, loss: float, grad_norm: float) -> str:
        if not math.isfinite(loss):
            return f"non-finite loss {loss}"
        if not math.isfinite(grad_norm):
            return f"non-finite gradient norm {grad_norm}"
        cfg = self.config
        if cfg.spike_factor and len(self._norms) >= cfg.spike_min_history:
            median = statistics.median(self._norms)
            if median > 0 and grad_norm > cfg.spike_factor * median:
                return (f"gradient norm {grad_norm:.4g} > {cfg.spike_factor:g} x rolling median "
                        f"{median:.4g}")
        return ""

    def check(self, loss: float, grad_norm: float) -> GuardResult:
        """Judge one executed step; call exactly once per executed step, on every rank."""
        self._executed += 1
        reason = self._trouble(float(loss), float(grad_norm))
        if not reason:
            self._norms.append(float(grad_norm))
            return GuardResult(Verdict.OK)
        self._trips.append(self._executed)
        while self._trips and self._trips[0] <= self._executed - self.config.trip_window:
            self._trips.popleft()
        trips = len(self._trips)
        if trips >= self.config.max_trips:
            return GuardResult(Verdict.GIVE_UP, f"{reason}; {trips} troubles within "
                               f"{self.config.trip_window} steps", trips)
        verdict = Verdict.ROLLBACK if self.config.action == "rollback" else Verdict.SKIP
        return GuardResult(verdict, reason, trips)
