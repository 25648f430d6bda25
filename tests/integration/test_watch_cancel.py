"""A cancel is final (issue 25, item 3), on the devcluster with the real ``slurmft watch``: a
user's ``scancel`` lands at each point of a recovery, deterministically, through the product's
test hook (``slurmft/steppoint.py``: the watcher runs it between its steps and waits for it),
and the job stays cancelled. Before the fix, a cancel landing while the watcher requeued a
running job was undone: the policy re-read the job, saw CANCELLED, and sent a plain
``scontrol requeue``, which Slurm 22.05 accepts for a cancelled job (measured)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from slurmft import steppoint
from slurmft.journal import read_events
from slurmft.rundir import RunDir
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import JobState

from watch_support import WatcherProc, events_until, observe_until, of

pytestmark = pytest.mark.integration

# Each point of a recovery of a RUNNING job (its node drained by the sweeper): before the requeue,
# between the requeue's read of the job and its send, before the exclusion, before the start.
POINTS = ("watch.requeue", "slurm.requeue", "watch.exclude", "watch.start_now")
HOOK = """#!{python}
import json, subprocess, sys
point, job = sys.argv[1], sys.argv[2]
plan = json.load(open({plan!r}))
if plan.get(job) == point:
    with open({fired!r}, "a") as fh:  # before the cancel: it may kill this hook with the job's step
        fh.write(f"{{job}} {{point}}\\n")
    subprocess.run(["scancel", job], check=False, timeout=30)
"""


def _hook(tmp_path: Path, plan: dict[str, str]) -> tuple[Path, Path]:
    """The hook program (a user's scancel at the planned point) and the file it logs to."""
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    fired = tmp_path / "fired"
    hook = tmp_path / "hook.py"
    hook.write_text(HOOK.format(python=sys.executable, plan=str(tmp_path / "plan.json"),
                                fired=str(fired)))
    hook.chmod(0o755)
    return hook, fired


@pytest.mark.timeout(240)
def test_a_scancel_at_every_point_of_a_recovery_leaves_the_job_cancelled(slurm_cluster, tmp_path):
    client = CliSlurmClient(env=slurm_cluster.env)
    script = tmp_path / "sleep.sh"
    script.write_text("#!/bin/bash\nsleep 600\n")
    runs, jobs = {}, {}
    for point in POINTS:
        run = tmp_path / point.replace(".", "_")
        run.mkdir()
        job_id = client.submit(script, env={**os.environ, **slurm_cluster.env},
                               sbatch_options=["--nodes=1", "--requeue", f"--output={tmp_path}/%j.out",
                                               f"--comment=SLURMFT_RUN_DIR={run}", f"--chdir={tmp_path}"])
        runs[job_id], jobs[point] = run, job_id
    running = {j: observe_until(client, j, lambda job: job.state is JobState.RUNNING, 60, "start")
               for j in jobs.values()}
    hook, fired = _hook(tmp_path, {j: p for p, j in jobs.items()})
    watcher = WatcherProc(slurm_cluster, list(jobs.values()), tmp_path / "watch.log",
                          env={steppoint.HOOK_ENV: str(hook)})
    hosts = sorted({n for job in running.values() for n in job.nodes})
    try:
        # The watcher has taken on every job, each RUNNING, before the nodes are drained: a bound
        # ended by its journaled watch_started (it was a fixed 3 s, short of a start at load 20).
        for job_id, run in runs.items():
            events_until(run, lambda ev: of(ev, "watch_started"), 90, f"job {job_id} watched",
                         context=watcher.text)
        for node in hosts:  # what the sweeper does to a node that fails its health check
            client.drain(node, "slurmft: test: failing health check")
        for job_id, run in runs.items():
            events_until(run, lambda ev: of(ev, "run_finished"), 90, f"job {job_id}'s watch ending",
                         context=watcher.text)
        time.sleep(5)  # a few more cycles: nothing brings a job back
        assert watcher.wait(30) == 0, watcher.text()[-4000:]  # every run over: the watcher exits
    finally:
        watcher.kill()
        for node in hosts:
            client.resume(node)
    assert sorted(fired.read_text().split("\n")[:-1]) == sorted(f"{j} {p}" for p, j in jobs.items())
    for point, job_id in jobs.items():
        final = client.job(job_id)
        assert final.state is JobState.CANCELLED, (point, final, watcher.text()[-3000:])
        events = read_events(RunDir(runs[job_id]).events)
        assert [e.get("how") for e in of(events, "run_finished")] == ["cancelled"], point
        assert not of(events, "gave_up"), point


@pytest.mark.timeout(300)
def test_a_scancel_while_the_launcher_requeues_itself_leaves_the_job_cancelled(slurm_cluster, tmp_path):
    # The launcher's point: it read its job (RUNNING, this run) and is about to requeue itself
    # after the time limit's warning; the hook cancels the job from inside it. (On 22.05 a job
    # being cancelled shows COMPLETING with no base state, so the old policy waited here rather
    # than requeueing; on 24.11+ it shows CANCELLED+COMPLETING, which the old policy requeued:
    # the unit tests in tests/unit/test_cancel_final.py cover that shape.)
    from train_job_support import TINY_ARGS, submit

    plan = tmp_path / "plan.json"
    hook, fired = _hook(tmp_path, {})
    run = tmp_path / "run"
    job = submit(slurm_cluster, run, [*TINY_ARGS, "--steps", "200", "--step-sleep", "0.1"], nodes=1,
                 env={steppoint.HOOK_ENV: str(hook)}, watch=True)
    plan.write_text(json.dumps({job.job_id: "launch.requeue"}))
    job.wait_step(2, timeout=120)
    job.client.cancel(job.job_id, signal="USR2", batch_only=True)
    final = job.wait_finished(timeout=120)
    time.sleep(5)  # the watcher's cycles after the cancel: nothing brings it back
    final = job.state()
    assert fired.read_text() == f"{job.job_id} launch.requeue\n", job.context()
    assert final.state is JobState.CANCELLED and final.restart_count == 0, job.context()
    events = job.events()
    assert [e.get("how") for e in of(events, "run_finished")] == ["cancelled"], job.context()
    assert not of(events, "recovery_action") and not of(events, "planned_end")


@pytest.mark.timeout(240)
def test_a_scancel_before_the_release_of_a_job_slurm_held_leaves_it_cancelled(slurm_cluster, tmp_path):
    # The release point of a launch-failure recovery (tests/integration/test_watch_launch_failed.py):
    # the node excluded, the job about to be released; the hook cancels it; the release re-reads
    # the job and refuses (Slurm itself refuses to release a cancelled job: measured).
    bad = slurm_cluster.node_names[0]  # where Slurm places a 1-node job on an idle cluster
    slurm_cluster.kill_node(bad)
    slurm_cluster.start_node(bad, stepd="/bin/false")
    client = CliSlurmClient(env=slurm_cluster.env)
    script = tmp_path / "sleep.sh"
    script.write_text("#!/bin/bash\nsleep 600\n")
    run = tmp_path / "run"
    run.mkdir()
    watcher = None
    try:
        job_id = client.submit(script, env={**os.environ, **slurm_cluster.env},
                               sbatch_options=["--nodes=1", "--requeue", f"--output={tmp_path}/%j.out",
                                               f"--comment=SLURMFT_RUN_DIR={run}", f"--chdir={tmp_path}"])
        hook, fired = _hook(tmp_path, {job_id: "watch.release"})
        watcher = WatcherProc(slurm_cluster, [job_id], tmp_path / "watch.log",
                              env={steppoint.HOOK_ENV: str(hook)})
        events = events_until(run, lambda ev: of(ev, "run_finished"), 120, "the watch ending",
                              context=watcher.text)
        time.sleep(5)  # a few more cycles: nothing brings it back
        final = client.job(job_id)
    finally:
        if watcher is not None:
            watcher.kill()
        slurm_cluster.kill_node(bad)
        slurm_cluster.start_node(bad)
    assert fired.read_text() == f"{job_id} watch.release\n", watcher.text()[-3000:]
    assert [e.get("cause") for e in of(events, "fault_detected")] == ["launch_failed"]
    assert final.state is JobState.CANCELLED, (final, watcher.text()[-3000:])
    assert [e.get("how") for e in of(events, "run_finished")] == ["cancelled"]
    assert not of(events, "recovery_action", action="release", ok=True)
