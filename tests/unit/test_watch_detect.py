"""The watcher's detectors, replayed on observations recorded from devcluster runs
(tests/fixtures/watch/README.md says how they were captured), and on edge cases built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurmft.slurm.client import Job, JobState, Node, NodeState
from slurmft.watch import detect
from slurmft.watch.config import WatchConfig
from slurmft.watch.detect import Memory, RunObservation
from slurmft.watch.record import job_from_json, job_to_json, observation_from_json
from slurmft.watch.runview import Beat, JournalSummary

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "watch"

# scenario -> (config, the first finding that calls for action: cause, action, nodes)
EXPECTED = {
    "crash": ({}, ("crash", "recover", ())),
    "corrupt_newest": ({}, ("crash", "recover", ())),
    "hang": ({"hang_timeout_s": 8, "startup_grace_s": 120}, ("hang", "recover", ())),
    "node_death": ({}, ("node_fail", "expedite", ("n2",))),
    "sweeper_drain": ({}, ("node_unhealthy", "recover", ("n1",))),
    "no_requeue": ({}, ("no_requeue", "give_up", ())),
    "completes": ({}, ("finished", "finish", ())),
}


def replay(name: str, config: WatchConfig):
    directory = FIXTURES / name
    for line in (directory / "records.jsonl").read_text().splitlines():
        obs, memory = observation_from_json(json.loads(line), directory / "events.jsonl")
        yield obs, detect.detect(obs, memory, config)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recorded_run_is_quiet_until_the_fault_then_names_its_cause(name):
    config, (cause, action, nodes) = EXPECTED[name]
    acting = []
    for obs, findings in replay(name, WatchConfig(**config)):
        found = [(f.cause, f.action, f.nodes) for f in findings if f.action != detect.WARN]
        if acting or found:
            acting.append(found)
        else:
            assert not [f for f in findings if f.action != detect.WARN]
    assert acting, f"{name}: no record calls for action"
    assert acting[0] == [(cause, action, nodes)]


def test_recorded_evidence_names_what_was_seen():
    texts = {name: [f.evidence for _, fs in replay(name, WatchConfig(**EXPECTED[name][0])) for f in fs
                    if f.action != detect.WARN] for name in ("hang", "sweeper_drain", "node_death")}
    assert "> hang timeout 8 s" in texts["hang"][0] and "cannot attribute" in texts["hang"][0]
    assert "drained by the sweeper: slurmft: external_site" in texts["sweeper_drain"][0]
    assert "n2 is DOWN" in texts["node_death"][0]


def test_job_records_round_trip():
    line = (FIXTURES / "node_death" / "records.jsonl").read_text().splitlines()[0]
    data = json.loads(line)["job"]
    assert job_to_json(job_from_json(data)) == {"raw_job_id": "", "time_limit_end": None, "reason_detail": "",
                                                "batch_host": "",
                                                **data}  # recorded before they existed


# -- edge cases -----------------------------------------------------------------------------

T0 = 1_800_000_000.0


def obs(job: Job | None, *, beats=(), nodes=None, summary=None, now=T0 + 100, done=None):
    return RunObservation("9", job, nodes or {}, summary or JournalSummary(),
                          {b.node: b for b in beats}, done, now)


def running(**kw) -> Job:
    from datetime import datetime, timezone

    return Job(job_id="9", name="t", state=JobState.RUNNING, nodes=("n1", "n2"), node_count=2,
               start_time=datetime.fromtimestamp(T0, tz=timezone.utc), **kw)


def beat(node: str, when: float, *, step_s=1.0, busy=None) -> Beat:
    return Beat(node, "9", 0, 10, when, step_s, busy)


def test_hang_timeout_is_learned_from_the_median_step_with_a_floor_and_the_skew_allowance():
    cfg = WatchConfig(hang_factor=10, hang_min_s=60, clock_skew_s=30)
    assert detect.hang_timeout(Memory(step_times=(2.0,)), cfg) == 60 + 30
    assert detect.hang_timeout(Memory(step_times=(30.0, 29.0, 31.0, 600.0)), cfg) == 305 + 30
    assert detect.hang_timeout(Memory(step_times=(30.0,), beat_gap_s=40.0), cfg) == 340 + 30
    # An explicit timeout is taken as is.
    assert detect.hang_timeout(Memory(step_times=(30.0,)), WatchConfig(hang_timeout_s=45)) == 45


def test_no_hang_during_start_up_grace_but_one_after_it():
    cfg = WatchConfig(startup_grace_s=300, hang_min_s=60, clock_skew_s=0)
    beats = Memory(beats_seen=True)  # the run has beaten before: this segment is stuck starting
    assert detect.detect_hang(obs(running(), now=T0 + 200), beats, cfg) is None
    finding = detect.detect_hang(obs(running(), now=T0 + 400), beats, cfg)
    assert finding is not None and "no heartbeat 400 s after the segment started" in finding.evidence


def test_fresh_heartbeat_means_no_hang_and_a_stale_one_does():
    cfg = WatchConfig(hang_timeout_s=30)
    assert detect.detect_hang(obs(running(), beats=[beat("n1", T0 + 90)]), Memory(), cfg) is None
    finding = detect.detect_hang(obs(running(), beats=[beat("n1", T0 + 50), beat("n2", T0 + 60)]),
                                 Memory(), cfg)
    assert finding.cause == "hang" and finding.fault_time == T0 + 60


def test_straggler_needs_the_whole_window_and_exactly_one_slow_node():
    cfg = WatchConfig(straggler_factor=1.5, straggler_window=3)
    slow = {"n1": (1.0, 1.0, 1.0), "n2": (1.0, 1.1, 0.9), "n3": (2.0, 2.1, 1.9)}
    finding = detect.detect_straggler(Memory(node_history=slow), cfg)
    assert finding is not None and finding.nodes == ("n3",) and finding.action == "warn"
    once = {**slow, "n3": (1.0, 1.0, 2.0)}
    assert detect.detect_straggler(Memory(node_history=once), cfg) is None


def test_not_responding_alone_is_not_acted_on_but_down_and_drained_are():
    base = {"n1": Node("n1", NodeState.ALLOCATED), "n2": Node("n2", NodeState.ALLOCATED,
                                                              frozenset({"NOT_RESPONDING"}))}
    assert detect.detect_nodes(obs(running(), nodes=base), Memory(), WatchConfig()) is None
    drained = {**base, "n2": Node("n2", NodeState.ALLOCATED, frozenset({"DRAIN"}), "slurmft: xid")}
    finding = detect.detect_nodes(obs(running(), nodes=drained), Memory(), WatchConfig())
    assert (finding.cause, finding.action, finding.nodes) == ("node_unhealthy", "recover", ("n2",))


def test_cancelled_job_is_finished_not_recovered():
    job = Job(job_id="9", name="t", state=JobState.CANCELLED)
    assert detect.detect_end(obs(job), Memory()).action == "finish"


def test_completing_job_is_not_an_end():
    job = running(flags=frozenset({"COMPLETING"}))
    assert detect.detect(obs(job, beats=[beat("n1", T0 - 1000)]), Memory(), WatchConfig()) == []


def test_an_array_task_is_matched_by_its_own_number_in_beats_and_journal():
    from datetime import datetime, timezone

    from slurmft import journal
    from slurmft.journal import Event

    task = Job(job_id="123_4", raw_job_id="127", name="t", state=JobState.RUNNING,
               nodes=("n1",), start_time=datetime.fromtimestamp(T0, tz=timezone.utc))
    fresh = Beat("n1", "127", 0, 10, T0 + 95, 1.0, None)
    assert detect.detect_hang(obs(task, beats=[fresh]), Memory(), WatchConfig(hang_timeout_s=30)) is None
    summary = JournalSummary()
    summary.add(Event(journal.SEGMENT_END, T0 + 99, {"job_id": "127", "restart_count": 0,
                                                     "exit_code": 86, "reason": "NaNs"}))
    ended = Job(job_id="123_4", raw_job_id="127", name="t", state=JobState.FAILED, exit_code=86)
    finding = detect.detect_end(obs(ended, summary=summary), Memory())
    assert (finding.cause, finding.action) == ("no_requeue", "give_up")


def test_stale_heartbeats_with_a_node_not_responding_blame_that_node():
    nodes = {"n1": Node("n1", NodeState.ALLOCATED),
             "n2": Node("n2", NodeState.ALLOCATED, frozenset({"NOT_RESPONDING"}))}
    finding = detect.detect_hang(obs(running(), beats=[beat("n1", T0 + 50)], nodes=nodes),
                                 Memory(), WatchConfig(hang_timeout_s=30))
    assert (finding.cause, finding.action, finding.nodes) == ("node_down", "recover", ("n2",))
    assert "n2 not responding" in finding.evidence


@pytest.mark.parametrize("poll", [0, 0.001, 0.49, float("nan")])
def test_a_poll_period_under_the_floor_is_refused(poll):
    # Every cycle is two RPCs at slurmctld: --poll 0.001 would be thousands a second.
    with pytest.raises(ValueError, match=r"poll_s must be >= 0.5 s"):
        WatchConfig(poll_s=poll)
    assert WatchConfig(poll_s=0.5).poll_s == 0.5
