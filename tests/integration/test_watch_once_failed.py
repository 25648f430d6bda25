"""``slurmft watch JOBID --once`` (cron's way to run the watcher) says when its cycle failed, on
the real devcluster: a run whose files cannot be written (the run dir's quota is full) is exit 1
with one line naming the job and why, not exit 0 as if the cycle had done its work. (Issue 26:
``--once`` once exited 0 whatever became of the run's cycle.)"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from slurmft.rundir import RunDir
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import JobState

pytestmark = pytest.mark.integration

# Writes past this size fail with EFBIG (Python ignores SIGXFSZ): the lock's one line fits, the
# state file does not. The same failure as a full quota on the run dir's filesystem.
FILE_SIZE_LIMIT = 64


def _full_quota() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


def _watch_once(cluster, job_id: str, *, limited: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMFT_")}
    return subprocess.run([sys.executable, "-m", "slurmft.cli", "watch", job_id, "--once"],
                          env={**env, **cluster.env}, capture_output=True, text=True, timeout=120,
                          preexec_fn=_full_quota if limited else None)


@pytest.mark.timeout(240)
def test_a_once_cycle_that_failed_is_exit_1_naming_the_job(slurm_cluster, tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    script = tmp_path / "held.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    client = CliSlurmClient(env=slurm_cluster.env)
    job_id = client.submit(script, sbatch_options=["--hold", f"--output={tmp_path}/held.out",
                                                   f"--comment=SLURMFT_RUN_DIR={run.root}"])
    try:
        failed = _watch_once(slurm_cluster, job_id, limited=True)
        assert failed.returncode == 1, failed.stdout + failed.stderr
        errors = [ln for ln in failed.stderr.splitlines() if ln.startswith("slurmft watch: ")]
        assert len(errors) == 1 and f"job {job_id}: this cycle failed" in errors[0], failed.stderr
        assert "Traceback" not in failed.stderr
        job = client.job(job_id)  # nothing was done to the job on the way
        assert job.state is JobState.PENDING and job.restart_count == 0 and not job.excluded_nodes
        ok = _watch_once(slurm_cluster, job_id, limited=False)  # the same cycle with room: exit 0
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert run.watch_state.is_file()
    finally:
        client.cancel(job_id)
