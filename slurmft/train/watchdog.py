"""Step watchdog: a hung step (or checkpoint phase) becomes a failure Slurm can see, with stacks.

A daemon thread watches what the training thread is doing: the step in progress (between
``step_started()`` and ``step_finished()``) and any phase marked with ``phase(label, timeout_s)``
(``CheckpointManager`` marks its saves and loads this way when given the watchdog, so time spent
saving between steps is watched too). A step's deadline is an explicit ``timeout_s``, or after
``warmup_steps`` observed steps ``safety_factor`` x the median observed step time (never below
``min_timeout_s``); a phase has its own timeout, and the step's clock is paused while a phase
nested in it runs.

When a deadline passes, the process ends with ``os._exit(slurmft.exitcodes.HANG)``: a rank stuck
inside a collective cannot be unwound, and ``os._exit`` does not wait for it. Before that, a
reporting thread writes a message and every thread's stack (``faulthandler``) to stderr (the job
log) and calls the optional ``on_fire`` hook (e.g. a journal line), bounded by
``report_timeout_s`` (:mod:`slurmft.train.hard_exit`: the filesystem may be what hangs).
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TextIO

from slurmft import exitcodes
from slurmft.train.hard_exit import exit_after_report

# The thread looks every poll, and also just past the deadline in sight: a hang is ended at its
# deadline, not up to a poll (1 s) after it (0.5 s on average of every in-place hang restart).
DEADLINE_SLACK_S = 0.01


@dataclass
class _Watch:
    label: str
    started: float
    timeout_s: float | None  # None: the adaptive step deadline


class StepWatchdog:
    """Ends a hung step with stacks and exit 87 (see the module docstring); ``start()`` it.

    timeout_s: a step's limit (None: adaptive). safety_factor: adaptive limit = this x the median
    step (10). warmup_steps: steps observed before the adaptive limit applies (5). min_timeout_s:
    floor of the adaptive limit (60). history: steps in the median (50). on_fire: called with the
    message before exiting (None). stream: where stacks go (stderr). exit_code: (87, HANG).
    poll_s: how often the thread looks (default: a tenth of the limit, at most 1 s), and again
    just past the watched deadline.
    report_timeout_s: longest the exit waits for the message, stacks and ``on_fire`` (10).
    """

    def __init__(self, *, timeout_s: float | None = None, safety_factor: float = 10.0,
                 warmup_steps: int = 5, min_timeout_s: float = 60.0, history: int = 50,
                 on_fire: Callable[[str], None] | None = None, stream: TextIO | None = None,
                 exit_code: int = exitcodes.HANG, poll_s: float | None = None,
                 report_timeout_s: float = 10.0,
                 _exit: Callable[[int], None] = os._exit) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"watchdog timeout_s must be > 0, got {timeout_s}")
        if safety_factor <= 1 or warmup_steps < 1 or min_timeout_s <= 0:
            raise ValueError("watchdog needs safety_factor > 1, warmup_steps >= 1, min_timeout_s > 0")
        if report_timeout_s <= 0:
            raise ValueError(f"watchdog report_timeout_s must be > 0, got {report_timeout_s}")
        self.timeout_s = timeout_s
        self.safety_factor = safety_factor
        self.warmup_steps = warmup_steps
        self.min_timeout_s = min_timeout_s
        self.on_fire = on_fire
        self.stream = stream
        self.exit_code = exit_code
        self.report_timeout_s = report_timeout_s
        self._exit = _exit
        self._durations: collections.deque[float] = collections.deque(maxlen=history)
        self._lock = threading.Lock()
        self._watches: list[_Watch] = []  # innermost last
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
            self._watches = [w for w in self._watches if not w.label.startswith("step ")]
            self._watches.insert(0, _Watch(f"step {step}", time.monotonic(), None))

    def step_finished(self) -> float:
        """Mark the step done; returns its duration (phases nested in it excluded), which feeds
        the adaptive deadline."""
        with self._lock:
            steps = [w for w in self._watches if w.label.startswith("step ")]
            self._watches = [w for w in self._watches if not w.label.startswith("step ")]
        duration = time.monotonic() - steps[0].started if steps else 0.0
        self._durations.append(duration)
        return duration

    @property
    def watching(self) -> str | None:
        """What is being watched now (the innermost step or phase), or None."""
        with self._lock:
            return self._watches[-1].label if self._watches else None

    @contextlib.contextmanager
    def phase(self, label: str, timeout_s: float) -> Iterator[None]:
        """Watch ``label`` (e.g. "checkpoint save of step 200") for at most ``timeout_s`` seconds.

        A step in progress around it is paused meanwhile: its clock resumes when the phase ends.
        """
        if timeout_s <= 0:
            raise ValueError(f"watchdog phase timeout_s must be > 0, got {timeout_s}")
        watch = _Watch(label, time.monotonic(), timeout_s)
        with self._lock:
            self._watches.append(watch)
        try:
            yield
        finally:
            spent = time.monotonic() - watch.started
            with self._lock:
                self._watches = [w for w in self._watches if w is not watch]
                for outer in self._watches:
                    outer.started += spent

    def _current(self) -> tuple[_Watch, float] | None:
        """The innermost watch and its limit, or None when nothing is watched (or warming up)."""
        with self._lock:
            watch = self._watches[-1] if self._watches else None
            if watch is None:
                return None
            watch = _Watch(watch.label, watch.started, watch.timeout_s)
        limit = watch.timeout_s if watch.timeout_s is not None else self.deadline_s()
        return None if limit is None else (watch, limit)

    def _run(self) -> None:
        while not self._stop.is_set():
            current = self._current()
            limit = current[1] if current else self.deadline_s()
            poll = self._poll_s or (min(1.0, limit / 10) if limit else 1.0)
            if current is not None and time.monotonic() - current[0].started > current[1]:
                watch, limit = current
                self._fire(watch.label, time.monotonic() - watch.started, limit)
                return
            self._stop.wait(self._next_look(current, poll, time.monotonic()))

    @staticmethod
    def _next_look(current: tuple[_Watch, float] | None, poll: float, now: float) -> float:
        """Seconds until the thread looks again: the poll, or just past the deadline in sight
        when that comes first (a hang ends at its deadline, not up to a poll after it)."""
        if current is None:
            return poll
        watch, limit = current
        return min(poll, max(watch.started + limit - now, 0.0) + DEADLINE_SLACK_S)

    def _fire(self, label: str, elapsed: float, limit: float) -> None:
        message = (f"slurmft watchdog: {label} has run {elapsed:.1f} s, over its {limit:.1f} s "
                   f"timeout; dumping all thread stacks and exiting with {exitcodes.describe(self.exit_code)}")
        exit_after_report(self.exit_code, lambda: self._report(message),
                          report_timeout_s=self.report_timeout_s, who="slurmft watchdog", _exit=self._exit)

    def _report(self, message: str) -> None:
        stream = self.stream or sys.stderr
        try:
            print(message, file=stream, flush=True)
            faulthandler.dump_traceback(file=stream, all_threads=True)
            stream.flush()
        except (OSError, ValueError):
            pass
        if self.on_fire is not None:
            try:
                self.on_fire(message)
            except Exception as exc:  # the exit must happen whatever the hook does
                try:
                    print(f"slurmft watchdog: on_fire hook failed: {exc}", file=stream, flush=True)
                except (OSError, ValueError):
                    pass
