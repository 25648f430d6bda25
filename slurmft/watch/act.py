"""The one place where the watcher changes anything in Slurm: requeue, exclude, start now, hold.

Each method runs one client operation and journals it as ``recovery_action`` (ok or not, with
Slurm's message; ``restart_action`` when it helps a planned end restart); errors propagate so
the caller records the step as not done and retries it next cycle. The caller records its intent in the run's state before calling.
"""

from __future__ import annotations

from typing import Callable, Sequence

from slurmft import journal, steppoint
from slurmft.slurm.client import SlurmClient, SlurmError
from slurmft.watch.detect import planned

Emit = Callable[..., None]


class Actor:
    def __init__(self, client: SlurmClient, emit: Emit) -> None:
        self.client = client
        self.emit = emit

    def _do(self, action: str, cause: str, nodes: Sequence[str], call: Callable[[], object],
            job_id: str) -> object:
        # Helping a planned end restart is no recovery: journaled apart (holding never is).
        kind = (journal.RESTART_ACTION if planned(cause) and action not in ("hold", "requeue_hold")
                else journal.RECOVERY_ACTION)
        steppoint.reached(f"watch.{action}", job_id)
        try:
            result = call()
        except SlurmError as exc:
            self.emit(kind, action=action, cause=cause, nodes=list(nodes), ok=False,
                      detail=str(exc)[:500])
            raise
        self.emit(kind, action=action, cause=cause, nodes=list(nodes), ok=True, detail="")
        return result

    def requeue(self, job_id: str, cause: str) -> bool:
        """State-based requeue (never a job that completed successfully); False when Slurm says
        it completed successfully."""
        return bool(self._do("requeue", cause, (), lambda: self.client.requeue(job_id), job_id))

    def exclude(self, job_id: str, cause: str, nodes: Sequence[str]) -> None:
        self._do("exclude", cause, nodes,
                 lambda: self.client.update_pending(job_id, exclude_nodes=list(nodes)), job_id)

    def readmit(self, job_id: str, cause: str, nodes: Sequence[str]) -> None:
        """Take nodes this watcher once excluded out of the job's ExcNodeList."""
        self._do("readmit", cause, nodes,
                 lambda: self.client.update_pending(job_id, readmit_nodes=list(nodes)), job_id)

    def start_now(self, job_id: str, cause: str) -> None:
        self._do("start_now", cause, (), lambda: self.client.update_pending(job_id, start_now=True), job_id)

    def set_down(self, node: str, cause: str, detail: str) -> None:
        self._do("set_down", cause, [node],
                 lambda: self.client.set_down(node, f"slurmft: watch: {detail}"), "")

    def resubmit(self, argv, cwd, env, cause: str) -> str:
        """Submit the forgotten job again; returns the new job id."""
        return str(self._do("resubmit", cause, (),
                            lambda: self.client.resubmit(argv, cwd=cwd, env=env), ""))

    def release(self, job_id: str, cause: str) -> None:
        """Release a job Slurm held after a failed launch (re-read first: never a user's or an
        admin's hold, never a cancelled job)."""
        self._do("release", cause, (), lambda: self.client.release_launch_hold(job_id), job_id)

    def hold(self, job_id: str, cause: str) -> None:
        self._do("hold", cause, (), lambda: self.client.hold(job_id), job_id)

    def requeue_hold(self, job_id: str, cause: str) -> bool:
        """An ended job back in the queue, held; False when Slurm says it completed."""
        return bool(self._do("requeue_hold", cause, (), lambda: self.client.requeue_hold(job_id), job_id))
