"""``slurmft.chaos.drive``: what an outcome of an injected fault says slurmft did wrong, on
constructed outcomes (the chaos demo's integration test drives the real ones)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.chaos import faults
from slurmft.chaos.drive import Outcome, excluded_for, outcome_problems
from slurmft.journal import read_events

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "journal"


def outcome(fault, **kw) -> Outcome:
    base = dict(fault=fault.name, detail="", injected=0.0, detected_as=sorted(fault.causes)[0],
                detect_s=2.0, running_s=6.0, back_s=15.0, last_step=23, resumed_step=20,
                world_size=3, nodes=["n1", "n2", "n4"], expected=True, committed_before=[15, 20])
    base.update(kw)
    return Outcome(**base)


problems = outcome_problems


def test_a_clean_recovery_has_no_problem_and_counts_its_lost_steps():
    o = outcome(faults.CRASH)
    assert problems(o) == [] and o.lost_steps == 3


def test_resuming_older_than_the_newest_intact_checkpoint_is_a_problem():
    assert "older than the newest intact 20" in problems(outcome(faults.CRASH, resumed_step=15))[0]


def test_a_corrupted_checkpoint_must_be_skipped_for_the_one_before():
    fine = outcome(faults.CORRUPT_NEWEST, corrupted=20, resumed_step=15)
    assert problems(fine) == []
    loaded = outcome(faults.CORRUPT_NEWEST, corrupted=20, resumed_step=20)
    assert "not from the checkpoint before the corrupted 20" in problems(loaded)[0]


def test_a_node_fault_must_exclude_its_node_and_not_run_there_again():
    o = outcome(faults.NODE_DEATH, detected_as="node_fail", victim="n3", excluded=["n3"])
    assert problems(o) == []
    kept = outcome(faults.NODE_DEATH, detected_as="node_fail", victim="n3", nodes=["n1", "n3", "n4"])
    assert sorted(problems(kept)) == ["n3, the node the fault hit, was not excluded",
                                      "running again on n3, the node the fault hit"]


def test_wrong_cause_slow_restart_and_lost_work_after_a_time_limit_are_problems():
    assert problems(outcome(faults.HANG, detected_as="crash", expected=False)) == ["detected as crash"]
    assert "running again after 120" in problems(outcome(faults.CRASH, running_s=120.0))[0]
    assert "2 steps lost" in problems(outcome(faults.TIME_LIMIT, last_step=22, resumed_step=20))[0]


def test_the_launchers_own_requeue_excludes_the_node_when_slurm_shows_it_excluded():
    """The 01:05 soak flagged "n4 ... was not excluded" for each requeue the launcher made with no
    spare left: it read only the watcher's exclusions and the allocation's fences."""
    events = read_events(FIXTURES / "soak_self_requeue.events.jsonl")
    excluded = excluded_for(events, lambda: ("n3", "n4"))
    assert excluded == ["n4", "n3"]
    o = outcome(faults.NODE_DEATH, detected_as="node_silent", victim="n4",
                nodes=["n1", "n2", "n5", "n6"], excluded=excluded)
    assert problems(o) == []
    # Slurm does not show the launcher's exclusion (its ExcNodeList update failed): not excluded.
    assert excluded_for(events, lambda: ("n3",)) == ["n3"]
    # Without a requeue of the launcher's in the window Slurm is not asked.
    assert excluded_for(events[2:], lambda: pytest.fail("Slurm asked")) == ["n3"]
