"""More faults under ``slurmft watch`` on the devcluster (see test_watch_recovery.py): a watcher
killed mid-recovery, a controller restart, a crash loop, and two jobs watched by one watcher. A
node death, a hang, a node the sweeper drains and a corrupted newest checkpoint are the chaos
demo's faults: tests/integration/test_demo.py checks each of them (cause, exclusion, bounds,
the checkpoint resumed from) in one run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmft.rundir import RunDir
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import JobState
from slurmft.watch.state import load_state

from test_watch_recovery import ARGS, _assert_resumed_from_newest, _committed, _context, _start
from train_job_support import TINY_ARGS, kill_ranks, losses, submit
from watch_support import WatcherProc, events_until, observe_until, of

pytestmark = pytest.mark.integration
SLURMFT = Path(sys.executable).parent / "slurmft"


def _failing_site_check(tmp_path: Path) -> Path:
    script = tmp_path / "site-check"
    script.write_text("#!/bin/sh\necho 'ERROR: site check: /scratch read-only'\nexit 1\n")
    script.chmod(0o755)
    config = tmp_path / "sweep.toml"
    config.write_text(f"""
[sweep]
checks = ["external_site"]
state_dir = "{tmp_path}/sweep-state"
report_dir = "{tmp_path}/sweep-reports"
textfile_dir = "{tmp_path}/sweep-textfile"

[[health_external.commands]]
name = "site"
argv = ["{script}"]
timeout_s = 15
""")
    return config


@pytest.mark.timeout(300)
def test_watcher_killed_mid_recovery_is_carried_on_without_a_double_requeue(slurm_cluster, tmp_path):
    # One node: the sweeper drains it, the watcher's requeue excludes it, the job runs elsewhere.
    run, job, watcher = _start(slurm_cluster, tmp_path, [*ARGS, "--steps", "300"], nodes=1,
                               name="killed_watcher")
    ctx = _context(job, watcher)
    second = None
    try:
        events_until(run, lambda ev: 5 in _committed(ev), 120, "first checkpoint", context=ctx)
        victim = job.client.job(job.job_id).nodes[0]
        subprocess.run([str(SLURMFT), "sweep", "--node", victim, "--config",
                        str(_failing_site_check(tmp_path))], env={**os.environ, **slurm_cluster.env},
                       capture_output=True, timeout=90)
        # SIGKILL the watcher as soon as its requeue is journaled: before the exclusion.
        events_until(run, lambda ev: of(ev, "recovery_action", action="requeue"), 60,
                     "the watcher's requeue", context=ctx)
        watcher.kill(signal.SIGKILL)
        state = load_state(RunDir(run), job.job_id)
        assert state.phase == "recovering" and state.recovery.requeue == "done"
        second = WatcherProc(slurm_cluster, [job.job_id], tmp_path / "killed_watcher2-watch.log",
                             run_dir=run)
        events = events_until(run, lambda ev: of(ev, "job_running"), 120, "job running again",
                              context=lambda: ctx() + second.text())
        assert len(of(events, "recovery_action", action="requeue")) == 1
        assert len(of(events, "fault_detected")) == 1
        final = job.client.job(job.job_id)
        assert victim in final.excluded_nodes and final.restart_count == 1
        assert victim not in of(events, "job_running")[0].get("nodes")
        events = events_until(run, lambda ev: any(e.get("restart_count", 0) >= 1 for e in of(ev, "loss")),
                              90, "training again", context=lambda: ctx() + second.text())
        _assert_resumed_from_newest(events)
    finally:
        watcher.kill()
        if second is not None:
            second.kill()


def _wait_text(watcher, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in watcher.text():
        assert time.monotonic() < deadline, f"watcher never logged {text!r}:\n{watcher.text()}"
        time.sleep(0.5)


@pytest.mark.timeout(300)
def test_controller_restart_while_watching_is_waited_out(slurm_cluster, tmp_path):
    # Long enough to outlive the outage (the client retries for up to a minute before a cycle
    # counts as "could not observe"): the crash must hit a running job.
    # One node: the outage and the crash after it are the watcher's to judge, not the world's.
    run, job, watcher = _start(slurm_cluster, tmp_path, [*ARGS, "--steps", "2000"], nodes=1,
                               name="controller_restart")
    ctx = _context(job, watcher)
    try:
        events_until(run, lambda ev: 5 in _committed(ev), 120, "first checkpoint", context=ctx)
        ctld = slurm_cluster.processes()["slurmctld"]
        os.kill(ctld.pid, signal.SIGKILL)
        # The client retries (with backoff) before a cycle counts as "could not observe".
        _wait_text(watcher, "could not observe Slurm", 90)
        slurm_cluster._restart_dead_services(60)
        _wait_text(watcher, "Slurm answers again", 120)
        assert not of(job.events(), "fault_detected")  # an outage is not a fault of the job
        assert kill_ranks(slurm_cluster, job.job_id) >= 1
        events = events_until(run, lambda ev: of(ev, "job_running"), 120, "job running again",
                              context=ctx)
        assert [e.get("cause") for e in of(events, "fault_detected")] == ["crash"]
        events = events_until(run, lambda ev: any(e.get("restart_count", 0) >= 1 for e in of(ev, "loss")),
                              90, "training again", context=ctx)
        _assert_resumed_from_newest(events)
    finally:
        watcher.kill()


@pytest.mark.timeout(300)
def test_crash_loop_is_held_after_n_restarts_without_progress(slurm_cluster, tmp_path):
    args = [*TINY_ARGS, "--steps", "200", "--ckpt-every", "100", "--step-sleep", "0.1"]
    run, job, watcher = _start(slurm_cluster, tmp_path, args, nodes=1, name="crash_loop",
                               watch_env={"SLURMFT_WATCH_CRASH_LOOP_RESTARTS": "2"})
    ctx = _context(job, watcher)
    try:
        for restart in range(3):
            events_until(run, lambda ev: any(e.get("restart_count") == restart and e.get("step", 0) >= 2
                                             for e in of(ev, "loss")), 120, f"training in restart {restart}",
                         context=ctx)
            assert kill_ranks(slurm_cluster, job.job_id) >= 1
            if restart < 2:
                events_until(run, lambda ev: len(of(ev, "job_running")) > restart, 90,
                             "job running again", context=ctx)
        assert watcher.wait(60) == 0, ctx()
        events = job.events()
        gave_up = of(events, "gave_up")
        assert len(gave_up) == 1 and "crash loop" in gave_up[0].get("reason")
        assert len(of(events, "recovery_action", action="requeue")) == 2
        held = job.client.job(job.job_id)   # back in the queue, held: never runs until released
        assert held.state is JobState.PENDING and held.reason in ("JobHeldUser", "JobHeldAdmin"), held
        assert gave_up[0].get("held") is True
    finally:
        watcher.kill()


@pytest.mark.timeout(300)
def test_two_jobs_watched_at_once_only_the_faulty_one_is_touched(slurm_cluster, tmp_path):
    """One watcher, ``--user root --all``: it adopts both jobs as they name their run dirs."""
    args = [*ARGS, "--steps", "100"]
    watcher = WatcherProc(slurm_cluster, [], tmp_path / "two_jobs-watch.log", "--user", "root",
                          "--all", run_dir=tmp_path / "a")
    a = submit(slurm_cluster, tmp_path / "a", args, nodes=1)
    b = submit(slurm_cluster, tmp_path / "b", args, nodes=1)
    def ctx() -> str:
        return a.log_text()[-2000:] + b.log_text()[-2000:] + watcher.text()[-3000:]

    try:
        events_until(tmp_path / "a", lambda ev: 5 in _committed(ev), 120, "a's checkpoint", context=ctx)
        assert f"watching job {a.job_id}" in watcher.text() and f"watching job {b.job_id}" in watcher.text()
        assert kill_ranks(slurm_cluster, a.job_id) >= 1
        events_until(tmp_path / "a", lambda ev: of(ev, "job_running"), 120, "a running again",
                     context=ctx)
        for run in (tmp_path / "a", tmp_path / "b"):
            events_until(run, lambda ev: of(ev, "run_finished"), 200, f"{run.name} finished",
                         context=ctx)
        assert a.client.job(a.job_id).state is JobState.COMPLETED
        final_b = b.client.job(b.job_id)
        assert final_b.state is JobState.COMPLETED and final_b.restart_count == 0
        assert not of(b.events(), "fault_detected")
        assert len(losses([e for e in a.events() if e.kind == "loss" and e.get("restart_count") == 1])) > 0
    finally:
        watcher.kill()


@pytest.mark.timeout(120)
def test_bad_input_is_one_line_and_touches_nothing(slurm_cluster, tmp_path):
    client = CliSlurmClient(env=slurm_cluster.env)
    script = tmp_path / "held.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    held = client.submit(script, sbatch_options=["--hold", f"--output={tmp_path}/held.out"])
    not_a_run = tmp_path / "notarun"
    not_a_run.mkdir()
    (not_a_run / "precious.txt").write_text("keep\n")
    env = {**os.environ, **slurm_cluster.env}
    cases = [
        (["999999"], 2, "job 999999 does not exist"),
        ([held], 2, f"job {held} names no run dir"),
        ([held, "--run-dir", str(not_a_run)], 2, "is not a slurmft run dir"),
        ([held, "--run-dir", "relative/dir"], 2, "is not an absolute path"),
        ([held, "--poll", "0.01"], 2, "poll_s must be >= 0.5 s"),
    ]
    for argv, code, message in cases:
        res = subprocess.run([str(SLURMFT), "watch", *argv, "--once"], env=env, text=True,
                             capture_output=True, timeout=60)
        assert res.returncode == code, (argv, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (argv, res.stderr)
    job = client.job(held)
    assert job.state is JobState.PENDING and job.restart_count == 0 and not job.excluded_nodes
    assert sorted(p.name for p in not_a_run.iterdir()) == ["precious.txt"]


@pytest.mark.timeout(120)
def test_saved_submission_resubmits_the_same_job_on_real_slurm(slurm_cluster, tmp_path):
    """What a forgotten job's resubmission sends, checked against the real controller: options,
    name, run dir comment, exclusion and work dir of the new job (held, so it never runs). The
    whole path, with the controller really forgetting a job and the watcher resubmitting it, is
    tests/integration/test_watch_forgotten.py."""
    from slurmft.watch import resubmit

    client = CliSlurmClient(env=slurm_cluster.env)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --job-name=resub\ntrue\n")
    work = tmp_path / "work"
    work.mkdir()
    original = client.submit(script, ["--steps", "40"], sbatch_options=[
        "--hold", "--nodes=1-2", f"--output={work}/out.log", f"--chdir={work}"])
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    line = observe_until(client, original, lambda j: client.submit_line(original) is not None, 30,
                         "accounting's submit line") and client.submit_line(original)
    resubmit.save_record(run, original, line, str(work), client.batch_script(original))
    record = resubmit.load_record(run)
    argv = resubmit.resubmit_argv(record, resubmit.SubmitRecord.paths(run)[1], run.root, ["n3"])
    new = client.resubmit(argv, cwd=work, env={**os.environ, **slurm_cluster.env})
    job = client.job(new)
    assert new != original and job.state is JobState.PENDING and job.reason in ("JobHeldUser", "JobHeldAdmin")
    assert job.name == "resub"
    assert job.run_dir == run.root and "n3" in job.excluded_nodes
    assert job.work_dir == work
