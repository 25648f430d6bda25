"""CliSlurmClient against the real devcluster (slurmctld + 4 slurmd + slurmdbd): every operation
the watcher and the sweeper rely on, observed the way they will observe it."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, TypeVar

import pytest

from slurmft.slurm.cli import CliSlurmClient
from slurmft.slurm.client import InvalidArgument, Job, JobNotFound, JobState, SlurmError

pytestmark = pytest.mark.integration
T = TypeVar("T")


def wait_for(fetch: Callable[[], T], ok: Callable[[T], bool], timeout: float, what: str, poll: float = 0.5) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {value!r}")
        time.sleep(poll)


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def client(slurm_cluster) -> CliSlurmClient:
    return CliSlurmClient(env=slurm_cluster.env)


def submit(client: CliSlurmClient, tmp_path: Path, body: str, *options: str) -> str:
    return client.submit(script(tmp_path, f"job{time.monotonic_ns()}.sh", body),
                         sbatch_options=[f"--output={tmp_path}/%j.out", *options])


def running(client: CliSlurmClient, job_id: str, timeout: float = 20) -> Job:
    return wait_for(lambda: client.job(job_id), lambda j: j.state is JobState.RUNNING, timeout, f"{job_id} RUNNING")


@pytest.mark.timeout(180)
def test_requeue_then_exclude_and_start_now(client, tmp_path):
    job_id = submit(client, tmp_path, "sleep 300", "-N2", "--comment=SLURMFT_RUN_DIR=/runs/a")
    job = running(client, job_id)
    first_nodes = job.nodes
    assert len(first_nodes) == 2 and job.node_count == 2 and job.run_dir == Path("/runs/a")

    requeued_at = datetime.now(timezone.utc)
    assert client.requeue(job_id) is True
    pending = wait_for(lambda: client.job(job_id), lambda j: j.state is JobState.PENDING and j.reason == "BeginTime",
                       30, "requeued job PENDING/BeginTime")
    # Slurm's requeue delay (~121 s), measured from the requeue, not from whenever we looked.
    delay = (pending.eligible_time - requeued_at).total_seconds()
    assert 100 <= delay <= 140, delay
    assert pending.restart_count == 1
    assert client.requeue(job_id) is True  # already pending: success, nothing done
    assert client.job(job_id).restart_count == 1

    client.update_pending(job_id, exclude_nodes=[first_nodes[0]])
    client.update_pending(job_id, exclude_nodes=[first_nodes[1]], start_now=True)
    # StartTime=now took effect: Slurm started it long before the requeue delay would have let
    # it (its next scheduling pass, ~3 s here; how long exactly is the matrix report's business).
    again = running(client, job_id, timeout=60)
    assert (pending.eligible_time - again.start_time).total_seconds() > 30, (again.start_time, pending)
    assert set(again.excluded_nodes) == set(first_nodes)  # merged, not replaced
    assert not set(again.nodes) & set(first_nodes) and len(again.nodes) == 2
    # slurmctld hands the requeued run's record to slurmdbd asynchronously: wait until sacct
    # shows it (REQUEUED on the first nodes, then the run that is going on now).
    def both_runs_recorded(h: list[Job]) -> bool:
        return len(h) >= 2 and h[0].state is JobState.REQUEUED and h[-1].state is JobState.RUNNING

    history = wait_for(lambda: client.job_history(job_id), both_runs_recorded, 30,
                       "accounting records of the requeued run and the new one")
    assert history[0].nodes == first_nodes and history[-1].nodes == again.nodes
    client.cancel(job_id)


@pytest.mark.timeout(60)
def test_readmitted_nodes_leave_the_exclusion_list_down_to_none(client, tmp_path, slurm_cluster):
    first, second = slurm_cluster.node_names[:2]
    job_id = submit(client, tmp_path, "sleep 300", "-N1", "--hold", f"--exclude={first},{second}")
    assert set(client.job(job_id).excluded_nodes) == {first, second}
    client.update_pending(job_id, readmit_nodes=[first])
    assert client.job(job_id).excluded_nodes == (second,)
    client.update_pending(job_id, readmit_nodes=[second], exclude_nodes=[first])
    assert client.job(job_id).excluded_nodes == (first,)
    client.update_pending(job_id, readmit_nodes=[first])
    assert client.job(job_id).excluded_nodes == ()  # an empty ExcNodeList= clears it
    client.cancel(job_id)


def test_exit_codes_and_completed_job_is_never_requeued(client, tmp_path):
    ok = submit(client, tmp_path, "exit 0")
    bad = submit(client, tmp_path, "exit 3")
    done = wait_for(lambda: client.jobs([ok, bad]), lambda js: len(js) == 2 and all(j.state.finished for j in js.values()),
                    30, "both jobs finished")
    assert done[ok].state is JobState.COMPLETED and done[ok].exit_code == 0
    assert done[bad].state is JobState.FAILED and done[bad].exit_code == 3 and done[bad].exit_signal is None
    assert client.requeue(ok) is False
    time.sleep(1)
    assert client.job(ok).state is JobState.COMPLETED
    history = wait_for(lambda: client.job_history(bad), lambda h: bool(h) and h[-1].state.finished, 10, "sacct record")
    assert history[-1].exit_code == 3


@pytest.mark.timeout(60)
def test_drain_resume_hold_release(client, tmp_path, slurm_cluster):
    client.drain("n2", "slurmft: gpu:\nxid 79\t" + "x" * 400)
    node = client.nodes(["n2"])["n2"]
    assert node.drained and node.reason.startswith("slurmft: gpu: xid 79 x") and "\n" not in node.reason
    assert len(node.reason) <= 200 and set(client.nodes()) == set(slurm_cluster.node_names)
    client.resume("n2")
    assert not client.nodes(["n2"])["n2"].drained
    client.resume("n2")  # already in service: nothing to do, no error

    job_id = submit(client, tmp_path, "true", "--begin=now+600")
    client.hold(job_id)
    held = client.job(job_id)
    assert held.state is JobState.PENDING and held.reason.startswith("JobHeld")
    client.release(job_id)
    released = client.job(job_id)
    assert released.state is JobState.PENDING and not released.reason.startswith("JobHeld")
    assert (released.eligible_time - datetime.now(timezone.utc)).total_seconds() > 500  # --begin kept
    client.cancel(job_id)


@pytest.mark.timeout(60)
def test_cancel_with_usr2_reaches_the_batch_script(client, tmp_path):
    marker, trapped = tmp_path / "got-usr2", tmp_path / "trap-installed"
    job_id = submit(client, tmp_path, f"trap 'echo usr2 > {marker}; exit 0' USR2\ntouch {trapped}\n"
                                      "while true; do sleep 0.2; done")
    running(client, job_id)
    # RUNNING comes with the allocation, before slurmd has even started the script: a USR2 sent
    # before the trap is in place would kill bash instead; on a loaded box 1 s is no guarantee.
    wait_for(lambda: trapped.exists(), bool, 20, "the batch script's USR2 trap")
    client.cancel(job_id, signal="USR2", batch_only=True)
    wait_for(lambda: marker.exists(), bool, 15, "USR2 marker file")
    assert marker.read_text().strip() == "usr2"


@pytest.mark.timeout(90)
def test_a_job_starts_a_step_in_another_of_its_users_jobs(client, tmp_path):
    """What in-allocation mode's spares from outside the allocation rest on
    (``slurmft.launch.refill``): from inside one job, ``srun --jobid=J`` starts a step in the
    one-node job J's allocation, on J's node, without J's batch script doing anything; the step's
    Slurm sets J's id (the task puts the training job's back), and cancelling J ends the step.
    Run on every release of the matrix (22.05, 24.11, 26.05)."""
    holder = submit(client, tmp_path, "sleep 300", "-N1", "--exclusive")
    node = running(client, holder).nodes[0]
    seen, ended = tmp_path / "step-seen", tmp_path / "step-ended"
    step = (f"srun --jobid={holder} --nodes=1 --ntasks=1 --nodelist={node} --kill-on-bad-exit=0 "
            f"bash -c 'echo $SLURMD_NODENAME $SLURM_JOB_ID > {seen}; sleep 300'; "
            f"echo $? > {ended}")
    outer = submit(client, tmp_path, step, "-N1", f"--exclude={node}")
    running(client, outer)
    text = wait_for(lambda: seen.read_text() if seen.exists() else "", bool, 30, "the step's line")
    assert text.split() == [node, holder]
    client.cancel(holder)
    wait_for(lambda: ended.exists(), bool, 30, "srun's end after the holder's cancel")
    assert ended.read_text().strip() != "0"
    wait_for(lambda: client.job(outer), lambda j: j.state.finished, 30, "the outer job's end")


@pytest.mark.timeout(40)
def test_no_requeue_job_is_refused_and_left_running(client, tmp_path):
    job_id = submit(client, tmp_path, "sleep 60", "--no-requeue")
    assert running(client, job_id).requeue_allowed is False
    with pytest.raises(SlurmError, match="--no-requeue"):
        client.requeue(job_id)
    assert client.job(job_id).state is JobState.RUNNING
    client.cancel(job_id)


@pytest.mark.timeout(30)
def test_errors_unknown_job_and_invalid_names(client, monkeypatch):
    with pytest.raises(JobNotFound, match="Invalid job id specified"):
        client.job("999999")
    calls = []
    monkeypatch.setattr(client, "_run", lambda argv, **kw: calls.append(argv))
    with pytest.raises(InvalidArgument, match="invalid node name"):
        client.nodes(["n[1-2]"])
    with pytest.raises(InvalidArgument, match="invalid node name"):
        client.drain("n1;reboot", "x")
    with pytest.raises(InvalidArgument, match="invalid job id"):
        client.requeue("12 13")
    assert calls == []


@pytest.mark.timeout(60)
def test_accounting_without_a_record_is_no_record(client, slurm_cluster):
    """Issue 26 item 6, on this release's real sacct: a job accounting never saw is no record
    (and ``job`` says the job is unknown), whatever shape the answer has (22.05's JSON says
    "Nothing found" as an error; 23.02+ as a warning). Both the client's history call and the
    JSON answer with the data_parser the client chose are read."""
    import os
    import subprocess

    from slurmft.slurm.parse_jobs import parse_sacct

    assert client.job_history("999999") == []
    with pytest.raises(JobNotFound):
        client.job("999999")
    out = subprocess.run(["sacct", client._json(), "-D", "-j", "999999"], capture_output=True, text=True,
                         env={**os.environ, **slurm_cluster.env}, timeout=30, check=True).stdout
    assert parse_sacct(out) == []


@pytest.mark.timeout(60)
def test_jobs_of_several_ids_is_one_controller_call(client, tmp_path, monkeypatch):
    ids = [submit(client, tmp_path, "sleep 60") for _ in range(3)]
    client.info()  # cached release/data_parser probe, not part of a poll
    calls = []
    real = client._run
    monkeypatch.setattr(client, "_run", lambda argv, **kw: calls.append(list(argv)) or real(argv, **kw))
    jobs = client.jobs([*ids, "999999"])
    assert set(jobs) == set(ids) and len(calls) == 1 and calls[0][0] == "squeue"


@pytest.mark.timeout(90)
def test_node_death_makes_node_down_and_job_leaves_running(client, tmp_path, slurm_cluster):
    job_id = submit(client, tmp_path, "sleep 300", "-N1")
    victim = running(client, job_id).nodes[0]
    killed = time.monotonic()
    slurm_cluster.kill_node(victim)
    node = wait_for(lambda: client.nodes([victim])[victim], lambda n: n.down, 45, f"{victim} DOWN", poll=1)
    took = time.monotonic() - killed
    assert not node.responding and 15 <= took <= 45, took
    job = wait_for(lambda: client.job(job_id), lambda j: j.state is not JobState.RUNNING, 15, "job no longer RUNNING")
    if job.state is JobState.PENDING:  # 22.05 here: requeued by Slurm when the node went DOWN
        assert job.restart_count == 1
    elif job.state is JobState.FAILED:
        # 24.11 here: the batch step reported its task's SIGKILL before its own slurmstepd died
        # (kill_node kills the tree one process at a time), so Slurm saw a failed job, not a node.
        assert job.reason == "RaisedSignal" and job.exit_signal == 9
    else:
        assert job.state is JobState.NODE_FAIL
    client.cancel(job_id)


@pytest.mark.timeout(60)
def test_set_down_takes_a_silent_nodes_job_off_it_at_once(client, tmp_path, slurm_cluster):
    """What the watcher's --operator mode does to a node that stopped answering: the controller
    gives up on it now instead of after SlurmdTimeout (300 s by default), so the job leaves it."""
    job_id = submit(client, tmp_path, "sleep 300", "-N1", "--requeue")
    victim = running(client, job_id).nodes[0]
    started = time.monotonic()
    client.set_down(victim, "slurmft: silent node: heartbeats of job 1 stale 31 s")
    node = client.nodes([victim])[victim]
    assert node.down and node.reason.startswith("slurmft: silent node"), node
    job = wait_for(lambda: client.job(job_id), lambda j: j.state is not JobState.RUNNING, 20,
                   "the job off its DOWN node")
    assert time.monotonic() - started < 20
    assert job.state in (JobState.PENDING, JobState.NODE_FAIL, JobState.FAILED), job
    client.cancel(job_id)
    with pytest.raises(InvalidArgument):
        client.set_down("n1;reboot", "x")


@pytest.mark.timeout(120)
def test_a_requeue_the_controller_never_answers_is_read_back_not_sent_twice(slurm_cluster, tmp_path):
    """The real controller stops answering in the middle of a requeue (slurmctld SIGSTOPped: the
    request waits in its socket, scontrol gives up, and slurmctld carries the requeue out once it
    runs again). The client must learn from the job that the requeue happened: True, one
    requeue (restart count 1), no error. (Sending it again blindly got "Job is pending
    execution" for a requeue that had succeeded.)"""
    import os
    import signal
    import threading

    from slurmft.slurm.config import SlurmConfig
    from slurmft.slurm.runner import Runner

    ctld = slurm_cluster.processes()["slurmctld"].pid
    stalls: list[threading.Timer] = []

    class StallDuringRequeue(Runner):
        def run(self, argv, **kwargs):
            if tuple(argv[:2]) == ("scontrol", "requeue") and not stalls:
                os.kill(ctld, signal.SIGSTOP)
                stalls.append(threading.Timer(4.0, os.kill, (ctld, signal.SIGCONT)))
                stalls[0].start()
            return super().run(argv, **kwargs)

    config = SlurmConfig(timeout=1.5, retries=6, backoff=0.5, max_backoff=2.0)
    plain = CliSlurmClient(env=slurm_cluster.env)
    job_id = submit(plain, tmp_path, "exit 1")  # FAILED: a plain requeue, refused once PENDING
    wait_for(lambda: plain.job(job_id), lambda j: j.state is JobState.FAILED, 30, f"{job_id} FAILED")
    stalled = CliSlurmClient(config, runner=StallDuringRequeue(config, slurm_cluster.env))
    try:
        assert stalled.requeue(job_id) is True
    finally:
        for timer in stalls:
            timer.cancel()
        os.kill(ctld, signal.SIGCONT)
    assert stalls, "the requeue was never sent"
    job = wait_for(lambda: plain.job(job_id), lambda j: j.state is JobState.PENDING, 30,
                   "requeued job PENDING")
    assert job.restart_count == 1
