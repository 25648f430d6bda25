"""The one background thread that persists a CheckpointManager's saves, one at a time.

It is started once and then fed through a queue, rather than a new thread per save: starting a
thread makes ``save()`` wait for the new thread to be scheduled, and that thread goes straight
into ``dcp.save``'s Python code holding the GIL, so the training thread got it back only at the
next forced switch (up to ``sys.getswitchinterval()``, 5 ms) — measured as 1-3 ms of extra
blocking per save. A waiting thread woken by a queue leaves the training thread running.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)


class SaveThread:
    def __init__(self, name: str = "slurmft-ckpt") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a submitted job has not finished yet."""
        return not self._idle.is_set()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` in the background; the caller must ``wait()`` for the previous one first."""
        if not self._thread.is_alive():
            raise RuntimeError("the checkpoint save thread has been stopped")
        if self.busy:
            raise RuntimeError("a checkpoint save is still in flight")
        self._idle.clear()
        self._jobs.put(job)

    def wait(self) -> None:
        """Block until the submitted job (if any) has finished."""
        self._idle.wait()

    def stop(self) -> None:
        """Finish the job in flight, then end the thread and join it."""
        if self._thread.is_alive():
            self.wait()
            self._jobs.put(None)
            self._thread.join()

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
