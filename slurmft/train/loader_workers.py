"""A ``worker_init_fn`` that keeps a DataLoader's worker processes alive through a preemption.

Slurm signals every process of a step under ``proctrack/cgroup`` and ``linuxproc``: a preemption's
TERM, and the USR2 the launcher forwards, reach a rank's DataLoader workers too, not only the rank.
The rank only sets a flag and saves at the next agreed step boundary (``preemption.py``), so it
usually draws another batch first; but torch's worker re-raises TERM's default action, and a
spawned worker has no handler for USR2, so the worker dies and torch raises ``RuntimeError:
DataLoader worker (pid(s) ...) exited unexpectedly`` in the rank, which then fails instead of
saving. So the worker ignores USR2, and a TERM from anyone but its rank: a thread of its own takes
every TERM (blocked in the worker, ``sigwaitinfo``), and ends the worker at once, exit 0, when the
rank sent it, as torch's own handler does: that is how the rank's ``multiprocessing`` ends its
daemonic workers at its exit (terminate, then join without a bound), so a worker that ignored every
TERM would hang a rank that exits without closing its loader, e.g. after its emergency save.
Otherwise the worker ends as it always does: at the loader's shutdown, when its watchdog sees the
rank gone, or killed by Slurm at the end of the grace time.

``DataLoader(..., worker_init_fn=slurmft.train.loader_worker_init)``, or ``LoaderWorkerInit(your_fn)``
to run your own after it; torch calls it in each worker after setting its own handlers. Picklable
(a module-level class), but only a ``fork`` worker is kept alive: a spawned one already runs a
second thread when the init runs, which does not block TERM. A program the worker starts inherits
the blocked TERM (``Popen.terminate()`` does not end it). Not covered either: multiprocessing's
resource tracker and fork server (docs/limitations.md).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable


def _take_terms(rank: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == rank:
            os._exit(0)  # the rank ends its worker: as torch's own TERM handler does


class LoaderWorkerInit:
    """In a DataLoader worker: ignore USR2, and a TERM unless its rank sent it; then ``then(worker_id)``."""

    def __init__(self, then: Callable[[int], object] | None = None) -> None:
        if then is not None and not callable(then):
            raise TypeError(f"LoaderWorkerInit: 'then' must be callable, got {type(then).__name__}")
        self.then = then

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        # Blocked before the thread starts, so that every thread of the worker inherits the mask
        # and only the thread's sigwaitinfo takes a TERM.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=_take_terms, args=(os.getppid(),), name="slurmft-loader-term",
                         daemon=True).start()
        if self.then is not None:
            self.then(worker_id)

    def __repr__(self) -> str:
        return f"LoaderWorkerInit({self.then!r})" if self.then is not None else "loader_worker_init"


loader_worker_init = LoaderWorkerInit()
