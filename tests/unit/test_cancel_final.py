"""A cancel is final (issue 25, item 3): the requeue policy, the watcher and the launcher never
bring back a job that was cancelled, whenever the cancel came. The Slurm facts the policy rests on
were measured on the devcluster (22.05.8, see ``slurmft/slurm/policy.py``); the integration test
``tests/integration/test_watch_cancel.py`` cancels a real job at each point of a recovery."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slurmft import steppoint
from slurmft.journal import read_events
from slurmft.slurm import policy
from slurmft.slurm.client import Job, JobCancelled, JobState

from test_watch_runwatch import NODES, T0, RecordingClient, job, watcher
from slurmft.rundir import RunDir

BASE = Job(job_id="1", name="t", state=JobState.RUNNING)


@pytest.mark.parametrize("flags", [(), ("COMPLETING",)])
def test_a_cancelled_job_is_never_requeued_also_while_the_cancel_completes(flags):
    # A plain `scontrol requeue`/`requeuehold` brings such a job back (measured): none is sent.
    job = replace(BASE, state=JobState.CANCELLED, flags=frozenset(flags))
    assert policy.requeue_action(job) is policy.RequeueAction.CANCELLED
    with pytest.raises(JobCancelled):
        policy.requeue_by_state(lambda: job, lambda inc: pytest.fail("requeued"), wait_s=1,
                                sleep=lambda s: None)


def test_a_cancel_between_the_read_and_the_requeue_is_final():
    # Read RUNNING -> "requeue Incomplete", which a cancel landing first makes a no-op; the
    # re-read shows CANCELLED: no plain requeue follows (before: one did, and the job came back).
    states = [JobState.RUNNING, JobState.CANCELLED]
    sent: list[bool] = []

    def fetch():
        return replace(BASE, state=states.pop(0) if len(states) > 1 else states[0])

    with pytest.raises(JobCancelled):
        policy.requeue_by_state(fetch, sent.append, wait_s=1, sleep=lambda s: None)
    assert sent == [True]  # only the Incomplete form, never a plain requeue


def test_a_cancel_in_flight_is_waited_on_then_final():
    # 22.05 shows a job being cancelled as COMPLETING with no base state (parsed RUNNING).
    states = [replace(BASE, flags=frozenset({"COMPLETING"}))] * 2 + [replace(BASE, state=JobState.CANCELLED)]
    with pytest.raises(JobCancelled):
        policy.requeue_by_state(lambda: states.pop(0) if len(states) > 1 else states[0],
                                lambda inc: pytest.fail("requeued"), wait_s=5, sleep=lambda s: None)


class CancelledMeanwhile(RecordingClient):
    """Slurm's answer once the job was cancelled after the cycle's squeue answer."""

    def requeue(self, job_id):
        self.calls.append(("requeue", job_id))
        raise JobCancelled(f"job {job_id} was cancelled")

    def requeue_hold(self, job_id):
        self.calls.append(("requeue_hold", job_id))
        raise JobCancelled(f"job {job_id} was cancelled")


@pytest.fixture
def run(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    return rd


def test_the_watcher_ends_its_watch_when_the_requeue_finds_the_job_cancelled(run):
    client = CancelledMeanwhile()
    w = watcher(run, client)
    w.step(job(), NODES, T0)
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 5)
    assert w.state.phase == "finished" and client.calls == [("requeue", "7")]
    w.step(job(JobState.CANCELLED), NODES, T0 + 10)
    assert client.calls == [("requeue", "7")]
    done = [e for e in read_events(run.events) if e.kind == "run_finished"]
    assert [e.get("how") for e in done] == ["cancelled"]


def test_giving_up_on_a_job_cancelled_meanwhile_neither_holds_nor_reports_a_hold(run):
    client = CancelledMeanwhile()
    w = watcher(run, client)
    w._give_up("crash", "test", job(JobState.FAILED, exit_code=1))
    assert w.state.phase == "finished"
    kinds = [e.kind for e in read_events(run.events)]
    assert "gave_up" not in kinds and "run_finished" in kinds


def test_a_cancel_after_the_requeue_ends_the_recovery_before_the_next_step(run):
    client = RecordingClient()
    w = watcher(run, client, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 5)
    assert client.calls == [("requeue", "7")]
    w.step(job(JobState.CANCELLED, restart=0), NODES, T0 + 6)  # requeue landed, then scancel
    assert w.state.phase == "finished" and client.calls == [("requeue", "7")]


def test_the_test_hook_runs_with_the_point_and_the_job(tmp_path, monkeypatch):
    out = tmp_path / "seen"
    hook = tmp_path / "hook"
    hook.write_text(f"#!/bin/sh\necho \"$1 $2\" >> {out}\n")
    hook.chmod(0o755)
    monkeypatch.setenv(steppoint.HOOK_ENV, str(hook))
    steppoint.reached("watch.requeue", "42")
    assert out.read_text() == "watch.requeue 42\n"
    monkeypatch.setenv(steppoint.HOOK_ENV, "relative/hook")  # refused, never run
    steppoint.reached("watch.requeue", "42")
    assert out.read_text() == "watch.requeue 42\n"


def test_the_launcher_cancelled_between_its_read_and_its_requeue_asks_for_nothing(tmp_path):
    # Before: the client's refusal became a journaled requeue_request for the watcher to carry out.
    from test_launch_requeue import IDENT, Client, _events, _voice

    from slurmft import exitcodes, journal
    from slurmft.launch import requeue

    client = Client(fail={"requeue": JobCancelled("job 2_1 was cancelled")})
    assert requeue.requeue_self(client, IDENT, _voice(tmp_path), "saved") == exitcodes.REQUEUE
    assert _events(tmp_path, journal.REQUEUE_REQUEST) == []
    actions = [e.get("action") for e in _events(tmp_path, journal.TEMPLATE)]
    assert actions == ["requeue", "not_requeued"]
