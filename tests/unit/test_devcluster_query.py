"""Parsing what scontrol/squeue print, on output captured from a real devcluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.slurm.devcluster.query import parse_jobs, parse_node_state, parse_nodes

FIXTURES = Path(__file__).parent.parent / "fixtures" / "devcluster"


def test_idle_completing_and_drained_nodes() -> None:
    nodes = parse_nodes((FIXTURES / "scontrol_show_node.idle_drain.txt").read_text())
    assert [n.describe() for n in nodes.values()] == ["IDLE", "IDLE+COMPLETING", "IDLE+DRAIN"]
    assert nodes["n1"].idle and not nodes["n2"].idle and not nodes["n3"].idle
    assert nodes["n3"].reason == "slurmft: test reason [root@2026-11-22T22:32:32]"


def test_a_node_the_backfill_planned_for_a_job_that_has_ended_is_idle() -> None:
    nodes = parse_nodes((FIXTURES / "scontrol_show_node.planned.txt").read_text())
    assert [n.describe() for n in nodes.values()] == ["IDLE+PLANNED", "IDLE+PLANNED", "IDLE", "IDLE"]
    assert all(n.idle for n in nodes.values())


def test_killed_node_is_down_and_not_responding() -> None:
    nodes = parse_nodes((FIXTURES / "scontrol_show_node.down.txt").read_text())
    assert nodes["n1"].state == "DOWN" and nodes["n1"].flags == {"NOT_RESPONDING"}
    assert nodes["n1"].reason.startswith("Not responding")


@pytest.mark.parametrize("text, state, flags", [
    ("IDLE", "IDLE", set()),
    ("MIXED*", "MIXED", {"NOT_RESPONDING"}),
    ("DOWN*+DRAIN", "DOWN", {"NOT_RESPONDING", "DRAIN"}),
    ("ALLOCATED+COMPLETING", "ALLOCATED", {"COMPLETING"}),
])
def test_state_strings(text: str, state: str, flags: set[str]) -> None:
    assert parse_node_state(text) == (state, frozenset(flags))


def test_jobs() -> None:
    jobs = parse_jobs("7|wrap|RUNNING|0:03|n2|n2\n8|my job|PENDING|0:00||(Resources)\n")
    assert [(j.job_id, j.name, j.state, j.reason) for j in jobs] == [
        ("7", "wrap", "RUNNING", "n2"), ("8", "my job", "PENDING", "(Resources)")]
