"""``slurmft status JOBID`` against the real devcluster: the run dir comes from the job comment,
the job's state from the controller; a job that does not exist, names no run dir, or names a run
dir its user does not own is one clear line and exit 2."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import time

import pytest

from slurmft.journal import Journal
from slurmft.slurm.cli import CliSlurmClient

pytestmark = pytest.mark.integration


def status(cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmft.cli", "status", *args],
                          env={**os.environ, **cluster.env, "COLUMNS": "200"}, capture_output=True,
                          text=True, timeout=60)


def sleeper(cluster, tmp_path, *options: str) -> tuple[CliSlurmClient, str]:
    script = tmp_path / "sleep.sh"
    script.write_text("#!/bin/bash\nsleep 120\n")
    client = CliSlurmClient(env=cluster.env)
    job_id = client.submit(script, env={**os.environ, **cluster.env},
                           sbatch_options=["--nodes=1", f"--output={tmp_path}/job.out", *options])
    deadline = time.monotonic() + 30
    while client.job(job_id).state.value != "RUNNING":
        assert time.monotonic() < deadline, f"job {job_id} did not start"
        time.sleep(0.3)
    return client, job_id


@pytest.mark.timeout(120)
def test_a_running_job_is_shown_from_its_comment_and_the_controller(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    client, job_id = sleeper(slurm_cluster, tmp_path, f"--comment=SLURMFT_RUN_DIR={run}")
    try:
        seg = Journal(run, job_id=job_id, restart_count=0)
        seg.append("segment_start", world_size=1, num_nodes=1, nodelist="n1", restored_step=None)
        for step in (1, 2, 3):
            seg.append("loss", step=step, loss=1.0, samples=0, world_size=1)
        seg.flush()  # loss lines are buffered until the next durable event
        result = status(slurm_cluster, job_id, "--json")
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["run_dir"] == str(run) and data["job_id"] == job_id
        assert data["slurm"]["state"] == "RUNNING" and data["slurm"]["nodes"]
        assert data["state"].startswith("training at step 3; Slurm: RUNNING")
        table = status(slurm_cluster, job_id)
        assert table.returncode == 0 and "training at step 3; Slurm: RUNNING" in table.stdout
        by_dir = json.loads(status(slurm_cluster, str(run), "--json").stdout)  # asks Slurm too
        assert by_dir["slurm"]["state"] == "RUNNING" and by_dir["note"] == ""

        os.chown(run, pwd.getpwnam("nobody").pw_uid, -1)
        result = status(slurm_cluster, job_id)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.strip() == (f"slurmft status: job {job_id}: run dir {run} is not owned "
                                         "by the job's user root (or give the run dir instead of "
                                         "the job id)")
    finally:
        client.cancel(job_id)


@pytest.mark.timeout(120)
def test_a_job_that_does_not_exist_or_names_no_run_dir(slurm_cluster, tmp_path):
    result = status(slurm_cluster, "999999")
    assert result.returncode == 2
    assert result.stderr.strip() == ("slurmft status: job 999999 does not exist (neither the "
                                     "controller nor accounting knows it)")
    client, job_id = sleeper(slurm_cluster, tmp_path)
    try:
        result = status(slurm_cluster, job_id)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
        assert f"job {job_id} names no run dir" in result.stderr
    finally:
        client.cancel(job_id)


@pytest.mark.timeout(120)
def test_the_watchers_on_event_hook_gets_each_event_as_json(slurm_cluster, tmp_path):
    """The real ``slurmft watch --once --on-event CMD`` on a job that completed: the hook is
    handed the watcher's ``run_finished`` event on stdin."""
    run = tmp_path / "run"
    run.mkdir()
    script = tmp_path / "ok.sh"
    script.write_text("#!/bin/bash\nexit 0\n")
    client = CliSlurmClient(env=slurm_cluster.env)
    job_id = client.submit(script, env={**os.environ, **slurm_cluster.env},
                           sbatch_options=["--nodes=1", f"--output={tmp_path}/job.out",
                                           f"--comment=SLURMFT_RUN_DIR={run}"])
    deadline = time.monotonic() + 60
    while client.job(job_id).state.value != "COMPLETED":
        assert time.monotonic() < deadline, f"job {job_id} did not complete"
        time.sleep(0.3)
    got = tmp_path / "events.out"
    hook = f"{sys.executable} -c 'import sys; open(\"{got}\", \"a\").write(sys.stdin.read())'"
    watch = subprocess.run([sys.executable, "-m", "slurmft.cli", "watch", job_id, "--once",
                            "--on-event", hook], env={**os.environ, **slurm_cluster.env},
                           capture_output=True, text=True, timeout=60)
    assert watch.returncode == 0, watch.stderr
    events = [json.loads(line) for line in got.read_text().splitlines()]
    assert [e["kind"] for e in events] == ["watch_started", "run_finished"]
    assert events[-1]["job_id"] == job_id and events[-1]["run_dir"] == str(run)
    assert events[-1]["state"] == "COMPLETED" and events[-1]["exit_code"] == 0
