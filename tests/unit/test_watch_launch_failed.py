"""A job Slurm itself held after a failed launch is released with the node excluded; a job held
by its user or an admin never is (issue 25, item 10). Parsers run on output captured on the
devcluster (22.05.8, tests/fixtures/slurm/2205/README.md)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from slurmft.journal import read_events
from slurmft.rundir import RunDir
from slurmft.slurm import policy
from slurmft.slurm.client import Job, JobCancelled, JobState, SlurmError
from slurmft.slurm.parse_jobs import parse_squeue
from slurmft.slurm.parse_nodes import parse_nodes
from slurmft.slurm.parse_steps import FailedRun, failed_run
from slurmft.watch.metrics import WatchMetrics

from test_watch_runwatch import NODES, T0, RecordingClient, job, watcher

CAP = Path(__file__).resolve().parents[1] / "fixtures" / "slurm" / "2205"


def _held() -> dict[str, Job]:
    return {j.name: j for j in parse_squeue((CAP / "squeue_held_launch_user_admin.json").read_text())}


def test_slurms_own_hold_after_a_failed_launch_is_told_from_a_users_and_an_admins():
    held = _held()
    assert {n: j.reason for n, j in held.items()} == {
        "launchfail": "JobHeldUser", "userhold": "JobHeldUser", "adminhold": "JobHeldAdmin"}
    assert held["launchfail"].reason_detail == "launch failed requeued held"
    assert [n for n, j in held.items() if policy.held_after_failed_launch(j)] == ["launchfail"]


def _host(output: str, raw: str) -> str | None:
    run = failed_run(output, raw)
    return None if run is None else run.batch_host


def test_the_node_a_launch_failed_on_is_the_batch_step_of_the_newest_requeued_run():
    assert _host((CAP / "sacct_steps_launch_failed.txt").read_text(), "10") == "n3"
    assert _host((CAP / "sacct_steps_launch_failed_twice.txt").read_text(), "10") == "n3"
    assert failed_run("10|PENDING|None assigned\n", "10") is None  # accounting lags
    assert _host("10|REQUEUED|n[1-2]\n10.batch|CANCELLED|n[1-2]\n", "10") is None
    assert failed_run("10|REQUEUED|n3\n10.batch|CANCELLED|n3\n", "1") is None  # not its


@pytest.mark.parametrize("fixture,raw", [("sacct_steps_prolog_failed_second_node.txt", "2"),
                                         ("sacct_steps_prolog_failed_alloc.txt", "3")])
def test_a_failed_run_names_its_whole_allocation_beside_its_batch_host(fixture, raw):
    # A 2-node job whose prolog failed on n2, at its first step or (PrologFlags=Alloc) at its
    # allocation (22.05.8, captured): the batch step ran on n1, the healthy batch host.
    assert failed_run((CAP / fixture).read_text(), raw) == FailedRun(("n1", "n2"), "n1")


def test_a_failed_prolog_blames_the_node_slurm_drained_for_it_not_the_batch_host():
    nodes = parse_nodes((CAP / "sinfo_prolog_error_drain.json").read_text(), "sinfo --json")
    assert nodes["n2"].reason == "Prolog error" and policy.prolog_failed(nodes["n2"])
    assert not policy.prolog_failed(nodes["n1"])
    run = FailedRun(("n1", "n2"), "n1")
    assert policy.launch_failure_nodes(run, nodes) == (("n2",), "Slurm drained it: Prolog error")
    # No prolog drain on the run's nodes: the batch launch failed on its batch host.
    healthy = {"n1": nodes["n1"], "n2": replace(nodes["n2"], flags=frozenset(), reason="")}
    assert policy.launch_failure_nodes(run, healthy)[0] == ("n1",)
    # An admin's drain for another reason is no evidence about the launch.
    admin = {**healthy, "n2": replace(nodes["n2"], reason="bad dimm")}
    assert policy.launch_failure_nodes(run, admin)[0] == ("n1",)
    assert policy.launch_failure_nodes(FailedRun(("n1", "n2"), None), healthy) == ((), "")


def test_release_rereads_and_refuses_a_users_or_admins_hold_or_a_cancel():
    held = _held()
    released = []
    policy.release_launch_hold(lambda: held["launchfail"], lambda: released.append(1))
    assert released == [1]
    for name in ("userhold", "adminhold"):
        with pytest.raises(SlurmError, match="not held by Slurm"):
            policy.release_launch_hold(lambda: held[name], lambda: pytest.fail("released"))
    with pytest.raises(JobCancelled):
        policy.release_launch_hold(lambda: replace(held["launchfail"], state=JobState.CANCELLED),
                                   lambda: pytest.fail("released"))


class LaunchClient(RecordingClient):
    def __init__(self, node: str | None = "n1", refuse: str | None = None) -> None:
        super().__init__()
        self.node, self.refuse = node, refuse

    def failed_launch_nodes(self, job_value: Job) -> tuple[tuple[str, ...], str]:
        self.calls.append(("failed_launch_nodes", job_value.job_id))
        return ((self.node,), "the batch step's node") if self.node else ((), "")

    def release_launch_hold(self, job_id: str) -> None:
        if self.refuse:
            raise SlurmError(self.refuse)
        self.calls.append(("release", job_id))


def _launch_held(restart=1) -> Job:
    return job(JobState.PENDING, restart=restart, nodes=(), reason="JobHeldUser",
               reason_detail="launch failed requeued held")


@pytest.fixture
def run(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    return rd


def test_a_job_held_after_a_failed_launch_is_released_with_its_node_excluded(run):
    client = LaunchClient(node="n1")
    w = watcher(run, client, start_now_delay_s=0)
    w.step(_launch_held(), NODES, T0)  # seen held at first sight: the launch failed at once
    assert client.calls == [("failed_launch_nodes", "7"), ("exclude", "7", ("n1",)), ("release", "7"),
                            ("start_now", "7", ())]
    fault = [e for e in read_events(run.events) if e.kind == "fault_detected"][0]
    assert fault.get("cause") == "launch_failed" and fault.get("nodes") == ["n1"]
    assert "on n1" in fault.get("evidence") and w.state.node_faults == {"n1": 1}
    w.step(job(JobState.PENDING, restart=1, nodes=()), NODES, T0 + 2)  # released: pending
    w.step(job(restart=1, nodes=("n2",)), NODES, T0 + 5)
    assert w.state.phase == "watching" and w.faults() == 1  # bounded like every other recovery


def test_accounting_that_lags_is_waited_for_before_acting(run):
    client = LaunchClient(node=None)
    w = watcher(run, client, start_now_delay_s=0)
    w.step(_launch_held(), NODES, T0)
    assert client.calls == [("failed_launch_nodes", "7")] and w.state.phase == "watching"
    client.node = "n2"
    w.step(_launch_held(), NODES, T0 + 1)
    assert ("exclude", "7", ("n2",)) in client.calls and ("release", "7") in client.calls


@pytest.mark.parametrize("reason,detail", [("JobHeldUser", ""), ("JobHeldAdmin", "")])
def test_a_job_held_by_its_user_or_an_admin_is_never_touched(run, reason, detail):
    client = LaunchClient()
    w = watcher(run, client)
    w.step(job(JobState.PENDING, restart=0, nodes=(), reason=reason, reason_detail=detail), NODES, T0)
    w.step(job(JobState.PENDING, restart=0, nodes=(), reason=reason, reason_detail=detail), NODES, T0 + 5)
    assert client.calls == [] and not read_events(run.events, ["fault_detected"])


def test_a_hold_put_on_since_the_last_look_is_left_as_it_is(run):
    client = LaunchClient(refuse="job 7 is not held by Slurm after a failed launch (...): not released")
    w = watcher(run, client, start_now_delay_s=0)
    w.step(_launch_held(), NODES, T0)  # the re-read refused it: an admin held it meanwhile
    admin = job(JobState.PENDING, restart=1, nodes=(), reason="JobHeldAdmin")
    w.step(admin, NODES, T0 + 1)  # this cycle's answer says so too: left as it is
    w.step(admin, NODES, T0 + 2)
    assert ("release", "7") not in client.calls and ("start_now", "7", ()) not in client.calls
    assert w.state.phase == "watching"
    warned = [e.get("what") for e in read_events(run.events, ["watch_warning"])]
    assert warned == ["not_released"]


def test_the_node_a_fault_names_is_visible_in_the_metrics():
    metrics = WatchMetrics(clock=lambda: T0)
    metrics.on_event("fault_detected", {"job_id": "7", "cause": "launch_failed", "nodes": ["n3"],
                                        "time": T0, "fault_time": T0})
    assert metrics.registry.get_sample_value(
        "slurmft_watch_node_faults_total", {"node": "n3", "cause": "launch_failed"}) == 1.0


def test_a_restart_that_fails_to_launch_mid_recovery_is_recovered_too(run):
    # A crash, requeued; the new run's launch fails on n2: Slurm holds the job. Before, the
    # recovery waited for it to run, sending StartTime=now to a held job, for ever.
    client = LaunchClient(node="n2")
    w = watcher(run, client, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 5)
    assert client.calls == [("requeue", "7")]
    w.step(_launch_held(restart=1), NODES, T0 + 8)
    assert client.calls[1:] == [("failed_launch_nodes", "7"), ("exclude", "7", ("n2",)), ("release", "7"),
                                ("start_now", "7", ())]
    causes = [e.get("cause") for e in read_events(run.events, ["fault_detected"])]
    assert causes == ["crash", "launch_failed"]


def test_under_cron_the_wait_for_accounting_is_bounded_across_once_invocations(run):
    """Each ``--once`` (cron) is a new watcher: the cycles waited for accounting to name the
    node live in the run's state, so the wait ends after ``CAPTURE_TRIES`` invocations with a
    release (said in a warning) instead of never (it restarted from zero each time)."""
    from slurmft.watch.runwatch import CAPTURE_TRIES, RunWatch
    from slurmft.watch.config import WatchConfig
    from slurmft.watch.state import load_state, save_state, RunState

    client = LaunchClient(node=None)
    save_state(run, RunState(job_id="7"))
    for i in range(CAPTURE_TRIES):
        w = RunWatch(run, load_state(run, "7"), client, WatchConfig(start_now_delay_s=0), once=True)
        w.step(_launch_held(), NODES, T0 + 60 * i)
    assert ("release", "7") in client.calls
    assert [e.get("what") for e in read_events(run.events) if e.kind == "watch_warning"] == [
        "launch_node_unknown"]
