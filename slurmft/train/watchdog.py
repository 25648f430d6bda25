"""Step-time watchdog: a hung step becomes a failure Slurm can see, with every thread's stack.

A daemon thread watches the step in progress (between ``step_started()`` and ``step_finished()``).
When it runs past its deadline — an explicit ``timeout_s``, or after ``warmup_steps`` observed
steps ``safety_factor`` x the median observed step time (never below ``min_timeout_s``) — the
thread dumps all Python threads' stacks with ``faulthandler`` to stderr (the job log), calls the
optional ``on_fire`` hook (best effort: e.g. a journal line), and ends the process with
``os._exit(slurmft.exitcodes.HANG)``: a rank stuck inside a collective cannot be unwound, and
``os._exit`` does not wait for it. Time between steps (checkpoint saves) is not watched.
"""

from __future__ import annotations

import collections
import faulthandler
import os
import statistics
import sys
import threading
import time
from typing import Callable, TextIO

from slurmft import exitcodes


class StepWatchdog:
    """Ends a hung step with stacks and exit 87 (see the module docstring); ``start()`` it.

    timeout_s: a step's limit (None: adaptive). safety_factor: adaptive limit = this x the median
    step (10). warmup_steps: steps observed before the adaptive limit applies (5). min_timeout_s:
    floor of the adaptive limit (60). history: steps in the median (50). on_fire: called with the
    message before exiting (None). stream: where stacks go (stderr). exit_code: (87, HANG).
    poll_s: how often the thread looks (default: a tenth of the limit, at most 1 s).
    """

    def __init__(self, *, timeout_s: float | None = None, safety_factor: float = 10.0,
                 warmup_steps: int = 5, min_timeout_s: float = 60.0, history: int = 50,
                 on_fire: Callable[[str], None] | None = None, stream: TextIO | None = None,
                 exit_code: int = exitcodes.HANG, poll_s: float | None = None,
                 _exit: Callable[[int], None] = os._exit) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"watchdog timeout_s must be > 0, got {timeout_s}")
        if safety_factor <= 1 or warmup_steps < 1 or min_timeout_s <= 0:
            raise ValueError("watchdog needs safety_factor > 1, warmup_steps >= 1, min_timeout_s > 0")
        self.timeout_s = timeout_s
        self.safety_factor = safety_factor
        self.warmup_steps = warmup_steps
        self.min_timeout_s = min_timeout_s
        self.on_fire = on_fire
        self.stream = stream
        self.exit_code = exit_code
        self._exit = _exit
        self._durations: collections.deque[float] = collections.deque(maxlen=history)
        self._lock = threading.Lock()
        self._step: int | None = None
        self._started_at = 0.0
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._thread: threading.Thread | None = None

    def deadline_s(self) -> float | None:
        """The current step timeout, or None while warming up without an explicit timeout."""
        if self.timeout_s is not None:
            return self.timeout_s
        if len(self._durations) < self.warmup_steps:
            return None
        return max(self.min_timeout_s, self.safety_factor * statistics.median(self._durations))

    def start(self) -> "StepWatchdog":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="slurmft-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "StepWatchdog":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def step_started(self, step: int) -> None:
        with self._lock:
            self._step, self._started_at = step, time.monotonic()

    def step_finished(self) -> float:
        """Mark the step done; returns its duration, which feeds the adaptive deadline."""
        with self._lock:
            duration = time.monotonic() - self._started_at
            self._step = None
        self._durations.append(duration)
        return duration

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                step, started = self._step, self._started_at
            limit = self.deadline_s()
            poll = self._poll_s or (min(1.0, limit / 10) if limit else 1.0)
            if step is not None and limit is not None and time.monotonic() - started > limit:
                self._fire(step, time.monotonic() - started, limit)
                return
            self._stop.wait(poll)

    def _fire(self, step: int, elapsed: float, limit: float) -> None:
        stream = self.stream or sys.stderr
        message = (f"slurmft watchdog: step {step} has run {elapsed:.1f} s, over its {limit:.1f} s "
                   f"timeout; dumping all thread stacks and exiting with {exitcodes.describe(self.exit_code)}")
        try:
            print(message, file=stream, flush=True)
            faulthandler.dump_traceback(file=stream, all_threads=True)
            stream.flush()
        except (OSError, ValueError):
            pass
        if self.on_fire is not None:
            try:
                self.on_fire(message)
            except Exception as exc:  # the exit below must happen whatever the hook does
                print(f"slurmft watchdog: on_fire hook failed: {exc}", file=stream, flush=True)
        self._exit(self.exit_code)
