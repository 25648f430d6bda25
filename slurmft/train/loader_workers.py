"""A ``worker_init_fn`` that keeps a DataLoader's worker processes alive through a preemption.

Slurm signals every process of a step under ``proctrack/cgroup`` and ``linuxproc``: a preemption's
TERM, and the USR2 the launcher forwards, reach a rank's DataLoader workers too, not only the rank.
The rank only sets a flag and saves at the next agreed step boundary (``preemption.py``), so it
usually draws another batch first; but torch's worker re-raises TERM's default action, and a
spawned worker has no handler for USR2, so the worker dies and torch raises ``RuntimeError:
DataLoader worker (pid(s) ...) exited unexpectedly`` in the rank, which then fails instead of
saving. So the worker ignores USR2, and lets the first TERM pass: Slurm sends one (a preemption,
the time limit, ``scancel``; then KILL after its grace). A second TERM ends it as before: that is
how the rank's ``multiprocessing`` ends its daemonic workers at exit (terminate, then join without
a bound), so a worker that ignored every TERM would hang a rank that exits without closing its
loader, e.g. after its emergency save. Otherwise the worker ends as it always does: at the loader's
shutdown, or when its watchdog sees the rank gone.

``DataLoader(..., worker_init_fn=slurmft.train.loader_worker_init)``, or
``LoaderWorkerInit(your_fn)`` to run your own after it. torch calls it in each worker after its own
signal handlers are set, so it overrides them. Picklable (a module-level class), for ``spawn`` and
``forkserver`` workers. Not covered: multiprocessing's resource tracker and fork server (see
docs/limitations.md).
"""

from __future__ import annotations

import signal
from typing import Callable

from types import FrameType


def _let_the_first_term_pass(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the next one ends the worker


class LoaderWorkerInit:
    """In a DataLoader worker: ignore USR2 and the first TERM, then call ``then(worker_id)`` if given."""

    def __init__(self, then: Callable[[int], object] | None = None) -> None:
        if then is not None and not callable(then):
            raise TypeError(f"LoaderWorkerInit: 'then' must be callable, got {type(then).__name__}")
        self.then = then

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _let_the_first_term_pass)
        if self.then is not None:
            self.then(worker_id)

    def __repr__(self) -> str:
        return f"LoaderWorkerInit({self.then!r})" if self.then is not None else "loader_worker_init"


loader_worker_init = LoaderWorkerInit()
