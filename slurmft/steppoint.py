"""Named points between the steps of a recovery, where a test may act on the real cluster.

``SLURMFT_TEST_HOOK=<program>`` (absolute path to an executable; unset everywhere but in tests):
at each point the watcher, the Slurm client and the launcher run ``<program> <point> <job id>``
and wait for it (bounded by ``HOOK_TIMEOUT_S``) before their next step. The integration tests use
it to ``scancel`` a job at every point of a recovery, deterministically, and check that the job
stays cancelled. The hook's outcome is ignored: it can delay a step, never change what it does.
Points: ``watch.<action>`` (before each change ``watch/act.py`` makes), ``slurm.requeue`` and
``slurm.requeuehold`` (after the state was read and the verb chosen, before it is sent),
``launch.requeue`` (after the launcher read its job, before it requeues itself).
"""

from __future__ import annotations

import logging
import os
import subprocess

HOOK_ENV = "SLURMFT_TEST_HOOK"
HOOK_TIMEOUT_S = 60.0

log = logging.getLogger(__name__)


def reached(point: str, job_id: str) -> None:
    """Run the test hook for ``point`` of ``job_id``, if one is set; never raises."""
    program = os.environ.get(HOOK_ENV)
    if not program:
        return
    if not os.path.isabs(program):
        log.error("%s=%r is not an absolute path: not run", HOOK_ENV, program)
        return
    try:
        subprocess.run([program, point, str(job_id)], timeout=HOOK_TIMEOUT_S, check=False,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        log.error("test hook %s at %s: %s", program, point, exc)
