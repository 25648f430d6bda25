"""Preemption: SIGUSR2/SIGTERM set a flag; at a step boundary every rank agrees with ONE all-reduce.

Slurm delivers ``--signal=B:USR2@grace`` (time limit) and SIGTERM (preemption, scancel) to the
batch script, which forwards them to every process of the training step. A signal reaches
ranks at different moments, maybe between two steps on one rank and mid-step on another, so a
rank must not act on its own flag: ``should_stop()`` all-reduces MAX of the flag over the group,
and every rank gets the same answer at the same step. Then all ranks join one emergency save of
that step and exit with ``slurmft.exitcodes.REQUEUE``.

The agreement costs a collective and a host sync (``.item()``), so it does not run on every call
when steps are short: all ranks agree on the call count of the next agreement inside the agreement
itself. Each rank proposes how many calls to wait, enough to cover about ``check_interval_s`` (5 s)
at its own measured time per call and never more than ``check_every`` (10), and the ranks take the
smallest proposal (the same all-reduce MAX carries the flag and the negated proposals). The first
two calls always agree (the second measures the step time), so a signal is acted on within about
``check_interval_s`` or ``check_every`` steps, whichever comes first: 0.1 s steps agree every 10
steps, 60 s steps every step, and neither waits 10 minutes past the template's 120 s grace. A
fixed count of steps could not know the step time; per-rank clocks alone would let ranks disagree
on when to call the collective, and deadlock. Without a process group there is nobody to agree
with and the local flag answers at once. ``benchmarks/step_cost_bench.py`` measures the cost.

The handler only sets the flag; a second signal during the save sets it again and nothing else,
so it cannot interrupt or corrupt the save.

A rank whose launcher is gone is an orphan: under plain torchrun the ranks run in their own
sessions, so a signal to torchrun's process group kills torchrun (SIGUSR2's default action) and
never reaches them, and they would train on to the end against a run dir the user may already
have restarted. A daemon thread watches the parent pid (every ``parent_poll_s``, 0.5 s) and, when
the process that started this rank is gone (``os.getppid()`` changed), sets the same flag as a
signal: the ranks agree at the next boundary, save and exit 85 (requeue me). Not
``PR_SET_PDEATHSIG``: it fires when the *thread* that forked the rank ends, not the process.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from slurmft.config import load_section

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGUSR2, signal.SIGTERM)
ORPHANED = "launcher gone"  # the reason when the rank's launcher died (the parent watch)
SECTION = "preemption"


@dataclass(frozen=True)
class PreemptionConfig:
    """``[preemption]`` settings (slurmft.toml, ``SLURMFT_PREEMPTION_<FIELD>``, or overrides).

    check_every: the most steps between the ranks' agreements on "a signal arrived" in
      ``PreemptionHandler.should_stop()`` (10; each is one all-reduce and a host sync; ``Run`` agrees
      every step for free on ``report()``'s all-reduce).
    check_interval_s: and about the most seconds between them, judged from the steps' measured
      time (5.0): slow steps agree more often than every ``check_every``-th.
    """

    check_every: int = 10  # the most steps between agreements (each one all-reduce + host sync)
    check_interval_s: float = 5.0  # ... and about the most seconds

    def __post_init__(self) -> None:
        _check_cadence(self.check_every, self.check_interval_s)

    @classmethod
    def load(cls, config_file: str | Path | None = None, *, environ: Mapping[str, str] | None = None,
             **overrides: Any) -> "PreemptionConfig":
        """Defaults < ``[preemption]`` of the config file < environment < ``overrides``."""
        return load_section(cls, SECTION, config_file=config_file, environ=environ, overrides=overrides)


def _check_cadence(check_every: int, check_interval_s: float) -> None:
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1, got {check_every}")
    if not (isinstance(check_interval_s, (int, float)) and math.isfinite(check_interval_s)
            and check_interval_s > 0):
        raise ValueError(f"check_interval_s must be a finite number > 0, got {check_interval_s!r}")


class PreemptionHandler:
    """Installs the flag-setting handlers; ``should_stop()`` is the collective decision.

    signals: the signals that mean "save and requeue" (USR2, TERM). process_group: who agrees
    (default: the world). device: where the flag is all-reduced ("cpu"; a CUDA device for NCCL).
    check_every, check_interval_s: the most calls of ``should_stop()`` between two all-reduces (10),
    and about the most seconds at the measured time per call (5.0; both ``[preemption]``).
    parent_poll_s: how often the parent-watch thread checks that the process which started this
    rank is still its parent (0.5 s; None or 0: no watch).
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = DEFAULT_SIGNALS, *,
                 process_group: Any = None, device: torch.device | str = "cpu",
                 check_every: int = PreemptionConfig.check_every,
                 check_interval_s: float = PreemptionConfig.check_interval_s,
                 parent_poll_s: float | None = 0.5) -> None:
        _check_cadence(check_every, check_interval_s)
        self.signals = tuple(signals)
        self.process_group = process_group
        self.device = torch.device(device)
        self.check_every = check_every
        self.check_interval_s = float(check_interval_s)
        self.received: signal.Signals | None = None
        self.count = 0
        self.agreements = 0  # collectives run so far
        self._previous: dict[signal.Signals, Callable | int | None] = {}
        self._calls = 0
        self._next_agreement = 1  # the call that agrees next: the first two calls always do
        self._last_agreement: tuple[int, float] | None = None  # (call, time.monotonic() at its end)
        self.parent_poll_s = parent_poll_s
        self.orphaned = False  # the launcher that started this rank is gone
        self._stop_watch = threading.Event()
        self._watch: threading.Thread | None = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only record; everything else happens at the next step boundary.
        self.received = signal.Signals(signum)
        self.count += 1

    def install(self) -> "PreemptionHandler":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler.install() must run in the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        parent = os.getppid()
        if self.parent_poll_s and parent > 1 and self._watch is None:  # started by init: nothing to watch
            self._stop_watch.clear()
            self._watch = threading.Thread(target=self._watch_parent, args=(parent, self.parent_poll_s),
                                           name="slurmft-parent-watch", daemon=True)
            self._watch.start()
        return self

    def _watch_parent(self, parent: int, poll_s: float) -> None:
        while not self._stop_watch.wait(poll_s):
            if os.getppid() != parent:  # reparented: the launcher died
                self.orphaned = True
                return

    def uninstall(self) -> None:
        self._stop_watch.set()
        if self._watch is not None:
            self._watch.join(timeout=5)
            self._watch = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    @property
    def requested(self) -> bool:
        """This rank saw a signal or lost its launcher (local view; use ``should_stop`` to decide)."""
        return self.received is not None or self.orphaned

    @property
    def reason(self) -> str | None:
        """What this rank saw: the signal's name, "launcher gone", or None."""
        if self.received is not None:
            return self.received.name
        return ORPHANED if self.orphaned else None

    @property
    def reasons(self) -> tuple[str, ...]:
        """Every ``reason`` this handler can give, in a fixed order (the same on every rank)."""
        return (*(sig.name for sig in self.signals), ORPHANED)

    def seen(self) -> list[float]:
        """This rank's ``reason`` as one 0/1 slot per ``reasons``: summed over the ranks (``Run``'s
        ``report()``), they say what any rank saw, not only this one."""
        return [1.0 if name == self.reason else 0.0 for name in self.reasons]

    def should_stop(self, *, force: bool = False) -> bool:
        """Collective: True on every rank when any rank saw a signal. Call on every rank, every step.

        The all-reduce runs on the calls the ranks agreed on in the previous one (module docstring)
        or when ``force`` is given on every rank; other calls return False without communicating.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return self.requested  # a single process: its own flag is the decision
        self._calls += 1
        if not force and self._calls < self._next_agreement:
            return False
        wait = 1  # no measurement yet: agree again at the next call, which measures
        if self._last_agreement is not None:
            # The time since the last agreement ended: this rank's steps, not the others' lateness.
            calls, since = self._calls - self._last_agreement[0], time.monotonic() - self._last_agreement[1]
            per_call = since / calls if calls > 0 else 0.0
            wait = (self.check_every if per_call <= 0
                    else max(1, min(self.check_every, int(self.check_interval_s / per_call))))
        self.agreements += 1
        # One MAX carries both: the flag, and the smallest proposal as the largest negated one.
        both = torch.tensor([1 if self.requested else 0, -wait], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.process_group)
        flag, negated = both.tolist()
        self._next_agreement = self._calls - negated
        self._last_agreement = (self._calls, time.monotonic())
        return bool(flag)
