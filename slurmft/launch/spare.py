"""In-allocation mode: a hot spare's node task waits, started, until the launcher makes it active.

A spare's step starts with the job (srun, its python, the node's beat, its warm server when
asked for), but its torchrun only once ``<run_dir>/allocation.json`` lists this node among the
``active`` ones, which the launcher writes when it fences a node and gives the spare its place.
A spare that ran torchrun from the start would sit on the rendezvous' redundancy list and join
whenever the participants drop below ``max_nodes``: also while a healthy node's agent restarts
its ranks in place after a crash, so the spare and that agent race for its place, and the loser
left on the wait list restarts everyone again (seen in benchmarks/recovery_bench.py's rank crash,
never recovered in the allocation). The file is untrusted: one that cannot be read or checked
waits on (said once); one of another job is not this job's.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Mapping

from slurmft import allocation
from slurmft.rundir import RunDir

SPARE_ENV = "SLURMFT_SPARE_NODE"   # set by the launcher on a spare's step: the node's name
POLL_S = 0.5


def waiting_node(env: Mapping[str, str]) -> str | None:
    return env.get(SPARE_ENV) or None


def wait_until_active(run_dir: Path, node: str, job_ids: set[str], stop: threading.Event,
                      poll_s: float = POLL_S) -> bool:
    """Until ``node`` is active in the run's allocation (True) or ``stop`` is set (False)."""
    warned = False
    while True:
        try:
            alloc = allocation.read(RunDir(run_dir))
        except allocation.AllocationError as exc:
            alloc = None
            if not warned:
                print(f"slurmft.launch.task: spare {node} waits on: {exc}", file=sys.stderr, flush=True)
                warned = True
        if alloc is not None and alloc.for_job(job_ids) and node in alloc.active:
            return True
        if stop.wait(poll_s):
            return False


def job_ids(env: Mapping[str, str]) -> set[str]:
    return {v for v in (env.get("SLURMFT_JOB_ID"), env.get("SLURM_JOB_ID")) if v}
