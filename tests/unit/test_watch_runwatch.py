"""The watcher's per-run state machine, driven cycle by cycle with constructed observations and
a client that records what it is asked (unit level: the integration tests use the devcluster)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timezone

import pytest

from slurmft import journal
from slurmft.journal import read_events
from slurmft.rundir import RunDir
from slurmft.slurm.client import Job, JobState, Node, NodeState, SlurmError
from slurmft.watch.config import WatchConfig
from slurmft.watch.exclusions import fit_exclusions, readmit_to_fit
from slurmft.watch.runwatch import RunWatch
from slurmft.watch.state import LockError, RunLock, RunState, StateError, load_state

T0 = 1_800_000_000.0


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, tz=timezone.utc)


class RecordingClient:
    """Answers the watcher's acting calls and records them; ``fail`` makes the next call of a
    kind raise like Slurm does."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail: dict[str, str] = {}

    def _call(self, *call) -> None:
        if call[0] in self.fail:
            raise SlurmError(self.fail.pop(call[0]))
        self.calls.append(call)

    def requeue(self, job_id: str) -> bool:
        self._call("requeue", job_id)
        return True

    def update_pending(self, job_id, *, exclude_nodes=(), readmit_nodes=(), start_now=False) -> None:
        if readmit_nodes:
            self._call("readmit", job_id, tuple(readmit_nodes))
        else:
            self._call("start_now" if start_now else "exclude", job_id, tuple(exclude_nodes))

    def hold(self, job_id: str) -> None:
        self._call("hold", job_id)

    def requeue_hold(self, job_id: str) -> bool:
        self._call("requeue_hold", job_id)
        return True

    # First sight: no submission to save (resubmission has its own tests).
    def submit_line(self, job_id: str):
        return None

    def batch_script(self, job_id: str) -> str:
        raise AssertionError("not asked without a submit line")


def job(state=JobState.RUNNING, restart=0, nodes=("n1", "n2"), **kw) -> Job:
    return Job(job_id="7", name="train", state=state, restart_count=restart, nodes=nodes,
               node_count=len(nodes), start_time=at(0), **kw)


NODES = {n: Node(n, NodeState.IDLE) for n in ("n1", "n2", "n3", "n4")}


@pytest.fixture
def run(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    return rd


def watcher(rd, client, **cfg) -> RunWatch:
    return RunWatch(rd, RunState(job_id="7"), client, WatchConfig(**cfg))


def journal_line(rd: RunDir, kind: str, **fields) -> None:
    journal.append_event(rd.events, kind, **fields)


def test_crash_is_requeued_once_then_started_now_after_the_delay(run):
    client = RecordingClient()
    w = watcher(run, client, start_now_delay_s=1.5)
    w.step(job(), NODES, T0 + 10)
    w.step(job(JobState.FAILED, exit_code=1, end_time=at(11)), NODES, T0 + 12)
    assert client.calls == [("requeue", "7")]
    w.step(job(JobState.FAILED, exit_code=1, end_time=at(11)), NODES, T0 + 13)  # stale answer
    assert client.calls == [("requeue", "7")]
    w.step(job(JobState.PENDING, restart=1, nodes=()), NODES, T0 + 14)
    assert client.calls == [("requeue", "7")]  # PENDING just seen: not yet
    w.step(job(JobState.PENDING, restart=1, nodes=()), NODES, T0 + 15.6)
    assert client.calls[-1] == ("start_now", "7", ())
    w.step(replace(job(restart=1), start_time=at(16)), NODES, T0 + 17)
    kinds = [e.kind for e in read_events(run.events)]
    assert kinds == ["watch_started", "fault_detected", "recovery_action", "recovery_action",
                     "job_running"]
    assert w.state.phase == "watching" and w.state.restarts_by_cause == {"crash": 1}


def test_a_requeue_recorded_as_in_flight_is_not_repeated_once_slurm_shows_it(run):
    client = RecordingClient()
    w = watcher(run, client)
    w.step(job(), NODES, T0)
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 5)
    saved = load_state(run, "7")
    saved.recovery.requeue = "doing"  # killed right after sending it
    w2 = RunWatch(run, saved, client, WatchConfig())
    w2.step(job(JobState.PENDING, restart=1, nodes=()), NODES, T0 + 8)
    assert [c[0] for c in client.calls] == ["requeue"]


def test_start_now_refused_right_after_requeue_is_retried(run):
    client = RecordingClient()
    w = watcher(run, client, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 5)
    client.fail["start_now"] = "slurm_update error: Job credential revoked"
    w.step(job(JobState.PENDING, restart=1, nodes=()), NODES, T0 + 6)
    assert w.state.recovery.start_now == "todo"
    w.step(job(JobState.PENDING, restart=1, nodes=()), NODES, T0 + 7)
    assert client.calls[-1] == ("start_now", "7", ())
    fails = [e for e in read_events(run.events) if e.kind == "recovery_action" and not e.get("ok")]
    assert "credential revoked" in fails[0].get("detail")


def test_slurm_requeue_after_node_failure_is_expedited_with_the_dead_node_excluded(run):
    client = RecordingClient()
    w = watcher(run, client, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    down = {**NODES, "n2": Node("n2", NodeState.DOWN, frozenset({"NOT_RESPONDING"}), "Not responding")}
    w.step(job(JobState.PENDING, restart=1, nodes=()), down, T0 + 30)
    assert client.calls == [("exclude", "7", ("n2",)), ("start_now", "7", ())]
    fault = [e for e in read_events(run.events) if e.kind == "fault_detected"][0]
    assert fault.get("cause") == "node_fail" and fault.get("nodes") == ["n2"]


def test_self_requeue_after_preemption_is_only_started_now(run):
    client = RecordingClient()
    w = watcher(run, client, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    journal_line(run, journal.PREEMPTION, job_id="7", restart_count=0, step=3, signal="USR2")
    journal_line(run, journal.SEGMENT_END, job_id="7", restart_count=0, exit_code=85)
    journal_line(run, journal.TEMPLATE, job_id="7", restart_count=0, action="requeue",
                 reason="training saved and asked to be requeued")
    w.step(job(JobState.PENDING, restart=1, nodes=()), NODES, T0 + 30)
    assert client.calls == [("start_now", "7", ())]
    assert w.state.restarts_by_cause == {"preempted": 1}


def test_launcher_requeue_request_is_carried_out_with_its_exclusions(run):
    client = RecordingClient()
    w = watcher(run, client, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    journal_line(run, journal.REQUEUE_REQUEST, job_id="7", restart_count=0, reason="no scontrol",
                 exclude=["n1"])
    journal_line(run, journal.SEGMENT_END, job_id="7", restart_count=0, exit_code=85)
    w.step(job(JobState.FAILED, exit_code=85), NODES, T0 + 5)
    w.step(job(JobState.PENDING, restart=1, nodes=()), NODES, T0 + 7)
    assert client.calls == [("requeue", "7"), ("exclude", "7", ("n1",)), ("start_now", "7", ())]


def test_do_not_requeue_exit_gives_up_and_holds_the_ended_job_in_the_queue(run):
    # Not requeued to run, not cancelled: back in the queue held (requeuehold), so it stays visible
    # with its reason and `scontrol release` resumes it once the cause is fixed.
    client = RecordingClient()
    w = watcher(run, client)
    w.step(job(), NODES, T0)
    journal_line(run, journal.SEGMENT_END, job_id="7", restart_count=0, exit_code=86, reason="NaNs")
    w.step(job(JobState.FAILED, exit_code=86), NODES, T0 + 5)
    assert client.calls == [("requeue_hold", "7")] and w.state.phase == "gave_up"
    gave = [e for e in read_events(run.events) if e.kind == "gave_up"][0]
    assert gave.get("cause") == "no_requeue" and gave.get("held") is True


def test_giving_up_never_touches_a_completed_or_cancelled_job(run):
    from slurmft.watch.state import RunState as _State

    for state in (JobState.COMPLETED, JobState.CANCELLED):
        client = RecordingClient()
        w = RunWatch(run, _State(job_id="7"), client, WatchConfig())
        w._give_up("crash", "test", job(state, exit_code=0))
        assert client.calls == []


def test_max_restarts_holds_the_requeued_job(run):
    client = RecordingClient()
    w = watcher(run, client, max_restarts=1, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    w.step(job(JobState.PENDING, restart=1, nodes=()), NODES, T0 + 5)  # 1st: expedited
    w.step(job(restart=1), NODES, T0 + 10)
    w.step(job(JobState.PENDING, restart=2, nodes=()), NODES, T0 + 20)  # 2nd: over the limit
    assert client.calls[-1] == ("hold", "7") and w.state.phase == "gave_up"


def test_completed_job_and_done_run_are_finished_never_requeued(run):
    client = RecordingClient()
    w = watcher(run, client)
    w.step(job(), NODES, T0)
    w.step(job(JobState.COMPLETED, exit_code=0), NODES, T0 + 5)
    assert client.calls == [] and w.state.phase == "finished"
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 10)  # nothing after the end
    assert client.calls == []


def test_done_marker_of_an_earlier_job_does_not_finish_this_one(run):
    run.done.write_text(json.dumps({"job_id": "3", "step": 100}))
    client = RecordingClient()
    w = watcher(run, client)
    w.step(job(), NODES, T0)
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 5)
    assert client.calls == [("requeue", "7")]


def test_known_bad_node_is_excluded_again_at_the_next_restart(run):
    client = RecordingClient()
    w = watcher(run, client, repeat_offender_faults=1, start_now_delay_s=0)
    w.state.node_faults = {"n3": 1}
    w.step(job(), NODES, T0)
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 5)
    w.step(job(JobState.PENDING, restart=1, nodes=()), NODES, T0 + 6)
    assert ("exclude", "7", ("n3",)) in client.calls


def test_exclusions_that_would_not_fit_are_dropped():
    pending = replace(job(JobState.PENDING, nodes=()), node_count=3, min_nodes=3)
    keep, dropped = fit_exclusions(pending, NODES, ["n1", "n2"])
    assert keep == ["n1"] and dropped == ["n2"]
    down = {**NODES, "n4": Node("n4", NodeState.DOWN)}
    keep, dropped = fit_exclusions(pending, down, ["n4"])
    assert keep == ["n4"] and dropped == []  # a DOWN node costs no capacity


def test_readmit_only_our_repaired_exclusions_oldest_first_and_only_to_fit():
    pending = replace(job(JobState.PENDING, nodes=()), node_count=2, min_nodes=2,
                      excluded_nodes=("n1", "n2", "n3"))
    # n3 is the user's own exclusion; n1 and n2 are ours (n2 the older) and in service again.
    assert readmit_to_fit(pending, NODES, [], ["n2", "n1"]) == ["n2"]
    # With the new exclusion of n4 there is room for nothing else: both of ours come back.
    assert readmit_to_fit(pending, NODES, ["n4"], ["n2", "n1"]) == ["n2", "n1"]
    # A node of ours still drained stays excluded.
    drained = {**NODES, "n2": Node("n2", NodeState.IDLE, frozenset({"DRAIN"}), "slurmft: x")}
    assert readmit_to_fit(pending, drained, [], ["n2", "n1"]) == ["n1"]
    # Enough room already: nothing is lifted.
    roomy = replace(pending, excluded_nodes=("n1",))
    assert readmit_to_fit(roomy, NODES, [], ["n1"]) == []


def test_exclusions_of_repaired_nodes_are_lifted_when_the_job_would_not_fit(run):
    """Weeks of faults on a small partition: every node the watcher excluded was repaired since;
    the next exclusion would leave the 3-node job room for 1 node, so the oldest come back."""
    client = RecordingClient()
    w = watcher(run, client, start_now_delay_s=0)
    w.state.excluded = ["n1", "n2"]
    three = replace(job(nodes=("n2", "n3", "n4")), node_count=3, min_nodes=3)
    w.step(replace(three, nodes=("n1", "n3", "n4")), NODES, T0)
    down = {**NODES, "n4": Node("n4", NodeState.DOWN, frozenset({"NOT_RESPONDING"}), "Not responding")}
    pending = replace(three, state=JobState.PENDING, restart_count=1, nodes=(),
                      excluded_nodes=("n2",))
    w.step(pending, down, T0 + 30)
    assert client.calls == [("exclude", "7", ("n4",)), ("readmit", "7", ("n2",)),
                            ("start_now", "7", ())]
    assert w.state.excluded == ["n1", "n4"]
    readmitted = [e for e in read_events(run.events) if e.get("action") == "readmit"]
    assert readmitted[0].get("nodes") == ["n2"] and readmitted[0].get("ok")
    assert load_state(run, "7").excluded == ["n1", "n4"]


def test_a_crash_with_nothing_to_exclude_still_readmits_what_the_job_needs(run):
    """Two node deaths, both excluded; both nodes repaired since. The next fault names no node,
    yet the job would never start again: our exclusions come back, a refusal is tried again."""
    client = RecordingClient()
    w = watcher(run, client, start_now_delay_s=0)
    w.state.excluded = ["n1", "n2"]
    three = replace(job(nodes=("n2", "n3", "n4")), node_count=3, min_nodes=3)
    w.step(replace(three, nodes=("n3", "n4", "n1")), NODES, T0)
    w.step(replace(three, state=JobState.FAILED, exit_code=1, nodes=("n3", "n4", "n1")), NODES, T0 + 5)
    pending = replace(three, state=JobState.PENDING, restart_count=1, nodes=(),
                      excluded_nodes=("n1", "n2"))
    client.fail["readmit"] = "slurm_update error: Socket timed out"
    w.step(pending, NODES, T0 + 6)
    assert ("readmit", "7", ("n1",)) not in client.calls
    w.step(pending, NODES, T0 + 7)
    assert client.calls[:2] == [("requeue", "7"), ("start_now", "7", ())]
    assert ("readmit", "7", ("n1",)) in client.calls
    assert w.state.excluded == ["n2"]


def test_second_watcher_of_a_run_is_refused_naming_the_holder(run):
    first = RunLock(run)
    first.acquire()
    try:
        with pytest.raises(LockError, match="already watched by pid"):
            RunLock(run).acquire()
    finally:
        first.release()
    RunLock(run).acquire()


def test_state_file_that_is_not_json_is_a_clear_error(run):
    run.watch_state.parent.mkdir(parents=True)
    run.watch_state.write_text("{nope")
    with pytest.raises(StateError, match="state.json"):
        load_state(run, "7")


class OperatorClient(RecordingClient):
    def set_down(self, node: str, reason: str) -> None:
        self._call("set_down", node, reason)


def test_operator_mode_sets_a_silent_node_down_then_expedites(run):
    from slurmft.rundir import atomic_write_json

    client = OperatorClient()
    w = watcher(run, client, operator=True, hang_timeout_s=20, start_now_delay_s=0)
    for node in ("n1", "n2"):
        atomic_write_json(run.heartbeat(node), {"node": node, "job_id": "7", "restart_count": 0,
                                                "step": 9, "time": T0 + 5})
    w.step(job(), NODES, T0 + 10)
    silent = {**NODES, "n2": Node("n2", NodeState.ALLOCATED, frozenset({"NOT_RESPONDING"}))}
    w.step(job(), silent, T0 + 20)
    assert client.calls == []  # one poll, heartbeats 15 s old: not yet
    w.step(job(), silent, T0 + 30)
    assert client.calls[0][:2] == ("set_down", "n2") and client.calls[0][2].startswith("slurmft: watch:")
    w.step(job(JobState.PENDING, restart=1, nodes=()), {**silent, "n2": Node("n2", NodeState.DOWN)},
           T0 + 32)
    assert [c[0] for c in client.calls] == ["set_down", "exclude", "start_now"]
    assert len([e for e in read_events(run.events) if e.kind == "fault_detected"]) == 1


def test_without_operator_mode_a_silent_node_is_left_to_slurm(run):
    from slurmft.rundir import atomic_write_json

    client = OperatorClient()
    w = watcher(run, client, hang_timeout_s=600)
    atomic_write_json(run.heartbeat("n1"), {"node": "n1", "job_id": "7", "restart_count": 0,
                                            "step": 9, "time": T0 + 5})
    silent = {**NODES, "n2": Node("n2", NodeState.ALLOCATED, frozenset({"NOT_RESPONDING"}))}
    w.step(job(), silent, T0 + 100)  # the same input sets n2 DOWN in operator mode (test above)
    assert client.calls == []


def test_expedited_requeue_on_26_05_needs_no_start_now(run):
    client = RecordingClient()
    w = watcher(run, client, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 5)
    w.step(job(JobState.PENDING, restart=1, nodes=(), flags=frozenset({"EXPEDITING"})), NODES, T0 + 6)
    assert client.calls == [("requeue", "7")]
    actions = [e.get("action") for e in read_events(run.events) if e.kind == "recovery_action"]
    assert actions == ["requeue", "expedite"]


def test_start_now_is_sent_again_when_the_job_still_waits_for_its_begin_time(run):
    client = RecordingClient()
    w = watcher(run, client, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 5)
    held = job(JobState.PENDING, restart=1, nodes=(), reason="BeginTime")
    w.step(held, NODES, T0 + 6)
    w.step(held, NODES, T0 + 12)
    assert [c[0] for c in client.calls] == ["requeue", "start_now"]
    w.step(held, NODES, T0 + 20)
    assert [c[0] for c in client.calls] == ["requeue", "start_now", "start_now"]


def test_slurm_requeue_seen_first_as_completing_is_still_expedited(run):
    """22.05 after a node failure: the requeued job shows COMPLETING with its new restart count
    for a cycle or two before it is PENDING (seen on the devcluster)."""
    client = RecordingClient()
    w = watcher(run, client, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    down = {**NODES, "n2": Node("n2", NodeState.DOWN, frozenset({"NOT_RESPONDING"}), "Not responding")}
    w.step(job(restart=1, flags=frozenset({"COMPLETING"})), down, T0 + 25)
    w.step(job(JobState.PENDING, restart=1, nodes=()), down, T0 + 27)
    assert client.calls == [("exclude", "7", ("n2",)), ("start_now", "7", ())]


def test_unreadable_heartbeat_dir_is_not_a_hang(run):
    import os

    client = RecordingClient()
    w = watcher(run, client, hang_timeout_s=30, startup_grace_s=0)
    run.heartbeat_dir.mkdir()
    os.chmod(run.heartbeat_dir, 0)
    try:
        if os.access(run.heartbeat_dir, os.R_OK):  # root reads anything: make it a file instead
            os.chmod(run.heartbeat_dir, 0o755)
            run.heartbeat_dir.rmdir()
            run.heartbeat_dir.write_text("not a directory")
        w.step(job(), NODES, T0 + 1000)
    finally:
        if run.heartbeat_dir.is_dir():
            os.chmod(run.heartbeat_dir, 0o755)
    assert client.calls == [] and w.state.phase == "watching"


def test_a_run_dir_that_says_done_is_not_requeued_during_its_recovery(run):
    client = RecordingClient()
    client.fail["requeue"] = "slurm_requeue error: Socket timed out"
    w = watcher(run, client)
    w.step(job(), NODES, T0)
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 5)  # requeue failed: retried next cycle
    run.done.write_text(json.dumps({"job_id": "7", "step": 40}))
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 10)
    assert client.calls == [] and w.state.phase == "finished"


def test_a_cancel_during_recovery_is_left_cancelled(run):
    client = RecordingClient()
    client.fail["requeue"] = "slurm_requeue error: Socket timed out"
    w = watcher(run, client)
    w.step(job(), NODES, T0)
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 5)
    w.step(job(JobState.CANCELLED), NODES, T0 + 10)
    assert client.calls == [] and w.state.phase == "finished"


def test_requested_exclusion_of_a_node_slurm_does_not_know_still_starts_the_job(run):
    client = RecordingClient()
    w = watcher(run, client, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    journal_line(run, journal.REQUEUE_REQUEST, job_id="7", restart_count=0, reason="pre-flight",
                 exclude=["gpu-host-17.example", "n1"])
    journal_line(run, journal.SEGMENT_END, job_id="7", restart_count=0, exit_code=85)
    w.step(job(JobState.FAILED, exit_code=85), NODES, T0 + 5)
    w.step(job(JobState.PENDING, restart=1, nodes=()), NODES, T0 + 7)
    assert client.calls == [("requeue", "7"), ("exclude", "7", ("n1",)), ("start_now", "7", ())]


def test_an_exclusion_slurm_keeps_refusing_does_not_block_the_start(run):
    client = RecordingClient()
    w = watcher(run, client, start_now_delay_s=0)
    w.step(job(), NODES, T0)
    drained = {**NODES, "n2": Node("n2", NodeState.ALLOCATED, frozenset({"DRAIN"}), "slurmft: x")}
    w.step(job(), drained, T0 + 5)
    for i in range(3):
        client.fail["exclude"] = "slurm_update error: Invalid node name specified"
        w.step(job(JobState.PENDING, restart=1, nodes=()), drained, T0 + 6 + i)
    assert client.calls[-1] == ("start_now", "7", ())


def test_state_file_with_wrong_types_is_a_clear_error(run):
    from slurmft.watch.state import RunState as RS, save_state

    save_state(run, RS(job_id="7"))
    data = json.loads(run.watch_state.read_text())
    data["node_faults"] = {"n1": "2"}
    run.watch_state.write_text(json.dumps(data))
    with pytest.raises(StateError, match="node_faults"):
        load_state(run, "7")


def test_a_job_still_alive_in_slurm_is_never_taken_for_forgotten():
    from slurmft.watch.loop import Watcher

    class Client:
        def jobs(self, ids):
            return {}  # a race: the listing missed it

        def nodes(self):
            return NODES

        def job(self, job_id):
            return job(JobState.RUNNING)

    class Run:
        job_id, active = "7", True

        def step(self, job, nodes, now):
            raise AssertionError("must not be stepped as forgotten this cycle")

    assert Watcher(Client(), [Run()], poll_s=1).cycle().observed


def test_one_run_that_fails_does_not_stop_the_others():
    from slurmft.watch.loop import Watcher

    class Client:
        def jobs(self, ids):
            return {i: job() for i in ids}

        def nodes(self):
            return NODES

    class Run:
        def __init__(self, job_id, boom):
            self.job_id, self.active, self.boom, self.stepped, self.errors = job_id, True, boom, 0, []

        def step(self, job, nodes, now):
            if self.boom:
                raise OSError(28, "No space left on device")
            self.stepped += 1

        def failed(self, exc):
            self.errors.append(exc)

    bad, good = Run("7", True), Run("8", False)
    Watcher(Client(), [bad, good], poll_s=1).cycle()
    assert good.stepped == 1 and len(bad.errors) == 1


def test_cron_once_cycles_announce_the_watcher_once_per_run(run):
    for _ in range(3):
        w = RunWatch(run, load_state(run, "7"), RecordingClient(), WatchConfig(), once=True)
        w.step(job(), NODES, T0)
    assert [e.kind for e in read_events(run.events)].count("watch_started") == 1


def test_a_job_submitted_with_no_requeue_is_given_up_not_retried_forever(run):
    client = RecordingClient()
    client.fail["requeue"] = "job 7: submitted with --no-requeue, Slurm will not requeue it"
    w = watcher(run, client)
    w.step(job(), NODES, T0)
    w.step(job(JobState.FAILED, exit_code=1), NODES, T0 + 5)
    assert w.state.phase == "gave_up"


def test_learned_hang_timeout_allows_for_the_gap_between_beats(run):
    # Defaults (hang_factor 10, hang_min_s 60, clock_skew_s 30) with 10 s steps and a beat every
    # 100 s of wall time: the newest beat of a healthy run is up to 110 s old. A steps-based
    # cadence once counted that as a hang at 101 s.
    from slurmft.train.heartbeat import Heartbeat

    clock = [T0]
    beats = {n: Heartbeat(run, n, job_id="7", restart_count=0, interval_s=100,
                          clock=lambda: clock[0], monotonic=lambda: clock[0]) for n in ("n1", "n2")}
    client = RecordingClient()
    w = watcher(run, client, startup_grace_s=0)
    for step in range(1, 42):
        clock[0] = T0 + 10 * step
        for hb in beats.values():
            hb.beat(step)
        w.step(job(), NODES, clock[0])
    last = clock[0]  # step 41's beat, 100 s after step 31's
    assert w.memory().step_times[-1] == 10 and w.memory().beat_gap_s == 110
    w.step(job(), NODES, last + 111)   # the beat due at +110 is 1 s late: a slow run, not a hang
    w.step(job(), NODES, last + 230)   # 9 steps past the due beat (+ skew): within the timeout
    assert client.calls == [] and w.state.phase == "watching"
    w.step(job(), NODES, last + 241)   # 10 steps past it, + the skew allowance: hung
    assert client.calls and client.calls[0][0] == "requeue"


def test_the_watcher_warns_of_a_node_whose_forward_is_slow_in_every_beat(run):
    from slurmft.train.heartbeat import Heartbeat

    clock = [1_800_000_000.0]
    beats = {n: Heartbeat(run, n, job_id="7", restart_count=0, interval_s=0, clock=lambda: clock[0],
                          monotonic=lambda: clock[0]) for n in ("n1", "n2", "n3")}
    job = Job(job_id="7", name="t", state=JobState.RUNNING, nodes=("n1", "n2", "n3"), node_count=3)
    nodes = {n: Node(n, NodeState.ALLOCATED) for n in ("n1", "n2", "n3")}
    client = RecordingClient()
    w = watcher(run, client, straggler_factor=2.0, straggler_window=4)
    for step in range(1, 7):
        clock[0] += 1.0
        for name, hb in beats.items():
            hb.beat(step, busy_s=0.30 if name == "n3" else 0.10)
        w.step(job, nodes, clock[0])
    warnings = [e for e in read_events(run.events) if e.kind == "watch_warning"]
    assert [e.get("what") for e in warnings] == ["straggler"] and warnings[0].get("nodes") == ["n3"]
    assert client.calls == []  # a warning; excluded at the next restart only if configured


def test_a_job_released_after_the_watcher_gave_up_is_watched_afresh():
    from slurmft.watch.state import released_after_giving_up

    state = RunState(job_id="7", phase="gave_up", reason="crash loop", restarts=3,
                     restarts_by_cause={"crash": 3}, node_faults={"n2": 2}, ckpt_at_recovery=[10, 10, 10])
    assert not released_after_giving_up(state, job(JobState.PENDING, reason="JobHeldUser"))  # still held
    assert state.phase == "gave_up"
    assert released_after_giving_up(state, job(JobState.PENDING, restart=4, nodes=(), reason="Priority"))
    assert (state.phase, state.restarts, state.restarts_by_cause, state.ckpt_at_recovery) == \
        ("watching", 0, {}, [])
    assert state.node_faults == {"n2": 2}   # the nodes it learned to distrust are kept


def test_operator_mode_sets_a_node_down_that_holds_a_recovery_in_completing(run):
    # A node death seen first as a hang (the heartbeats stop before Slurm flags the node): the
    # requeue leaves the job COMPLETING until the dead node is DOWN, which Slurm alone does only
    # after SlurmdTimeout (measured: the --operator benchmark recovered no sooner than plain watch).
    from slurmft.rundir import atomic_write_json

    client = OperatorClient()
    w = watcher(run, client, operator=True, hang_timeout_s=10, start_now_delay_s=0)
    for n in ("n1", "n2"):
        atomic_write_json(run.heartbeat(n), {"node": n, "job_id": "7", "restart_count": 0,
                                             "step": 9, "time": T0 + 5, "last_step_s": 1.0})
    w.step(job(), NODES, T0 + 6)
    w.step(job(), NODES, T0 + 20)  # every beat 15 s old: a hang, no node to blame yet
    assert [c[0] for c in client.calls] == ["requeue"]
    ending = job(flags=frozenset({"COMPLETING"}))
    w.step(ending, NODES, T0 + 22)  # ending, every node still answering: nothing to do
    assert [c[0] for c in client.calls] == ["requeue"]
    silent = {**NODES, "n2": Node("n2", NodeState.ALLOCATED, frozenset({"NOT_RESPONDING"}))}
    w.step(ending, silent, T0 + 50)
    w.step(ending, NODES, T0 + 53)   # it answered again: the first sighting is forgotten
    w.step(ending, silent, T0 + 56)
    w.step(ending, silent, T0 + 59)  # not responding for less than a poll (5 s): not yet
    assert [c[0] for c in client.calls] == ["requeue"]
    w.step(ending, silent, T0 + 61)
    w.step(ending, silent, T0 + 62)  # once
    assert [c[:2] for c in client.calls] == [("requeue", "7"), ("set_down", "n2")]
    assert w.state.node_faults.get("n2") == 1
    w.step(job(JobState.PENDING, restart=1, nodes=()), {**silent, "n2": Node("n2", NodeState.DOWN)},
           T0 + 63)
    assert client.calls[2:] == [("exclude", "7", ("n2",)), ("start_now", "7", ())]


def test_operator_mode_never_sets_down_a_node_of_a_job_being_cancelled(run):
    from slurmft.watch.state import Recovery

    client = OperatorClient()
    w = watcher(run, client, operator=True, hang_timeout_s=10)
    w.step(job(), NODES, T0 + 6)
    w.state.phase = "recovering"
    w.state.recovery = Recovery(cause="hang", evidence="", fault_time=T0, detect_time=T0 + 20,
                                restart_count=0, requeue="done", exclude_step="skip")
    silent = {**NODES, "n2": Node("n2", NodeState.ALLOCATED, frozenset({"NOT_RESPONDING"}))}
    cancelling = job(JobState.CANCELLED, flags=frozenset({"COMPLETING"}))
    for t in (50, 60, 70):
        w.step(cancelling, silent, T0 + t)
    assert client.calls == []


def test_a_recovery_without_operator_mode_never_sets_a_node_down(run):
    client = OperatorClient()
    w = watcher(run, client, hang_timeout_s=10)
    w.step(job(), NODES, T0 + 6)
    w.state.phase = "recovering"
    from slurmft.watch.state import Recovery
    w.state.recovery = Recovery(cause="hang", evidence="", fault_time=T0, detect_time=T0 + 20,
                                restart_count=0, requeue="done", exclude_step="skip")
    silent = {**NODES, "n2": Node("n2", NodeState.ALLOCATED, frozenset({"NOT_RESPONDING"}))}
    for t in (50, 60, 70):
        w.step(job(flags=frozenset({"COMPLETING"})), silent, T0 + t)
    assert client.calls == []
