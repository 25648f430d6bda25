"""A run dir is a run, not a job, on the devcluster: a second job in the same run dir is taken on
by the watcher as a new epoch, then crashed and recovered; array tasks each in their own run dir
(a wrapper exporting SLURMFT_RUN_DIR per task, no %a) all run, and two tasks pointed at one run
dir end with the second refused in one line. Every action is the watcher's or the launcher's."""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from slurmft import exitcodes
from slurmft.journal import read_events
from slurmft.rundir import RunDir
from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import JobNotFound, JobState
from slurmft.watch.resolve import current_user

from train_job_support import JOB_ENV, TEMPLATE, TINY_ARGS, EXAMPLE, kill_ranks, submit
from watch_support import WatcherProc, events_until, observe_until, of

pytestmark = pytest.mark.integration

ARGS = [*TINY_ARGS, "--ckpt-every", "5", "--step-sleep", "0.1"]


@pytest.mark.timeout(480)
@pytest.mark.parametrize("watcher", ["one_per_job", "user_all"])
def test_a_second_job_in_the_same_run_dir_is_a_new_epoch_watched_crashed_and_recovered(
        slurm_cluster, tmp_path, watcher):
    """one_per_job: `slurmft watch JOB1` ends with its run, then `slurmft watch JOB2` starts fresh
    on the run dir's state; user_all: one `slurmft watch --user $USER --all` watches both (the
    first let go when it ends, the second taken on as the run's next epoch)."""
    run = tmp_path / "run"
    logs: list[WatcherProc] = []
    if watcher == "user_all":
        logs.append(WatcherProc(slurm_cluster, [], tmp_path / "w-all.log", "--user", current_user(),
                                "--all", run_dir=run))
    first = submit(slurm_cluster, run, [*ARGS, "--steps", "10"], nodes=1)
    if watcher == "one_per_job":
        logs.append(WatcherProc(slurm_cluster, [first.job_id], tmp_path / "w1.log", run_dir=run))

    def ctx() -> str:
        return first.context() + "".join(f"\n--- watcher {i} ---\n{w.text()[-4000:]}"
                                         for i, w in enumerate(logs))

    try:
        assert first.wait_finished(150).state is JobState.COMPLETED, ctx()
        events_until(run, lambda ev: of(ev, "run_finished", job_id=first.job_id), 60,
                     "job 1's run_finished", context=ctx)
        if watcher == "one_per_job":
            assert logs[0].wait(60) == 0, ctx()
        # The next sbatch in the same run dir continues the run (today: the watcher exits 2
        # until someone deletes watch/state.json; --all never lets the first run go).
        second = submit(slurm_cluster, run, [*ARGS, "--steps", "30"], nodes=1)
        observe_until(second.client, second.job_id, lambda j: j.run_dir is not None, 90,
                      "run dir comment", context=second.log_text)
        if watcher == "one_per_job":
            logs.append(WatcherProc(slurm_cluster, [second.job_id], tmp_path / "w2.log", run_dir=run))
        events_until(run, lambda ev: any(e.get("job_id") == second.job_id and e.get("step", 0) >= 15
                                         for e in of(ev, "checkpoint_committed")), 150,
                     "job 2's checkpoint at step 15", context=ctx)
        assert kill_ranks(slurm_cluster, second.job_id) >= 1
        events_until(run, lambda ev: of(ev, "job_running", job_id=second.job_id), 120,
                     "job 2 running again", context=ctx)
        final = observe_until(second.client, second.job_id, lambda j: j.state.finished, 200, "end",
                              context=ctx)
        assert final.state is JobState.COMPLETED, ctx()
        events_until(run, lambda ev: of(ev, "run_finished", job_id=second.job_id), 60,
                     "job 2's run_finished", context=ctx)
        if watcher == "one_per_job":
            assert logs[-1].wait(60) == 0, ctx()
    finally:
        for w in logs:
            w.kill()
    events = second.events()
    started = of(events, "watch_started")
    assert [(e.get("job_id"), e.get("epoch")) for e in started] == [(first.job_id, 1), (second.job_id, 2)]
    faults = of(events, "fault_detected")
    assert [(e.get("job_id"), e.get("cause")) for e in faults] == [(second.job_id, "crash")], ctx()
    starts = of(events, "segment_start")
    assert starts[1].get("restored_step") == 10  # job 2 went on from job 1's last checkpoint
    assert max(e.get("step") for e in of(events, "loss")) == 30
    state = json.loads(RunDir(run).watch_state.read_text())
    assert [e["job_id"] for e in state["epochs"]] == [first.job_id, second.job_id]
    assert (state["job_id"], state["restarts"], state["phase"]) == (second.job_id, 1, "finished")


WRAPPER = textwrap.dedent("""\
    #!/bin/bash
    #SBATCH --requeue
    #SBATCH --ntasks-per-node=1
    # What many users do: one run dir per task, spelled by the wrapper, no %a.
    export SLURMFT_RUN_DIR={base}/task_$SLURM_ARRAY_TASK_ID
    exec bash {template} "$@"
    """)


def _task_end(client, task_id: str, timeout: float, log: Path):
    """The task's end; a pending array of several tasks is one record (``<id>_[0-1]``) that
    names no task yet, so "not listed" is waited through."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            job = client.job(task_id)
            if job.state.finished:
                return job
        except JobNotFound:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"task {task_id} did not end within {timeout:.0f} s\n"
                                 + (log.read_text(errors="replace")[-4000:] if log.exists() else ""))
        time.sleep(1)


def _array(cluster, tmp_path, script, tasks: str, steps: int = 12):
    client = CliSlurmClient(env=cluster.env)
    env = {**os.environ, **cluster.env, **JOB_ENV}
    array_id = client.submit(script, [str(EXAMPLE), *ARGS, "--steps", str(steps)], env=env,
                             sbatch_options=["--nodes=1", f"--array={tasks}",
                                             f"--output={tmp_path}/task_%a.out", f"--chdir={tmp_path}"])
    return client, array_id


@pytest.mark.timeout(300)
def test_array_tasks_each_in_the_run_dir_a_wrapper_spells_all_run(slurm_cluster, tmp_path):
    script = tmp_path / "sweep.sbatch"
    script.write_text(WRAPPER.format(base=tmp_path, template=TEMPLATE))
    client, array_id = _array(slurm_cluster, tmp_path, script, "0-1")
    for task in (0, 1):
        log = tmp_path / f"task_{task}.out"
        job = _task_end(client, f"{array_id}_{task}", 240, log)
        assert job.state is JobState.COMPLETED and job.exit_code == 0, log.read_text()
        claim = json.loads(RunDir(tmp_path / f"task_{task}").claim.read_text())
        assert (claim["job_id"], claim["array_task_id"]) == (f"{array_id}_{task}", str(task))
        assert job.run_dir == tmp_path / f"task_{task}"


@pytest.mark.timeout(300)
def test_two_array_tasks_pointed_at_one_run_dir_the_second_is_refused_in_one_line(
        slurm_cluster, tmp_path):
    script = tmp_path / "shared.sbatch"
    shared = tmp_path / "shared"
    script.write_text(WRAPPER.format(base=tmp_path, template=TEMPLATE)
                      .replace("{base}/task_$SLURM_ARRAY_TASK_ID".format(base=tmp_path), str(shared)))
    # Long enough that the first task still runs when the second starts (they start together).
    client, array_id = _array(slurm_cluster, tmp_path, script, "0-1", steps=60)
    ends = {}
    for task in (0, 1):
        ends[task] = _task_end(client, f"{array_id}_{task}", 240, tmp_path / f"task_{task}.out")
    codes = sorted(j.exit_code for j in ends.values())
    assert codes == [0, exitcodes.NO_REQUEUE], (
        {t: (j.state, j.exit_code) for t, j in ends.items()},
        *((tmp_path / f"task_{t}.out").read_text(errors="replace")[-3000:] for t in (0, 1)))
    loser = next(t for t, j in ends.items() if j.exit_code == exitcodes.NO_REQUEUE)
    winner = 1 - loser
    text = (tmp_path / f"task_{loser}.out").read_text(errors="replace")
    errors = [line for line in text.splitlines() if "ERROR" in line]
    assert len(errors) == 1, text
    assert f"is claimed by job {array_id}_{winner} (task {winner} of array job {array_id}), which " \
           "is still alive" in errors[0], text
    # Nothing of the refused task's reached the run dir's journal.
    journaled = {e.get("job_id") for e in read_events(RunDir(shared).events)}
    assert journaled and not journaled & ends[loser].ids, journaled


@pytest.mark.timeout(120)
def test_a_one_task_array_is_known_by_its_task_id_while_it_pends(slurm_cluster, tmp_path):
    """What the watcher relies on after resubmitting a forgotten array task alone
    (``--array=<task>``): it follows ``<new id>_<task>``, which Slurm must list while the job
    pends, or the watcher would take it for forgotten."""
    script = tmp_path / "one.sbatch"
    script.write_text("#!/bin/bash\nsleep 1\n")
    client = CliSlurmClient(env=slurm_cluster.env)
    array_id = client.submit(script, env={**os.environ, **slurm_cluster.env},
                             sbatch_options=["--array=5", "--hold", f"--chdir={tmp_path}",
                                             f"--output={tmp_path}/one.out"])
    try:
        job = client.job(f"{array_id}_5")
        assert job.state is JobState.PENDING and job.job_id == f"{array_id}_5"
        assert f"{array_id}_5" in client.user_jobs(job.user)
    finally:
        client.cancel(array_id)


@pytest.mark.timeout(300)
def test_a_job_waiting_to_start_does_not_stop_the_others_from_being_watched(slurm_cluster, tmp_path):
    """`slurmft watch A B`, B not started (BeginTime an hour ahead): A is watched at once, to its
    end; B, cancelled before it ever named a run dir, is reported and the watcher exits 2. Today
    nothing is watched until B starts."""
    run = tmp_path / "run"
    a = submit(slurm_cluster, run, [*ARGS, "--steps", "10"], nodes=1)
    b = submit(slurm_cluster, tmp_path / "later", [*ARGS, "--steps", "10"], nodes=1,
               sbatch_options=["--begin=now+3600"])
    observe_until(a.client, a.job_id, lambda j: j.run_dir is not None, 90, "A's run dir comment",
                  context=a.log_text)
    w = WatcherProc(slurm_cluster, [a.job_id, b.job_id], tmp_path / "w.log", run_dir=run)
    try:
        events_until(run, lambda ev: of(ev, "watch_started", job_id=a.job_id), 90,
                     "A watched while B waits", context=w.text)
        assert a.wait_finished(150).state is JobState.COMPLETED, a.context()
        events_until(run, lambda ev: of(ev, "run_finished", job_id=a.job_id), 60,
                     "A's run_finished", context=w.text)
        assert w.proc.poll() is None, w.text()  # still waiting for B
        b.client.cancel(b.job_id)
        assert w.wait(60) == 2, w.text()
    finally:
        w.kill()
    assert f"job {b.job_id} ended (CANCELLED) without naming a run dir" in w.text()
    assert f"job(s) {b.job_id} have not started" in w.text()
