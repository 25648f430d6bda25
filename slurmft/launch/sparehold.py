"""``python -m slurmft.launch.sparehold``: the batch script of a spare job (``refill``).

It trains nothing: it holds its one node for the training job's launcher, which starts the
node's task here as a step of this job (``srun --jobid``). The launcher cancels it when it is
done with it; this process is the bound for when the launcher cannot: it ends the job by itself
once the training job's launcher is gone or no longer counts on it:

  - the batch host's alive file (its task beats every second while the launcher runs) has not
    moved for ``max(PULSE_MIN_S, 6 x SLURMFT_NODE_SILENT_S)``: the launcher died with its node,
    or the job ended or was requeued and nothing started again;
  - ``allocation.json`` is the training job's and has not listed this job among its spare jobs
    for ``UNLISTED_S`` (the launcher lists a spare job as soon as sbatch answers): a new launcher
    (the job requeued) has spares of its own;
  - ``allocation.json`` lists this node as fenced: the launcher is done with it (and cancels the
    job itself; this is for a cancel that did not reach Slurm).

Every wait has its bound; what it reads is the user's run dir, checked (``slurmft.allocation``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable, Mapping

from slurmft import allocation
from slurmft.launch import refill
from slurmft.launch.liveness import read_beat
from slurmft.rundir import RunDir

POLL_S = 5.0
PULSE_MIN_S = 60.0
UNLISTED_S = 120.0
STARTUP_S = 300.0    # the batch host's first beat may come this late after the job was submitted


def log(line: str) -> None:
    print(f"slurmft.launch.sparehold: {line}", file=sys.stderr, flush=True)


class Hold:
    """Whether the spare job is still wanted, judged on this node's monotonic clock."""

    def __init__(self, run_dir: RunDir, main_job: str, own_job: str, host_alive: Path,
                 silent_s: float, clock: Callable[[], float] = time.monotonic, node: str = "") -> None:
        self.run_dir, self.main_job, self.own_job, self.node = run_dir, main_job, own_job, node
        self.host_alive, self.clock = host_alive, clock
        self.pulse_s = max(PULSE_MIN_S, 6 * silent_s)
        now = clock()
        self.started = now
        self.mark = self._beat()
        self.moved = now if self.mark is not None else None
        self.listed = now

    def _beat(self):
        beat = read_beat(self.host_alive)
        return None if beat is None else beat[0]

    def why_not(self) -> str | None:
        """None while the job is wanted; else why it ends."""
        now = self.clock()
        mark = self._beat()
        if mark is not None and mark != self.mark:
            self.mark, self.moved = mark, now
        since = self.moved if self.moved is not None else self.started
        bound = self.pulse_s if self.moved is not None else max(self.pulse_s, STARTUP_S)
        if now - since > bound:
            return (f"no beat from the training job's batch host ({self.host_alive}) for "
                    f"{now - since:.0f} s: its launcher is gone")
        try:
            alloc = allocation.read(self.run_dir)
        except allocation.AllocationError:
            alloc = None    # unreadable now: judged again at the next look, the pulse bounds it
        if alloc is None or not alloc.for_job(self.main_job):
            return None
        if self.node and self.node in alloc.fenced_nodes:
            return f"job {self.main_job}'s launcher fenced this node ({self.node})"
        if self.own_job in alloc.spare_job_ids:
            self.listed = now
        elif now - self.listed > UNLISTED_S:
            return (f"job {self.main_job}'s allocation.json has not listed this spare job for "
                    f"{now - self.listed:.0f} s: its launcher does not count on it")
        return None


def from_environ(env: Mapping[str, str]) -> Hold:
    try:
        run_dir, main_job = env["SLURMFT_RUN_DIR"], env[refill.FOR_ENV]
        own, alive = env["SLURM_JOB_ID"], env[refill.HOST_ALIVE_ENV]
        silent = float(env[refill.SILENT_ENV])
    except (KeyError, ValueError) as exc:
        raise SystemExit(f"slurmft.launch.sparehold: not started by slurmft's launcher ({exc})") from None
    return Hold(RunDir(Path(run_dir)), main_job, own, Path(alive), silent,
                node=env.get("SLURMD_NODENAME", ""))


def main() -> None:
    hold = from_environ(os.environ)
    log(f"holding {os.environ.get('SLURMD_NODENAME', '?')} as a spare of job {hold.main_job}")
    while True:
        why = hold.why_not()
        if why is not None:
            log(f"ending: {why}")
            return
        time.sleep(POLL_S)


if __name__ == "__main__":
    main()
