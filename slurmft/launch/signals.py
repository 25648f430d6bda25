"""Signals that reach the launcher, and where they go.

Slurm's ``--signal=B:USR2@<s>`` (time limit; it may come up to 60 s early) and a TERM
(preemption, ``scancel``, an outside requeue) reach the batch script, i.e. this launcher. The
handler only records them. While training runs, each is forwarded as USR2 to the launcher's own
``srun`` child (srun passes it to every process of ITS step, nothing else), and re-sent every
``SLURMFT_RESIGNAL_S`` (floor 1 s) until the step ends: a rank still importing torch has no
handler yet. The launcher never signals by job id, so a signal for one run cannot land in the
next.

A signal that arrives BEFORE training starts is checked against what Slurm says about this run
(``is_for_this_run``): a run that is RUNNING, with this restart count, not completing and not
near its time limit was not told to stop by Slurm; the signal is journaled and ignored.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from slurmft.launch.identity import JobIdentity
from slurmft.slurm.client import Job, JobState

WATCHED = (signal.SIGUSR2, signal.SIGTERM)
# --signal=B:USR2@120 (the template's) may arrive up to 60 s before its time (sbatch(1)).
TIME_LIMIT_WINDOW_S = 120 + 60 + 30


@dataclass
class SignalLog:
    """Signals received, in order (name, monotonic time)."""

    received: list[tuple[str, float]] = field(default_factory=list)

    def handler(self, signum: int, frame: object) -> None:
        self.received.append((signal.Signals(signum).name.removeprefix("SIG"), time.monotonic()))

    def install(self) -> None:
        for sig in WATCHED:
            signal.signal(sig, self.handler)

    def take(self) -> list[str]:
        names = [name for name, _ in self.received]
        self.received.clear()
        return names


def is_for_this_run(job: Job | None, identity: JobIdentity, now: datetime | None = None
                    ) -> tuple[bool, str]:
    """(act on it?, why) for a signal received before training started."""
    if job is None:
        return True, "Slurm cannot be asked (no scontrol): taken as meant for this run"
    if job.state is not JobState.RUNNING or job.completing:
        return True, f"Slurm is ending this run (JobState={job.state.value}" + \
            (" COMPLETING)" if job.completing else ")")
    if job.restart_count != identity.restart_count:
        return True, f"Slurm counts {job.restart_count} restarts, this run is {identity.restart_count}"
    if job.time_limit_end is not None:
        now = now or datetime.now(timezone.utc)
        end = job.time_limit_end
        end = end if end.tzinfo else end.replace(tzinfo=timezone.utc)
        left = (end - now).total_seconds()
        if left <= TIME_LIMIT_WINDOW_S:
            return True, f"the time limit is {left:.0f} s away"
    return False, (f"this run is RUNNING (restart {identity.restart_count}) and not near its time "
                   "limit: a signal meant for an earlier run or sent by mistake")
