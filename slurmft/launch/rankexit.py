"""In-allocation mode: a rank's crash journaled by its node's warm server the moment it ends.

torchrun restarts every node's workers after one rank fails, and the launcher used to learn of a
crash only when the next world journaled its start (``inplace``): seconds to tens of seconds
late, counted by ``slurmft status`` and the ETTR as detection time. A node's warm server
(``warm``) forks and reaps every rank of its node, so it sees a rank's end when it happens. An
end is a crash unless it is one of slurmft's deliberate exits (0; 85, 86, 87, 88: preempted,
do not requeue, hung, re-formed, each journaled by the ranks themselves), a stop by TERM or INT
(torchrun stopping its workers, a signal passed on), or the server's own kill of a worker whose
client is gone (torchrun killed the client). For a crash the server appends ``rank_exit``
(rank, node, exit code, pid; the job and restart count of the rank's environment) to the run's
journal; the launcher's ``inplace`` journals it as ``fault_detected`` (``rank_crash``) once the
node is seen still beating (a rank that died with its node is its fence's fault).

Ranks started cold (``SLURMFT_WARM_WORKERS=0``) are torchrun's children only: their crash is
still learned at the next world's start. The append is one ``O_APPEND`` write (``journal``): on
a hung shared filesystem it blocks this server as it blocks the node's ranks.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Callable, Mapping

from slurmft import exitcodes, journal
from slurmft.rundir import RUN_DIR_ENV, RunDir

DELIBERATE = frozenset({exitcodes.OK, exitcodes.REQUEUE, exitcodes.NO_REQUEUE, exitcodes.HANG,
                        exitcodes.REFORM})
STOPS = frozenset({signal.SIGTERM, signal.SIGINT})


def crashed(code: int) -> bool:
    """Whether a rank's exit status (an exit code, or minus the signal that killed it) is a crash."""
    if code < 0:
        return -code not in STOPS
    return code not in DELIBERATE


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def record(env: Mapping[str, str], code: int, pid: int, log: Callable[[str], None]) -> bool:
    """Journal a crashed rank's end (True), or nothing for another end or outside a run."""
    run_dir, job_id = env.get(RUN_DIR_ENV), env.get("SLURM_JOB_ID")
    if not crashed(code) or not run_dir or not job_id:
        return False
    try:
        restart_count = int(env.get("SLURM_RESTART_COUNT") or 0)
        attempt = int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
        rank = int(env.get("RANK") or -1)
    except ValueError:
        restart_count, attempt, rank = 0, 0, -1
    try:
        journal.append_event(RunDir(Path(run_dir)).events, journal.RANK_EXIT, job_id=job_id,
                             restart_count=restart_count, attempt=attempt, rank=rank,
                             node=env.get("SLURMD_NODENAME", ""), exit_code=code, pid=pid,
                             how=describe(code))
    except (OSError, ValueError) as exc:
        log(f"could not journal rank {rank}'s crash ({describe(code)}): {exc}")
        return False
    return True
