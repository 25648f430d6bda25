"""Per-node heartbeat: ``<run_dir>/heartbeat/<node>.json``, written by local rank 0 of each node.

The watcher reads it to tell a slow job from a hung one, so the cadence is set in wall time, not
in steps: ``beat(step)`` (called at every step boundary) writes at the segment's first step
boundary and then at the first boundary after ``interval_s`` seconds since the last write: every
step when steps are long, every few steps when they are short. Every beat carries
``last_step_s``, the duration of the node's last finished step (measured boundary to boundary on
the monotonic clock, phases excluded), so the watcher learns the run's pace from its first beat.

A long phase between or inside steps (a checkpoint save or load, an evaluation, data-loader
start-up) announces itself: ``with heartbeat.phase("evaluation", bound_s=1800):`` writes a beat
naming the phase and its bound (the watcher waits that long for the next beat), and one more when
it ends. ``CheckpointManager`` does this for its saves and loads when given the heartbeat, the way
it marks them for the step watchdog; ``Run.phase`` does both for a user's own phases.

The write is one small atomic file replace (``slurmft.rundir.atomic_write_json``);
``benchmarks/heartbeat_bench.py`` measures its cost per training step.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from slurmft.rundir import RunDir, atomic_write_json

FORMAT_VERSION = 2
DEFAULT_INTERVAL_S = 10.0
MAX_LABEL = 200  # characters of a phase's label kept in the file


@dataclass
class _Phase:
    label: str
    bound_s: float
    started: float  # monotonic


class Heartbeat:
    """Call ``beat(step)`` after every step on every rank; only node leaders write, in wall time.

    run_dir, node: the file is ``<run_dir>/heartbeat/<node>.json``. job_id, restart_count, attempt
    (torchrun's restart count of the workers): written in each beat. interval_s: seconds between
    writes at step boundaries (10; a step longer than that beats at each boundary). enabled: False
    on all but local rank 0 (True). clock: the wall clock written as ``time`` (``time.time``);
    monotonic: the clock step durations are measured on (``time.monotonic``, immune to NTP steps).
    """

    def __init__(self, run_dir: RunDir, node: str, *, job_id: str | None, restart_count: int,
                 attempt: int = 0,
                 interval_s: float = DEFAULT_INTERVAL_S, enabled: bool = True,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if not interval_s >= 0:
            raise ValueError(f"heartbeat interval_s must be >= 0 seconds, got {interval_s}")
        if not node or "/" in node or node.startswith("."):
            raise ValueError(f"node name {node!r} cannot name a heartbeat file")
        self.path = run_dir.heartbeat(node)
        self.node = node
        self.job_id = job_id
        self.restart_count = restart_count
        self.attempt = attempt
        self.interval_s = interval_s
        self.enabled = enabled
        self._clock = clock
        self._monotonic = monotonic
        self._mark = monotonic()           # where the step in progress started (phases excluded)
        self._last_write: float | None = None  # monotonic time of the last write
        self._stepped = False              # a step boundary was beaten in this segment
        self._step: int | None = None
        self._last_step_s: float | None = None
        self._busy_s: float | None = None
        self._phases: list[_Phase] = []    # innermost last
        self.writes = 0

    def due(self, step: int | None = None) -> bool:
        """Whether ``beat()`` at this moment writes the file (``step`` is not needed: the cadence
        is in wall time; accepted for callers of the step-based heartbeat)."""
        if not self.enabled:
            return False
        return (not self._stepped or self._last_write is None
                or self._monotonic() - self._last_write >= self.interval_s)

    def beat(self, step: int, *, force: bool = False,
             busy_s: float | Callable[[], float | None] | None = None) -> bool:
        """Record that ``step`` finished; write the file when due (or ``force``). True when written.

        ``busy_s``: this node's own time in the step outside collectives (e.g. compute before
        the step's first collective), or a function returning it, called only when the beat is
        written. In synchronous training every rank's wall step time is the same, so only a
        per-node time like this lets the watcher tell a straggler node."""
        now = self._monotonic()
        self._last_step_s = max(0.0, now - self._mark)
        self._mark = now
        self._step = step
        if not self.enabled or not (force or self.due()):
            return False
        self._stepped = True
        self._busy_s = busy_s() if callable(busy_s) else busy_s
        self._write(now)
        return True

    @contextlib.contextmanager
    def phase(self, label: str, bound_s: float) -> Iterator[None]:
        """Announce a phase that may keep this node from beating for up to ``bound_s`` seconds
        (a checkpoint save or load, an evaluation): one beat naming it as it starts, one as it
        ends. Its time does not count in the step it sits in. Phases nest (the innermost is
        announced; the outer one again, with what is left of its bound, when the inner ends)."""
        if not bound_s > 0:
            raise ValueError(f"heartbeat phase bound_s must be > 0 seconds, got {bound_s}")
        phase = _Phase(label[:MAX_LABEL], float(bound_s), self._monotonic())
        self._phases.append(phase)
        if self.enabled:
            self._write(phase.started)
        try:
            yield
        finally:
            now = self._monotonic()
            spent = now - phase.started
            self._phases = [p for p in self._phases if p is not phase]
            self._mark += spent          # the step around it resumes where it was
            for outer in self._phases:
                outer.started += spent   # as the step watchdog does: the inner phase had the time
            if self.enabled:
                self._write(now)

    def _write(self, now: float) -> None:
        record: dict = {
            "version": FORMAT_VERSION,
            "node": self.node,
            "job_id": self.job_id,
            "restart_count": self.restart_count,
            "attempt": self.attempt,
            "pid": os.getpid(),
            "step": self._step,
            "time": self._clock(),
            "last_step_s": self._last_step_s,
            "busy_s": self._busy_s,  # a phase's beats repeat the last step's
            "interval_s": self.interval_s,
        }
        if self._phases:
            phase = self._phases[-1]
            record["phase"] = phase.label
            record["phase_bound_s"] = max(1.0, phase.bound_s - (now - phase.started))
        atomic_write_json(self.path, record)
        self._last_write = now
        self.writes += 1
