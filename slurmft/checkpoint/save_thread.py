"""The one background thread that persists a CheckpointManager's saves, one at a time.

It is started once and then fed through a queue, rather than a new thread per save: starting a
thread makes ``save()`` wait for the new thread to be scheduled, and that thread goes straight
into ``dcp.save``'s Python code holding the GIL, so the training thread got it back only at the
next forced switch (up to ``sys.getswitchinterval()``, 5 ms) — measured as 1-3 ms of extra
blocking per save. A waiting thread woken by a queue leaves the training thread running.

Every wait on it is bounded: ``wait(timeout_s)`` raises :class:`SaveWaitTimeout` naming the save
it waited for, and ``stop(timeout_s)`` gives up on a save that does not finish in time (a peer
died inside one of its collectives) and leaves the thread behind instead of blocking the exit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class SaveWaitTimeout(TimeoutError):
    """A save did not finish within the bound; the message names the save and the bound."""


class SaveThread:
    def __init__(self, name: str = "slurmft-ckpt") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._what = ""
        self._since = 0.0
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a submitted job has not finished yet."""
        return not self._idle.is_set()

    @property
    def in_flight(self) -> str | None:
        """What the job in flight is (as given to ``submit``), or None when idle."""
        return self._what if self.busy else None

    def submit(self, job: Callable[[], None], *, what: str = "checkpoint save") -> None:
        """Run ``job`` in the background; the caller must ``wait()`` for the previous one first."""
        if self._abandoned or not self._thread.is_alive():
            raise RuntimeError("the checkpoint save thread has been stopped")
        if self.busy:
            raise RuntimeError(f"a checkpoint save is still in flight: {self._what}")
        self._what, self._since = what, time.monotonic()
        self._idle.clear()
        self._jobs.put(job)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the submitted job (if any) has finished, at most ``timeout_s`` seconds.

        Raises :class:`SaveWaitTimeout` naming the job when it is still running after the bound.
        ``None`` waits without a bound (only for callers that have their own, e.g. tests).
        """
        if self._idle.wait(timeout_s):
            return
        raise SaveWaitTimeout(
            f"{self._what} still in flight after waiting {timeout_s:g} s "
            f"(running for {time.monotonic() - self._since:.0f} s): the background save is stuck, "
            f"likely on a dead peer's collective or a hung filesystem")

    def stop(self, timeout_s: float | None = None) -> bool:
        """Finish the job in flight (waiting at most ``timeout_s``), then end the thread and join it.

        Returns False when the job did not finish in time: the thread is then left behind (a
        daemon, stuck where the job is) and the caller goes on, e.g. to exit the process.
        """
        if self._abandoned:
            return False
        if self._thread.is_alive():
            try:
                self.wait(timeout_s)
            except SaveWaitTimeout as exc:
                self._abandoned = True
                log.error("giving up on the checkpoint save at exit: %s", exc)
                return False
            self._jobs.put(None)
            self._thread.join(timeout_s)
        return True

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a job reports its own failures; this is a last resort
                log.exception("checkpoint save thread: unexpected error")
            finally:
                job = None  # do not keep the finished save's state (and its manager) alive while idle
                self._idle.set()
