"""The launcher on the devcluster, in the four situations that broke the bash template
(issue 19): an array task preempted alone, two pre-flights on one node at once, a job without
scontrol (on a cluster of its own running proctrack/pgid), and outside requeues followed at once
by a restart; and two of its functions on real
Slurm: a pre-flight that fails a node, and a heterogeneous job refused. The real template runs
the real example; the test plays only the watcher's part it needs (``StartTime=now``), and only
where it says why; elsewhere the real ``slurmft watch`` does. A job has one node unless the test is
about several (issue 28: each node is a torchrun and a rank importing torch, at every start)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from slurmft import exitcodes, journal
from slurmft.journal import read_events
from slurmft.rundir import RunDir
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import JobState
from slurmft.slurm.devcluster import DevCluster, DevClusterError
from slurmft.sweep.lock import SweepLock

from train_job_support import EXAMPLE, JOB_ENV, TEMPLATE, TINY_ARGS, TrainJob, submit
from watch_support import events_until, of

pytestmark = pytest.mark.integration


def _events(run: Path, kinds=None):
    return read_events(RunDir(run).events, kinds)


def _template(run: Path, action: str):
    return [e for e in _events(run, [journal.TEMPLATE]) if e.get("action") == action]


@pytest.mark.timeout(240)
def test_array_task_preempted_alone_sibling_untouched(slurm_cluster, tmp_path):
    args = [*TINY_ARGS, "--steps", "40", "--ckpt-every", "10", "--step-sleep", "0.2"]
    array = submit(slurm_cluster, tmp_path / "run_%a", args, nodes=1, sbatch_options=["--array=0-1"])
    tasks = {i: TrainJob(array.client, tmp_path / f"run_{i}", f"{array.job_id}_{i}",
                         tmp_path / f"run_{i}-job.out") for i in (0, 1)}  # sbatch expands %a
    # A pending array is one squeue record ("1_[0-1]"): look at the tasks once they run.
    deadline = time.monotonic() + 120
    while not all(any(e.get("step", 0) >= 4 for e in t.events([journal.LOSS])) for t in tasks.values()):
        assert time.monotonic() < deadline, "\n".join(t.log_text()[-2000:] for t in tasks.values())
        time.sleep(0.5)
    for task in tasks.values():  # the watcher starts the requeued task again, per task id
        task.watch(slurm_cluster)
    # The task whose own SLURM_JOB_ID is the array's id: a bare-id signal would hit both.
    raw = {i: _template(t.run_dir, "launch")[0].get("raw_job_id") for i, t in tasks.items()}
    target = next(i for i, r in raw.items() if r == array.job_id)
    sibling = 1 - target
    tasks[target].client.cancel(tasks[target].job_id, signal="USR2", batch_only=True)
    for task in tasks.values():
        final = task.wait_finished(timeout=180)
        assert final.state is JobState.COMPLETED, task.log_text()[-4000:]
    assert tasks[target].state().restart_count == 1
    assert [e.get("restart_count") for e in _events(tasks[target].run_dir, [journal.PREEMPTION])] == [0]
    requeued = _template(tasks[target].run_dir, "requeue")
    assert [e.get("job_id") for e in requeued] == [tasks[target].job_id]   # array-aware everywhere
    assert tasks[sibling].state().restart_count == 0
    assert _events(tasks[sibling].run_dir, [journal.PREEMPTION]) == []
    assert _template(tasks[sibling].run_dir, "forward") == []
    starts = _events(tasks[target].run_dir, [journal.SEGMENT_START])
    assert [e.get("restored_step") for e in starts][1] is not None        # resumed, not restarted
    assert tasks[target].state().run_dir == tasks[target].run_dir         # the comment, per task


@pytest.mark.timeout(240)
def test_two_preflights_on_one_busy_node_exclude_nothing(slurm_cluster, tmp_path):
    """Both jobs start on n1 while another sweep holds n1's lock (as the cron sweep or a third
    job's pre-flight does): both wait for it, neither excludes n1."""
    state = tmp_path / "sweep-state"
    env = {"SLURMFT_SWEEP_STATE_DIR": str(state), "SLURMFT_SWEEP_REPORT_DIR": str(state / "reports"),
           "SLURMFT_SWEEP_TEXTFILE_DIR": str(state / "textfile")}
    args = [*TINY_ARGS, "--steps", "6", "--ckpt-every", "3"]
    from slurmft.sweep.config import SweepConfig
    from slurmft.sweep.run import lock_path

    with SweepLock(lock_path(SweepConfig(state_dir=state), "n1")):
        jobs = [submit(slurm_cluster, tmp_path / f"run{i}", args, nodes=1,
                       sbatch_options=["--nodelist=n1"], env=env) for i in (0, 1)]
        for job in jobs:  # both are in their pre-flight, held by the busy sweep
            job.wait_for(lambda j: j.state is JobState.RUNNING and "pre-flight on" in job.log_text(),
                         90, "its pre-flight")
        # Held on until each pre-flight's sweep (a Python process it starts after that line) has
        # found the lock taken; the pre-flight waits up to 60 s for it. Held for 8 s from RUNNING,
        # on a loaded box the launcher reached its pre-flight after the lock was gone.
        time.sleep(15)
    for job in jobs:
        final = job.wait_finished(timeout=180)
        assert final.state is JobState.COMPLETED and final.restart_count == 0, job.log_text()[-4000:]
        assert _template(job.run_dir, "exclude") == [] and _template(job.run_dir, "requeue") == []
        assert final.nodes == ("n1",)
        # The lock really was contended, and the sweep then judged n1 (a note, not a skip).
        notes = _template(job.run_dir, "preflight_note")
        assert notes and all(n.get("node") == "n1" for n in notes), job.log_text()[-4000:]
        assert any("waited" in line for n in notes for line in n.get("evidence")), notes
        assert _template(job.run_dir, "preflight_skip") == []


@pytest.fixture
def pgid_cluster() -> Iterator[DevCluster]:
    """One node under ``ProctrackType=proctrack/pgid``: a step's signal reaches only the node
    task's process group, not the ranks in their own sessions (the node task relays it:
    slurmft.launch.relay). A short directory: munged's and slurmstepd's sockets live under it."""
    root = Path(tempfile.mkdtemp(prefix="sft-pgid-", dir="/tmp"))
    cluster = None
    try:
        cluster = DevCluster.up(root / "c", nodes=1, proctrack="pgid", timeout=300)
        yield cluster
    finally:
        if cluster is not None:
            try:
                cluster.down()
            except DevClusterError as exc:
                print(f"pgid cluster teardown: {exc}")
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(540)  # its cluster's start (~3 s quiet) is bounded at 300 s under load
def test_job_without_scontrol_saves_and_asks_the_watcher_to_requeue(pgid_cluster, tmp_path):
    """Also the preemption under proctrack/pgid (a cluster of its own, ~3 s to start): the
    launcher's USR2 reaches the ranks only through the node task's relay."""
    slurm_cluster = pgid_cluster
    bin_dir = tmp_path / "bin"   # a container image with srun but no Slurm client tools
    bin_dir.mkdir()
    (bin_dir / "srun").symlink_to("/usr/bin/srun")
    args = [*TINY_ARGS, "--steps", "200", "--ckpt-every", "50", "--step-sleep", "0.1"]
    job = submit(slurm_cluster, tmp_path / "run", args, nodes=1,
                 sbatch_options=[f"--export=ALL,PATH={bin_dir}"])   # the job's PATH, not sbatch's
    job.wait_step(5, timeout=120)
    job.client.cancel(job.job_id, signal="USR2", batch_only=True)
    final = job.wait_finished(timeout=120)
    assert final.exit_code == exitcodes.REQUEUE and final.restart_count == 0, job.log_text()[-4000:]
    [request] = job.events([journal.REQUEUE_REQUEST])
    assert request.get("restart_count") == 0 and request.get("exclude") == []
    assert "no scontrol" in request.get("reason")
    saved = job.events([journal.PREEMPTION])[0].get("step")
    assert [e.get("step") for e in job.events([journal.CHECKPOINT_COMMITTED])] == [saved]
    assert all(e.get("exit_code") != exitcodes.NO_REQUEUE for e in job.events([journal.SEGMENT_END]))
    assert "Slurm is ending" not in job.log_text()
    assert "no scontrol on PATH: the job comment is not set" in job.log_text()


@pytest.mark.timeout(1200)  # ~3 min quiet; six start-ups took over 420 s at load 25
def test_outside_requeue_then_start_now_five_times_every_run_trains_on(slurm_cluster, tmp_path):
    """StartTime=now 0.5 s after PENDING is sent here by the test harness only because this
    test is about the launcher's signal handling: it recreates what a fast watcher does (the
    new run starting within seconds of the old one's end), where signals sent by job id used to
    land in the new run."""
    args = [*TINY_ARGS, "--steps", "60", "--ckpt-every", "5", "--step-sleep", "0.3"]
    job = submit(slurm_cluster, tmp_path / "run", args, nodes=1)
    requeued_at: dict[int, float] = {}
    for restart in range(5):
        _wait_loss_in_run(job, restart, timeout=120)
        requeued_at[restart] = time.time()
        assert job.client.requeue(job.job_id)
        deadline = time.monotonic() + 60
        while True:
            state = job.state()
            if state.state is JobState.PENDING and not state.completing:
                break
            assert time.monotonic() < deadline, f"job never PENDING after requeue {restart}"
            time.sleep(0.1)
        time.sleep(0.5)
        job.client.update_pending(job.job_id, start_now=True)
    final = job.wait_finished(timeout=240)
    assert final.state is JobState.COMPLETED and final.restart_count == 5, job.log_text()[-4000:]
    for event in job.events([journal.TEMPLATE, journal.PREEMPTION]):
        if event.kind == journal.PREEMPTION or event.get("action") in ("forward", "early_signal"):
            restart = event.get("restart_count")
            assert restart in requeued_at and event.time >= requeued_at[restart], \
                f"stray signal in run {restart}: {event}"
    assert all(e.get("exit_code") != exitcodes.NO_REQUEUE for e in job.events([journal.SEGMENT_END]))
    steps = {e.get("step") for e in job.events([journal.LOSS])}
    assert steps == set(range(1, 61))


def _wait_loss_in_run(job: TrainJob, restart: int, timeout: float) -> None:
    """Until run ``restart`` journaled a loss past the step it restored (it trains on)."""
    deadline = time.monotonic() + timeout
    while True:
        starts = [e for e in job.events([journal.SEGMENT_START]) if e.get("restart_count") == restart]
        if starts:
            restored = starts[-1].get("restored_step") or 0
            if any(e.get("restart_count") == restart and e.get("step", 0) > restored
                   for e in job.events([journal.LOSS])):
                return
        state = job.state()
        assert not state.state.finished and time.monotonic() < deadline, \
            f"run {restart} never trained (state {state.state.value})\n{job.log_text()[-4000:]}"
        time.sleep(0.3)


@pytest.mark.timeout(480)
def test_a_later_run_trains_past_an_earlier_runs_done_and_survives_preemption(slurm_cluster, tmp_path):
    """Issue 13: a DONE left by an earlier run used to end every later run in the same
    directory at its first preemption (the template exited 0 when DONE existed)."""
    run = tmp_path / "run"
    first = submit(slurm_cluster, run, [*TINY_ARGS, "--steps", "3", "--ckpt-every", "3"], nodes=1)
    assert first.wait_finished(timeout=120).state is JobState.COMPLETED, first.log_text()[-4000:]
    assert (run / "DONE").exists()
    args = [*TINY_ARGS, "--steps", "30", "--ckpt-every", "10", "--step-sleep", "0.2"]
    second = submit(slurm_cluster, run, args, nodes=1, watch=True)
    second.wait_step(6, timeout=120)
    second.client.cancel(second.job_id, signal="USR2", batch_only=True)
    final = second.wait_finished(timeout=180)
    assert final.state is JobState.COMPLETED and final.restart_count == 1, second.log_text()[-4000:]
    assert max(e.get("step") for e in second.events([journal.LOSS])) == 30
    ends = [e.get("exit_code") for e in second.events([journal.SEGMENT_END])
            if e.get("job_id") == second.job_id]
    assert ends == [exitcodes.REQUEUE, exitcodes.OK]


def _site_check_failing_on(tmp_path: Path, victim: str) -> Path:
    """A sweep config (for ``SLURMFT_CONFIG``) whose one check, part of ``--quick`` (the
    pre-flight's sweep), fails only on ``victim``: a site script judging ``$SLURMD_NODENAME``."""
    script = tmp_path / "site-check"
    script.write_text(f"""#!/bin/sh
if [ "$SLURMD_NODENAME" = {victim} ]; then
    echo "ERROR: site check: /scratch read-only on $SLURMD_NODENAME"; exit 1
fi
echo "site check: ok"
""")
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
quick = true
""")
    return config


@pytest.mark.timeout(300)
def test_preflight_failing_one_node_excludes_it_requeues_and_trains_without_it(slurm_cluster, tmp_path):
    """A 2-node job whose pre-flight sweep fails on n2 alone: the launcher journals n2's
    exclusion with the failing check's line, requeues itself with n2 in its ExcNodeList (the
    real watcher only starts it again), and the next run trains on two other nodes; nothing
    exits 86."""
    victim = "n2"   # the 4 nodes are idle: Slurm gives a 2-node job n1,n2
    env = {"SLURMFT_CONFIG": str(_site_check_failing_on(tmp_path, victim))}
    job = submit(slurm_cluster, tmp_path / "run", [*TINY_ARGS, "--steps", "2", "--ckpt-every", "2"],
                 nodes=2, env=env, watch=True)
    events = events_until(job.run_dir, lambda ev: of(ev, journal.TEMPLATE, action="launch"), 60,
                          "the launcher's first run", context=job.context)
    [launch] = of(events, journal.TEMPLATE, action="launch")
    assert victim in launch.get("nodes"), f"Slurm did not give the job {victim}: {launch}"
    final = job.wait_finished(timeout=240)
    assert final.state is JobState.COMPLETED and final.exit_code == 0, job.context()
    assert final.restart_count == 1 and victim in final.excluded_nodes, final
    assert victim not in final.nodes and len(final.nodes) == 2, final

    events = job.events()
    [exclusion] = of(events, journal.TEMPLATE, action="exclude")
    assert exclusion.get("restart_count") == 0 and exclusion.get("node") == victim
    assert f"external_site: ERROR: site check: /scratch read-only on {victim}" in exclusion.get("evidence")
    [requeued] = of(events, journal.TEMPLATE, action="requeue")
    assert requeued.get("restart_count") == 0 and requeued.get("exclude") == victim
    assert "pre-flight" in requeued.get("reason")
    # The launcher itself requeued the job and set its ExcNodeList, with the batch step being
    # TERMed by that requeue (no requeue_request left to the watcher); the watcher only started
    # the job again.
    assert f"requeued, excluding {victim}" in job.log_text(), job.context()
    assert not of(events, journal.REQUEUE_REQUEST), job.context()
    assert not of(events, journal.RECOVERY_ACTION, action="requeue"), job.context()
    assert not of(events, journal.SEGMENT_START, restart_count=0)   # no training on n2's run
    assert any(e.get("restart_count") == 1 for e in of(events, journal.LOSS))
    assert not of(events, journal.TEMPLATE, action="give_up")
    assert all(e.get("exit_code") != exitcodes.NO_REQUEUE for e in of(events, journal.SEGMENT_END))


@pytest.mark.timeout(180)
def test_heterogeneous_job_is_refused_with_one_line_and_exit_86(slurm_cluster, tmp_path):
    """The template submitted as a hetjob (``sbatch -N1 : -N1``) ends at once with one line
    naming the reason and exit 86 (bad input: do not requeue); Slurm does not requeue it and
    nothing is created or journaled."""
    client = CliSlurmClient(env=slurm_cluster.env)
    run, log = tmp_path / "run", tmp_path / "het.out"
    # sbatch itself: the client's submit() takes no ':' component separator.
    sbatch = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", f"--output={log}", f"--chdir={tmp_path}", ":",
         "--nodes=1", str(TEMPLATE), str(EXAMPLE), *TINY_ARGS],
        env={**os.environ, **slurm_cluster.env, **JOB_ENV, "SLURMFT_RUN_DIR": str(run)},
        capture_output=True, text=True, timeout=30)
    assert sbatch.returncode == 0, sbatch.stderr
    job_id = sbatch.stdout.strip().split(";")[0]
    job = TrainJob(client, run, job_id, log)
    # Slurm starts a hetjob only in a backfill pass: every 30 s (bf_interval) on the devcluster.
    final = job.wait_for(lambda j: j.state.finished, 45, "end of the hetjob (backfill starts it)")
    assert final.state is JobState.FAILED and final.exit_code == exitcodes.NO_REQUEUE, final
    assert final.restart_count == 0 and not final.excluded_nodes, final
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        "ERROR: SLURM_HET_SIZE=2: heterogeneous jobs are not supported by slurmft launch "
        "(submit one homogeneous allocation) -> exit 86 (do not requeue)"), lines
    assert not run.exists()
