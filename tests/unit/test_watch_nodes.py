"""What the watcher does about nodes: operator mode's corroboration before DOWN, an admin's drain
as maintenance, exclusions bounded by the job's partitions (on real published node tables),
fault counts that fade. Each test fails on the code before issue 25's fixes."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest

from slurmft import journal
from slurmft.journal import encode_event, read_events
from slurmft.rundir import RunDir, atomic_write_json
from slurmft.slurm.client import Job, JobState, Node, NodeState
from slurmft.slurm.parse_nodes import parse_nodes
from slurmft.watch import detect
from slurmft.watch.config import WatchConfig
from slurmft.watch.detect import Memory, RunObservation
from slurmft.watch.exclusions import fade_faults, fit_exclusions, readmit_to_fit
from slurmft.watch.runview import Beat, JournalSummary
from slurmft.watch.runwatch import RunWatch
from slurmft.watch.state import RunState, StateError, load_state, save_state

T0 = 1_800_000_000.0
PUB = Path(__file__).resolve().parents[1] / "fixtures" / "slurm" / "published"


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0 + seconds, tz=timezone.utc)


def running(nodes=("n1", "n2"), restart=0, **kw) -> Job:
    return Job(job_id="7", name="train", state=JobState.RUNNING, nodes=nodes, node_count=len(nodes),
               restart_count=restart, start_time=at(0), **kw)


def beat(node: str, when: float, step_s: float = 1.0) -> Beat:
    return Beat(node, "7", 0, 10, when, step_s, None)


def observe(job, nodes, *, beats=(), now, summary=None) -> RunObservation:
    return RunObservation("7", job, nodes, summary or JournalSummary(), {b.node: b for b in beats},
                          None, now)


UP = {n: Node(n, NodeState.ALLOCATED) for n in ("n1", "n2", "n3")}
SILENT = {**UP, "n2": Node("n2", NodeState.ALLOCATED, frozenset({"NOT_RESPONDING"}))}


class Client:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def requeue(self, job_id):
        self.calls.append(("requeue", job_id))
        return True

    def update_pending(self, job_id, *, exclude_nodes=(), readmit_nodes=(), start_now=False):
        kind = "readmit" if readmit_nodes else "start_now" if start_now else "exclude"
        self.calls.append((kind, job_id, tuple(readmit_nodes or exclude_nodes)))

    def set_down(self, node, reason):
        self.calls.append(("set_down", node))

    def submit_line(self, job_id):
        return None


@pytest.fixture
def run(tmp_path) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    return rd


def commit(rd: RunDir, step: int, when: float) -> None:
    with open(rd.events, "ab") as f:
        f.write(encode_event(journal.CHECKPOINT_COMMITTED, {"job_id": "7", "restart_count": 0,
                                                            "step": step}, now=when))


def heartbeat(rd: RunDir, node: str, when: float, step_s: float = 1.0) -> None:
    atomic_write_json(rd.heartbeat(node), {"node": node, "job_id": "7", "restart_count": 0,
                                           "step": 10, "time": when, "recent_step_s": step_s,
                                           "every": 10})


# -- operator mode: corroboration before DOWN ------------------------------------------------

def test_operator_mode_never_sets_down_a_node_seen_silent_at_one_poll_only():
    cfg = WatchConfig(operator=True, hang_timeout_s=20)
    stale = [beat("n1", T0 + 5), beat("n2", T0 + 5)]
    once = observe(running(), SILENT, beats=stale, now=T0 + 100)
    assert detect.detect_silent_node(once, Memory(silent_since={"n2": T0 + 100}), cfg) is None
    twice = detect.detect_silent_node(once, Memory(silent_since={"n2": T0 + 95}), cfg)
    assert (twice.action, twice.nodes) == ("set_down", ("n2",))


def test_operator_mode_waits_for_the_runs_learned_hang_timeout_not_30_s():
    """Steps of 10 s: the learned timeout is 10 x 10 = 100 s (+ the 30 s clock-skew allowance).
    A node silent for two polls whose heartbeat is 40 s old is a busy node with a slow link, not a
    dead one."""
    cfg = WatchConfig(operator=True)
    memory = Memory(step_times=(10.0,), silent_since={"n2": T0})
    assert detect.hang_timeout(memory, cfg) == 130
    beats = [beat("n1", T0 + 60, 10.0), beat("n2", T0 + 60, 10.0)]
    assert detect.detect_silent_node(observe(running(), SILENT, beats=beats, now=T0 + 100),
                                     memory, cfg) is None
    late = detect.detect_silent_node(observe(running(), SILENT, beats=beats, now=T0 + 191), memory, cfg)
    assert late is not None and late.nodes == ("n2",) and "> hang timeout 130 s" in late.evidence


def test_operator_mode_judges_the_heartbeats_from_the_silent_node_itself():
    """n1's beat is stale (it waits in a collective), n2's is fresh: n2 answered the run moments
    ago, so its missed pings are not evidence enough to kill every job on it."""
    cfg = WatchConfig(operator=True, hang_timeout_s=20)
    memory = Memory(silent_since={"n2": T0})
    beats = [beat("n1", T0 + 5), beat("n2", T0 + 95)]
    assert detect.detect_silent_node(observe(running(), SILENT, beats=beats, now=T0 + 100),
                                     memory, cfg) is None
    # A silent node with no heartbeat of this segment at all gives no evidence either.
    assert detect.detect_silent_node(observe(running(), SILENT, beats=[beat("n1", T0 + 5)],
                                             now=T0 + 100), memory, cfg) is None


def test_the_recovery_path_uses_the_same_rule():
    cfg = WatchConfig(operator=True, hang_timeout_s=120)
    ending = running(flags=frozenset({"COMPLETING"}))
    beats = [beat("n1", T0 + 40), beat("n2", T0 + 40)]
    seen = {"n2": T0 + 50}
    # 60 s of silence > the old 30 s, < the run's timeout: kept.
    assert detect.silent_nodes_of_ending_job(observe(ending, SILENT, beats=beats, now=T0 + 100),
                                             Memory(), cfg, 0, seen) == []
    assert detect.silent_nodes_of_ending_job(observe(ending, SILENT, beats=beats, now=T0 + 200),
                                             Memory(), cfg, 0, seen) == ["n2"]
    assert detect.silent_nodes_of_ending_job(observe(ending, SILENT, beats=beats, now=T0 + 200),
                                             Memory(), cfg, 0, {"n2": T0 + 199}) == []


def test_a_watcher_sets_down_only_after_two_polls_and_the_learned_timeout(run):
    client = Client()
    w = RunWatch(run, RunState(job_id="7"), client, WatchConfig(operator=True, hang_min_s=60, clock_skew_s=0))
    heartbeat(run, "n1", T0 + 5)
    heartbeat(run, "n2", T0 + 5)
    w.step(running(), SILENT, T0 + 40)   # first sight; beats 35 s old
    w.step(running(), SILENT, T0 + 45)   # two polls, but 40 s < 60 s learned
    assert client.calls == []
    assert load_state(run, "7").silent_since == {"n2": T0 + 40}  # kept for the next watcher
    w.step(running(), SILENT, T0 + 70)
    assert client.calls[0] == ("set_down", "n2")


# -- an admin's drain: maintenance -----------------------------------------------------------

def drained(reason="maintenance"):
    return {**UP, "n2": Node("n2", NodeState.ALLOCATED, frozenset({"DRAIN"}), reason)}


def summary_with(*commits) -> JournalSummary:
    s = JournalSummary()
    s.commits.extend((t, step, None) for t, step in commits)
    return s


def test_an_admin_drain_waits_for_a_checkpoint_committed_after_it():
    cfg = WatchConfig()
    memory = Memory(drained_since={"n2": T0 + 100})
    before = summary_with((T0 + 50, 100), (T0 + 90, 200))
    waiting = detect.detect_nodes(observe(running(), drained(), now=T0 + 130, summary=before), memory, cfg)
    assert (waiting.cause, waiting.action, waiting.nodes) == ("node_drained", "warn", ("n2",))
    after = summary_with((T0 + 50, 100), (T0 + 90, 200), (T0 + 125, 300))
    acting = detect.detect_nodes(observe(running(), drained(), now=T0 + 130, summary=after), memory, cfg)
    assert (acting.cause, acting.action, acting.nodes) == ("node_drained", "recover", ("n2",))
    assert "checkpoint step 300 committed after the drain" in acting.evidence


def test_an_admin_drain_waits_at_most_the_checkpoint_overdue_bound():
    cfg = WatchConfig(checkpoint_overdue_factor=2.0, checkpoint_overdue_min_s=120)
    memory = Memory(drained_since={"n2": T0 + 100})
    usual = summary_with((T0 - 300, 100), (T0 - 200, 200), (T0 - 100, 300))  # every 100 s
    assert detect.admin_drain_bound(usual, cfg) == 200
    obs = observe(running(), drained(), now=T0 + 299, summary=usual)
    assert detect.detect_nodes(obs, memory, cfg).action == "warn"
    late = detect.detect_nodes(replace(obs, now=T0 + 301), memory, cfg)
    assert late.action == "recover" and "no checkpoint committed" in late.evidence
    # No interval known yet: admin_drain_wait_s.
    assert detect.admin_drain_bound(JournalSummary(), WatchConfig(admin_drain_wait_s=900)) == 900


def test_sweeper_drain_and_down_still_recover_at_once_and_ignore_leaves_admin_drains_alone():
    memory = Memory(drained_since={"n2": T0 + 100})
    obs = observe(running(), drained("slurmft: gpu: xid 79"), now=T0 + 101)
    assert detect.detect_nodes(obs, memory, WatchConfig()).action == "recover"
    both = {**drained(), "n1": Node("n1", NodeState.DOWN)}
    finding = detect.detect_nodes(observe(running(), both, now=T0 + 101), memory, WatchConfig())
    assert finding.action == "recover" and set(finding.nodes) == {"n1", "n2"}
    ignore = WatchConfig(admin_drain="ignore")
    left = detect.detect_nodes(observe(running(), drained(), now=T0 + 10**6), memory, ignore)
    assert left.action == "warn" and "left alone" in left.evidence  # said, never acted on
    with pytest.raises(ValueError, match="admin_drain must be one of after_checkpoint, ignore"):
        WatchConfig(admin_drain="now")


def test_a_watched_run_trains_through_an_admin_drain_until_its_next_checkpoint(run):
    client = Client()
    w = RunWatch(run, RunState(job_id="7"), client, WatchConfig(start_now_delay_s=0))
    commit(run, 100, T0 + 10)
    w.step(running(), UP, T0 + 20)
    w.step(running(), drained(), T0 + 30)
    w.step(running(), drained(), T0 + 60)
    assert client.calls == []
    warnings = [e for e in read_events(run.events) if e.kind == journal.WATCH_WARNING]
    assert [e.get("what") for e in warnings] == ["node_drained"]
    assert load_state(run, "7").drained_since == {"n2": T0 + 30}
    commit(run, 200, T0 + 70)
    w.step(running(), drained(), T0 + 75)
    assert client.calls == [("requeue", "7")]
    w.step(replace(running(restart=1), state=JobState.PENDING, nodes=()), drained(), T0 + 80)
    assert ("exclude", "7", ("n2",)) in client.calls
    assert w.state.node_faults == {}  # maintenance is not the node's fault
    # ... nor the run's: a planned end, journaled as one, counted toward no restart limit.
    kinds = [e.kind for e in read_events(run.events)]
    assert "fault_detected" not in kinds and "recovery_action" not in kinds
    [end] = [e for e in read_events(run.events) if e.kind == journal.PLANNED_END]
    assert end.get("cause") == "node_drained"
    assert w.faults() == 0


def test_admin_drains_count_toward_no_restart_limit(run):
    from slurmft.watch import giveup
    state = RunState(job_id="7", restarts_by_cause={"node_drained": 40})
    config = WatchConfig(max_restarts=1, max_restarts_per_cause=1, crash_loop_restarts=1)
    assert giveup.limit_reached(state, config, "node_drained", None) is None
    assert giveup.fault_restarts(state) == 0


# -- exclusions bounded by the job's partitions ----------------------------------------------

TABLES = {  # published real node tables with two partitions: the job's, and its 2 usable nodes
    "23.11/v0.0.40": ("standard", ("cn2", "cn3")),
    "24.11/v0.0.42": ("standard", ("cn1", "cn2")),
    "25.05/v0.0.43": ("normal", ("cn1", "cn2")),
    "25.11/v0.0.44": ("normal", ("cn3", "cn4")),
}


def table(release: str) -> dict[str, Node]:
    text = (PUB / release / "slurmrestd__slurm-nodes.json").read_text()
    return parse_nodes(text, "scontrol --json show nodes")


@pytest.mark.parametrize("release", sorted(TABLES))
def test_every_release_names_each_nodes_partitions(release):
    nodes = table(release)
    part, usable = TABLES[release]
    assert {n for n, node in nodes.items() if part in node.partitions} == {"cn1", "cn2", "cn3", "cn4"}
    assert all(len(node.partitions) == 1 for node in nodes.values())


@pytest.mark.parametrize("release", sorted(TABLES))
def test_no_fit_counts_only_the_jobs_partition(release):
    """A 2-node job in a partition with 2 usable nodes left (the others DOWN or drained), beside
    another partition of idle nodes: excluding one of its 2 would leave it nowhere to run."""
    nodes = table(release)
    part, usable = TABLES[release]
    pending = Job(job_id="7", name="t", state=JobState.PENDING, node_count=2, min_nodes=2,
                  partition=part)
    assert fit_exclusions(pending, nodes, [usable[0]]) == ([], [usable[0]])
    other = next(n for n, node in nodes.items() if part not in node.partitions)
    assert fit_exclusions(pending, nodes, [other]) == ([other], [])  # costs the job nothing
    # A job that may run in either partition fits in the other one.
    either = replace(pending, partition=",".join(sorted({part, *nodes[other].partitions})))
    assert fit_exclusions(either, nodes, [usable[0]]) == ([usable[0]], [])


def test_readmission_counts_only_the_jobs_partition():
    nodes = {n: Node(n, NodeState.IDLE, partitions=frozenset({"a"})) for n in ("a1", "a2", "a3")}
    nodes.update({n: Node(n, NodeState.IDLE, partitions=frozenset({"b"})) for n in ("b1", "b2")})
    pending = Job(job_id="7", name="t", state=JobState.PENDING, node_count=2, min_nodes=2,
                  partition="a", excluded_nodes=("a1", "a2", "b1"))
    # a3 alone is left in partition a: our oldest exclusion there comes back, b1 never helps.
    assert readmit_to_fit(pending, nodes, [], ["b1", "a1", "a2"]) == ["a1"]
    assert readmit_to_fit(replace(pending, excluded_nodes=("b1",)), nodes, [], ["b1"]) == []


def test_a_job_the_launcher_shrank_before_its_requeue_is_judged_at_its_allocated_size():
    """The soak of 2026-11-27: the in-allocation launcher released dead n6 (3 of 4 nodes left),
    requeued, and Slurm showed the pending job with NumNodes 3 (22.05 shows the shrunk count; it
    starts the job only on the 4 it was submitted with). With n3, n4, n6 excluded of 6 nodes, the
    3 counted fit; the 4 needed did not: never runnable, and nothing was readmitted. Judged at the
    allocation's size, our repaired exclusions come back."""
    from slurmft.allocation import Allocation, Fence
    from slurmft.watch.exclusions import sized_as_allocated

    nodes = {n: Node(n, NodeState.IDLE) for n in ("n1", "n2", "n3", "n4", "n5", "n6")}
    nodes["n6"] = Node("n6", NodeState.DOWN, frozenset({"NOT_RESPONDING"}))
    shown = Job(job_id="1", name="t", state=JobState.PENDING, node_count=3, min_nodes=3,
                excluded_nodes=("n3", "n4", "n6"))
    record = Allocation(job_id="1", generation=3, active=("n1", "n2", "n5"), spares=(),
                        fenced=(Fence("n6", "node_silent", 1.0),))
    assert readmit_to_fit(shown, nodes, [], ["n3", "n4", "n6"]) == []  # what the watcher did
    sized = sized_as_allocated(shown, record)
    assert sized.min_nodes == 4
    assert readmit_to_fit(sized, nodes, [], ["n3", "n4", "n6"]) == ["n3"]
    # another job's record, no record, or a record no bigger than the job: the job as Slurm shows it
    assert sized_as_allocated(shown, replace(record, job_id="2")) is shown
    assert sized_as_allocated(shown, None) is shown
    assert sized_as_allocated(replace(shown, min_nodes=5), record).min_nodes == 5
    # A spare job's node (SLURMFT_SPARE_REFILL=1), active or fenced, was never the job's own.
    from slurmft.allocation import SpareJob
    refilled = replace(record, spares=("n7",), fenced=(*record.fenced, Fence("n8", "node_silent", 2.0)),
                       spare_jobs=(SpareJob("40", "n7"), SpareJob("41", "n8"), SpareJob("42")))
    assert sized_as_allocated(shown, refilled).min_nodes == 4


# -- fault counts fade -------------------------------------------------------------------------

def test_a_nodes_faults_fade_after_it_serves_healthily():
    faults, clean = {"n1": 2, "n2": 1}, {}
    assert not fade_faults(faults, clean, ["n1", "n2"], T0, 100)
    assert not fade_faults(faults, clean, ["n1"], T0 + 50, 100)  # n2 left: its clean stretch ends
    assert fade_faults(faults, clean, ["n1", "n2"], T0 + 100, 100)
    assert faults == {"n1": 1, "n2": 1} and clean == {"n1": T0 + 100, "n2": T0 + 100}
    assert fade_faults(faults, clean, ["n1", "n2"], T0 + 200, 100)
    assert faults == {} and not fade_faults(faults, clean, ["n1"], T0 + 10**6, 0)


def test_a_repeat_offender_that_served_for_the_fade_period_is_no_longer_excluded_on_sight(run):
    client = Client()
    w = RunWatch(run, RunState(job_id="7", node_faults={"n2": 2}), client,
                 WatchConfig(node_fault_fade_s=3600, hang_timeout_s=10**6))
    assert w._known_bad() == ["n2"]
    for t in (0, 1800, 3600, 7200):
        w.step(running(), UP, T0 + t)
    assert load_state(run, "7").node_faults == {}
    assert w._known_bad() == []


def test_state_refuses_a_node_time_that_is_not_a_number(run):
    state = RunState(job_id="7", drained_since={"n2": T0})
    save_state(run, state)
    assert load_state(run, "7").drained_since == {"n2": T0}
    data = state.to_json()
    data["clean_since"] = {"n1": "soon"}
    atomic_write_json(run.watch_state, data)
    with pytest.raises(StateError, match="clean_since"):
        load_state(run, "7")


def test_a_resubmission_excludes_only_what_leaves_the_job_room_in_its_partition():
    """A forgotten 2-node job last ran on cn1,cn2 of ``normal`` (25.05's published table), where
    only those two are usable: excluding one for an old fault would leave it nowhere to run."""
    from slurmft.watch.exclusions import resubmission_exclusions

    nodes = table("25.05/v0.0.43")
    assert resubmission_exclusions(nodes, ["cn1", "cn2"], ["cn1", "gpu1"]) == (["gpu1"], ["cn1"])
    # Unknown allocation: the whole table is its pool (room enough, the fault is excluded).
    assert resubmission_exclusions(nodes, [], ["cn1"]) == (["cn1"], [])


@pytest.mark.parametrize("path, command", [("2205/sinfo_drain_down.json", "sinfo --json"),
                                           ("2411/scontrol_nodes_drain.json", "scontrol --json show nodes"),
                                           ("2605/scontrol_nodes_drain.json", "scontrol --json show nodes")])
def test_our_own_captures_name_each_nodes_partition(path, command):
    nodes = parse_nodes((PUB.parent / path).read_text(), command)
    assert nodes and all(node.partitions == frozenset({"debug"}) for node in nodes.values())


def test_a_requeued_job_submitted_to_two_partitions_may_use_both():
    """Captured on 22.05: a job submitted with ``-p train,other`` ran in train; requeued, Slurm
    lists both again, so a recovery counts capacity in either."""
    from slurmft.slurm.parse_jobs import parse_squeue

    cap = PUB.parent / "2205"
    [pending] = parse_squeue((cap / "squeue_multi_partition_requeued.json").read_text())
    assert pending.state is JobState.PENDING and pending.restart_count == 1
    assert pending.partitions == frozenset({"train", "other"})
    nodes = parse_nodes((cap / "sinfo_two_partitions.json").read_text(), "sinfo --json")
    assert {n: set(v.partitions) for n, v in nodes.items()} == {
        "n1": {"train"}, "n2": {"train"}, "n3": {"other"}}
    assert fit_exclusions(pending, nodes, ["n1", "n2"]) == (["n1", "n2"], [])  # n3 is left
    only_train = replace(pending, partition="train")
    assert fit_exclusions(only_train, nodes, ["n1", "n2"]) == (["n1"], ["n2"])


def test_a_checkpoint_is_after_the_drain_by_its_place_in_the_journal_not_by_the_nodes_clock(run):
    """Commit times come from the compute node's clock, the drain's first sight from the login
    node's. A node clock 20 s ahead made a commit from before the drain look after it (its steps
    since lost); one 20 s behind made a commit after the drain look before it."""
    client = Client()
    w = RunWatch(run, RunState(job_id="7"), client, WatchConfig(start_now_delay_s=0))
    commit(run, 100, T0 + 10)
    w.step(running(), UP, T0 + 20)
    commit(run, 200, T0 + 45)  # committed at T0 + 25 (before the drain), the node's clock 20 s fast
    w.step(running(), drained(), T0 + 30)  # the drain's first sight: the journal names step 200
    w.step(running(), drained(), T0 + 50)
    assert client.calls == [] and load_state(run, "7").drained_after_step == {"n2": 200}
    commit(run, 300, T0 + 40)  # committed at T0 + 60, the node's clock 20 s slow
    w.step(running(), drained(), T0 + 65)
    assert client.calls == [("requeue", "7")]
    [end] = [e for e in read_events(run.events) if e.kind == journal.PLANNED_END]
    assert "checkpoint step 300 committed after the drain" in end.get("evidence")
