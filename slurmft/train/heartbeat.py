"""Per-node heartbeat: ``<run_dir>/heartbeat/<node>.json``, written by local rank 0 every few steps.

The watcher reads it to tell a slow job from a hung one: step, wall time, and the recent step
duration (mean over the steps since the previous beat), and ``every`` (steps between beats: the
watcher's hang timeout allows for the time between two beats). The write is one small atomic file
replace (``slurmft.rundir.atomic_write_json``); ``benchmarks/heartbeat_bench.py`` measures its cost
per training step.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from slurmft.rundir import RunDir, atomic_write_json

FORMAT_VERSION = 1


class Heartbeat:
    """Call ``beat(step)`` after every step on every rank; only node leaders write, every k steps.

    run_dir, node: the file is ``<run_dir>/heartbeat/<node>.json``. job_id, restart_count: written
    in each beat. every: steps between writes (10). enabled: False on all but local rank 0 (True).
    clock: wall-clock source (``time.time``).
    """

    def __init__(self, run_dir: RunDir, node: str, *, job_id: str | None, restart_count: int,
                 every: int = 10, enabled: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        if every < 1:
            raise ValueError(f"heartbeat every must be >= 1 step, got {every}")
        if not node or "/" in node or node.startswith("."):
            raise ValueError(f"node name {node!r} cannot name a heartbeat file")
        self.path = run_dir.heartbeat(node)
        self.node = node
        self.job_id = job_id
        self.restart_count = restart_count
        self.every = every
        self.enabled = enabled
        self._clock = clock
        self._last_time: float | None = None
        self._last_step: int | None = None
        self.writes = 0

    def due(self, step: int) -> bool:
        """Whether ``beat(step)`` writes the file."""
        return self.enabled and step % self.every == 0

    def beat(self, step: int, *, force: bool = False, busy_s: float | None = None) -> bool:
        """Record that ``step`` finished; write the file on every k-th step. True when written.

        ``busy_s``: this node's own time in the step outside collectives (e.g. compute before
        the step's first collective). In synchronous training every rank's wall step time is the
        same, so only a per-node time like this lets the watcher tell a straggler node."""
        if not self.enabled or (not force and step % self.every):
            return False
        now = self._clock()
        recent = None
        if self._last_time is not None and self._last_step is not None and step > self._last_step:
            recent = (now - self._last_time) / (step - self._last_step)
        atomic_write_json(self.path, {
            "version": FORMAT_VERSION,
            "node": self.node,
            "job_id": self.job_id,
            "restart_count": self.restart_count,
            "pid": os.getpid(),
            "step": step,
            "time": now,
            "recent_step_s": recent,
            "busy_s": busy_s,
            "every": self.every,
        })
        self._last_time, self._last_step = now, step
        self.writes += 1
        return True
