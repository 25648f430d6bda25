"""A job Slurm itself held after its launch or its prolog failed on a node ("launch failed
requeued held"): which node (from accounting's record of the failed run, and the drain Slurm set
on a node whose prolog failed: the controller's record of the requeued job names none) and the
release, once that node is excluded. Never a job held by its user or an admin, never a cancelled
one: the client re-reads the job before it releases (``slurm.policy.release_launch_hold``).
``RunWatch`` owns the recovery's state; this module makes the two calls and says how they went.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

from slurmft import journal
from slurmft.slurm.client import Job, JobCancelled, SlurmError
from slurmft.slurm.policy import held_after_failed_launch
from slurmft.watch.act import Actor
from slurmft.watch.detect import Finding
from slurmft.watch.state import DONE, TODO, Recovery, RunState

log = logging.getLogger(__name__)
RELEASED, RETRY, CANCELLED, LEFT = "released", "retry", "cancelled", "left"
# Tries at a release that fails while Slurm still holds the job (no answer...).
MAX_RELEASE_ATTEMPTS = 3


class LaunchHolds:
    def __init__(self, actor: Actor, emit: Callable[..., None], job_id: str, lookup_cycles: int,
                 state: RunState) -> None:
        self.actor, self.emit, self.job_id = actor, emit, job_id
        self.lookup_cycles = lookup_cycles
        # Cycles spent waiting for accounting's record of the failed launch, kept in the run's
        # state: under cron each `--once` is a new watcher, and a count it forgot never ended.
        self.state = state

    def locate(self, finding: Finding, job: Job) -> Finding | None:
        """The launch-failure finding with the nodes it failed on (a failed prolog's node, else
        the batch launch's); None to wait a cycle for accounting (it lags the controller by
        seconds), at most ``lookup_cycles`` cycles: then the finding as it is (released without
        an exclusion, said in a warning)."""
        self.state.launch_lookups += 1
        try:
            nodes, why = self.actor.client.failed_launch_nodes(job)
        except SlurmError as exc:
            log.error("job %s: could not read accounting for its failed launch: %s", self.job_id, exc)
            nodes, why = (), ""
        if not nodes and self.state.launch_lookups < self.lookup_cycles:
            return None
        self.state.launch_lookups = 0
        if not nodes:
            self.emit(journal.WATCH_WARNING, what="launch_node_unknown", nodes=[],
                      detail="accounting names no node for the failed launch: released without "
                             "an exclusion")
            return finding
        return replace(finding, nodes=tuple(nodes),
                       evidence=f"{finding.evidence} on {', '.join(nodes)} ({why})")

    def release(self, rec: Recovery, job: Job) -> str:
        """Release the job (its node excluded by now): RELEASED, RETRY (next cycle), CANCELLED,
        or LEFT: held since by its user or an admin (the client's re-read refused it), or refused
        again and again: left as it is, said once."""
        try:
            self.actor.release(job.job_id, rec.cause)
        except JobCancelled:
            return CANCELLED
        except SlurmError as exc:
            rec.release_attempts += 1
            if rec.release_attempts < MAX_RELEASE_ATTEMPTS and held_after_failed_launch(job):
                rec.release = TODO
                return RETRY
            self.emit(journal.WATCH_WARNING, what="not_released", nodes=[],
                      detail=f"not releasing the job: {exc}")
            return LEFT
        rec.release = DONE
        return RELEASED
