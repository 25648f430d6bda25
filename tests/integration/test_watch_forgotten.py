"""A job Slurm forgot while no watcher ran, on a real controller: ``slurmft watch`` saw the job
(and saved its submission), was stopped, the job crashed, the controller purged its record (a
dedicated cluster with a MinJobAge of seconds, ``forgetful_cluster``), and a new ``slurmft watch``
resubmits it from the saved record and follows the new job. The test only breaks things and
observes: the resubmission is the watcher's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from slurmft.rundir import RunDir
from slurmft.slurm.client import JobState
from slurmft.watch import resubmit
from slurmft.watch.state import load_state

from test_watch_recovery import ARGS, _committed
from train_job_support import JOB_ENV, TEMPLATE, kill_ranks, losses, submit
from watch_support import WatcherProc, events_until, observe_until, of

pytestmark = pytest.mark.integration
STEPS = 30


def _min_job_age_s(cluster) -> int:
    found = re.search(r"^MinJobAge=(\d+)$", cluster.slurm_conf.read_text(), re.MULTILINE)
    assert found, f"no MinJobAge in {cluster.slurm_conf}"
    return int(found.group(1))


def _wait_forgotten(cluster, job_id: str, timeout: float) -> None:
    """Until the controller itself no longer knows the job (``scontrol show job`` refuses it;
    accounting still has it)."""
    deadline = time.monotonic() + timeout
    while True:
        shown = subprocess.run(["scontrol", "show", "job", job_id], env={**os.environ, **cluster.env},
                               capture_output=True, text=True, timeout=15)
        if shown.returncode != 0 and "Invalid job id" in shown.stderr:
            return
        assert time.monotonic() < deadline, (
            f"the controller still knows job {job_id} {timeout:.0f} s after its end:\n"
            f"{shown.stdout[:500]}{shown.stderr[:500]}")
        time.sleep(0.5)


@pytest.mark.timeout(240)
def test_a_job_forgotten_while_no_watcher_ran_is_resubmitted_and_resumes(forgetful_cluster, tmp_path):
    cluster = forgetful_cluster
    min_age = _min_job_age_s(cluster)
    assert min_age <= 10, "forgetful_cluster must forget within seconds"
    run = tmp_path / "run"
    job = submit(cluster, run, [*ARGS, "--steps", str(STEPS)], nodes=1)
    old = job.job_id
    observe_until(job.client, old, lambda j: j.run_dir is not None, 60, "run dir comment",
                  context=job.log_text)
    first = WatcherProc(cluster, [old], tmp_path / "first-watch.log", run_dir=run)
    second = None

    def ctx() -> str:
        return (f"--- job log\n{job.log_text()[-3000:]}\n--- first watcher\n{first.text()[-2000:]}"
                + (f"\n--- second watcher\n{second.text()[-3000:]}" if second else ""))

    try:
        # At first sight the watcher saves what a resubmission needs; then it is stopped (Ctrl-C).
        deadline = time.monotonic() + 60
        while (record := resubmit.load_record(RunDir(run))) is None or record.job_id != old:
            assert time.monotonic() < deadline, f"the watcher saved no submission for {old}\n{ctx()}"
            time.sleep(0.5)
        first.kill(signal.SIGINT)
        assert first.proc.poll() is not None, ctx()

        # The job crashes with no watcher running: nobody requeues it, and the controller forgets it.
        events_until(run, lambda ev: 5 in _committed(ev) and any(
            e.get("step", 0) >= 7 for e in of(ev, "loss")), 120, "step 7 after checkpoint 5",
            context=ctx)
        assert kill_ranks(cluster, old) >= 1
        ended = observe_until(job.client, old, lambda j: j.state.finished, 60, "end", context=ctx)
        assert ended.state is JobState.FAILED and ended.restart_count == 0, ended
        ended_at = time.monotonic()
        # Slurm purges in a background loop: well past MinJobAge under load (13 s seen with 5).
        _wait_forgotten(cluster, old, min_age + 75)
        print(f"\ncontroller forgot job {old} {time.monotonic() - ended_at:.1f} s after its end "
              f"was seen (MinJobAge={min_age})")
        newest = max(RunDir(run).committed_steps())  # on disk: a commit may outrun its journal line
        assert not of(job.events(), "fault_detected")

        # A new watcher, named the old job (its run dir given: accounting keeps no job comment
        # here), with the environment the job needs: a resubmitted job gets the watcher's.
        second = WatcherProc(cluster, [old], tmp_path / "second-watch.log", "--run-dir", str(run),
                             env=JOB_ENV, run_dir=run)
        events = events_until(run, lambda ev: of(ev, "job_resubmitted"), 60, "resubmission",
                              context=ctx)
        resubmitted = of(events, "job_resubmitted")
        new = resubmitted[0].get("new_job_id")
        assert len(resubmitted) == 1 and resubmitted[0].get("old_job_id") == old and new != old
        detected = of(events, "fault_detected")
        assert [(e.get("cause"), e.get("job_id")) for e in detected] == [("forgotten", old)]

        # The new job trains again from the newest checkpoint of the forgotten one.
        events = events_until(run, lambda ev: any(e.get("job_id") == new for e in of(ev, "loss")),
                              120, f"job {new} training", context=ctx)
        starts = [e for e in of(events, "segment_start") if e.get("job_id") == new]
        assert [e.get("restored_step") for e in starts] == [newest]

        # ... and the watcher follows it (not the old id) to its end.
        assert second.wait(120) == 0, ctx()
        final = job.client.job(new)
        assert final.state is JobState.COMPLETED and final.restart_count == 0, final
        events = job.events()
        finished = of(events, "run_finished")
        assert [(e.get("job_id"), e.get("how")) for e in finished] == [(new, "finished")]
        assert not of(events, "recovery_action", action="requeue")
        assert load_state(RunDir(run), new).job_id == new
        redone = losses([e for e in events if e.kind == "loss" and e.get("job_id") == new])
        assert sorted(redone) == list(range(newest + 1, STEPS + 1))
        # The new job was submitted from the saved script, which is the template as submitted.
        assert resubmit.saved_script(RunDir(run)) == TEMPLATE.read_bytes()
    finally:
        first.kill()
        if second is not None:
            second.kill()


WRAPPER = """#!/bin/bash
#SBATCH --requeue
#SBATCH --ntasks-per-node=1
# One run dir per task, spelled by the wrapper (no %a): what many users do.
export SLURMFT_RUN_DIR={base}/task_$SLURM_ARRAY_TASK_ID
exec bash {template} "$@"
"""


@pytest.mark.timeout(360)
def test_a_forgotten_array_task_is_resubmitted_alone_and_followed_under_either_id(
        forgetful_cluster, tmp_path):
    """Today: the whole array is submitted again with SLURMFT_RUN_DIR resolved (every task exits
    86), and a watcher restarted for the old id exits 2."""
    from slurmft.slurm.cli import CliSlurmClient
    from train_job_support import EXAMPLE

    cluster = forgetful_cluster
    script = tmp_path / "sweep.sbatch"
    script.write_text(WRAPPER.format(base=tmp_path, template=TEMPLATE))
    client = CliSlurmClient(env=cluster.env)
    array_id = client.submit(script, [str(EXAMPLE), *ARGS, "--steps", str(STEPS)],
                             env={**os.environ, **cluster.env, **JOB_ENV},
                             sbatch_options=["--nodes=1", "--array=0-1", f"--chdir={tmp_path}",
                                             f"--output={tmp_path}/task_%a.out"])
    old, run = f"{array_id}_1", tmp_path / "task_1"
    log = tmp_path / "task_1.out"
    watchers: list[WatcherProc] = []

    def ctx() -> str:
        return (log.read_text(errors="replace")[-3000:] if log.exists() else "") + "".join(
            f"\n--- watcher {i}\n{w.text()[-2500:]}" for i, w in enumerate(watchers))

    def running_task():  # the one node runs task 0, then task 1
        try:
            return client.job(old)
        except Exception:
            return None

    try:
        deadline = time.monotonic() + 150
        while (j := running_task()) is None or j.run_dir is None:
            assert time.monotonic() < deadline, f"task 1 never named its run dir\n{ctx()}"
            time.sleep(1)
        watchers.append(WatcherProc(cluster, [old], tmp_path / "w0.log", run_dir=run))
        deadline = time.monotonic() + 60
        while (record := resubmit.load_record(RunDir(run))) is None or record.job_id != old:
            assert time.monotonic() < deadline, f"no submission saved for {old}\n{ctx()}"
            time.sleep(0.5)
        watchers[0].kill(signal.SIGINT)
        events_until(run, lambda ev: 5 in _committed(ev), 120, "checkpoint 5", context=ctx)
        assert kill_ranks(cluster, observe_until(client, old, lambda j: True, 10, "task").raw_job_id) >= 1
        observe_until(client, old, lambda j: j.state.finished, 60, "end", context=ctx)
        _wait_forgotten(cluster, old, _min_job_age_s(cluster) + 75)

        watchers.append(WatcherProc(cluster, [old], tmp_path / "w1.log", "--run-dir", str(run),
                                    env=JOB_ENV, run_dir=run))
        events = events_until(run, lambda ev: of(ev, "job_resubmitted"), 60, "resubmission",
                              context=ctx)
        new = of(events, "job_resubmitted")[0].get("new_job_id")
        assert new.endswith("_1") and new != old, new  # the task alone, under its own index
        events_until(run, lambda ev: any(e.get("restored_step") is not None
                                         for e in of(ev, "segment_start")
                                         if e.get("job_id") in (new, new.split("_")[0])),
                     150, f"{new} training", context=ctx)
        # Restarted for the OLD id (the systemd unit's instance), the watcher follows the new job.
        watchers[1].kill(signal.SIGINT)
        watchers.append(WatcherProc(cluster, [old], tmp_path / "w2.log", "--run-dir", str(run),
                                    env=JOB_ENV, run_dir=run))
        assert watchers[2].wait(180) == 0, ctx()
        assert f"job {new}: finished" in watchers[2].text(), ctx()
        assert client.job(new).state is JobState.COMPLETED
        # Only task 1 was submitted again: no task 0 of the new array, and task 0's run is its own.
        listed = client.user_jobs(client.job(new).user)
        assert not [j for j in listed if j.startswith(new.split("_")[0] + "_") and j != new]
        state = load_state(RunDir(run), new)
        assert [(e.job_id, e.resubmitted_from) for e in state.epochs][-1] == (new, old)
    finally:
        for w in watchers:
            w.kill()
