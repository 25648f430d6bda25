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

def _full_quota(limit: int):
    """Writes past ``limit`` bytes fail with EFBIG (Python ignores SIGXFSZ): the same failure as
    a full quota on the run dir's filesystem, for every file bigger than that."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def _watch_once(cluster, job_id: str, *, limit: int | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMFT_")}
    return subprocess.run([sys.executable, "-m", "slurmft.cli", "watch", job_id, "--once"],
                          env={**env, **cluster.env}, capture_output=True, text=True, timeout=120,
                          preexec_fn=_full_quota(limit) if limit is not None else None)


def _held_job(client, tmp_path, name: str) -> tuple[RunDir, str]:
    run = RunDir(tmp_path / name)
    run.root.mkdir()
    script = tmp_path / f"{name}.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    job_id = client.submit(script, sbatch_options=["--hold", f"--output={tmp_path}/{name}.out",
                                                   f"--comment=SLURMFT_RUN_DIR={run.root}"])
    return run, job_id


@pytest.mark.timeout(240)
def test_a_once_cycle_that_failed_is_exit_1_naming_the_job(slurm_cluster, tmp_path):
    client = CliSlurmClient(env=slurm_cluster.env)
    (probe, probe_id), (run, job_id) = _held_job(client, tmp_path, "probe"), _held_job(client, tmp_path, "run")
    try:
        # What a watcher writes before its cycle (the lock, the lease: a line or two) is smaller
        # than the state its cycle saves: a quota just under the state's size (measured on a run
        # like it) lets the watcher start, and fails its cycle's save.
        assert _watch_once(slurm_cluster, probe_id).returncode == 0
        state = probe.watch_state.stat().st_size
        failed = _watch_once(slurm_cluster, job_id, limit=state - 32)
        assert failed.returncode == 1, failed.stdout + failed.stderr
        errors = [ln for ln in failed.stderr.splitlines() if ln.startswith("slurmft watch: ")]
        assert len(errors) == 1 and f"job {job_id}: this cycle failed" in errors[0], failed.stderr
        assert "Traceback" not in failed.stderr
        job = client.job(job_id)  # nothing was done to the job on the way
        assert job.state is JobState.PENDING and job.restart_count == 0 and not job.excluded_nodes
        ok = _watch_once(slurm_cluster, job_id)  # the same cycle with room: exit 0
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert run.watch_state.is_file()
    finally:
        client.cancel(probe_id)
        client.cancel(job_id)
